"""An optimized module over its life: train then evaluate, changing batch sizes and sequence lengths,
and copies (copy.copy, copy.deepcopy, pickle, torch.save/torch.load).

A percentage budget is a share of each training program's own unplanned peak (every input signature
apart), and a forward-only program takes the bytes of the training program of its shapes (else of the
largest planned); every input signature gets its own compiled program (a bounded cache), so changing
shapes never reach Dynamo's recompile limit; a copy is optimized again with the same settings and the
budget's resolution so far and replays the original's plans without solving.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import optsched
from optsched import BudgetInfeasibleError
from optsched import api
from optsched.budget import LARGEST_TRAINING_PROGRAM, SAME_SHAPES, THIS_PROGRAM
from optsched.measure import measure_training_step

TIME_LIMIT_S = 1.0
WIDTH = 32


class Blocks(nn.Module):
    """Residual GELU blocks over (batch, sequence, width): activations dominate, so "60%" is
    reachable by recomputing; any sequence length works."""

    def __init__(self, depth: int = 6):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(WIDTH, 4 * WIDTH) for _ in range(depth))
        self.down = nn.ModuleList(nn.Linear(4 * WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x):
        for u, d in zip(self.up, self.down, strict=True):
            x = x + d(F.gelu(u(x)))
        return (x * x).mean()


def _blocks(depth: int = 6) -> Blocks:
    torch.manual_seed(0)
    return Blocks(depth)


def _x(batch: int = 8, seq: int = 64) -> torch.Tensor:
    torch.manual_seed(batch * 1000 + seq)
    return torch.randn(batch, seq, WIDTH)


def _input_bytes(plan: optsched.Plan) -> set[int]:
    return {t.bytes for t in plan.problem.tensors if t.kind.value == "input"}


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ---------------------------------------------------------------------------------------------
# budgets across modes and shapes


@pytest.mark.parametrize("pct", ["60%", "99%"])
def test_eval_and_no_grad_after_training_keep_the_training_budget(pct):
    """An evaluation of the shapes just trained takes that training program's bytes: pct of a forward-only
    program's own peak is out of reach (it saves no activations to recompute). Issue 24 changed where the
    bytes come from (the training program of the same shapes, no longer the first training program), not
    what this loop gets: one shape, so the same program either way."""
    module = _blocks()
    opt = optsched.optimize(module, pct, device_profile="cpu", time_limit_s=TIME_LIMIT_S)
    x = _x()
    opt(x).backward()
    train = opt.plan.summary()
    fraction = float(pct[:-1]) / 100
    assert train["budget_from"] == THIS_PROGRAM
    assert train["budget_reference_peak_bytes"] == train["unplanned_peak_bytes"]
    assert train["budget_bytes"] == int(fraction * train["unplanned_peak_bytes"])
    train_plan = opt.plan

    opt.eval()
    module.eval()
    with torch.no_grad():
        out = opt(x)  # used to raise BudgetInfeasibleError: pct of the forward-only program's own peak
        assert torch.equal(out, module(x))
    s = opt.plan.summary()
    assert s["kind"] == "inference"
    assert s["budget_bytes"] == train["budget_bytes"]  # the same bytes, not pct of this program's peak
    assert s["budget_from"] == SAME_SHAPES
    assert s["budget_reference_peak_bytes"] == train["unplanned_peak_bytes"]
    assert s["predicted_peak_bytes"] <= s["budget_bytes"]
    assert opt.plan.budget_from["fingerprint"] == train_plan.fingerprint["hash"]

    opt.train()
    module.train()
    module.zero_grad(set_to_none=True)  # a new step (one that accumulates is another program)
    opt(x).backward()
    assert opt.plan is train_plan  # the training program, still cached: not planned again


def test_a_smaller_last_batch_gets_its_own_share():
    """A smaller last batch is a training program of its own shapes: "60%" means 60% of its own unplanned
    peak. Before issue 24 it kept the first batch's bytes (the first training program fixed them), a looser
    budget than the user asked of this step; now its budget is tighter, met, and the step still computes
    eager's loss and gradients."""
    module = _blocks()
    ref = copy.deepcopy(module)
    opt = optsched.optimize(module, "60%", device_profile="cpu", time_limit_s=TIME_LIMIT_S)
    opt(_x(8)).backward()
    first = opt.plan.budget_bytes
    module.zero_grad(set_to_none=True)

    last = _x(3)
    loss = opt(last)
    loss.backward()
    s = opt.plan.summary()
    assert (s["kind"], s["budget_from"]) == ("training", THIS_PROGRAM)
    assert s["budget_bytes"] == int(0.6 * s["unplanned_peak_bytes"]) < first
    assert s["predicted_peak_bytes"] <= s["budget_bytes"]
    assert 3 * 64 * WIDTH * 4 in _input_bytes(opt.plan)
    ref_loss = ref(last)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    _assert_same_grads(_grads(module), _grads(ref))


def test_a_forward_only_program_before_any_training_takes_its_own_peak():
    """With no training program planned, a forward-only program's percentage is of its own peak (nothing
    else to take it of); once one is, a forward-only program of other shapes takes the largest training
    program's bytes (issue 24: before, the first training program's, which here is the same program)."""
    x = _x()
    early = optsched.optimize(_blocks(), "60%", device_profile="cpu", time_limit_s=TIME_LIMIT_S)
    with pytest.raises(BudgetInfeasibleError) as info, torch.no_grad():
        early(x)  # 60% of the forward-only program's own peak: out of reach
    assert "60% of this forward-only program's own unplanned peak" in str(info.value)
    assert "no training program was planned before it" in str(info.value)

    module = _blocks()
    opt = optsched.optimize(module, "100%", device_profile="cpu", time_limit_s=TIME_LIMIT_S)
    with torch.no_grad():
        opt(x)
    first = opt.plan.summary()
    assert (first["kind"], first["budget_from"]) == ("inference", THIS_PROGRAM)
    assert first["budget_bytes"] == first["unplanned_peak_bytes"] == first["budget_reference_peak_bytes"]

    opt(x).backward()  # a training program: 100% of its own peak
    train = opt.plan.summary()
    assert (train["kind"], train["budget_from"]) == ("training", THIS_PROGRAM)
    assert train["budget_bytes"] == train["unplanned_peak_bytes"] > first["budget_bytes"]

    with torch.no_grad():
        opt(_x(4))  # a forward-only program planned after it, of shapes never trained
    s = opt.plan.summary()
    assert (s["kind"], s["budget_from"], s["budget_bytes"]) == ("inference", LARGEST_TRAINING_PROGRAM,
                                                                train["budget_bytes"])


def test_a_larger_shape_gets_its_own_share_and_an_untrained_eval_shape_can_raise():
    """Before issue 24 a larger training shape had to fit the bytes the first (smaller) one fixed and
    raised BudgetInfeasibleError (the bytes fixed by the first of an ascending loop's lengths). Now it plans
    within its own share. What can still raise is a forward-only program of shapes never trained: it
    takes the largest training program's bytes, and the error says where they came from."""
    module = _blocks()
    opt = optsched.optimize(module, "60%", device_profile="cpu", time_limit_s=TIME_LIMIT_S)
    small = _x(2)
    opt(small).backward()
    plan = opt.plan
    module.zero_grad(set_to_none=True)
    with pytest.raises(BudgetInfeasibleError) as info, torch.no_grad():
        opt(_x(32))  # never trained at batch 32: the bytes of batch 2's training program
    e = info.value
    assert e.budget_bytes == plan.budget_bytes < e.lower_bound_bytes
    assert f"the bytes of {LARGEST_TRAINING_PROGRAM} this callable planned" in str(e)
    assert "'60%'" in str(e) and "no plan fits" in str(e)
    assert opt.plan is None  # the program that failed has no plan

    opt(_x(32)).backward()  # the larger training shape: its own share
    s = opt.plan.summary()
    assert (s["kind"], s["budget_from"]) == ("training", THIS_PROGRAM)
    assert s["budget_bytes"] == int(0.6 * s["unplanned_peak_bytes"]) > plan.budget_bytes
    assert s["predicted_peak_bytes"] <= s["budget_bytes"]
    module.zero_grad(set_to_none=True)
    opt(small).backward()  # the planned shape still runs
    assert opt.plan is plan


# ---------------------------------------------------------------------------------------------
# changing shapes


def test_many_sequence_lengths_never_hit_the_recompile_limit(monkeypatch):
    monkeypatch.setattr(api, "SHAPE_CACHE_SIZE", 4)
    module = _blocks(depth=1)
    ref = copy.deepcopy(module)
    opt = optsched.optimize(module, "100%", device_profile="cpu", time_limit_s=0.5)
    dispatcher = opt._compiled_call_impl
    plans = {}
    lengths = list(range(14, 2, -1))  # 12 distinct shapes: more than Dynamo's 8 per code object
    for seq in lengths:
        x = _x(2, seq)
        loss = opt(x)
        loss.backward()
        plans[seq] = opt.plan
        assert 2 * seq * WIDTH * 4 in _input_bytes(opt.plan)  # `.plan` is the plan of this shape
        assert len(dispatcher.entries) <= 4
        ref_loss = ref(x)
        ref_loss.backward()
        assert torch.equal(loss, ref_loss)
        _assert_same_grads(_grads(module), _grads(ref))
        module.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert len({id(p) for p in plans.values()}) == len(lengths)
    # each length 100% of its own unplanned peak (issue 24; before, all had the bytes of the first, length 14)
    assert all(p.budget_bytes == p.baseline.peak_bytes for p in plans.values())
    assert len({p.budget_bytes for p in plans.values()}) == len(lengths)

    module.zero_grad(set_to_none=True)
    opt(_x(2, 4)).backward()  # cached: runs without planning
    assert opt.plan is plans[4]
    evicted = weakref.ref(plans.pop(14))
    gc.collect()
    assert evicted() is None  # a dropped program frees its plan (and compiled code)
    module.zero_grad(set_to_none=True)
    opt(_x(2, 14)).backward()  # dropped: planned again
    assert 2 * 14 * WIDTH * 4 in _input_bytes(opt.plan)
    assert len(dispatcher.entries) == 4


def test_plan_follows_the_program_that_runs():
    module = _blocks(depth=1)
    opt = optsched.optimize(module, None, device_profile="cpu", time_limit_s=0.5)
    a, b = _x(2, 8), _x(2, 16)
    opt(a).backward()
    plan_a = opt.plan
    module.zero_grad(set_to_none=True)  # each step from None (one that accumulates is another program)
    opt(b).backward()
    plan_b = opt.plan
    assert plan_a is not plan_b
    module.zero_grad(set_to_none=True)
    opt(a).backward()
    assert opt.plan is plan_a
    with torch.no_grad():
        opt(b)
    assert opt.plan.kind == "inference"
    module.zero_grad(set_to_none=True)
    opt(b).backward()
    assert opt.plan is plan_b

    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    f = optsched.optimize(lambda x, k: torch.tanh(x @ w).sum() * k, None, device_profile="cpu", time_limit_s=0.5)
    f(a, 2).backward()
    plan_2 = f.plan
    f(a, 3).backward()  # another constant argument: another program
    assert f.plan is not plan_2
    f(a, 2).backward()
    assert f.plan is plan_2


def test_dispatch_key_has_an_extension_point():
    module = _blocks(depth=1)
    opt = optsched.optimize(module, None, device_profile="cpu", time_limit_s=0.5)
    dispatcher = opt._compiled_call_impl
    x = _x(2, 8)
    assert dispatcher.extra_key((x,), {}) is None
    dispatcher.extra_key = lambda args, kwargs: torch.get_default_dtype()
    opt(x).backward()
    base, usage = dispatcher.key((x,), {})  # the signature, and what the caller was seen doing with the outputs
    assert base[-1] == torch.float32
    assert len(dispatcher.entries) == 1


# ---------------------------------------------------------------------------------------------
# copies


def _deepcopy(m):
    return copy.deepcopy(m)


def _pickle(m):
    return pickle.loads(pickle.dumps(m))


def _torch_save(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("roundtrip", [_deepcopy, _pickle, _torch_save])
def test_a_copy_stays_optimized_and_replays_the_plan(roundtrip):
    module = _blocks()
    x = _x()
    eager = measure_training_step(module, module, (x,))
    opt = optsched.optimize(module, "60%", time_limit_s=TIME_LIMIT_S)
    opt(x).backward()
    plan = opt.plan
    module.zero_grad(set_to_none=True)

    c = roundtrip(opt)
    assert isinstance(c, Blocks) and c is not opt
    assert c.plan is None  # until the copy plans (replays)
    assert all(p is not q and p.data_ptr() != q.data_ptr() for p, q in zip(c.parameters(), module.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(c.parameters(), module.parameters()))

    got = measure_training_step(c, c, (x,))
    assert torch.equal(got.loss, eager.loss)
    _assert_same_grads(got.grads, eager.grads)
    assert c.plan is not None and c.plan is not plan
    assert any(n.startswith("loaded from <plan carried") for n in c.plan.stats.notes)  # replayed, not solved
    assert c.plan.schedule == plan.schedule
    assert c.plan.predicted_peak_bytes == plan.predicted_peak_bytes
    assert c.plan.budget_bytes == plan.budget_bytes and c.plan.budget_spec == "60%"
    assert abs(got.peak_bytes - c.plan.predicted_peak_bytes) <= 0.01 * got.peak_bytes
    assert got.peak_bytes < 0.8 * eager.peak_bytes  # the planned program runs, not eager
    assert all(p.grad is None for p in module.parameters())  # the copy's gradients are its own

    c.eval()  # the copy carries the training programs' bytes, not just "60%"
    with torch.no_grad():
        c(x)
    assert (c.plan.budget_from["program"], c.plan.budget_bytes) == (SAME_SHAPES, plan.budget_bytes)

    again = measure_training_step(opt, module, (x,))  # the original keeps working, with its plan
    assert opt.plan is plan
    _assert_same_grads(again.grads, eager.grads)


def test_copy_copy_shares_parameters_and_stays_optimized():
    module = _blocks()
    x = _x()
    opt = optsched.optimize(module, "60%", device_profile="cpu", time_limit_s=TIME_LIMIT_S)
    opt(x).backward()
    plan = opt.plan
    module.zero_grad(set_to_none=True)

    c = copy.copy(opt)
    assert isinstance(c, Blocks) and c is not opt
    assert all(p is q for p, q in zip(c.parameters(), module.parameters(), strict=True))
    assert c._compiled_call_impl is not opt._compiled_call_impl
    got = measure_training_step(c, module, (x,))
    assert c.plan.schedule == plan.schedule and c.plan is not plan
    assert abs(got.peak_bytes - plan.predicted_peak_bytes) <= 0.01 * got.peak_bytes
    want = measure_training_step(opt, module, (x,))
    assert opt.plan is plan
    _assert_same_grads(got.grads, want.grads)


def test_a_copy_before_any_call_plans_with_the_same_settings():
    opt = optsched.optimize(_blocks(), "70%", device_profile="cpu", time_limit_s=TIME_LIMIT_S)
    c = copy.deepcopy(opt)
    assert c.plan is None
    c(_x()).backward()
    s = c.plan.summary()
    assert (s["budget_from"], s["device_profile"], c.plan.budget_spec) == (THIS_PROGRAM, "cpu", "70%")
    assert s["budget_bytes"] == int(0.7 * s["unplanned_peak_bytes"])
    assert not any(n.startswith("loaded from") for n in c.plan.stats.notes)
    assert opt.plan is None  # the original has not planned


def test_a_pickled_function_stays_optimized():
    f = optsched.optimize(_loss_of_tanh, None, device_profile="cpu", time_limit_s=0.5)
    x = torch.randn(4, WIDTH, requires_grad=True)
    f(x).backward()
    g = pickle.loads(pickle.dumps(f))
    assert g.__name__ == "_loss_of_tanh" and g.plan is None
    assert torch.equal(g(x), _loss_of_tanh(x))
    assert g.plan.schedule == f.plan.schedule
    assert any(n.startswith("loaded from <plan carried") for n in g.plan.stats.notes)


def _loss_of_tanh(x):
    return torch.tanh(x).pow(3).sum()


# ---------------------------------------------------------------------------------------------
# plan files


def test_the_plan_cache_keys_plans_by_the_resolved_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTSCHED_CACHE_DIR", str(tmp_path))
    x = _x()

    def eval_plan_after_training_on(batch):
        opt = optsched.optimize(_blocks(), "60%", device_profile="cpu", time_limit_s=TIME_LIMIT_S, plan="auto")
        opt(_x(batch)).backward()
        with torch.no_grad():
            opt(x)
        return opt.plan

    first = eval_plan_after_training_on(8)
    assert len(list(tmp_path.glob("*.json"))) == 2  # the training program and the forward-only one
    again = eval_plan_after_training_on(8)  # the same bytes: both replayed
    assert any(n.startswith("loaded from") for n in again.stats.notes)
    assert again.budget_bytes == first.budget_bytes
    assert first.budget_from["program"] == SAME_SHAPES
    # trained on other shapes: the forward-only program takes the largest training program's bytes, other
    # bytes, and its plan is not reused
    other = eval_plan_after_training_on(4)
    assert other.budget_bytes < first.budget_bytes
    assert not any(n.startswith("loaded from") for n in other.stats.notes)
    assert len(list(tmp_path.glob("*.json"))) == 4
    made_for = optsched.load_plan(next(p for p in tmp_path.glob("*.json") if _is(p, other))).data["made_for"]
    assert made_for["budget_from"] == LARGEST_TRAINING_PROGRAM
    assert made_for["budget_resolved_bytes"] == other.budget_bytes


def _is(path, plan) -> bool:
    data = optsched.load_plan(path).data
    return data["fingerprint"]["hash"] == plan.fingerprint["hash"] and data["made_for"]["budget_bytes"] == plan.budget_bytes
