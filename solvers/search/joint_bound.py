"""A peak bound over one save/recompute choice for the whole program, weighed at every step at once.

Why: `peak_bound`'s families bound each step alone, and each may assume its own choice: the caller's loss as if
every activation were recomputed, a backward op as if the ones it needs were saved. No plan does both. On
nn.TransformerEncoder (3 layers, width 128) the point bounds said 10.19 MiB where every plan found needed 11.81: the
plans keep six layer-norm outputs across the caller's loss because recomputing one more makes some layer's backward
hold a recomputed chain beside its gradients. One choice S (the set of forward ops recomputed) held at every step
says 11.28.

The argument. Take any plan the simulator accepts, S its recomputed ops (each recomputed once). In the simulator a
forward value whose producer is not in S has one copy, from the forward to its last read (by backward ops and by
recomputations); one whose producer is in S is read in the backward only from its recomputed copy, made before every
backward read of it (a recomputation's included). "Claimable" values are those peak_bound's chained family claims
(made by the forward, held by nobody outside, on the device, taking memory). Then in that plan:

* while the caller computes its loss: what `_Bound._caller_held` counts, and every claimable value the backward reads
  (a backward op, or the recomputation of an op in S) whose producer is not in S, unless a backward op writes into it;
* at each forward op f: `_Bound._forward(f)`, and every such value made by an ancestor of f that no forward op after
  f reads (those `_forward` counts already);
* at each backward op b: `_Bound._bw_const(b)` (inputs, held seeds, forward step outputs, b's operands and scratch),
  and, in terms of the plan's order (after(o): backward op o runs after b; A(P): P is in S and recomputed after b):
    - a claimable forward value read after b (by a backward op o with after(o), or the recomputation of a Q with
      A(Q)) is live at b unless A(its producer): its copy was made before b, or is made again after it;
    - A(P) needs P in S, every backward reader of P's outputs after b, and A(Q) for each Q in S reading them;
    - after() is closed under dependencies (b's ancestors before it, its descendants after);
    - a backward value made before b and read after it (a step output: made before b) and a seed the backward frees
      that is read after b are live at b;
  and for b1 before b2 in every plan, A(P) at b2 implies A(P) at b1.

Every plan gives S, after() and A() satisfying all of these, and its peak is at least each step's sum. So the least,
over every S and every assignment, of the largest sum is a lower bound: a 0-1 program solved by CP-SAT
(`_Master`). Not every backward op is put in (a 365-op Llama's would take minutes): the model starts with the
START_POINTS highest and, after each solve, checks its S at other backward ops, each a minimum cut with S fixed
(`_point_value`, the highest last value first, CHECKS of them at most), adding those above the solution's peak (ADD
at most), until none is, ROUNDS solves are done or the solves' work (SOLVE_DTIME, LOADS) or the checks' (CHECK_ARCS)
is spent. Each solve's proven bound holds whatever points it has (fewer
points: a relaxation of the same argument), so a limit reached early weakens the bound and never breaks it. The
solves are deterministic (one worker, CP-SAT's deterministic time), so the same problem gets the same bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from ortools.graph.python import max_flow
from ortools.sat.python import cp_model

from ..cpsat.common import DETERMINISTIC_WALL_FACTOR, memory_unit, run_solver, work_unit
from ..model import calibration
from ..model.problem import Phase, TensorKind
from .flow import INF

MAX_OPS = 400  # problems with more ops are left to the other families (each point's model is as large as the backward)
START_POINTS = 3  # backward ops in the first solve (the highest upper bounds)
CHECKS = 48  # backward ops whose minimum cut is checked against each solution, the highest last value first
ADD = 4  # of those above the solution's peak, added to the next solve at most
ROUNDS = 8  # solves at most
SOLVE_DTIME = 0.15  # CP-SAT's deterministic time for all solves together (each takes what the ones before left)
LOADS = 15_000  # constraints loaded by all solves together (each solve loads the whole model, built in Python)
CHECK_ARCS = 500_000  # arcs of the checks' networks together; then no more checks
WORK_UNIT = work_unit("joint")


@dataclass
class _Answer:
    bound: int  # memory units, proven
    peak: int  # the solution's peak (memory units), or -1 with no solution
    recomputed: frozenset[int]
    optimal: bool


def joint_bound(b, consts: dict, upper: dict[int, int], best: int) -> tuple[int, str]:
    """The joint bound if above `best` (and where), else (best, ""). `b`: peak_bound's `_Bound` (its forward ops' bounds
    computed); `consts`: per backward op, `_bw_const`; `upper`: per backward op, an upper bound of its point bound (the
    first points are the highest)."""
    p = b.p
    if not p.has_backward or len(p.ops) > MAX_OPS:
        return best, ""
    master = _Master(b, consts, best)
    if not master.values:
        return best, ""
    order = sorted(master.consts, key=lambda o: (-upper.get(o, 0), o))
    last = {o: master.consts[o][0] for o in order}
    for o in order[:START_POINTS]:
        master.add_point(o)
    answer, arc_end = None, b.joint_arcs + CHECK_ARCS
    for _ in range(ROUNDS):
        answer = master.solve()
        if answer.peak < 0 or not answer.optimal or master.dtime_left <= 0 or b.joint_arcs >= arc_end:
            break
        if master.loaded + 1.25 * master.size() > LOADS:  # the next solve's model (with the ops it adds) would not fit
            break
        above = _points_above(b, master, answer, last, upper, arc_end)
        if not above:
            break
        for o in above:
            master.add_point(o)
    value = answer.bound * master.unit if answer else 0
    if value > best:
        return value, f"over one save/recompute choice at {len(master.points)} backward ops and the forward's"
    return best, ""


def _points_above(b, master: _Master, answer: _Answer, last: dict[int, int], upper: dict[int, int],
                  arc_end: int) -> list[int]:
    """Backward ops not in the model whose minimum cut, with the solution's recomputed set, is above its peak (an op
    whose upper bound, every value it may need kept, is not above it cannot be)."""
    above: list[tuple[int, int]] = []
    todo = sorted((o for o in last if o not in master.points and upper.get(o, INF) // master.unit > answer.peak),
                  key=lambda o: (-last[o], o))
    for o in todo[:CHECKS]:
        if b.joint_arcs >= arc_end:
            break
        v = last[o] = _point_value(b, master, o, answer.recomputed)
        if v // master.unit > answer.peak:
            above.append((v, o))
            if len(above) >= ADD:
                break
    return [o for _v, o in sorted(above, key=lambda vo: (-vo[0], vo[1]))]


class _Master:
    """The 0-1 program of the module docstring, a backward op's constraints added at a time."""

    def __init__(self, b, consts: dict, best: int):
        self.b, p = b, b.p
        self.unit = memory_unit(p)
        is_bw = [op.phase is Phase.BW for op in p.ops]
        self.bw_readers = [[q for q in b.readers[t.id] if is_bw[q]] for t in p.tensors]
        self.rec = [op.id for op in p.fw_ops if b.recomputable[op.id]]
        rec = set(self.rec)
        self.rec_readers = [[q for q in b.readers[t.id] if q in rec] for t in p.tensors]
        self.values = [t.id for t in p.tensors if b.claimable(t.id) and (self.bw_readers[t.id] or self.rec_readers[t.id])]
        self.value_set = set(self.values)
        self.bw_values = [t.id for t in p.tensors
                          if b.size[t.id] and (b.bw_made[t.id] or t.kind is TensorKind.TANGENT_FREED)]
        self.consts = consts
        self.m = m = cp_model.CpModel()
        self.r = {q: m.NewBoolVar(f"recompute_{q}") for q in self.rec}
        top = (sum(b.size) + sum(b.ws) + b.inputs) // self.unit + 1
        self.peak = m.NewIntVar(min(best // self.unit, top), top, "peak")
        self.points: dict[int, dict[int, object]] = {}  # backward op -> its A() per recomputable op
        self.dtime_left = SOLVE_DTIME
        self.loaded = 0  # constraints the solves so far loaded
        self._forward_and_caller()
        m.Minimize(self.peak)

    def size(self) -> int:
        return len(self.m.Proto().constraints)

    def units(self, nbytes: int) -> int:
        return nbytes // self.unit

    def _producer_r(self, t: int):
        return self.r.get(self.b.p.tensors[t].producer)

    def _forward_and_caller(self) -> None:
        b, p, m = self.b, self.b.p, self.m
        saved = {}
        for w in self.values:
            rw, s = self._producer_r(w), m.NewBoolVar(f"saved_{w}")
            if self.bw_readers[w]:
                m.Add(s == 1) if rw is None else m.Add(s + rw >= 1)
            else:  # read by recomputations only: kept when one of them runs and w's producer does not
                for q in self.rec_readers[w]:
                    m.Add(s >= self.r[q] - (rw if rw is not None else 0))
            saved[w] = s
        base, held = b._caller_held
        if held:
            written = {i for op in p.bw_ops for _o, i in op.reuse}
            m.Add(self.peak >= self.units(base) + sum(self.units(b.size[w]) * saved[w] for w in self.values
                                                      if w not in held and w not in written))
        # a value `_forward` counts at every op after its producer is not a term; one only recomputations read (a
        # dropout's output under a recomputed add) is, kept when they run
        kept = [w for w in self.values if not b.live_across_forward(w)]
        for f in p.fw_ops:
            anc, desc, own = b.anc[f.id], b.desc[f.id], set(f.inputs) | set(f.outputs)
            terms = [self.units(b.size[w]) * saved[w] for w in kept
                     if w not in own
                     and anc >> p.tensors[w].producer & 1
                     and not any(desc >> q & 1 for q in b.readers[w] if p.ops[q].phase is Phase.FW)]
            if terms:
                m.Add(self.peak >= self.units(b.fw_values[f.id]) + sum(terms))

    def add_point(self, at: int) -> None:
        after = self._order_at(at)
        rec_after = self._recomputed_after(at, after)
        terms = self._forward_terms(at, after, rec_after) + self._backward_terms(at, after)
        self.m.Add(self.peak >= self.units(self.consts[at][0]) + sum(terms))

    def _order_at(self, at: int) -> dict[int, object]:
        """after(o) per backward op: 0 (before `at`, or `at` itself), 1 (after it), or a variable."""
        b, m = self.b, self.m
        anc, desc = b.anc[at], b.desc[at]
        after: dict[int, object] = {}
        for op in b.p.bw_ops:
            o = op.id
            after[o] = 0 if o == at or anc >> o & 1 else 1 if desc >> o & 1 else m.NewBoolVar(f"after_{at}_{o}")
        for o, x in after.items():
            for q in b.preds[o]:
                if q in after and not (isinstance(x, int) and isinstance(after[q], int)):
                    m.Add(x >= after[q])
        return after

    def _recomputed_after(self, at: int, after: dict[int, object]) -> dict[int, object]:
        """A(P) per recomputable op P: 0 or a variable; tied to the same op's A() at the points already in."""
        b, m, r = self.b, self.m, self.r
        rec_after: dict[int, object] = {}
        for q in self.rec:
            readers = [after[o] for t in b.p.ops[q].outputs for o in self.bw_readers[t]]
            if any(isinstance(x, int) and x == 0 for x in readers):
                rec_after[q] = 0
                continue
            x = rec_after[q] = m.NewBoolVar(f"recomputed_after_{at}_{q}")
            m.AddImplication(x, r[q])
            for y in readers:
                if not isinstance(y, int):
                    m.Add(y >= x)
        for q, x in rec_after.items():
            if isinstance(x, int):
                continue
            for t in b.p.ops[q].outputs:
                for c in self.rec_readers[t]:
                    if isinstance(rec_after[c], int):
                        m.Add(x + r[c] <= 1)
                    else:
                        m.Add(rec_after[c] >= x + r[c] - 1)
            for other, xs in self.points.items():
                y = xs.get(q)
                if y is None or isinstance(y, int):
                    continue
                if b.anc[at] >> other & 1:  # `other` runs before `at`: recomputed after `at`, after `other` too
                    m.Add(y >= x)
                elif b.anc[other] >> at & 1:
                    m.Add(x >= y)
        self.points[at] = rec_after
        return rec_after

    def _forward_terms(self, at: int, after: dict, rec_after: dict) -> list:
        b, m = self.b, self.m
        skip = self.consts[at][1]
        terms = []
        for w in self.values:
            if w in skip:
                continue
            alt = rec_after[b.p.tensors[w].producer] if self._producer_r(w) is not None else 0
            reads = [after[o] for o in self.bw_readers[w] if o != at] + [rec_after[q] for q in self.rec_readers[w]]
            reads = [x for x in reads if not (isinstance(x, int) and x == 0)]
            if not reads:
                continue
            live = m.NewBoolVar(f"live_{at}_{w}")
            for x in reads:
                m.Add(live + alt >= x)
            terms.append(self.units(b.size[w]) * live)
        return terms

    def _backward_terms(self, at: int, after: dict) -> list:
        b, p, m = self.b, self.b.p, self.m
        skip, desc = self.consts[at][1], b.desc[at]
        terms = []
        for x in self.bw_values:
            if x in skip:
                continue
            t = p.tensors[x]
            if t.kind is TensorKind.TANGENT_FREED:
                reads = [after[o] for o in b.readers[x] if o != at and not (isinstance(after[o], int) and after[o] == 0)]
                made_before = 1
            else:
                if t.producer == at or desc >> t.producer & 1:
                    continue
                made_before = 1 - after[t.producer]
                reads = [1] if x in p.outputs else [after[o] for o in b.readers[x] if o != at
                                                    and not (isinstance(after[o], int) and after[o] == 0)]
            if not reads:
                continue
            live = m.NewBoolVar(f"live_{at}_{x}")
            for y in reads:
                m.Add(live >= made_before + y - 1)
            terms.append(self.units(b.size[x]) * live)
        return terms

    def solve(self) -> _Answer:
        solver = cp_model.CpSolver()
        solver.optsched_work_unit = WORK_UNIT  # type: ignore[attr-defined]  # charged by run_solver
        solver.optsched_constraint_unit = "joint_constraint"  # type: ignore[attr-defined]
        params = solver.parameters
        params.num_workers, params.random_seed, params.linearization_level = 1, 0, 0
        params.max_deterministic_time = self.dtime_left
        params.max_time_in_seconds = DETERMINISTIC_WALL_FACTOR * calibration.seconds(WORK_UNIT, self.dtime_left)
        status = run_solver(solver, self.m)
        self.dtime_left -= solver.deterministic_time
        self.loaded += self.size()
        bound = math.floor(solver.BestObjectiveBound() + 1e-6)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return _Answer(bound if status == cp_model.UNKNOWN else 0, -1, frozenset(), False)
        chosen = frozenset(q for q, x in self.r.items() if solver.Value(x))
        self.m.ClearHints()
        for q, x in self.r.items():
            self.m.AddHint(x, q in chosen)
        return _Answer(bound, round(solver.ObjectiveValue()), chosen, status == cp_model.OPTIMAL)


def _point_value(b, master: _Master, at: int, recomputed: frozenset[int]) -> int:
    """The constraint of backward op `at` with the recomputed set fixed, as bytes: its constant part and a minimum cut.
    Source side: before `at` (ops), kept at `at` (a recomputable op's copies: its outputs are paid for where needed after
    `at`); sink side: after `at`, made again after `at`, needed after `at` (a forward value). `at`'s ancestors are the
    source itself, its descendants the sink."""
    p = b.p
    const, skip = master.consts[at]
    anc, desc = b.anc[at], b.desc[at]
    net = _Arcs()
    node = {op.id: _SRC if op.id == at or anc >> op.id & 1 else _SNK if desc >> op.id & 1 else net.node()
            for op in p.bw_ops}
    for o, k in node.items():
        if k > _SNK:
            for q in b.preds[o]:
                if q in node:
                    net.edge(k, node[q], INF)
    _backward_values(b, master, at, net, node)
    again = {q: net.node() for q in master.rec if q in recomputed}
    needed: dict[int, int] = {}
    for w in master.values:
        if w not in skip:
            needed[w] = k = net.node()
            for o in master.bw_readers[w]:
                if o != at:
                    net.edge(k, node[o], INF)
            net.edge(again.get(p.tensors[w].producer, _SRC), k, b.size[w])
    for q, k in again.items():
        for t in p.ops[q].outputs:
            for o in master.bw_readers[t]:
                net.edge(node[o], k, INF)
            for c in master.rec_readers[t]:
                if c in again:
                    net.edge(again[c], k, INF)
        for u in p.ops[q].inputs:
            if u in needed:
                net.edge(needed[u], k, INF)
    b.joint_arcs += len(net.heads)
    return const + net.max_flow()


def _backward_values(b, master: _Master, at: int, net: _Arcs, node: dict[int, int]) -> None:
    """The backward's values and freed seeds in `_point_value`'s network (as peak_bound's `_cut` has them)."""
    p, skip, desc = b.p, master.consts[at][1], b.desc[at]
    for x in master.bw_values:
        if x in skip:
            continue
        t = p.tensors[x]
        others = [o for o in b.readers[x] if o != at]
        if t.kind is TensorKind.TANGENT_FREED:
            tail = _SRC
        elif t.producer == at or desc >> t.producer & 1:
            continue
        elif x in p.outputs:
            net.edge(node[t.producer], _SNK, b.size[x])
            continue
        else:
            tail = node[t.producer]
        if others:
            y = net.node()
            net.edge(tail, y, b.size[x])
            for o in others:
                net.edge(y, node[o], INF)


_SRC, _SNK = 0, 1


class _Arcs:
    """A flow network's arcs, solved by OR-tools' max flow. Arcs into the source, out of the sink or from a node to
    itself are left out (no path from source to sink uses them)."""

    def __init__(self) -> None:
        self.n = 2
        self.tails: list[int] = []
        self.heads: list[int] = []
        self.caps: list[int] = []

    def node(self) -> int:
        self.n += 1
        return self.n - 1

    def edge(self, u: int, v: int, c: int) -> None:
        if u != v and u != _SNK and v != _SRC:
            self.tails.append(u)
            self.heads.append(v)
            self.caps.append(c)

    def max_flow(self) -> int:
        if not self.tails:
            return 0
        finite = sum(c for c in self.caps if c < INF)
        flow = max_flow.SimpleMaxFlow()
        flow.add_arcs_with_capacity(np.array(self.tails, dtype=np.int64), np.array(self.heads, dtype=np.int64),
                                    np.minimum(np.array(self.caps, dtype=np.int64), finite + 1))
        status = flow.solve(_SRC, _SNK)
        if status != flow.OPTIMAL:
            raise RuntimeError(f"max flow failed ({status})")
        return flow.optimal_flow()
