"""Chunking the LM head + cross-entropy (issue 16): detection, the chunked graph's gradients against
eager's, the predicted peak against the measured one, and the planner's choice of chunk count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition
from functorch.compile import make_boxed_func

import optsched
from benchmarks.models import gpt
from optsched.capture.errors import logging_ignored
from optsched.lower.chunked_ce import linear_cross_entropy
from optsched.measure import measure_training_step
from optsched.passes.chunking import chunk, copy_graph, find_chains

TIME_LIMIT_S = 2.0
SCALAR_SLACK = 64  # bytes: the autograd engine's scalar tangent of the loss, outside the programs
CFG = gpt.GPTConfig(vocab_size=2048, block_size=64, n_layer=1, n_head=2, n_embd=32)


def _gpt():
    model = gpt.build(CFG)
    return model, gpt.make_batch(CFG, batch_size=2, seq_len=64)


def _eager(model, inputs, call=None):
    for p in model.parameters():
        p.grad = None
    loss = (model if call is None else call)(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def _joint_run(model, inputs, chunks: int | None):
    """Capture the joint graph (torch's own partition afterwards), find the chains, chunk them when asked;
    the loss and gradients of the program that runs."""
    found = {}

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        found["chains"], found["skipped"] = find_chains(joint)
        g = joint
        if chunks is not None:
            g = copy_graph(joint)
            chunk(g, chunks)
            found["after"] = find_chains(g)
        return default_partition(g, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    backend = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=lambda g, _: make_boxed_func(g),
                           partition_fn=partition)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    with logging_ignored():
        loss, grads = _eager(model, inputs, compiled)
    return found, loss, grads


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def _hf_gpt2(loss_inside: bool, shift_logits: bool = False):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1024, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    lm = transformers.GPT2LMHeadModel(cfg)

    class WithLabels(torch.nn.Module):  # the model's own loss (labels shifted inside, ignore_index -100)
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids, labels):
            return self.lm(input_ids=ids, labels=labels, use_cache=False).loss

    class LossOutside(torch.nn.Module):  # the model returns logits; the loss is computed outside it
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids, labels):
            logits = self.lm(input_ids=ids, use_cache=False).logits
            if shift_logits:  # logits[:, :-1]: a copy of the logits whose rows are not the matmul's
                return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
            shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]  # as transformers' ForCausalLMLoss shifts
            return F.cross_entropy(logits.view(-1, logits.size(-1)), shifted.reshape(-1), ignore_index=-100)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (2, 32), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # padding: the mean divides by the labels not ignored
    return (WithLabels() if loss_inside else LossOutside()), (ids, labels)


def test_kernel_matches_eager_for_mean_sum_and_ignored_labels():
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(100, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(100, (37,))
    y[:5] = -100
    for mean in (True, False):
        loss = F.cross_entropy(h @ w.t(), y, reduction="mean" if mean else "sum")
        gh, gw = torch.autograd.grad(loss, (h, w))
        for k in (1, 2, 8, 64):
            out, total, gh_k, gw_k = linear_cross_entropy(h.detach(), w.detach().t(), y, k, -100, mean)
            assert total.item() == 32
            torch.testing.assert_close(out, loss.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(gh_k, gh, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(gw_k, gw, rtol=1e-12, atol=1e-12)


def test_detects_the_gpt_lm_head_and_chunked_gradients_equal_eager():
    model, inputs = _gpt()
    loss, grads = _eager(model, inputs)
    for k in (1, 2, 8):
        found, loss_k, grads_k = _joint_run(model, inputs, k)
        (chain,) = found["chains"]
        assert chain.shape == (2 * 64, CFG.n_embd, CFG.vocab_size)
        assert found["after"] == ([], [])  # nothing left to chunk: the loss is the fused op's
        torch.testing.assert_close(loss_k, loss, rtol=1e-6, atol=1e-6)
        _close(grads_k, grads)


@pytest.mark.parametrize("loss_inside", [True, False], ids=["hf_labels", "hf_loss_outside"])
def test_detects_hf_gpt2_and_gradients_equal_eager(loss_inside):
    model, inputs = _hf_gpt2(loss_inside)
    loss, grads = _eager(model, inputs)
    found, loss_k, grads_k = _joint_run(model, inputs, 4)
    (chain,) = found["chains"]
    assert chain.shape == (2 * 32, 32, 1024), chain.describe()
    torch.testing.assert_close(loss_k, loss, rtol=1e-6, atol=1e-6)
    _close(grads_k, grads)


def test_shifted_logits_are_left_alone_with_a_reason():
    model, inputs = _hf_gpt2(False, shift_logits=True)
    loss, grads = _eager(model, inputs)
    found, loss_k, grads_k = _joint_run(model, inputs, 4)
    assert found["chains"] == [] and "matmul" in found["skipped"][0], found["skipped"]
    torch.testing.assert_close(loss_k, loss)


def test_leaves_alone_what_it_cannot_chunk():
    class PerToken(torch.nn.Module):  # reduction='none': per-token losses leave the graph
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(16, 50, bias=False)

        def forward(self, x, y):
            return F.cross_entropy(self.head(x), y, reduction="none").square().mean()

    class LogitsOut(torch.nn.Module):  # the caller computes the loss: no loss in the graph
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(16, 50, bias=False)

        def forward(self, x):
            return self.head(x).sum()

    x, y = torch.randn(8, 16), torch.randint(50, (8,))
    found, _, _ = _joint_run(PerToken(), (x, y), None)
    assert found["chains"] == [] and "reduction 'none'" in found["skipped"][0]
    found, _, _ = _joint_run(LogitsOut(), (x,), None)
    assert found["chains"] == [] and found["skipped"] == []


def test_forced_chunks_predicted_peak_is_measured_and_lower():
    model, inputs = _gpt()
    _, grads = _eager(model, inputs)
    peaks = {}
    for k in (1, 8):
        opt = optsched.optimize(model, example_inputs=inputs, time_limit_s=TIME_LIMIT_S, chunking=k)
        plan = opt.plan
        assert plan.summary()["chunks"] == ({"lm_head": k} if k > 1 else {})
        measured = measure_training_step(opt, model, inputs)
        assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= SCALAR_SLACK
        _close(measured.grads, grads)
        peaks[k] = measured.peak_bytes
    logits_bytes = 2 * 64 * CFG.vocab_size * 4
    assert peaks[8] < peaks[1] - logits_bytes  # eager holds the logits, their log-softmax and its gradient


def test_the_planner_chunks_at_a_budget_only_chunking_meets():
    model, inputs = _gpt()
    _, grads = _eager(model, inputs)
    unplanned = optsched.optimize(model, example_inputs=inputs, time_limit_s=TIME_LIMIT_S).plan
    plan_1 = unplanned.summary()
    assert plan_1["chunks"] == {}  # off by default
    budget = int(0.6 * plan_1["unplanned_peak_bytes"])
    with pytest.raises(optsched.BudgetInfeasibleError):  # recomputation alone cannot reach it
        optsched.optimize(model, budget, example_inputs=inputs, time_limit_s=TIME_LIMIT_S, chunking=False)
    opt = optsched.optimize(model, budget, example_inputs=inputs, time_limit_s=TIME_LIMIT_S, chunking=True)
    plan = opt.plan
    k = plan.summary()["chunks"]["lm_head"]
    assert k > 1
    tried = {t["chunks"]: t for t in plan.chunk_trials}
    assert not tried[1]["fits"] and tried[k]["fits"]
    # the fastest count that fits (more chunks only when faster by more than the tie margin)
    fitting = [t for t in plan.chunk_trials if t["fits"]]
    assert plan.estimated_time_s <= min(t["estimated_time_s"] for t in fitting) * 1.011
    measured = measure_training_step(opt, model, inputs)
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= SCALAR_SLACK
    assert measured.peak_bytes <= budget
    _close(measured.grads, grads)


def test_a_chunked_plan_file_replays_the_chunked_graph(tmp_path):
    model, inputs = _gpt()
    _, grads = _eager(model, inputs)
    path = tmp_path / "chunked.json"
    solved = optsched.optimize(model, example_inputs=inputs, time_limit_s=TIME_LIMIT_S, chunking=4, plan=path).plan
    loaded = optsched.optimize(model, example_inputs=inputs, plan=path)  # chunking off: the file decides
    plan = loaded.plan
    assert any(n.startswith("loaded from") for n in plan.stats.notes)
    assert plan.summary()["chunks"] == {"lm_head": 4} and plan.predicted_peak_bytes == solved.predicted_peak_bytes
    measured = measure_training_step(loaded, model, inputs)
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= SCALAR_SLACK
    _close(measured.grads, grads)


def test_roofline_costs_charge_every_chunk():
    """With a named profile (no measurement) the chunked op costs its chunks' weight traffic and launches."""
    model, inputs = _gpt()
    opt = optsched.optimize(model, "60%", example_inputs=inputs, time_limit_s=TIME_LIMIT_S, chunking=True,
                            device_profile="h100")
    plan = opt.plan
    assert plan.timing == "roofline" and plan.summary()["chunks"]["lm_head"] > 1
    fitting = [t for t in plan.chunk_trials if t["fits"]]
    assert len(fitting) >= 2 and fitting[0]["estimated_time_s"] < fitting[1]["estimated_time_s"]
    assert plan.summary()["chunks"]["lm_head"] == fitting[0]["chunks"]  # the fewest chunks that fit: fastest


def test_hf_gpt2_planned_with_chunking_at_half_its_peak():
    model, inputs = _hf_gpt2(True)
    _, grads = _eager(model, inputs)
    opt = optsched.optimize(model, "50%", example_inputs=inputs, time_limit_s=TIME_LIMIT_S, chunking=True)
    plan = opt.plan
    assert plan.summary()["chunks"]["lm_head"] > 1
    measured = measure_training_step(opt, model, inputs)
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= SCALAR_SLACK
    assert measured.peak_bytes <= plan.budget_bytes
    _close(measured.grads, grads)


def test_the_plan_cache_keeps_chunked_plans_apart(tmp_path, monkeypatch):
    """plan="auto": a plan chunked under chunking=4 is not what a later optimize() without chunking replays."""
    monkeypatch.setenv("OPTSCHED_CACHE_DIR", str(tmp_path))
    model, inputs = _gpt()
    chunked = optsched.optimize(model, example_inputs=inputs, time_limit_s=TIME_LIMIT_S, chunking=4, plan="auto").plan
    assert chunked.summary()["chunks"] == {"lm_head": 4}
    plain = optsched.optimize(model, example_inputs=inputs, time_limit_s=TIME_LIMIT_S, plan="auto").plan
    assert not any(k > 1 for k in (plain.summary()["chunks"] or {}).values())
    again = optsched.optimize(model, example_inputs=inputs, time_limit_s=TIME_LIMIT_S, chunking=4, plan="auto").plan
    assert any(n.startswith("loaded from") for n in again.stats.notes)  # each setting still finds its own
    assert again.summary()["chunks"] == {"lm_head": 4}
    assert len(list(tmp_path.glob("*.json"))) == 2
