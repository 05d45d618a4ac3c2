"""CP-SAT model: the exact memory-optimal order of a forward-only program.

Each op gets a distinct position; each storage lives from its producer's position
to its last reader's (or to the end, for outputs); a cumulative constraint bounds
the live bytes by the peak, which is minimized. Exact, so it only scales to a few
hundred ops: larger graphs use the greedy order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from .common import make_solver, memory_unit, run_solver
from ..model.problem import Problem, TensorKind


@dataclass
class OrderResult:
    order: list[int]
    status: str
    peak_bytes: int
    bound_bytes: int  # proven lower bound on the peak over all orders (exact when the unit is 1 byte)
    wall_s: float


def solve_order(
    problem: Problem, *, hint: list[int] | None = None, time_limit_s: float = 10.0, workers: int = 2
) -> OrderResult | None:
    """Minimize the peak over topological orders of the forward ops. None if no order was found in time."""
    t0 = time.perf_counter()
    ops = problem.fw_ops
    n = len(ops)
    m = cp_model.CpModel()
    pos = {o.id: m.NewIntVar(0, n - 1, f"pos[{o.name}]") for o in ops}
    m.AddAllDifferent(list(pos.values()))
    readers: dict[int, list[int]] = {t.id: [] for t in problem.tensors}
    for o in ops:
        for t in o.inputs:
            readers[t].append(o.id)
            p = problem.tensors[t].producer
            if p is not None:
                m.Add(pos[p] < pos[o.id])
    unit = memory_unit(problem)
    intervals, demands, fixed = [], [], 0
    for t in problem.tensors:
        units = -(-t.bytes // unit)
        if t.kind is not TensorKind.ACTIVATION:
            fixed += t.bytes
            continue
        start = pos[t.producer]
        if t.id in problem.outputs:
            end = m.NewConstant(n)
        else:
            end = m.NewIntVar(0, n, f"end[{t.name}]")
            m.AddMaxEquality(end, [start + 1] + [pos[r] + 1 for r in readers[t.id]])
        size = m.NewIntVar(1, n, f"len[{t.name}]")
        intervals.append(m.NewIntervalVar(start, size, end, f"live[{t.name}]"))
        demands.append(units)
    peak = m.NewIntVar(0, sum(demands), "peak")
    m.AddCumulative(intervals, demands, peak)
    m.Minimize(peak)
    if hint:
        for k, o in enumerate(hint):
            m.AddHint(pos[o], k)
    solver = make_solver(time_limit_s, workers, "order")
    status = run_solver(solver, m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    order = sorted(pos, key=lambda o: solver.Value(pos[o]))
    return OrderResult(
        order=order,
        status=solver.StatusName(status),
        peak_bytes=int(solver.ObjectiveValue()) * unit + fixed,
        bound_bytes=(int(solver.BestObjectiveBound()) * unit + fixed) if all(t.bytes % unit == 0 for t in problem.tensors) else 0,
        wall_s=time.perf_counter() - t0,
    )
