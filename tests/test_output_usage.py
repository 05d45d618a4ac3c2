"""What the caller does with a step's outputs: gradients that never come, outputs it drops or holds,
a loss it computes itself. The plan follows it: memory never above eager's at no budget, and
predicted = measured once the caller's usage has been seen (from the second step at the latest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import optsched
from optsched.measure import measure_training_step
from optsched.capture.output_usage import OutputUsage

transformers = pytest.importorskip("transformers")

ROUNDING = 64  # bytes: the autograd engine's scalar seed and 0-dim zeros the plan does not place exactly
PLANNING = dict(device_profile="cpu", time_limit_s=2)  # the roofline's op costs: what the caller does is the subject here


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(cfg), torch.randint(0, 1000, (4, 64))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _warm(call, module, inputs, n: int = 2) -> None:
    """Steps outside any measurement: the first plans on a guess, the next re-plans if the caller
    did otherwise."""
    for _ in range(n):
        call(*inputs).backward()
        for p in module.parameters():
            p.grad = None


def _steps(call, module, inputs):
    _warm(call, module, inputs)
    return measure_training_step(call, module, inputs)


def test_labels_no_budget_is_eagers_peak_and_predicted():
    model, ids = _llama()
    eager = measure_training_step(lambda i: model(input_ids=i, labels=i).loss, model, (ids,))
    opt = optsched.optimize(model, **PLANNING)
    r = _steps(lambda i: opt(input_ids=i, labels=i).loss, model, (ids,))
    assert r.peak_bytes <= eager.peak_bytes + ROUNDING
    assert abs(opt.plan.predicted_peak_bytes - r.peak_bytes) <= ROUNDING
    assert _max_diff(eager.grads, r.grads) == 0.0
    # the loss gets a gradient; logits and the key/value cache get none and are dropped
    usage = OutputUsage.parse(opt.plan.summary()["output_usage"])
    assert sum(usage.grad) == 1 and not any(usage.held[i] for i, g in enumerate(usage.grad) if not g)


def test_loss_outside_follows_the_caller_from_the_second_step():
    model, ids = _llama()

    def loss_of(logits, i):
        return F.cross_entropy(logits.flatten(0, 1), i.flatten())

    eager = measure_training_step(lambda i: loss_of(model(input_ids=i).logits, i), model, (ids,))
    opt = optsched.optimize(model, **PLANNING)
    r = _steps(lambda i: loss_of(opt(input_ids=i).logits, i), model, (ids,))
    assert r.peak_bytes <= eager.peak_bytes + ROUNDING
    assert abs(opt.plan.predicted_peak_bytes - r.peak_bytes) <= 0.01 * r.peak_bytes
    assert _max_diff(eager.grads, r.grads) == 0.0
    assert opt.plan.summary()["output_usage"].count("g") == 1  # the logits only: the cache gets no gradient


class _TwoHeads(nn.Module):
    """Returns a loss and a big extra tensor, like a model returning logits beside its loss."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(256, 256)
        self.head = nn.Linear(256, 1024)

    def forward(self, x):
        h = torch.relu(self.body(x))
        out = self.head(h)
        return out.pow(2).mean(), out


def test_a_gradient_into_an_output_the_plan_did_not_expect_is_correct_and_replanned():
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(64, 256)

    def both(m):
        def call(x):
            loss, out = m(x)
            return loss + out.sum() * 1e-3  # the second output gets a gradient too
        return call

    eager = measure_training_step(both(model), model, (x,))
    opt = optsched.optimize(model, **PLANNING)
    both(opt)(x).backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    assert _max_diff(eager.grads, first) < 1e-6  # right from the first step, whatever was guessed
    assert opt.plan.summary()["output_usage"] == "gh,--"  # the guess: the scalar only
    _warm(both(opt), model, (x,), n=1)
    second = measure_training_step(both(opt), model, (x,))
    assert opt.plan.summary()["output_usage"] == "gh,g-"  # seen: a gradient flows in, the caller drops it
    # the caller's own loss is estimated as two intermediates of the output's size (exact for cross-entropy);
    # this one (a sum) makes none beyond the gradient it hands back: the estimate errs on the safe side
    out_bytes = 64 * 1024 * 4
    assert second.peak_bytes <= opt.plan.predicted_peak_bytes <= second.peak_bytes + 2 * out_bytes
    assert _max_diff(eager.grads, second.grads) < 1e-6


def test_a_loss_outside_a_model_returning_its_cache_is_planned_on_the_logits():
    """`F.cross_entropy(model(ids).logits, y)` on a Hugging Face LM, which returns its key/value cache beside the
    logits (use_cache's default): the first guess has gradients flowing into the logits only (the cache is read
    by the model's own attention: an intermediate it hands out), which is what the caller does, so the first plan
    is the step that runs (it was planned with a tangent and a caller's loss per cache tensor)."""
    model, ids = _llama()
    targets = torch.randint(0, 1000, ids.shape, generator=torch.Generator().manual_seed(2))

    def outside(m):
        return lambda i: F.cross_entropy(m(input_ids=i).logits.flatten(0, 1), targets.flatten())

    eager = measure_training_step(outside(model), model, (ids,))
    opt = optsched.optimize(model, eager.peak_bytes, **PLANNING)
    first = measure_training_step(outside(opt), model, (ids,))
    plan = opt.plan
    usage = OutputUsage.parse(plan.summary()["output_usage"])
    assert len(usage.grad) > 1 and sum(usage.grad) == 1  # the logits, not the cache
    assert first.peak_bytes <= eager.peak_bytes
    assert _max_diff(eager.grads, first.grads) == 0.0
    measure_training_step(outside(opt), model, (ids,))
    # what the first backward saw: the gradients the plan assumed (it held the logits where that fitted)
    assert OutputUsage.parse(opt.plan.summary()["output_usage"]).grad == usage.grad


class _Encoder(nn.Module):
    """Returns a reconstruction and the code it was made from, as a VAE returns its mean beside its output."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(256, 64)
        self.dec = nn.Linear(64, 256)

    def forward(self, x):
        code = torch.tanh(self.enc(x))
        return self.dec(code), code


def test_a_gradient_into_an_intermediate_output_is_correct_warned_and_replanned():
    """The guess's other side: a caller that differentiates an output the model itself reads on (the code) gets
    right gradients on the first step, a warning (its plan had no gradient for it) and a plan for it next."""
    torch.manual_seed(0)
    model, x = _Encoder(), torch.randn(64, 256)

    def both(m):
        def call(x):
            out, code = m(x)
            return (out - x).pow(2).mean() + code.pow(2).mean()
        return call

    eager = measure_training_step(both(model), model, (x,))
    opt = optsched.optimize(model, "8MiB", **PLANNING)
    with pytest.warns(optsched.OutputUsageWarning, match=r"output\(s\) \[1\].*planned 'gh,--', seen 'g-,g-'"):
        both(opt)(x).backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    assert _max_diff(eager.grads, first) < 1e-6
    second = _steps(both(opt), model, (x,))
    assert opt.plan.summary()["output_usage"] == "g-,g-"
    assert _max_diff(eager.grads, second.grads) < 1e-6


def test_an_output_held_through_the_backward_is_planned_as_held():
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(64, 256)
    kept = []

    def holding(m):
        def call(x):
            loss, out = m(x)
            kept.append(out)  # the caller keeps the extra output past the backward
            return loss
        return call

    eager = measure_training_step(holding(model), model, (x,))
    kept.clear()
    opt = optsched.optimize(model, **PLANNING)
    _warm(holding(opt), model, (x,))
    kept.clear()
    r = measure_training_step(holding(opt), model, (x,))
    kept.clear()
    assert opt.plan.summary()["output_usage"] == "gh,-h"
    assert abs(opt.plan.predicted_peak_bytes - r.peak_bytes) <= ROUNDING
    assert r.peak_bytes <= eager.peak_bytes + ROUNDING
    assert _max_diff(eager.grads, r.grads) == 0.0


def test_a_budgeted_step_that_used_more_than_its_plan_assumed_warns_once():
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(64, 256)
    opt = optsched.optimize(model, "8MiB", **PLANNING)  # a budget (roomy): a step above its plan could go over one
    with pytest.warns(optsched.OutputUsageWarning, match=r"output\(s\) \[1\].*planned 'gh,--', seen 'gh,gh'.*next call plans for it"):
        loss, out = opt(x)
        (loss + out.sum() * 1e-3).backward()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", optsched.OutputUsageWarning)  # the re-planned program assumes it: no warning
        for _ in range(2):
            loss, out = opt(x)
            (loss + out.sum() * 1e-3).backward()  # `out` is still referenced here: held through the backward
    assert opt.plan.summary()["output_usage"] == "gh,gh"


def test_usage_text_round_trips():
    usage = OutputUsage((True, False, True), (True, False, False))
    assert usage.describe() == "gh,--,g-"
    assert OutputUsage.parse(usage.describe()) == usage


class _ViewOut(nn.Module):
    """Returns a view of an intermediate beside its loss: AOTAutograd hands the caller a new view
    object over our storage, so whether the caller holds it cannot be seen; the plan counts it held."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 1024)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        return h.pow(2).mean(), h.t()


@pytest.mark.parametrize("hold", [True, False], ids=["held", "dropped"])
def test_a_view_output_is_watched_through_the_callers_tensor(hold):
    torch.manual_seed(0)
    model, x = _ViewOut(), torch.randn(64, 256)
    kept = []

    def calling(m):
        def call(x):
            loss, view = m(x)
            if hold:
                kept.append(view)
            return loss
        return call

    eager = measure_training_step(calling(model), model, (x,))
    kept.clear()
    opt = optsched.optimize(model, **PLANNING)
    _warm(calling(opt), model, (x,))
    kept.clear()
    r = measure_training_step(calling(opt), model, (x,))
    kept.clear()
    assert opt.plan.summary()["output_usage"] == ("gh,-h" if hold else "gh,--")
    assert abs(opt.plan.predicted_peak_bytes - r.peak_bytes) <= ROUNDING
    assert r.peak_bytes <= eager.peak_bytes + ROUNDING
    assert _max_diff(eager.grads, r.grads) == 0.0


class _PointwiseExtra(nn.Module):
    """A loss and an extra output whose backward is pointwise: with the Inductor executor those ops would
    form a group reading the extra output's tangent."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        return h.pow(2).mean(), (h * 2 + 1).relu()


def test_a_missing_tangent_never_reaches_a_fused_kernel():
    # the one-element zero that stands for a missing tangent has stride 0; a group kernel compiled for the
    # traced (dense) strides rejects it, so ops reading a tangent stay out of groups
    torch.manual_seed(0)
    model, x = _PointwiseExtra(), torch.randn(32, 64)
    model(x)[0].backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    opt = optsched.optimize(model, executor="inductor", device_profile="cpu")  # the default limit fits Inductor's set-up
    for _ in range(2):
        opt(x)[0].backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        assert _max_diff(eager, got) == 0.0
    assert opt.plan.summary()["output_usage"] == "gh,--" and opt.plan.summary()["n_fusion_groups"] > 0
