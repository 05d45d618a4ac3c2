"""Errors that tell the truth (issue 26): what the user's own code raises reaches the user as itself, and
optimizing what optimize() returned optimizes the original instead of tracing optsched."""

from __future__ import annotations

import traceback

import pytest
import torch

import optsched
from optsched.capture.errors import CaptureError


class _RaisesOnLargeBatches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] > 4:
            raise ValueError("bad input")
        return self.linear(x).square().mean()


def test_a_value_error_raised_in_forward_reaches_the_caller_as_itself():
    model = _RaisesOnLargeBatches()
    opt = optsched.optimize(model, None, time_limit_s=2)
    with pytest.raises(ValueError, match="^bad input$") as raised:
        opt(torch.randn(6, 8))
    assert not isinstance(raised.value, CaptureError)
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert frames[-1].filename == __file__ and frames[-1].name == "forward"  # raised by the user's line
    assert raised.value.__context__ is None  # Dynamo's report is not chained to it
    opt(torch.randn(3, 8)).backward()  # the optimized module still plans and runs other calls
    assert opt.plan is not None and model.linear.weight.grad is not None


def test_a_users_own_exception_class_raised_in_a_function_reaches_the_caller():
    class BatchTooSmall(Exception):
        pass

    def step(x, w):
        if x.shape[0] < 2:
            raise BatchTooSmall(f"need 2 rows, got {x.shape[0]}")
        return (x @ w).relu().sum()

    w = torch.randn(4, 4, requires_grad=True)
    opt = optsched.optimize(step, None, time_limit_s=2)
    with pytest.raises(BatchTooSmall, match="need 2 rows, got 1"):
        opt(torch.randn(1, 4), w)
    opt(torch.randn(3, 4), w).backward()
    assert w.grad is not None


def test_a_graph_break_is_still_a_capture_error():
    def step(x):
        print("tracing")
        return x.sin().sum()

    with pytest.raises(CaptureError, match=r"print\(\.\.\.\)"):
        optsched.optimize(step, None, time_limit_s=2)(torch.randn(3, requires_grad=True))


def test_optimizing_an_optimized_function_optimizes_the_original_with_a_warning():
    def step(x, w):
        return (x @ w).relu().sum()

    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    inner = optsched.optimize(step, None, time_limit_s=2)
    with pytest.warns(UserWarning, match=r"optimize\(\) got a function .*step.* that optimize\(\) already returned: "
                                         r"the original is optimized with these settings"):
        outer = optsched.optimize(inner, "1GB", time_limit_s=2)
    assert outer.__wrapped__ is step
    outer(x, w).backward()
    assert outer.plan is not None and outer.plan.budget_spec == "1GB"
    assert torch.allclose(w.grad, torch.func.grad(lambda w: step(x, w))(w))
    inner(x, w)  # the earlier one still works as it was
    assert inner.plan is not None and inner.plan.budget_spec == "none"


def test_optimizing_an_optimized_module_warns_and_plans_with_the_new_settings():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x = torch.randn(8, 16)
    inner = optsched.optimize(model, None, time_limit_s=2)
    with pytest.warns(UserWarning, match=r"optimize\(\) got a module Sequential that optimize\(\) already returned"):
        outer = optsched.optimize(inner, "1GB", time_limit_s=2)
    outer(x).sum().backward()
    assert outer.plan.budget_spec == "1GB"
    assert outer[0].weight is model[0].weight and model[0].weight.grad is not None


@pytest.mark.parametrize("budget", [1000, "0.5%"])
def test_a_budget_below_the_proven_bound_is_infeasible_not_a_time_limit(budget):
    """Issue 26: 1000 bytes or "0.5%" came back after the whole time limit as PlanningTimeLimitError ("a larger
    time_limit_s may find one") although proven: the error says none can, and the search does not wait for it."""
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    om = optsched.optimize(m, budget, time_limit_s=30, device_profile="cpu", deterministic=True)
    with pytest.raises(optsched.BudgetInfeasibleError) as e:
        om(torch.randn(32, 64)).sum().backward()
    assert e.value.proven and not isinstance(e.value, optsched.PlanningTimeLimitError)
    assert "none can" in str(e.value)


def test_start_from_takes_only_an_error_that_carries_a_plan():
    m = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="start_from must be a BudgetInfeasibleError"):
        optsched.optimize(m, "50%", start_from="plan.json")
    planless = optsched.BudgetInfeasibleError(1000, 2000, 500)  # as the distributed planner raises it
    with pytest.raises(ValueError, match="carries no plan"):
        optsched.optimize(m, "50%", start_from=planless)


def test_start_from_an_error_gives_its_lowest_plan_at_that_peak():
    """The error names optimize(..., start_from=) when its plan is not proven the lowest; passing it back with
    its peak as the budget meets that peak (no earlier call leaves anything behind to do it implicitly). Below
    the bound the budget is refused before any search (issue 33): nothing to add."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                              for _ in range(4)])
    x = torch.randn(256, 64)
    om = optsched.optimize(m, 1000, time_limit_s=2, device_profile="cpu", deterministic=True)
    with pytest.raises(optsched.BudgetInfeasibleError) as info:
        om(x).sum().backward()
    proven = info.value
    assert proven.proven and not proven.searched and "start_from" not in str(proven)  # proven: nothing to add
    om = optsched.optimize(m, proven.lower_bound_bytes, time_limit_s=2, device_profile="cpu", deterministic=True)
    with pytest.raises(optsched.BudgetInfeasibleError) as info:  # at the bound: searched, nothing found
        om(x).sum().backward()
    e = info.value
    assert e.lowest_schedule is not None and not e.proven and "start_from=<this error>" in str(e), str(e)
    again = optsched.optimize(m, e.lowest_peak_bytes, time_limit_s=2, device_profile="cpu", deterministic=True,
                              start_from=e)
    again(x).sum().backward()
    assert again.plan.sim.peak_bytes <= e.lowest_peak_bytes


def test_start_from_a_plan_meets_its_peak_and_is_never_worse_below_it():
    """An optimized step's plan passed back: a budget of its predicted peak is met (the plan is offered
    first), and a lower budget's search starts from it: its lowest peak is never above the plan's."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                              for _ in range(4)])
    x = torch.randn(256, 64)
    kw = dict(time_limit_s=1, device_profile="cpu", deterministic=True)
    first = optsched.optimize(m, "80%", **kw)
    first(x).sum().backward()
    plan = first.plan
    again = optsched.optimize(m, plan.predicted_peak_bytes, start_from=plan, **kw)
    again(x).sum().backward()
    assert again.plan.predicted_peak_bytes <= plan.predicted_peak_bytes
    try:
        lower = optsched.optimize(m, plan.predicted_peak_bytes // 2, start_from=plan, **kw)
        lower(x).sum().backward()
        assert lower.plan.predicted_peak_bytes <= plan.predicted_peak_bytes // 2
    except optsched.BudgetInfeasibleError as e:  # searched from the plan, or proven before any search
        assert e.lowest_peak_bytes <= plan.predicted_peak_bytes or (e.proven and not e.searched), str(e)


def test_an_unproven_error_says_how_to_start_from_its_plan():
    from optsched.planning.errors import start_from_note
    from optsched.solvers import Schedule

    open_gap = optsched.BudgetInfeasibleError(1000, 2000, 500, Schedule([0], []))
    assert "mem_budget=2000, start_from=<this error>" in start_from_note(open_gap)
    assert start_from_note(optsched.BudgetInfeasibleError(1000, 2000, 1500, Schedule([0], []))) == ""  # proven
    assert start_from_note(optsched.BudgetInfeasibleError(1000, 2000, 500)) == ""  # no plan to start from


def test_start_from_a_plan_file_starts_from_its_schedule(tmp_path):
    """Issue 33 item 17: `start_from=optsched.load_plan(path)` (in any process) is the file's schedule, its
    offloads found by tensor name on the problem planned; its peak is met, gradients are eager's. A PlanFile
    without a schedule is a ValueError saying so."""
    from optsched.plans.file_format import PlanFile
    from optsched.plans.reuse import start_schedule

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                              for _ in range(4)])
    x = torch.randn(256, 64)
    m(x).sum().backward()
    eager = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    kw = dict(time_limit_s=1, device_profile="cpu", deterministic=True, offload=True)
    first = optsched.optimize(m, "60%", **kw)
    first(x).sum().backward()
    m.zero_grad(set_to_none=True)  # the next step starts as this one did (accumulating is another step)
    pf = optsched.load_plan(first.plan.save(tmp_path / "p.json"))
    assert pf.data["decisions"]["offload"]  # offloads, named in the file
    assert start_schedule(pf, first.plan.problem) == first.plan.schedule
    again = optsched.optimize(m, pf.summary["predicted_peak_bytes"], start_from=pf, **kw)
    again(x).sum().backward()
    assert again.plan.predicted_peak_bytes <= pf.summary["predicted_peak_bytes"]
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), eager))
    with pytest.raises(ValueError, match="holds no schedule"):
        optsched.optimize(m, "50%", start_from=PlanFile(None, {"schema": "optsched.plan"}))
