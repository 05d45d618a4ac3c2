"""Solving strategy: heuristics to start, CP-SAT to improve and bound, the simulator to decide.

Every candidate plan is replayed by the simulator; the answer is the fastest one
whose simulated peak fits the budget (lowest peak among equally fast ones), so no
plan over budget ever leaves this module.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

from ..cpsat.order import solve_order
from ..cpsat.remat import min_peak_remat, solve_remat
from .heuristics import (
    greedy_forward_order,
    greedy_recompute,
    lower_bound_peak,
    place_recomputes,
    prune_recomputes,
    recompute_candidates,
)
from ..model.problem import Problem, Schedule, SolveStats, collecting_rejections, default_schedule, reject
from ..cpsat.bound import solve_bound_and_repair
from .offload import mix_offload_and_recompute
from ..model import clock
from ..progress import Display, ProgressLine
from .blocks import find_groups
from .fusion_groups import merge_formed
from .segments import improve_by_segments
from .chain import MIN_BLOCKS, improve_by_chain
from .reorder import base_orders, refine_order
from ..model.simulator import ScheduleError, SimResult, simulate

log = logging.getLogger(__name__)

EXACT_ORDER_MAX_OPS = 300  # the exact order model proves optimality up to about this size
INTERVAL_MODEL_MAX_OPS = 200  # the interval save/recompute model finds good plans up to about this size
GAP_TARGET = 0.002  # stop searching once a plan is provably within 0.2% of the step time
SEARCH_SHARE = 0.75  # of the time limit, for finding plans; the rest certifies the bound (certify), but
# CHAIN_SHARE of it for the chain step
OFFLOAD_SHARE = 0.2  # of the time limit, within SEARCH_SHARE, for mixing in offloads when allowed
WHOLE_PROGRAM_SHARE = 0.55  # of the search time, for the whole-program models; the segment search has the rest
TIGHT_BUDGET = 0.5  # below this share of the unplanned peak, the segment search runs first
EARLY_SEGMENT_SHARE = 0.6  # of the search time, for that first segment search
CHAIN_SHARE = 0.15  # of the time limit, after the search (from the certification's share), for per-block
# options combined along the chain
CHAIN = True  # combine per-block options along the chain (search/chain.py) after the segment search
TIME_LIMIT_USED = 0.95  # a search that used this much of its limit was ended by it
LOWEST_REPORTED_SIZE = 32  # problems whose lowest-peak plan an error reported are remembered (this process)
_LOWEST_REPORTED: OrderedDict[str, Schedule] = OrderedDict()


class BudgetInfeasibleError(Exception):
    """No plan found within the budget. Carries the lowest peak found and a proven lower bound.

    `proven`: the budget is below the bound, so no plan can fit. Otherwise a plan may exist
    between the bound and the lowest peak found; `PlanningTimeLimitError` (a subclass) says the
    time limit ended the search, this class alone that the search ended by itself.
    """

    def __init__(
        self, budget_bytes: int, lowest_peak_bytes: int, lower_bound_bytes: int, lowest_schedule: Schedule | None = None,
        *, elapsed_s: float | None = None, time_limit_s: float | None = None,
    ):
        self.budget_bytes = budget_bytes
        self.lowest_peak_bytes = lowest_peak_bytes
        self.lowest_schedule = lowest_schedule  # a plan that reaches lowest_peak_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.elapsed_s = elapsed_s
        self.time_limit_s = time_limit_s
        super().__init__(self._message())

    @property
    def proven(self) -> bool:
        """No plan can fit: the budget is below a peak every plan reaches."""
        return self.budget_bytes < self.lower_bound_bytes

    @property
    def peak_gap(self) -> float:
        """(lowest peak found - bound) / lowest peak found: how far the search may be from the lowest peak."""
        if self.lowest_peak_bytes <= 0:
            return 0.0
        return max(0.0, (self.lowest_peak_bytes - self.lower_bound_bytes) / self.lowest_peak_bytes)

    def _message(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        found = f"the lowest peak found is {mib(self.lowest_peak_bytes)}"
        if self.proven:
            return f"no plan fits {mib(self.budget_bytes)}, and none can: every plan needs at least {mib(self.lower_bound_bytes)} ({found})"
        took = f" after {self.elapsed_s:.1f}s" if self.elapsed_s is not None else ""
        return (
            f"no plan fits {mib(self.budget_bytes)}: none found{took}; {found}, and no plan can go below "
            f"{mib(self.lower_bound_bytes)} (gap {self.peak_gap:.1%}); the search ended before its time limit, "
            "so a larger one is unlikely to help"
        )


class PlanningTimeLimitError(BudgetInfeasibleError):
    """The time limit ended the search before a plan within the budget was found: one may exist."""

    def _message(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        return (
            f"no plan fits {mib(self.budget_bytes)} within the time limit: it ended the search ({self.time_limit_s:g}s, "
            f"{self.elapsed_s:.1f}s used) before one was found; the lowest peak found is {mib(self.lowest_peak_bytes)} and no "
            f"plan can go below {mib(self.lower_bound_bytes)} (gap {self.peak_gap:.1%}); a larger time_limit_s may find one"
        )


@dataclass
class Solution:
    schedule: Schedule
    sim: SimResult
    stats: SolveStats
    baseline: SimResult  # the program as captured, unplanned
    budget_bytes: int | None
    lower_bound_bytes: int


def _better(a: SimResult, b: SimResult | None) -> bool:
    return b is None or (round(a.time_s, 12), a.peak_bytes) < (round(b.time_s, 12), b.peak_bytes)


def _fits(sim: SimResult, budget: int | None) -> bool:
    return budget is None or sim.peak_bytes <= budget


def solve(
    problem: Problem,
    budget_bytes: int | None,
    *,
    time_limit_s: float = 5.0,
    workers: int | None = None,
    progress: bool | Display = False,
    deterministic: bool = False,
) -> Solution:
    """Plan `problem` under `budget_bytes` (None: fastest, then lowest peak).

    Training steps: whole-program save/recompute models (the interval model up to
    INTERVAL_MODEL_MAX_OPS ops, alternated with reordering; above, the relaxation-and-repair
    model), then the segment search (each block's backward planned whole: order and
    save/recompute together, copied to repeated blocks), then offloading when allowed. The
    reported time bound is the relaxation's for the order the plan runs in: valid over every
    save/recompute(/offload) plan in that order, and "OPTIMAL" only when the plan meets it.
    `deterministic`: the same plan on every run (solvers/model/clock.py); the time limit counts work.
    """
    with clock.deterministic(deterministic), _caller_heap_frozen(), collecting_rejections() as rejected:
        sol = _solve(problem, budget_bytes, time_limit_s, workers, progress)
    sol.stats.notes += rejected.notes()  # the candidates the search dropped on an error, counted per kind
    return sol


@contextmanager
def _caller_heap_frozen():
    """The caller's objects are left out of garbage collection while we solve: a captured graph with its
    fake tensors is millions of objects, and every full collection scanned them all (Llama 80 layers,
    plan_offline at 40%: 56.6 s -> 40.9 s, the same plan). Not when the caller froze objects itself:
    unfreezing would release theirs."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _solve(problem: Problem, budget_bytes: int | None, time_limit_s: float, workers: int | None, progress) -> Solution:
    wall0, t0 = time.perf_counter(), clock.now()
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    baseline = simulate(problem, default_schedule(problem))
    lower = lower_bound_peak(problem)
    line = ProgressLine(f"planning {len(problem.ops)} ops", enabled=progress is not False,
                        display=None if isinstance(progress, bool) else progress)
    try:
        cut = False
        if problem.has_backward:
            offload = problem.host_bw > 0 and budget_bytes is not None
            search_s = (SEARCH_SHARE - OFFLOAD_SHARE if offload else SEARCH_SHARE) * time_limit_s
            whole_s = search_s * (WHOLE_PROGRAM_SHARE if budget_bytes is not None else 1.0)
            early = None
            small = len(problem.ops) <= INTERVAL_MODEL_MAX_OPS
            if small and budget_bytes is not None and budget_bytes < TIGHT_BUDGET * baseline.peak_bytes:
                # tight: the segment search from the program as captured first (whole-program models
                # tend to recompute the chain between blocks there)
                line.note("planning block by block")
                early, cut = improve_by_segments(problem, default_schedule(problem), budget_bytes,
                                                 deadline=t0 + EARLY_SEGMENT_SHARE * search_s, workers=workers)
                whole_s = search_s * WHOLE_PROGRAM_SHARE - (clock.now() - t0)
            if len(problem.ops) <= INTERVAL_MODEL_MAX_OPS:
                best, stats, lowest = _solve_training(problem, budget_bytes, whole_s, workers)
            else:
                best, stats, lowest = _solve_training_scalable(problem, budget_bytes, whole_s, workers, line)
            if early is not None:
                best, stats, lowest = _merge(problem, budget_bytes, best, stats, lowest, early)
            if offload:  # a first offloading plan from the greedy ladder, for the segment search to refine
                line.note("mixing offload and recomputation")
                ladder_end = min(clock.now() + OFFLOAD_SHARE * time_limit_s, t0 + SEARCH_SHARE * time_limit_s)
                best, stats, lowest = _with_offloads(problem, budget_bytes, best, stats, lowest, ladder_end)
            if budget_bytes is not None:
                line.note("planning block by block")
                best, stats, lowest, cut_late = _by_segments(problem, budget_bytes, best, stats, lowest,
                                                             t0 + SEARCH_SHARE * time_limit_s, workers, offload=offload)
                if CHAIN and len(find_groups(problem).blocks) >= MIN_BLOCKS:
                    # its time comes from the certification's share (which rarely needs all of it), so the
                    # search above is the same with or without it: the plan is never worse
                    line.note("combining block options along the chain")
                    chain_end = min(clock.now(), t0 + SEARCH_SHARE * time_limit_s) + CHAIN_SHARE * time_limit_s
                    best, stats, lowest = _by_chain(problem, budget_bytes, best, stats, lowest, chain_end, workers,
                                                    offload)
                cut = cut or cut_late
            if best is None and budget_bytes is not None:
                best, stats, lowest = _reported_lowest(problem, budget_bytes, best, stats, lowest)
            if offload and best is not None:
                _weaken_to_offload_space(problem, stats)
            if best is not None and budget_bytes is not None:
                certify(problem, best, budget_bytes, stats, time_limit_s - (clock.now() - t0), workers)
        else:
            best, stats = _solve_forward_only(problem, time_limit_s, workers)
            lowest = best
        sim = simulate(problem, best) if best is not None else None
        if sim is None or not _fits(sim, budget_bytes):
            line.close()
            used = clock.now() - t0
            error = PlanningTimeLimitError if cut or used >= TIME_LIMIT_USED * time_limit_s else BudgetInfeasibleError
            if budget_bytes is not None and problem.has_backward:
                _remember_lowest(problem, lowest)
            raise error(budget_bytes or 0, simulate(problem, lowest).peak_bytes, lower, lowest,
                        elapsed_s=time.perf_counter() - wall0, time_limit_s=time_limit_s)
        stats.wall_s = time.perf_counter() - wall0
        line.close(f"{stats.status}, estimated {stats.objective_s * 1e3:.2f} ms, gap {stats.gap:.2%}, {stats.wall_s:.1f}s")
    except BaseException:  # Ctrl-C or an error: the live line must not outlive the solve
        line.close()
        raise
    return Solution(best, sim, stats, baseline, budget_bytes, lower)


def _merge(problem: Problem, budget: int, best: Schedule | None, stats: SolveStats, lowest: Schedule, other: Schedule,
           method: str | None = None):
    """(best, its stats, lowest) with one more plan considered."""
    kept_best = None if best is None else _Candidate(best, simulate(problem, best), stats)
    kept_lowest = _Candidate(lowest, simulate(problem, lowest), stats)
    sim = simulate(problem, other)
    method = method or "segment search (order and save/recompute per block)"
    cand = _Candidate(other, sim, _heuristic_stats(problem, sim, method))
    kept_best, kept_lowest = _keep(kept_best, kept_lowest, cand, budget)
    if kept_best is None:
        return None, stats, kept_lowest.schedule
    return kept_best.schedule, kept_best.stats, kept_lowest.schedule


def _by_segments(
    problem: Problem, budget: int, best: Schedule | None, stats: SolveStats, lowest: Schedule, deadline: float,
    workers: int, offload: bool = False,
) -> tuple[Schedule | None, SolveStats, Schedule, bool]:
    """The segment search from the plan found when it fits (to make it faster), else from the lowest
    plan found (to make one fit); `offload`: segments decide offloads too. Last: whether the deadline
    cut it short."""
    if deadline - clock.now() < 0.1:
        return best, stats, lowest, True
    found, cut = improve_by_segments(problem, best if best is not None else lowest, budget, deadline=deadline,
                                     workers=workers, offload=offload)
    method = "segment search (order, save/recompute and offload per block)" if offload else None
    return (*_merge(problem, budget, best, stats, lowest, found, method), cut)


def _by_chain(
    problem: Problem, budget: int, best: Schedule | None, stats: SolveStats, lowest: Schedule, deadline: float,
    workers: int, offload: bool,
) -> tuple[Schedule | None, SolveStats, Schedule]:
    """Per-block options combined along the chain (search/chain.py) from the plan found (or the lowest),
    then the segment search again from its answer if time is left; kept only when the simulator says better."""
    start = best if best is not None else lowest
    if deadline - clock.now() < 0.1:
        return best, stats, lowest
    found = improve_by_chain(problem, start, budget, deadline=deadline, workers=workers, offload=offload)
    if found is start:
        return best, stats, lowest
    if deadline - clock.now() > 0.1:
        found, _cut = improve_by_segments(problem, found, budget, deadline=deadline, workers=workers, offload=offload)
    return _merge(problem, budget, best, stats, lowest, found, "per-block options combined along the chain")


def _structure(problem: Problem) -> str:
    """A key for what decides a plan's memory: ops, storages, sizes, offloading; not op times (two captures
    of one model measure different times but take the same plans)."""
    h = hashlib.sha256()
    for op in problem.ops:
        h.update(repr((op.phase.value, op.inputs, op.outputs, op.recomputable, op.reuse, op.reuse_all,
                       op.workspace_bytes)).encode())
    for t in problem.tensors:
        h.update(repr((t.bytes, t.kind.value, t.producer, t.offloadable)).encode())
    h.update(repr((sorted(problem.outputs), sorted(problem.returned), problem.host_bw > 0,
                   problem.host_budget_bytes)).encode())
    return h.hexdigest()


def _remember_lowest(problem: Problem, schedule: Schedule) -> None:
    key = _structure(problem)
    _LOWEST_REPORTED[key] = schedule
    _LOWEST_REPORTED.move_to_end(key)
    while len(_LOWEST_REPORTED) > LOWEST_REPORTED_SIZE:
        _LOWEST_REPORTED.popitem(last=False)


def _reported_lowest(problem: Problem, budget: int, best, stats, lowest: Schedule):
    """(best, stats, lowest) with the lowest-peak plan an earlier error reported for a problem of this
    structure considered: the search takes other paths at other budgets, and a user who asks for the
    lowest peak an error reported must get that plan."""
    known = _LOWEST_REPORTED.get(_structure(problem))
    if known is None:
        return best, stats, lowest
    try:
        return _merge(problem, budget, best, stats, lowest, known, "the lowest-peak plan an earlier error reported")
    except ScheduleError as e:  # not a plan of this problem after all
        reject(log, "candidate(s) rejected: the lowest-peak plan an earlier error reported for this structure", e)
        return best, stats, lowest


def _solve_forward_only(
    problem: Problem, time_limit_s: float, workers: int, exact_max_ops: int = EXACT_ORDER_MAX_OPS
) -> tuple[Schedule, SolveStats]:
    """Exact order up to `exact_max_ops` ops; above, the greedy order refined by CP-SAT windows."""
    program = [o.id for o in problem.fw_ops]
    greedy = greedy_forward_order(problem)
    orders = {"program": program, "greedy": greedy}
    status, bound_bytes, method = "HEURISTIC", None, "greedy order"
    start = min((program, greedy), key=lambda o: simulate(problem, Schedule(o, [])).peak_bytes)
    if len(program) > exact_max_ops:
        # the greedy order has no lookahead: a path it starts early may only finish late
        refined = refine_order(problem, Schedule(start, []), time_limit_s=time_limit_s, workers=workers, max_rounds=50)
        orders["windows"] = refined.fw_order
        method = "greedy order + cp-sat windows"
    else:
        res = solve_order(problem, hint=start, time_limit_s=time_limit_s, workers=workers)
        if res is not None:
            orders["cp-sat"] = res.order
            status, bound_bytes, method = res.status, res.bound_bytes, "cp-sat exact order"
    best_name, best = None, None
    for name, order in orders.items():
        sim = simulate(problem, Schedule(order, []))
        if best is None or sim.peak_bytes < best[1].peak_bytes:
            best_name, best = name, (Schedule(order, []), sim)
    sched, sim = best
    notes = [f"order from {best_name}"]
    if bound_bytes:
        notes.append(f"peak lower bound {bound_bytes} bytes over all orders")
    stats = SolveStats(status, sim.time_s, sim.time_s, 0.0, 0.0, method, notes)
    return sched, stats


def _solve_training(
    problem: Problem, budget: int | None, time_limit_s: float, workers: int
) -> tuple[Schedule | None, SolveStats, Schedule]:
    """Alternate: save/recompute for a fixed order, then reorder around the peak, then again."""
    deadline = clock.now() + time_limit_s
    bw_order = [o.id for o in problem.bw_ops]
    program = [o.id for o in problem.fw_ops]
    orders = [(program, bw_order, "program order")]
    greedy_fw = greedy_forward_order(problem)
    if greedy_fw != program:
        orders.append((greedy_fw, bw_order, "greedy forward order"))
    best: _Candidate | None = None
    lowest: _Candidate | None = None
    for fw_order, bw, label in orders:
        share = 0.35 * time_limit_s / len(orders)
        for cand in _remat_candidates(problem, budget, fw_order, bw, share, workers, label):
            best, lowest = _keep(best, lowest, cand, budget)
    if best is None:  # over budget in every fixed order: start reordering from the lowest peak instead
        cand = _min_peak_candidate(problem, program, bw_order, 0.15 * time_limit_s, workers, "program order")
        if cand is not None:
            best, lowest = _keep(best, lowest, cand, budget)
    for round_ in range(8):  # reorder around the peak, then re-decide recomputation for the new order
        left = deadline - clock.now()
        if left < 0.2:
            break
        base = best if best is not None else lowest
        refined = refine_order(problem, base.schedule, time_limit_s=0.25 * left, workers=workers)
        rsim = simulate(problem, refined)
        if rsim.peak_bytes >= base.sim.peak_bytes:
            break
        label = f"reordered x{round_ + 1}"
        fw_order, bw = base_orders(problem, refined)
        stats = _heuristic_stats(problem, rsim, f"{base.stats.method}, then {label}")
        best, lowest = _keep(best, lowest, _Candidate(refined, rsim, stats), budget)
        left = deadline - clock.now()
        for cand in _remat_candidates(problem, budget, fw_order, bw, 0.5 * left, workers, label):
            best, lowest = _keep(best, lowest, cand, budget)
        if best is None:  # still over budget: push the peak down as far as this order allows
            cand = _min_peak_candidate(problem, fw_order, bw, 0.3 * (deadline - clock.now()), workers, label)
            if cand is not None:
                best, lowest = _keep(best, lowest, cand, budget)
    if best is None:
        return None, SolveStats("INFEASIBLE", float("inf"), float("inf"), float("inf"), 0.0, "cp-sat"), lowest.schedule
    return best.schedule, best.stats, lowest.schedule


@dataclass
class _Candidate:
    schedule: Schedule
    sim: SimResult
    stats: SolveStats


def _keep(best, lowest, cand: _Candidate, budget: int | None):
    """Update (fastest within budget, lowest peak) with a candidate; CP-SAT's wins ties over heuristics."""
    if _fits(cand.sim, budget):
        if best is None or _better(cand.sim, best.sim) or (
            best.stats.status == "HEURISTIC" and cand.stats.status != "HEURISTIC" and not _better(best.sim, cand.sim)
        ):
            best = cand
    if lowest is None or cand.sim.peak_bytes < lowest.sim.peak_bytes:
        lowest = cand
    return best, lowest


def _heuristic_stats(problem: Problem, sim: SimResult, method: str) -> SolveStats:
    """Without a model solution, the bound is the time of the step with no recomputation at all."""
    bound = sum(o.time_s for o in problem.ops)
    gap = max(0.0, (sim.time_s - bound) / sim.time_s) if sim.time_s else 0.0
    status = "OPTIMAL" if sim.time_s <= bound else "HEURISTIC"  # nothing recomputed: nothing faster exists
    return SolveStats(status, sim.time_s, bound, gap, 0.0, method, ["bound: every plan (each op once)"])


def _min_peak_candidate(
    problem: Problem, fw_order: list[int], bw_order: list[int], time_s: float, workers: int, label: str
) -> _Candidate | None:
    res = min_peak_remat(problem, fw_order, bw_order, time_limit_s=max(0.2, time_s), workers=workers)
    if res is None:
        return None
    sched = place_recomputes(problem, fw_order, bw_order, res[0])
    sim = simulate(problem, sched)
    return _Candidate(sched, sim, _heuristic_stats(problem, sim, f"cp-sat lowest-peak recompute, {label}"))


def _remat_candidates(
    problem: Problem, budget: int | None, fw_order: list[int], bw_order: list[int], time_s: float, workers: int, label: str
) -> list[_Candidate]:
    """The greedy plan and the CP-SAT plan (warm-started from it) for one fixed order."""
    out = []
    heur = greedy_recompute(problem, budget, fw_order, bw_order)
    heur_sim = simulate(problem, heur)
    out.append(_Candidate(heur, heur_sim, _heuristic_stats(problem, heur_sim, f"greedy recompute, {label}")))
    hint = set(heur_sim.recomputed_ops) if _fits(heur_sim, budget) else None
    t_start = time.perf_counter()
    res = solve_remat(problem, fw_order, bw_order, budget, time_limit_s=max(0.2, time_s), workers=workers, hint=hint)
    if res is None or res.status == "INFEASIBLE":
        return out
    kept = prune_recomputes(problem, budget, fw_order, bw_order, res.recompute) if budget is not None else res.recompute
    sched = place_recomputes(problem, fw_order, bw_order, kept)
    sim = simulate(problem, sched)
    repaired = ""
    if not _fits(sim, budget):  # the model's plan is over in the simulator: recompute more, greedily, from it
        fixed = simulate(problem, greedy_recompute(problem, budget, fw_order, bw_order, start=set(kept)))
        if _fits(fixed, budget):
            kept = prune_recomputes(problem, budget, fw_order, bw_order, set(fixed.recomputed_ops))
            sched = place_recomputes(problem, fw_order, bw_order, kept)
            sim, repaired = simulate(problem, sched), " (repaired greedily)"
    base_s = sum(problem.ops[o].time_s for o in fw_order + bw_order)
    bound = base_s  # every op once; the interval model's own bound is not valid (it over-counts memory)
    # the interval model counts memory conservatively: its OPTIMAL proves nothing about the simulator's
    # plans, so the status waits for the relaxation's certificate (certify)
    notes = list(res.notes) + ([f"interval model {res.status} (conservative memory: not a proof)"] if res.status == "OPTIMAL" else [])
    stats = SolveStats(
        status="FEASIBLE",
        objective_s=sim.time_s,
        bound_s=bound,
        gap=max(0.0, (sim.time_s - bound) / sim.time_s) if sim.time_s > 0 else 0.0,
        wall_s=time.perf_counter() - t_start,
        method=f"cp-sat save/recompute{repaired}, {label}",
        notes=notes,
    )
    out.append(_Candidate(sched, sim, stats))
    return out


def _step_profile(problem: Problem, fw_order: list[int], bw_order: list[int], budget: int):
    """For the relaxation's repair: simulated live bytes per model step, or None when the plan fits."""

    def run(recompute: set[int]) -> list[int] | None:
        sim = simulate(problem, place_recomputes(problem, fw_order, bw_order, recompute))
        if sim.peak_bytes <= budget:
            return None
        per_step, j = [], -1
        for k, (_o, is_rc) in enumerate(sim.steps):
            if k < sim.n_forward_steps:
                per_step.append(sim.timeline[k])
                continue
            if not per_step or len(per_step) == sim.n_forward_steps + j + 1:
                per_step.append(0)
            per_step[-1] = max(per_step[-1], sim.timeline[k])
            if not is_rc:
                j += 1
        return per_step

    return run


def _faster_fit(problem: Problem, fw: list[int], bw: list[int], a, b) -> bool:
    """Whether relaxation result `a` is a better start than `b`: it fits and `b` does not, or both fit and it
    is faster, or neither fits and its peak is lower (the greedy repair has less to do)."""
    if a.fits != b.fits:
        return a.fits
    sa, sb = (simulate(problem, place_recomputes(problem, fw, bw, x.recompute)) for x in (a, b))
    return sa.time_s < sb.time_s if a.fits else sa.peak_bytes < sb.peak_bytes


def _solve_training_scalable(
    problem: Problem, budget: int | None, time_limit_s: float, workers: int, line: ProgressLine
) -> tuple[Schedule | None, SolveStats, Schedule]:
    """Relaxation + repair in the program's order, a greedy finish if needed, then reordering."""
    deadline = clock.now() + time_limit_s
    fw = [o.id for o in problem.fw_ops]
    bw = [o.id for o in problem.bw_ops]
    base_s = sum(o.time_s for o in problem.ops)
    if budget is None:
        sched = default_schedule(problem)
        sim = simulate(problem, sched)
        stats = SolveStats("OPTIMAL", sim.time_s, sim.time_s, 0.0, 0.0, "no recomputation needed",
                           ["bound: every plan (each op once)"])
        return sched, stats, sched
    groups = find_groups(problem, fw)
    ties = [[groups.members[b][j] for b in groups.blocks] for j in range(groups.period)] if groups.blocks else []
    res = None
    if ties:  # repeated blocks decide alike first: a model L times smaller to search, solved in seconds
        line.note(f"relaxation + repair, {len(groups.blocks)} blocks deciding alike")
        res = solve_bound_and_repair(
            problem, fw, bw, budget, _step_profile(problem, fw, bw, budget),
            time_limit_s=0.3 * time_limit_s, workers=workers, ties=ties, gap_s=GAP_TARGET * base_s,
        )
    # then each block on its own, from the tied plan: kept when it fits and is faster
    untied = solve_bound_and_repair(
        problem, fw, bw, budget, _step_profile(problem, fw, bw, budget),
        time_limit_s=(0.6 if res is None or not res.fits else 0.4) * (deadline - clock.now()), workers=workers,
        hint=set(res.recompute) if res is not None else None,
        on_solution=lambda obj, bound: line.update(base_s + obj, base_s + bound),
        gap_s=GAP_TARGET * base_s,
    )
    if untied is not None and (res is None or _faster_fit(problem, fw, bw, untied, res)):
        res = untied
    chosen = set(res.recompute) if res is not None else set()
    line.note("repairing with the greedy heuristic")
    sched = greedy_recompute(problem, budget, fw, bw, start=chosen, deadline=deadline)
    if simulate(problem, sched).peak_bytes <= budget:
        line.note("dropping recomputations the budget does not need")
        kept = prune_recomputes(problem, budget, fw, bw, set(sched.recomputed(problem)), deadline=deadline)
        sched = place_recomputes(problem, fw, bw, kept)
    sim = simulate(problem, sched)
    bound = base_s + (res.bound_s if res is not None else 0.0)
    method = "cp-sat relaxation + repair, program order" + (", blocks alike" if ties and res is not None and res.bound_s == 0.0 else "")
    if res is not None and set(sim.recomputed_ops) != chosen:
        method += " + greedy"
    stats = SolveStats(
        status="FEASIBLE" if res is not None else "HEURISTIC",
        objective_s=sim.time_s,
        bound_s=bound,
        gap=max(0.0, (sim.time_s - bound) / sim.time_s) if sim.time_s else 0.0,
        wall_s=0.0,
        method=method,
        notes=[f"relaxation {res.status}, {res.rounds} rounds" if res is not None else "relaxation found nothing"],
    )
    best = _Candidate(sched, sim, stats) if _fits(sim, budget) else None
    lowest = _Candidate(sched, sim, stats)
    if best is None:
        # the repair ran out of time or budget: recomputing every candidate is a cheap plan whose peak
        # is often lower, so the lowest peak reported (and the start of reordering) is never worse
        every = place_recomputes(problem, fw, bw, recompute_candidates(problem))
        esim = simulate(problem, every)
        cand = _Candidate(every, esim, _heuristic_stats(problem, esim, "recompute every candidate, program order"))
        best, lowest = _keep(best, lowest, cand, budget)
        stats = best.stats if best is not None else stats
    left = deadline - clock.now()
    if left > 0.5:
        # reordering keeps the recompute set (so the time): it only lowers the peak, or rescues
        # a plan still over budget, so it gets a small share unless the plan does not fit yet
        line.note("reordering around the peak")
        base = best or lowest
        share = 0.5 * left if best is None else min(0.5 * left, 0.15 * time_limit_s)
        refined = refine_order(problem, base.schedule, time_limit_s=share, workers=workers)
        rsim = simulate(problem, refined)
        best, lowest = _keep(best, lowest, _Candidate(refined, rsim, stats), budget)
    if best is None:
        return None, stats, lowest.schedule
    return best.schedule, best.stats, lowest.schedule


def _with_offloads(
    problem: Problem, budget: int, best: Schedule | None, stats: SolveStats, lowest: Schedule, deadline: float
) -> tuple[Schedule | None, SolveStats, Schedule]:
    """The fastest of the recompute-only plan and plans that offload on top of less recomputation,
    and the lowest-peak plan seen (an offloading one may be lower than every recompute-only plan)."""
    start = best if best is not None else lowest
    fw, bw = base_orders(problem, start)
    best_sim = simulate(problem, best) if best is not None else None
    lowest_peak = simulate(problem, lowest).peak_bytes
    lowest_rc = set(lowest.recomputed(problem)) if lowest is not None else None
    for sched in mix_offload_and_recompute(problem, fw, bw, budget, deadline, lowest_rc):
        sim = simulate(problem, sched)
        if sim.peak_bytes < lowest_peak:
            lowest, lowest_peak = sched, sim.peak_bytes
        if _fits(sim, budget) and _better(sim, best_sim):
            best, best_sim = sched, sim
            stats = _heuristic_stats(problem, sim, "recompute plan at a looser budget + greedy offload")
    return best, stats, lowest


def _weaken_to_offload_space(problem: Problem, stats: SolveStats) -> None:
    """A recompute-only bound does not hold once offloading is allowed: fall back to the trivial one
    (every op once, no waiting) until the offload-aware relaxation certifies a better one."""
    trivial = sum(o.time_s for o in problem.ops)
    if stats.bound_s > trivial:
        stats.bound_s = trivial
        stats.gap = max(0.0, (stats.objective_s - trivial) / stats.objective_s) if stats.objective_s else 0.0
        stats.notes.append("recompute-only bound dropped: offloading is allowed")
    if stats.status == "OPTIMAL" and stats.objective_s > trivial * (1 + 1e-9):
        stats.status = "FEASIBLE"


def certify(problem: Problem, schedule: Schedule, budget: int, stats: SolveStats, time_s: float, workers: int) -> None:
    """The bound and status a plan may claim: the relaxation's bound for the plan's own order and fusion
    groups (valid for every plan in that order with those groups formed, offloading ones too when the
    problem allows offloading), "OPTIMAL" only when the plan meets it; when the relaxation cannot run,
    the bound every such plan meets (each op once, no waiting)."""
    if schedule.formed:  # formed groups change times and memory: the relaxation runs on them merged
        fused, schedule = merge_formed(problem, schedule)
        problem = fused.problem
    fw, bw = base_orders(problem, schedule)
    base_s = sum(problem.ops[o].time_s for o in fw + bw)
    res = None
    if time_s > 0.05:
        res = solve_bound_and_repair(
            problem, fw, bw, budget, lambda _r: None, time_limit_s=time_s, workers=workers, max_rounds=1,
            gap_s=GAP_TARGET * base_s, offload=problem.host_bw > 0, hint=set(schedule.recomputed(problem)),
        )
    if res is None or res.status in ("UNKNOWN", "MODEL_INVALID", "INFEASIBLE"):
        if res is not None and res.status == "INFEASIBLE":  # a relaxation cannot reject a plan that fits
            stats.notes.append("relaxation found no plan in this order (a modelling bug)")
        _set_bound(stats, base_s)
        stats.notes.append("bound: every plan (each op once; the relaxation did not finish)")
        return
    if base_s + res.bound_s > stats.objective_s * (1 + 1e-9):  # above a plan that fits: the relaxation is wrong here
        _set_bound(stats, base_s)
        stats.notes.append("bound: every plan (each op once; the relaxation's was above this plan: a modelling bug)")
        return
    _set_bound(stats, base_s + res.bound_s)
    space = "save/recompute/offload" if problem.host_bw > 0 else "save/recompute"
    stats.notes.append(f"bound: every {space} plan in this op order (relaxation)")


def _set_bound(stats: SolveStats, bound_s: float) -> None:
    stats.bound_s = bound_s
    stats.gap = max(0.0, (stats.objective_s - bound_s) / stats.objective_s) if stats.objective_s else 0.0
    if stats.gap <= 1e-6:  # within the ns rounding of costs
        stats.status = "OPTIMAL"
    elif stats.status == "OPTIMAL":
        stats.status = "FEASIBLE"
