"""Offload planning: copy saved activations to the host where that costs less time than recomputing them.

A copy to the host and back is free when both directions hide behind compute, and
a recomputation never is; but copies share one queue per direction, so offloading
everything stalls. The planner starts from recompute-only plans at a ladder of
budgets between the requested one and the unplanned peak (less recomputation the
higher the rung), then offloads saved activations live at the peak, least exposed
copy time per byte first, until the requested budget holds. The simulator decides
every step, so what comes out fits and its time counts every stall.
"""

from __future__ import annotations


from .heuristics import greedy_recompute, place_recomputes, prune_recomputes
from .incumbent import NOTHING_FITS, better
from ..model.problem import Problem, Schedule, TensorKind
from ..model.simulator import SimResult, simulate
from ..model import clock

LADDER = (1.0, 0.75, 0.5, 0.25, 0.0)  # rungs: share of the way from the budget to the unplanned peak
LEADS = (1.0, 2.0)  # prefetch early enough to hide this many copy times behind compute
CANDIDATES_PER_ROUND = 6


def prefetch_position(problem: Problem, sim: SimResult, tensor: int, lead: float = 1.0) -> int:
    """The latest backward position whose compute before `tensor`'s first backward reader lasts `lead` copy times."""
    first = next(k for k in range(sim.n_forward_steps, len(sim.steps)) if (tensor, False) in sim.reads[k])
    return _ahead_of(problem, sim, tensor, first, lead)


def prefetch_positions(problem: Problem, sim: SimResult, tensors: frozenset[int], lead: float = 1.0) -> dict[int, int]:
    """`prefetch_position` of each of `tensors` that the backward reads, in one pass over the backward's steps."""
    first: dict[int, int] = {}
    for k in range(sim.n_forward_steps, len(sim.steps)):
        for t, recomputed in sim.reads[k]:
            if not recomputed and t in tensors:
                first.setdefault(t, k)
    return {t: _ahead_of(problem, sim, t, k, lead) for t, k in first.items()}


def _ahead_of(problem: Problem, sim: SimResult, tensor: int, first: int, lead: float) -> int:
    """The backward position `lead` copy times of `tensor` ahead of step `first`."""
    seconds = lead * problem.tensors[tensor].bytes / problem.host_bw
    return step_with_compute_before(problem, sim, first, seconds) - sim.n_forward_steps


def step_with_compute_before(problem: Problem, sim: SimResult, k: int, seconds: float) -> int:
    """The latest step (not before the backward) whose compute up to step `k` lasts `seconds`."""
    ahead = 0.0
    while k > sim.n_forward_steps and ahead < seconds:
        k -= 1
        ahead += problem.ops[sim.steps[k][0]].time_s
    return k


def _offloadable_at_peak(problem: Problem, sim: SimResult, host_left: int) -> list[int]:
    """Saved activations whose forward copy is on the device at the peak, largest first."""
    k = sim.peak_step
    out = {
        lt.tensor
        for lt in sim.lifetimes
        if lt.start <= k <= lt.end and not lt.recomputed and not lt.prefetched
    }
    saved = set(sim.saved)
    ok = [
        t
        for t in out
        if t in saved
        and t not in sim.offloads
        and problem.tensors[t].kind is TensorKind.ACTIVATION
        and problem.tensors[t].offloadable
        and problem.tensors[t].bytes <= host_left
    ]
    return sorted(ok, key=lambda t: (-problem.tensors[t].bytes, t))


def add_offloads(problem: Problem, schedule: Schedule, budget: int, deadline: float | None = None) -> Schedule | None:
    """Offload saved activations of `schedule` until its simulated peak fits `budget` (None if it cannot)."""
    sched, sim = offload_towards(problem, schedule, budget, deadline)
    return _drop_needless(problem, sched, sim, budget) if sim.peak_bytes <= budget else None


def offload_towards(problem: Problem, schedule: Schedule, budget: int,
                    deadline: float | None = None) -> tuple[Schedule, SimResult]:
    """Offload saved activations live at the peak, least exposed copy time per byte freed first, until the
    peak fits `budget`; the plan reached and its simulation (over budget when no offload lowers it further,
    the deadline passed or the host is full: then the lowest peak it passed through)."""
    sched = schedule
    sim = simulate(problem, sched)
    if problem.host_bw <= 0:
        return sched, sim
    host_cap = problem.host_budget_bytes if problem.host_budget_bytes is not None else float("inf")
    lowest = (sched, sim)
    while sim.peak_bytes > budget:
        if deadline is not None and clock.now() > deadline:
            break
        best = None  # (key, schedule, sim)
        for t in _offloadable_at_peak(problem, sim, host_cap - sim.host_bytes)[:CANDIDATES_PER_ROUND]:
            for lead in LEADS:
                offload = {**sched.offload, t: prefetch_position(problem, sim, t, lead)}
                trial = Schedule(sched.fw_order, sched.bw_order, offload, sched.formed)
                tsim = simulate(problem, trial)
                freed = sim.peak_bytes - tsim.peak_bytes
                if freed <= 0 and tsim.peak_step == sim.peak_step:
                    continue
                key = ((tsim.time_s - sim.time_s) / max(freed, 1), -freed, tsim.time_s)
                if best is None or key < best[0]:
                    best = (key, trial, tsim)
        if best is None:
            return lowest
        _key, sched, sim = best
        if better(sim, lowest[1], NOTHING_FITS):
            lowest = (sched, sim)
    return (sched, sim) if sim.peak_bytes <= budget else lowest


def _drop_needless(problem: Problem, sched: Schedule, sim: SimResult, budget: int) -> Schedule:
    """Take back offloads the budget does not need (no faster without them, but less traffic and host memory)."""
    for t in sorted(sched.offload, key=lambda t: problem.tensors[t].bytes):
        rest = {u: j for u, j in sched.offload.items() if u != t}
        trial = Schedule(sched.fw_order, sched.bw_order, rest)
        tsim = simulate(problem, trial)
        if tsim.peak_bytes <= budget and tsim.time_s <= sim.time_s + 1e-12:
            sched, sim = trial, tsim
    return sched


def mix_offload_and_recompute(
    problem: Problem,
    fw_order: list[int],
    bw_order: list[int],
    budget: int,
    deadline: float | None = None,
    lowest: set[int] | None = None,
) -> list[Schedule]:
    """Plans in this order that reach `budget` with offloads on top of less recomputation than it needs alone.

    `bw_order` lists backward ops only. One plan per rung of LADDER that fits, and one
    that offloads on top of `lowest` (the lowest-peak recompute set known), for budgets
    recomputation alone cannot reach. When none fits, the lowest-peak plans offloading reached
    instead (over budget: the incumbent keeps the lowest, a start for the segment search and the
    lowest peak an error reports).
    """
    if problem.host_bw <= 0:
        return []
    top = simulate(problem, place_recomputes(problem, fw_order, bw_order, ())).peak_bytes
    if top <= budget:
        return []  # nothing to decide: the plan without recomputation fits
    out: list[Schedule] = []
    over: list[Schedule] = []  # the lowest plan each start reached, over budget
    tried: set[frozenset[int]] = set()

    def offload_on(kept: set[int]) -> None:
        tried.add(frozenset(kept))
        sched, sim = offload_towards(problem, place_recomputes(problem, fw_order, bw_order, kept), budget, deadline)
        if sim.peak_bytes <= budget:
            out.append(_drop_needless(problem, sched, sim, budget))
        else:
            over.append(sched)

    for share in LADDER:
        if deadline is not None and clock.now() > deadline:
            break
        rung = int(budget + share * (top - budget))
        start = greedy_recompute(problem, rung if share < 1.0 else None, fw_order, bw_order, deadline=deadline)
        if simulate(problem, start).peak_bytes > rung:
            continue
        kept = prune_recomputes(problem, rung, fw_order, bw_order, set(start.recomputed(problem)), deadline=deadline)
        if frozenset(kept) not in tried:
            offload_on(kept)
    if not out and lowest is not None and frozenset(lowest) not in tried:
        offload_on(set(lowest))
    return out or over


def offload_all(problem: Problem) -> Schedule:
    """Every offloadable saved activation to the host, each prefetched one copy time ahead of its reader.

    The budget-blind policy of activation-offloading wrappers (torchtune's, for one): a
    baseline to compare with, not a plan the solver would pick. Within a host budget it
    takes them in the order they are made until the next one no longer fits.
    """
    sched = place_recomputes(problem, [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops], ())
    if problem.host_bw <= 0:
        return sched
    sim = simulate(problem, sched)
    movable = [
        t for t in sim.saved
        if problem.tensors[t].kind is TensorKind.ACTIVATION and problem.tensors[t].offloadable
    ]
    room = problem.host_budget_bytes if problem.host_budget_bytes is not None else float("inf")
    chosen = {}
    for t in sorted(movable, key=lambda t: sim.spans[(t, False)][0]):
        if problem.tensors[t].bytes > room:
            break
        room -= problem.tensors[t].bytes
        chosen[t] = prefetch_position(problem, sim, t)
    return Schedule(sched.fw_order, sched.bw_order, chosen)
