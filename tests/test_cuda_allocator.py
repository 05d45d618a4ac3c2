"""The CUDA memory contract (issue 23): problems for a CUDA target count what the caching allocator counts.

The rules (optsched/costs/cuda_allocator.py) are checked against hand-computed cases; problems built for
the h100 profile from captured graphs are checked against the same graphs' CPU problems, which must not
change. The one check that needs the GPU compares a plan's predicted peak with max_memory_allocated."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import optsched
from optsched.capture.joint_graph import build_joint_graph
from optsched.compiler.offline import plan_offline
from optsched.costs.cuda_allocator import (
    AllocatorConfig, allocated_bytes, cublas_workspace_bytes, cublaslt_workspace_bytes, round_size,
)
from optsched.costs.problem_builder import CudaMemory, build_problem
from optsched.costs.profiles import get_profile
from optsched.solvers import TensorKind

KiB, MiB = 1024, 2**20
H100, CPU = get_profile("h100"), get_profile("cpu")
_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE", "DISABLE_ADDMM_CUDA_LT", "TORCH_BLAS_PREFER_CUBLASLT")


@pytest.fixture
def default_env(monkeypatch):
    """The allocator's and cuBLAS's defaults, whatever this shell sets."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- what one request counts


@pytest.mark.parametrize("n, counted", [
    (0, 0),  # no allocation at all
    (1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024),
    (MiB, MiB),  # the largest small-pool request
    (MiB + 1, MiB + 512),  # large pool: a new 20 MiB segment, split
    (10 * MiB - 1, 10 * MiB),
    (10 * MiB, 10 * MiB),  # a 10 MiB segment, nothing left to split
    (14 * MiB + 1, 14 * MiB + 512),  # a 16 MiB segment: 2 MiB - 512 left, more than 1 MiB: split
    (15 * MiB - 512, 15 * MiB - 512),  # 1 MiB + 512 left: split
    (15 * MiB, 16 * MiB),  # exactly 1 MiB left: not split, the whole segment counts
    (16 * MiB - 1, 16 * MiB),
    (32 * MiB, 32 * MiB),
])
def test_allocated_bytes_by_hand(n, counted):
    assert allocated_bytes(n) == counted
    if n:
        assert round_size(n) == max(512, -(-n // 512) * 512)


def test_expandable_segments_split_every_block():
    cfg = AllocatorConfig.parse("expandable_segments:True")
    assert cfg.expandable_segments
    assert allocated_bytes(15 * MiB, cfg) == 15 * MiB
    assert allocated_bytes(3, cfg) == 512


def test_max_split_size_keeps_large_blocks_whole():
    cfg = AllocatorConfig.parse("max_split_size_mb:20")
    assert cfg.max_split_size == 20 * MiB
    assert allocated_bytes(21 * MiB + 1, cfg) == 22 * MiB  # not split: its 2 MiB-rounded segment
    assert allocated_bytes(12 * MiB, cfg) == 12 * MiB  # below the limit: split as usual


def test_roundup_power2_divisions_change_the_counted_size():
    one = AllocatorConfig.parse("roundup_power2_divisions:4")
    # 1.1 MiB: four steps between 1 and 2 MiB, the next is 1.25 MiB (512-rounding would give 1153536)
    assert round_size(1153434, one) == 1310720 == allocated_bytes(1153434, one)
    assert round_size(1153434) == 1153536
    assert round_size(2000, one) == 2048  # not above 512 * 4: plain 512-byte rounding
    listed = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert [listed.divisions(s) for s in (MiB, 300 * MiB, 600 * MiB, 1536 * MiB, 3 * 2**30, 100 * 2**30)] == [
        1, 1, 2, 4, 8, 8]


def test_allocator_config_from_env():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert AllocatorConfig.from_env(env).expandable_segments
    env["PYTORCH_ALLOC_CONF"] = "backend:native,garbage_collection_threshold:0.6,max_split_size_mb:64"
    cfg = AllocatorConfig.from_env(env)  # the newer variable wins; other keys are skipped
    assert not cfg.expandable_segments and cfg.max_split_size == 64 * MiB
    assert AllocatorConfig.from_env({}) == AllocatorConfig()


# ----------------------------------------------------------------------------- workspaces


def test_cublas_workspace_sizes():
    assert cublas_workspace_bytes((9, 0), {}) == 32 * MiB  # Hopper: :4096:8
    assert cublas_workspace_bytes((8, 0), {}) == 4096 * KiB * 2 + 16 * KiB * 8  # :4096:2:16:8
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * KiB
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "nonsense"}) == 32 * MiB
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}) == 0


def test_cublaslt_workspace_sizes():
    assert cublaslt_workspace_bytes((9, 0), {}) == MiB
    assert cublaslt_workspace_bytes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0  # shares cuBLAS's
    big = {"CUBLASLT_WORKSPACE_SIZE": str(64 * 1024)}
    assert cublaslt_workspace_bytes((9, 0), big) == 32 * MiB  # capped at the cuBLAS workspace
    assert cublaslt_workspace_bytes((9, 0), {**big, "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == 64 * MiB


# ----------------------------------------------------------------------------- problems for a CUDA target


class _MLP(nn.Module):
    """Linear layers with biases (addmm: the cuBLASLt path), sizes that are not multiples of 512 bytes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 33)
        self.b = nn.Linear(33, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


def _inputs():
    return (torch.randn(10, 7),)


def test_h100_problem_counts_blocks_and_workspaces(default_env):
    cpu = plan_offline(_MLP, _inputs, None, device_profile="cpu", time_limit_s=1).problem
    gpu = plan_offline(_MLP, _inputs, None, device_profile="h100", time_limit_s=1).problem
    assert any(t.bytes % 512 for t in cpu.tensors)  # the CPU problem is not rounded
    assert not any("workspace" in t.name for t in cpu.tensors)
    by_name = {t.name: t for t in gpu.tensors}
    for t in cpu.tensors:  # the same graph: every storage takes its allocator blocks
        g = by_name[t.name]
        assert g.bytes == allocated_bytes(t.bytes) and g.bytes % 512 == 0 and g.bytes >= t.bytes, t.name
    workspaces = {t.name: t.bytes for t in gpu.tensors if "workspace" in t.name}
    assert workspaces == {"cublas_workspace.forward": 32 * MiB, "cublaslt_workspace.forward": MiB,
                          "cublas_workspace.backward": 32 * MiB, "cublaslt_workspace.backward": MiB}
    assert all(by_name[n].kind is TensorKind.INPUT and not by_name[n].offloadable for n in workspaces)
    assert [o.name for o in gpu.ops] == [o.name for o in cpu.ops]


def test_a100_workspace_and_allocator_settings(monkeypatch, default_env):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:1")
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    gpu = plan_offline(_MLP, _inputs, None, device_profile="a100", time_limit_s=1).problem
    assert {t.name: t.bytes for t in gpu.tensors if "workspace" in t.name} == {
        "cublas_workspace.forward": 4 * MiB, "cublas_workspace.backward": 4 * MiB}


def _joint(fn, *args):
    """The joint forward+backward graph AOTAutograd traces for fn."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._functorch.partitioners import default_partition

    got = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
        got["jg"] = build_joint_graph(joint, num_fwd_outputs)
        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    def compiler(gm, _inputs):
        return make_boxed_func(gm)

    aot_function(fn, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition)(*args)
    return got["jg"]


def test_cpu_targets_are_unchanged(default_env):
    w = torch.randn(7, 3, requires_grad=True)
    jg = _joint(lambda x, w: (x @ w).tanh().sum(), torch.randn(5, 7), w)
    for device, profile in (("cpu", CPU), ("cpu", H100), (None, H100), ("meta", CPU)):
        assert CudaMemory.for_target(jg, profile, device) is None
        problem = build_problem(jg, profile, device=device).problem
        assert [t.bytes for t in problem.tensors] == [s.nbytes for s in jg.storages], (device, profile.name)
    cuda = build_problem(jg, H100, device="meta").problem  # an offline capture for the H100
    assert [t.bytes for t in cuda.tensors[:len(jg.storages)]] == [allocated_bytes(s.nbytes) for s in jg.storages]
    assert [t.name for t in cuda.tensors[len(jg.storages):]] == ["cublas_workspace.forward", "cublas_workspace.backward"]


def test_forward_only_program_has_one_workspace(default_env):
    gm = make_fx(lambda x, w: torch.relu(x @ w), tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
    problem = build_problem(build_joint_graph(gm, None), H100, device="meta").problem
    assert [t.name for t in problem.tensors if "workspace" in t.name] == ["cublas_workspace.forward"]


@pytest.mark.parametrize("dropout_p, seed_bytes", [(0.0, 512), (0.1, 0)])
def test_efficient_attention_seed_and_offset(dropout_p, seed_bytes):
    """Without dropout the kernel makes its philox seed and offset on the GPU (512 bytes each); with
    dropout on the host. Outputs nobody reads are the kernel's scratch during its step."""
    q, k, v = (torch.randn(2, 4, 64, 32) for _ in range(3))

    def all_outputs(q, k, v):
        return tuple(torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p))

    def output_only(q, k, v):
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p)[0]

    jg = build_joint_graph(make_fx(all_outputs, tracing_mode="fake")(q, k, v), None)
    problem = build_problem(jg, H100, device="meta").problem
    attention = next(n for n in jg.compute if "efficient" in str(n.target))
    lse, seed, offset = (jg.storage_of[g] for g in jg.getitems[attention][1:])
    assert problem.tensors[lse].bytes == 2 * 4 * 64 * 4  # logsumexp: rows padded to 32, float32
    assert problem.tensors[seed].bytes == problem.tensors[offset].bytes == seed_bytes
    assert problem.ops[0].workspace_bytes == 0

    gm = make_fx(output_only, tracing_mode="fake")(q, k, v)
    gm.graph.eliminate_dead_code()  # as AOTAutograd's graphs: no getitem for an output nobody reads
    jg = build_joint_graph(gm, None)
    (op,) = build_problem(jg, H100, device="meta").problem.ops
    assert op.workspace_bytes == 2 * 4 * 64 * 4 + 2 * seed_bytes
    assert build_problem(jg, CPU, device="cpu").problem.ops[0].workspace_bytes == 0


# ----------------------------------------------------------------------------- on the GPU


class _BiasMLP(nn.Module):
    def __init__(self, width: int = 2048, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return x.square().mean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the contract is max_memory_allocated")
def test_predicted_peak_is_what_the_caching_allocator_counts():
    """measured <= predicted <= 1.01 * measured, where measured is max_memory_allocated over one step from
    an allocator holding only the step's state (parameters, input, the cuBLAS workspaces the first steps made)."""
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()  # other tests' workspaces: this step's are counted from its own calls
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = _BiasMLP().cuda()
    x = torch.randn(4096, 2048, device="cuda")
    opt = optsched.optimize(model, None, example_inputs=(x,), time_limit_s=10)

    def step():
        for p in model.parameters():
            p.grad = None
        opt(x).backward()

    step()  # plans; the forward's and the backward's threads make their cuBLAS workspaces
    step()
    for p in model.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    predicted = opt.plan.predicted_peak_bytes
    assert measured <= predicted <= 1.01 * measured, (
        f"predicted {predicted} bytes, measured {measured} ({(predicted - measured) / measured:+.3%})")


def test_gpu_plans_name_the_allocators_default_mode(monkeypatch, default_env):
    """Measured on an H200, the default mode counted 11-15 MiB over the requested bytes (blocks served whole) and
    expandable segments none: a CUDA plan with a budget says which it assumes; CPU plans and no budget say nothing."""
    from optsched.costs.cuda_allocator import DEFAULT_MODE_NOTE

    def notes(profile, budget):
        return plan_offline(_MLP, _inputs, budget, device_profile=profile, time_limit_s=1).stats.notes

    assert DEFAULT_MODE_NOTE in notes("h100", "100%")
    assert DEFAULT_MODE_NOTE not in notes("h100", None)
    assert DEFAULT_MODE_NOTE not in notes("cpu", "100%")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert DEFAULT_MODE_NOTE not in notes("h100", "100%")
