"""CP-SAT model: save or recompute each forward activation, with the op order fixed.

Time axis: forward steps 0..F-1, then backward steps F..F+B-1. A recomputed op p
runs at backward step N[p], no later than the first backward op that reads its
outputs and no later than any recomputed op that reads them. Each forward
activation t has a last backward use L[t]. Memory is a cumulative constraint over

- a fixed profile (inputs, tangents, backward tensors, forward tensors up to their
  last forward use),
- for each saved activation, an optional interval [last forward use + 1, L[t] + 1),
- for each output of a recomputed op, an optional interval [N[p], L[t] + 1).

Counting a recomputation's operands live through the whole backward step it
precedes over-approximates the real program slightly, so every plan this model
accepts is within budget when the simulator replays it. The objective is the
recompute time (the rest of the step's time is fixed); a second pass minimizes
the peak among equally fast plans.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from .common import NS, cost_ns, make_solver, memory_unit, run_solver
from ..model.liveness import Activation, OrderedProblem
from ..model.problem import Problem
from ..model import clock

@dataclass
class RematResult:
    recompute: set[int]
    status: str
    recompute_s: float  # objective of the first pass
    bound_s: float  # proven lower bound on recompute time, in this model
    peak_bytes: int  # the model's (conservative) peak
    wall_s: float
    notes: list[str] = field(default_factory=list)




class _RematModel:
    def __init__(self, problem: Problem, fw_order: list[int], bw_order: list[int]):
        self.p = problem
        self.m = cp_model.CpModel()
        self.unit = memory_unit(problem)
        self.o = OrderedProblem(problem, fw_order, bw_order)
        self.F, self.T = self.o.F, self.o.T
        self.candidates = self.o.candidates
        self.r = {o: self.m.NewBoolVar(f"recompute[{problem.ops[o].name}]") for o in self.candidates}
        self.N = {o: self.m.NewIntVar(self.F, self.T - 1, f"N[{problem.ops[o].name}]") for o in self.candidates}
        self.static = self.o.static
        self.sure: list[list] = [[] for _ in range(self.T)]  # per step: (units, literal) surely live
        self.intervals: list = []
        self.demands: list[int] = []
        for act in self.o.activations:
            self._forward_activation(act)
        for o in self.candidates:  # a recomputation runs before any recomputed reader
            for t in problem.ops[o].outputs:
                for c in self.o.fw_readers[t]:
                    if c in self.r:
                        self.m.Add(self.N[o] <= self.N[c]).OnlyEnforceIf(self.r[c])
        self._add_static_runs()

    def _units(self, nbytes: int) -> int:
        return -(-nbytes // self.unit)

    def _forward_activation(self, act: Activation) -> None:
        m, F, T = self.m, self.F, self.T
        direct, rc_readers, fw_last = act.direct, act.rc_readers, act.fw_last
        name = self.p.tensors[act.tensor].name
        if direct:
            needed = 1
        else:
            needed = m.NewBoolVar(f"needed[{name}]")
            m.AddBoolOr([self.r[c] for c in rc_readers]).OnlyEnforceIf(needed)
            for c in rc_readers:
                m.AddImplication(self.r[c], needed)
        L = m.NewIntVar(F, T - 1, f"L[{name}]")
        if direct:
            m.Add(L >= max(direct))
        for c in rc_readers:
            m.Add(L >= self.N[c]).OnlyEnforceIf(self.r[c])
        size = self._units(self.p.tensors[act.tensor].bytes)
        prod = act.producer
        if prod in self.r:
            rc = self.r[prod]
            if direct:
                m.Add(self.N[prod] <= min(direct)).OnlyEnforceIf(rc)
            m.Add(L >= self.N[prod]).OnlyEnforceIf(rc)
            saved = m.NewBoolVar(f"saved[{name}]")
            if direct:
                m.Add(saved == 1 - rc)
            else:
                m.Add(saved <= needed)
                m.Add(saved + rc <= 1)
                m.Add(saved >= needed - rc)
            self._optional(f"rc[{name}]", self.N[prod], L, rc, size)
            scratch = self.p.ops[prod].workspace_bytes
            if scratch and act.tensor == self.p.ops[prod].outputs[0]:  # once per recomputed op
                self._optional(f"ws[{name}]", self.N[prod], self.N[prod], rc, self._units(scratch))
            if direct:  # a recomputed copy surely lives through its direct readers
                self._sure(min(direct), max(direct), size, rc)
        else:
            saved = needed
        self._optional(f"saved[{name}]", fw_last + 1, L, saved, size)
        # a saved copy surely lives from its last forward use to the end of the forward and to its last direct reader
        self._sure(fw_last + 1, max([F] + direct), size, saved)

    def _sure(self, first: int, last: int, units: int, present) -> None:
        for k in range(first, last + 1):
            self.sure[k].append((units, present))

    def _optional(self, name: str, start, last, present, demand: int) -> None:
        if isinstance(present, int):
            if not present:
                return
            present = self.m.NewConstant(1)
        size = self.m.NewIntVar(0, self.T, f"len_{name}")
        end = self.m.NewIntVar(0, self.T, f"end_{name}")
        self.m.Add(end == last + 1)
        iv = self.m.NewOptionalIntervalVar(start, size, end, present, f"iv_{name}")
        self.intervals.append(iv)
        self.demands.append(demand)

    def _add_static_runs(self) -> None:
        k = 0
        while k < self.T:
            j = k
            while j + 1 < self.T and self.static[j + 1] == self.static[k]:
                j += 1
            if self.static[k]:
                self.intervals.append(self.m.NewIntervalVar(k, j - k + 1, j + 1, f"static_{k}"))
                self.demands.append(self._units(self.static[k]))
            k = j + 1

    def constrain_peak(self, budget_bytes: int | None) -> cp_model.IntVar:
        top = sum(self.demands) + 1
        cap = top if budget_bytes is None else max(0, min(budget_bytes // self.unit, top))
        peak = self.m.NewIntVar(0, cap, "peak")
        self.m.AddCumulative(self.intervals, self.demands, peak)
        # Redundant per-step sums of what is surely live: the cumulative alone gives CP-SAT's
        # LP almost no bound, these turn the time objective into a knapsack it can bound.
        for k, terms in enumerate(self.sure):
            if terms:
                self.m.Add(self._units(self.static[k]) + sum(u * v for u, v in terms) <= peak)
        return peak

    def recompute_ns(self):
        return sum(cost_ns(self.p.ops[o].time_s) * v for o, v in self.r.items())


def _solver(time_limit_s: float, workers: int) -> cp_model.CpSolver:
    # level 2 adds the cumulative and enforced linear constraints to the LP: a better
    # bound on the recompute time for the same search (measured on the GPT step)
    return make_solver(time_limit_s, workers, "remat", linearization_level=2)


def solve_remat(
    problem: Problem,
    fw_order: list[int],
    bw_order: list[int],
    budget_bytes: int | None,
    *,
    time_limit_s: float = 10.0,
    workers: int = 2,
    hint: set[int] | None = None,
    minimize_peak_after: bool = True,
) -> RematResult | None:
    """Fastest recompute set whose conservative peak fits `budget_bytes`; None if none was found."""
    t0 = time.perf_counter()
    c0 = clock.now()
    model = _RematModel(problem, fw_order, bw_order)
    peak = model.constrain_peak(budget_bytes)
    cost = model.recompute_ns()
    model.m.Minimize(cost)
    if hint is not None:
        for o, v in model.r.items():
            model.m.AddHint(v, o in hint)
    solver = _solver(time_limit_s * (0.7 if minimize_peak_after else 1.0), workers)
    status = run_solver(solver, model.m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None if status != cp_model.INFEASIBLE else RematResult(set(), "INFEASIBLE", math.inf, math.inf, 0, time.perf_counter() - t0)
    chosen = {o for o, v in model.r.items() if solver.Value(v)}
    best_ns = solver.ObjectiveValue()
    bound_ns = solver.BestObjectiveBound()
    status_name = solver.StatusName(status)
    peak_units = solver.Value(peak)
    notes = []
    remaining = time_limit_s - (clock.now() - c0)
    if minimize_peak_after and remaining > 0.1:
        model.m.Add(cost <= round(best_ns))
        model.m.ClearHints()
        for o, v in model.r.items():
            model.m.AddHint(v, o in chosen)
        model.m.Minimize(peak)
        solver2 = _solver(remaining, workers)
        status2 = run_solver(solver2, model.m)
        if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            chosen = {o for o, v in model.r.items() if solver2.Value(v)}
            peak_units = solver2.Value(peak)
            notes.append(f"peak pass: {solver2.StatusName(status2)}")
    return RematResult(
        recompute=chosen,
        status=status_name,
        recompute_s=best_ns * NS,
        bound_s=bound_ns * NS,
        peak_bytes=peak_units * model.unit,
        wall_s=time.perf_counter() - t0,
        notes=notes,
    )


def min_peak_remat(
    problem: Problem, fw_order: list[int], bw_order: list[int], *, time_limit_s: float = 5.0, workers: int = 2
) -> tuple[set[int], int, int] | None:
    """Lowest conservative peak reachable by recomputation alone: (recompute set, peak bytes, model bound bytes)."""
    model = _RematModel(problem, fw_order, bw_order)
    peak = model.constrain_peak(None)
    model.m.Minimize(peak)
    solver = _solver(time_limit_s, workers)
    status = run_solver(solver, model.m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    chosen = {o for o, v in model.r.items() if solver.Value(v)}
    return chosen, solver.Value(peak) * model.unit, int(solver.BestObjectiveBound()) * model.unit
