"""Turn a captured graph plus a device profile into a torch-free `Problem`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .cuda_allocator import (
    CUBLAS_OPS, CUBLASLT_OPS, AllocatorConfig, ThreadUse, addmm_uses_cublaslt, allocated_bytes, persistent_allocations,
)
from .cuda_reduce import ReduceScratch, reduce_scratch
from .profiles import DeviceProfile, NodeCosts, compute_capability, multiprocessors, node_flops, node_time
from ..passes.chunked_ce import KERNELS_PER_CHUNK, OP as CHUNKED_CE
from ..capture.joint_graph import JointGraph, Storage
from .sdpa_prediction import host_outputs
from ..passes.op_variants import inplace_foreach, out_variant
from ..optim.in_graph import is_update
from ..capture.output_usage import OutputUsage, tangent_outputs
from ..solvers.model import clock
from ..solvers.model.problem import Op, Phase, Problem, Tensor, TensorKind
from .._torch import INPUT_MUTATION_AOT_OUTPUT, BlasBackend, OpOverload

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
    if not isinstance(target, OpOverload):
        return False
    if target._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        # attention kernels carry the tag for their dropout; without dropout they are deterministic
        return target.overloadpacket.__name__ in _SDPA and _dropout_p(node) == 0.0
    return True


def reuse_candidates(jg: JointGraph) -> dict[str, fx.Node | list[fx.Node]]:
    """Per compute node that could write into dying inputs, what to test its out= form on: the first
    such input, or for a foreach op the list it would update in place."""
    out: dict[str, fx.Node | list[fx.Node]] = {}
    for node in jg.compute:
        if is_foreach_reuse(node):
            if _foreach_reuse_pairs(jg, node):
                out[node.name] = list(node.args[0])
            continue
        pairs = _reuse_pairs(jg, node, jg.outputs_of[node])
        if pairs:
            out[node.name] = pairs[0][2]
    return out


def is_foreach_reuse(node: fx.Node) -> bool:
    """A functional foreach op whose in-place twin updates its first list: it reuses that list or nothing."""
    return inplace_foreach(node.target) is not None and bool(node.args) and isinstance(node.args[0], (list, tuple))


def _fits(jg: JointGraph, a: fx.Node, out: int, out_val: torch.Tensor) -> int | None:
    """`a`'s storage when `out` (of value `out_val`) could be written into it: an activation of the same
    layout, covering the whole storage."""
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
        and jg.storages[s].nbytes == jg.storages[out].nbytes == v.numel() * v.element_size()
    ):
        return s
    return None


def _reuse_pairs(jg: JointGraph, node: fx.Node, outs: list[int]) -> list[tuple[int, int, fx.Node]]:
    """Inputs whose storage this op could write its output into: same layout, covering the whole storage,
    and read by no other input through another layout (`sub(x, x.t())` into x: an elementwise op may read
    the elements it writes, never others; ATen refuses the partial overlap)."""
    if len(outs) != 1 or out_variant(node.target) is None:
        return []
    pairs = []
    for a in node.all_input_nodes:
        s = _fits(jg, a, outs[0], node.meta["val"])
        if s is not None and all(_same_layout(b, a) for b in node.all_input_nodes if s in jg.node_storages(b)):
            pairs.append((outs[0], s, a))
    return pairs


def _same_layout(b: fx.Node, a: fx.Node) -> bool:
    """`b` reads exactly `a`'s elements, in `a`'s layout."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(vb, torch.Tensor) and (vb.shape, vb.stride(), vb.storage_offset()) == (
        va.shape, va.stride(), va.storage_offset())


def _foreach_reuse_pairs(jg: JointGraph, node: fx.Node) -> list[tuple[int, int]]:
    """(output i, first list's element i) for every output, when the in-place twin can write them all:
    each element fits its output, the elements' storages are distinct, and no other argument reads them."""
    xs = list(node.args[0])
    items = jg.getitems.get(node, [])
    if [g.args[1] for g in items] != list(range(len(xs))) or not all(isinstance(x, fx.Node) for x in xs):
        return []  # an unread output would still overwrite its element, which may be alive
    pairs = []
    for x, g in zip(xs, items, strict=True):
        out = jg.storage_of.get(g)
        s = _fits(jg, x, out, g.meta.get("val")) if out is not None and isinstance(g.meta.get("val"), torch.Tensor) else None
        if s is None:
            return []
        pairs.append((out, s))
    written = {s for _, s in pairs}
    others: set[int] = set()
    fx.node.map_arg((node.args[1:], node.kwargs), lambda a: others.update(jg.node_storages(a)))
    if len(written) != len(pairs) or written & others:
        return []
    return pairs


def _may_reuse(jg: JointGraph, node: fx.Node, measured: NodeCosts | None) -> bool:
    """Whether `node` may write its output into a dying input (`Op.reuse`): when profiling saw its out= form
    do so without a full-size temporary; and, where nothing measured it (a profile's roofline, the default on
    CUDA; profiling inside another profiler), when it accumulates gradients (`is_gradient_accumulation`)."""
    if measured is not None and measured.scratch_measured and node.name in measured.reuse_ok:
        return measured.reuse_ok[node.name]
    return is_gradient_accumulation(jg, node)


def is_gradient_accumulation(jg: JointGraph, node: fx.Node) -> bool:
    """A backward `add` of two gradients: what eager's autograd engine does in place (`InputBuffer` adds a
    gradient into the one already there), e.g. the parts of a shared weight's gradient (ALBERT's layers,
    BART's tied embeddings), summed as each use's backward makes one. `add.out` into an operand of the
    output's layout (what `_fits` checks) is computed in place on every device, no temporary: planning it
    out of place costs one more gradient than eager at every such step, at the end of the backward, where
    every gradient is live, the whole step's peak (BART on a roofline profile: +1.1%)."""
    return node.target is torch.ops.aten.add.Tensor and jg.phase.get(node) is Phase.BW


def _reuse(jg: JointGraph, node: fx.Node, outs: list[int]) -> tuple[tuple[int, int], ...]:
    if is_foreach_reuse(node):
        return tuple(_foreach_reuse_pairs(jg, node))
    return tuple((o, i) for o, i, _ in _reuse_pairs(jg, node, outs))


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


def mutated_input_storages(jg: JointGraph) -> set[int]:
    """Storages of the training step's inputs that AOTAutograd writes new values into once the forward has run
    (their new value is a forward output: BatchNorm's running stats, `nn.Embedding(max_norm=...)`'s weight,
    which `embedding_renorm_` renormalizes in place). An op reading one is never recomputed in the backward:
    it would read the new value, and autograd refuses the input saved for it ("modified by an inplace
    operation"), as the input's version changed after it was saved."""
    (out,) = jg.gm.graph.find_nodes(op="output")
    descs = out.meta.get("desc")
    if not isinstance(descs, (list, tuple)):
        return set()
    mutated = {getattr(d, "mutated_input", None) for d in descs if type(d).__name__ == INPUT_MUTATION_AOT_OUTPUT}
    return {s for p in jg.primals if p.meta.get("desc") in mutated for s in jg.node_storages(p)}


def written_storages(jg: JointGraph, node: fx.Node) -> list[int]:
    """Storages a mutating op writes (its arguments the schema marks as written)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out: list[int] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
        for a in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(a, fx.Node):
                out += jg.node_storages(a)
    return out


def order_writes(jg: JointGraph, nodes: list[fx.Node], ops: list[Op], tensors: list[Tensor]) -> tuple[list[Op], list[Tensor]]:
    """Keep every write into a storage between the reads it must follow and the reads that must see it.

    Storages are how the problem orders ops, and a write allocates nothing, so without this
    the planner could move a write before a read of the old value. Each write reads a 0-byte
    token from every op that touched the storage since the previous write, and makes a token
    every later reader takes. An op that reads a storage written after it is not recomputed:
    its recomputation would read the new value.
    """
    writes = [set(written_storages(jg, n)) for n in nodes]
    if not any(writes):
        return ops, tensors
    extra_in: dict[int, list[int]] = {}
    extra_out: dict[int, list[int]] = {}
    tensors = list(tensors)

    def token(op_id: int) -> int:
        t = Tensor(len(tensors), f"{ops[op_id].name}.order{len(extra_out.get(op_id, []))}", 0, TensorKind.ACTIVATION,
                   op_id, offloadable=False)
        tensors.append(t)
        extra_out.setdefault(op_id, []).append(t.id)
        return t.id

    written = set().union(*writes)
    last_write: dict[int, int] = {}  # storage -> token of its latest write
    since: dict[int, list[int]] = {s: [] for s in written}  # storage -> ops that read it since that write
    read_then_written: set[int] = set()
    for op in ops:
        touched = [s for s in op.inputs if s in written]
        for s in set(touched) | writes[op.id]:
            if s in last_write:
                extra_in.setdefault(op.id, []).append(last_write[s])
        for s in writes[op.id]:
            for r in since[s]:
                if r != op.id:
                    extra_in.setdefault(op.id, []).append(token(r))
                    read_then_written.add(r)
            since[s] = []
            last_write[s] = token(op.id)
        for s in touched:
            if s not in writes[op.id]:
                since[s].append(op.id)
    new_ops = [
        dataclasses.replace(
            op,
            inputs=tuple(dict.fromkeys(op.inputs + tuple(extra_in.get(op.id, ())))),
            outputs=op.outputs + tuple(extra_out.get(op.id, ())),
            recomputable=op.recomputable and op.id not in read_then_written,
        )
        for op in ops
    ]
    return new_ops, tensors


def _update_op(jg: JointGraph, node: fx.Node, oid: int, reads: tuple[int, ...], profile: DeviceProfile,
               count) -> Op:
    """The optimizer's update (optim/in_graph.py): it writes its parameters and holds its temporaries while it runs."""
    update = node.target
    params = [s for p in node.args[1] for s in jg.node_storages(p)]
    return Op(id=oid, name=node.name, phase=Phase.BW, inputs=reads, outputs=(), recomputable=False,
              time_s=update.time_s(profile.mem_bw, profile.launch_s), workspace_bytes=count(update.scratch_bytes),
              writes=tuple(dict.fromkeys(params)))


def order_updates(ops: list[Op], tensors: list[Tensor]) -> tuple[list[Op], list[Tensor]]:
    """Every backward op that reads a parameter an update writes runs before the update: it reads a 0-byte token
    of each such reader (the solver's order then keeps them before it; the simulator refuses a recomputation
    reading the parameter after it)."""
    written = {t: op.id for op in ops for t in op.writes}
    if not written:
        return ops, tensors
    tensors = list(tensors)
    extra_in: dict[int, list[int]] = {}
    extra_out: dict[int, list[int]] = {}
    for op in ops:
        for writer in dict.fromkeys(written[t] for t in op.inputs if t in written):
            if op.phase is Phase.BW and writer != op.id:
                t = Tensor(len(tensors), f"{op.name}.before_update{len(extra_out.get(op.id, []))}", 0,
                           TensorKind.ACTIVATION, op.id, offloadable=False)
                tensors.append(t)
                extra_out.setdefault(op.id, []).append(t.id)
                extra_in.setdefault(writer, []).append(t.id)
    return [dataclasses.replace(op, inputs=op.inputs + tuple(extra_in.get(op.id, ())),
                                outputs=op.outputs + tuple(extra_out.get(op.id, ()))) for op in ops], tensors


def _roofline(node: fx.Node, profile: DeviceProfile) -> float:
    """The profile's roofline time; the chunked LM head + cross-entropy (passes/chunked_ce.py) as its k chunks
    run: each reads the weight twice and reads and writes the weight's gradient, and launches its kernels."""
    if node.target is not CHUNKED_CE:
        return node_time(node, profile)
    hidden, weight_t, chunks = (node.args[0].meta["val"], node.args[1].meta["val"], node.args[3])
    rows, h = hidden.shape
    vocab, size = weight_t.shape[1], hidden.element_size()
    k = max(1, min(int(chunks), int(rows)))
    traffic = size * (4 * k * vocab * h + 6 * rows * vocab + 3 * rows * h)
    half = hidden.dtype in (torch.float16, torch.bfloat16)
    compute = node_flops(node) / (profile.half_flops if half else profile.fp32_flops)
    return max(compute, traffic / profile.mem_bw) + k * KERNELS_PER_CHUNK * profile.launch_s


def oversized_storages(problem: Problem, jg: JointGraph) -> dict[str, int]:
    """Tensor name -> bytes, for `problem`'s storages larger than the values `jg` made them for (`_held_bytes`):
    what a plan file records so that its replay, which measures nothing, sizes them alike. CPU's only: on CUDA every
    storage is the allocator's block, larger than its value."""
    nominal = {s.node.name: s.nbytes for s in jg.storages}
    return {t.name: t.bytes for t in problem.tensors if t.name in nominal and t.bytes > nominal[t.name]}


def _held_bytes(jg: JointGraph, measured: NodeCosts | None) -> dict[int, int]:
    """Storages larger than their values, as profiling measured them (CPU): the output of an op with one output storage
    that held more bytes when the op returned (CPU's mse_loss returns its 0-dim loss on an input-sized buffer, held as
    long as the loss is: planned as 4 bytes, a step measured an input's size over its prediction)."""
    if measured is None or not measured.held_bytes:
        return {}
    out = {}
    for node, storages in jg.outputs_of.items():
        got = measured.held_bytes.get(node.name)
        if len(storages) == 1 and got is not None and got > jg.storages[storages[0]].nbytes:
            out[storages[0]] = got
    return out


def build_problem(
    jg: JointGraph,
    profile: DeviceProfile,
    name: str = "step",
    measured: NodeCosts | None = None,
    offload: bool = False,
    host_budget_bytes: int | None = None,
    usage: OutputUsage | None = None,
    device: torch.device | str | None = None,
    grads_at_start: bool = False,
    resident: Sequence[tuple[str, int]] = (),
) -> Built:
    """Ops in program order (forward, then backward).

    With `measured` (from running the graph on the device), op times, kernel scratch
    space and in-place out= forms come from there. Without it times are the profile's
    roofline, scratch space is unknown (0) and no op writes into its inputs, since
    nothing verified that its out= form does so without a temporary, except the backward's
    gradient accumulations, which eager does in place (`is_gradient_accumulation`).
    `offload`: activations may go to host memory at the profile's host bandwidth.
    `usage`: which forward outputs the caller differentiates and holds through the backward
    (training only; None: all of them, as the program alone would suggest).
    `grads_at_start`: the step accumulates into gradients that exist when it starts (see `_grads_at_start`).
    `resident`: (name, bytes) of what is on the device the whole step though the program reads none of it,
    counted as the allocator counts it: the module's parameters and buffers the program does not read (an unused
    submodule, a buffer kept for checkpoints) and the user's optimizer's state (planning/optimizer_step.py: from
    the first step on, though torch creates it at the first `opt.step()`).
    `device`: where the program runs (the planner's target device; "meta" for an offline capture,
    which runs on the profile's device; None: the device of the graph's tensors). On CUDA, bytes are
    what the caching allocator counts (see `CudaMemory`); elsewhere, the storages' sizes.
    """
    cuda = CudaMemory.for_target(jg, profile, device)
    held, returned = caller_outputs(jg, usage)
    movable = offloadable_storages(jg) - returned  # the caller holds those until the forward ends
    tangent_bytes = _tangent_bytes(jg, usage)
    count = cuda.count if cuda is not None else (lambda n: n)
    known: set = set()
    if cuda is None:
        allocated = _held_bytes(jg, measured)
        tensors = [
            Tensor(s.index, s.node.name, 0 if s.index in tangent_bytes else allocated.get(s.index, s.nbytes), s.kind,
                   offloadable=s.index in movable)
            for s in jg.storages
        ]
    else:
        host, known = cuda.host_storages(jg), storage_keys(jg)
        tensors = [
            Tensor(s.index, s.node.name, 0 if s.index in tangent_bytes else cuda.storage_bytes(jg, s, host),
                   s.kind, offloadable=s.index in movable)
            for s in jg.storages
        ]
    ops: list[Op] = []
    nodes: list[fx.Node] = []
    mutated = mutated_input_storages(jg)
    order = [n for n in jg.compute if jg.phase[n] is Phase.FW] + [n for n in jg.compute if jg.phase[n] is Phase.BW]
    for node in order:
        oid = len(ops)
        outs = jg.outputs_of[node]
        for s in outs:
            tensors[s] = dataclasses.replace(tensors[s], producer=oid)
        reads = tuple(s for s in jg.arg_storages(node) if s not in outs)
        if is_update(node):
            ops.append(_update_op(jg, node, oid, reads, profile, count))
            nodes.append(node)
            continue
        ops.append(
            Op(
                id=oid,
                name=node.name,
                phase=jg.phase[node],
                inputs=reads,
                outputs=tuple(outs),
                time_s=measured.times[node.name] if measured and node.name in measured.times else _roofline(node, profile),
                recomputable=jg.phase[node] is Phase.FW and bool(outs) and is_recomputable(node) and not mutated & set(reads),
                reuse=_reuse(jg, node, outs) if _may_reuse(jg, node, measured) else (),
                reuse_all=is_foreach_reuse(node),
                workspace_bytes=(measured.workspace.get(node.name, 0) if measured else 0)
                + (cuda.unread_output_bytes(jg, node, known) if cuda is not None else 0)
                + (cuda.kernel_scratch_bytes(node) if cuda is not None and not _scratch_measured(measured, node) else 0)
                + sum(count(tangent_bytes[s]) for s in reads if s in tangent_bytes),
            )
        )
        nodes.append(node)
    ops, tensors = order_writes(jg, nodes, ops, tensors)
    ops, tensors = order_updates(ops, tensors)
    if caller := caller_loss_bytes(jg, usage, count=count):
        # its intermediates, until the backward starts; its loss value and the reduction's weight (cross-entropy's
        # total_weight, or the seed the caller's backward makes), held by the caller to the step's end: counted
        # from the start (an overcount of 2 scalars in the forward)
        tensors = tensors + [Tensor(len(tensors), "caller_loss_estimate", caller, TensorKind.CALLER, offloadable=False),
                             Tensor(len(tensors) + 1, "caller_loss_scalars", 2 * count(4), TensorKind.INPUT,
                                    offloadable=False)]
    if cuda is not None:  # the cuBLAS workspaces: allocated once, kept; counted for the whole step
        tensors = tensors + [Tensor(len(tensors) + i, w.name, w.bytes, TensorKind.INPUT, offloadable=False)
                             for i, w in enumerate(cuda.workspaces(jg))]
    if grads_at_start and jg.is_training:  # an accumulation step (api.grads_at_start)
        tensors = tensors + _grads_at_start(jg, tensors)
    tensors = tensors + [Tensor(len(tensors) + i, n, cuda.count(b) if cuda is not None else b, TensorKind.INPUT,
                                offloadable=False) for i, (n, b) in enumerate(resident)]
    problem = Problem(
        ops, tensors, frozenset(held), returned=frozenset(returned), name=name,
        host_bw=profile.host_bw if offload else 0.0, host_budget_bytes=host_budget_bytes if offload else None,
    )
    clock.count("problem_op", len(problem.ops))  # its building on the solvers' clock (deterministic mode)
    return Built(problem, nodes)


def _grads_at_start(jg: JointGraph, tensors: list[Tensor]) -> list[Tensor]:
    """The gradients a step that accumulates starts with: one of each gradient the backward makes, held
    by the parameters the whole step (the autograd engine adds the new ones into them in place after the
    backward returns, so both sets are live at its end)."""
    made = sorted({s for o in jg.bw_outputs if isinstance(o, fx.Node) for s in jg.node_storages(o)})
    return [Tensor(len(tensors) + i, f"{tensors[s].name}.grad_at_start", tensors[s].bytes, TensorKind.INPUT, offloadable=False)
            for i, s in enumerate(made)]


def caller_outputs(jg: JointGraph, usage: OutputUsage | None) -> tuple[set[int], set[int]]:
    """Storages the caller holds to the end of the step (gradients, and forward outputs it keeps
    through the backward), and forward outputs it drops once the forward returns."""
    held: set[int] = set()
    returned: set[int] = set()
    for i, o in enumerate(jg.fw_outputs):
        if isinstance(o, fx.Node):
            keep = usage is None or i >= len(usage.held) or usage.held[i]
            (held if keep else returned).update(jg.node_storages(o))
    for o in jg.bw_outputs:
        if isinstance(o, fx.Node):
            held.update(jg.node_storages(o))
    return held, returned - held


def _tangent_bytes(jg: JointGraph, usage: OutputUsage | None) -> dict[int, int]:
    """Per tangent storage of an output no gradient flows into, one element's bytes: the backward reads it as
    zeros broadcast from one element, made anew for each op that reads it and dead after that op
    (`output_usage.zeros_if_missing`), so the storage itself holds nothing and each reader holds the element
    as its workspace."""
    if usage is None:
        return {}
    out = {}
    for t, i in zip(jg.tangents, tangent_outputs(jg.gm, jg.tangents)):
        v = t.meta.get("val")
        if i is not None and i < len(usage.grad) and not usage.grad[i] and isinstance(v, torch.Tensor) and t in jg.storage_of:
            out[jg.storage_of[t]] = v.element_size()
    return out


def caller_loss_bytes(jg: JointGraph, usage: OutputUsage | None, count=None) -> int:
    """An estimate of what the caller holds between our forward and backward while it computes a loss
    from non-scalar outputs it differentiates, besides the gradient it hands us: two intermediates of each
    one's size (cross-entropy keeps its log-softmax while its backward makes the gradient that goes into it;
    a squared error, the difference and its gradient). A loss computed inside the model costs nothing here.
    `count`: the bytes an allocation of n bytes takes (None: n)."""
    if usage is None or not jg.is_training:
        return 0
    count = count if count is not None else (lambda n: n)
    total = 0
    for i, o in enumerate(jg.fw_outputs):
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        if i < len(usage.grad) and usage.grad[i] and isinstance(v, torch.Tensor) and v.dim() > 0:
            total += 2 * count(v.numel() * v.element_size())
    return total


# --------------------------------------------------------------------------- the CUDA memory contract


def _packet(node: fx.Node) -> str:
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", "")


@dataclass(frozen=True)
class CudaMemory:
    """How the CUDA caching allocator counts a program's memory (costs/cuda_allocator.py has the rules):

    * every storage takes `allocated_bytes(nbytes)`: 512-byte blocks, 0 for an empty storage, a whole
      2 MiB-rounded segment for large ones the allocator does not split;
    * only device storages count: on a CUDA capture, tensors on the GPU (a host constant or a CPU scalar
      input takes no GPU memory); in an offline capture, whose fake CPU tensors stand for the GPU's, every
      tensor. Memory-efficient attention's seed and offset with dropout are host tensors either way
      (`sdpa_prediction.host_outputs`);
    * outputs of an op no one reads (a kernel's extra outputs, e.g. attention's logsumexp in a forward-only
      program) are allocated by the kernel and dropped after its step: scratch space of that op;
    * the cuBLAS (and cuBLASLt) workspaces of the threads that call cuBLAS are storages of the whole step:
      allocated at the first such call and kept for the process's life, they exist before every step but
      the first (and in the first, counting them from its start is the conservative choice);
    * a sum or mean split across thread blocks stages partial results in global memory for the kernel's life
      (costs/cuda_reduce.py): scratch of that op where nothing measured the op's memory (an offline plan).

    `device_types`: the fake-tensor devices that stand for GPU storages. `capability`: the GPU's compute
    capability, which sizes the cuBLAS workspace.
    """

    config: AllocatorConfig
    capability: tuple[int, int]
    device_types: frozenset[str]
    multiprocessors: int = 132
    threads_per_multiprocessor: int = 2048

    @classmethod
    def for_target(cls, jg: JointGraph, profile: DeviceProfile, device: torch.device | str | None) -> CudaMemory | None:
        """The CUDA memory model of a program planned for `device` (see `build_problem`), or None when it
        does not run on CUDA (bytes are then the storages' own sizes)."""
        dev = torch.device(device) if device is not None else _graph_device(jg)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                return cls(AllocatorConfig.from_env(), compute_capability(profile), frozenset({"cuda"}),
                           multiprocessors(profile))
            props = torch.cuda.get_device_properties(dev)
            return cls(AllocatorConfig.from_env(), tuple(torch.cuda.get_device_capability(dev)), frozenset({"cuda"}),
                       props.multi_processor_count, getattr(props, "max_threads_per_multi_processor", 2048))
        if dev.type == "meta" and profile.device_type == "cuda":  # an offline capture for a GPU profile
            return cls(AllocatorConfig.from_env(), compute_capability(profile), frozenset({"cpu", "cuda", "meta"}),
                       multiprocessors(profile))
        return None

    def count(self, nbytes: int) -> int:
        return allocated_bytes(nbytes, self.config)

    def on_device(self, v) -> bool:
        return not isinstance(v, torch.Tensor) or v.device.type in self.device_types

    def storage_bytes(self, jg: JointGraph, s: Storage, host: set[int]) -> int:
        if s.index in host or not self.on_device(_storage_value(jg, s)):
            return 0
        return self.count(s.nbytes)

    def host_storages(self, jg: JointGraph) -> set[int]:
        """Storages the graph shows on the device that the CUDA kernel makes on the host."""
        out: set[int] = set()
        for node in jg.compute:
            idx = _host_outputs(node)
            for g in jg.getitems.get(node, []):
                if g.args[1] in idx and g in jg.storage_of:
                    out.add(jg.storage_of[g])
        return out

    def unread_output_bytes(self, jg: JointGraph, node: fx.Node, known: set) -> int:
        """Bytes of the new tensors `node` returns that no getitem reads: allocated by its kernel, freed
        once its result is dropped. `known`: the graph's storages (`storage_keys`), which are not new."""
        val = node.meta.get("val")
        if not isinstance(val, (tuple, list)):
            return 0
        read = {g.args[1] for g in jg.getitems.get(node, [])}
        host = _host_outputs(node)
        total = 0
        for i, v in enumerate(val):
            if i in read or i in host or not isinstance(v, torch.Tensor) or not self.on_device(v):
                continue
            if StorageWeakRef(v.untyped_storage()) in known:
                continue  # an alias of a value the graph holds, not a new allocation
            total += self.count(v.untyped_storage().nbytes())
        return total

    def kernel_scratch_bytes(self, node: fx.Node) -> int:
        """What the op's CUDA kernel allocates and frees beside its outputs, as far as it is predicted: a sum's or
        mean's staging memory and semaphores (costs/cuda_reduce.py); 0 for other ops."""
        got = _reduction_scratch(node, self) if _packet(node) in _REDUCTIONS and node.args else None
        return 0 if got is None else self.count(got.staging_bytes) + self.count(got.semaphore_bytes)

    def workspaces(self, jg: JointGraph) -> list:
        """The cuBLAS / cuBLASLt workspaces the program's threads allocate (cuda_allocator.persistent_allocations):
        the forward's on the caller's thread; the backward's on the autograd engine's device thread, which
        also runs forward matmuls the plan recomputes there."""
        lt_gemms = _prefers_cublaslt()
        lt_addmm = addmm_uses_cublaslt()
        use = {"forward": [False, False], "backward": [False, False]}
        for node in jg.compute:
            name = _packet(node)
            if name not in CUBLAS_OPS:
                continue
            lt = lt_gemms or name in CUBLASLT_OPS or (name == "addmm" and lt_addmm and _has_vector_bias(node))
            phases = ["forward"] if jg.phase[node] is Phase.FW else ["backward"]
            if jg.phase[node] is Phase.FW and jg.is_training and is_recomputable(node):
                phases.append("backward")
            for p in phases:
                use[p][0] = True
                use[p][1] = use[p][1] or lt
        threads = {k: ThreadUse(*v) for k, v in use.items()}
        return persistent_allocations(self.capability, threads, config=self.config)


_REDUCTIONS = frozenset({"sum", "mean"})  # aten packets run by gpu_reduce_kernel with a sum's accumulator


def _reduction_scratch(node: fx.Node, cuda: CudaMemory) -> ReduceScratch | None:
    arg = node.args[0]
    x = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    if not isinstance(x, torch.Tensor) or not cuda.on_device(x) or x.is_complex():
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    try:
        shape, strides = [int(s) for s in x.shape], [int(s) for s in x.stride()]
        dims, offset = [int(d) for d in (dims or [])], int(x.storage_offset())
    except (TypeError, RuntimeError):  # symbolic sizes: no prediction
        return None
    wide = x.dtype == torch.float64 or not x.dtype.is_floating_point  # double, int64 and bool sums accumulate wide
    return reduce_scratch(shape, strides, dims, element_bytes=x.element_size(), accumulator_bytes=8 if wide else 4,
                          multiprocessors=cuda.multiprocessors, threads_per_multiprocessor=cuda.threads_per_multiprocessor,
                          storage_offset=offset)


def _scratch_measured(measured: NodeCosts | None, node: fx.Node) -> bool:
    """Whether running the op on the device measured its scratch (op timing's profiler saw its allocations)."""
    return (measured is not None and measured.scratch_measured and node.name not in measured.unmeasured
            and node.name not in measured.estimated)


def _host_outputs(node: fx.Node) -> tuple[int, ...]:
    if not isinstance(node.target, OpOverload):
        return ()
    return host_outputs(_packet(node), _dropout_p(node))


def _graph_device(jg: JointGraph) -> torch.device:
    """The GPU the graph's tensors are on, else the CPU."""
    for s in jg.storages:
        v = s.node.meta.get("val")
        if isinstance(v, torch.Tensor) and v.device.type == "cuda":
            return v.device
    return torch.device("cpu")


def _storage_value(jg: JointGraph, s: Storage):
    """The tensor the storage's first holder has (a get_attr constant: the module's attribute)."""
    v = s.node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v
    if s.node.op == "get_attr":
        obj = jg.gm
        for part in str(s.node.target).split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None
    return None


def storage_keys(jg: JointGraph) -> set:
    """The graph's storages, as StorageWeakRefs of their first holders' values."""
    keys = set()
    for s in jg.storages:
        v = _storage_value(jg, s)
        if isinstance(v, torch.Tensor):
            keys.add(StorageWeakRef(v.untyped_storage()))
    return keys


def _has_vector_bias(node: fx.Node) -> bool:
    """addmm(bias, a, b) with a 1-D bias: the cuBLASLt `gemm_and_bias` path (Blas.cpp, addmm_out_cuda_impl)."""
    bias = node.args[0] if node.args else None
    v = bias.meta.get("val") if isinstance(bias, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() == 1


def _prefers_cublaslt() -> bool:
    """Every matmul takes the cuBLASLt path (torch.backends.cuda.preferred_blas_library, TORCH_BLAS_PREFER_CUBLASLT)."""
    backend = BlasBackend
    try:
        return backend is not None and torch.backends.cuda.preferred_blas_library() == backend.Cublaslt
    except (RuntimeError, AttributeError):
        return False
