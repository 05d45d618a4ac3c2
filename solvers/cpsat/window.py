"""CP-SAT model: the lowest-peak order of one window of a schedule, the rest held fixed.

Steps outside [a, b) keep their places. Inside, any order that respects the
window's own data dependencies is allowed. Storages made before the window and
read inside it live from the window's start to their last reader inside (or
through the window, if read later); storages made inside live from their
producer to their last reader (or through the window). A copy brought back from the
host inside the window counts from as many steps ahead of its first reader there as
it was issued before (it is issued again so: `search/reorder.py`). Storages that only pass
through are a constant. An input the simulator lets its one reader's output take over
(reuse) ends before that reader in any order; other reuse is ignored (the model
counts a little more than the simulator), and the simulator decides whether to keep
the new order. This is how the backward gets reordered: autograd's order can hold
three large tensors where two would do.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

from .common import make_solver, memory_unit, run_solver
from ..model.problem import Problem, TensorKind
from ..model.simulator import SimResult


def reorder_window(
    problem: Problem, sim: SimResult, a: int, b: int, *, time_limit_s: float = 2.0, workers: int = 2
) -> list[tuple[int, bool]] | None:
    """A new order for steps [a, b) that lowers the window's peak, or None."""
    steps = sim.steps[a:b]
    n = len(steps)
    if n < 2:
        return None
    unit = memory_unit(problem)
    m = cp_model.CpModel()
    pos = [m.NewIntVar(0, n - 1, f"pos{i}") for i in range(n)]
    m.AddAllDifferent(pos)
    producer_at: dict[tuple[int, bool], int] = {}
    for i, (o, rc) in enumerate(steps):
        for t in problem.ops[o].outputs:
            producer_at[(t, rc)] = i
    readers: dict[tuple[int, bool], list[int]] = {}
    for i in range(n):
        for key in sim.reads[a + i]:
            readers.setdefault(key, []).append(i)
            if key in producer_at and producer_at[key] != i:
                m.Add(pos[producer_at[key]] < pos[i])
    _writes_after_reads(problem, steps, pos, m)
    handed = {(sim.reused[a + i], i) for i in range(n) if a + i in sim.reused}  # (input, step taking its storage)
    intervals, demands, fixed = [], [], 0
    for key, (s, e) in sim.spans.items():
        ev = None if key[1] else sim.offloads.get(key[0])
        if ev is not None and a >= sim.n_forward_steps:  # the backward: only the copy brought back counts
            s = ev.prefetch
        if e < a or s >= b:
            continue
        nbytes = problem.tensors[key[0]].bytes
        units = -(-nbytes // unit)
        inside_readers = readers.get(key, [])
        made_inside = key in producer_at
        if not made_inside and not inside_readers:
            fixed += units  # passes through
            continue
        start = pos[producer_at[key]] if made_inside else 0
        if ev is not None and s >= a and inside_readers and not made_inside:  # brought back ahead of its first reader
            first = m.NewIntVar(0, n - 1, f"first{key}")
            m.AddMinEquality(first, [pos[i] for i in inside_readers])
            start = m.NewIntVar(0, n - 1, f"back{key}")
            m.AddMaxEquality(start, [first - (ev.first_read - ev.prefetch), m.NewConstant(0)])
        t = problem.tensors[key[0]]
        # a seed the backward frees (TANGENT_FREED) lives to its last reader, like an activation
        pinned = t.kind not in (TensorKind.ACTIVATION, TensorKind.TANGENT_FREED) or (t.id in problem.visible and not key[1])
        if pinned:  # inputs, tangents and outputs live to a fixed step, whatever the order
            ends = [m.NewConstant(min(n, e - a + 1))]
        elif len(inside_readers) == 1 and e < b and (key[0], inside_readers[0]) in handed:
            ends = [pos[inside_readers[0]]]  # dies at its one reader, whose output takes its storage, in any order
        else:
            ends = [pos[i] + 1 for i in inside_readers]
            if e >= b:
                ends.append(m.NewConstant(n))
        if made_inside:
            ends.append(pos[producer_at[key]] + 1)
        end = m.NewIntVar(0, n, f"end{key}")
        m.AddMaxEquality(end, ends)
        size = m.NewIntVar(0, n, f"len{key}")
        intervals.append(m.NewIntervalVar(start, size, end, f"live{key}"))
        demands.append(units)
    peak = m.NewIntVar(0, sum(demands) + 1, "peak")
    m.AddCumulative(intervals, demands, peak)
    m.Minimize(peak)
    for i in range(n):
        m.AddHint(pos[i], i)
    solver = make_solver(time_limit_s, workers, "window")
    status = run_solver(solver, m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    order = sorted(range(n), key=lambda i: solver.Value(pos[i]))
    if order == list(range(n)):
        return None
    return [steps[i] for i in order]


def _writes_after_reads(problem: Problem, steps: list[tuple[int, bool]], pos: list, m: cp_model.CpModel) -> None:
    """An op that overwrites an input (an optimizer's update: `Op.writes`) runs after every step of the window
    reading it, as the simulator requires."""
    for i, (o, _rc) in enumerate(steps):
        for t in problem.ops[o].writes:
            for j, (r, _) in enumerate(steps):
                if j != i and t in problem.ops[r].inputs:
                    m.Add(pos[j] < pos[i])
