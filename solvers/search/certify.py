"""What a plan may claim: its bound, gap and status, proven about the plan returned (formed fusion groups included).

"OPTIMAL" only with a proof about that plan in the simulator's semantics. Training with a budget: the
relaxation for the plan's own order and groups (`certify`). Training without one: every op once on the
problem with the plan's groups merged. Forward-only: the peak is what is minimized, so OPTIMAL only when
the plan's simulated peak meets `lower_bound_peak` (valid for every order, scratch space and storage reuse
counted); the order model's own optimum ignores both and proves nothing here.
"""

from __future__ import annotations

from ..cpsat.bound import solve_bound_and_repair
from ..model.problem import Problem, Schedule, SolveStats
from ..model.simulator import SimResult
from .fusion_groups import merge_formed
from .heuristics import base_orders, lower_bound_peak
from .incumbent import gap
from .starts import GAP_TARGET

CERTIFY_MIN_S = 0.05  # less time than this: the relaxation is not started
CUT_LINEARIZATION = 2  # CP-SAT's linearization level with its cuts (see _relaxation_bound) ...
CUT_SHARE = 0.3  # ... and its share of the relaxation's time ...
CUT_MAX_OPS = 2000  # ... on graphs up to this size (Llama-7B layers: 8 layers, 939 ops, 2.52% -> 2.41%; 32 and 80
# layers no gap changed in that share, and 80 layers took 1-2 s longer)


def merged(problem: Problem, schedule: Schedule) -> tuple[Problem, Schedule]:
    """The problem and plan with the plan's formed fusion groups as single ops (their time and memory)."""
    if not schedule.formed:
        return problem, schedule
    fused, schedule = merge_formed(problem, schedule)
    return fused.problem, schedule


def certify_plan(problem: Problem, schedule: Schedule, sim: SimResult, budget: int | None, stats: SolveStats,
                 time_s: float, workers: int) -> None:
    """Set `stats` (a copy the caller owns) for the plan returned: objective, bound, gap, status."""
    stats.objective_s = sim.time_s
    stats.notes = [n for n in stats.notes if not n.startswith("bound:")]
    if not problem.has_backward:
        _certify_forward(problem, schedule, sim, stats)
    elif budget is None:
        p, _s = merged(problem, schedule)
        _set_bound(stats, sum(o.time_s for o in p.ops))
        stats.notes.append("bound: every plan (each op once)" + (" with these fusion groups" if schedule.formed else ""))
    else:
        certify(problem, schedule, budget, stats, time_s, workers)


def _certify_forward(problem: Problem, schedule: Schedule, sim: SimResult, stats: SolveStats) -> None:
    p, _s = merged(problem, schedule)
    peak_bound = lower_bound_peak(p)
    stats.bound_s, stats.gap = sim.time_s, 0.0  # every order runs each op once: the time is fixed
    if sim.peak_bytes <= peak_bound:
        stats.status = "OPTIMAL"
    elif stats.status == "OPTIMAL":
        stats.status = "FEASIBLE"
    stats.notes.append(f"peak bound {peak_bound} bytes over every order (inputs and any one op's operands)")


def certify(problem: Problem, schedule: Schedule, budget: int, stats: SolveStats, time_s: float, workers: int) -> None:
    """The bound and status a plan may claim: the relaxation's bound for the plan's own order and fusion
    groups (valid for every plan in that order with those groups formed, offloading ones too when the
    problem allows offloading), "OPTIMAL" only when the plan meets it; when the relaxation cannot run,
    the bound every such plan meets (each op once, no waiting)."""
    problem, schedule = merged(problem, schedule)  # formed groups change times and memory
    fw, bw = base_orders(problem, schedule)
    base_s = sum(problem.ops[o].time_s for o in fw + bw)
    res = _relaxation_bound(problem, fw, bw, budget, schedule, base_s, time_s, workers) if time_s > CERTIFY_MIN_S else None
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


def _relaxation_bound(problem: Problem, fw: list[int], bw: list[int], budget: int, schedule: Schedule, base_s: float,
                      time_s: float, workers: int):
    """The relaxation for this order solved for its bound at CP-SAT's default linearization, then, unless that
    proved it optimal, with its cuts (linearization level 2): the 12-layer GPT's relaxation is optimal at once with
    them, where the default level stays 2% under its optimum for seconds (the gap reported, 3.1% -> 1.2%). The
    higher bound is kept: both are valid. Together they take at most `time_s` (each solve ends once within
    GAP_TARGET of its bound: what it leaves flows on, to the chunk counts planned after this one), CUT_SHARE of it
    for the cuts, on graphs up to CUT_MAX_OPS ops. They took half of it before (a first round's share of a repair
    loop's limit), and 32 Llama-7B layers' relaxation, which proves a 0.8% gap in 2 s, did not finish in 0.9 s."""
    best = None
    cut = CUT_SHARE if len(problem.ops) <= CUT_MAX_OPS else 0.0
    for level, limit in ((None, (1 - cut) * time_s), (CUT_LINEARIZATION, cut * time_s)):
        if limit <= CERTIFY_MIN_S:  # one round: the solve takes its whole limit
            continue
        got = solve_bound_and_repair(
            problem, fw, bw, budget, lambda _r: None, time_limit_s=limit, workers=workers, max_rounds=1,
            gap_s=GAP_TARGET * base_s, offload=problem.host_bw > 0, hint=set(schedule.recomputed(problem)),
            linearization_level=level,
        )
        if got is not None and got.status == "INFEASIBLE":
            return got  # a relaxation cannot reject a plan that fits: the caller says so
        if got is not None and got.status in ("OPTIMAL", "FEASIBLE") and (best is None or got.bound_s > best.bound_s):
            best = got
        if best is not None and best.status == "OPTIMAL":
            break
    return best


def _set_bound(stats: SolveStats, bound_s: float) -> None:
    stats.bound_s = bound_s
    stats.gap = gap(stats.objective_s, bound_s)
    if stats.gap <= 1e-6:  # within the ns rounding of costs
        stats.status = "OPTIMAL"
    elif stats.status == "OPTIMAL":
        stats.status = "FEASIBLE"
