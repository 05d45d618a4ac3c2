"""The sweep (solvers/search/sweep.py): plans for a budget on a measure other than the problem's peak, as
optimize_fsdp's per-rank total (a block's peak plus every other block's saved activations) is. Torch-free."""

from __future__ import annotations

import pytest

from optsched.solvers import SimResult, TensorKind, simulate, solve
from optsched.solvers.search.sweep import recompute_ladder, schedule_for, sweep
from optsched.solvers.synthetic import chain_training_problem

PROBLEM = chain_training_problem(6, act_bytes=1 << 20, seed=1)
FLOOR = 8 << 20  # fixed terms the measure adds to every plan
OTHERS = 3  # blocks whose saved activations count beside the running one's peak
LIMIT = 0.5


def measure(sim: SimResult) -> int:
    saved = sum(PROBLEM.tensors[t].bytes for t in sim.saved if PROBLEM.tensors[t].kind != TensorKind.INPUT)
    return FLOOR + sim.peak_bytes + OTHERS * saved


@pytest.fixture(scope="module")
def fastest():
    return sweep(PROBLEM, measure, None, floor=FLOOR, time_limit_s=LIMIT)


def test_without_a_budget_the_solvers_fastest_plan_alone(fastest):
    sol = solve(PROBLEM, None, time_limit_s=LIMIT)
    [only] = fastest.tried
    assert (only.how, only.peak_budget) == ("solve", None)
    assert (only.sim.peak_bytes, only.sim.time_s, only.total) == (sol.sim.peak_bytes, sol.sim.time_s, measure(sol.sim))
    assert fastest.bound == FLOOR + sol.lower_bound_bytes <= only.total
    assert fastest.fitting(None) == fastest.tried


def test_below_the_fastest_plan_every_candidate_is_measured_and_the_fitting_ones_come_fastest_first(fastest):
    budget = FLOOR + (fastest.tried[0].total - FLOOR) * 3 // 5
    found = sweep(PROBLEM, measure, budget, floor=FLOOR, time_limit_s=LIMIT)
    assert {c.how for c in found.tried} >= {"solve", "full_recompute", "checkpoint_blocks", "sqrt_segments", "recompute"}
    assert all(c.total == measure(c.sim) >= found.bound for c in found.tried)
    for c in found.tried:  # each candidate is the plan it names, as the simulator judges it
        if c.how == "solve":
            again = solve(PROBLEM, c.peak_budget, time_limit_s=LIMIT).sim
            assert (again.peak_bytes, again.time_s) == (c.sim.peak_bytes, c.sim.time_s)
            assert c.peak_budget is None or c.sim.peak_bytes <= c.peak_budget
        else:
            again = simulate(PROBLEM, schedule_for(c.how, c.recompute, PROBLEM))
            assert (again.peak_bytes, again.time_s) == (c.sim.peak_bytes, c.sim.time_s)
    fits = found.fitting(budget)
    assert fits and all(c.total <= budget for c in fits)
    assert [(c.sim.time_s, c.total) for c in fits] == sorted((c.sim.time_s, c.total) for c in fits)
    assert len(fits) < len(found.tried)  # the fastest plan, at least, does not fit
    # the bisection keeps a solver's plan for a peak budget under the fastest plan's peak that the measure fits
    assert any(c.how == "solve" and c.peak_budget is not None and c.total <= budget for c in found.tried)


def test_a_budget_below_the_bound_is_refused_without_a_search(fastest):
    found = sweep(PROBLEM, measure, fastest.bound - 1, floor=FLOOR, time_limit_s=LIMIT)
    assert found.tried == fastest.tried and found.bound == fastest.bound
    assert found.fitting(fastest.bound - 1) == []


def test_the_recompute_ladder_adds_the_next_cheapest_op_per_byte_at_each_rung():
    ladder = recompute_ladder(PROBLEM)
    assert [len(r) for r in ladder] == list(range(1, len(ladder) + 1))
    assert all(ladder[k][:-1] == ladder[k - 1] for k in range(1, len(ladder)))
    per_byte = [PROBLEM.ops[o].time_s / sum(PROBLEM.tensors[t].bytes for t in PROBLEM.ops[o].outputs) for o in ladder[-1]]
    assert per_byte == sorted(per_byte)
