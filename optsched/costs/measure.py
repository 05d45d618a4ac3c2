"""Allocator-level memory and time measurement, the ground truth for tests and benchmarks.

The planner predicts peak memory from a model of the schedule; these helpers measure what
the allocator actually did, so predictions can be checked against reality.

CPU peaks come from the profiler's allocation events (``profile_memory=True``); the CPU
allocator has no peak counter of its own. Findings from experiments with torch 2.13 (CPU):

* ``alloc_size`` is the *requested* byte count, not rounded: ``torch.empty(1000, dtype=uint8)``
  records 1000 and ``torch.empty(3, dtype=uint8)`` records 3 (the CUDA caching allocator, by
  contrast, rounds ``memory_allocated`` up to 512-byte blocks). Zero-byte tensors record nothing.
* A free is a separate event with a negative ``alloc_size``.
* Allocation events carry ``alloc_size``, ``device`` (a ``torch.device``), ``ptr``,
  ``total_allocated``, ``total_reserved``, ``id`` and ``allocation_id`` (the last two None on CPU).
* The CPU reporter only knows the size of blocks allocated while some profiler was running.
  A block allocated before *any* session is freed silently (torch warns "Memory block of
  unknown size was allocated before the profiling started"); a block allocated during an
  *earlier* session is freed with its size, so ``end_bytes`` may be negative. Either way the
  peak is the largest running sum above the level at the start; only a silent free can make
  it overstate the truth (the freed bytes are never subtracted).
* Every allocator call is seen, including ones no Python name refers to: ``x * 2`` first
  wraps 2 as an 8-byte double tensor and casts it to a 4-byte float tensor.
* On a GPT forward+backward (340 allocation events, 1 and 2 threads) all events came from
  the calling thread, no two shared a timestamp, and the time-ordered running sum matched
  the profiler's own ``total_allocated`` at every step.
* Every profiler start and stop prints a ``USDT:... profiler_start`` / ``profiler_stop`` line
  to stderr (libkineto's Logger writes its USDT markers to ``std::cerr``; only
  ``KINETO_LOG_LEVEL=6`` turns them off, and that hides kineto's errors too, for the whole
  process). ``memory_profile`` drops exactly those lines: fd 2 goes to a temporary file
  around start and stop only, and everything else written there is passed on.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.profiler import ProfilerActivity, profile

from .._torch import ALLOCATION_EVENT
from ..solvers.model import clock
from .cuda_allocator import AllocatorConfig, allocated_bytes

__all__ = ["PeakResult", "live_bytes", "measure_peak", "measure_ratio", "measure_time", "measure_training_step"]


# libkineto's USDT markers, exactly: "USDT:<date> <time> <pid>:<tid> <file>:<line>] profiler_start"
_KINETO_MARKER = re.compile(rb"USDT:[^\n]*\] profiler_(start|stop)\r?\n?")


@contextlib.contextmanager
def _kineto_markers_dropped() -> Iterator[None]:
    """Drop libkineto's profiler_start/stop lines from what C++ writes to fd 2 meanwhile; pass the
    rest on (delayed by the milliseconds this lasts, never lost). A no-op if fd 2 is not open."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught.read().splitlines(keepends=True) if not _KINETO_MARKER.fullmatch(line))
            while kept:
                kept = kept[os.write(2, kept):]


@contextlib.contextmanager
def memory_profile() -> Iterator[profile]:
    """`torch.profiler.profile` of CPU activity with allocation events, without libkineto's
    start/stop markers on stderr. Planning work on the solvers' clock: a pass (about 0.15 s here), and the
    process's first start once (about 0.8 s: its libraries set up)."""
    clock.count("profiler_pass")
    clock.count_once("profiler_first_start")
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _kineto_markers_dropped():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _kineto_markers_dropped():
            prof.__exit__(None, None, None)


def live_bytes(*objs: Any) -> int:
    """Bytes held by the distinct storages reachable from ``objs``.

    Accepts tensors, modules (parameters and buffers, not grads) and nested lists, tuples,
    sets and dicts. Storages are counted once, so views and tied weights are not double
    counted, which is what the allocator sees.
    """
    seen: dict[StorageWeakRef, int] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[StorageWeakRef(storage)] = storage.nbytes()
        elif isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                visit(t)
            for t in obj.buffers():
                visit(t)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                visit(v)

    for obj in objs:
        visit(obj)
    return sum(seen.values())


def unread_state(state: Iterable[tuple[str, torch.Tensor]], inputs: Iterable[Any],
                 device: torch.device) -> list[tuple[str, int]]:
    """(name, bytes) of each storage of `state` (a module's named parameters and buffers) on `device`
    that no tensor of `inputs` (a captured program's inputs) shares: resident for the whole step, though
    the program never reads it. Each storage once; tensor subclasses (a sharded parameter) are left
    out, their storage is not theirs to count."""
    read = {StorageWeakRef(x.untyped_storage()) for x in inputs if type(x) in _PLAIN}
    out: dict[StorageWeakRef, tuple[str, int]] = {}
    for name, t in state:
        if type(t) not in _PLAIN or t.device.type != device.type or device.index not in (None, t.device.index):
            continue
        key = StorageWeakRef(t.untyped_storage())
        if key not in read and key not in out:
            out[key] = (name, t.untyped_storage().nbytes())
    return list(out.values())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class PeakResult:
    """Memory used by one call, relative to what was allocated when it started."""

    peak_bytes: int  # largest increase above the starting level, >= 0
    end_bytes: int  # allocated at the end minus at the start; < 0 if fn freed more than it kept
    result: Any = field(default=None, compare=False, repr=False)  # fn's return value


def measure_peak(fn: Callable[[], Any], device: str | torch.device = "cpu") -> PeakResult:
    """Run ``fn()`` once and report its allocator peak on ``device``.

    Tensors ``fn`` returns stay alive (they are in ``result``) and so count in ``end_bytes``.
    """
    device = torch.device(device)
    gc.collect()  # so garbage made earlier is not freed mid-measurement
    if device.type == "cuda":
        return _measure_peak_cuda(fn, device)
    return _measure_peak_profiler(fn, device)


def _measure_peak_cuda(fn: Callable[[], Any], device: torch.device) -> PeakResult:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    end = torch.cuda.memory_allocated(device) - start
    return PeakResult(peak_bytes=max(peak, 0), end_bytes=end, result=result)


def _measure_peak_profiler(fn: Callable[[], Any], device: torch.device) -> PeakResult:
    with memory_profile() as prof:
        result = fn()
    events = [
        (event.start_time_ns, event.extra_fields.alloc_size)
        for event in walk_events(prof.profiler.kineto_results.experimental_event_tree())
        if type(event.extra_fields).__name__ == ALLOCATION_EVENT
        and _same_device(event.extra_fields.device, device)
    ]
    events.sort(key=lambda e: e[0])  # stable, so equal timestamps keep tree order
    running = peak = 0
    for _, size in events:
        running += size
        peak = max(peak, running)
    return PeakResult(peak_bytes=peak, end_bytes=running, result=result)


def walk_events(events: list) -> Iterator:
    """Profiler events in pre-order; allocations are leaves under the op that made them."""
    for event in events:
        yield event
        yield from walk_events(event.children)


def labelled_peaks(prof: profile, *prefixes: str) -> dict[str, tuple[int, int]]:
    """Per `record_function` label starting with one of `prefixes`: (the peak of the bytes its allocations held, what
    they still held at its end). Many runs measured in one profiler pass, each under its own label."""
    out = {}
    for event in walk_events(prof.profiler.kineto_results.experimental_event_tree()):
        if not event.name.startswith(prefixes):
            continue
        running = peak = 0
        for _t, size in sorted((e.start_time_ns, e.extra_fields.alloc_size) for e in walk_events(event.children)
                               if type(e.extra_fields).__name__ == ALLOCATION_EVENT):
            running += size
            peak = max(peak, running)
        out[event.name] = (peak, running)
    return out


def _same_device(event_device: torch.device, wanted: torch.device) -> bool:
    if event_device.type != wanted.type:
        return False
    return wanted.index is None or event_device.index == wanted.index


def measure_time(fn: Callable[[], Any], *, warmup: int = 2, repeat: int = 5) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs.

    The median resists one-off stalls (GC, page faults, a noisy neighbour on a shared CPU).
    CUDA is synchronized around each run so queued kernels are counted. On a 2-core machine
    with another busy process, 2 intra-op threads can run ~40x slower than 1
    (``torch.set_num_threads(1)``) because each parallel region waits for a descheduled thread.
    """
    sync = device_sync()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ratio(fn: Callable[[], Any], reference: Callable[[], Any], *, warmup: int = 2, repeat: int = 7) -> tuple[float, float]:
    """(median seconds of fn, median seconds of reference), timed alternately.

    Alternating the two in one loop makes their ratio robust to the machine's speed
    drifting during a benchmark, which on a shared 2-core box it does by tens of percent.
    """
    for _ in range(warmup):
        fn()
        reference()
    a, b = [], []
    for _ in range(repeat):
        a.append(measure_time(fn, warmup=0, repeat=1))
        b.append(measure_time(reference, warmup=0, repeat=1))
    return statistics.median(a), statistics.median(b)


@dataclass
class StepMeasurement:
    """One forward+backward from a canonical state (gradients None)."""

    peak_bytes: int  # absolute: bytes live at the start (parameters, buffers, inputs) + the measured rise
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def measure_training_step(call: Callable, module: torch.nn.Module, inputs: tuple, *,
                          uncounted: tuple = ()) -> StepMeasurement:
    """Peak device bytes of `call(*inputs).backward()`, counted at the allocator.

    Gradients are set to None before and after, so every measurement starts from the
    same state and frees made by the step are of blocks the profiler saw allocated.
    `uncounted`: tensors among `inputs` that the module never sees and a plan's budget does not cover (a loss
    computed outside the module: its targets), left out of the peak. Their storages must not be shared
    with a counted input.
    """
    for p in module.parameters():
        p.grad = None
    gc.collect()
    device = device_of([*module.parameters(), *inputs]) or torch.device("cpu")
    left_out = {id(t) for t in uncounted}
    if not left_out <= {id(t) for t in inputs}:
        raise ValueError("measure_training_step: `uncounted` takes tensors among `inputs`")
    counted = tuple(t for t in inputs if id(t) not in left_out)
    # on CUDA what the allocator counts now (blocks rounded, cuBLAS workspaces of earlier steps included),
    # as a plan's peak counts it, less the caller's uncounted blocks; on CPU the storages' bytes, which is what
    # its allocator counts
    if device.type == "cuda":
        config = AllocatorConfig.from_env()
        start = torch.cuda.memory_allocated(device) - sum(
            allocated_bytes(t.untyped_storage().nbytes(), config) for t in uncounted if t.device == device)
    else:
        start = live_bytes(module, counted)

    def step() -> torch.Tensor:
        loss = call(*inputs)
        loss.backward()
        return loss.detach()

    res = measure_peak(step, device)
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    for p in module.parameters():
        p.grad = None
    return StepMeasurement(start + res.peak_bytes, res.result, grads)


def device_of(values) -> torch.device | None:
    """The device of the first tensor among `values`, None when there is none."""
    for x in values:
        if isinstance(x, torch.Tensor):
            return x.device
    return None


def device_sync() -> Callable[[], None]:
    """What a timer waits on: CUDA kernels run after their launch returns, so a timer that does not wait for
    them times the launch. Nothing to wait for where CUDA was never started (CPU ops run when called)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.synchronize
    return lambda: None
