"""PyTorch's min-cut partitioner read from PyTorch itself (optsched/baselines/pytorch_mincut.py): its
saved-vs-recomputed decision on optsched's captured graph becomes a Schedule the simulator runs, and the
storages the simulator keeps across the forward/backward boundary are the ones torch's forward saves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optsched.baselines import capture_training_step, mincut_choice, mincut_sweep, non_monotone
from optsched.baselines.pytorch_mincut import MinCutChoice, torch_partition
from optsched.solvers import Phase, Schedule, default_schedule, simulate
from tests import models

BUDGETS = (1.0, 0.5, 0.0)


@pytest.fixture(scope="module")
def gpt_step():
    from benchmarks.models.gpt import GPTConfig, build, make_batch

    cfg = GPTConfig(n_layer=2, n_embd=64, block_size=32)
    return capture_training_step(build(cfg), make_batch(cfg, batch_size=2, seq_len=32))


@pytest.fixture(scope="module")
def gpt_choices(gpt_step):
    return {b: mincut_choice(gpt_step, b) for b in BUDGETS}


def test_the_problem_is_optsched_s_own(gpt_step):
    p = gpt_step.problem
    assert p.has_backward and len(p.fw_ops) > 10
    assert [o.name for o in p.ops] == [n.name for n in gpt_step.built.nodes]


@pytest.mark.parametrize("budget", BUDGETS)
def test_schedule_runs_and_saves_what_torch_saves(gpt_step, gpt_choices, budget):
    c = gpt_choices[budget]
    p = gpt_step.problem
    sim = simulate(p, c.schedule)  # raises on an invalid schedule
    assert sim.peak_bytes == c.sim.peak_bytes
    assert c.notes == []  # both views of the graph agree on GPT
    # every backward op runs once, forward ops in program order, recomputations are forward ops
    assert sorted(o for o in c.schedule.bw_order if p.ops[o].phase is Phase.BW) == [o.id for o in p.bw_ops]
    assert c.schedule.fw_order == [o.id for o in p.fw_ops]
    assert sorted(p.ops[o].name for o in c.schedule.recomputed(p)) == sorted(c.recomputed)
    # the independent check: what crosses the boundary in the replay is exactly torch's saved set
    assert c.saved_storages == set(sim.saved)


@pytest.mark.parametrize("budget", BUDGETS)
def test_recomputed_ops_are_the_forward_nodes_in_torch_s_backward(gpt_step, gpt_choices, budget):
    fw, bw = torch_partition(gpt_step, budget)
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    in_both = {n.name for n in bw.graph.nodes if n.op == "call_function"} & fw_names
    ops = {o.name for o in gpt_step.problem.fw_ops}
    assert set(gpt_choices[budget].recomputed) == in_both & ops


def test_budget_one_saves_everything_like_eager(gpt_step, gpt_choices):
    p = gpt_step.problem
    eager = simulate(p, default_schedule(p))
    full = gpt_choices[1.0]
    assert full.recomputed == []  # only views are remade at 1.0 on this graph
    assert full.sim.peak_bytes == eager.peak_bytes and full.sim.time_s == pytest.approx(eager.time_s)


def test_budget_zero_recomputes_more_and_costs_time(gpt_choices):
    zero, half, full = gpt_choices[0.0], gpt_choices[0.5], gpt_choices[1.0]
    assert set(half.recomputed) < set(zero.recomputed) or len(zero.recomputed) > len(half.recomputed)
    assert len(zero.recomputed) > len(full.recomputed)
    assert zero.sim.time_s > half.sim.time_s > full.sim.time_s
    assert zero.sim.recompute_s > 0
    assert len(zero.saved_storages) < len(full.saved_storages)
    assert half.sim.peak_bytes < full.sim.peak_bytes  # a budget below 1 lowers the peak here


def test_a_sweep_is_one_choice_per_budget(gpt_step):
    sweep = mincut_sweep(gpt_step, [0.8, 0.2])
    assert [c.activation_memory_budget for c in sweep] == [0.8, 0.2]
    assert all(isinstance(c, MinCutChoice) and c.summary()["peak_bytes"] == c.sim.peak_bytes for c in sweep)


def test_non_monotone_names_adjacent_budgets_whose_peak_goes_up():
    def choice(budget, peak):
        return MinCutChoice(budget, Schedule([], []), SimResult_stub(peak), [], [], set())

    def SimResult_stub(peak):
        return SimpleNamespace(peak_bytes=peak, time_s=0.0)

    sweep = [choice(1.0, 100), choice(0.5, 60), choice(0.3, 70), choice(0.0, 100), choice(0.2, 50)]
    assert non_monotone(sweep) == [(0.0, 0.2), (0.3, 0.5)]
    assert non_monotone([choice(1.0, 10), choice(0.0, 5)]) == []


def test_a_model_with_dropout_keeps_random_ops_saved():
    """On a graph without decompositions torch's min-cut at budget 0 recomputes native_dropout too (it
    would draw another mask); optsched never recomputes a random op: the choice keeps it saved and says so."""
    model, inputs = models.dropout_mlp()
    step = capture_training_step(model, inputs)
    p = step.problem
    random_ops = {o.name for o in p.fw_ops if not o.recomputable and o.outputs}
    assert random_ops  # the dropout masks
    c = mincut_choice(step, 0.0)
    assert not random_ops & set(c.recomputed)
    sim = simulate(p, c.schedule)
    kept = {t for o in p.fw_ops if o.name in random_ops for t in o.outputs}
    if any("never recomputes" in n for n in c.notes):
        assert all(name in " ".join(c.notes) for name in random_ops)
        assert set(sim.saved) - c.saved_storages <= kept  # only what was kept against torch's choice
    else:
        assert c.saved_storages == set(sim.saved)


def test_measured_op_times_as_optimize_measures_them_on_cpu():
    model, inputs = models.mlp()
    roofline = capture_training_step(model, inputs)
    measured = capture_training_step(model, inputs, measure=True)
    assert [o.name for o in measured.problem.ops] == [o.name for o in roofline.problem.ops]
    assert all(o.time_s > 0 for o in measured.problem.ops)
    assert [o.time_s for o in measured.problem.ops] != [o.time_s for o in roofline.problem.ops]
    c = mincut_choice(measured, 0.0)
    assert c.saved_storages == set(simulate(measured.problem, c.schedule).saved)
