"""Plans for a budget on a measure of the plan other than the problem's own peak.

`solve` plans for the problem's peak. A caller whose memory counts more than that gives `sweep` its measure of
a plan: optimize_fsdp's per-rank total counts a block's peak plus what every other block saves for its backward,
so a plan that saves less at a higher peak can win by far. `solve` runs for a bisection of peak budgets (for the
largest whose plan the measure fits), and whole-problem schedules and recompute sets, which weigh saved bytes
rather than the peak, are measured beside its plans; the simulator judges each. A search over candidates, not
one model of the measure: the plan found is not proven best for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..baselines import BASELINES
from ..model.liveness import recompute_candidates
from ..model.problem import Problem, Schedule
from ..model.simulator import SimResult, simulate
from .heuristics import full_recompute, place_recomputes
from .solution import BudgetInfeasibleError
from .strategy import solve

HEURISTICS = ("full_recompute", "checkpoint_blocks", "sqrt_segments")
"""Whole-problem schedules measured beside the solver's (full_recompute keeps only the problem's inputs)."""


@dataclass(frozen=True)
class Candidate:
    """A plan the sweep measured: `how` it was made ("solve", for `peak_budget`, None: no budget; a name of
    HEURISTICS; "recompute": the forward ops named in `recompute` recomputed), its simulation and its measure."""

    how: str
    peak_budget: int | None
    sim: SimResult
    total: int
    recompute: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sweep:
    tried: list[Candidate]  # in the order measured: the solver's fastest plan first
    bound: int  # no plan's measure is lower: the caller's floor plus the problem's proven peak bound

    def fitting(self, budget: int | None) -> list[Candidate]:
        """The candidates whose measure is within `budget` (None: any), fastest first, then the lowest measure."""
        fits = [c for c in self.tried if budget is None or c.total <= budget]
        return sorted(fits, key=lambda c: (c.sim.time_s, c.total))


def heuristic_schedule(name: str, problem: Problem) -> Schedule:
    return full_recompute(problem) if name == "full_recompute" else BASELINES[name](problem)


def recompute_ladder(problem: Problem) -> list[list[int]]:
    """Recompute sets that trade the least time for saved bytes: the recompute candidates sorted by time per
    byte of output, and every prefix of that order."""
    def per_byte(o: int) -> float:
        return problem.ops[o].time_s / max(1, sum(problem.tensors[t].bytes for t in problem.ops[o].outputs))

    order = sorted(recompute_candidates(problem), key=lambda o: (per_byte(o), o))
    return [order[:k] for k in range(1, len(order) + 1)]


def schedule_for(how: str, recompute: tuple[str, ...], problem: Problem) -> Schedule:
    """The schedule a candidate not made by the solver gives `problem` (the same graph, its ops matched by
    name: a problem captured again where the plan runs)."""
    if how == "recompute":
        by_name = {o.name: o.id for o in problem.ops}
        return place_recomputes(problem, [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops],
                                [by_name[n] for n in recompute])
    return heuristic_schedule(how, problem)


def sweep(problem: Problem, measure: Callable[[SimResult], int], budget: int | None, *, floor: int,
          time_limit_s: float, tolerance: float = 0.02) -> Sweep:
    """The plans of `problem` measured by `measure` (for any plan at least `floor` plus its peak) against
    `budget`. The solver's fastest plan alone when `budget` is None or it fits, or when `budget` is below the
    bound; else also the HEURISTICS' schedules, the recompute_ladder's and the solver's plans for peak budgets
    bisected (to `tolerance`) for the largest whose plan fits. Each `solve` gets `time_limit_s`, deterministic."""
    def solved(peak_budget: int | None):
        try:
            sol = solve(problem, peak_budget, time_limit_s=time_limit_s, deterministic=True)
        except BudgetInfeasibleError:
            return None, None
        return Candidate("solve", peak_budget, sol.sim, measure(sol.sim)), sol

    def simulated(how: str, schedule: Schedule, recompute: tuple[str, ...] = ()) -> Candidate:
        sim = simulate(problem, schedule)
        return Candidate(how, None, sim, measure(sim), recompute)

    fastest, sol = solved(None)
    bound = floor + sol.lower_bound_bytes
    if budget is None or fastest.total <= budget or budget < bound:
        return Sweep([fastest], bound)
    tried = [fastest] + [simulated(name, heuristic_schedule(name, problem)) for name in HEURISTICS]
    fw, bw = [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops]
    tried += [simulated("recompute", place_recomputes(problem, fw, bw, ops), tuple(problem.ops[o].name for o in ops))
              for ops in recompute_ladder(problem)]
    lo, hi = sol.lower_bound_bytes - 1, fastest.sim.peak_bytes
    for _ in range(16):
        if hi - lo <= max(4096, int(hi * tolerance)):
            break
        mid = (lo + hi) // 2
        c, _sol = solved(mid)
        if c is None:
            lo = mid
            continue
        tried.append(c)
        if c.total <= budget:
            lo = mid
        else:
            hi = mid
    return Sweep(tried, bound)
