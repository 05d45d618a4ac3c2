"""Replay a schedule: the one evaluator every solver and heuristic is judged by.

Memory convention (matches an allocator that frees at last use): at step k the live
bytes are every storage produced at or before k and read at or after k. An op's
inputs and outputs are therefore live together while it runs; a storage nobody
reads lives only during the step that makes it. Inputs live all step, outputs of
the step live to its end, forward results the caller drops after the forward
(`Problem.returned`) at least to the forward's end, tangents from the start of the backward.
A formed fusion option's steps count as one (fusion_sim.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from . import clock
from .fusion_sim import formed_runs, hidden_bytes, merge_runs, step_workspace
from .offload_sim import OffloadEvent, replay_offload
from .problem import Phase, Problem, Schedule, ScheduleError


class Lifetime(NamedTuple):
    """One copy of a tensor on the device (a named tuple: a simulation of 10,000 steps makes some 30,000)."""

    tensor: int
    start: int
    end: int  # inclusive
    recomputed: bool  # the copy made by a recomputation in the backward
    prefetched: bool = False  # the copy brought back from the host


@dataclass
class SimResult:
    peak_bytes: int
    peak_step: int
    time_s: float
    timeline: list[int]  # live bytes at each step
    steps: list[tuple[int, bool]]  # (op id, is recomputation) per step
    n_forward_steps: int
    saved: list[int]  # forward storages kept alive into the backward
    reused: dict[int, int]  # step -> input tensor whose storage the step's output takes over
    reads: list[list[tuple[int, bool]]]  # per step: (tensor, recomputed copy?) it reads
    spans: dict[tuple[int, bool], tuple[int, int]]  # every copy's [start, end], reuse applied
    recomputed_ops: list[int]
    recompute_s: float
    offloads: dict[int, OffloadEvent] = field(default_factory=dict)  # tensor -> when it leaves and returns
    offloaded_bytes: int = 0
    transfer_s: float = 0.0  # busy time of the copy queues, overlapping compute
    exposed_transfer_s: float = 0.0  # the part compute waited for (included in time_s)
    host_bytes: int = 0  # host memory taken by offloaded copies
    boundary_bytes: int = 0  # live while the caller computes its loss between forward and backward (0: no such loss)
    formed: tuple[int, ...] = ()  # the schedule's formed fusion options

    @property
    def lifetimes(self) -> list[Lifetime]:
        """Every copy on the device, by start then tensor: made when first asked (most plans a search simulates are
        judged by their peak alone, and making these was a fifth of a simulation)."""
        made = self.__dict__.get("_lifetimes")
        if made is None:
            made = self.__dict__["_lifetimes"] = [Lifetime(*c) for c in sorted(
                _copies(self.spans, self.offloads), key=lambda c: (c[1], c[0]))]
        return made


def _check_orders(problem: Problem, schedule: Schedule) -> None:
    phases = problem.phases
    if sorted(schedule.fw_order) != phases.fw_ids:
        missing = set(phases.fw_ids) - set(schedule.fw_order)
        raise ScheduleError(f"forward order is not a permutation of the forward ops (missing {sorted(missing)[:5]})")
    seen = set(schedule.bw_order)
    if len(seen) == len(schedule.bw_order) and not seen & phases.not_recomputable and not phases.writes:
        if not phases.bw_ids <= seen:
            raise ScheduleError(f"backward order misses {len(phases.bw_ids - seen)} backward ops")
        return  # set operations: what the loop below checks, without a Python step per op
    bw_ids = phases.bw_ids
    seen = set()
    written: dict[int, str] = {}  # input -> the op that overwrote it (Op.writes)
    for o in schedule.bw_order:
        if o in seen:
            raise ScheduleError(f"op {problem.ops[o].name!r} appears twice in the backward order")
        seen.add(o)
        op = problem.ops[o]
        if op.phase is Phase.FW and not op.recomputable:
            raise ScheduleError(f"op {op.name!r} is not recomputable")
        if late := [t for t in op.inputs if t in written]:
            raise ScheduleError(f"op {op.name!r} reads {problem.tensors[late[0]].name!r} after {written[late[0]]!r} "
                                "overwrote it")
        written.update((t, op.name) for t in op.writes)
    if not bw_ids <= seen:
        raise ScheduleError(f"backward order misses {len(bw_ids - seen)} backward ops")


def simulate(problem: Problem, schedule: Schedule) -> SimResult:
    """Validate `schedule` against `problem` and return its memory timeline, peak and time."""
    with clock.stage("simulation"):
        return _simulated(problem, schedule)


def _simulated(problem: Problem, schedule: Schedule) -> SimResult:
    _check_orders(problem, schedule)
    steps = schedule_steps(problem, schedule)
    clock.count("simulated_step", len(steps))
    n_fw = len(schedule.fw_order)
    runs = formed_runs(problem, schedule, steps)
    walk = _walk(problem, steps, n_fw)
    span = walk.span
    if runs:
        fused_s, fused_rc_s = merge_runs(problem, runs, steps, span, walk.reads)
        walk.time_s -= fused_s
        walk.recompute_s -= fused_rc_s
    _hold_caller_values(problem, span, n_fw, last=max(len(steps) - 1, 0))
    saved = _saved_across_boundary(problem, span, n_fw)
    in_runs = {k for r in runs for k in range(r.start, r.end + 1)}
    reused = _apply_reuse(problem, steps, n_fw, span, in_runs)
    time_s = walk.time_s
    offload = None
    if schedule.offload:
        offload = replay_offload(problem, steps, n_fw, span, walk.reads, set(saved), schedule.offload,
                                 runs=[(r.start, r.end, problem.fusion_options[r.option].time_s) for r in runs])
        time_s += offload.exposed_s
    copies = _copies(span, offload.events if offload is not None else None)
    nbytes = hidden_bytes(problem, runs) if runs else None  # None: the tensors' own sizes
    workspace = step_workspace(problem, steps, runs) if runs else None
    timeline = _timeline(problem, steps, copies, span, nbytes, workspace)
    first_reads = walk.reads[n_fw] if len(steps) > n_fw else ()
    boundary = _caller_boundary(problem, copies, n_fw, len(steps), nbytes, first_reads)
    peak = max(timeline + [boundary])
    return SimResult(
        peak_bytes=peak,
        peak_step=timeline.index(peak) if peak in timeline else n_fw,
        boundary_bytes=boundary,
        time_s=time_s,
        timeline=timeline,
        steps=steps,
        n_forward_steps=n_fw,
        saved=saved,
        recomputed_ops=sorted(walk.recompute_pos),
        reused=reused,
        reads=walk.reads,
        spans={key: (v[0], v[1]) for key, v in span.items()},
        recompute_s=walk.recompute_s,
        formed=schedule.formed,
        **(_offload_fields(offload) if offload is not None else {}),
    )


def schedule_steps(problem: Problem, schedule: Schedule) -> list[tuple[int, bool]]:
    """(op id, is recomputation) per step: the forward order, then the backward order, in which a
    forward op is a recomputation."""
    return [(o, False) for o in schedule.fw_order] + [
        (o, problem.ops[o].phase is Phase.FW) for o in schedule.bw_order
    ]


@dataclass
class _Walk:
    """What stepping through the program gives: every copy's span (before the caller's holds and
    reuse), what each step reads, where recomputations run, compute time."""

    span: dict[tuple[int, bool], list[int]]  # copy key: (tensor, recomputed?) -> [start, end]
    reads: list[list[tuple[int, bool]]] = field(default_factory=list)
    recompute_pos: dict[int, int] = field(default_factory=dict)  # recomputed op -> its step
    time_s: float = 0.0
    recompute_s: float = 0.0


def _walk(problem: Problem, steps: list[tuple[int, bool]], n_fw: int) -> _Walk:
    """Per-step liveness bookkeeping: each read extends the copy it reads to that step (recompute handling:
    in the backward, a tensor whose producer was recomputed earlier is read from the recomputed copy; one whose
    producer is recomputed later may not be read before it: the lowered backward has no other copy of it,
    lower/programs.py refuses the plan), each output starts a copy; a tensor made twice (by the same kind of
    step) is an error. The simulator's innermost loop (every step's every input): names bound once, the reads
    inline (a call per step was a third of a 10,000-step simulation)."""
    walk = _Walk(_held_from_start(problem, n_fw, last=max(len(steps) - 1, 0)))
    recomputed = {o for o, is_rc in steps[n_fw:] if is_rc}
    ops, span, done, all_reads = problem.ops, walk.span, walk.recompute_pos, walk.reads
    reads_of = _reads_of(problem)
    for k, (o, is_rc) in enumerate(steps):
        backward = k >= n_fw
        reads = []
        for t, producer in reads_of[o]:
            if backward and producer in done:
                key = (t, True)
            elif backward and producer in recomputed:
                raise ScheduleError(f"backward step {k} ({ops[o].name!r}) reads {problem.tensors[t].name!r} "
                                    "before its recomputation")
            else:
                key = (t, False)
            reads.append(key)
            copy = span.get(key)
            if copy is None or copy[0] > k:
                where = "backward" if backward else "forward"
                raise ScheduleError(f"{where} step {k} ({ops[o].name!r}) reads {problem.tensors[t].name!r} "
                                    "before it exists")
            if copy[1] < k:
                copy[1] = k
        all_reads.append(reads)
        op = ops[o]
        if is_rc:
            done[o] = k
            walk.recompute_s += op.time_s
        for t in op.outputs:
            key = (t, is_rc)
            if key in span:
                raise ScheduleError(f"{problem.tensors[t].name!r} produced twice")
            span[key] = [k, k]
        walk.time_s += op.time_s
    return walk


def _reads_of(problem: Problem) -> list[tuple[tuple[int, int | None], ...]]:
    """Per op, (input tensor, its producer) for each input: made once per problem's ops and tensors."""
    cached = problem.__dict__.get("_reads_of")
    if cached is None or cached[0] is not problem.ops or cached[1] is not problem.tensors \
            or len(cached[2]) != len(problem.ops):
        tensors = problem.tensors
        cached = problem.ops, tensors, [tuple((t, tensors[t].producer) for t in op.inputs) for op in problem.ops]
        problem.__dict__["_reads_of"] = cached
    return cached[2]


def _held_from_start(problem: Problem, n_fw: int, last: int) -> dict[tuple[int, bool], list[int]]:
    """Spans of what no step produces: inputs live all program, tangents the whole backward
    (the autograd engine holds the seed)."""
    facts = problem.tensor_facts
    span: dict[tuple[int, bool], list[int]] = {(t, False): [0, last] for t in facts.inputs}
    for t in facts.tangents:
        span[(t, False)] = [n_fw, last]
    for t in facts.freed_tangents:  # to its last read (reads extend it)
        span[(t, False)] = [n_fw, min(n_fw, last)]
    return span


def _hold_caller_values(problem: Problem, span: dict, n_fw: int, last: int) -> None:
    """The caller's holds: program outputs live to the end, forward results the caller drops
    after the forward (`Problem.returned`) at least to the forward's end."""
    for t in problem.outputs:
        if (t, False) in span:
            span[(t, False)][1] = last
    for t in problem.returned:
        if (t, False) in span:
            span[(t, False)][1] = max(span[(t, False)][1], n_fw - 1)


def _saved_across_boundary(problem: Problem, span: dict, n_fw: int) -> list[int]:
    """The backward boundary: forward activations (not outputs, not recomputed copies) alive from
    the forward into the backward, i.e. what autograd saves."""
    saveable = problem.tensor_facts.saveable
    return sorted(t for (t, rc), (s, e) in span.items() if not rc and s < n_fw <= e and t in saveable)


def _copies(span: dict, offloads: dict[int, OffloadEvent] | None) -> list[tuple[int, int, int, bool, bool]]:
    """(tensor, start, end, recomputed, prefetched) per copy on the device, `Lifetime`'s fields as a plain tuple (cheaper
    to make); an offloaded tensor's is cut in two: on the device from its producer until dropped, and again from its
    prefetch."""
    if not offloads:
        return [(t, s, e, rc, False) for (t, rc), (s, e) in span.items()]
    copies = []
    for (t, rc), (s, e) in span.items():
        ev = offloads.get(t) if not rc else None
        if ev is None:
            copies.append((t, s, e, rc, False))
        else:
            copies.append((t, s, ev.release - 1, False, False))
            copies.append((t, ev.prefetch, e, False, True))
    return copies


def _timeline(problem: Problem, steps: list[tuple[int, bool]], copies: list[tuple], span: dict,
              nbytes: list[int] | None = None, workspace: list[int] | None = None) -> list[int]:
    """Live bytes at each step (the copies, `_copies`, summed by a difference array) plus the step's
    workspace; an empty program still holds its inputs. `nbytes`, `workspace`: per tensor and per
    step, when formed fusion groups change them (fusion_sim.py)."""
    size = nbytes if nbytes is not None else problem.tensor_facts.bytes
    delta = [0] * (len(steps) + 2)
    for t, start, end, _rc, _pf in copies:
        if end >= start:
            delta[start] += size[t]
            delta[end + 1] -= size[t]
    timeline, live = [], 0
    ops = problem.ops
    for k, (o, _rc) in enumerate(steps):
        live += delta[k]
        timeline.append(live + (ops[o].workspace_bytes if workspace is None else workspace[k]))
    if not timeline:
        timeline = [sum(size[t] for (t, _), _v in span.items())]
    return timeline


def _caller_boundary(problem: Problem, copies: list[tuple], n_fw: int, n_steps: int,
                     nbytes: list[int] | None = None, first_reads: Iterable[tuple[int, bool]] = ()) -> int:
    """Live bytes while the caller computes its loss between our forward and backward: what crosses
    from forward to backward (inputs, saved and held values), the tangents it is making, and its own
    intermediates (`TensorKind.CALLER`). 0 when the caller computes nothing we know of. `first_reads`:
    what the backward's first step reads; a forward value it writes its output into (`_apply_reuse`)
    crosses too, though its own lifetime ends the step before (the output's starts at that step)."""
    facts = problem.tensor_facts
    caller = facts.caller_bytes
    if not caller or n_steps <= n_fw:
        return 0
    taken = set(first_reads)
    size = facts.bytes if nbytes is None else nbytes
    live = sum(
        size[t]
        for t, start, end, rc, _pf in copies
        if start < n_fw <= end or (start == n_fw and t in facts.tangent_set)
        or (start < n_fw and end == n_fw - 1 and (t, rc) in taken)
    )
    return live + caller


def _offload_fields(rep) -> dict:
    return {
        "offloads": rep.events,
        "offloaded_bytes": rep.offloaded_bytes,
        "transfer_s": rep.transfer_s,
        "exposed_transfer_s": rep.exposed_s,
        "host_bytes": rep.host_bytes,
    }


def _apply_reuse(problem: Problem, steps: list[tuple[int, bool]], n_fw: int, span: dict,
                 fused: set[int] = frozenset()) -> dict[int, int]:
    """Let an op write its output into an input that dies at that very step.

    The input's storage then ends one step earlier and the output takes it over, so
    the step allocates nothing new. Only activations qualify: inputs, tangents and
    the step's outputs are held by someone else. Steps of formed fusion groups (`fused`) do not:
    their kernel writes no input.
    """
    reused: dict[int, int] = {}
    recomputed_before: set[int] = set()
    reusable = problem.tensor_facts.reusable
    for k, (o, is_rc) in enumerate(steps):
        op = problem.ops[o]
        dying = []
        for _out, inp in () if k in fused else op.reuse:
            t = problem.tensors[inp]
            key = (inp, k >= n_fw and t.producer in recomputed_before)
            s, e = span[key]
            if inp in reusable and e == k and s < k:
                dying.append((inp, key))
                if not op.reuse_all:
                    break
        if dying and (not op.reuse_all or len(dying) == len(op.reuse)):
            for _inp, key in dying:
                span[key][1] = k - 1
            reused[k] = dying[0][0]  # for reuse_all, the step writes every pair's input
        if is_rc:
            recomputed_before.add(o)
    return reused
