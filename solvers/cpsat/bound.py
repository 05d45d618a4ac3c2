"""CP-SAT on a relaxation: a valid lower bound, and plans for graphs too large for the interval model.

For a fixed op order, count at every step only what is *surely* live under a
decision: a saved activation from its last forward use to its last direct backward
reader (at least to the end of the forward), a recomputed one across its direct
backward readers, and the fixed profile. Every real plan in that order has at
least this much live, so the least recompute time under the budget in this model
bounds every plan in that order from below. The model is a 0-1 program with one
constraint per step that can bind, so it scales to thousands of ops.

With `offload`, a saved activation may instead go to the host: it then counts only
across its backward readers, and the copies' volume bounds the time compute waits.

Its solution may not fit when simulated (recomputation chains and transients are
not counted). `solve_bound_and_repair` adds, per step, what the simulator saw and
the model did not, and solves again until a plan fits; only the first solve's
bound is reported as the bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from .common import NS, cost_ns, make_solver, memory_unit, run_solver
from ..model.liveness import OrderedProblem
from ..model.problem import Problem
from ..model import calibration, clock

# a bound-only solve (one round) is not started when loading its model would take more than this share of its time:
# 80 Llama-7B layers' certification loaded 14,400 constraints (1.1 s on the clock) in a 1-3 s slice and never
# finished, 2.9-4.5 s on the clock (1.3-1.7 s of wall time) for the gap against each op once; 32 layers' loads in
# 0.45 s of a 1.8 s slice and proves a 0.8% gap
BOUND_LOAD_SHARE = 0.35


@dataclass
class BoundResult:
    recompute: set[int]  # the last (repaired) solution
    status: str  # of the first solve: OPTIMAL means bound_s is the relaxation's optimum
    bound_s: float  # valid lower bound on the recompute time of any plan in this order
    fits: bool  # whether `recompute` fits when simulated
    rounds: int
    wall_s: float
    offload: frozenset[int] = frozenset()  # tensors the last solution offloads (`offload_plans` only)
    # (recompute, offload) of the other solutions the solves found, last round first, each round's lowest objective
    # first (`alternatives` > 0 only)
    alternatives: list[tuple[frozenset[int], frozenset[int]]] = field(default_factory=list)


class _BoundModel:
    """`offload`: let any offloadable saved activation go to the host instead (valid bounds for
    problems with host bandwidth, and plans that offload: `solve_bound_and_repair(offload_plans=True)`)."""

    def __init__(self, problem: Problem, fw_order: list[int], bw_order: list[int], offload: bool = False):
        self.p = problem
        self.o = OrderedProblem(problem, fw_order, bw_order, optimistic_reuse=True)
        self.unit = memory_unit(problem)
        self.fw_s = sum(problem.ops[o].time_s for o in fw_order)
        self.bw_s = sum(problem.ops[o].time_s for o in bw_order)
        # (units, key, kind, first step, last step): kind "s" (saved) and "f" (offloaded: on the
        # device at least across its backward readers) are keyed by tensor, "r" (recomputed) by producer op
        self.spans: list[tuple[int, int, str, int, int]] = []
        self.offloadable: list[int] = []
        for act in self.o.activations:
            units = problem.tensors[act.tensor].bytes // self.unit  # rounded down: stays a relaxation
            # its last backward reader may write its output into this storage: then the output's bytes (in
            # the fixed profile) are these bytes at that step, counted once
            last = max(act.direct, default=self.o.F)
            if act.direct and self._reused_by(act.tensor, last):
                last -= 1
            self._span(units, act.tensor, "s", act.fw_last + 1, max(self.o.F - 1, last) if act.direct else self.o.F)
            if act.direct and act.producer in self.o.candidates:
                self._span(units, act.producer, "r", min(act.direct), last)
            if offload and problem.host_bw > 0 and problem.tensors[act.tensor].offloadable:
                self.offloadable.append(act.tensor)
                if act.direct:
                    self._span(units, act.tensor, "f", min(act.direct), last)

    def _span(self, units: int, key: int, kind: str, first: int, last: int) -> None:
        if last >= first:
            self.spans.append((units, key, kind, first, last))

    def _reused_by(self, tensor: int, k: int) -> bool:
        """Whether the backward op at step `k` may write an output into `tensor`'s storage."""
        return any(
            self.o.pos[r] == k and any(inp == tensor for _out, inp in self.p.ops[r].reuse)
            for r in self.o.bw_readers[tensor]
        )

    def fixed_units(self, k: int) -> int:
        return self.o.static[k] // self.unit

    def build(self, budget_bytes: int, margin: list[int], hint: set[int] | None, ties: list[list[int]] = ()):
        """A model with `margin` extra units at each step (all zero for the bound).

        The surely-live sum is carried from segment to segment (the steps between two
        changes of which terms are live) in one integer per segment, so the model has
        O(terms) entries rather than O(terms x steps), and one capacity constraint per
        segment, at its highest fixed profile.
        """
        m = cp_model.CpModel()
        r = {o: m.NewBoolVar(f"r{o}") for o in self.o.candidates}
        for group in ties:  # repeated blocks decide alike (no longer a relaxation: plans only, not bounds)
            present = [o for o in group if o in r]
            for o in present[1:]:
                m.Add(r[o] == r[present[0]])
        f = {t: m.NewBoolVar(f"f{t}") for t in self.offloadable}
        for group in ties:  # and offload alike: the same output of each tied op
            outs = [self.p.ops[o].outputs for o in group]
            for j in range(min(len(x) for x in outs)):
                present = [f[x[j]] for x in outs if x[j] in f]
                for v in present[1:]:
                    m.Add(v == present[0])
        self.f = f
        saved = {}
        for act in self.o.activations:
            s = saved[act.tensor] = m.NewBoolVar(f"s{act.tensor}")
            rp = r.get(act.producer, 0)
            kept = s + f.get(act.tensor, 0)  # saved on the device or on the host
            if act.direct:
                m.Add(kept + rp == 1)
            else:
                m.Add(kept + rp <= 1)
                for c in act.rc_readers:  # a recomputed reader needs it kept or recomputed
                    m.Add(kept + rp >= r[c])
                m.Add(kept <= sum(r[c] for c in act.rc_readers))
        cap = -(-budget_bytes // self.unit)  # rounded up: stays a relaxation
        T = self.o.T
        starts: list[list[int]] = [[] for _ in range(T + 1)]
        stops: list[list[int]] = [[] for _ in range(T + 1)]
        for i, (_u, _x, _s, first, last) in enumerate(self.spans):
            starts[first].append(i)
            stops[last + 1].append(i)
        lit = [{"s": saved, "r": r, "f": f}[kind][x] for _u, x, kind, _f, _l in self.spans]
        top = sum(u for u, *_ in self.spans)
        live, live_most = None, 0  # running sum variable, and its largest possible value
        k = 0
        while k < T:
            j = k + 1
            while j < T and not starts[j] and not stops[j]:
                j += 1
            delta = [self.spans[i][0] * lit[i] for i in starts[k]] + [-self.spans[i][0] * lit[i] for i in stops[k]]
            live_most += sum(self.spans[i][0] for i in starts[k]) - sum(self.spans[i][0] for i in stops[k])
            if delta or live is None:
                new = m.NewIntVar(0, top, f"live{k}")
                m.Add(new == (live if live is not None else 0) + sum(delta))
                live = new
            fixed = max(self.fixed_units(q) + margin[q] for q in range(k, j))
            if fixed + live_most > cap:  # else it can never bind
                m.Add(live + fixed <= cap)
            k = j
        recompute_ns = sum(cost_ns(self.p.ops[o].time_s) * v for o, v in r.items())
        if f:
            m.Minimize(recompute_ns + self._exposure(m, f, recompute_ns))
        else:
            m.Minimize(recompute_ns)
        if hint is not None:
            for o, v in r.items():
                m.AddHint(v, o in hint)
        return m, r

    def _exposure(self, m: cp_model.CpModel, f: dict, recompute_ns) -> cp_model.IntVar:
        """Time compute must wait for copies, at least: each queue carries every offloaded byte,
        copies out all end within the forward, copies back within the backward."""
        p = self.p
        vol_ns = sum(int(p.tensors[t].bytes / p.host_bw / NS) * v for t, v in f.items())  # rounded down
        if p.host_budget_bytes is not None:
            m.Add(sum(p.tensors[t].bytes * v for t, v in f.items()) <= p.host_budget_bytes)
        most = int(sum(p.tensors[t].bytes for t in f) / p.host_bw / NS) + 1
        exposed = m.NewIntVar(0, most, "exposed")
        m.Add(exposed >= vol_ns - int(self.fw_s / NS) - 1)
        m.Add(exposed >= vol_ns - int(self.bw_s / NS) - 1 - recompute_ns)
        return exposed

    def model_profile(self, recompute: set[int], offloaded: frozenset[int] = frozenset()) -> list[int]:
        """What this model counts at each step for a given recompute set (and set of tensors offloaded)."""
        delta = [0] * (self.o.T + 1)
        for u, x, kind, first, last in self.spans:
            if kind == "f":
                on = x in offloaded
            elif kind == "s":
                on = self.p.tensors[x].producer not in recompute and x not in offloaded
            else:
                on = x in recompute
            if on:
                delta[first] += u
                delta[last + 1] -= u
        out, run = [], 0
        for k in range(self.o.T):
            run += delta[k]
            out.append(run + self.fixed_units(k))
        return out


def solve_bound_and_repair(
    problem: Problem,
    fw_order: list[int],
    bw_order: list[int],
    budget_bytes: int,
    simulate_steps: Callable[[set[int]], list[int] | None],
    *,
    time_limit_s: float = 10.0,
    workers: int = 2,
    hint: set[int] | None = None,
    max_rounds: int = 8,
    ties: list[list[int]] = (),
    on_solution: Callable[[float, float], None] | None = None,
    gap_s: float = 0.0,
    offload: bool = False,
    offload_plans: bool = False,
    linearization_level: int | None = None,
    alternatives: int = 0,
) -> BoundResult | None:
    """Bound the recompute time for this order, then repair the relaxation's plan until it fits.

    `simulate_steps(recompute)` returns the simulated live bytes per model step (the
    maximum over the steps a model step stands for), or None if the plan fits.
    `gap_s`: stop a solve once its objective is within this many seconds of its bound.
    `linearization_level`: CP-SAT's (None: its default); 2 adds cuts that can close the bound far sooner.
    `alternatives`: keep up to this many of the other solutions the solves found (`BoundResult.alternatives`): with
    offloads, the model's objective prices copies by their volume only, and a solution it ranks lower may run faster
    when simulated (Llama-7B, 16 layers at 40%: the last solution 1.176x the unplanned step, one found before it 1.076x).
    `offload`: bound over plans that may also offload (then only the bound is meaningful), unless
    `offload_plans`: the plans offload too, `simulate_steps(recompute, offloaded)` simulates them and the
    result's `offload` holds the tensors offloaded.
    """
    t0 = time.perf_counter()
    deadline = clock.now() + time_limit_s
    model = _BoundModel(problem, fw_order, bw_order, offload or offload_plans)
    margin = [0] * model.o.T
    bound_s, status0, chosen, fits = 0.0, "UNKNOWN", set(hint or ()), False
    offloaded: frozenset[int] = frozenset()
    rounds = 0
    found: list[list[tuple[float, frozenset[int], frozenset[int]]]] = []  # per round: (objective, recompute, offload)
    for rounds in range(1, max_rounds + 1):
        left = deadline - clock.now()
        if left <= 0.05:
            break
        m, r = model.build(budget_bytes, margin, chosen if chosen else hint, ties)
        if max_rounds == 1 and clock.is_deterministic() and \
                calibration.seconds("cpsat_constraint", len(m.Proto().constraints)) > BOUND_LOAD_SHARE * left:
            break  # a bound only, and loading its model would take too much of the time: no solve (status UNKNOWN)
        share = 1.0 if max_rounds == 1 else 0.5 if rounds == 1 else 0.35  # one round only (a bound): all the time
        solver = make_solver(left * share, workers, "bound", linearization_level=linearization_level)
        solver.parameters.absolute_gap_limit = gap_s / NS
        cb = _Progress(on_solution, NS, r, model.f if offload_plans else {}, alternatives > 0) \
            if on_solution or alternatives else None
        status = run_solver(solver, m, cb)
        if cb is not None:
            found.append(sorted(cb.found, key=lambda x: x[0]))
        if rounds == 1:
            status0 = solver.StatusName(status)
            if status == cp_model.INFEASIBLE:
                return BoundResult(set(), "INFEASIBLE", float("inf"), False, rounds, time.perf_counter() - t0)
            # costs were rounded to whole ns (at least 1): take that slack off so the bound stays below
            bound_s = max(0.0, solver.BestObjectiveBound() - len(model.o.candidates)) * NS
            if ties:  # tied decisions restrict the plans: the model bounds nothing
                bound_s = 0.0
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        chosen = {o for o, v in r.items() if solver.Value(v)}
        if offload_plans:
            offloaded = frozenset(t for t, v in model.f.items() if solver.Value(v))
        over = simulate_steps(chosen, offloaded) if offload_plans else simulate_steps(chosen)
        if over is None:
            fits = True
            break
        counted = model.model_profile(chosen, offloaded)
        for k, live in enumerate(over):  # count next time what the model missed where it overflowed
            if live > budget_bytes:
                margin[k] = max(margin[k], -(-live // model.unit) - counted[k])
    others: list[tuple[frozenset[int], frozenset[int]]] = []
    last = (frozenset(chosen), offloaded)
    for _obj, rc, off in (x for per_round in reversed(found) for x in per_round):
        if len(others) >= alternatives:
            break
        if (rc, off) != last and (rc, off) not in others:
            others.append((rc, off))
    return BoundResult(chosen, status0, bound_s, fits, rounds, time.perf_counter() - t0, offloaded, others)


class _Progress(cp_model.CpSolverSolutionCallback):
    """Each solution's objective and bound to `report`; with `keep`, its recompute set and offloads in `found`."""

    def __init__(self, report: Callable[[float, float], None] | None, scale: float, r: dict, f: dict, keep: bool):
        super().__init__()
        self.report, self.scale, self.r, self.f, self.keep = report, scale, r, f, keep
        self.found: list[tuple[float, frozenset[int], frozenset[int]]] = []

    def on_solution_callback(self) -> None:
        if self.report is not None:
            self.report(self.ObjectiveValue() * self.scale, self.BestObjectiveBound() * self.scale)
        if self.keep:
            self.found.append((self.ObjectiveValue(), frozenset(o for o, v in self.r.items() if self.Value(v)),
                               frozenset(t for t, v in self.f.items() if self.Value(v))))
