"""Activation checkpointing already in the model is honoured or improved upon.

A model whose blocks run under `torch.utils.checkpoint.checkpoint` (and a Hugging Face model after
`gradient_checkpointing_enable()`) is planned at several budgets; each plan is measured at the
allocator against the user's own checkpointed eager step: never above its peak, gradients equal.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import optsched
from optsched import BudgetInfeasibleError
from optsched.measure import StepMeasurement, measure_training_step

TIME_LIMIT_S = 2.0
MiB = 2**20


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Residual MLP blocks; blocks i with i % every == 0 run under checkpoint (every=0: none)."""

    def __init__(self, width=128, n=4, every=1, reentrant=False, context_fn=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))
        self.every, self.reentrant, self.context_fn = every, reentrant, context_fn

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if self.every and i % self.every == 0:
                kw = {"context_fn": self.context_fn} if self.context_fn else {}
                x = checkpoint(b, x, use_reentrant=self.reentrant, **kw)
            else:
                x = b(x)
        return x.pow(2).mean()


def _net(**kw):
    torch.manual_seed(0)
    return Net(**kw), (torch.randn(16, 64, 128),)


def _planned(module, inputs, budget=None) -> tuple[optsched.Plan, StepMeasurement]:
    opt = optsched.optimize(module, budget, time_limit_s=TIME_LIMIT_S)
    opt(*inputs).backward()  # compiles and plans
    for t in inputs:
        t.grad = None  # an input that requires grad: every measured step allocates its gradient
    return opt.plan, measure_training_step(opt, module, inputs)


def _assert_honoured(plan, planned: StepMeasurement, user: StepMeasurement, budget_bytes=None):
    measured, predicted = planned.peak_bytes, plan.predicted_peak_bytes
    assert abs(measured - predicted) <= 0.01 * measured, f"predicted {predicted} bytes, measured {measured}"
    assert measured <= user.peak_bytes, (
        f"measured {measured / MiB:.2f} MiB above the user's checkpointed eager {user.peak_bytes / MiB:.2f} MiB"
    )
    if budget_bytes is not None:
        assert measured <= budget_bytes
    assert torch.equal(planned.loss, user.loss)
    assert set(planned.grads) == set(user.grads)
    for k in user.grads:
        assert torch.equal(planned.grads[k], user.grads[k]), k


def _user_note(plan) -> str:
    notes = [n for n in plan.stats.notes if n.startswith("user checkpointing")]
    assert len(notes) == 1, plan.stats.notes
    return notes[0]


@functools.cache
def _checkpointed():
    module, inputs = _net()
    return module, inputs, measure_training_step(module, module, inputs)


def test_without_checkpointing_the_peak_doubles_in_eager():
    """The issue: planning used to discard the user's checkpointing (the unplanned peak is eager's)."""
    module, inputs, user = _checkpointed()
    module.every = 0
    try:
        plain = measure_training_step(module, module, inputs)
    finally:
        module.every = 1
    assert plain.peak_bytes > 1.8 * user.peak_bytes


@functools.cache
def _no_budget():
    module, inputs, _user = _checkpointed()
    return _planned(module, inputs)


def test_no_budget_is_capped_at_the_users_checkpointing():
    _module, _inputs, user = _checkpointed()
    plan, planned = _no_budget()
    _assert_honoured(plan, planned, user)
    note = _user_note(plan)
    assert "4 regions" in note and "the plan's budget is capped there (asked: no budget)" in note
    assert plan.budget_bytes is not None and plan.budget_bytes <= user.peak_bytes
    assert plan.baseline.peak_bytes > 1.8 * plan.budget_bytes  # the captured graph alone, unchecked
    assert plan.summary()["n_recomputed"] > 0


def test_a_percentage_is_a_share_of_the_users_checkpointed_step():
    """Issue 24: "60%" of a checkpointed model was taken of the captured program with every activation saved
    (twice the user's step), then capped at the user's own plan: ~100% of what the user runs. It is a share
    of the user's checkpointed step now; where no plan reaches it, the error says so."""
    module, inputs, user = _checkpointed()
    # 99%, not 97%: whether a search reaches 97% depends on the op costs measured in that process (a two-worker
    # run missed it by 0.3 MiB, issue 34's "two fresh processes"); the share's meaning is what is tested here
    plan, planned = _planned(module, inputs, "99%")
    _assert_honoured(plan, planned, user, plan.budget_bytes)
    reference = plan.summary()["budget_reference_peak_bytes"]
    assert plan.budget_bytes == int(0.99 * reference)
    assert abs(reference - user.peak_bytes) <= 0.01 * user.peak_bytes  # the user's checkpointed step
    assert reference < 0.6 * plan.baseline.peak_bytes  # not the captured program with everything saved
    with pytest.raises(BudgetInfeasibleError, match="own activation checkpointing: its step peaks at"):
        optsched.optimize(module, "40%", time_limit_s=TIME_LIMIT_S)(*inputs)


def test_a_tight_budget_improves_on_partial_checkpointing():
    """Blocks 0 and 2 checkpointed: a budget 20% below the user's eager peak recomputes more."""
    module, inputs = _net(every=2)
    user = measure_training_step(module, module, inputs)
    budget = int(0.8 * user.peak_bytes)
    plan, planned = _planned(module, inputs, budget)
    _assert_honoured(plan, planned, user, budget)
    assert plan.budget_bytes == budget
    note = _user_note(plan)
    assert "2 regions" in note and f"the budget {budget / MiB:.2f} MiB is below it" in note


def test_a_budget_below_what_any_plan_reaches_still_raises():
    module, inputs, _user = _checkpointed()
    with pytest.raises(BudgetInfeasibleError, match="no plan fits"):
        optsched.optimize(module, 4 * MiB, time_limit_s=1.0)(*inputs)


def test_reentrant_checkpointing_is_captured_too():
    """Dynamo traces use_reentrant=True as the same tagged region. (Eager reentrant checkpointing
    needs an input that requires grad, or its blocks' outputs do not.)"""
    module, (x,) = _net(reentrant=True)
    inputs = (x.requires_grad_(),)
    user = measure_training_step(module, module, inputs)
    plan, planned = _planned(module, inputs)
    _assert_honoured(plan, planned, user)
    assert "4 regions" in _user_note(plan)


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_checkpointing_keeps_what_the_policy_saves():
    module, inputs = _net(context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
    user = measure_training_step(module, module, inputs)
    plan, planned = _planned(module, inputs)
    _assert_honoured(plan, planned, user)
    # per block: layer norm, gelu, add recomputed; both addmm saved
    full, _ = _no_budget()
    assert "4 regions, 8 ops recomputed" in _user_note(plan)
    assert "4 regions, 12 ops recomputed" in _user_note(full)


def test_the_users_plan_is_kept_when_the_solver_finds_nothing_under_it(monkeypatch):
    from optsched.planning import solving as backend

    def nothing_fits(problem, budget_bytes, **_kw):
        raise BudgetInfeasibleError(budget_bytes or 0, 2**40, 0)

    monkeypatch.setattr(backend, "solve", nothing_fits)
    module, inputs, user = _checkpointed()
    plan, planned = _planned(module, inputs)
    _assert_honoured(plan, planned, user)
    assert plan.stats.method == "the user's activation checkpointing"
    assert _user_note(plan).endswith("the solver found nothing under it, the user's plan is kept")


def test_random_ops_in_a_region_are_named_in_the_note():
    class DropBlock(Block):
        def forward(self, x):
            return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln(x)))), 0.1)

    module, inputs = _net(n=2)
    module.blocks = nn.ModuleList(DropBlock(128) for _ in range(2))
    plan, _ = _planned(module, inputs)
    assert "random ops in checkpointed regions are not recomputed: their 0.25 MiB" in _user_note(plan)


def test_hf_gradient_checkpointing_enable():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).train()

    class Loss(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, labels=ids).loss

    module, inputs = Loss(model), (torch.randint(128, (4, 64)),)
    plain = measure_training_step(module, module, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated alias of activation_checkpointing_enable in transformers 5
        model.gradient_checkpointing_enable()  # use_reentrant=False by default
    user = measure_training_step(module, module, inputs)
    assert user.peak_bytes < plain.peak_bytes
    plan, planned = _planned(module, inputs)
    _assert_honoured(plan, planned, user)
    assert "2 regions" in _user_note(plan)


class CheckpointedLM(nn.Module):
    """Checkpointed blocks between an embedding and a vocabulary head; returns the logits (the caller's loss)."""

    def __init__(self, vocab=1000, width=32, n=2, reentrant=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))
        self.head = nn.Linear(width, vocab)
        self.reentrant = reentrant

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_loss_outside_a_checkpointed_model(reentrant):
    """Issue 33: with the loss outside (`F.cross_entropy(model(x), y)`) the first call planned as if the caller
    held the logits through the backward: the user's checkpointed step, the reference of a percentage, counted
    them, and so did the proven bound, which refused the user's own eager peak as a budget ("none can")."""
    torch.manual_seed(0)
    model = CheckpointedLM(reentrant=reentrant)
    ids, targets = torch.randint(0, 1000, (4, 64)), torch.randint(0, 1000, (4, 64))

    def step(m):
        return lambda: F.cross_entropy(m(ids).flatten(0, 1), targets.flatten())

    user = measure_training_step(step(model), model, ())
    opt = optsched.optimize(model, user.peak_bytes, time_limit_s=0.5)
    first = measure_training_step(step(opt), model, ())  # the first call: plans, then runs
    assert first.peak_bytes <= user.peak_bytes
    assert abs(opt.plan.predicted_peak_bytes - first.peak_bytes) <= 0.01 * first.peak_bytes
    assert opt.plan.summary()["output_usage"] == "g-"  # a gradient into the logits, which the caller drops
    assert torch.equal(first.loss, user.loss) and all(torch.equal(first.grads[k], g) for k, g in user.grads.items())
    share = optsched.optimize(model, "100%", time_limit_s=0.5)
    share(ids)
    reference = share.plan.summary()["budget_reference_peak_bytes"]  # the user's checkpointed step as it runs
    assert abs(reference - user.peak_bytes) <= 0.01 * user.peak_bytes
