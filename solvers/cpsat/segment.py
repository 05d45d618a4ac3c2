"""CP-SAT model: one stretch of the backward planned whole, order and save/recompute together.

A segment is a run of backward steps [a, b) (a transformer block's backward) together with
the forward ops only it needs (the block's forward ops: every backward reader of their
outputs lies in the segment). Inside, the model decides at once

- for each such forward op: saved across the forward, or recomputed at a step of the
  segment chosen by the model (before every reader);
- the order of the segment's steps (data dependencies respected);

and the memory it counts is exact up to rounding and storage reuse (not modelled: the
simulator may find less): storages made before the segment and read inside live from its
start to their last reader, storages made inside from their producer to their last reader
(or through the segment), storages that only pass through are a constant. Outside the
segment, a saved activation raises every step between its last forward use and the
segment: those steps are constraints too. Every other step keeps its place.

Two objectives: the least recompute time under a budget, or the lowest peak (then the
least time at that peak). The simulator decides whether the answer is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from .common import cost_ns, make_solver, memory_unit, run_solver
from ..model.problem import Phase, Problem, TensorKind
from ..model.simulator import SimResult


@dataclass
class SegmentPlan:
    steps: list[tuple[int, bool]]  # the segment's new steps: (op id, recomputation?)
    recompute: set[int]  # the free ops recomputed in it
    status: str
    peak_units: int  # the model's peak (for the peak objective) in memory units


def free_ops(problem: Problem, sim: SimResult, a: int, b: int, owned: Iterable[int]) -> list[int]:
    """Forward ops of `owned` whose save/recompute the segment [a, b) can decide alone.

    Every backward reader of their outputs (and their own recomputation, if any) lies in the
    segment; they are recomputable, not visible to the caller; and what a recomputation
    would read is available in the segment (alive at its start, made in it, or another free op's).
    """
    n_fw = sim.n_forward_steps
    inside = range(a, b)
    step_of_bw: dict[int, int] = {}
    rc_step: dict[int, int] = {}
    for k in range(n_fw, len(sim.steps)):
        o, rc = sim.steps[k]
        (rc_step if rc else step_of_bw)[o] = k
    readers: dict[int, list[int]] = {}
    for k in range(n_fw, len(sim.steps)):
        for t in problem.ops[sim.steps[k][0]].inputs:
            readers.setdefault(t, []).append(k)
    cand = set()
    for o in owned:
        op = problem.ops[o]
        if op.phase is not Phase.FW or not op.recomputable or not op.outputs:
            continue
        if any(t in problem.visible or problem.tensors[t].kind is not TensorKind.ACTIVATION for t in op.outputs):
            continue
        if o in rc_step and rc_step[o] not in inside:
            continue
        if all(k in inside for t in op.outputs for k in readers.get(t, [])):
            cand.add(o)
    made_inside = {t for k in inside for t in problem.ops[sim.steps[k][0]].outputs}
    changed = True
    while changed:  # drop ops whose recomputation would read something gone by the segment's start
        changed = False
        for o in sorted(cand):
            for t in problem.ops[o].inputs:
                p = problem.tensors[t].producer
                if p in cand or problem.tensors[t].kind is not TensorKind.ACTIVATION:
                    continue
                key = (t, p in rc_step and rc_step[p] < b)
                span = sim.spans.get(key)
                alive = span is not None and span[0] <= a <= span[1]
                if not alive and not (key[1] and t in made_inside):
                    cand.discard(o)
                    changed = True
                    break
    return sorted(cand)


class _SegmentModel:
    def __init__(self, problem: Problem, sim: SimResult, a: int, b: int, free: list[int]):
        self.p, self.sim, self.a, self.b = problem, sim, a, b
        self.free = list(free)
        free_set = set(free)
        self.m = m = cp_model.CpModel()
        self.unit = memory_unit(problem)
        # the segment's steps: fixed ones (everything there now but free ops' recomputations), then one
        # optional recomputation per free op
        kept = [(k, s) for k, s in enumerate(sim.steps[a:b]) if not (s[1] and s[0] in free_set)]
        self.fixed = [s for _k, s in kept]
        self.fixed_offset = [k for k, _s in kept]  # each fixed step's offset in [a, b) now
        self.owner = {t: o for o in free for t in problem.ops[o].outputs}  # free op output -> its op
        n = self.n = len(self.fixed) + len(free)
        self.pos = [m.NewIntVar(0, n - 1, f"pos{i}") for i in range(n)]
        self.r = {o: m.NewBoolVar(f"recompute[{problem.ops[o].name}]") for o in free}
        self.rc_index = {o: len(self.fixed) + j for j, o in enumerate(free)}
        self.present = [1] * len(self.fixed) + [self.r[o] for o in free]
        m.AddNoOverlap([self._unit_interval(i) for i in range(n)])
        self.intervals, self.demands = [], []
        self.const_units = 0
        self.saved_lit: dict[int, cp_model.IntVar] = {}
        n_fw = sim.n_forward_steps
        self.rc_step = {o: k for k, (o, rc) in enumerate(sim.steps) if rc and k >= n_fw}
        self._tensors(free_set)
        self._workspace()

    def units(self, nbytes: int) -> int:
        return -(-nbytes // self.unit)

    def _unit_interval(self, i: int):
        if isinstance(self.present[i], int):
            return self.m.NewIntervalVar(self.pos[i], 1, self.pos[i] + 1, f"step{i}")
        return self.m.NewOptionalIntervalVar(self.pos[i], 1, self.pos[i] + 1, self.present[i], f"step{i}")

    def _live(self, name: str, start, ends: list, present, units: int, closed_end: int | None = None) -> None:
        """A storage copy live from `start` to the largest of `ends` (each (expr, literal or None))."""
        m = self.m
        end = m.NewIntVar(0, self.n, f"end_{name}")
        for expr, lit in ends:
            c = m.Add(end >= expr)
            if lit is not None:
                c.OnlyEnforceIf(lit)
        if closed_end is not None:
            m.Add(end == closed_end)
        size = m.NewIntVar(0, self.n, f"len_{name}")
        if isinstance(present, int):
            iv = m.NewIntervalVar(start, size, end, f"live_{name}")
        else:
            iv = m.NewOptionalIntervalVar(start, size, end, present, f"live_{name}")
        self.intervals.append(iv)
        self.demands.append(units)

    def _tensors(self, free_set: set[int]) -> None:
        p, sim, a, b, m = self.p, self.sim, self.a, self.b, self.m
        free_out = self.owner
        producer_at: dict[tuple[int, bool], int] = {}
        for i, (o, rc) in enumerate(self.fixed):
            for t in p.ops[o].outputs:
                producer_at[(t, rc)] = i
        # which copy each fixed step reads; free ops' outputs are handled on their own
        readers: dict[tuple[int, bool], list[int]] = {}
        free_readers: dict[int, list[int]] = {}  # free op output -> fixed steps reading it
        for i in range(len(self.fixed)):
            k = a + self.fixed_offset[i]
            for key in sim.reads[k]:
                if key[0] in free_out:
                    free_readers.setdefault(key[0], []).append(i)
                    continue
                readers.setdefault(key, []).append(i)
                if key in producer_at and producer_at[key] != i:
                    m.Add(self.pos[producer_at[key]] < self.pos[i])
        # free ops' recomputations read their inputs: another free op's output, or a fixed copy
        opt_readers: dict[tuple[int, bool], list[int]] = {}  # fixed copy -> free ops reading it
        free_free: dict[int, list[int]] = {}  # free op output -> free ops reading it
        for f in self.free:
            for t in p.ops[f].inputs:
                if t in free_out:
                    free_free.setdefault(t, []).append(f)
                    continue
                prod = p.tensors[t].producer
                key = (t, prod is not None and prod not in free_set and self.rc_step.get(prod, b) < b)
                opt_readers.setdefault(key, []).append(f)
                if key in producer_at:
                    m.Add(self.pos[producer_at[key]] < self.pos[self.rc_index[f]]).OnlyEnforceIf(self.r[f])
        # every other copy alive in the segment
        for key, (s, e) in sim.spans.items():
            if key[0] in free_out or e < a or s >= b:
                continue
            units = self.units(p.tensors[key[0]].bytes)
            inside = readers.get(key, [])
            optional = opt_readers.get(key, [])
            made = key in producer_at
            if not made and not inside and not optional:
                self.const_units += units
                continue
            start = self.pos[producer_at[key]] if made else 0
            if self._pinned(key):  # inputs, tangents, the caller's values: live to a fixed step, whatever the order
                self._live(f"{key}", start, [], 1, units, closed_end=e - a + 1 if e < b - 1 else self.n)
                continue
            ends = [(self.pos[i] + 1, None) for i in inside]
            ends += [(self.pos[self.rc_index[f]] + 1, self.r[f]) for f in optional]
            if made:
                ends.append((self.pos[producer_at[key]] + 1, None))
            if e >= b:
                ends.append((self.n, None))
            self._live(f"{key}", start, ends, 1, units)
        # free ops: saved (from the segment's start) or recomputed (from their step), to their last reader
        for f in self.free:
            rf, i_rc = self.r[f], self.rc_index[f]
            fixed_readers = sorted({i for t in p.ops[f].outputs for i in free_readers.get(t, [])})
            free_rd = sorted({g for t in p.ops[f].outputs for g in free_free.get(t, [])})
            for i in fixed_readers:
                m.Add(self.pos[i_rc] < self.pos[i]).OnlyEnforceIf(rf)
            for g in free_rd:
                m.Add(self.pos[i_rc] < self.pos[self.rc_index[g]]).OnlyEnforceIf([rf, self.r[g]])
            needed = m.NewBoolVar(f"needed[{f}]")
            if fixed_readers:
                m.Add(needed == 1)
            elif free_rd:
                m.AddMaxEquality(needed, [self.r[g] for g in free_rd])
            else:
                m.Add(needed == 0)
            saved = m.NewBoolVar(f"saved[{f}]")
            m.AddMinEquality(saved, [needed, rf.Not()])
            self.saved_lit[f] = saved
            for t in p.ops[f].outputs:
                units = self.units(p.tensors[t].bytes)
                ends = [(self.pos[i] + 1, None) for i in fixed_readers]
                ends += [(self.pos[self.rc_index[g]] + 1, self.r[g]) for g in free_rd]
                self._live(f"s{t}", 0, ends, saved, units)
                self._live(f"r{t}", self.pos[i_rc], ends + [(self.pos[i_rc] + 1, None)], rf, units)

    def _pinned(self, key: tuple[int, bool]) -> bool:
        t = self.p.tensors[key[0]]
        return t.kind is not TensorKind.ACTIVATION or (t.id in self.p.outputs and not key[1])

    def _workspace(self) -> None:
        for i, (o, _rc) in enumerate(self.fixed):
            w = self.p.ops[o].workspace_bytes
            if w:
                self._live(f"ws{i}", self.pos[i], [(self.pos[i] + 1, None)], 1, self.units(w))
        for f in self.free:
            w = self.p.ops[f].workspace_bytes
            if w:
                i = self.rc_index[f]
                self._live(f"ws{i}", self.pos[i], [(self.pos[i] + 1, None)], self.r[f], self.units(w))

    def outside_terms(self) -> list[tuple[int, list[int]]]:
        """(bytes at a step before the segment with no free op saved, free ops whose saving adds to it),
        the largest per distinct set: a saved output lives from its last forward use to the segment."""
        p, sim, a = self.p, self.sim, self.a
        n_fw = sim.n_forward_steps
        fw_pos = {o: k for k, (o, _rc) in enumerate(sim.steps[:n_fw])}
        last_fw = {t: fw_pos[f] for t, f in self.owner.items()}
        for o, k in fw_pos.items():
            for t in p.ops[o].inputs:
                if t in last_fw:
                    last_fw[t] = max(last_fw[t], k)
        best: dict[tuple[int, ...], int] = {}
        for k in range(a):
            counted = [t for t in last_fw if last_fw[t] < k and sim.spans.get((t, False), (0, -1))[1] >= k]
            base = sim.timeline[k] - sum(p.tensors[t].bytes for t in counted)
            pattern = tuple(sorted(t for t in last_fw if last_fw[t] < k))
            best[pattern] = max(best.get(pattern, 0), base)
        if sim.boundary_bytes:
            counted = [t for t in last_fw if last_fw[t] < n_fw and sim.spans.get((t, False), (0, -1))[1] >= n_fw]
            pattern = tuple(sorted(t for t in last_fw if last_fw[t] < n_fw))
            base = sim.boundary_bytes - sum(p.tensors[t].bytes for t in counted)
            best[pattern] = max(best.get(pattern, 0), base)
        return [(base, list(pattern)) for pattern, base in best.items() if pattern]

    def outside_expr(self, tensors: list[int]):
        return sum(self.units(self.p.tensors[t].bytes) * self.saved_lit[self.owner[t]] for t in tensors)

    def hint(self) -> None:
        rc_now = {o: k for k, (o, rc) in enumerate(self.sim.steps[self.a:self.b]) if rc}
        for i in range(len(self.fixed)):
            self.m.AddHint(self.pos[i], self.fixed_offset[i])
        for f in self.free:
            self.m.AddHint(self.r[f], f in rc_now)
            self.m.AddHint(self.pos[self.rc_index[f]], rc_now.get(f, 0))

    def recompute_ns(self):
        return sum(cost_ns(self.p.ops[f].time_s) * self.r[f] for f in self.free)

    def extract(self, solver: cp_model.CpSolver, status: str, peak_units: int) -> SegmentPlan:
        chosen = {f for f in self.free if solver.Value(self.r[f])}
        present = list(range(len(self.fixed))) + [self.rc_index[f] for f in self.free if f in chosen]
        present.sort(key=lambda i: solver.Value(self.pos[i]))
        steps = [self.fixed[i] if i < len(self.fixed) else (self.free[i - len(self.fixed)], True) for i in present]
        return SegmentPlan(steps, chosen, status, peak_units)


def replan_segment(
    problem: Problem,
    sim: SimResult,
    a: int,
    b: int,
    free: list[int],
    budget_bytes: int | None,
    *,
    time_limit_s: float = 2.0,
    workers: int = 2,
) -> SegmentPlan | None:
    """The segment [a, b) replanned: least recompute time within `budget_bytes`, or (None) lowest peak.

    None when the model finds nothing (no plan within the budget in this model, or no time)."""
    if b - a < 1 or a < sim.n_forward_steps:
        return None
    model = _SegmentModel(problem, sim, a, b, free)
    m, unit = model.m, model.unit
    outside = model.outside_terms()
    top = sum(model.demands) + model.const_units + max((base for base, _ in outside), default=0) // unit + 1
    if budget_bytes is not None:
        cap = budget_bytes // unit - model.const_units
        if cap < 0:
            return None
        m.AddCumulative(model.intervals, model.demands, cap)
        for base, tensors in outside:
            m.Add(model.outside_expr(tensors) <= budget_bytes // unit - model.units(base))
        m.Minimize(model.recompute_ns())
        model.hint()
        solver = make_solver(time_limit_s, workers)
        status = run_solver(solver, m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return model.extract(solver, solver.StatusName(status), -1)
    peak = m.NewIntVar(0, top, "peak")
    inner = m.NewIntVar(0, top, "inner")
    m.Add(peak >= inner + model.const_units)
    m.AddCumulative(model.intervals, model.demands, inner)
    for base, tensors in outside:
        m.Add(peak >= model.outside_expr(tensors) + model.units(base))
    m.Minimize(peak)
    model.hint()
    solver = make_solver(0.6 * time_limit_s, workers)
    status = run_solver(solver, m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    best_peak = solver.Value(peak)
    first = model.extract(solver, solver.StatusName(status), best_peak)
    # then the least recompute time at that peak
    m.ClearHints()
    for f in model.free:
        m.AddHint(model.r[f], f in first.recompute)
    m.Add(peak <= best_peak)
    m.Minimize(model.recompute_ns())
    solver = make_solver(0.4 * time_limit_s, workers)
    status = run_solver(solver, m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return first
    return model.extract(solver, solver.StatusName(status), best_peak)
