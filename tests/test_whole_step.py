"""The whole training step in one plan (issue 36): `optimize(model, budget, optimizer=opt)` counts the
optimizer's state from the first step and fits the update after the backward in the budget."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import optsched
from benchmarks.models import gpt
from optsched.measure import live_bytes, measure_peak
from optsched.planning.optimizer_step import check_update_fits, optimizer_state, update_scratch_bytes
from optsched.solvers import BudgetInfeasibleError

# the caller's cross-entropy is an estimate (costs/problem_builder.caller_loss_bytes): its index and scalar
# temporaries are not in it
CALLER_SLACK = 16 * 1024


class LogitsGPT(gpt.GPT):
    """The bundled GPT returning logits: the loss is computed outside the module."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_step(**optimize_args):
    """(the whole step, its model, optimizer and optimized module): 4 layers, width 256, batch 8, AdamW."""
    cfg = gpt.GPTConfig()
    torch.manual_seed(0)
    model = LogitsGPT(cfg)
    x, y = gpt.make_batch(cfg, batch_size=8)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    om = optsched.optimize(model, optimizer=opt, device_profile="cpu", time_limit_s=3, **optimize_args)

    def step() -> None:
        F.cross_entropy(om(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return step, model, opt, om, (x, y)


def test_whole_step_peak_is_predicted_and_within_budget():
    """Forward, backward and opt.step() with AdamW's state existing: the allocator's peak of the whole step
    is the plan's (its state counted from the first plan, before torch made it) and within the budget."""
    step, model, opt, om, batch = gpt_step(mem_budget="60%")
    step()
    step()  # the second call plans for what the caller was seen doing with the outputs
    plan = om.plan
    state = sum(b for _, b in optimizer_state(opt, torch.device("cpu")))
    assert state == sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())
    assert sum(t.bytes for t in plan.problem.tensors if t.name.endswith("(optimizer state)")) == state
    update = check_update_fits(plan.problem, plan.budget_bytes, update_scratch_bytes(opt), opt)
    predicted = max(plan.predicted_peak_bytes, update)
    start = live_bytes(model, batch, list(opt.state.values()))
    measured = start + measure_peak(step).peak_bytes
    assert measured <= plan.budget_bytes
    assert abs(measured - predicted) <= CALLER_SLACK, (measured, predicted)
    assert om.plan is plan


def test_update_that_cannot_fit_is_refused_naming_the_optimizer():
    """A budget the forward and backward may meet but AdamW's step after them cannot (parameters, every
    gradient, the state and the foreach temporaries): the error names the optimizer and the fix."""
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    params = sum(p.numel() * 4 for p in model.parameters())
    # parameters, gradients and state live at the step's end, plus foreach temporaries of the parameters' size
    budget = 4 * params + update_scratch_bytes(opt) - 1
    om = optsched.optimize(model, budget, optimizer=opt, device_profile="cpu", time_limit_s=2)
    with pytest.raises(BudgetInfeasibleError, match=r"AdamW\.step\(\) after the backward.*raise the budget"):
        om(torch.randn(4, 128)).square().mean().backward()


def test_options_are_checked_at_optimize():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer, got list"):
        optsched.optimize(model, optimizer=[torch.optim.SGD(model.parameters())])
    with pytest.raises(NotImplementedError, match="RMSprop.*SGD, Adam, AdamW"):
        optsched.optimize(model, optimizer=torch.optim.RMSprop(model.parameters()))
    with pytest.raises(ValueError, match="optimizer= or plan=, not both"):  # a replay would not count the state
        optsched.optimize(model, optimizer=torch.optim.SGD(model.parameters()), plan="auto")
