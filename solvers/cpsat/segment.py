"""CP-SAT model: one stretch of the backward planned whole, order and save/recompute together.

A segment is a run of backward steps [a, b) (a transformer block's backward) together with
the forward ops only it needs (the block's forward ops: every backward reader of their
outputs lies in the segment). Inside, the model decides at once

- for each such forward op: saved across the forward, recomputed at a step of the
  segment chosen by the model (before every reader), or, when the problem allows
  offloading, copied to the host as it is made and back from a prefetch step before
  the segment, one of a few the model chooses from (`OffloadWindow`): an earlier one
  hides more copying, a later one holds the copies on the device for less of the plan;
- the order of the segment's steps (data dependencies respected);
- for each fusion option whose members are all backward steps of the segment: whether it is
  formed (members consecutive, every copy they read or make live through the whole run, values
  made and read only inside it not materialized, the kernel's scratch space; the objective gains
  the time the kernel saves);

and the memory it counts is exact up to rounding and storage reuse (not modelled: the
simulator may find less): storages made before the segment and read inside live from its
start to their last reader, storages made inside from their producer to their last reader
(or through the segment), storages that only pass through are a constant. Outside the
segment, a saved activation raises every step between its last forward use and the
segment: those steps are constraints too; an offloaded one raises only the steps from its
prefetch on. Copies are assumed hidden behind compute: the offloads of one segment together
must not take longer to copy than the forward left to hide them and the compute between the
prefetch and the segment (the simulator times every stall and judges). Every other step keeps
its place.

Two objectives: the least recompute time under a budget, or the lowest peak (then the
least time at that peak); an offload costs a small share of its copy time (OFFLOAD_PENALTY)
so that saving is preferred where memory allows. The simulator decides whether the answer
is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from .common import cost_ns, make_solver, memory_unit, run_solver
from ..model.fusion_sim import internal_tensors
from ..model.problem import Phase, Problem, TensorKind
from ..model.simulator import SimResult


OFFLOAD_PENALTY = 0.05  # of an offload's copy time, charged in the objective: saving wins a tie


@dataclass(frozen=True)
class OffloadWindow:
    """Where and how much a segment may offload: free ops' outputs come back from one of the
    `prefetches`, (global step at or before the segment, seconds of copying the compute from there
    can hide), within `host_left` bytes of host memory (None: unlimited)."""

    prefetches: tuple[tuple[int, float], ...]
    host_left: int | None


@dataclass
class SegmentPlan:
    steps: list[tuple[int, bool]]  # the segment's new steps: (op id, recomputation?)
    recompute: set[int]  # the free ops recomputed in it
    status: str
    peak_units: int  # the model's peak (for the peak objective) in memory units
    offload: set[int] = field(default_factory=set)  # the free ops whose outputs go to the host and back
    prefetch_step: int | None = None  # where they come back (a global step)
    fusion: dict[int, bool] = field(default_factory=dict)  # fusion options decided here: formed or not


def free_ops(problem: Problem, sim: SimResult, a: int, b: int, owned: Iterable[int], offload: bool = False) -> list[int]:
    """Forward ops of `owned` whose save/recompute(/offload) the segment [a, b) can decide alone.

    Every backward reader of their outputs (and their own recomputation, if any) lies in the
    segment; they are recomputable (or, with `offload`, their outputs offloadable), not visible
    to the caller; and what a recomputation would read is available in the segment (alive at
    its start, made in it, or another free op's).
    """
    inside = range(a, b)
    rc_step, readers = _backward_index(problem, sim)
    cand = set()
    for o in owned:
        op = problem.ops[o]
        movable = offload and all(problem.tensors[t].offloadable for t in op.outputs)
        if op.phase is not Phase.FW or not (op.recomputable or movable) or not op.outputs:
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
            if not problem.ops[o].recomputable:
                continue  # never recomputed: what it reads does not matter here
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


_index_memo: list = []  # [(problem, sim, index)]: the last plan's, which the segment search asks about segment after segment


def _backward_index(problem: Problem, sim: SimResult) -> tuple[dict[int, int], dict[int, list[int]]]:
    """For the steps after the forward: the step of each recomputation, and each tensor's reading steps.
    Built once per plan (a whole-graph scan: 10 ms at 9000 ops, for every segment tried)."""
    if _index_memo and _index_memo[0][0] is problem and _index_memo[0][1] is sim:
        return _index_memo[0][2]
    rc_step: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for k in range(sim.n_forward_steps, len(sim.steps)):
        o, rc = sim.steps[k]
        if rc:
            rc_step[o] = k
        for t in problem.ops[o].inputs:
            readers.setdefault(t, []).append(k)
    _index_memo[:] = [(problem, sim, (rc_step, readers))]
    return rc_step, readers


class _SegmentModel:
    def __init__(self, problem: Problem, sim: SimResult, a: int, b: int, free: list[int],
                 window: OffloadWindow | None = None, decide_fusion: bool = False):
        self.p, self.sim, self.a, self.b = problem, sim, a, b
        self.free = list(free)
        self.window = window
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
        for o in free:
            if not problem.ops[o].recomputable:  # free only to be offloaded
                m.Add(self.r[o] == 0)
        self.rc_index = {o: len(self.fixed) + j for j, o in enumerate(free)}
        self.present = [1] * len(self.fixed) + [self.r[o] for o in free]
        m.AddNoOverlap([self._unit_interval(i) for i in range(n)])
        self.intervals, self.demands = [], []
        self.const_units = 0
        self.saved_lit: dict[int, cp_model.IntVar] = {}  # on the device from its last forward use
        self.kept_lit: dict[int, cp_model.IntVar] = {}  # saved or offloaded: on the device in the segment
        self.off: dict[int, cp_model.IntVar] = {}
        self.window_lit = [m.NewBoolVar(f"prefetch@{k}") for k, _s in window.prefetches] if window else []
        self.off_at: dict[int, list[cp_model.IntVar]] = {}  # free op -> offloaded and back from each prefetch
        n_fw = sim.n_forward_steps
        self.rc_step = {o: k for k, (o, rc) in enumerate(sim.steps) if rc and k >= n_fw}
        self._fusion_options(decide_fusion)
        self._tensors(free_set)
        self._workspace()
        self._offload_limits()

    def _fusion_options(self, decide: bool) -> None:
        """A formed literal per option whose members are all fixed backward steps here; when formed, the
        members fill [start, start + len) (positions are distinct, so nothing runs between them). Not
        `decide`: each stays as the plan has it."""
        m, p = self.m, self.p
        index = {s: i for i, s in enumerate(self.fixed)}
        self.f: dict[int, cp_model.IntVar] = {}
        self.run_end: dict[int, cp_model.LinearExpr] = {}
        self.run_start: dict[int, cp_model.IntVar] = {}
        self.option_of: dict[int, int] = {}  # fixed step -> its option
        self.hidden: dict[int, int] = {}  # tensor made and read only inside an option -> the option
        readers = p.consumers() if p.fusion_options else {}
        for j, opt in enumerate(p.fusion_options):
            steps = [index.get((o, False)) for o in opt.members]
            if any(i is None for i in steps) or p.ops[opt.members[0]].phase is not Phase.BW:
                continue
            f = self.f[j] = m.NewBoolVar(f"formed[{j}]")
            if not decide:
                m.Add(f == int(j in self.sim.formed))
            start = self.run_start[j] = m.NewIntVar(0, self.n - len(steps), f"run{j}")
            self.run_end[j] = start + len(steps)
            for i in steps:
                m.Add(self.pos[i] >= start).OnlyEnforceIf(f)
                m.Add(self.pos[i] < start + len(steps)).OnlyEnforceIf(f)
                self.option_of[i] = j
            for t in internal_tensors(p, opt.members, readers):
                self.hidden[t] = j

    def _run_ends(self, steps: list[int]) -> list:
        """Extra ends of a copy that fixed `steps` read or make: the end of each one's formed run."""
        js = {self.option_of[i] for i in steps if i in self.option_of}
        return [(self.run_end[j], self.f[j]) for j in sorted(js)]

    def saved_ns(self):
        """Time the formed options save."""
        return sum(max(0, cost_ns(self._members_s(j)) - cost_ns(self.p.fusion_options[j].time_s)) * f
                   for j, f in self.f.items())

    def _members_s(self, j: int) -> float:
        return sum(self.p.ops[o].time_s for o in self.p.fusion_options[j].members)

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
            j = self.option_of.get(producer_at[key]) if made else None
            if j is not None:  # made by a member: from the run's start when formed
                start = m.NewIntVar(0, self.n - 1, f"start_{key}")
                m.Add(start == self.pos[producer_at[key]]).OnlyEnforceIf(self.f[j].Not())
                m.Add(start == self.run_start[j]).OnlyEnforceIf(self.f[j])
            if self._pinned(key):  # inputs, tangents, the caller's values: live to a fixed step, whatever the order
                self._live(f"{key}", start, [], 1, units, closed_end=e - a + 1 if e < b - 1 else self.n)
                continue
            ends = [(self.pos[i] + 1, None) for i in inside]
            ends += [(self.pos[self.rc_index[f]] + 1, self.r[f]) for f in optional]
            ends += self._run_ends(inside + ([producer_at[key]] if made else []))
            if made:
                ends.append((self.pos[producer_at[key]] + 1, None))
            if e >= b:
                ends.append((self.n, None))
            hidden = self.hidden.get(key[0]) if not key[1] else None
            self._live(f"{key}", start, ends, 1 if hidden is None else self.f[hidden].Not(), units)
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
            kept = m.NewBoolVar(f"kept[{f}]")
            m.AddMinEquality(kept, [needed, rf.Not()])
            self.kept_lit[f] = self.saved_lit[f] = kept
            if self._offloadable(f):
                off, saved = m.NewBoolVar(f"offload[{p.ops[f].name}]"), m.NewBoolVar(f"saved[{f}]")
                m.Add(saved + off == kept)
                at = [m.NewBoolVar(f"offload[{f}]@{j}") for j in range(len(self.window_lit))]
                m.Add(sum(at) == off)
                for y, w in zip(at, self.window_lit):
                    m.AddImplication(y, w)
                self.off[f], self.saved_lit[f], self.off_at[f] = off, saved, at
            for t in p.ops[f].outputs:
                units = self.units(p.tensors[t].bytes)
                ends = [(self.pos[i] + 1, None) for i in fixed_readers] + self._run_ends(fixed_readers)
                ends += [(self.pos[self.rc_index[g]] + 1, self.r[g]) for g in free_rd]
                self._live(f"s{t}", 0, ends, kept, units)
                self._live(f"r{t}", self.pos[i_rc], ends + [(self.pos[i_rc] + 1, None)], rf, units)

    def _offloadable(self, f: int) -> bool:
        tensors = [self.p.tensors[t] for t in self.p.ops[f].outputs]
        return self.window is not None and all(t.offloadable and t.bytes > 0 for t in tensors)

    def _copy_ns(self, f: int) -> int:
        return cost_ns(sum(self.p.tensors[t].bytes for t in self.p.ops[f].outputs) / self.p.host_bw)

    def _offload_limits(self) -> None:
        """Host memory, and copies no longer than the compute that hides them (both directions)."""
        if not self.off:
            return
        w, m = self.window, self.m
        m.AddAtMostOne(self.window_lit)
        if w.host_left is not None:
            m.Add(sum(sum(self.p.tensors[t].bytes for t in self.p.ops[f].outputs) * x for f, x in self.off.items())
                  <= max(0, w.host_left))
        for j, (_k, copy_left_s) in enumerate(w.prefetches):
            m.Add(sum(self._copy_ns(f) * at[j] for f, at in self.off_at.items()) <= max(0, int(copy_left_s / 1e-9)))

    def _pinned(self, key: tuple[int, bool]) -> bool:
        t = self.p.tensors[key[0]]
        free = (TensorKind.ACTIVATION, TensorKind.TANGENT_FREED)  # a freed seed lives to its last reader
        return t.kind not in free or (t.id in self.p.outputs and not key[1])

    def _workspace(self) -> None:
        for i, (o, _rc) in enumerate(self.fixed):
            w = self.p.ops[o].workspace_bytes
            j = self.option_of.get(i)
            if j is None:
                if w:
                    self._live(f"ws{i}", self.pos[i], [(self.pos[i] + 1, None)], 1, self.units(w))
                continue
            kernel = self.p.fusion_options[j].workspace_bytes  # a formed run's steps all hold the kernel's
            if w:
                self._live(f"ws{i}", self.pos[i], [(self.pos[i] + 1, None)], self.f[j].Not(), self.units(w))
            if kernel:
                self._live(f"wsk{i}", self.pos[i], [(self.pos[i] + 1, None)], self.f[j], self.units(kernel))
        for f in self.free:
            w = self.p.ops[f].workspace_bytes
            if w:
                i = self.rc_index[f]
                self._live(f"ws{i}", self.pos[i], [(self.pos[i] + 1, None)], self.r[f], self.units(w))

    def outside_terms(self) -> list[tuple[int, list[int], tuple[int, ...]]]:
        """(bytes at a step before the segment with no free op kept, free outputs whose keeping adds to
        it, the prefetches from which offloaded ones count too), the largest per distinct set: a saved
        output lives from its last forward use to the segment, an offloaded one from its prefetch.

        The set at step k is the free outputs last used in the forward before k and the prefetches at or
        before k: it changes at those steps only, so the steps are walked once, the bytes of the set's
        copies on the device at each step summed by a difference array (per step, the set rebuilt, this
        was O(steps x free outputs): 80 Llama-7B layers, 4.9 s of a 22 s search in 23 segment models)."""
        p, sim, a = self.p, self.sim, self.a
        n_fw = sim.n_forward_steps
        fw_pos = {o: k for k, (o, _rc) in enumerate(sim.steps[:n_fw])}
        last_fw = {t: fw_pos[f] for t, f in self.owner.items()}
        for o, k in fw_pos.items():
            for t in p.ops[o].inputs:
                if t in last_fw:
                    last_fw[t] = max(last_fw[t], k)
        on_device: dict[int, list[tuple[int, int]]] = {}  # free output -> its copies' steps now
        for lt in sim.lifetimes:
            if lt.tensor in last_fw and not lt.recomputed:
                on_device.setdefault(lt.tensor, []).append((lt.start, lt.end))
        prefetches = [k for k, _s in self.window.prefetches] if self.window is not None else []
        n = max(a, n_fw + 1)  # the steps looked at: those before the segment, and the caller's boundary
        joins: dict[int, list[int]] = {}  # step -> the free outputs that join the set there
        counted = [0] * (n + 1)  # difference array: bytes of the set's members on the device at each step
        for t, last in last_fw.items():
            joins.setdefault(last + 1, []).append(t)
            for s, e in _union(on_device.get(t, ())):
                lo, hi = max(s, last + 1), min(e, n - 1)
                if lo <= hi:
                    counted[lo] += p.tensors[t].bytes
                    counted[hi + 1] -= p.tensors[t].bytes
        changes = set(joins) | {max(0, k) for k in prefetches}
        members: list[int] = []
        pattern, back, on = (), (), 0
        best: dict[tuple, int] = {}
        boundary = None
        for k in range(n):
            on += counted[k]
            if k in changes:
                if k in joins:
                    members += joins[k]
                    pattern = tuple(sorted(members))
                back = tuple(j for j, kj in enumerate(prefetches) if kj <= k)
            if k < a:
                key = (pattern, back)
                best[key] = max(best.get(key, 0), sim.timeline[k] - on)
            if k == n_fw and sim.boundary_bytes:  # offloaded outputs are on the host while the caller computes its loss
                boundary = (pattern, ()), sim.boundary_bytes - on
        if boundary is not None:
            key, base = boundary
            best[key] = max(best.get(key, 0), base)
        return [(base, list(pattern), back) for (pattern, back), base in best.items() if pattern]

    def outside_expr(self, tensors: list[int], back: tuple[int, ...] = ()):
        """What keeping `tensors` adds at a step: saved ones, and offloaded ones back from a prefetch in `back`."""
        def on_device(f: int):
            at = self.off_at.get(f)
            return self.saved_lit[f] + (sum(at[j] for j in back) if at and back else 0)
        return sum(self.units(self.p.tensors[t].bytes) * on_device(self.owner[t]) for t in tensors)

    def hint(self) -> None:
        rc_now = {o: k for k, (o, rc) in enumerate(self.sim.steps[self.a:self.b]) if rc}
        for i in range(len(self.fixed)):
            self.m.AddHint(self.pos[i], self.fixed_offset[i])
        for f in self.free:
            self.m.AddHint(self.r[f], f in rc_now)
            self.m.AddHint(self.pos[self.rc_index[f]], rc_now.get(f, 0))
        for f, x in self.off.items():
            self.m.AddHint(x, f not in rc_now and any(t in self.sim.offloads for t in self.p.ops[f].outputs))
        for j, f in self.f.items():
            self.m.AddHint(f, j in self.sim.formed)

    def time_ns(self):
        """Recomputation, plus OFFLOAD_PENALTY of every offload's copy time, less what formed options save."""
        return sum(cost_ns(self.p.ops[f].time_s) * self.r[f] for f in self.free) + sum(
            max(1, int(OFFLOAD_PENALTY * self._copy_ns(f))) * x for f, x in self.off.items()) - self.saved_ns()

    def extract(self, solver: cp_model.CpSolver, status: str, peak_units: int) -> SegmentPlan:
        chosen = {f for f in self.free if solver.Value(self.r[f])}
        present = list(range(len(self.fixed))) + [self.rc_index[f] for f in self.free if f in chosen]
        present.sort(key=lambda i: solver.Value(self.pos[i]))
        steps = [self.fixed[i] if i < len(self.fixed) else (self.free[i - len(self.fixed)], True) for i in present]
        offload = {f for f, x in self.off.items() if solver.Value(x)}
        back = [k for (k, _s), w in zip(self.window.prefetches, self.window_lit) if solver.Value(w)] if offload else []
        fusion = {j: bool(solver.Value(f)) for j, f in self.f.items()}
        return SegmentPlan(steps, chosen, status, peak_units, offload, back[0] if back else None, fusion)


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
    window: OffloadWindow | None = None,
    decide_fusion: bool = False,
) -> SegmentPlan | None:
    """The segment [a, b) replanned: least recompute time within `budget_bytes`, or (None) lowest peak;
    with `window`, free ops' outputs may be offloaded too; with `decide_fusion`, the fusion options of
    the segment's backward steps are formed or not (else each stays as the plan has it; either way
    `SegmentPlan.fusion` says, for `splice`).

    None when the model finds nothing (no plan within the budget in this model, or no time)."""
    if b - a < 1 or a < sim.n_forward_steps:
        return None
    model = _SegmentModel(problem, sim, a, b, free, window, decide_fusion)
    m, unit = model.m, model.unit
    outside = model.outside_terms()
    top = sum(model.demands) + model.const_units + max((base for base, _, _ in outside), default=0) // unit + 1
    if budget_bytes is not None:
        cap = budget_bytes // unit - model.const_units
        if cap < 0:
            return None
        m.AddCumulative(model.intervals, model.demands, cap)
        for base, tensors, back in outside:
            m.Add(model.outside_expr(tensors, back) <= budget_bytes // unit - model.units(base))
        m.Minimize(model.time_ns())
        model.hint()
        solver = make_solver(time_limit_s, workers, "segment")
        status = run_solver(solver, m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return model.extract(solver, solver.StatusName(status), -1)
    peak = m.NewIntVar(0, top, "peak")
    inner = m.NewIntVar(0, top, "inner")
    m.Add(peak >= inner + model.const_units)
    m.AddCumulative(model.intervals, model.demands, inner)
    for base, tensors, back in outside:
        m.Add(peak >= model.outside_expr(tensors, back) + model.units(base))
    m.Minimize(peak)
    model.hint()
    solver = make_solver(0.6 * time_limit_s, workers, "segment")
    status = run_solver(solver, m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    best_peak = solver.Value(peak)
    first = model.extract(solver, solver.StatusName(status), best_peak)
    # then the least recompute time at that peak
    m.ClearHints()
    for f in model.free:
        m.AddHint(model.r[f], f in first.recompute)
    for f, x in model.off.items():
        m.AddHint(x, f in first.offload)
    for j, f in model.f.items():
        m.AddHint(f, first.fusion[j])
    m.Add(peak <= best_peak)
    m.Minimize(model.time_ns())
    solver = make_solver(0.4 * time_limit_s, workers, "segment")
    status = run_solver(solver, m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return first
    return model.extract(solver, solver.StatusName(status), best_peak)


def _union(spans) -> list[tuple[int, int]]:
    """Overlapping [start, end] spans merged: a step inside two copies of one tensor counts it once."""
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]
