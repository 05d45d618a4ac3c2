"""A budget no plan can meet is refused at once (issue 33): below the proven bound, neither op timing, nor fusion
groups, nor any search can change the answer, so none of them runs. A 1000-byte budget on the bundled GPT timed
its 472 ops (7.8 s) and searched (3-40 s more, longer with a larger time_limit_s) to say "none can", and then
suggested chunking, which cannot reach it either."""

from __future__ import annotations

import pytest

import optsched
from benchmarks.models import gpt
from optsched.planning import op_costs, solving
from optsched.solvers import default_schedule, simulate, solve
from optsched.solvers.search import strategy
from optsched.solvers.search.heuristics import lower_bound_peak
from optsched.solvers.synthetic import chain_training_problem


@pytest.fixture
def nothing_timed_or_searched(monkeypatch):
    """Fails the test on any op timing or solve while planning."""
    calls = []
    monkeypatch.setattr(op_costs, "profile_nodes", lambda *a, **k: calls.append("op timing") or pytest.fail("ops timed"))
    monkeypatch.setattr(solving, "solve", lambda *a, **k: calls.append("solve") or pytest.fail("searched"))
    return calls


@pytest.mark.parametrize("chunking", [None, "auto"])
def test_a_budget_below_what_stays_resident_is_refused_before_timing_or_search(nothing_timed_or_searched, chunking):
    """The bundled GPT (`make demo`'s) at 1000 bytes: proven, unsearched, and no chunking suggested (parameters,
    the batch and gradients alone take more, whatever the chunk count). The time limit plays no part."""
    cfg = gpt.GPTConfig()
    model, inputs = gpt.build(cfg), gpt.make_batch(cfg, batch_size=4)
    with pytest.raises(optsched.BudgetInfeasibleError) as info:
        optsched.optimize(model, 1000, example_inputs=inputs, time_limit_s=30, chunking=chunking)
    e, text = info.value, str(info.value)
    assert e.proven and not e.searched and not isinstance(e, optsched.PlanningTimeLimitError), text
    assert e.budget_bytes == 1000 < e.lower_bound_bytes and "refused before any search" in text, text
    assert "could run in token chunks" not in text and "chunking='auto' chunks it" not in text, text
    assert "the parameters, buffers, inputs and the step's outputs (gradients) alone take" in text, text
    assert nothing_timed_or_searched == []
    assert all(p.grad is None for p in model.parameters())


def test_the_early_floor_never_refuses_a_budget_the_measured_bound_allows(monkeypatch):
    """The floor (most favourable costs, fusion groups as options) is below the bound of the problem with measured
    costs: at that bound the ops are timed and the planning goes on (whatever it then finds)."""
    cfg = gpt.GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=32)
    model, inputs = gpt.build(cfg), gpt.make_batch(cfg, batch_size=2)
    lb = optsched.optimize(model, None, example_inputs=inputs, time_limit_s=1).plan.lower_bound_bytes
    timed = []
    profile = op_costs.profile_nodes
    monkeypatch.setattr(op_costs, "profile_nodes", lambda *a, **k: timed.append(1) or profile(*a, **k))
    try:
        optsched.optimize(model, lb, example_inputs=inputs, time_limit_s=1)
    except optsched.BudgetInfeasibleError:
        pass
    assert timed


def test_solve_refuses_a_budget_below_its_bound_without_searching(monkeypatch):
    p = chain_training_problem(n_layers=6, seed=0)
    lb = lower_bound_peak(p)
    monkeypatch.setattr(strategy, "run_portfolio", lambda *a, **k: pytest.fail("searched below the bound"))
    with pytest.raises(optsched.BudgetInfeasibleError) as info:
        solve(p, lb - 1, time_limit_s=30)
    e = info.value
    assert e.proven and not e.searched and e.lower_bound_bytes == lower_bound_peak(p, joint=True) and e.elapsed_s < 5
    assert e.lowest_schedule is not None and e.lowest_peak_bytes == simulate(p, default_schedule(p)).peak_bytes
    assert "refused before any search" in str(e)
