"""The offload runtime: host slots, buffer-set reuse, the copy queues, memory at the allocator."""

from __future__ import annotations

import gc
import warnings
from concurrent.futures import Future

import pytest
import torch

from optsched.lower import offload_runtime
from optsched.measure import measure_peak
from optsched.lower.offload_runtime import OffloadDeviceError, OffloadRuntime, SlotSpec

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: side streams, pinned memory and events cannot run on this CPU-only machine",
)


def _tensors(device: torch.device) -> list[torch.Tensor]:
    """Different dtypes and shapes, one non-contiguous but dense (a transpose)."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(17, 5, generator=g).to(device),
        torch.randn(3, 8, 6, generator=g).to(torch.bfloat16).to(device),
        torch.randint(-(2**40), 2**40, (11,), generator=g).to(device),
        torch.randn(6, 9, generator=g).to(device).t(),  # shape (9, 6), stride (1, 9)
        torch.randn(4, 1, 3, generator=g).to(device).transpose(0, 2),  # a size-1 dim between
    ]


def _specs(xs: list[torch.Tensor]) -> list[SlotSpec]:
    return [SlotSpec(tuple(x.shape), x.stride(), x.dtype) for x in xs]


def _step(rt: OffloadRuntime, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A forward's part: acquire, start every offload, then release them all."""
    bufs = rt.acquire()
    transfers = [rt.offload(bufs, x, i) for i, x in enumerate(xs)]
    return [rt.release(tr) for tr in transfers]


def _back(rt: OffloadRuntime, hosts: list[torch.Tensor]) -> list[torch.Tensor]:
    """A backward's part: start every prefetch, then wait for them all."""
    transfers = [rt.prefetch(h) for h in hosts]
    return [rt.wait(tr) for tr in transfers]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    assert torch.equal(_bits(a), _bits(b))


def _storage_ptrs(ts: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts}


def test_round_trip_cpu() -> None:
    xs = _tensors(CPU)
    rt = OffloadRuntime(_specs(xs), CPU, "cpu")
    hosts = _step(rt, xs)
    back = _back(rt, hosts)
    for x, h, y in zip(xs, hosts, back):
        _assert_same(h, x)
        _assert_same(y, x)
    assert not (_storage_ptrs(xs) | _storage_ptrs(back)) & _storage_ptrs(hosts)
    assert len(_storage_ptrs(hosts)) == 1  # all slots in the one buffer set
    assert not _storage_ptrs(xs) & _storage_ptrs(back)


def test_host_copy_survives_overwrite_and_free() -> None:
    xs = _tensors(CPU)
    expected = [x.clone() for x in xs]
    rt = OffloadRuntime(_specs(xs), CPU, "cpu")
    hosts = _step(rt, xs)
    for x in xs:
        x.zero_()
    del xs
    gc.collect()
    for _ in range(3):  # reuse of the freed memory by other tensors
        junk = [torch.full_like(e, 7) for e in expected]
    del junk
    for e, h, y in zip(expected, hosts, _back(rt, hosts)):
        _assert_same(h, e)
        _assert_same(y, e)


def test_buffer_set_reused_when_host_tensors_dead() -> None:
    xs = _tensors(CPU)
    rt = OffloadRuntime(_specs(xs), CPU, "cpu")
    first = rt.host_bytes
    assert first >= sum(s.nbytes for s in _specs(xs)) and first % 64 == 0
    for step in range(4):
        xs = [x + step if x.dtype != torch.bfloat16 else x * 2 for x in xs]
        hosts = _step(rt, xs)
        for x, y in zip(xs, _back(rt, hosts)):
            _assert_same(y, x)
        del hosts, y
        assert rt.n_buffer_sets == 1 and rt.host_bytes == first


def test_second_buffer_set_while_first_step_alive() -> None:
    xs1 = _tensors(CPU)
    xs2 = [x + 1 if x.dtype != torch.bfloat16 else x * 3 for x in xs1]
    rt = OffloadRuntime(_specs(xs1), CPU, "cpu")
    hosts1 = _step(rt, xs1)  # two forwards before their backwards
    hosts2 = _step(rt, xs2)
    assert rt.n_buffer_sets == 2 and rt.host_bytes == 2 * OffloadRuntime(_specs(xs1), CPU, "cpu").host_bytes
    assert not _storage_ptrs(hosts1) & _storage_ptrs(hosts2)
    for x, y in zip(xs2, _back(rt, hosts2)):
        _assert_same(y, x)
    for x, y in zip(xs1, _back(rt, hosts1)):
        _assert_same(y, x)
    del hosts1, hosts2
    _step(rt, xs1)  # both sets free again: no third
    assert rt.n_buffer_sets == 2


def test_view_of_host_tensor_keeps_set_busy() -> None:
    xs = _tensors(CPU)
    rt = OffloadRuntime(_specs(xs), CPU, "cpu")
    view = _step(rt, xs)[0][1:]  # the host tensor itself is dead, its view is not
    _step(rt, xs)
    assert rt.n_buffer_sets == 2
    _assert_same(view, xs[0][1:])


NO_USE_COUNT = pytest.mark.filterwarnings("ignore:torch._C._storage_Use_Count is missing:RuntimeWarning")


def test_a_set_counts_as_busy_whenever_the_use_count_cannot_be_read(monkeypatch) -> None:
    """Fails closed: torch's storage use count is what sees a view outliving the tensors handed out; without it
    a set must count as busy even when nothing of it lives (rewriting it could corrupt a saved activation)."""
    xs = _tensors(CPU)
    rt = OffloadRuntime(_specs(xs), CPU, "cpu")
    bufs = rt.acquire()
    view = [rt.release(rt.offload(bufs, x, i)) for i, x in enumerate(xs)][0][1:]  # the host tensors die, the view lives
    assert bufs.busy()  # seen by the count
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert bufs.busy()
    del view
    gc.collect()
    assert bufs.busy()  # free in fact, but this torch cannot say so
    monkeypatch.undo()
    assert not bufs.busy()


@NO_USE_COUNT
def test_without_the_use_count_a_set_is_never_reused_while_a_view_may_live(monkeypatch) -> None:
    """Without torch's storage use count a view's life cannot be seen: every set counts as busy (it was
    counted free, and the next step overwrote the view's data); dead sets are forgotten, so host memory
    stays bounded."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    xs = _tensors(CPU)
    rt = OffloadRuntime(_specs(xs), CPU, "cpu")
    view = _step(rt, xs)[0][1:]  # the host tensor itself is dead, its view is not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hosts = _step(rt, [x + 1 if x.dtype != torch.bfloat16 else x * 3 for x in xs])
    _assert_same(view, xs[0][1:])
    assert any("_storage_Use_Count is missing" in str(w.message) for w in caught)  # said, not silent
    for _ in range(3):  # each step a fresh set; the dead ones are not kept
        del hosts
        hosts = _step(rt, xs)
        assert rt.n_buffer_sets == 1
    for x, y in zip(xs, _back(rt, hosts)):
        _assert_same(y, x)


@NO_USE_COUNT
def test_an_offloading_plan_without_the_use_count_allocates_fresh_sets_and_keeps_eagers_gradients(monkeypatch) -> None:
    """The safe path end to end: an offloading plan's steps, with the symbol gone, each take a fresh host set."""
    import optsched
    from optsched.measure import measure_training_step

    class Chain(torch.nn.Module):  # activations (4096 x 64) dwarf the weights: the plan offloads some
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())],
                                           torch.nn.Linear(64, 1))

        def forward(self, x):
            return self.net(x).square().mean()

    torch.manual_seed(0)
    model, x = Chain(), torch.randn(4096, 64)
    eager = measure_training_step(model, model, (x,))
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    opt = optsched.optimize(model, "60%", example_inputs=(x,), offload=True, time_limit_s=1)
    assert opt.plan.summary()["n_offloaded"] > 0
    made, new_set = [], OffloadRuntime._new_set
    monkeypatch.setattr(OffloadRuntime, "_new_set", lambda self: made.append(1) or new_set(self))
    for step in range(1, 3):
        got = measure_training_step(opt, model, (x,))
        assert len(made) == step  # the fallback: a fresh set each step, none reused
        assert torch.equal(got.loss, eager.loss)
        assert got.grads.keys() == eager.grads.keys()
        for k in eager.grads:
            assert torch.equal(got.grads[k], eager.grads[k]), k


class _InlineExecutor:
    """Runs the submitted copy on the calling thread. The profiler records only the calling
    thread's allocations (a worker's torch.empty shows nothing), so to see whether the workers'
    copies allocate, the memory tests run them inline."""

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut


@pytest.fixture(params=["inline", "threads"])
def runtime_and_tensors(request: pytest.FixtureRequest) -> tuple[OffloadRuntime, list[torch.Tensor]]:
    xs = _tensors(CPU)
    rt = OffloadRuntime(_specs(xs), CPU, "cpu")
    if request.param == "inline":
        rt._copies._d2h = rt._copies._h2d = _InlineExecutor()
    _back(rt, _step(rt, xs))  # warm up: worker threads started, the first set exists
    gc.collect()
    return rt, xs


def test_offload_and_release_allocate_nothing(runtime_and_tensors) -> None:
    rt, xs = runtime_and_tensors
    res = measure_peak(lambda: _step(rt, xs), "cpu")
    assert (res.peak_bytes, res.end_bytes) == (0, 0)
    assert rt.n_buffer_sets == 1
    for x, h in zip(xs, res.result):
        _assert_same(h, x)


def test_prefetch_allocates_exactly_the_slot(runtime_and_tensors) -> None:
    rt, xs = runtime_and_tensors
    hosts = _step(rt, xs)
    sizes = [spec.nbytes for spec in _specs(xs)]
    # One profiler session for all (each costs ~0.2 s); each destination is sized on its storage.
    res = measure_peak(lambda: [rt.wait(rt.prefetch(h)) for h in hosts], "cpu")
    assert res.peak_bytes == res.end_bytes == sum(sizes)
    for x, y, size in zip(xs, res.result, sizes):
        assert y.untyped_storage().nbytes() == size
        _assert_same(y, x)


def test_wrong_device_plan_raises() -> None:
    with pytest.raises(OffloadDeviceError, match="cuda") as info:
        OffloadRuntime([SlotSpec((2,), (1,), torch.float32)], CPU, "cuda")
    assert "cpu" in str(info.value) and "plan again" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is unavailable")
def test_cuda_unavailable_raises() -> None:
    with pytest.raises(OffloadDeviceError, match=r"cuda.*is_available\(\) is False"):
        OffloadRuntime([SlotSpec((2,), (1,), torch.float32)], torch.device("cuda"), "cuda")


def test_slot_mismatch_raises() -> None:
    rt = OffloadRuntime([SlotSpec((4, 3), (3, 1), torch.float32)], CPU, "cpu")
    bufs = rt.acquire()
    for bad in (torch.zeros(3, 4), torch.zeros(4, 3, dtype=torch.float64), torch.zeros(3, 4).t(), torch.zeros(12)):
        with pytest.raises(ValueError, match="slot 0"):
            rt.offload(bufs, bad, 0)
    with pytest.raises(ValueError, match="not dense"):
        SlotSpec((2, 2, 2), (3, 3, 1), torch.float32)  # extent 8 = numel, but overlapping


def test_worker_errors_surface_at_release_and_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 3)
    rt = OffloadRuntime(_specs([x]), CPU, "cpu")
    bufs = rt.acquire()
    bufs.slots[0] = torch.empty(5)  # copy_ fails in the worker: sizes do not broadcast
    tr = rt.offload(bufs, x, 0)
    with pytest.raises(RuntimeError, match="size"):
        rt.release(tr)
    assert tr.keep is None  # the device tensor is dropped even so

    def broken(dst: torch.Tensor, src: torch.Tensor) -> None:
        raise RuntimeError("copy failed in the worker")

    monkeypatch.setattr(offload_runtime, "_copy", broken)
    tr = rt.prefetch(torch.randn(4, 3))
    with pytest.raises(RuntimeError, match="copy failed in the worker"):
        rt.wait(tr)


def test_copies_do_not_attach_autograd_history() -> None:
    x = torch.randn(4, 3, requires_grad=True) * 2
    rt = OffloadRuntime(_specs([x]), CPU, "cpu")
    (h,) = _step(rt, [x])
    assert not h.requires_grad and h.grad_fn is None
    (y,) = _back(rt, [h])
    assert not y.requires_grad
    _assert_same(y, x)


@pytest.mark.gpu
@needs_cuda
def test_round_trip_cuda() -> None:
    dev = torch.device("cuda")
    xs = _tensors(dev)
    rt = OffloadRuntime(_specs(xs), dev, "cuda")
    hosts = _step(rt, xs)
    back = _back(rt, hosts)
    torch.cuda.synchronize()
    for x, h, y in zip(xs, hosts, back):
        assert h.device.type == "cpu" and h.is_pinned()
        _assert_same(h, x)
        _assert_same(y, x)
        assert y.device.type == "cuda"
    del hosts, back, h, y  # the loop's last host tensor too: a live one keeps its set busy (found on an H200)
    _step(rt, xs)
    assert rt.n_buffer_sets == 1


def test_the_device_copy_is_freed_on_the_calling_thread() -> None:
    """The profiler only sees the calling thread: a device copy whose last reference died in a
    worker would stay allocated as far as the measured peak knows."""
    spec = SlotSpec((256, 256), (256, 1), torch.float32)
    rt = OffloadRuntime([spec], CPU, "cpu")
    bufs = rt.acquire()

    def step():
        x = torch.ones(256, 256)
        tr = rt.offload(bufs, x, 0)
        del x  # the transfer holds the only reference now
        return rt.release(tr)

    for _ in range(5):  # the copy's timing varies; the accounting must not
        res = measure_peak(step, "cpu")
        assert (res.peak_bytes, res.end_bytes) == (spec.nbytes, 0)
        assert torch.equal(res.result, torch.ones(256, 256))
        del res
