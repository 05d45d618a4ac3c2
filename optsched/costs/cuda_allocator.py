"""What PyTorch's CUDA caching allocator counts: the bytes `torch.cuda.max_memory_allocated` sees for a
request, and the allocations a CUDA step makes through it that no graph shows (issue 23).

Plain arithmetic and environment variables; no torch. The rules, from PyTorch's sources (main branch,
read for torch 2.13; cited by file and function):

Requests (c10/cuda/CUDACachingAllocator.cpp, `DeviceCachingAllocator::malloc`, `round_size`,
`get_allocation_size`, `should_split`, `alloc_found_block`; c10/core/AllocatorConfig.cpp):

* 0 bytes allocates nothing (`NativeCachingAllocator::allocate` calls `malloc` only for size != 0).
* A request of n bytes becomes `round_size(n)`: 512 bytes at least (`kMinBlockSize`), else the next
  multiple of 512; with `roundup_power2_divisions` set (PYTORCH_ALLOC_CONF, or the older
  PYTORCH_CUDA_ALLOC_CONF) for n's power-of-two interval to d > 1 and n > 512 * d, the next of d equal
  steps between the powers of two around n instead. That rounded size is the block's size, and
  `allocated_bytes` (what max_memory_allocated reads) grows by the block's size (`alloc_found_block`),
  so the option does change what is counted: it is read here from the same variables.
* Rounded sizes up to 1 MiB come from the small pool: always split to exactly that size.
* Larger ones come from the large pool. When no cached block fits, a new segment is cudaMalloc'd:
  20 MiB for sizes under 10 MiB (split: counted as the rounded size), else the size rounded up to 2 MiB,
  which is split only when more than 1 MiB would remain (`should_split`). So a request of 10 MiB or more
  counts its 2 MiB-rounded segment when that adds at most 1 MiB: 15 MiB counts 16 MiB. Freed, that
  block stays whole in the cache and the next step's request of the same size takes it whole again.
  With `max_split_size_mb` no block that large is split (it counts its segment); with
  `expandable_segments:True` every block is split to the rounded size.

  Not modeled (it depends on the allocator's history, not on the request): a large request served from
  a cached free block that is larger by at most 1 MiB counts the whole block, up to 1 MiB more than
  `allocated_bytes` here, and with `max_split_size_mb` an oversize cached block larger by up to
  `max_non_split_rounding_mb` (20 MiB by default). The `cudaMallocAsync` backend is not modeled.
  Measured on an H200 (issue 32): 11-15 MiB above the requested bytes at 9-37 GiB peaks; with
  `expandable_segments:True` none, plans measuring what they predict to the byte (`DEFAULT_MODE_NOTE`).

Allocations no graph shows (aten/src/ATen/cuda/CublasHandlePool.cpp):

* cuBLAS workspace: `getCurrentCUDABlasHandle` calls `setWorkspaceForHandle`, which allocates
  `getChosenWorkspaceSize()` bytes through the caching allocator the first time a (cuBLAS handle,
  stream) pair is used, and keeps it for the process's life. Handles are per thread: the forward runs
  on the caller's thread and a CUDA backward on the autograd engine's device thread, so a training step
  holds two. Size: CUBLAS_WORKSPACE_CONFIG's `:SIZE:COUNT` pairs summed (SIZE KiB times COUNT), else
  32 MiB on sm90 (`:4096:8`) and 8 MiB + 128 KiB elsewhere (`:4096:2:16:8`).
* cuBLASLt workspace: `getCUDABlasLtWorkspace` allocates its own per (handle, stream), unless
  TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 makes it share the cuBLAS one: CUBLASLT_WORKSPACE_SIZE KiB (1024
  by default), capped at the cuBLAS workspace size unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0. The Lt
  path also takes the cuBLAS handle (so the cuBLAS workspace too). Which ops take the Lt path is a
  prediction (aten/src/ATen/native/cuda/Blas.cpp): addmm with a 1-D bias (`gemm_and_bias`; off with
  DISABLE_ADDMM_CUDA_LT=1), `_addmm_activation`, `_scaled_mm` (fp8), and every matmul when the
  preferred BLAS library is cuBLASLt (TORCH_BLAS_PREFER_CUBLASLT=1, torch.backends.cuda.preferred_blas_library).
* RNG: none. The CUDA generator's philox seed and offset live on the host; only CUDA-graph capture
  (`CUDAGeneratorState::register_graph`) allocates device copies, and optsched captures none. The
  attention kernels' seed/offset outputs are values of the graph (see `costs/sdpa_prediction`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MODE_NOTE", "AllocatorConfig", "PersistentAllocation", "ThreadUse", "addmm_uses_cublaslt", "allocated_bytes",
    "cublas_workspace_bytes", "cublaslt_workspace_bytes", "default_mode_note", "persistent_allocations", "round_size",
]

KiB, MiB = 1024, 1024 * 1024
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request of the small pool
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the segment of requests between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one per power of two

# ops that call cuBLAS (aten overload packet names; matmul, linear, einsum reach the graph as these)
CUBLAS_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation", "_int_mm",
    "_scaled_mm", "linear_cross_entropy",  # the last: optsched's chunked LM head (passes/chunked_ce.py)
})
# ops that take the cuBLASLt path (and its workspace) without TORCH_BLAS_PREFER_CUBLASLT
CUBLASLT_OPS = frozenset({"_addmm_activation", "_scaled_mm"})


@dataclass(frozen=True)
class AllocatorConfig:
    """The options of PYTORCH_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF) that change what a request counts."""

    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS  # per interval [2^k MiB, 2^(k+1) MiB)
    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: every block may be split

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllocatorConfig:
        """The configuration the caching allocator reads at start-up: PYTORCH_ALLOC_CONF, else the
        deprecated PYTORCH_CUDA_ALLOC_CONF (AcceleratorAllocatorConfig::instance)."""
        environ = os.environ if environ is None else environ
        name = "PYTORCH_ALLOC_CONF" if "PYTORCH_ALLOC_CONF" in environ else "PYTORCH_CUDA_ALLOC_CONF"
        text = environ.get(name) or ""
        try:
            return cls.parse(text)
        except (ValueError, IndexError) as e:  # torch refuses it too, when its allocator starts
            raise ValueError(f"{name}={text!r} does not parse as the CUDA caching allocator's settings: {e}") from None

    @classmethod
    def parse(cls, text: str) -> AllocatorConfig:
        """`key:value` pairs separated by commas, as AcceleratorAllocatorConfig::parseArgs reads them;
        keys that do not change the counted bytes are skipped."""
        tokens = re.findall(r"[\[\]:,]|[^\[\]:,\s]+", text)
        divisions, expandable, max_split = [0] * _INTERVALS, False, None
        i = 0
        while i < len(tokens):
            key = tokens[i]
            value = tokens[i + 2] if i + 2 < len(tokens) and tokens[i + 1] == ":" else None
            if key == "roundup_power2_divisions" and value == "[":
                i = _parse_division_list(tokens, i + 3, divisions)
            elif key == "roundup_power2_divisions" and value is not None:
                divisions = [int(value)] * _INTERVALS
                i += 3
            elif key == "expandable_segments" and value is not None:
                expandable = value in ("True", "true")
                i += 3
            elif key == "max_split_size_mb" and value is not None:
                max_split = int(value) * MiB
                i += 3
            else:  # another key: skip its value (a bracketed list too)
                i += 1
                if i < len(tokens) and tokens[i] == ":":
                    i += 1
                    if i < len(tokens) and tokens[i] == "[":
                        while i < len(tokens) and tokens[i] != "]":
                            i += 1
                    i += 1
            while i < len(tokens) and tokens[i] == ",":
                i += 1
        return cls(tuple(divisions), expandable, max_split)

    def divisions(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size): the interval of floor(log2(size)),
        1 MiB and below in the first, 32 GiB and above in the last."""
        log_size = size.bit_length() - 1
        index = max(0, log_size - 20)
        return self.roundup_power2_divisions[min(index, _INTERVALS - 1)]


def _parse_division_list(tokens: list[str], i: int, divisions: list[int]) -> int:
    """`[256:1,512:2,>:8]`: boundaries in MiB (powers of two), each value from that boundary's interval,
    the first value also below it, `>` for every interval after the last boundary. Returns the index after `]`."""
    first, last = True, 0
    while i < len(tokens) and tokens[i] != "]":
        if tokens[i] == ",":
            i += 1
            continue
        boundary, value = tokens[i], int(tokens[i + 2])
        if boundary == ">":
            divisions[last + 1:] = [value] * (len(divisions) - last - 1)
        else:
            index = min(int(boundary).bit_length() - 1, len(divisions) - 1)
            if first:
                divisions[:index] = [value] * index
                first = False
            divisions[index] = value
            last = index
        i += 3
    return i + 1


DEFAULT_CONFIG = AllocatorConfig()

DEFAULT_MODE_NOTE = (
    "CUDA caching allocator in its default mode: a block served from a cached block up to 1 MiB larger counts "
    "whole, as the allocator's history decides, so the measured peak can exceed this prediction by about 0.05% "
    "(11-15 MiB at 9-37 GiB on an H200); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True makes them equal "
    "(and avoids the fragmentation that can make a budget near the device's memory run out)")


def default_mode_note(config: AllocatorConfig) -> str | None:
    """What a CUDA plan with a budget says of the allocator's mode: `DEFAULT_MODE_NOTE` unless every block is
    split to its rounded size (expandable segments), where the prediction is what the allocator counts."""
    return None if config.expandable_segments else DEFAULT_MODE_NOTE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size <= 4 or divisions <= 1 or size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(n: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """The block size a request of n > 0 bytes asks for (`DeviceCachingAllocator::round_size`)."""
    if n < MIN_BLOCK:
        return MIN_BLOCK
    d = config.divisions(n)
    if d > 1 and n > MIN_BLOCK * d:
        return _roundup_power2_next_division(n, d)
    return -(-n // MIN_BLOCK) * MIN_BLOCK


def allocated_bytes(n: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """What `allocated_bytes` (torch.cuda.memory_allocated) grows by for a request of n bytes: 0 for 0;
    the rounded size, or the whole new segment when it is not split (see the module docstring)."""
    if n <= 0:
        return 0
    size = round_size(n, config)
    if size <= SMALL_SIZE or config.expandable_segments:
        return size
    segment = LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // ROUND_LARGE) * ROUND_LARGE
    splits = (config.max_split_size is None or size < config.max_split_size) and segment - size > SMALL_SIZE
    return size if splits else segment


def _env_flag(environ: Mapping[str, str], name: str) -> bool | None:
    """c10::utils::check_env: "1" True, "0" False, anything else (or unset) None."""
    return {"1": True, "0": False}.get(environ.get(name, ""))


def cublas_workspace_bytes(capability: tuple[int, int], environ: Mapping[str, str] | None = None) -> int:
    """`getChosenWorkspaceSize()` (CublasHandlePool.cpp, parseChosenWorkspaceSize) on a GPU of this
    compute capability: CUBLAS_WORKSPACE_CONFIG's `:SIZE:COUNT` pairs (KiB) summed, else 32 MiB on
    sm90 and 4096 KiB * 2 + 16 KiB * 8 elsewhere (also when the variable does not parse)."""
    environ = os.environ if environ is None else environ
    default = 4096 * KiB * 8 if tuple(capability) == (9, 0) else 4096 * KiB * 2 + 16 * KiB * 8
    pairs = re.findall(r":([0-9]+):([0-9]+)", environ.get("CUBLAS_WORKSPACE_CONFIG") or "")
    return sum(int(size) * KiB * int(count) for size, count in pairs) if pairs else default


def cublaslt_workspace_bytes(capability: tuple[int, int], environ: Mapping[str, str] | None = None) -> int:
    """The cuBLASLt workspace's own allocation (`getCUDABlasLtWorkspace`, `getCUDABlasLtWorkspaceSize`):
    0 with TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 (it uses the cuBLAS workspace); else CUBLASLT_WORKSPACE_SIZE
    KiB (1024 by default), capped at the cuBLAS workspace unless that variable is 0."""
    environ = os.environ if environ is None else environ
    unified = _env_flag(environ, "TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if unified is True:
        return 0
    match = re.match(r"\s*\+?([0-9]+)", environ.get("CUBLASLT_WORKSPACE_SIZE") or "")
    size = int(match.group(1)) * KiB if match else 1024 * KiB
    return size if unified is False else min(size, cublas_workspace_bytes(capability, environ))


@dataclass(frozen=True)
class PersistentAllocation:
    """Device memory a step allocates through the caching allocator that no graph value holds."""

    name: str
    bytes: int  # as allocated_bytes counts it
    appears: str  # when it is allocated (it is never freed)


@dataclass(frozen=True)
class ThreadUse:
    """What one host thread of the step calls: cuBLAS at all, and the cuBLASLt path."""

    cublas: bool = False
    cublaslt: bool = False


def persistent_allocations(
    capability: tuple[int, int], threads: Mapping[str, ThreadUse], *, environ: Mapping[str, str] | None = None,
    config: AllocatorConfig = DEFAULT_CONFIG,
) -> list[PersistentAllocation]:
    """The cuBLAS (and cuBLASLt) workspaces of the step's threads, by thread name ("forward": the caller's
    thread; "backward": the autograd engine's device thread), on a GPU of this compute capability."""
    environ = os.environ if environ is None else environ
    out = []
    for thread, use in threads.items():
        if not (use.cublas or use.cublaslt):
            continue
        n = cublas_workspace_bytes(capability, environ)
        if n:
            out.append(PersistentAllocation(f"cublas_workspace.{thread}", allocated_bytes(n, config),
                                            f"the first cuBLAS call of the {thread} thread, kept for the process's life"))
        lt = cublaslt_workspace_bytes(capability, environ) if use.cublaslt else 0
        if lt:
            out.append(PersistentAllocation(f"cublaslt_workspace.{thread}", allocated_bytes(lt, config),
                                            f"the first cuBLASLt call of the {thread} thread, kept for the process's life"))
    return out


def addmm_uses_cublaslt(environ: Mapping[str, str] | None = None) -> bool:
    """addmm with a 1-D bias takes the cuBLASLt path unless DISABLE_ADDMM_CUDA_LT=1 (Blas.cpp)."""
    return _env_flag(os.environ if environ is None else environ, "DISABLE_ADDMM_CUDA_LT") is not True
