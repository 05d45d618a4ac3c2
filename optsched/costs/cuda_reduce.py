"""The scratch PyTorch's CUDA reduction kernel allocates through the caching allocator (issue 32).

A reduction split across thread blocks (`ReduceConfig::should_global_reduce`) stages each block's partial
results in global memory and counts finished blocks with semaphores: `gpu_reduce_kernel` allocates
`global_memory_size()` and `semaphore_size()` bytes from the caching allocator for the kernel's life, after
the output. No graph shows them, and they can be large: a bias gradient (a [4096, 2048] bf16 gradient
summed over its rows) stages 64 MiB. On a GPU op memory is measured, which sees them; an offline plan for
a GPU profile predicts them here. Measured on an H200 (torch 2.11): [4096, 2048] -> 64 MiB + 64 B and
[4096, 1536] -> 48 MiB + 48 B, as computed below.

Plain arithmetic, no torch. The rules are `setReduceConfig`, `ReduceConfig::set_block_dimension`,
`global_memory_size` and `semaphore_size` (aten/src/ATen/native/cuda/Reduce.cuh, read for torch 2.11-2.13),
with TensorIterator's layout of a reduction: size-1 dims dropped, reduced dims first, each group ordered by
the input's strides (fastest first), adjacent dims coalesced where their strides chain.

Not modeled: a reduction needing 64-bit indexing (2^31 elements or more), which the kernel splits into
sub-reductions each with its own staging; ROCm's constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ReduceScratch", "reduce_scratch"]

MAX_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double only)
WARP = 32
VEC = 4  # ReduceConfig::input_vec_size and the largest output vector
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256


@dataclass(frozen=True)
class ReduceScratch:
    """The kernel's global staging buffer and its semaphores, in bytes (0, 0: not split across blocks)."""

    staging_bytes: int
    semaphore_bytes: int


def _last_pow2(n: int) -> int:
    """floor to a power of two, at least 1 (Reduce.cuh's last_pow2)."""
    return max(1, 1 << (max(int(n), 1).bit_length() - 1))


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _layout(shape: Sequence[int], strides: Sequence[int], dims: set[int]) -> tuple[list[int], list[int], int]:
    """TensorIterator's dims of a reduction of a tensor (shape, strides in elements) over `dims`: sizes and input
    strides, reduced dims first, then the kept ones, each fastest first, coalesced; and how many are reduced."""
    reduced = sorted((strides[d], shape[d]) for d in dims if shape[d] != 1)
    kept = sorted((strides[d], shape[d]) for d in range(len(shape)) if d not in dims and shape[d] != 1)

    def coalesce(group: list[tuple[int, int]]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for stride, size in group:
            if out and out[-1][0] * out[-1][1] == stride:
                out[-1] = (out[-1][0], out[-1][1] * size)
            else:
                out.append((stride, size))
        return out

    r, k = coalesce(reduced), coalesce(kept)
    return [s for _, s in r + k], [st for st, _ in r + k], len(r)


def _output_vec_size(strides: list[int], shape: list[int], n_reduced: int, offset: int) -> int:
    """get_output_vec_size: 4, halved until the input's address (its storage offset, the block being 512-byte
    aligned), the first kept dim's size and every other dim's stride divide it."""
    vec = VEC
    for n in [offset, shape[n_reduced], *(st for i, st in enumerate(strides) if i != n_reduced)]:
        while n % vec:
            vec //= 2
    return vec


def reduce_scratch(shape: Sequence[int], strides: Sequence[int], dims: Sequence[int], *, element_bytes: int,
                   accumulator_bytes: int, multiprocessors: int, threads_per_multiprocessor: int = 2048,
                   storage_offset: int = 0) -> ReduceScratch:
    """What `gpu_reduce_kernel` allocates beside its output for reducing a tensor (shape, strides in elements)
    over `dims` (all of them when empty), accumulating in `accumulator_bytes` (4 for sums and means of 16- and
    32-bit floats), on a GPU with `multiprocessors` SMs."""
    numel = 1
    for s in shape:
        numel *= int(s)
    if numel == 0 or numel >= 2**31:
        return ReduceScratch(0, 0)
    all_dims = set(range(len(shape))) if not dims else {d % len(shape) for d in dims} if shape else set()
    sizes, steps, n_reduced = _layout([int(s) for s in shape], [int(s) for s in strides], all_dims)
    inputs_per_output = 1
    for s in sizes[:n_reduced]:
        inputs_per_output *= s
    num_outputs = numel // inputs_per_output
    ndim = len(sizes)
    if ndim == 0:
        fastest_reduced, dim0, dim1, fastest_stride = True, 1, 1, 1
    else:
        fastest_reduced = n_reduced == ndim or steps[0] < steps[n_reduced]
        dim0, dim1 = (inputs_per_output, num_outputs) if fastest_reduced else (num_outputs, inputs_per_output)
        fastest_stride = steps[0] if fastest_reduced else steps[n_reduced]
    output_vec = 1
    if fastest_stride == 1:
        if fastest_reduced and dim0 >= 128 and n_reduced == 1:
            dim0 //= VEC  # vectorize along the input
        elif not fastest_reduced:
            output_vec = _output_vec_size(steps, sizes, n_reduced, storage_offset)
            dim0 //= output_vec
    # set_block_dimension
    max_threads = MAX_THREADS // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    threads = width * height
    step_input = step_output = 1
    block_x_reduce = ndim == 0 or fastest_reduced
    if block_x_reduce:
        step_input *= width
    else:
        step_output *= width
    values_per_thread = _div_up(inputs_per_output, step_input)
    split_warps = values_per_thread >= min(height * 16, MAX_VALUES_PER_THREAD)
    if split_warps:
        step_input *= height
    else:
        step_output *= height
    grid_x = _div_up(num_outputs // output_vec, step_output)
    target_grid = multiprocessors * (threads_per_multiprocessor // threads)
    values_per_thread = _div_up(inputs_per_output, step_input)
    if not (split_warps and values_per_thread >= MAX_VALUES_PER_THREAD and grid_x <= target_grid):
        return ReduceScratch(0, 0)
    ctas = max(min(_div_up(target_grid, grid_x), _div_up(values_per_thread, MIN_VALUES_PER_THREAD)),
               _div_up(values_per_thread, MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return ReduceScratch(0, 0)
    staging = accumulator_bytes * num_outputs * ctas
    if not block_x_reduce:
        staging *= width * output_vec
    return ReduceScratch(staging, 4 * grid_x)
