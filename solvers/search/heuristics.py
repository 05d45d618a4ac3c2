"""Fast heuristics: warm starts for CP-SAT, fallbacks, and baselines to compare with."""

from __future__ import annotations

from collections.abc import Iterable

from ..model.problem import TANGENTS, Problem, Schedule, TensorKind
from ..model.liveness import recompute_candidates
from ..model.simulator import simulate
from ..model import clock


def place_recomputes(problem: Problem, fw_order: list[int], bw_order: list[int], recompute: Iterable[int]) -> Schedule:
    """Insert each recomputed forward op just before the first backward step that needs it.

    `bw_order` lists backward ops only. A recomputation whose inputs are recomputed
    too pulls those in first (depth first), so the result is always runnable.
    """
    todo = set(recompute)
    done: set[int] = set()
    out: list[int] = []

    def need(op_id: int) -> None:
        for t in problem.ops[op_id].inputs:
            p = problem.tensors[t].producer
            if p is not None and p in todo and p not in done:
                done.add(p)
                need(p)
                out.append(p)

    for b in bw_order:
        need(b)
        out.append(b)
    return Schedule(fw_order=list(fw_order), bw_order=out)


def base_orders(problem: Problem, schedule: Schedule) -> tuple[list[int], list[int]]:
    """The schedule's forward order and its backward order without recomputations (what `place_recomputes`
    takes)."""
    bw = [o for o in schedule.bw_order if problem.ops[o].phase.value == "bw"]
    return list(schedule.fw_order), bw


def greedy_forward_order(problem: Problem) -> list[int]:
    """Topological order of the forward that runs, at each step, the ready op that grows memory least.

    Growth = bytes it allocates minus bytes it lets go (inputs whose last reader it is).
    Ties keep program order. This is what turns Thunder's memory-blind order back
    into the 0.75 MiB one on the seed functions.
    """
    fw = problem.fw_ops
    fw_ids = {o.id for o in fw}
    readers: dict[int, set[int]] = {t.id: set() for t in problem.tensors}
    for o in problem.ops:
        for t in o.inputs:
            readers[t].add(o.id)
    pending_readers = {t: set(r) for t, r in readers.items()}
    freeable = {
        t.id
        for t in problem.tensors
        if t.kind is TensorKind.ACTIVATION
        and t.id not in problem.visible
        and not (readers[t.id] - fw_ids)  # read in the backward: stays anyway
    }
    deps = {o.id: {problem.tensors[t].producer for t in o.inputs} & fw_ids for o in fw}
    users: dict[int, set[int]] = {o.id: set() for o in fw}
    for o, ds in deps.items():
        for d in ds:
            users[d].add(o)
    missing = {o: len(ds) for o, ds in deps.items()}

    def growth(o: int) -> int:
        op = problem.ops[o]
        alloc = sum(problem.tensors[t].bytes for t in op.outputs)
        freed = sum(problem.tensors[t].bytes for t in op.inputs if t in freeable and pending_readers[t] == {o})
        return alloc - freed

    order: list[int] = []
    ready = {o for o, n in missing.items() if n == 0}
    while ready:
        best = min(ready, key=lambda o: (growth(o), o))
        ready.discard(best)
        order.append(best)
        for t in problem.ops[best].inputs:
            pending_readers[t].discard(best)
        for u in users[best]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.add(u)
    return order


def greedy_recompute(
    problem: Problem,
    budget: int | None,
    fw_order: list[int] | None = None,
    bw_order: list[int] | None = None,
    max_rounds: int | None = None,
    start: set[int] | None = None,
    deadline: float | None = None,
) -> Schedule:
    """Recompute saved activations, best bytes-per-second first, until the simulated peak fits.

    Each round scores every saved activation live at the current peak by
    (bytes freed at the peak) / (recompute time), recomputes the best one's producer,
    and re-simulates. Returns the lowest-peak schedule seen if the budget is never met.
    `start`: recomputations to begin from; `deadline`: a clock.now() to stop at.
    """
    fw_order = list(fw_order) if fw_order is not None else [o.id for o in problem.fw_ops]
    bw_order = list(bw_order) if bw_order is not None else [o.id for o in problem.bw_ops]
    candidates = set(recompute_candidates(problem))
    chosen: set[int] = set(start or ())
    best = place_recomputes(problem, fw_order, bw_order, chosen)
    if budget is None and not chosen:  # no budget: nothing is worth recomputing
        return best
    sched, sim = best, simulate(problem, best)
    best_peak = sim.peak_bytes
    rounds = max_rounds if max_rounds is not None else len(candidates) + 1
    for _ in range(rounds):
        if budget is not None and sim.peak_bytes <= budget:
            return sched
        if deadline is not None and clock.now() > deadline:
            break
        k = sim.peak_step
        at_peak = [lt for lt in sim.lifetimes if lt.start <= k <= lt.end and not lt.recomputed and lt.tensor in sim.saved]
        scored = []
        for lt in at_peak:
            p = problem.tensors[lt.tensor].producer
            if p in candidates and p not in chosen:
                scored.append((problem.tensors[lt.tensor].bytes / (problem.ops[p].time_s + 1e-9), p))
        if not scored:
            break
        scored.sort(reverse=True)
        improved = False
        for _score, p in scored[:4]:  # the best few, in case one does not lower the peak
            trial = place_recomputes(problem, fw_order, bw_order, chosen | {p})
            trial_sim = simulate(problem, trial)
            if trial_sim.peak_bytes < sim.peak_bytes or (
                trial_sim.peak_bytes == sim.peak_bytes and trial_sim.peak_step != sim.peak_step
            ):
                chosen.add(p)
                sched, sim = trial, trial_sim
                improved = True
                break
        if not improved:
            chosen.add(scored[0][1])
            sched = place_recomputes(problem, fw_order, bw_order, chosen)
            sim = simulate(problem, sched)
        if sim.peak_bytes < best_peak:
            best, best_peak = sched, sim.peak_bytes
    return sched if budget is not None and sim.peak_bytes <= budget else best


def full_recompute(problem: Problem) -> Schedule:
    """Recompute every candidate: the lowest-memory end of the recompute-only range."""
    return place_recomputes(
        problem, [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops], recompute_candidates(problem)
    )


def lower_bound_peak(problem: Problem, joint: bool = False) -> int:
    """A peak no plan of this problem can go below (every order, save/recompute/offload choice, storage reuse
    and set of formed fusion options the simulator accepts; see `peak_bound`): the larger of the simple
    bound (inputs, plus any one op's operands and scratch, or the step's outputs at the end, or, when the
    caller computes a loss between forward and backward, its memory with the tangents it makes) and
    `peak_bound.step_bound` (what must be live together at each op's step, minimized by a cut over the
    choices around it). Values a fusion option may keep inside its kernel count 0, and an op in an option
    the smaller of its scratch and the option's. Its work is counted on the solvers' clock. `joint`: with the
    joint family (`peak_bound.step_bound`), as the solve asks for it inside its time limit."""
    from .peak_bound import step_bound

    return max(simple_peak_bound(problem), step_bound(problem, joint))


def simple_peak_bound(problem: Problem) -> int:
    """The simple part of `lower_bound_peak`: inputs plus the largest of one op's operands and scratch, the
    step's outputs, the caller's loss with the tangents."""
    from .peak_bound import fused_sizes, fused_workspaces

    size, ws = fused_sizes(problem), fused_workspaces(problem)
    inputs = sum(t.bytes for t in problem.tensors if t.kind is TensorKind.INPUT)
    act = lambda ids: sum(size[t] for t in set(ids) if problem.tensors[t].kind is not TensorKind.INPUT)  # noqa: E731
    best = act(problem.outputs)
    caller = [t.id for t in problem.tensors if t.kind is TensorKind.CALLER]
    if caller and problem.has_backward:
        best = max(best, act(caller + [t.id for t in problem.tensors if t.kind in TANGENTS]))
    for op in problem.ops:
        # an output written into an input's storage shares its bytes: count the larger saving (all, together)
        reused = [problem.tensors[i].bytes for _o, i in op.reuse]
        shared = sum(reused) if op.reuse_all else max(reused, default=0)  # reuse_all: every pair at once
        best = max(best, act(op.inputs + op.outputs) - shared + ws[op.id])
    return inputs + best


def prune_recomputes(
    problem: Problem,
    budget: int,
    fw_order: list[int],
    bw_order: list[int],
    recompute: set[int],
    deadline: float | None = None,
) -> set[int]:
    """Drop recomputations the budget does not need, most expensive first, checking each with the simulator.

    Models that count memory conservatively (or repairs that add margins) leave some
    recomputation that buys nothing; this takes it back.
    """
    chosen = set(recompute)
    for o in sorted(chosen, key=lambda o: -problem.ops[o].time_s):
        if deadline is not None and clock.now() > deadline:
            break
        trial = chosen - {o}
        if simulate(problem, place_recomputes(problem, fw_order, bw_order, trial)).peak_bytes <= budget:
            chosen = trial
    return chosen
