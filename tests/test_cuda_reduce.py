"""The staging memory of PyTorch's CUDA reduction kernel (optsched/costs/cuda_reduce.py), and offline plans for GPU
profiles counting it as the op's scratch (issue 32: an offline H100 plan measured 35 MiB over its prediction)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from optsched.compiler.offline import plan_offline
from optsched.costs.cuda_allocator import allocated_bytes
from optsched.costs.cuda_reduce import ReduceScratch, reduce_scratch

MiB = 2**20


def _sum_rows(rows: int, cols: int, **kw) -> ReduceScratch:
    """A bias gradient: a [rows, cols] gradient summed over its rows, bf16, on an H100/H200 (132 SMs)."""
    return reduce_scratch((rows, cols), (cols, 1), [0], element_bytes=2, accumulator_bytes=4, multiprocessors=132, **kw)


@pytest.mark.parametrize("cols, staging, semaphores", [
    # allocations traced on an H200 (torch 2.11) in a GPT's backward: output, staging, semaphores per bias sum
    (2048, 64 * MiB, 64), (1536, 48 * MiB, 48), (512, 16 * MiB, 16),
])
def test_bias_gradient_sums_stage_what_the_h200_allocated(cols, staging, semaphores):
    assert _sum_rows(4096, cols) == ReduceScratch(staging, semaphores)


def test_reduced_dims_coalesce():
    """[8, 512, C] summed over its first two dims is the same reduction as [4096, C] over its first."""
    x = torch.empty(8, 512, 2048)
    got = reduce_scratch(x.shape, x.stride(), [0, 1], element_bytes=2, accumulator_bytes=4, multiprocessors=132)
    assert got == _sum_rows(4096, 2048)
    assert reduce_scratch(x.shape, x.stride(), [-3, -2], element_bytes=2, accumulator_bytes=4,
                          multiprocessors=132) == got


def test_small_and_row_reductions_stage_nothing():
    assert _sum_rows(64, 2048) == ReduceScratch(0, 0)  # too few values per thread to split across blocks
    rows = reduce_scratch((4096, 1000), (1000, 1), [1], element_bytes=4, accumulator_bytes=4, multiprocessors=132)
    assert rows == ReduceScratch(0, 0)  # each output's inputs are contiguous: a block per output, no staging


def test_a_full_reduction_stages_one_value_per_block():
    got = reduce_scratch((4096, 1000), (1000, 1), [], element_bytes=4, accumulator_bytes=4, multiprocessors=132)
    assert got.semaphore_bytes == 4 and 0 < got.staging_bytes <= 4 * 132 * 4  # one output, at most 4 blocks per SM


def test_misaligned_input_vectorizes_less_and_stages_differently():
    aligned, offset = _sum_rows(4096, 2048), _sum_rows(4096, 2048, storage_offset=1)
    assert offset.staging_bytes > 0 and offset != aligned


def test_more_multiprocessors_never_stage_less():
    a100 = reduce_scratch((65536, 64), (64, 1), [0], element_bytes=4, accumulator_bytes=4, multiprocessors=108)
    h100 = reduce_scratch((65536, 64), (64, 1), [0], element_bytes=4, accumulator_bytes=4, multiprocessors=132)
    assert 0 < a100.staging_bytes <= h100.staging_bytes


class _Biased(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 1024)
        self.out = nn.Linear(1024, 8)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x))).square().mean()


def _batch():
    return (torch.randn(8192, 256),)


def test_offline_gpu_plan_counts_the_bias_sums_staging():
    gpu = plan_offline(_Biased, _batch, None, device_profile="h100", time_limit_s=1).problem
    cpu = plan_offline(_Biased, _batch, None, device_profile="cpu", time_limit_s=1).problem
    sums = {o.name: o.workspace_bytes for o in gpu.ops if o.name.startswith("sum")}
    want = reduce_scratch((8192, 1024), (1024, 1), [0], element_bytes=4, accumulator_bytes=4, multiprocessors=132)
    assert want.staging_bytes > 8 * MiB  # a bias gradient of 1024 over 8192 rows
    assert allocated_bytes(want.staging_bytes) + allocated_bytes(want.semaphore_bytes) in sums.values(), sums
    assert all(o.workspace_bytes == 0 for o in cpu.ops if o.name.startswith("sum"))  # CPU kernels: no such staging
    a100 = plan_offline(_Biased, _batch, None, device_profile="a100", time_limit_s=1).problem
    assert max(o.workspace_bytes for o in a100.ops if o.name.startswith("sum")) <= max(sums.values())
