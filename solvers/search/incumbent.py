"""The incumbent: the one place that decides which plan is better.

Every move of the search (strategy.PORTFOLIO) offers its plans here. Each is simulated once and
judged by one comparator (`better`: within the budget first, then faster, then lower); the
incumbent keeps the best plan and the lowest-peak plan, each with the stats of the move it came
from. So no plan over budget leaves the search, and no two places can disagree on "better".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..model.problem import Problem, Schedule, SolveStats, reject
from ..model.simulator import ScheduleError, SimResult, simulate
from .heuristics import base_orders, place_recomputes

log = logging.getLogger(__name__)

NOTHING_FITS = -1  # a budget no plan meets: `better` under it orders by peak, then time
NEAR = 0.02  # a plan over the budget by at most this share is kept when it is faster than every plan that fits


def fits(sim: SimResult, budget: int | None) -> bool:
    return budget is None or sim.peak_bytes <= budget


def aim_bytes(sim: SimResult, budget: int | None) -> int:
    """The bytes a step is over when it holds more: the budget; with none, one byte below the plan's peak (so the
    steps at the peak)."""
    return sim.peak_bytes - 1 if budget is None else budget


def bytes_over(sim: SimResult, budget: int | None) -> int:
    """The bytes over `aim_bytes` summed over the plan's steps (the caller's loss between forward and backward counted
    as one step). What a local search lowers while its moves leave a flat peak (several steps at about its height)
    where it is: a step towards a lower one."""
    line = aim_bytes(sim, budget)
    return sum(max(0, live - line) for live in sim.timeline) + max(0, sim.boundary_bytes - line)


def gap(objective_s: float, bound_s: float) -> float:
    """(objective - bound) / objective, never negative: how far a plan may be from the best."""
    return max(0.0, (objective_s - bound_s) / objective_s) if objective_s > 0 else 0.0


def better(a: SimResult, b: SimResult | None, budget: int | None) -> bool:
    """The comparator: `a` fits and `b` does not; both fit and `a` is faster (then lower); neither fits
    and `a` is lower (then faster). Times are compared rounded to 1e-12 s (sums of ns costs)."""
    if b is None:
        return True
    fa, fb = fits(a, budget), fits(b, budget)
    if fa != fb:
        return fa
    ta, tb = round(a.time_s, 12), round(b.time_s, 12)
    return (ta, a.peak_bytes) < (tb, b.peak_bytes) if fa else (a.peak_bytes, ta) < (b.peak_bytes, tb)


def heuristic_stats(problem: Problem, sim: SimResult, method: str) -> SolveStats:
    """Stats of a plan no model proved anything about: the bound is the step with every op once."""
    bound = sum(o.time_s for o in problem.ops)
    status = "OPTIMAL" if sim.time_s <= bound else "HEURISTIC"  # nothing recomputed, no stall: nothing is faster
    return SolveStats(status, sim.time_s, bound, gap(sim.time_s, bound), 0.0, method, ["bound: every plan (each op once)"])


@dataclass
class Candidate:
    schedule: Schedule
    sim: SimResult
    stats: SolveStats


class Incumbent:
    """The best plan (`better` under the budget) and the lowest-peak plan offered so far."""

    def __init__(self, problem: Problem, budget: int | None):
        self.problem, self.budget = problem, budget
        self.best: Candidate | None = None  # fits the budget
        self.lowest: Candidate | None = None  # lowest peak, fits or not
        self.lowest_plain: Candidate | None = None  # lowest peak among plans that offload nothing
        self._near: Candidate | None = None  # the fastest plan just over the budget (NEAR)

    @property
    def start(self) -> Candidate | None:
        """Where an improving move starts: the best plan, else the lowest (to make one fit)."""
        return self.best or self.lowest

    @property
    def found(self) -> bool:
        return self.best is not None

    def offer(self, schedule: Schedule, how: SolveStats | str, sim: SimResult | None = None,
              *, rejected: str = "candidate(s) rejected") -> Candidate | None:
        """Consider a plan; `how` is its stats or, for a heuristic's plan, the method's name. Returns the
        candidate (None when the plan does not replay: it is dropped with `rejected` as the reason)."""
        if sim is None:
            try:
                sim = simulate(self.problem, schedule)
            except ScheduleError as e:
                reject(log, rejected, e)
                return None
        stats = heuristic_stats(self.problem, sim, how) if isinstance(how, str) else how
        cand = Candidate(schedule, sim, stats)
        if fits(sim, self.budget) and (better(sim, self.best and self.best.sim, self.budget) or self._wins_tie(cand)):
            self.best = cand
        if not schedule.offload and better(sim, self.lowest_plain and self.lowest_plain.sim, NOTHING_FITS):
            self.lowest_plain = cand
        if better(sim, self.lowest and self.lowest.sim, NOTHING_FITS):
            self.lowest = cand
            if not fits(sim, self.budget):
                self._offer_placed(cand)
        if (self.budget is not None and not fits(sim, self.budget) and sim.peak_bytes <= self.budget * (1 + NEAR)
                and (self._near is None or sim.time_s < self._near.sim.time_s)):
            self._near = cand
        return cand

    def _offer_placed(self, cand: Candidate) -> None:
        """A new lowest plan over the budget, its recomputations each moved to just before the first step that
        reads them (`place_recomputes`), in its own orders: moves that splice plans together can leave one early,
        live across steps that do not need it (the bundled GPT at 40%: a segment search's 37.20 MiB plan, re-placed,
        fits at 36.28). Plans that offload or form fusion options keep their steps (positions index them)."""
        sched = cand.schedule
        if sched.offload or sched.formed:
            return
        placed = place_recomputes(self.problem, *base_orders(self.problem, sched), cand.sim.recomputed_ops)
        if placed.bw_order == sched.bw_order:
            return
        try:  # moved later, a recomputation may read an input an update in the backward has overwritten: not a plan
            sim = simulate(self.problem, placed)
        except ScheduleError:
            return
        self.offer(placed, f"{cand.stats.method}, recomputations at first use", sim)

    @property
    def near(self) -> Candidate | None:
        """The fastest plan over the budget by at most NEAR, while no plan that fits is as fast."""
        n = self._near
        return n if n is not None and (self.best is None or n.sim.time_s < self.best.sim.time_s) else None

    def _wins_tie(self, cand: Candidate) -> bool:
        """A model's plan replaces an equal heuristic one (its stats say more)."""
        b = self.best
        return (b is not None and b.stats.status == "HEURISTIC" and cand.stats.status != "HEURISTIC"
                and not better(b.sim, cand.sim, self.budget))
