"""Runtime for offloading activations to host memory between forward and backward.

A lowered forward program calls ``acquire`` once, then ``offload``/``release`` per offloaded
activation; the backward calls ``prefetch``/``wait`` to bring them back. The copies overlap
compute: on CUDA they run on one side stream per direction, on CPU on one worker thread per
direction (which exercises the same program structure where no GPU exists).

Host memory comes from preallocated buffer sets (one flat buffer per set, every slot at a
fixed offset), so a training step allocates no host memory in the common case (a set is reused
only when torch's storage reference count proves it free; without that count, a fresh set per step), and on CPU
the only allocations are the ones the plan accounts for (a prefetch's destination, made on
the calling thread so that the profiler's allocation events show it where the plan says).
"""

from __future__ import annotations

import math
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["HostBuffers", "OffloadDeviceError", "OffloadRuntime", "SlotSpec", "Transfer"]

_ALIGN = 64  # bytes; every slot starts at a multiple, which also suits any dtype's alignment


class OffloadDeviceError(RuntimeError):
    """The plan's offload decisions do not fit the device the step runs on."""


@dataclass(frozen=True)
class SlotSpec:
    """Layout of one offloaded tensor. It must be dense (a permutation of contiguous strides),
    so that its host copy is exactly ``nbytes`` and one ``copy_`` moves it whole."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "stride", tuple(int(s) for s in self.stride))
        if len(self.shape) != len(self.stride):
            raise ValueError(f"SlotSpec: shape {self.shape} and stride {self.stride} differ in rank")
        if math.prod(self.shape) and not _dense(self.shape, self.stride):
            raise ValueError(f"SlotSpec: stride {self.stride} of shape {self.shape} is not dense")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True if the strides visit every element of a numel-sized block exactly once."""
    expected = 1
    for size, st in sorted((p for p in zip(shape, stride) if p[0] != 1), key=lambda p: p[1]):
        if st != expected:
            return False
        expected *= size
    return True


@dataclass(eq=False)
class HostBuffers:
    """One set of host slots. Busy while any tensor handed out by ``release`` is alive."""

    buffer: torch.Tensor  # flat uint8
    slots: list[torch.Tensor]  # internal views of ``buffer``, never handed out
    handed_out: list[weakref.ref] = field(default_factory=list)
    reads: list[Any] = field(default_factory=list)  # CUDA: events of prefetches reading from this set
    _own_refs: int | None = 0  # storage references held by the set itself (buffer and slots); None: unknown

    def busy(self) -> bool:
        if any(r() is not None for r in self.handed_out):
            return True
        # Also catches views of a handed-out tensor that outlive it (they hold the storage). Fails closed:
        # a count that cannot be read may hide such a view, and rewriting its data corrupts a saved activation.
        refs = _storage_refs(self.buffer)
        return refs is None or self._own_refs is None or refs > self._own_refs


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many references hold `t`'s storage; None where this torch cannot say."""
    from .._torch import storage_refs  # looked up at each call, as torch has it now

    return storage_refs(t)


@dataclass(eq=False)
class Transfer:
    """A copy in flight. ``keep`` holds the source alive until the copy is done."""

    result: torch.Tensor | None  # offload: the host slot; prefetch: the device destination
    keep: torch.Tensor | None
    done: Any  # Future (CPU) or torch.cuda.Event (CUDA)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    # no_grad: a worker thread's grad mode is on by default, and copying a tensor that requires
    # grad would attach autograd history to the host buffer. Returns None so that a finished
    # Future holds no tensor.
    with torch.no_grad():
        dst.copy_(src)


def _copy_boxed(box: list) -> None:
    """Run a copy whose tensors only this call holds: the pool's work item keeps its arguments
    a moment after the Future completes, and a tensor freed then, on the worker thread, would
    be freed where the allocator profile does not see it."""
    dst, src = box
    box.clear()
    _copy(dst, src)


class _ThreadCopies:
    """CPU backend: one single-worker pool per direction, so copies are serial per direction
    and overlap the caller's compute (torch ops release the GIL). Workers never allocate."""

    def __init__(self) -> None:
        self._d2h = ThreadPoolExecutor(1, thread_name_prefix="optsched-d2h")
        self._h2d = ThreadPoolExecutor(1, thread_name_prefix="optsched-h2d")

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Future:
        return self._d2h.submit(_copy_boxed, [dst, src])

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Future:
        return self._h2d.submit(_copy_boxed, [dst, src])

    def wait(self, done: Future) -> None:
        done.result()  # re-raises the worker's exception

    def note_read(self, bufs: HostBuffers, done: Future) -> None:
        pass  # until the copy has run, the pool's work item holds the host tensor: the set is busy

    def before_reuse(self, bufs: HostBuffers) -> None:
        pass


class _StreamCopies:
    """CUDA backend: one side stream per direction, ordered against the current stream with
    events, so neither direction makes the host wait for the GPU."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._d2h = torch.cuda.Stream(device)
        self._h2d = torch.cuda.Stream(device)

    def _copy(self, side: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, on_device: torch.Tensor) -> Any:
        side.wait_stream(torch.cuda.current_stream(self._device))  # src is computed, dst allocated
        with torch.cuda.stream(side), torch.no_grad():
            dst.copy_(src, non_blocking=True)
        on_device.record_stream(side)  # the caching allocator must not reuse it before the copy
        event = torch.cuda.Event()
        event.record(side)
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        return self._copy(self._d2h, dst, src, src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        return self._copy(self._h2d, dst, src, dst)

    def wait(self, done: Any) -> None:
        torch.cuda.current_stream(self._device).wait_event(done)

    def note_read(self, bufs: HostBuffers, done: Any) -> None:
        bufs.reads.append(done)

    def before_reuse(self, bufs: HostBuffers) -> None:
        # The host tensor dies when `wait` returns, possibly before its copy has run on the GPU:
        # the next offloads into this set must not overtake those reads.
        for event in bufs.reads:
            self._d2h.wait_event(event)
        bufs.reads.clear()


def _checked_device(device: torch.device | str, planned_for: str) -> torch.device:
    """The device a plan's offloads run on, refused (OffloadDeviceError) unless it is the kind planned for and
    present."""
    device = torch.device(device)
    if planned_for != device.type:
        raise OffloadDeviceError(
            f"this plan offloads activations as planned for {planned_for!r}, but the step runs on {device}: "
            f"plan again with a profile for this device (optimize(..., device_profile=...)), "
            f"or run on the device it was planned for ({planned_for})"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OffloadDeviceError(
            f"this plan offloads activations to pinned host memory on {device} (planned for {planned_for!r}), "
            "but torch.cuda.is_available() is False: run on a machine with a CUDA device, "
            "or plan again with a profile for this device (e.g. device_profile='cpu')"
        )
    return device


def _layout(specs: list[SlotSpec]) -> tuple[list[int], int]:
    """Each slot's byte offset in a buffer set (each at a multiple of _ALIGN), and the set's bytes."""
    offsets, total = [], 0
    for spec in specs:
        offsets.append(total)
        total += -(-spec.nbytes // _ALIGN) * _ALIGN
    return offsets, total


class OffloadRuntime:
    """Host slots and copy queues for one plan; its methods are the lowered programs' call targets.

    On CUDA a released host tensor is ordered for the GPU only: read it on the CPU only after
    synchronizing.
    """

    def __init__(self, slots: list[SlotSpec], device: torch.device, planned_for: str) -> None:
        self.device = device = _checked_device(device, planned_for)
        self.specs = list(slots)
        self._offsets, self._set_bytes = _layout(self.specs)
        self._copies = _StreamCopies(device) if device.type == "cuda" else _ThreadCopies()
        self._sets: list[HostBuffers] = []
        self._by_ptr: dict[int, HostBuffers] = {}
        self._new_set()

    def _new_set(self) -> HostBuffers:
        buffer = torch.empty(self._set_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        slots = [
            buffer[off : off + spec.nbytes].view(spec.dtype).as_strided(spec.shape, spec.stride)
            for off, spec in zip(self._offsets, self.specs)
        ]
        bufs = HostBuffers(buffer, slots)
        bufs._own_refs = _storage_refs(buffer)
        self._sets.append(bufs)
        self._by_ptr[buffer.data_ptr()] = bufs
        return bufs

    def acquire(self) -> HostBuffers:
        """A buffer set no live host tensor refers to; a new one if all are busy (e.g. two
        forwards before their backwards), since handing out a busy set corrupts saved data.
        Where torch cannot count a storage's references every set counts as busy: each step then
        gets a fresh set (host memory allocated per step), and the sets whose tensors are dead are
        forgotten rather than kept (a view still alive keeps its storage, which is never rewritten)."""
        if self._sets and _storage_refs(self._sets[0].buffer) is None:
            warnings.warn("torch._C._storage_Use_Count is missing in this torch: optsched cannot tell when an "
                          "offload host buffer is free again, so each step allocates a fresh one", RuntimeWarning,
                          stacklevel=2)
            self._forget_unreusable()
        for bufs in self._sets:
            if not bufs.busy():
                bufs.handed_out.clear()
                self._copies.before_reuse(bufs)
                return bufs
        return self._new_set()

    def _forget_unreusable(self) -> None:
        """Drop the sets whose handed-out tensors are dead: unable to tell whether views of them live,
        they are never reused, and kept they would grow host memory by a set per step."""
        for bufs in [b for b in self._sets if not any(r() is not None for r in b.handed_out)]:
            self._sets.remove(bufs)
            del self._by_ptr[bufs.buffer.data_ptr()]

    def offload(self, bufs: HostBuffers, x: torch.Tensor, slot: int) -> Transfer:
        """Start copying device tensor ``x`` into slot ``slot`` of ``bufs``."""
        spec = self.specs[slot]
        if x.shape != spec.shape or x.stride() != spec.stride or x.dtype != spec.dtype:
            raise ValueError(
                f"offload slot {slot} holds shape {spec.shape} stride {spec.stride} {spec.dtype}, "
                f"got shape {tuple(x.shape)} stride {x.stride()} {x.dtype}"
            )
        if x.device.type != self.device.type:
            raise ValueError(f"offload slot {slot}: tensor is on {x.device}, the runtime on {self.device}")
        host = bufs.slots[slot]
        return Transfer(host, x, self._copies.to_host(host, x))

    def release(self, tr: Transfer) -> torch.Tensor:
        """Wait for the offload, drop the device tensor, return a fresh host tensor on the slot."""
        slot = tr.result
        assert slot is not None, "release called twice on the same Transfer"
        try:  # wait before dropping x: its last reference must go here, on the thread the profiler sees
            self._copies.wait(tr.done)
        finally:  # and drop it even if the copy failed
            tr.result = tr.keep = tr.done = None
        host = slot.as_strided(slot.shape, slot.stride())
        owner = self._by_ptr.get(slot.untyped_storage().data_ptr())
        if owner is not None:  # None: a set forgotten mid-step (never reused, so nothing to track)
            owner.handed_out.append(weakref.ref(host))
        return host

    def prefetch(self, host: torch.Tensor) -> Transfer:
        """Allocate the device tensor now, on the calling thread, and start copying ``host`` into it."""
        dst = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        done = self._copies.to_device(dst, host)
        owner = self._by_ptr.get(host.untyped_storage().data_ptr())
        if owner is not None:
            self._copies.note_read(owner, done)
        return Transfer(dst, host, done)

    def wait(self, tr: Transfer) -> torch.Tensor:
        """Wait for the prefetch and return the device tensor."""
        dst = tr.result
        assert dst is not None, "wait called twice on the same Transfer"
        try:
            self._copies.wait(tr.done)
        finally:
            tr.result = tr.keep = tr.done = None
        return dst

    @property
    def host_bytes(self) -> int:
        """Bytes of host buffers allocated so far, over all sets."""
        return self._set_bytes * len(self._sets)

    @property
    def n_buffer_sets(self) -> int:
        return len(self._sets)
