"""The baselines library (solvers/baselines): every heuristic gives a schedule the simulator runs, on
synthetic chains, the Thunder seed as data and small random training problems; and each does what its
source says on the cases where that is easy to see."""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optsched.solvers import Phase, Problem, default_schedule, simulate
from optsched.solvers.baselines import BASELINES, checkpoint_blocks, dtr_eviction, sqrt_segments
from optsched.solvers.baselines.inductor_orders import bfs_order, dfs_order, lpmf_order
from optsched.solvers.search.blocks import find_blocks
from optsched.solvers.search.heuristics import lower_bound_peak
from optsched.solvers.synthetic import chain_training_problem, parallel_paths_problem
from tests.bruteforce import training_problems
from tests.hypothesis_profiles import examples

SYNTHETIC = {
    "chain8": chain_training_problem(8),
    "chain3": chain_training_problem(3, act_bytes=1 << 12, seed=3),
    "chain8_offload": chain_training_problem(8, host_bw=1e10),
    "chain6_offload_host_budget": chain_training_problem(6, host_bw=1e9, host_budget_bytes=3 << 20),
    "paths10": parallel_paths_problem(),
    "paths3": parallel_paths_problem(3, nbytes=1024),
}
RANDOM = settings(
    max_examples=examples(40),
    deadline=None,
    derandomize=True,  # the same examples every run: a failure is a bug, not bad luck
    suppress_health_check=[HealthCheck.too_slow],
)


def peak(problem: Problem, schedule) -> int:
    return simulate(problem, schedule).peak_bytes


def budgets(problem: Problem) -> list[int | None]:
    eager = peak(problem, default_schedule(problem))
    low = lower_bound_peak(problem)
    return [None, low, (low + eager) // 2, eager]


def check_all(problem: Problem) -> None:
    """Every baseline at every budget: a schedule the simulator accepts, offloads only with a host link."""
    for name, fn in BASELINES.items():
        for budget in budgets(problem):
            schedule = fn(problem, budget)
            sim = simulate(problem, schedule)  # raises on an invalid schedule
            assert sim.peak_bytes > 0, name
            assert not schedule.offload or problem.host_bw > 0, name
            assert max(Counter(sim.recomputed_ops).values(), default=0) <= 1, name


def test_the_registry_has_every_heuristic_with_one_signature():
    assert {"eager", "checkpoint_blocks", "sqrt_segments", "order_lpmf", "order_bfs", "order_dfs",
            "thunder_horizontal", "dtr_eviction", "offload_all"} <= set(BASELINES)
    for name, fn in BASELINES.items():
        params = list(inspect.signature(fn).parameters.values())
        assert params[0].name == "problem" and params[1].name == "budget_bytes", name
        assert params[1].default is None, name
        assert all(p.default is not inspect.Parameter.empty for p in params[1:]), name
        assert fn.__doc__ and inspect.getmodule(fn).__doc__, name


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_every_baseline_simulates_on_synthetic_problems(name):
    check_all(SYNTHETIC[name])


@RANDOM
@given(problem=training_problems(), host=st.sampled_from([0.0, 1e6]))
def test_every_baseline_simulates_on_random_problems(problem, host):
    check_all(dataclasses.replace(problem, host_bw=host))


def test_eager_is_the_default_schedule():
    for problem in SYNTHETIC.values():
        assert BASELINES["eager"](problem, 123) == default_schedule(problem)


def test_sqrt_segments_lowers_a_chains_peak_recomputing_each_op_once():
    problem = chain_training_problem(16)
    eager = simulate(problem, default_schedule(problem))
    sim = simulate(problem, sqrt_segments(problem))
    assert sim.peak_bytes < eager.peak_bytes
    assert sim.recomputed_ops and len(sim.recomputed_ops) == len(set(sim.recomputed_ops))
    # the boundaries are saved: fewer saved activations than eager's, at least one per checkpointed segment
    assert 0 < len(sim.saved) < len(eager.saved)
    # one segment (the last is never checkpointed, as checkpoint_sequential) is eager itself
    assert sqrt_segments(problem, n_segments=1) == default_schedule(problem)
    with pytest.raises(ValueError):
        sqrt_segments(problem, n_segments=0)


def test_checkpoint_blocks_k1_recomputes_inside_every_block():
    problem = chain_training_problem(8)
    groups = find_blocks(problem)
    assert len(groups.blocks) >= 2
    recomputed = set(checkpoint_blocks(problem, k=1).recomputed(problem))
    for b in groups.blocks:
        assert recomputed & set(groups.members[b]), groups.members[b]
    every_other = set(checkpoint_blocks(problem, k=2).recomputed(problem))
    hit = [b for b in groups.blocks if every_other & set(groups.members[b])]
    assert hit == groups.blocks[::2]
    eager_peak = peak(problem, default_schedule(problem))
    assert peak(problem, checkpoint_blocks(problem, k=1)) < eager_peak


@pytest.mark.parametrize("name", ["chain8", "chain3", "chain8_offload"])
def test_dtr_under_a_budget_is_never_above_eager(name):
    problem = SYNTHETIC[name]
    eager_peak = peak(problem, default_schedule(problem))
    low = lower_bound_peak(problem)
    for frac in (0.0, 0.25, 0.5, 0.75, 0.95):
        budget = int(low + frac * (eager_peak - low))
        assert peak(problem, dtr_eviction(problem, budget)) <= eager_peak
    # the chain has room: at 3/4 of the way down DTR reaches the budget
    budget = int(low + 0.75 * (eager_peak - low))
    assert peak(problem, dtr_eviction(problem, budget)) <= budget
    assert dtr_eviction(problem, None) == default_schedule(problem)


@RANDOM
@given(problem=training_problems(), frac=st.sampled_from([0.1, 0.5, 0.9]))
def test_dtr_on_random_problems_is_never_above_eager(problem, frac):
    eager_peak = peak(problem, default_schedule(problem))
    low = lower_bound_peak(problem)
    budget = int(low + frac * max(eager_peak - low, 0))
    assert peak(problem, dtr_eviction(problem, budget)) <= eager_peak


def is_topological(problem: Problem, order: list[int]) -> bool:
    made = {t.id for t in problem.tensors if t.producer is None}
    for o in order:
        if not set(problem.ops[o].inputs) <= made:
            return False
        made.update(problem.ops[o].outputs)
    return sorted(order) == [o.id for o in problem.fw_ops]


@RANDOM
@given(problem=training_problems())
def test_forward_orders_are_topological(problem):
    for order in (lpmf_order(problem), bfs_order(problem), dfs_order(problem)):
        assert is_topological(problem, order)
    for name in ("order_lpmf", "order_bfs", "order_dfs", "order_inductor", "thunder_horizontal"):
        schedule = BASELINES[name](problem)
        assert schedule.bw_order == [o.id for o in problem.ops if o.phase is Phase.BW]
        simulate(problem, schedule)


@pytest.mark.parametrize("n_paths", [3, 10])
def test_lpmf_undoes_the_thunder_seeds_breadth_first_order(n_paths):
    """The seed: stage by stage over every path holds every path's temporary (2.75 MiB above the inputs at
    10 paths); least-peak-memory-first finishes each path first (0.75 MiB); Thunder's horizontal order is
    the stage-by-stage one."""
    nbytes = 256 * 256 * 4
    problem = parallel_paths_problem(n_paths, nbytes)
    inputs = (n_paths + 1) * nbytes
    program = peak(problem, default_schedule(problem))
    lpmf = peak(problem, BASELINES["order_lpmf"](problem))
    assert lpmf <= program
    assert lpmf - inputs == 3 * nbytes
    assert peak(problem, BASELINES["thunder_horizontal"](problem)) - inputs == (n_paths + 1) * nbytes
    assert peak(problem, BASELINES["order_inductor"](problem)) == lpmf


def test_thunder_horizontal_groups_independent_ops_of_one_kind():
    problem = parallel_paths_problem(4, 1024)
    order = BASELINES["thunder_horizontal"](problem).fw_order
    kinds = [problem.ops[o].name.split("_")[0] for o in order]
    assert kinds == ["relu1"] * 4 + ["mm1"] * 4 + ["relu2"] * 4 + ["mm2"] * 4


def test_offload_all_moves_every_saved_activation_only_with_a_host_link():
    problem = SYNTHETIC["chain8_offload"]
    schedule = BASELINES["offload_all"](problem)
    sim = simulate(problem, schedule)
    assert set(schedule.offload) == set(simulate(problem, default_schedule(problem)).saved)
    assert sim.peak_bytes < peak(problem, default_schedule(problem))
    assert BASELINES["offload_all"](SYNTHETIC["chain8"]).offload == {}
