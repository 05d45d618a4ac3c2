"""Hoisting readers above the backward's peak (solvers/search/hoist.py): the plans it returns are valid by the
independent checker, their peak is the independent replay's, and never above the plan it started from."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optsched.solvers import Phase, Schedule, TensorKind, simulate
from optsched.solvers.model import clock
from optsched.solvers.search.heuristics import place_recomputes
from optsched.solvers.search.hoist import hoist_readers
from tests.bruteforce import recomputable_fw_ops, replay, topological_orders, training_problems
from tests.hypothesis_profiles import examples
from tests.schedule_checker import assert_valid
from tests.test_solvers import Builder


def _two_branches():
    """Forward a, c (64 bytes each) from x; the backward's first step makes a 128-byte P from the tangent alone,
    then P's reader, then a's and c's readers: run in that order, a and c are live while P is made."""
    b = Builder()
    x = b.tensor("x", 8)
    (a,) = b.op("f", Phase.FW, [x], [64])
    (c,) = b.op("k", Phase.FW, [x], [64])
    (loss,) = b.op("h", Phase.FW, [a, c], [1])
    t = b.tensor("t", 1, TensorKind.TANGENT)
    (p,) = b.op("p", Phase.BW, [t], [128])
    (g1,) = b.op("q", Phase.BW, [p], [1])
    (g2,) = b.op("r", Phase.BW, [t, a], [1])
    (g3,) = b.op("s", Phase.BW, [t, c], [1])
    return b.problem([loss, g1, g2, g3])


def test_readers_of_values_live_across_the_peak_run_before_it():
    problem = _two_branches()
    start = Schedule([0, 1, 2], [3, 4, 5, 6])
    sim = simulate(problem, start)
    hoisted, hsim = hoist_readers(problem, start, sim, None, clock.now() + 10.0)
    assert_valid(problem, hoisted, "hoist_readers")
    assert hoisted.bw_order[-2:] == [3, 4]  # a's and c's readers first, then the step that makes P and its reader
    # the least any order holds while q runs: x, the loss, the tangent, P and the three gradients
    assert hsim.peak_bytes == 8 + 1 + 1 + 128 + 3 == replay(problem, hoisted).peak_bytes < sim.peak_bytes


def test_no_time_no_change():
    problem = _two_branches()
    start = Schedule([0, 1, 2], [3, 4, 5, 6])
    sim = simulate(problem, start)
    assert hoist_readers(problem, start, sim, None, clock.now() - 1.0) == (start, sim)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(problem=training_problems(), seed=st.integers(0, 2**16), budget_share=st.sampled_from((None, 0.5, 0.8)))
def test_hoisted_plans_are_valid_and_never_higher(problem, seed, budget_share):
    rng = random.Random(seed)
    fw = [o.id for o in problem.fw_ops]
    bw_orders = topological_orders(problem, [o.id for o in problem.bw_ops], limit=6)
    bw = rng.choice(bw_orders)
    ops = recomputable_fw_ops(problem)
    start = place_recomputes(problem, fw, bw, rng.sample(ops, rng.randint(0, len(ops))))
    sim = simulate(problem, start)
    budget = None if budget_share is None else int(sim.peak_bytes * budget_share)
    hoisted, hsim = hoist_readers(problem, start, sim, budget, clock.now() + 5.0)
    assert_valid(problem, hoisted, "hoist_readers")
    assert hsim.peak_bytes == replay(problem, hoisted).peak_bytes == simulate(problem, hoisted).peak_bytes
    assert hsim.peak_bytes <= sim.peak_bytes
    assert sorted(hoisted.bw_order) == sorted(start.bw_order) and hoisted.fw_order == start.fw_order
