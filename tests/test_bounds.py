"""Bounds and optimality claims against brute force (issue 14: bounds not always valid, "OPTIMAL" without proof).

On small random training problems (4-9 forward ops, a loss, a mirrored backward; see
`tests/bruteforce.py`) every subset of the recomputable forward ops is placed as the solvers place
recomputations (`place_recomputes`) and simulated, so for one order we know the true lowest peak and the
true least step time under any budget. An independent liveness replay written from the simulator's stated
memory convention must agree with `simulate` on every enumerated plan, so that a simulator bug shows up
here rather than being inherited by the ground truth.

Enumerating recompute sets with `place_recomputes` covers a subset of the plans in an order (a
recomputation could also be placed elsewhere), so its minima are upper bounds on the true minima: a bound
above them, or an "OPTIMAL" objective above them, is a real violation, never an artefact of the test.

What each claim is tested against, as the code states it:
- `lower_bound_peak(problem)` ("a peak no schedule can go below"): every plan in every forward order we
  enumerate, and the peak of the plan `solve()` returns (`Solution.lower_bound_bytes`).
- `SolveStats.bound_s` (docstring of `solve`: "the reported bound comes from the relaxation for the
  order the plan runs in, so the gap is valid for that order"; note "bound: relaxation over
  save/recompute plans in this order"): every save/recompute plan in the plan's own order
  (`base_orders`) that fits the budget.
- status "OPTIMAL": the objective is the least time among those plans.
- `solve()` never returns a plan over budget; `BudgetInfeasibleError` says "the lowest peak found is X
  and no plan can go below Y": X is the simulated peak of `lowest_schedule` and above the budget, Y a
  valid lower bound.

Offloading is out of scope (host_bw = 0 throughout): with it the claims change to
"save/recompute/offload plans" and brute force would have to enumerate offload placements too.

Known violations are kept as minimal explicit regressions, marked xfail(strict=True): when the solver
is fixed they start passing, pytest reports XPASS as a failure, and the xfail must be removed (and
`KNOWN_REUSE_ALL_BUG` below set to False so the fuzzers draw `reuse_all` ops again).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from optsched.solvers import BudgetInfeasibleError, Op, Phase, Problem, Tensor, TensorKind, simulate, solve
from optsched.solvers.search import strategy
from optsched.solvers.search.heuristics import lower_bound_peak, place_recomputes
from optsched.solvers.search.heuristics import base_orders

from tests.bruteforce import (
    describe,
    enumerate_plans,
    least_time_within,
    min_peak,
    min_time_within,
    replay,
    topological_fw_orders,
    training_problems,
)
from tests.hypothesis_profiles import examples

REL = 1e-9  # op times are whole microseconds: the solvers' ns rounding is exact, so only float noise remains
TIME_LIMIT_S = 0.5

# lower_bound_peak subtracts only the largest reused input for a `reuse_all` op, which frees all of them
# (test_lower_bound_with_reuse_all_regression). Until that is fixed the fuzzers leave `reuse_all` out, or
# every claim resting on the peak bound would fail on it.
KNOWN_REUSE_ALL_BUG = False

CHEAP = settings(
    max_examples=examples(200),
    deadline=None,
    derandomize=True,  # the same examples every run: a failure is a bug, not bad luck
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
SOLVES = settings(CHEAP, max_examples=examples(60))
SOLVES_MANY = settings(CHEAP, max_examples=examples(150))  # the solves are fast on problems this small


def _problems(**kw):
    return training_problems(reuse_all=not KNOWN_REUSE_ALL_BUG, **kw)


def _program(problem: Problem) -> tuple[list[int], list[int]]:
    return [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops]


def _le(a: float, b: float) -> bool:
    return a <= b + REL * max(abs(a), abs(b))


# ---------------------------------------------------------------------------------------------
# the ground truth itself


def test_replay_agrees_with_the_simulator_by_hand():
    """The replay on a case computed by hand: reuse in the forward, a recomputation, workspace."""
    A = TensorKind.ACTIVATION
    tensors = [
        Tensor(0, "x", 10, TensorKind.INPUT),
        Tensor(1, "a", 100, A, 0),
        Tensor(2, "b", 100, A, 1),
        Tensor(3, "loss", 1, A, 2),
        Tensor(4, "tangent", 1, TensorKind.TANGENT),
        Tensor(5, "ga", 100, A, 3),
        Tensor(6, "gx", 10, A, 4),
    ]
    ops = [
        Op(0, "fa", Phase.FW, (0,), (1,), 1e-6),
        Op(1, "fb", Phase.FW, (1,), (2,), 1e-6, reuse=((2, 1),)),  # b written into a
        Op(2, "loss", Phase.FW, (2,), (3,), 1e-6),
        Op(3, "bb", Phase.BW, (4, 2), (5,), 2e-6, workspace_bytes=7),
        Op(4, "ba", Phase.BW, (5, 1), (6,), 1e-6),
    ]
    p = Problem(ops, tensors, outputs=frozenset({3, 6}))
    plans = {tuple(sorted(pl.recompute)): pl for pl in enumerate_plans(p, *_program(p))}
    # saving everything: a is read in the backward, so fb cannot take it over
    # steps: fa [x a]=110, fb [x a b]=210, loss [x a b loss]=211, bb [x a b loss t ga]+7=319, ba [x a loss t ga gx]=222
    assert replay(p, plans[()].schedule).timeline == [110, 210, 211, 319, 222]
    # recomputing fa: a dies in the forward at fb, which writes b into it
    # fa 110, fb [x b]=110, loss 111, bb [x b loss t ga]+7=219, fa' [x loss t ga a']=212, ba [x loss t ga a' gx]=222
    sched = plans[(0,)].schedule
    assert sched.bw_order == [3, 0, 4]
    assert replay(p, sched).timeline == [110, 110, 111, 219, 212, 222]
    assert simulate(p, sched).timeline == [110, 110, 111, 219, 212, 222]


@CHEAP
@given(_problems(), st.data())
def test_replay_agrees_with_the_simulator_in_every_order(problem, data):
    """Every recompute set in a few forward orders: `enumerate_plans` asserts replay == simulate."""
    orders = topological_fw_orders(problem, limit=50)
    fw = data.draw(st.sampled_from(orders))
    enumerate_plans(problem, fw, [o.id for o in problem.bw_ops], check=True)


@CHEAP
@given(_problems(), st.data())
def test_least_time_within_agrees_with_enumerating_every_plan(problem, data):
    """`least_time_within` (the brute force that skips what cannot fit, for problems too big to enumerate)
    finds what enumerating every plan finds, in any forward order, at any budget."""
    fw = data.draw(st.sampled_from(topological_fw_orders(problem, limit=20)))
    bw = [o.id for o in problem.bw_ops]
    plans = enumerate_plans(problem, fw, bw, check=False)
    peaks = sorted({pl.peak_bytes for pl in plans})
    budget = data.draw(st.sampled_from([None, peaks[0] - 1, *peaks]))
    found = least_time_within(problem, fw, bw, budget)
    if found is None:
        assert min_time_within(plans, budget) == float("inf")
        return
    assert budget is None or found.peak_bytes <= budget
    assert found.time_s == pytest.approx(min_time_within(plans, budget), rel=REL, abs=0), describe(problem)


# ---------------------------------------------------------------------------------------------
# (a) the peak lower bound


@CHEAP
@given(_problems())
def test_lower_bound_peak_is_below_every_plan_in_every_order(problem):
    bound = lower_bound_peak(problem)
    bw = [o.id for o in problem.bw_ops]
    for fw in topological_fw_orders(problem, limit=30):
        lowest = min_peak(enumerate_plans(problem, fw, bw, check=False))
        assert bound <= lowest, f"lower_bound_peak {bound} > a plan's peak {lowest} in order {fw}\n{describe(problem)}"


def _reuse_all_problem() -> Problem:
    """x -> a, x -> b; (a, b) -> (c, d) writing c into a and d into b together (reuse_all); loss(c, d)."""
    A = TensorKind.ACTIVATION
    tensors = [
        Tensor(0, "x", 1, TensorKind.INPUT),
        Tensor(1, "a", 10, A, 0),
        Tensor(2, "b", 10, A, 1),
        Tensor(3, "c", 10, A, 2),
        Tensor(4, "d", 10, A, 2),
        Tensor(5, "loss", 1, A, 3),
        Tensor(6, "tangent", 1, TensorKind.TANGENT),
        Tensor(7, "gx", 1, A, 4),
    ]
    ops = [
        Op(0, "fa", Phase.FW, (0,), (1,), 1e-6),
        Op(1, "fb", Phase.FW, (0,), (2,), 1e-6),
        Op(2, "fcd", Phase.FW, (1, 2), (3, 4), 1e-6, reuse=((3, 1), (4, 2)), reuse_all=True),
        Op(3, "loss", Phase.FW, (3, 4), (5,), 1e-6),
        Op(4, "bw", Phase.BW, (6,), (7,), 1e-6),
    ]
    return Problem(ops, tensors, outputs=frozenset({5, 7}))


def test_lower_bound_with_reuse_all_regression():
    p = _reuse_all_problem()
    bw = [o.id for o in p.bw_ops]
    true_min = min(min_peak(enumerate_plans(p, fw, bw)) for fw in topological_fw_orders(p))
    assert true_min == 22  # x 1 + c 10 + d 10 + loss 1 at the loss step; fcd allocates nothing new
    assert lower_bound_peak(p) <= true_min


def test_solution_lower_bound_is_below_its_own_peak_with_reuse_all_regression():
    p = _reuse_all_problem()
    sol = solve(p, 22, time_limit_s=TIME_LIMIT_S, workers=2)
    assert sol.sim.peak_bytes == 22
    assert sol.lower_bound_bytes <= sol.sim.peak_bytes


# ---------------------------------------------------------------------------------------------
# (b)-(d) what solve() claims


@st.composite
def _solve_cases(draw):
    """A problem and a budget: None, one of the peaks some plan in program order reaches (mostly one of the
    lowest: tight budgets are where conservative models miss plans), or just below the least of them."""
    problem = draw(_problems())
    plans = enumerate_plans(problem, *_program(problem))
    peaks = sorted({pl.peak_bytes for pl in plans})
    kind = draw(st.sampled_from(["tight", "tight", "tight", "peak", "below", "none"]))
    if kind == "none":
        budget = None
    elif kind == "below":
        budget = peaks[0] - draw(st.integers(1, 64))
    elif kind == "tight":  # among the three lowest peaks: recomputation is needed, and choosing it is hard
        budget = draw(st.sampled_from(peaks[:3]))
    else:
        budget = draw(st.sampled_from(peaks))
    return problem, plans, budget


def _check_solution(problem: Problem, plans_program, budget: int | None, sol) -> str:
    """Every claim of `sol` against brute force, whatever its status (returned, for the callers to see that
    OPTIMAL, the strongest claim, is among those checked)."""
    what = f"budget {budget}, stats {sol.stats}\n{describe(problem)}"
    sim = simulate(problem, sol.schedule)
    # (d) never over budget; what it reports is what the simulator says, and the independent replay too
    assert budget is None or sim.peak_bytes <= budget, what
    assert sol.sim.peak_bytes == sim.peak_bytes and sol.sim.time_s == sim.time_s, what
    mine = replay(problem, sol.schedule)
    assert mine.peak_bytes == sim.peak_bytes and mine.time_s == pytest.approx(sim.time_s, rel=REL), what
    assert sol.stats.objective_s == pytest.approx(sim.time_s, rel=REL), what
    assert sol.lower_bound_bytes == _solves_bound(problem, budget)
    assert sol.lower_bound_bytes <= sim.peak_bytes, f"peak bound above the plan's own peak: {what}"
    assert problem.host_bw == 0  # the claims below are the recompute-only ones
    fw, bw = base_orders(problem, sol.schedule)
    plans = plans_program if (fw, bw) == _program(problem) else enumerate_plans(problem, fw, bw)
    fastest = min_time_within(plans, budget)  # brute force: the fastest enumerated plan in the plan's order
    placed = place_recomputes(problem, fw, bw, sol.schedule.recomputed(problem)) == sol.schedule
    # the plan's time is real (replayed above), so no optimum is above it; when its recomputations are placed
    # as the enumeration places them it is one of the enumerated plans, so none is below brute force's either
    # (placed elsewhere it may beat every enumerated plan: then it is the fastest known plan)
    if placed:
        assert _le(fastest, sol.stats.objective_s), (
            f"objective {sol.stats.objective_s!r} below the fastest plan {fastest!r} brute force finds, "
            f"though the plan is one it enumerates: {what}")
    best = min(fastest, sim.time_s)
    # (b) the bound holds over every plan in the plan's order that fits
    assert _le(sol.stats.bound_s, best), (
        f"bound_s {sol.stats.bound_s!r} above the least time {best!r} of a plan in the plan's order "
        f"(fw {fw}) within the budget: {what}"
    )
    assert _le(sol.stats.bound_s, sol.stats.objective_s), what
    assert sol.stats.gap >= 0
    # (c) OPTIMAL: nothing in that space is faster: the objective is the optimum
    if sol.stats.status == "OPTIMAL":
        assert _le(sol.stats.objective_s, best) and _le(best, sol.stats.objective_s), (
            f"OPTIMAL at {sol.stats.objective_s!r} but a plan in the plan's order (fw {fw}) fits in "
            f"{best!r}: {what}"
        )
    return sol.stats.status


def _solves_bound(problem, budget) -> int:
    """The bound `solve` reports: with the joint family at a budget under JOINT_NEAR times the point families'."""
    return strategy.peak_bound_for(problem, budget)


def _solve_and_check(case) -> str:
    """What `solve` claims on the case, checked; its status ("infeasible" for BudgetInfeasibleError)."""
    problem, plans, budget = case
    assert lower_bound_peak(problem) <= min_peak(plans)
    try:
        sol = solve(problem, budget, time_limit_s=TIME_LIMIT_S, workers=2)
    except BudgetInfeasibleError as e:
        # (d) what the error claims: the lowest peak found is real and over budget, the bound is a bound
        assert budget is not None
        assert e.lower_bound_bytes == _solves_bound(problem, budget)
        assert e.lowest_schedule is not None
        assert simulate(problem, e.lowest_schedule).peak_bytes == e.lowest_peak_bytes
        assert e.lowest_peak_bytes > budget
        assert e.lower_bound_bytes <= min_peak(plans), f"'no plan can go below' is false\n{describe(problem)}"
        assert getattr(e, "proven", e.lower_bound_bytes > budget) == (e.lower_bound_bytes > budget)
        if e.lower_bound_bytes > budget:
            assert min_peak(plans) > budget, f"'no plan can fit' is false\n{describe(problem)}"
        return "infeasible"
    return _check_solution(problem, plans, budget, sol)


def _fuzz_statuses(settings_) -> Counter:
    """`_solve_and_check` on each drawn case; how often each status came back (so that a caller can see the
    checks of OPTIMAL ran, not only those every status gets)."""
    statuses: Counter = Counter()

    @settings_
    @given(_solve_cases())
    def run(case):
        statuses[_solve_and_check(case)] += 1

    run()
    return statuses


def test_solve_bounds_and_optimality_against_brute_force():
    statuses = _fuzz_statuses(SOLVES_MANY)
    solved = sum(n for k, n in statuses.items() if k != "infeasible")
    # problems this small are mostly proven (95 of the 119 solved cases here): OPTIMAL was checked
    assert statuses["OPTIMAL"] >= solved // 4, statuses


@SOLVES
@given(_solve_cases())
def test_solve_finds_a_plan_whenever_brute_force_does(case):
    """BudgetInfeasibleError says "no plan fits": on problems this small a plan in the program order that
    fits must be found within the time limit."""
    problem, plans, budget = case
    assume(budget is not None and min_peak(plans) <= budget)
    try:
        solve(problem, budget, time_limit_s=TIME_LIMIT_S, workers=2)
    except BudgetInfeasibleError as e:
        fitting = min((pl for pl in plans if pl.peak_bytes <= budget), key=lambda pl: pl.peak_bytes)
        raise AssertionError(
            f"{e}; but recomputing {sorted(fitting.recompute)} in program order peaks at {fitting.peak_bytes}\n"
            f"{describe(problem)}"
        ) from e


@pytest.mark.slow
def test_solve_bounds_and_optimality_long_fuzz():
    statuses = _fuzz_statuses(settings(SOLVES, max_examples=300))
    assert statuses["OPTIMAL"] >= sum(n for k, n in statuses.items() if k != "infeasible") // 4, statuses


def _interval_model_problem() -> Problem:
    """Found by the fuzzer (shrunk by hypothesis): seven forward ops (f0, f3 recomputable), seven backward
    ops, every op 1 us. Program order, nothing recomputed: 14 us at 512 bytes; recomputing f0: 15 us at
    456; f3: 15 us at 460; both: 16 us at 456. The interval model over-counts memory (storage reuse, a
    recomputation's operands across its whole step), so at budget 456 it proves "OPTIMAL" for {f0, f3},
    16 us; `prune_recomputes` then drops f3, and the plan is reported OPTIMAL at 15 us with bound_s 16 us."""
    A, F, B = TensorKind.ACTIVATION, Phase.FW, Phase.BW
    sizes = {"in0": 64, "f0.0": 64, "f0.1": 128, "f1.0": 128, "f2.0": 128, "f3.0": 128, "f3.1": 64, "f4.0": 64,
             "f4.1": 64, "f5.0": 64, "loss": 4, "tangent": 4, "b6.0": 4, "b5.0": 4, "b4.0": 4, "b3.0": 64,
             "b2.0": 64, "b2.1": 64, "b1.0": 64, "b0.0": 64, "b0.1": 128}
    ids = {name: i for i, name in enumerate(sizes)}
    # (name, phase, inputs, outputs, recomputable, reuse pairs)
    spec = [
        ("f0", F, ["in0"], ["f0.0", "f0.1"], True, [("f0.0", "in0")]),
        ("f1", F, ["f0.1"], ["f1.0"], False, [("f1.0", "f0.1")]),
        ("f2", F, ["f1.0", "in0"], ["f2.0"], False, [("f2.0", "f1.0")]),
        ("f3", F, ["f2.0"], ["f3.0", "f3.1"], True, [("f3.0", "f2.0")]),
        ("f4", F, ["f3.1"], ["f4.0", "f4.1"], False, [("f4.0", "f3.1")]),
        ("f5", F, ["f4.1"], ["f5.0"], False, [("f5.0", "f4.1")]),
        ("loss", F, ["f5.0"], ["loss"], False, []),
        ("b6", B, ["tangent"], ["b6.0"], True, [("b6.0", "tangent")]),
        ("b5", B, ["b6.0", "tangent"], ["b5.0"], True, [("b5.0", "b6.0")]),
        ("b4", B, ["b5.0", "tangent"], ["b4.0"], True, [("b4.0", "b5.0")]),
        ("b3", B, ["b4.0", "tangent", "f2.0", "f3.0"], ["b3.0"], True, []),
        ("b2", B, ["b3.0"], ["b2.0", "b2.1"], True, [("b2.0", "b3.0")]),
        ("b1", B, ["b2.0", "tangent"], ["b1.0"], True, []),
        ("b0", B, ["b1.0", "f0.0"], ["b0.0", "b0.1"], True, []),
    ]
    producer = {out: k for k, (_n, _p, _i, outs, _r, _u) in enumerate(spec) for out in outs}
    kind = {"in0": TensorKind.INPUT, "tangent": TensorKind.TANGENT}
    tensors = [Tensor(i, n, b, kind.get(n, A), producer.get(n)) for n, i in ids.items() for b in [sizes[n]]]
    ops = [
        Op(k, n, ph, tuple(ids[t] for t in ins), tuple(ids[t] for t in outs), 1e-6, rec,
           tuple((ids[o], ids[i]) for o, i in reuse))
        for k, (n, ph, ins, outs, rec, reuse) in enumerate(spec)
    ]
    return Problem(ops, tensors, outputs=frozenset(ids[t] for t in ("loss", "b2.1", "b0.0", "b0.1")))


def test_interval_model_optimal_is_not_a_proof_regression():
    # fails on e950523 (OPTIMAL, bound_s 16 us, objective 15 us); passes with the strategy that no longer takes
    # the interval model's status and bound (uncommitted work on issue 14 when this test was written)
    p = _interval_model_problem()
    plans = {tuple(sorted(pl.recompute)): (pl.peak_bytes, round(pl.time_s * 1e6)) for pl in enumerate_plans(p, *_program(p))}
    assert plans[()] == (512, 14) and plans[(0,)] == (456, 15) and plans[(3,)] == (460, 15) and plans[(0, 3)] == (456, 16)
    sol = solve(p, 456, time_limit_s=TIME_LIMIT_S, workers=2)
    assert sol.sim.peak_bytes <= 456
    # brute force in the plan's own order (the program's: the forward is a chain): 15 us is the optimum
    fw, bw = base_orders(p, sol.schedule)
    assert min_time_within(enumerate_plans(p, fw, bw), 456) == pytest.approx(15e-6, rel=REL)
    assert _le(sol.stats.bound_s, 15e-6), sol.stats  # recomputing f0 alone fits in 15 us
    assert _le(sol.stats.bound_s, sol.stats.objective_s), sol.stats
    # whatever the status: the search finds that optimum on a problem this small (the plan recomputes f0);
    # it was an "OPTIMAL" with a bound above it that the bug made
    assert sol.stats.objective_s == pytest.approx(15e-6, rel=REL), sol.stats
    assert sol.stats.status != "OPTIMAL" or _le(15e-6, sol.stats.bound_s), sol.stats  # OPTIMAL: bound met


def _backward_reuse_problem(c_bytes: int) -> Problem:
    """x -> a (5 B), x -> c; loss(a, c); bl(tangent, a) -> ga writes ga into a (a dies there); bc(ga, c) -> gc
    writes gc into ga. Every op 1 us. The relaxation keeps a saved activation live through its last backward
    reader, but the simulator hands its storage to that reader's output: it counts a twice at bl."""
    A, F, B = TensorKind.ACTIVATION, Phase.FW, Phase.BW
    tensors = [
        Tensor(0, "x", 1, TensorKind.INPUT), Tensor(1, "a", 5, A, 0), Tensor(2, "c", c_bytes, A, 1),
        Tensor(3, "loss", 1, A, 2), Tensor(4, "tangent", 1, TensorKind.TANGENT), Tensor(5, "ga", 5, A, 3),
        Tensor(6, "gc", 5, A, 4),
    ]
    ops = [
        Op(0, "fa", F, (0,), (1,), 1e-6), Op(1, "fc", F, (0,), (2,), 1e-6), Op(2, "loss", F, (1, 2), (3,), 1e-6),
        Op(3, "bl", B, (4, 1), (5,), 1e-6, reuse=((5, 1),)), Op(4, "bc", B, (5, 2), (6,), 1e-6, reuse=((6, 5),)),
    ]
    return Problem(ops, tensors, outputs=frozenset({3, 6}))


def test_relaxation_bound_with_backward_reuse_regression():
    from optsched.solvers.cpsat.bound import solve_bound_and_repair

    p = _backward_reuse_problem(c_bytes=10)
    fw, bw = _program(p)
    plans = enumerate_plans(p, fw, bw)
    nothing = next(pl for pl in plans if not pl.recompute)
    assert nothing.peak_bytes == 18 == min_peak(plans)
    res = solve_bound_and_repair(p, fw, bw, 18, lambda _r: None, time_limit_s=TIME_LIMIT_S, workers=2, max_rounds=1)
    assert res is not None and res.status != "INFEASIBLE"
    assert res.bound_s <= 0.0, res  # a plan recomputing nothing fits


def _single_backward_reuse_problem() -> Problem:
    """x -> a (10 B); loss(a); bl(tangent, a) -> ga written into a; ba(ga) -> gx. Every op 1 us; the program
    peaks at 14 bytes (x, ga, loss, tangent, gx at ba)."""
    A, F, B = TensorKind.ACTIVATION, Phase.FW, Phase.BW
    tensors = [
        Tensor(0, "x", 1, TensorKind.INPUT), Tensor(1, "a", 10, A, 0), Tensor(2, "loss", 1, A, 1),
        Tensor(3, "tangent", 1, TensorKind.TANGENT), Tensor(4, "ga", 10, A, 2), Tensor(5, "gx", 1, A, 3),
    ]
    ops = [
        Op(0, "fa", F, (0,), (1,), 1e-6), Op(1, "loss", F, (1,), (2,), 1e-6),
        Op(2, "bl", B, (3, 1), (4,), 1e-6, reuse=((4, 1),)), Op(3, "ba", B, (4,), (5,), 1e-6),
    ]
    return Problem(ops, tensors, outputs=frozenset({2, 5}))


def test_relaxation_rejects_a_plan_that_fits_regression():
    from optsched.solvers.cpsat.bound import solve_bound_and_repair

    p = _single_backward_reuse_problem()
    fw, bw = _program(p)
    assert min_peak(enumerate_plans(p, fw, bw)) == 14
    res = solve_bound_and_repair(p, fw, bw, 14, lambda _r: None, time_limit_s=TIME_LIMIT_S, workers=2, max_rounds=1)
    assert res is not None and res.status != "INFEASIBLE", res


def test_a_bound_only_solve_whose_model_takes_most_of_its_time_to_load_is_not_started():
    """Certification's one-round relaxation: when loading its model alone would take more than BOUND_LOAD_SHARE of
    the time (80 Llama-7B layers: 14,400 constraints in a 1-3 s slice, never finished), no solve starts and nothing
    is charged; with the time to load and solve it, the same call bounds."""
    from optsched.solvers.cpsat import bound
    from optsched.solvers.model import calibration, clock
    from optsched.solvers.model.problem import default_schedule
    from optsched.solvers.synthetic import chain_training_problem

    p = chain_training_problem(60)
    budget = simulate(p, default_schedule(p)).peak_bytes // 2
    fw, bw = [o.id for o in p.fw_ops], [o.id for o in p.bw_ops]

    def bound_only(limit):
        with clock.deterministic():
            res = bound.solve_bound_and_repair(p, fw, bw, budget, lambda _r: None, time_limit_s=limit, workers=1,
                                               max_rounds=1)
            return res, clock.units_counted()

    ample, units = bound_only(5.0)
    assert ample.status == "OPTIMAL" and ample.bound_s > 0
    load = calibration.seconds("cpsat_constraint", units["cpsat_constraint"])
    short = 0.9 * load / bound.BOUND_LOAD_SHARE
    assert short > 0.05  # above the loop's own least time: the load is what stops it
    skipped, units = bound_only(short)
    assert skipped.status == "UNKNOWN" and skipped.bound_s == 0.0 and "cpsat_constraint" not in units
    _started, units = bound_only(1.1 * load / bound.BOUND_LOAD_SHARE)
    assert units["cpsat_constraint"] > 0  # loaded and solved (what it proves in that time may vary)
