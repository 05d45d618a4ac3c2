"""Turn a captured graph plus a device profile into a torch-free `Problem`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .costs import DeviceProfile, node_time
from .joint_graph import JointGraph
from .solvers.problem import Op, Phase, Problem, Tensor

_SDPA = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}


@dataclass
class Built:
    problem: Problem
    nodes: list[fx.Node]  # op id -> compute node


def _dropout_p(node: fx.Node) -> float:
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in node.kwargs:
                return float(node.kwargs[arg.name])
            return float(node.args[i]) if i < len(node.args) else float(arg.default_value or 0.0)
    return 0.0


def is_recomputable(node: fx.Node) -> bool:
    """Deterministic, non-mutating ops only: recomputing a random op would change its values."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        # attention kernels carry the tag for their dropout; without dropout they are deterministic
        return target.overloadpacket.__name__ in _SDPA and _dropout_p(node) == 0.0
    return True


def build_problem(jg: JointGraph, profile: DeviceProfile, name: str = "step") -> Built:
    tensors = [Tensor(s.index, s.node.name, s.nbytes, s.kind) for s in jg.storages]
    ops: list[Op] = []
    nodes: list[fx.Node] = []
    order = [n for n in jg.compute if jg.phase[n] is Phase.FW] + [n for n in jg.compute if jg.phase[n] is Phase.BW]
    for node in order:
        oid = len(ops)
        outs = jg.outputs_of[node]
        for s in outs:
            tensors[s] = Tensor(s, tensors[s].name, tensors[s].bytes, tensors[s].kind, oid)
        reads = tuple(s for s in jg.arg_storages(node) if s not in outs)
        ops.append(
            Op(
                id=oid,
                name=node.name,
                phase=jg.phase[node],
                inputs=reads,
                outputs=tuple(outs),
                time_s=node_time(node, profile),
                recomputable=jg.phase[node] is Phase.FW and bool(outs) and is_recomputable(node),
            )
        )
        nodes.append(node)
    outputs = set()
    for o in jg.fw_outputs + jg.bw_outputs:
        if isinstance(o, fx.Node):
            outputs.update(jg.node_storages(o))
    return Built(Problem(ops, tensors, frozenset(outputs), name=name), nodes)
