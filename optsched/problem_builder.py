"""Turn a captured graph plus a device profile into a torch-free `Problem`."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.fx as fx

from .costs import DeviceProfile, NodeCosts, node_time
from .joint_graph import JointGraph
from .solvers.problem import Op, Phase, Problem, Tensor, TensorKind

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


@functools.cache
def out_variant(target: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, str] | None:
    """The out= overload of an elementwise op with the same inputs, and its out argument's name."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.pointwise not in target.tags:
        return None
    want = [(a.name, str(a.type)) for a in target._schema.arguments]
    packet = target.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        outs = [a for a in args if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only]
        if len(outs) != 1 or len(cand._schema.returns) != 1:
            continue
        if [(a.name, str(a.type)) for a in args if a is not outs[0]] == want:
            return cand, outs[0].name
    return None


def reuse_candidates(jg: JointGraph) -> dict[str, fx.Node]:
    """Per compute node that could write into a dying input, the first such input (to test its out= form on)."""
    out = {}
    for node in jg.compute:
        pairs = _reuse_pairs(jg, node, jg.outputs_of[node])
        if pairs:
            out[node.name] = pairs[0][2]
    return out


def _reuse_pairs(jg: JointGraph, node: fx.Node, outs: list[int]) -> list[tuple[int, int, fx.Node]]:
    """Inputs whose storage this op could write its output into: same layout, covering the whole storage."""
    if len(outs) != 1 or out_variant(node.target) is None:
        return []
    out_val = node.meta["val"]
    pairs = []
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        s = jg.storage_of.get(a)
        if (
            isinstance(v, torch.Tensor)
            and s is not None
            and jg.storages[s].kind is TensorKind.ACTIVATION
            and v.shape == out_val.shape
            and v.dtype == out_val.dtype
            and v.stride() == out_val.stride()
            and v.storage_offset() == 0
            and jg.storages[s].nbytes == jg.storages[outs[0]].nbytes == v.numel() * v.element_size()
        ):
            pairs.append((outs[0], s, a))
    return pairs


def _dense(v: torch.Tensor) -> bool:
    """Its elements tile a block of numel elements exactly: some permutation of it is contiguous."""
    expected = 1
    for size, stride in sorted((d for d in zip(v.shape, v.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def offloadable_storages(jg: JointGraph) -> set[int]:
    """Activations one strided copy can move whole: their only non-view holder covers the storage densely."""
    holders: dict[int, int] = {}
    for node, s in jg.storage_of.items():
        if not jg.is_view(node):
            holders[s] = holders.get(s, 0) + 1
    out = set()
    for s in jg.storages:
        v = s.node.meta.get("val")
        if (
            s.kind is TensorKind.ACTIVATION
            and holders.get(s.index) == 1
            and isinstance(v, torch.Tensor)
            and v.storage_offset() == 0
            and _dense(v)
            and v.numel() * v.element_size() == s.nbytes
        ):
            out.add(s.index)
    return out


def build_problem(
    jg: JointGraph,
    profile: DeviceProfile,
    name: str = "step",
    measured: NodeCosts | None = None,
    offload: bool = False,
    host_budget_bytes: int | None = None,
) -> Built:
    """Ops in program order (forward, then backward).

    With `measured` (from running the graph on the device), op times, kernel scratch
    space and in-place out= forms come from there. Without it times are the profile's
    roofline, scratch space is unknown (0) and no op writes into its inputs, since
    nothing verified that its out= form does so without a temporary.
    `offload`: activations may go to host memory at the profile's host bandwidth.
    """
    movable = offloadable_storages(jg)
    tensors = [Tensor(s.index, s.node.name, s.nbytes, s.kind, offloadable=s.index in movable) for s in jg.storages]
    ops: list[Op] = []
    nodes: list[fx.Node] = []
    order = [n for n in jg.compute if jg.phase[n] is Phase.FW] + [n for n in jg.compute if jg.phase[n] is Phase.BW]
    for node in order:
        oid = len(ops)
        outs = jg.outputs_of[node]
        for s in outs:
            tensors[s] = dataclasses.replace(tensors[s], producer=oid)
        reads = tuple(s for s in jg.arg_storages(node) if s not in outs)
        ops.append(
            Op(
                id=oid,
                name=node.name,
                phase=jg.phase[node],
                inputs=reads,
                outputs=tuple(outs),
                time_s=measured.times[node.name] if measured and node.name in measured.times else node_time(node, profile),
                recomputable=jg.phase[node] is Phase.FW and bool(outs) and is_recomputable(node),
                reuse=tuple((o, i) for o, i, _ in _reuse_pairs(jg, node, outs))
                if measured and measured.reuse_ok.get(node.name)
                else (),
                workspace_bytes=measured.workspace.get(node.name, 0) if measured else 0,
            )
        )
        nodes.append(node)
    outputs = set()
    for o in jg.fw_outputs + jg.bw_outputs:
        if isinstance(o, fx.Node):
            outputs.update(jg.node_storages(o))
    problem = Problem(
        ops, tensors, frozenset(outputs), name=name,
        host_bw=profile.host_bw if offload else 0.0, host_budget_bytes=host_budget_bytes if offload else None,
    )
    return Built(problem, nodes)
