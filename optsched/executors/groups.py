"""Fusion groups on the captured graph: which ops form a kernel, as what subgraph, at what cost.

Which ops form a group is decided on the problem (by the planner, `solvers/search/fusion_groups.find_groups`: connected,
convex sets of ops the executor can fuse, joined by values only members read). Here each
group becomes a small fx.GraphModule (placeholders: the values it reads from outside;
output: the values it materializes; members writing into inputs keep their out= form) that
the executor compiles once per distinct structure, and is timed once.
"""

from __future__ import annotations

import gc
import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.autograd.profiler import record_function

from .._torch import tree_leaves, unset_fake_temporarily
from ..costs.profiles import DeviceProfile, node_flops, random_like
from .base import Executor
from ..capture.fingerprint import fingerprint
from ..capture.joint_graph import JointGraph
from ..costs.measure import device_sync, labelled_peaks, measure_peak, memory_profile
from ..solvers.model import clock
from ..solvers.model.calibration import compile_unit, seconds
from ..solvers.model.fusion_sim import internal_tensors
from ..solvers.model.problem import Problem, convexity_violation, reject

log = logging.getLogger(__name__)


@dataclass
class Group:
    nodes: list[fx.Node]  # compute nodes, in program order
    inputs: list[fx.Node]  # values read from outside, in placeholder order
    outputs: list[fx.Node]  # values it materializes (storage holders), in output order
    module: fx.GraphModule
    writes: dict[fx.Node, fx.Node] = field(default_factory=dict)  # member writing into an input -> that input
    kernel: Callable[..., tuple] | None = None
    time_s: float = 0.0
    workspace_bytes: int = 0


def _storage_holder(jg: JointGraph, s: int) -> fx.Node:
    return jg.storages[s].node


def build_group(jg: JointGraph, problem: Problem, members: list[int], nodes: list[fx.Node]) -> Group:
    """The group's subgraph: member nodes, the views and getitems between them, external reads as placeholders."""
    inside = internal_tensors(problem, members)
    compute = [nodes[o] for o in members]
    member_set = set(compute)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def owned(n: fx.Node) -> bool:
        """Made inside the group: a member, its getitem, or a view of one."""
        if n in member_set:
            return True
        if n.target is operator.getitem and n.args[0] in member_set:
            return True
        return jg.is_view(n) and any(owned(a) for a in n.all_input_nodes)

    def value(n: fx.Node) -> fx.Node:
        if n in env:
            return env[n]
        if owned(n):
            for a in n.all_input_nodes:
                value(a)
            env[n] = graph.node_copy(n, lambda a: env[a])
            return env[n]
        ph = graph.placeholder(f"in{len(inputs)}")
        ph.target = ph.name  # the parameter fx names it by: a renamed placeholder must not alias another's
        ph.meta = dict(n.meta)
        inputs.append(n)
        env[n] = ph
        return ph

    for n in compute:
        value(n)
        for g in jg.getitems.get(n, []):
            value(g)
    # storages only: order tokens (ids past the graph's storages) exist in the problem alone
    made = [s for o in members for s in problem.ops[o].outputs if s not in inside and s < len(jg.storages)]
    outputs = [_storage_holder(jg, s) for s in made]
    graph.output(tuple(env[o] for o in outputs))
    # placeholders first, in the order they were made
    head = next(iter(graph.nodes))
    for ph in reversed([env[i] for i in inputs]):
        if ph is not head:
            head.prepend(ph)
        head = ph
    graph.lint()
    # an out= member returns its destination, so whoever reads the member reads that input (updated)
    writes = {n: n.kwargs["out"] for n in compute if isinstance(n.kwargs.get("out"), fx.Node)}
    if not set(writes.values()) <= set(inputs):
        raise ValueError(f"fusion group {[n.name for n in compute]} writes into a value made inside it")
    return Group(compute, inputs, outputs, fx.GraphModule(torch.nn.Module(), graph), writes)


def roofline_time(group: Group, profile: DeviceProfile) -> float:
    """One launch; FLOPs of the members; bytes of what it reads and materializes only."""
    flops = sum(node_flops(n) for n in group.nodes)

    def nbytes(n: fx.Node) -> int:
        return sum(v.numel() * v.element_size() for v in tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor))

    moved = sum(nbytes(n) for n in group.inputs) + sum(nbytes(n) for n in group.outputs)
    half = any(isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16)
               for n in group.outputs for v in tree_leaves(n.meta.get("val")))
    rate = profile.half_flops if half else profile.fp32_flops
    return max(flops / rate, moved / profile.mem_bw) + profile.launch_s


@dataclass
class CompiledGroup:
    kernel: Callable[..., tuple]
    time_s: float = 0.0
    workspace_bytes: int = 0


def group_key(g: Group, measure: bool) -> str:
    """What a compiled group is cached under: its structure, not node names (the same group in every layer compiles
    and is timed once), and whether it was timed."""
    return fingerprint(g.module)["hash"] + f"measured={measure}"


def compile_cost_s(executor: Executor, measure: bool) -> tuple[float, float]:
    """Seconds on the solvers' clock that compiling one more group adds (what `compile_groups` counts): its compile
    and timing, and apart from them the process's one-time set-up it would pay (Inductor's first start, once).
    Planning compiles a group only where this fits in the time left (planning/fusion.py)."""
    compiled, setup = _compile_units(executor)
    cost = sum(seconds(u, 1) for u in compiled) + (seconds("op_timed", 1) if measure else 0.0)
    return cost, (seconds(setup, 1) if setup and not clock.counted_once(setup) else 0.0)


def _compile_units(executor: Executor) -> tuple[list[str], str | None]:
    """The units one group's compile counts, and the one-time set-up unit its first compile counts: none for
    plan_offline's stand-in executors, which plan groups and build nothing."""
    if getattr(executor, "plans_only", False):
        return [], None
    return [compile_unit(executor.name)], ("inductor_first_start" if executor.name == "inductor" else None)


def compile_groups(
    groups: list[Group], executor: Executor, device: torch.device, measure: bool,
    cache: dict[str, CompiledGroup] | None = None,
) -> None:
    """Compile each group (once per distinct subgraph); with `measure`, time it and find its scratch
    space (once per distinct subgraph too). `cache` carries both across calls for one graph."""
    cache = {} if cache is None else cache
    with clock.stage("fusion compiles"), unset_fake_temporarily():
        examples: dict[str, list[torch.Tensor]] = {}  # the kernels compiled now, to measure: their inputs
        for g in groups:
            key = group_key(g, measure)
            if key not in cache and key not in examples:
                example = [random_like(n.meta["val"], device) for n in g.inputs]
                done = CompiledGroup(executor.compile_group(g.module, example))
                compiled, setup = _compile_units(executor)  # on the solvers' clock: planning time (deterministic mode)
                for unit in compiled:
                    clock.count(unit)
                if setup is not None:  # its first compile sets the compiler up
                    clock.count_once(setup)
                if measure:
                    done.time_s = _time_kernel(done.kernel, example)
                    clock.count("op_timed")
                    examples[key] = example
                cache[key] = done
        for key, scratch in _scratch_bytes({k: (cache[k].kernel, ex) for k, ex in examples.items()}).items():
            cache[key].workspace_bytes = scratch
        for g in groups:
            done = cache[group_key(g, measure)]
            g.kernel, g.time_s, g.workspace_bytes = done.kernel, done.time_s, done.workspace_bytes


_KERNEL = "optsched_kernel::"


def _time_kernel(kernel: Callable[..., tuple], example: list[torch.Tensor]) -> float:
    """The best of three runs, after a warm-up run."""
    kernel(*example)
    best = float("inf")
    sync = device_sync()
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        kernel(*example)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _scratch_bytes(kernels: dict[str, tuple[Callable[..., tuple], list[torch.Tensor]]]) -> dict[str, int]:
    """Each kernel's scratch space: the peak of its run less its outputs. On the CPU all of them in one pass of
    the allocation profiler, each run labelled (a pass is 0.15 s here: one per kernel was most of a small
    program's planning); on CUDA the allocator's peak around each run."""
    if not kernels:
        return {}
    first = next(iter(kernels.values()))[1]
    device = first[0].device if first else torch.device("cpu")
    if device.type == "cuda":
        out = {}
        for key, (kernel, example) in kernels.items():
            outs = kernel(*example)
            out_bytes = sum(o.untyped_storage().nbytes() for o in outs if isinstance(o, torch.Tensor))
            del outs
            peak = measure_peak(lambda kernel=kernel, example=example: kernel(*example), device)
            out[key] = max(0, peak.peak_bytes - out_bytes)
        return out
    gc.collect()
    with memory_profile() as prof:
        for key, (kernel, example) in kernels.items():
            with record_function(_KERNEL + key):
                outs = kernel(*example)
            del outs
    # what a label still holds at its end is its outputs
    return {name[len(_KERNEL):]: max(0, peak - max(end, 0))
            for name, (peak, end) in labelled_peaks(prof, _KERNEL).items()}


def horizontal_candidates(
    problem: Problem, nodes: list[fx.Node], fusible: list[bool], taken: set[int], limit: int = 3
) -> list[list[int]]:
    """Sets of fusible ops of one kind (same target, input shapes, phase and depth in the graph) that
    could run as one kernel: convex, so no path leads from one member through other ops to another.
    Largest first."""
    depth: dict[int, int] = {}
    classes: dict[tuple, list[int]] = {}
    for op in problem.ops:
        producers = [problem.tensors[t].producer for t in op.inputs]
        depth[op.id] = 1 + max((depth[p] for p in producers if p is not None), default=0)
        if not fusible[op.id] or op.id in taken:
            continue
        n = nodes[op.id]
        shapes = tuple(tuple(a.meta["val"].shape) for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))
        classes.setdefault((op.phase, n.target, shapes, depth[op.id]), []).append(op.id)
    out = []
    for members in sorted(classes.values(), key=len, reverse=True):
        if len(members) < 2:
            continue
        between = convexity_violation(problem, members)  # a class is of one phase, in program order already
        if between is not None:
            reject(log, "horizontal fusion candidate(s) rejected, not convex", ValueError(
                f"fusion group {[problem.ops[o].name for o in members]} is not convex: "
                f"{problem.ops[between].name!r} lies between its members"))
            continue
        out.append(members)
    return out[:limit]
