"""The measurement helpers are the ground truth for everything else, so they must be exact."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.models import gpt
from benchmarks.models.seed_functions import (
    make_inputs,
    memory_peak_efficient_func,
    memory_peak_inefficient_func,
)
from optsched.measure import PeakResult, live_bytes, measure_peak, measure_time
from tests.models import ALL

MiB = 1024 * 1024


def test_peak_of_explicit_allocation_pattern_is_exact():
    def fn():
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3001, dtype=torch.uint8)  # odd size: CPU sizes are not rounded
        del a
        c = torch.empty(250, dtype=torch.float32)  # 1000 bytes, reuses nothing
        return b, c

    r = measure_peak(fn)
    assert r.peak_bytes == 1000 + 3001  # a and b live together; c comes after a is freed
    assert r.end_bytes == 3001 + 1000
    assert [t.numel() for t in r.result] == [3001, 250]


def test_one_mebibyte():
    r = measure_peak(lambda: torch.empty(MiB, dtype=torch.uint8))
    assert (r.peak_bytes, r.end_bytes) == (MiB, MiB)


def test_nothing_allocated_gives_zero():
    assert measure_peak(lambda: None) == PeakResult(peak_bytes=0, end_bytes=0)


def test_temporaries_count_in_peak_but_not_at_end():
    x = torch.randn(256, 256)
    r = measure_peak(lambda: (x + x)[0].clone())  # 256 KiB temporary, 1 KiB result
    assert r.peak_bytes == 256 * 1024 + 1024
    assert r.end_bytes == 1024


def test_hidden_allocations_are_seen():
    # `x * 2` wraps 2 as an 8-byte double tensor and casts it to a 4-byte float one: the
    # profiler sees every allocator call, not just the tensors Python code names.
    x = torch.randn(256, 256)
    r = measure_peak(lambda: x * 2)
    assert r.peak_bytes == 256 * 1024 + 8 + 4
    assert r.end_bytes == 256 * 1024


def test_freeing_an_earlier_allocation_gives_negative_end():
    held = measure_peak(lambda: [torch.empty(4096, dtype=torch.uint8)]).result
    r = measure_peak(held.clear)
    assert (r.peak_bytes, r.end_bytes) == (0, -4096)


def test_result_is_kept_out_of_eq_and_repr():
    a = PeakResult(1, 2, result=torch.zeros(1))
    assert a == PeakResult(1, 2, result="other")
    assert "result" not in repr(a)


@pytest.mark.parametrize(
    "func, expected",
    [(memory_peak_efficient_func, 3 * MiB // 4), (memory_peak_inefficient_func, 11 * MiB // 4)],
)
def test_thunder_1337_eager_peaks(func, expected):
    # The issue reports 0.75 and 2.75 MiB on CUDA; CPU eager must match exactly.
    t0s, a = make_inputs()
    for _ in range(2):  # repeatable, not a first-call artefact
        r = measure_peak(lambda: func(t0s, a))
        assert r.peak_bytes == expected
        assert r.end_bytes == 256 * 256 * 4  # only the returned matrix survives


def test_seed_inputs_stay_finite():
    t0s, a = make_inputs()
    assert torch.isfinite(memory_peak_efficient_func(t0s, a)).all()
    assert torch.isfinite(memory_peak_inefficient_func(t0s, a)).all()


@pytest.mark.parametrize("func", [memory_peak_efficient_func, memory_peak_inefficient_func])
def test_seed_functions_trace_without_graph_breaks(func):
    torch._dynamo.reset()
    t0s, a = make_inputs(n_paths=3, size=32)
    compiled = torch.compile(func, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(t0s, a), func(t0s, a))


def test_live_bytes_counts_each_storage_once():
    x = torch.zeros(10, 10)
    assert live_bytes(x, x[1:], {"v": [x.view(-1)]}) == 400
    assert live_bytes(x[:1]) == 400  # a view holds its whole storage
    assert live_bytes(x, torch.zeros(3, dtype=torch.float64)) == 424


def test_live_bytes_counts_tied_parameters_once():
    model, _ = ALL["tied_lm"]()
    assert model.head.weight is model.embed.weight
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups
    all_uses = [p for _, p in model.named_parameters(remove_duplicate=False)]
    naive = sum(p.numel() * p.element_size() for p in all_uses)
    assert naive > unique
    assert live_bytes(model) == unique
    assert live_bytes(all_uses) == unique
    assert live_bytes(model, model.embed.weight) == unique


def test_live_bytes_includes_buffers():
    bn = torch.nn.BatchNorm1d(8)  # 2 params + running mean/var of 8 floats, int64 counter
    assert live_bytes(bn) == 4 * 8 * 4 + 8


def test_gpt_forward_backward():
    cfg = gpt.GPTConfig()
    model = gpt.build(cfg)
    assert model.lm_head.weight is model.wte.weight
    idx, targets = gpt.make_batch(cfg, batch_size=2)
    assert idx.dtype == targets.dtype == torch.int64
    assert idx.shape == targets.shape == (2, cfg.block_size)
    loss = model(idx, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gpt_is_reproducible():
    cfg = gpt.GPTConfig(n_layer=1, n_embd=32, block_size=16)
    batch = gpt.make_batch(cfg, batch_size=2, seed=3)
    assert torch.equal(gpt.build(cfg, seed=1)(*batch), gpt.build(cfg, seed=1)(*batch))


def test_gpt_traces_without_graph_breaks():
    torch._dynamo.reset()
    cfg = gpt.GPTConfig(n_layer=2, n_embd=32, block_size=16, vocab_size=50)
    model = gpt.build(cfg)
    batch = gpt.make_batch(cfg, batch_size=2)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*batch), model(*batch))


@pytest.mark.parametrize("name", sorted(ALL))
def test_test_models_forward_backward(name):
    module, inputs = ALL[name](seed=0)
    loss = module(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_measure_time_returns_median_seconds():
    calls = []
    t = measure_time(lambda: calls.append(1), warmup=1, repeat=3)
    assert len(calls) == 4
    assert 0 <= t < 0.1


def test_planning_inside_a_profiling_session_leaves_it_running():
    """A first call measured by the user's own profiler plans inside it: optsched's profiling must not end
    the user's session (torch's profiler is one per process), and the plan says what it could not measure."""
    import optsched
    from tests import models

    model, inputs = models.mlp()
    opt = optsched.optimize(model)
    from optsched.planning.op_costs import ScratchNotMeasuredWarning

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with pytest.warns(ScratchNotMeasuredWarning, match="scratch space was not measured"):
            opt(*inputs).backward()
        torch.arange(7).cumsum(0)  # after planning: the session still records
    assert any(e.name == "aten::cumsum" for e in prof.events())
    assert any("another profiler was running" in n for n in opt.plan.stats.notes)


def test_training_step_leaves_out_the_callers_targets_only_when_asked():
    """A loss outside the module: its targets are the caller's, held through the step, and a plan's budget
    (the module's) does not cover them. `uncounted` leaves exactly their bytes out of the peak."""
    from optsched.measure import measure_training_step

    model = torch.nn.Linear(64, 16)
    x, y = torch.randn(32, 64), torch.randint(0, 16, (4096,))

    def call(x, y):
        return torch.nn.functional.cross_entropy(model(x).repeat(128, 1), y)

    every = measure_training_step(call, model, (x, y))
    modules = measure_training_step(call, model, (x, y), uncounted=(y,))
    assert every.peak_bytes - modules.peak_bytes == y.untyped_storage().nbytes()
    with pytest.raises(ValueError, match="among `inputs`"):
        measure_training_step(call, model, (x, y), uncounted=(y.clone(),))
