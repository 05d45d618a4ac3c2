"""Search by segments: replan one stretch of the backward at a time, copy the answer to repeated blocks.

Starting from any plan, each round takes the segment that matters most (the one holding
the peak while the plan is over budget, else the one spending most on recomputation),
replans it whole with solvers/cpsat/segment.py (order and save/recompute together, the
rest of the plan held), and keeps the result when the simulator says it is better. When the
segment is a repeated block's, the same change is tried on every other block of that
shape at once: a block solved once serves the whole chain, which keeps planning time
linear in depth. With `offload=True` (the problem has host bandwidth), each segment model also
decides which of its activations go to the host and back (prefetched one copy time ahead of
the segment), and the plan's offloads are carried through every change. Fusion options whose members
are all backward steps of a segment are decided by its model too (formed or not, copied to sibling
blocks by their steps); formed groups elsewhere are carried while their members stay consecutive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..model import clock
from ..cpsat.segment import OffloadWindow, free_ops, replan_segment
from ..model.problem import Problem, Schedule, reject
from ..model.simulator import ScheduleError, SimResult, schedule_steps, simulate
from .blocks import Groups, find_blocks, op_signature, segments
from .incumbent import better, fits as _fits
from .offload import step_with_compute_before

log = logging.getLogger(__name__)

SEGMENT_S = 2.0  # the most one segment model may take
# replans of same-shape segments (repeated blocks), or copies of a change to them, that did not help, after which
# the others of that shape are left as they are (for this round): the blocks of a deep model differ only in what
# is live around them (80 Llama layers at 60%: 2.5 s of a 6 s slice went to 79 copies of one change, none helping)
SAME_SHAPE_MISSES = 3
PREFETCH_LEAD = 1.0  # a segment's offloads come back this many copy times of compute before it
PREFETCH_SHARES = (0.25, 0.5, 1.0)  # the prefetch steps a segment model chooses from: hiding these shares of
# copying all it may offload


def splice(
    problem: Problem, sim: SimResult, a: int, b: int, new: list[tuple[int, bool]],
    redecided: set[int] = frozenset(), offloaded: dict[int, int] | None = None,
    *, fusion: dict[int, bool] | None = None,
) -> Schedule:
    """The plan of `sim` with steps [a, b) replaced by `new`. Its offloads stay (a prefetch inside the
    segment moves to its start, later ones shift), but for the tensors in `redecided`: those are
    offloaded as `offloaded` says (tensor -> global prefetch step, at or before `a`), or not at all.
    Its formed fusion options stay while their members still run consecutively, but for those in
    `fusion` (option -> formed), decided anew."""
    n_fw = sim.n_forward_steps
    steps = sim.steps[n_fw:a] + new + sim.steps[b:]
    offload: dict[int, int] = {}
    for t, ev in sim.offloads.items():
        if t in redecided:
            continue
        k = ev.prefetch
        offload[t] = (k if k < a else a if k < b else k + len(new) - (b - a)) - n_fw
    offload.update((t, k - n_fw) for t, k in (offloaded or {}).items())
    fw, bw = [o for o, _ in sim.steps[:n_fw]], [o for o, _ in steps]
    fusion = fusion or {}
    formed = [j for j in sim.formed if j not in fusion] + [j for j, f in fusion.items() if f]
    return Schedule(fw, bw, offload, tuple(j for j in formed if j in fusion or still_consecutive(problem, j, fw, bw)))


def still_consecutive(problem: Problem, j: int, fw: list[int], bw: list[int]) -> bool:
    """Whether fusion option `j`'s members run consecutively in `fw` and, where they run there, in `bw`."""
    members = set(problem.fusion_options[j].members)
    for order in (fw, bw):
        at = [k for k, o in enumerate(order) if o in members]
        if at and (len(at) != len(members) or at[-1] - at[0] + 1 != len(at)):
            return False
    return True


def offload_window(problem: Problem, sim: SimResult, a: int, free: list[int]) -> OffloadWindow | None:
    """Where segment [a, b)'s offloads come back from, and what host memory and copy time is left for
    them; None when nothing of `free` can go to the host."""
    if problem.host_bw <= 0:
        return None
    mine = {t for f in free for t in problem.ops[f].outputs}
    movable = sum(problem.tensors[t].bytes for t in mine if problem.tensors[t].offloadable)
    if not movable:
        return None
    n_fw = sim.n_forward_steps
    others = sum(problem.tensors[t].bytes for t in sim.offloads if t not in mine)
    host_left = None if problem.host_budget_bytes is None else problem.host_budget_bytes - others
    forward_left = sum(problem.ops[o].time_s for o, _ in sim.steps[:n_fw]) - others / problem.host_bw
    options: dict[int, float] = {}
    for share in PREFETCH_SHARES:
        k = prefetch_step(problem, sim, a, int(share * movable))
        options[k] = min(sum(problem.ops[o].time_s for o, _ in sim.steps[k:a]), forward_left)
    return OffloadWindow(tuple(sorted(options.items(), reverse=True)), host_left)


def prefetch_step(problem: Problem, sim: SimResult, a: int, nbytes: int) -> int:
    """The latest step (not before the backward) with PREFETCH_LEAD copy times of `nbytes` of compute before `a`."""
    return step_with_compute_before(problem, sim, a, PREFETCH_LEAD * nbytes / problem.host_bw)


def improve_by_segments(
    problem: Problem,
    schedule: Schedule,
    budget: int | None,
    *,
    deadline: float,
    workers: int = 2,
    on_step: Callable[[str], None] | None = None,
    max_rounds: int = 200,
    offload: bool = False,
) -> tuple[Schedule, bool]:
    """The best plan reached from `schedule` by replanning segments (never worse than `schedule`), and
    whether the deadline cut the search short (False: no segment change helps any more). `offload`:
    segments may offload their activations too (when the problem has host bandwidth)."""
    groups = find_blocks(problem, schedule.fw_order)
    best, bsim = schedule, simulate(problem, schedule)
    tried: set[tuple] = set()
    for _ in range(max_rounds):
        fits = _fits(bsim, budget)
        segs = _priority(problem, bsim, groups, segments(problem, bsim, groups), budget)
        improved = False
        missed: dict[tuple, int] = {}  # a segment's shape -> replans of segments of that shape that did not help
        for a, b, g in segs:
            left = deadline - clock.now()
            if left < 0.1:
                return best, True
            state = (tuple(bsim.steps[a:b]), fits)
            if state in tried:
                continue
            shape = tuple((op_signature(problem, o), rc) for o, rc in bsim.steps[a:b])
            if missed.get(shape, 0) >= SAME_SHAPE_MISSES:
                continue
            tried.add(state)
            missed[shape] = missed.get(shape, 0) + 1  # a replan that helps ends the round (and its count)
            free = free_ops(problem, bsim, a, b, groups.members[g], offload=offload and problem.host_bw > 0)
            window = offload_window(problem, bsim, a, free) if offload else None
            limit = min(left, SEGMENT_S)
            res = replan_segment(problem, bsim, a, b, free, budget, time_limit_s=limit, workers=workers, window=window,
                                 decide_fusion=True)
            left = deadline - clock.now()
            if res is None and not fits and left >= 0.1:  # on the time the first model left (it had all of `limit`:
                # the second took as much again, GPT-2 at 1.08x its bound: a 0.69 s slice used 1.55 s)
                res = replan_segment(problem, bsim, a, b, free, None, time_limit_s=min(left, SEGMENT_S), workers=workers,
                                     window=window, decide_fusion=True)
            if res is None:
                continue
            outs = {t for f in free for t in problem.ops[f].outputs}
            back = {t: res.prefetch_step for f in res.offload for t in problem.ops[f].outputs} if window else {}
            cand = splice(problem, bsim, a, b, res.steps, outs if window else set(), back, fusion=res.fusion)
            try:
                csim = simulate(problem, cand)
            except ScheduleError as e:  # an offload the replay refuses (host budget): not kept
                reject(log, "candidate(s) rejected in the segment search (a replanned segment)", e)
                continue
            if not better(csim, bsim, budget):
                continue
            best, bsim, improved = cand, csim, True
            if on_step:
                on_step(f"segment of group {g} replanned: {bsim.peak_bytes / 2**20:.2f} MiB")
            if g in groups.block_set:
                moved = (free, res.offload) if window else None
                best, bsim = _copy_to_siblings(problem, groups, best, bsim, g, state[0], res.steps, budget, moved,
                                               res.fusion, deadline=deadline)
            break
        if not improved:
            return best, False
    return best, True


def _priority(problem: Problem, sim: SimResult, groups: Groups, segs, budget: int | None):
    """Over budget: the segment holding the peak, then those whose saved activations are live there.
    Within budget: most recomputation time first."""
    if not _fits(sim, budget):
        k = sim.peak_step
        live_at_peak: dict[int, int] = {}
        for lt in sim.lifetimes:
            if lt.start <= k <= lt.end and not lt.recomputed:
                prod = problem.tensors[lt.tensor].producer
                if prod is not None and prod in groups.of_op:
                    g = groups.of_op[prod]
                    live_at_peak[g] = live_at_peak.get(g, 0) + problem.tensors[lt.tensor].bytes
        holding = [s for s in segs if s[0] <= k < s[1]]
        rest = sorted((s for s in segs if s not in holding), key=lambda s: -live_at_peak.get(s[2], 0))
        return holding + [s for s in rest if live_at_peak.get(s[2], 0) > 0]
    rc_time = []
    for a, b, g in segs:
        t = sum(problem.ops[o].time_s for o, rc in sim.steps[a:b] if rc)
        rc_time.append((-t, a, b, g))
    return [(a, b, g) for t, a, b, g in sorted(rc_time) if t < 0]


def _copy_to_siblings(problem, groups: Groups, sched: Schedule, sim: SimResult, g: int, old_steps, solved, budget,
                      moved: tuple[list[int], set[int]] | None = None, fusion: dict[int, bool] | None = None, *,
                      deadline: float | None = None):
    """Apply the change made to block `g`'s segment (whose steps were `old_steps`, now `solved`) to every
    other block's of the same shape: to all of them at once first (one simulation: a change that lowers the
    peak lowers it only once every block has it), else one at a time, each kept when the simulator says it is
    better, until `deadline` (clock.now()) or SAME_SHAPE_MISSES copies in a row that do not help.
    `moved`: (the free ops whose offloading was decided, those offloaded), when offloads were;
    `fusion`: the fusion options decided there (each copied to the option of the same steps).

    `solved` is the run the segment search spliced in, not block g's segment as `segments` finds it in the
    new plan: a step that reads no forward value belongs to the run before it there, so one moved to the
    segment's start fell out of it, and every copy then missed that op (80 Llama layers at 40%: 936 copies
    refused, none made)."""
    segs_now = {s[2]: s for s in segments(problem, sim, groups)}
    steps = sim.steps  # segment positions refer to this plan; later copies are found by content (replace_run)
    old_index = {s: i for i, s in enumerate(old_steps)}
    copies = []  # (the other block's segment now, its steps with the change, offloads, fusion options)
    for h in groups.blocks:
        if h == g or h not in segs_now:
            continue
        ha, hb, _ = segs_now[h]
        target_old = steps[ha:hb]
        if not same_shape(problem, old_steps, target_old):
            continue
        fw_map = dict(zip(groups.members[g], groups.members[h]))
        mapped = translate(solved, old_index, target_old, fw_map)
        if mapped is not None:
            copies.append((target_old, mapped, map_offloads(problem, moved, fw_map),
                           map_fusion(problem, fusion, old_index, target_old)))
    if len(copies) > 1:
        at_once = _all_copies(problem, sim, copies)
        if at_once is not None:
            try:
                tsim = simulate(problem, at_once)
            except ScheduleError as e:
                reject(log, "candidate(s) rejected in the segment search (a copy to every repeated block)", e)
            else:
                if better(tsim, sim, budget):
                    return at_once, tsim
    misses = 0
    for target_old, mapped, offloads, fused in copies:
        if (deadline is not None and clock.now() >= deadline) or misses >= SAME_SHAPE_MISSES:
            break
        trial = replace_run(problem, sim, target_old, mapped, offloads, fusion=fused)
        misses += 1  # reset by a copy that helps
        if trial is None:
            continue
        try:
            tsim = simulate(problem, trial)
        except ScheduleError as e:  # the copy does not run in that block's plan: it keeps its own
            reject(log, "candidate(s) rejected in the segment search (a copy to a repeated block)", e)
            continue
        if better(tsim, sim, budget):
            sched, sim, misses = trial, tsim, 0
    return sched, sim


def _all_copies(problem: Problem, sim: SimResult, copies: list) -> Schedule | None:
    """The plan of `sim` with every copy made (their offloads too), None where one's run is not found.
    Each splice needs only the steps, offloads and formed options of the plan before it: those of the last
    schedule stand in for a simulation (`_Steps`)."""
    plan = sim
    sched = None
    for target_old, mapped, offloads, fused in copies:
        sched = replace_run(problem, plan, target_old, mapped, offloads, fusion=fused)
        if sched is None:
            return None
        plan = _Steps.of(problem, sched)
    return sched


class _Steps:
    """What `splice` reads of a simulation (steps, forward length, offloads' prefetch steps, formed options),
    from a schedule not simulated."""

    def __init__(self, n_fw: int, steps: list, offloads: dict, formed: tuple):
        self.n_forward_steps, self.steps, self.offloads, self.formed = n_fw, steps, offloads, formed

    @classmethod
    def of(cls, problem: Problem, sched: Schedule) -> _Steps:
        n_fw = len(sched.fw_order)
        return cls(n_fw, schedule_steps(problem, sched), {t: _Prefetch(n_fw + k) for t, k in sched.offload.items()},
                   sched.formed)


class _Prefetch:
    def __init__(self, prefetch: int):
        self.prefetch = prefetch


def same_shape(problem: Problem, src_steps, dst_steps) -> bool:
    """Whether two segments are the same sequence of op shapes (recomputations at the same places)."""
    return len(src_steps) == len(dst_steps) and all(
        r1 == r2 and op_signature(problem, o1) == op_signature(problem, o2)
        for (o1, r1), (o2, r2) in zip(src_steps, dst_steps)
    )


def translate(solved, old_index: dict, target_old: list, fw_map: dict) -> list | None:
    """The solved segment's steps as the other block's (`old_index`: step -> place in the segment it was
    solved from): its recomputations through `fw_map`, its other steps through their place in the old
    segment. None when a step has no counterpart."""
    out = []
    for o, rc in solved:
        if rc and o in fw_map:
            out.append((fw_map[o], True))
        elif not rc and (o, rc) in old_index:
            out.append(target_old[old_index[(o, rc)]])
        else:
            return None
    return out


def map_offloads(problem: Problem, moved, fw_map: dict) -> tuple[set[int], set[int]] | None:
    """(tensors whose offloading is redecided, tensors offloaded) in the block `fw_map` leads to."""
    if moved is None:
        return None
    free, offloaded = moved
    if any(f not in fw_map for f in free):
        return None
    outs = {t for f in free for t in problem.ops[fw_map[f]].outputs}
    return outs, {t for f in offloaded for t in problem.ops[fw_map[f]].outputs}


def map_fusion(problem: Problem, fusion: dict[int, bool] | None, old_index: dict, target_old: list,
               ) -> dict[int, bool] | None:
    """Fusion decisions of one segment (whose steps index as `old_index`) for the segment `target_old`:
    each option's decision given to the option made of the same steps there, when there is one."""
    if not fusion:
        return None
    by_members = {frozenset(o.members): j for j, o in enumerate(problem.fusion_options)}
    out = {}
    for j, formed in fusion.items():
        steps = [old_index.get((o, False)) for o in problem.fusion_options[j].members]
        if None in steps:
            continue
        k = by_members.get(frozenset(target_old[i][0] for i in steps))
        if k is not None:
            out[k] = formed
    return out


def _runs_at(steps: list, run: list, start: int):
    """Where `run` occurs in `steps` at or after `start`, first to last (found from its first step by
    `list.index`, not a slice compared at every position)."""
    last = len(steps) - len(run)
    if not run:
        yield from range(start, last + 1)
        return
    k = start
    while k <= last:
        try:
            k = steps.index(run[0], k, last + 1)
        except ValueError:
            return
        if steps[k:k + len(run)] == run:
            yield k
        k += 1


def replace_run(problem: Problem, sim: SimResult, old: list, new: list, offloads=None, *,
                fusion: dict[int, bool] | None = None) -> Schedule | None:
    """The plan with the run of steps `old` (found in its backward) replaced by `new`; `offloads`:
    (tensors whose offloading is redecided, those offloaded: prefetched ahead of the run); `fusion`:
    fusion options decided anew (see `splice`)."""
    n_fw = sim.n_forward_steps
    steps = sim.steps
    for k in _runs_at(steps, old, n_fw):
            bw = steps[n_fw:k] + new + steps[k + len(old):]
            if len(set(bw)) != len(bw):
                return None
            if offloads is None:
                return splice(problem, sim, k, k + len(old), new, fusion=fusion)
            redecided, off = offloads
            back = prefetch_step(problem, sim, k, sum(problem.tensors[t].bytes for t in off)) if off else k
            return splice(problem, sim, k, k + len(old), new, redecided, dict.fromkeys(off, back), fusion=fusion)
    return None
