"""A plan made offline for a GPU replays there: the normalizations' statistics as CUDA makes them, and a plan
file's executor replacing the device's default one when the caller named none."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import optsched
from optsched.compiler.offline import default_dtype, plan_offline
from tests import models

ROWS, WIDTH = 4096, 64  # 4096 statistics per LayerNorm output: 16 KiB in float32, 8 KiB in bf16 (512-byte blocks)


class _Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.lin, self.bn = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)

    def forward(self, x):
        return self.bn(self.lin(self.ln(x))).float().pow(2).mean()


def _bf16_norms():
    with default_dtype(torch.bfloat16):
        return _Norms()


def _batch():
    return (torch.randn(ROWS, WIDTH, dtype=torch.bfloat16),)


def _outputs(plan, target: str) -> tuple[str, list[str]]:
    """The node of `target` in the plan's fingerprint: its name and output dtypes."""
    name, _target, _shape, dtype = next(sig for sig in plan.fingerprint["nodes"] if sig[1] == target)
    return name, dtype.split(";")


def _getitem_bytes(plan, node: str, index: int) -> int:
    """Bytes of output `index` of `node` (a getitem of it, by the graph's node names: getitem, getitem_1, ...)."""
    names = [sig[0] for sig in plan.fingerprint["nodes"]]
    getitems = [n for n in names[names.index(node) + 1:] if n.startswith("getitem")]
    return next(t.bytes for t in plan.problem.tensors if t.name == getitems[index])


def test_h100_plan_has_the_cuda_statistics_dtypes():
    """On CUDA, LayerNorm's mean and rstd and BatchNorm's saved mean and inverse std of bf16 input are float32
    (the CPU fake kernels give bf16): the offline H100 graph has them so, and its plan counts their 4 bytes."""
    h100 = plan_offline(_bf16_norms, _batch, None, device_profile="h100", offload=False, time_limit_s=2)
    ln, dtypes = _outputs(h100, "aten.native_layer_norm.default")
    assert dtypes == ["bfloat16", "float32", "float32"]
    assert _getitem_bytes(h100, ln, 1) == _getitem_bytes(h100, ln, 2) == 4 * ROWS
    _bn, dtypes = _outputs(h100, "aten._native_batch_norm_legit_functional.default")
    assert dtypes[:3] == ["bfloat16", "float32", "float32"]

    cpu = plan_offline(_bf16_norms, _batch, None, device_profile="cpu", offload=False, time_limit_s=2)
    ln, dtypes = _outputs(cpu, "aten.native_layer_norm.default")
    assert dtypes == ["bfloat16", "bfloat16", "bfloat16"]  # a CPU capture's, unchanged
    assert _getitem_bytes(cpu, ln, 1) == 2 * ROWS
    assert h100.baseline.peak_bytes > cpu.baseline.peak_bytes


def test_eval_batch_norm_saves_the_running_statistics_on_cuda():
    """In eval mode the CPU kernel saves empty statistics, the CUDA one the running ones (C float32 each)."""
    def frozen():
        with default_dtype(torch.bfloat16):
            return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)).eval().requires_grad_(False)

    plan = plan_offline(frozen, _batch, None, device_profile="h100", offload=False, time_limit_s=2)
    target = "aten._native_batch_norm_legit_no_training.default"
    shape = next(sig[2] for sig in plan.fingerprint["nodes"] if sig[1] == target)
    assert shape.split(";")[1:] == [str(WIDTH), str(WIDTH)]
    assert _outputs(plan, target)[1][1:] == ["float32", "float32"]


def _mlp_plan_file(tmp_path, executor: str, profile: str):
    path = tmp_path / f"{executor}.json"
    plan_offline(lambda: models.mlp()[0], lambda: models.mlp()[1], None, device_profile=profile, executor=executor,
                 offload=False, time_limit_s=2).save(path)
    return path


def test_plan_file_executor_replaces_the_default_one(tmp_path):
    """A plan made with one executor, loaded where the default is another (here: an Inductor plan, eager this CPU's
    default; on a GPU: plan_offline's eager, Inductor or nvFuser the default), is replayed with the file's executor
    when the caller named none; an executor the caller names, or one that cannot run here, is still refused."""
    path = _mlp_plan_file(tmp_path, "inductor", "cpu")
    model, inputs = models.mlp()
    opt = optsched.optimize(model, None, example_inputs=inputs, device_profile="cpu", offload=False, plan=path)
    assert any("loaded from" in n for n in opt.plan.stats.notes)
    assert opt.plan.executor == "inductor" and opt.plan.fusion_groups
    loss = opt(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(*inputs).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)

    with pytest.raises(optsched.PlanMismatchError, match="executor: the plan has 'inductor', this run wants 'eager'"):
        optsched.optimize(models.mlp()[0], None, example_inputs=inputs, device_profile="cpu", offload=False,
                          executor="eager", plan=path)

    path = _mlp_plan_file(tmp_path, "nvfuser", "h100")  # nvFuser runs on CUDA only
    with pytest.raises(optsched.PlanMismatchError, match="executor: the plan has 'nvfuser', this run wants 'eager'"):
        optsched.optimize(models.mlp()[0], None, example_inputs=inputs, device_profile="h100", offload=False,
                          plan=path)
