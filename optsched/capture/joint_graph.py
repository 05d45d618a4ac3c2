"""Our view of an AOTAutograd graph: storages, compute nodes, views, phases.

The joint graph holds every forward and backward node. Memory lives in storages,
not in nodes: a view (or a getitem of a list of views) shares its base's storage,
so it allocates nothing and keeps the base alive. Compute nodes are the ones that
allocate (or mutate); they become the ops of the planning problem.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .._torch import tree_leaves
from ..solvers.model.problem import Phase, TensorKind


@dataclass
class Storage:
    index: int
    nbytes: int
    kind: TensorKind
    node: fx.Node  # the node that first holds it (placeholder, compute node or getitem)


@dataclass
class JointGraph:
    gm: fx.GraphModule
    num_fwd_outputs: int
    primals: list[fx.Node]
    tangents: list[fx.Node]
    fw_outputs: list  # fx.Node or None / constants
    bw_outputs: list
    storages: list[Storage] = field(default_factory=list)
    storage_of: dict[fx.Node, int] = field(default_factory=dict)
    compute: list[fx.Node] = field(default_factory=list)  # in program order
    phase: dict[fx.Node, Phase] = field(default_factory=dict)
    outputs_of: dict[fx.Node, list[int]] = field(default_factory=dict)  # compute node -> storages it allocates
    getitems: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # compute node -> its getitem users

    @property
    def is_training(self) -> bool:
        return bool(self.tangents)

    def is_view(self, node: fx.Node) -> bool:
        return node.op == "call_function" and node not in self.outputs_of and not self._is_getitem_of_compute(node)

    def _is_getitem_of_compute(self, node: fx.Node) -> bool:
        return node.target is operator.getitem and node.args[0] in self.outputs_of

    def node_storages(self, node: fx.Node) -> list[int]:
        """Storages a node's value reads from (for tuple values: all elements)."""
        if node in self.storage_of:
            return [self.storage_of[node]]
        out = []
        for g in self.getitems.get(node, []):
            out += self.node_storages(g)
        return out

    def arg_storages(self, node: fx.Node) -> list[int]:
        seen: dict[int, None] = {}
        for a in tree_leaves((node.args, node.kwargs)):
            if isinstance(a, fx.Node):
                for s in self.node_storages(a):
                    seen[s] = None
        return list(seen)


def _tensor_val(node: fx.Node) -> torch.Tensor | None:
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _storage_key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _is_mutating(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _output_nodes(gm: fx.GraphModule) -> list:
    (out,) = gm.graph.find_nodes(op="output")
    return list(tree_leaves(out.args[0]))


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def build_joint_graph(gm: fx.GraphModule, num_fwd_outputs: int | None = None, *, freed_tangents: bool = False) -> JointGraph:
    """Index `gm` (a joint graph from the partition hook, or an inference graph when
    `num_fwd_outputs` is None) by storage and phase. `freed_tangents`: the backward takes its tangents
    over from the autograd engine (capture/tangent_handover.py), so they die at their last use."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    tangents = [p for p in placeholders if "tangents" in p.name]
    primals = [p for p in placeholders if p not in tangents]
    outs = _output_nodes(gm)
    if num_fwd_outputs is None:
        num_fwd_outputs = len(outs)
    jg = JointGraph(gm, num_fwd_outputs, primals, tangents, outs[:num_fwd_outputs], outs[num_fwd_outputs:])
    by_key: dict[StorageWeakRef, int] = {}

    def storage_for(node: fx.Node, t: torch.Tensor, kind: TensorKind) -> tuple[int, bool]:
        key = _storage_key(t)
        if key in by_key:
            return by_key[key], False
        by_key[key] = len(jg.storages)
        jg.storages.append(Storage(len(jg.storages), t.untyped_storage().nbytes(), kind, node))
        return by_key[key], True

    for p in placeholders:
        t = _tensor_val(p)
        if t is not None:
            # a 0-dim seed is a loss's: `loss.backward()` itself holds it (autograd makes it before the engine runs)
            seed = TensorKind.TANGENT_FREED if freed_tangents and t.dim() > 0 else TensorKind.TANGENT
            kind = seed if p in tangents else TensorKind.INPUT
            jg.storage_of[p], _ = storage_for(p, t, kind)
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # a constant the graph module holds (torch.tensor(...) in traced code)
            t = _tensor_val(node)
            if t is None and isinstance(value := _attr(gm, node.target), torch.Tensor):
                t = value
            if t is not None:
                jg.storage_of[node], _ = storage_for(node, t, TensorKind.INPUT)
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            continue  # handled with its parent
        allocated: list[int] = []
        t = _tensor_val(node)
        if t is not None:
            s, new = storage_for(node, t, TensorKind.ACTIVATION)
            jg.storage_of[node] = s
            if new:
                allocated.append(s)
        else:
            items = [u for u in node.users if u.target is operator.getitem]
            jg.getitems[node] = sorted(items, key=lambda u: u.args[1])
            for g in jg.getitems[node]:
                gt = _tensor_val(g)
                if gt is None:
                    continue
                s, new = storage_for(g, gt, TensorKind.ACTIVATION)
                jg.storage_of[g] = s
                if new:
                    allocated.append(s)
        if allocated or _is_mutating(node) or t is None and not jg.getitems.get(node):
            jg.outputs_of[node] = allocated
            jg.compute.append(node)
    _assign_phases(jg)
    return jg


def _assign_phases(jg: JointGraph) -> None:
    """Forward = everything the forward outputs and the forward's own input mutations
    (buffer updates such as BatchNorm's running stats) depend on; the rest runs in the backward."""
    if not jg.is_training:
        for n in jg.compute:
            jg.phase[n] = Phase.FW
        return
    from_tangents: set[fx.Node] = set(jg.tangents)
    for n in jg.gm.graph.nodes:
        if any(a in from_tangents for a in n.all_input_nodes):
            from_tangents.add(n)
    needed: set[fx.Node] = set()
    stack = [o for o in jg.fw_outputs if isinstance(o, fx.Node)]
    stack += [n for n in jg.compute if _is_mutating(n) and n not in from_tangents]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(a for a in n.all_input_nodes)
    for n in jg.compute:
        jg.phase[n] = Phase.FW if n in needed else Phase.BW
