"""Offload end to end on CPU: the planned step's device peak is the predicted one, gradients are
eager's, offloaded device memory is really gone between offload and prefetch, and the host
budget and the device a plan was made for are respected.

On CPU the "host" is a separate pool in the same memory, filled by worker threads; the
allocator profile counts only the device-role storage, as the plan does.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import optsched
from optsched.measure import measure_training_step
from tests.models import gpt_with_eager
from optsched.lower.offload_runtime import OffloadDeviceError, OffloadRuntime, _ThreadCopies

MiB = 2**20

# module fixtures shared by most tests: one worker runs the file (see tests/conftest.py)
pytestmark = pytest.mark.xdist_group("offload")


@pytest.fixture(scope="module")
def gpt_setup():
    return gpt_with_eager()


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: max diff {(got[k] - want[k]).abs().max().item():.3g}"


@pytest.fixture(scope="module")
def offloading_run(gpt_setup):
    model, inputs, eager = gpt_setup
    budget = int(0.55 * eager.peak_bytes)
    opt = optsched.optimize(model, budget, example_inputs=inputs, offload=True, device_profile="cpu", time_limit_s=2.0)
    torch.manual_seed(0)
    planned = measure_training_step(opt, model, inputs)
    return opt, budget, planned


def test_offloading_plan_peak_is_predicted_and_within_budget(offloading_run):
    opt, budget, planned = offloading_run
    s = opt.plan.summary()
    assert s["n_offloaded"] > 0 and s["offloaded_bytes"] > 0
    assert s["host_bytes"] == s["offloaded_bytes"] <= s["host_budget_bytes"]
    assert s["transfer_s"] == pytest.approx(2 * s["offloaded_bytes"] / opt.plan.profile.host_bw)
    assert 0 <= s["exposed_transfer_s"] <= s["transfer_s"]
    assert planned.peak_bytes <= budget
    assert abs(planned.peak_bytes - opt.plan.predicted_peak_bytes) <= 0.01 * planned.peak_bytes


def test_offloading_plan_gradients_equal_eager(gpt_setup, offloading_run):
    _model, _inputs, eager = gpt_setup
    _opt, _budget, planned = offloading_run
    assert torch.equal(planned.loss, eager.loss)
    _assert_same_grads(planned.grads, eager.grads)


def test_offloaded_device_memory_is_freed_between_offload_and_prefetch(gpt_setup, offloading_run, monkeypatch):
    model, inputs, _eager = gpt_setup
    opt, _budget, _planned = offloading_run
    storages: dict[int, StorageWeakRef] = {}  # host slot address -> the device storage copied into it
    prefetched: list[int] = []
    to_host, to_device = _ThreadCopies.to_host, _ThreadCopies.to_device

    def watch_to_host(self, dst, src):
        storages[dst.data_ptr()] = StorageWeakRef(src.untyped_storage())
        return to_host(self, dst, src)

    def watch_to_device(self, dst, src):
        assert storages[src.data_ptr()].expired(), "the device copy was still alive at its prefetch"
        prefetched.append(src.data_ptr())
        return to_device(self, dst, src)

    monkeypatch.setattr(_ThreadCopies, "to_host", watch_to_host)
    monkeypatch.setattr(_ThreadCopies, "to_device", watch_to_device)
    loss = opt(*inputs)
    n = opt.plan.summary()["n_offloaded"]
    assert len(storages) == n > 0
    # between the forward and the backward, no offloaded activation has device memory
    assert all(ref.expired() for ref in storages.values())
    loss.backward()
    assert sorted(prefetched) == sorted(storages)
    for p in model.parameters():
        p.grad = None


def test_plans_between_steps_share_one_host_pool(gpt_setup, offloading_run, monkeypatch):
    """The pool is allocated when the plan is made; steps reuse it and allocate no host memory."""
    model, inputs, _eager = gpt_setup
    opt, _budget, _planned = offloading_run
    made = []
    new_set = OffloadRuntime._new_set
    monkeypatch.setattr(OffloadRuntime, "_new_set", lambda self: made.append(1) or new_set(self))
    for _ in range(3):
        model.zero_grad(set_to_none=True)  # each a new step (one that accumulates is another program)
        opt(*inputs).backward()
    assert made == []
    for p in model.parameters():
        p.grad = None


def test_a_small_host_budget_is_respected(gpt_setup, offloading_run):
    model, inputs, eager = gpt_setup
    free_opt, budget, _planned = offloading_run
    host_budget = free_opt.plan.summary()["offloaded_bytes"] // 3
    opt = optsched.optimize(model, budget, example_inputs=inputs, offload=True, host_budget=host_budget, device_profile="cpu",
                            time_limit_s=2.0)
    s = opt.plan.summary()
    assert s["host_budget_bytes"] == host_budget
    assert s["offloaded_bytes"] <= host_budget
    torch.manual_seed(0)
    planned = measure_training_step(opt, model, inputs)
    assert planned.peak_bytes <= budget
    assert abs(planned.peak_bytes - opt.plan.predicted_peak_bytes) <= 0.01 * planned.peak_bytes
    _assert_same_grads(planned.grads, eager.grads)


def test_offload_is_off_by_default_on_cpu(gpt_setup):
    model, inputs, eager = gpt_setup
    opt = optsched.optimize(model, int(0.55 * eager.peak_bytes), example_inputs=inputs, time_limit_s=2.0)
    s = opt.plan.summary()
    assert s["n_offloaded"] == 0 and s["host_budget_bytes"] is None


def test_a_plan_with_offloads_for_a_gpu_refuses_to_run_on_cpu(gpt_setup):
    model, inputs, _eager = gpt_setup
    with pytest.raises(OffloadDeviceError, match=r"'h100'.*cuda.*cpu"):
        optsched.optimize(model, "80%", example_inputs=inputs, device_profile="h100", offload=True, time_limit_s=3.0)


@pytest.mark.parametrize("bad", ["yes", 1])
def test_offload_setting_must_be_a_bool_or_none(bad):
    with pytest.raises(ValueError, match="offload must be"):
        optsched.optimize(torch.nn.Linear(2, 2), None, offload=bad)


def test_host_budget_is_parsed_like_a_memory_budget():
    with pytest.raises(ValueError, match="host_budget"):
        optsched.optimize(torch.nn.Linear(2, 2), None, host_budget="lots")
