"""A percentage budget in a loop whose shapes change (issue 24): bucketed or curriculum sequence lengths.

"60%" is a share of each training program's own unplanned peak, so every length plans within its own
share whether the lengths grow or shrink (when the first length fixed the bytes, an ascending loop raised
BudgetInfeasibleError at every longer length). A forward-only program takes the bytes of the training
program of its shapes, else of the largest one planned.
"""

from __future__ import annotations

import copy

import pytest
import torch

import optsched
from benchmarks.models import gpt
from optsched.budget import LARGER_TRAINING_PROGRAM, LARGEST_TRAINING_PROGRAM, SAME_SHAPES, THIS_PROGRAM
from optsched.costs.measure import live_bytes, measure_peak
from optsched.measure import measure_training_step

# module fixtures shared by most tests: one worker runs the file (see tests/conftest.py)
pytestmark = pytest.mark.xdist_group("growing-shapes")

CFG = gpt.GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128)
BATCH = 16  # activations dominate the weights: 60% is reached by recomputing, at every length
LENGTHS = [32, 56, 80, 104, 128]
TIME_LIMIT_S = 0.5
SCALAR_SLACK = 64  # bytes: the autograd engine's scalar tangent of the loss, outside the programs


def _batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt.make_batch(CFG, batch_size=BATCH, seq_len=seq, seed=seq)


def _train_through(lengths: list[int]) -> tuple[torch.nn.Module, torch.nn.Module, dict[int, optsched.Plan]]:
    """One step per length with "60%": each plans within its own share, runs as planned (predicted peak
    measured) and computes eager's loss and gradients bitwise. Plans go to the plan cache (`cache`)."""
    model = gpt.build(CFG)
    eager = copy.deepcopy(model)
    opt = optsched.optimize(model, "60%", device_profile="cpu", time_limit_s=TIME_LIMIT_S, plan="auto")
    plans = {}
    for seq in lengths:
        inputs = _batch(seq)
        opt(*inputs).backward()  # plans (outside the measurement: planning has its own test)
        model.zero_grad(set_to_none=True)
        got = measure_training_step(opt, model, inputs)
        loss = eager(*inputs)
        loss.backward()
        want = {n: p.grad for n, p in eager.named_parameters()}
        eager.zero_grad(set_to_none=True)
        plan = opt.plan
        s = plan.summary()
        assert (s["kind"], s["budget_from"]) == ("training", THIS_PROGRAM), seq
        assert s["budget_bytes"] == int(0.6 * s["unplanned_peak_bytes"]), seq  # its own share, not the first's
        assert s["budget_reference_peak_bytes"] == s["unplanned_peak_bytes"]
        assert s["predicted_peak_bytes"] <= s["budget_bytes"], seq
        assert abs(got.peak_bytes - s["predicted_peak_bytes"]) <= SCALAR_SLACK, (seq, got.peak_bytes, s)
        assert got.peak_bytes <= s["budget_bytes"], seq
        torch.testing.assert_close(got.loss, loss.detach(), rtol=0, atol=0)
        assert got.grads.keys() == want.keys()
        for name, g in want.items():
            torch.testing.assert_close(got.grads[name], g, rtol=0, atol=0, msg=f"{name} at length {seq}")
        plans[seq] = plan
    return opt, model, plans


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as m:
        path = tmp_path_factory.mktemp("plan_cache")
        m.setenv("OPTSCHED_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def ascending(cache):
    return _train_through(LENGTHS)


def test_every_length_of_an_ascending_loop_plans_within_its_own_share(ascending):
    _, _, plans = ascending
    budgets = [plans[seq].budget_bytes for seq in LENGTHS]
    assert budgets == sorted(budgets) and len(set(budgets)) == len(budgets)  # each length its own bytes
    assert any(plans[seq].sim.recomputed_ops for seq in LENGTHS)  # the budgets bind: planning, not eager


@pytest.mark.slow  # 10 s
def test_a_descending_loop_gets_the_same_budgets_and_replays_the_ascending_plans(ascending):
    """The order the shapes come in does not matter: each length's budget is the same, so the plan cache
    (keyed by what the percentage was resolved against) gives back the plans the ascending loop saved."""
    _, _, up = ascending
    _, _, down = _train_through(LENGTHS[::-1])
    for seq in LENGTHS:
        assert down[seq].budget_bytes == up[seq].budget_bytes, seq
        assert any(n.startswith("loaded from") for n in down[seq].stats.notes), seq
        assert down[seq].schedule == up[seq].schedule, seq


def test_eval_after_training_takes_the_bytes_of_the_training_step_it_evaluates(ascending):
    opt, model, plans = ascending
    model.eval()
    try:
        with torch.no_grad():
            for seq, program, lender in [(56, SAME_SHAPES, 56), (40, LARGEST_TRAINING_PROGRAM, 128)]:  # 40: untrained
                inputs = _batch(seq)
                start = live_bytes(model, inputs)
                opt(*inputs)  # plans (outside the measurement)
                measured = measure_peak(lambda inputs=inputs: opt(*inputs))
                assert torch.equal(measured.result, model._call_impl(*inputs)), seq  # eager's loss, bitwise
                s = opt.plan.summary()
                assert (s["kind"], s["budget_from"]) == ("inference", program), seq
                assert s["budget_bytes"] == plans[lender].budget_bytes, seq
                assert s["budget_reference_peak_bytes"] == plans[lender].baseline.peak_bytes
                assert opt.plan.budget_from["fingerprint"] == plans[lender].fingerprint["hash"]
                assert s["predicted_peak_bytes"] <= s["budget_bytes"]
                assert start + measured.peak_bytes <= s["predicted_peak_bytes"] + SCALAR_SLACK, seq
    finally:
        model.train()


def test_a_forward_only_program_before_any_training_takes_its_own_share():
    model = gpt.build(CFG)
    opt = optsched.optimize(model, "100%", device_profile="cpu", time_limit_s=TIME_LIMIT_S)
    with torch.no_grad():
        opt(*_batch(32))
    s = opt.plan.summary()
    assert (s["kind"], s["budget_from"]) == ("inference", THIS_PROGRAM)
    assert s["budget_bytes"] == s["unplanned_peak_bytes"]


SMALL = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)  # weights dominate small batches


def _small_step(opt, model, eager, batch: int) -> dict:
    """One step of batch `batch`: planned, measured within its bytes, eager's loss and gradients bitwise."""
    inputs = gpt.make_batch(SMALL, batch_size=batch, seed=batch)
    opt(*inputs).backward()  # plans (outside the measurement)
    got = measure_training_step(opt, model, inputs)
    loss = eager(*inputs)
    loss.backward()
    s = opt.plan.summary()
    assert s["predicted_peak_bytes"] <= s["budget_bytes"] and got.peak_bytes <= s["budget_bytes"], (batch, s)
    torch.testing.assert_close(got.loss, loss.detach(), rtol=0, atol=0)
    assert got.grads.keys() == {n for n, _ in eager.named_parameters()}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(got.grads[name], p.grad, rtol=0, atol=0, msg=f"{name} at batch {batch}")
    eager.zero_grad(set_to_none=True)
    return s


def test_a_small_last_batch_takes_the_bytes_a_larger_batch_was_given(tmp_path, monkeypatch):
    """Issue 33: at "60%" batches of 1 and 2 fall below their bound (the weights and their gradients, which do not
    shrink with the batch, dominate their peak) and raised BudgetInfeasibleError, ending the loop. After batch 8
    they plan with the bytes batch 8 was given: each step within them, eager's gradients; the plan says which
    bytes and why, and plan="auto" replays it. With no larger batch planned yet, the error says so."""
    monkeypatch.setenv("OPTSCHED_CACHE_DIR", str(tmp_path))
    model = gpt.build(SMALL)
    eager = copy.deepcopy(model)
    options = dict(device_profile="cpu", time_limit_s=2, deterministic=True, plan="auto")
    opt = optsched.optimize(model, "60%", **options)
    large = _small_step(opt, model, eager, 8)
    assert large["budget_from"] == THIS_PROGRAM and large["budget_bytes"] == int(0.6 * large["unplanned_peak_bytes"])
    for batch in (1, 2):
        s = _small_step(opt, model, eager, batch)
        assert int(0.6 * s["unplanned_peak_bytes"]) < s["lower_bound_bytes"], (batch, s)  # its own share: none can
        assert (s["budget_from"], s["budget_bytes"]) == (LARGER_TRAINING_PROGRAM, large["budget_bytes"]), batch
        assert s["budget_reference_peak_bytes"] == large["unplanned_peak_bytes"]
        assert any(n.startswith("budget: 60% of this training program's unplanned peak") and "memory the loop was "
                   "already allowed" in n for n in opt.plan.stats.notes), opt.plan.stats.notes

    again = optsched.optimize(model, "60%", **options)  # the small batch first: nothing larger known
    with pytest.raises(optsched.BudgetInfeasibleError) as info:
        again(*gpt.make_batch(SMALL, batch_size=1, seed=1)).backward()
    assert info.value.proven and "no larger training program of this callable was planned before this one" in \
        str(info.value), str(info.value)
    for batch in (8, 1):  # then the plan file made with batch 8's bytes is replayed
        again(*gpt.make_batch(SMALL, batch_size=batch, seed=batch)).backward()
        model.zero_grad(set_to_none=True)
        assert any(n.startswith("loaded from") for n in again.plan.stats.notes), batch
    assert (again.plan.summary()["budget_from"], again.plan.budget_bytes) == (LARGER_TRAINING_PROGRAM, large["budget_bytes"])
