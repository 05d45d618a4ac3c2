"""Lower a schedule back into executable fx programs.

Forward: primals -> (*forward outputs, *saved). Backward: (*saved, *tangents) ->
gradients, with each recomputed op emitted where the schedule puts it (just
before its first use). Both run in the planned order. fx frees every value right
after its last use; the boxed calling convention (the callee receives the list of
arguments and clears it) lets saved tensors die inside the backward too.

Views allocate nothing, so they are not scheduled: each program re-emits a view
where it is first needed, from whatever holds its base there.

Offloaded activations go through an OffloadRuntime, called from both programs at
the steps the simulator timed: the forward starts the copy out right after the
producer and drops the device copy at its release step, then hands the host copy
to the backward as a saved tensor; the backward issues the copy back at the
prefetch step and waits for it just before the first reader.

The backward runs once per forward: it frees saved tensors and may write into them, so it
refuses to run for a graph kept for another backward (`refuse_kept_graph`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from ..executors.groups import Group
from ..capture.joint_graph import JointGraph
from ..capture.output_usage import zeros_if_missing
from .offload_runtime import OffloadRuntime, SlotSpec
from ..passes.op_variants import inplace_foreach, out_variant
from ..costs.problem_builder import is_foreach_reuse
from ..solvers.model.offload_sim import OffloadEvent
from ..solvers.model.problem import Problem, Schedule
from .._torch import (  # SavedForBackwardsAOTOutput labels outputs for AOTAutograd's own tooling: None where missing
    BoxedCodeGen, SavedForBackwardsAOTOutput, current_graph_task_id, get_current_graph_task_keep_graph)


class KeptGraphError(RuntimeError):
    """A planned backward asked to keep its graph (`retain_graph=True`, `create_graph=True`)."""


KEPT_GRAPH_MESSAGE = (
    "optsched: a planned training step's backward runs once per forward, and retain_graph=True or "
    "create_graph=True (in backward() or torch.autograd.grad()) keeps the graph for another backward, which "
    "would need the saved activations again. The planned backward frees each saved activation at its last "
    "use and may write gradients into it: that is how the step keeps within its memory budget. Fix: call "
    "backward() once per forward (sum the losses first: (loss_a + loss_b).backward(), or run the forward "
    "again for another backward); for gradients of gradients (create_graph=True, a gradient penalty), run "
    "that step without optimize()"
)


@fx.node.has_side_effect
def refuse_kept_graph() -> None:
    """The backward's first step: raise KeptGraphError when the autograd engine keeps the graph (run outside
    the engine, by a test or a profiler, there is no graph to keep)."""
    if current_graph_task_id() != -1 and get_current_graph_task_keep_graph():
        raise KeptGraphError(KEPT_GRAPH_MESSAGE)


class _Program:
    """One fx graph under construction, resolving original nodes to new ones on demand."""

    def __init__(self, jg: JointGraph, resolve_missing: Callable[[fx.Node], fx.Node]):
        self.jg = jg
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.resolve_missing = resolve_missing

    def placeholder(self, node: fx.Node) -> fx.Node:
        new = self.new_placeholder(node.name)
        new.meta = dict(node.meta)
        self.env[node] = new
        return new

    def new_placeholder(self, name: str) -> fx.Node:
        """A placeholder whose argument name is its node name. fx renames a placeholder whose name is
        taken (the backward makes its saved-tensor placeholders as values are first read, after other
        nodes have their names) but keeps the requested name as its target, the generated function's
        parameter, then binds `node_name = target` at the top of the body in placeholder order. With a
        name taken, one such line can overwrite another placeholder's parameter before that one is read
        (`getitem_7 = getitem; getitem_14 = getitem_7`): the second placeholder receives the first's
        tensor. With target and name equal there are no such lines."""
        new = self.graph.placeholder(name)
        new.target = new.name
        return new

    def value(self, node: fx.Node) -> fx.Node:
        if node in self.env:
            return self.env[node]
        if node.op == "get_attr":  # a constant of the captured module, which roots the lowered one
            new = self.graph.get_attr(node.target)
            new.meta = dict(node.meta)
            self.env[node] = new
            return new
        if self.jg.is_view(node):
            for a in node.all_input_nodes:
                self.value(a)
            return self._copy(node)
        if node.target is operator.getitem and node.args[0] in self.env:
            return self._copy(node)
        return self.resolve_missing(node)

    def emit(self, node: fx.Node | Group, into: int | None = None) -> None:
        """Emit a compute node and, at once, every getitem of it (so no tuple outlives its items),
        or a fusion group as one call to its kernel.

        `into`: a storage, read by this node and dead after it, to write the output into.
        """
        if isinstance(node, Group):
            self._emit_group(node)
            return
        for a in node.all_input_nodes:
            self.value(a)
        if into is None:
            self._copy(node)
        elif is_foreach_reuse(node):
            self._emit_foreach_in_place(node)
            return
        else:
            self._emit_into(node, into)
        for g in self.jg.getitems.get(node, []):
            self._copy(g)

    def _emit_foreach_in_place(self, node: fx.Node) -> None:
        """The foreach op's in-place twin on its first list (all dying here): output i is element i."""
        xs = [self.value(x) for x in node.args[0]]
        args = (xs, *fx.map_arg(node.args[1:], self.value))
        new = self.graph.call_function(inplace_foreach(node.target), args, fx.map_arg(node.kwargs, self.value))
        new.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        for g, x in zip(self.jg.getitems.get(node, []), xs, strict=True):
            self.env[g] = x

    def _emit_group(self, group: Group) -> None:
        args = tuple(self.value(n) for n in group.inputs)
        call = self.graph.call_function(group.kernel, args)
        call.meta["fusion_group"] = group  # what the kernel computes and writes, for readers of the program
        for i, out in enumerate(group.outputs):
            # named after the value it stands for, as a node_copy would be (readable programs)
            item = self.graph.create_node("call_function", operator.getitem, (call, i), name=out.name)
            item.meta = dict(out.meta)
            self.env[out] = item
        for member, dest in group.writes.items():
            self.env[member] = self.value(dest)

    def _emit_into(self, node: fx.Node, storage: int) -> None:
        overload, out_name = out_variant(node.target)
        dest = next(a for a in node.all_input_nodes if self.jg.storage_of.get(a) == storage)
        args = fx.map_arg(node.args, self.value)
        kwargs = {**fx.map_arg(node.kwargs, self.value), out_name: self.value(dest)}
        new = self.graph.call_function(overload, args, kwargs)
        new.meta = dict(node.meta)
        self.env[node] = new

    def _copy(self, node: fx.Node) -> fx.Node:
        new = self.graph.node_copy(node, lambda a: self.value(a))
        self.env[node] = new
        return new

    def output(self, values: list, descs: list | None) -> None:
        """`values`: original nodes (resolved here), nodes of this program, or constants."""
        out = self.graph.output(
            tuple(self.value(v) if isinstance(v, fx.Node) and v.graph is not self.graph else v for v in values)
        )
        if descs is not None and len(descs) == len(values):
            out.meta["desc"] = descs


def _output_descs(jg: JointGraph) -> list:
    (out,) = jg.gm.graph.find_nodes(op="output")
    descs = out.meta.get("desc")
    return list(descs) if isinstance(descs, (list, tuple)) else []


def lower_inference(
    jg: JointGraph, built_nodes: list[fx.Node | Group], schedule: Schedule, reused: dict[int, int]
) -> fx.GraphModule:
    """A forward-only program in the planned order."""
    prog, _host = _forward(jg, built_nodes, schedule, reused)
    prog.output(jg.fw_outputs, _output_descs(jg) or None)
    return _module(jg, prog.graph)


def _forward(
    jg: JointGraph,
    built_nodes: list[fx.Node | Group],
    schedule: Schedule,
    reused: dict[int, int],
    offloads: dict[int, OffloadEvent] | None = None,
    runtime: OffloadRuntime | None = None,
    slots: dict[int, int] | None = None,
) -> tuple[_Program, dict[int, fx.Node]]:
    """The primals, then the forward ops in the planned order (the output is left to the caller).

    Returns the program and, per offloaded storage, the node holding its host copy.
    """

    def missing(node: fx.Node) -> fx.Node:
        raise RuntimeError(f"{node.name} is used before it is computed in the planned forward order")

    prog = _Program(jg, missing)
    for p in jg.primals:
        prog.placeholder(p)
    offloads = offloads or {}
    made_at: dict[int, list[int]] = {}
    release_at: dict[int, list[int]] = {}
    for t, ev in sorted(offloads.items()):
        made_at.setdefault(ev.produced, []).append(t)
        release_at.setdefault(ev.release, []).append(t)
    bufs = prog.graph.call_function(runtime.acquire, ()) if offloads else None
    copying: dict[int, fx.Node] = {}
    host: dict[int, fx.Node] = {}
    n_fw = len(schedule.fw_order)
    for k, o in enumerate(schedule.fw_order):
        for t in release_at.get(k, []):
            host[t] = prog.graph.call_function(runtime.release, (copying.pop(t),))
        prog.emit(built_nodes[o], reused.get(k))
        for t in made_at.get(k, []):
            value = prog.value(jg.storages[t].node)
            copying[t] = prog.graph.call_function(runtime.offload, (bufs, value, slots[t]))
    for t in release_at.get(n_fw, []):
        host[t] = prog.graph.call_function(runtime.release, (copying.pop(t),))
    return prog, host


def lower_training(
    jg: JointGraph,
    problem: Problem,
    built_nodes: list[fx.Node | Group],
    schedule: Schedule,
    reused: dict[int, int],
    offloads: dict[int, OffloadEvent] | None = None,
    make_runtime: Callable[[list[SlotSpec]], OffloadRuntime] | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule, list[fx.Node]]:
    """Forward and backward modules for AOTAutograd, and the original nodes saved between them.

    `reused` maps a step (forward steps first, then backward) to the input storage its
    output is written into, as the simulator decided. `offloads` (from the simulator)
    are run by the runtime `make_runtime` builds for their slots.

    The backward is built first: what it reads from the forward decides what the forward saves.
    """
    offloads = offloads or {}
    runtime, slots = _offload_runtime(jg, offloads, make_runtime)
    bw = _Backward(jg, _recomputed_nodes(problem, built_nodes, schedule), offloads, runtime)
    bw.build(built_nodes, schedule, reused)
    fw, host = _forward(jg, built_nodes, schedule, reused, offloads, runtime, slots)
    _forward_output(jg, fw, bw.saved, host, offloads, bw.saved_symbols)
    return _module(jg, fw.graph), _module(jg, bw.prog.graph), bw.saved


def _offload_runtime(
    jg: JointGraph,
    offloads: dict[int, OffloadEvent],
    make_runtime: Callable[[list[SlotSpec]], OffloadRuntime] | None,
) -> tuple[OffloadRuntime | None, dict[int, int]]:
    """The runtime for the plan's offloads (None without any), and each offloaded storage's slot
    in it (storages in id order)."""
    if not offloads:
        return None, {}
    if make_runtime is None:
        raise ValueError("a plan with offloads needs an offload runtime")
    order = sorted(offloads)
    return make_runtime([_slot_spec(jg, t) for t in order]), {t: i for i, t in enumerate(order)}


def _recomputed_nodes(problem: Problem, built_nodes: list[fx.Node | Group], schedule: Schedule) -> set[fx.Node]:
    """The original nodes the backward recomputes (a recomputed fusion group: all its members)."""
    recomputed: set[fx.Node] = set()
    for o in schedule.recomputed(problem):
        item = built_nodes[o]
        recomputed.update(item.nodes if isinstance(item, Group) else [item])
    return recomputed


class _Backward:
    """The backward program, built in the planned backward order. A forward value it reads and
    does not recompute crosses as a saved tensor (a placeholder, in first-read order) or, when
    offloaded, comes back from the host: prefetched at its planned step, waited for at its first
    reader. `saved`: the original nodes behind the placeholders, the forward's extra outputs."""

    def __init__(
        self,
        jg: JointGraph,
        recomputed: set[fx.Node],
        offloads: dict[int, OffloadEvent],
        runtime: OffloadRuntime | None,
    ):
        self.jg = jg
        self.recomputed = recomputed
        self.offloads = offloads
        self.runtime = runtime
        self.saved: list[fx.Node] = []
        self.placeholders: list[fx.Node] = []
        self.saved_symbols: list[fx.Node] = []  # SymInts and SymFloats (a module's int attribute traced as an input)
        self.symbol_placeholders: list[fx.Node] = []
        self.fetching: dict[int, fx.Node] = {}  # offloaded storage -> its prefetch, until first read
        self.prog = _Program(jg, self._from_forward)
        self.tangent_ph: dict[fx.Node, fx.Node] = {}  # original tangent -> its placeholder (None: no gradient came)
        self.from_tangents = set(jg.tangents)  # the tangents and every view of one, made anew for each reader
        for n in jg.gm.graph.nodes:
            if jg.is_view(n) and any(a in self.from_tangents for a in n.all_input_nodes):
                self.from_tangents.add(n)

    def build(self, built_nodes: list[fx.Node | Group], schedule: Schedule, reused: dict[int, int]) -> None:
        """Tangents, then the backward ops in order with each prefetch at its step, then the
        gradients; placeholders moved to the top (saved and host copies, then tangents)."""
        jg = self.jg
        tangent_ph = [self.prog.placeholder(t) for t in jg.tangents]
        for t in jg.tangents:
            self.tangent_ph[t] = self.prog.env.pop(t)  # read through zeros_if_missing (`_tangent`)
        self.prog.graph.call_function(refuse_kept_graph, ())
        n_fw = len(schedule.fw_order)
        fetch_at: dict[int, list[int]] = {}
        for t, ev in sorted(self.offloads.items()):
            fetch_at.setdefault(ev.prefetch, []).append(t)
        for j, o in enumerate(schedule.bw_order):
            for t in fetch_at.get(n_fw + j, []):
                self._prefetch(t)
            for n in self.from_tangents:  # each op reads its own zero of a missing tangent, dead after it
                self.prog.env.pop(n, None)
            self.prog.emit(built_nodes[o], reused.get(n_fw + j))
        if self.fetching:
            raise RuntimeError(f"{len(self.fetching)} offloaded tensors are prefetched but never read")
        self.prog.output(jg.bw_outputs, _output_descs(jg)[jg.num_fwd_outputs :] or None)
        # AOTAutograd's order: saved symbols, saved tensors, tangents (the forward returns the symbols last)
        _move_placeholders_first(self.prog.graph, self.symbol_placeholders + self.placeholders + tangent_ph)

    def _prefetch(self, storage: int) -> None:
        """The offloaded storage's host copy crosses as a saved tensor; its copy back starts here."""
        node = self.jg.storages[storage].node
        host_ph = self._saved_placeholder(node, f"{node.name}_host")
        self.fetching[storage] = self.prog.graph.call_function(self.runtime.prefetch, (host_ph,))

    def _saved_placeholder(self, node: fx.Node, name: str) -> fx.Node:
        self.saved.append(node)
        new = self.prog.new_placeholder(name)
        new.meta = dict(node.meta)
        self.placeholders.append(new)
        return new

    def _tangent(self, node: fx.Node) -> fx.Node:
        """A tangent as the op about to be emitted reads it: the gradient that came, or where none came (an
        output the caller did not differentiate), zeros broadcast from one element made here and dead after
        this op, as eager autograd holds nothing for such an output (the plan counts the element as each
        reader's workspace: costs/problem_builder)."""
        v = node.meta["val"]
        new = self.prog.graph.call_function(zeros_if_missing, (self.tangent_ph[node], tuple(v.shape), v.dtype, v.device))
        new.meta = dict(node.meta)
        self.prog.env[node] = new
        return new

    def _from_forward(self, node: fx.Node) -> fx.Node:
        """A forward value the backward reads and does not recompute: it crosses as a saved tensor,
        or, if offloaded, comes back from the host here, at its first reader. A tangent: `_tangent`."""
        if node in self.tangent_ph:
            return self._tangent(node)
        owner = node.args[0] if node.target is operator.getitem else node
        if owner in self.recomputed:
            raise RuntimeError(f"{node.name} is read in the backward before its recomputation")
        storage = self.jg.storage_of.get(node)
        if storage in self.offloads:
            if storage not in self.fetching or self.jg.storages[storage].node is not node:
                raise RuntimeError(f"{node.name} is read in the backward before its prefetch")
            new = self.prog.graph.call_function(self.runtime.wait, (self.fetching.pop(storage),))
        elif isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
            self.saved_symbols.append(node)
            new = self.prog.new_placeholder(node.name)
            new.meta = dict(node.meta)
            self.symbol_placeholders.append(new)
        else:
            if not isinstance(node.meta.get("val"), torch.Tensor):
                raise RuntimeError(f"{node.name} is not a tensor and cannot be saved")
            new = self._saved_placeholder(node, node.name)
        self.prog.env[node] = new
        return new


def _forward_output(
    jg: JointGraph,
    fw: _Program,
    saved: list[fx.Node],
    host: dict[int, fx.Node],
    offloads: dict[int, OffloadEvent],
    symbols: list[fx.Node] = (),
) -> None:
    """The forward's output: its own outputs, then what the backward saves, in the backward's
    placeholder order (an offloaded storage as its host copy), then the symbols it saves, labelled for AOTAutograd."""
    descs = _output_descs(jg)[: jg.num_fwd_outputs]
    if descs and SavedForBackwardsAOTOutput is not None:
        descs = descs + [SavedForBackwardsAOTOutput(i) for i in range(len(saved) + len(symbols))]
    else:
        descs = None
    crossing = []
    for node in saved:
        storage = jg.storage_of.get(node)
        crossing.append(host.pop(storage) if storage in offloads and storage in host else node)
    fw.output(list(jg.fw_outputs) + crossing + list(symbols), descs)


def _slot_spec(jg: JointGraph, storage: int) -> SlotSpec:
    v = jg.storages[storage].node.meta["val"]
    return SlotSpec(tuple(v.shape), tuple(v.stride()), v.dtype)


def _move_placeholders_first(graph: fx.Graph, ordered: list[fx.Node]) -> None:
    """Placeholders were created as values were first needed; put them at the top, in order."""
    head = next(iter(graph.nodes))
    for ph in reversed(ordered):
        if ph is not head:
            head.prepend(ph)
        head = ph


def _module(jg: JointGraph, graph: fx.Graph) -> fx.GraphModule:
    graph.lint()
    return fx.GraphModule(jg.gm, graph)


def boxed(gm: fx.GraphModule) -> Callable:
    """Compile `gm` to take its arguments as a list that it clears, so nothing holds them past their last use."""
    gm.graph.set_codegen(BoxedCodeGen())
    gm.recompile()

    def run(args: list):
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    run.graph_module = gm  # type: ignore[attr-defined]
    return run


__all__ = ["KEPT_GRAPH_MESSAGE", "KeptGraphError", "boxed", "lower_inference", "lower_training"]
