"""The normalizations' outputs as a CUDA capture records them, in an offline capture made with CPU fake tensors.

Some fake kernels branch on the device: a CPU capture and a CUDA capture of the same step differ in
the dtype (or shape) of the statistics these ops save for their backward. On the GPU, Dynamo's fake
CUDA tensors take the non-CPU branch, as the CUDA kernels allocate; the offline capture's CPU fake
tensors take the CPU one, so its plan would not match the GPU's graph (fingerprint) and would count
half the statistics' bytes. Sources (torch 2.13):

- `native_layer_norm` (torch/_refs/__init__.py): mean and rstd are cast to the input dtype only
  `if input.device.type in ["cpu", "mtia"]`; otherwise they stay in the computation dtype, float32
  for fp16/bf16 input, as CUDA's `layer_norm_cuda` allocates them (acc_type, layer_norm_kernel.cu).
- the batch norms (torch/_decomp/decompositions.py, `native_batch_norm_helper`, behind every
  variant below): save_mean and save_rstd are cast to the input dtype `if input.device.type == "cpu"`
  (CUDA's `batch_norm_cuda`, Normalization.cu: the accumulate type); in eval mode the CPU returns
  them empty, other devices return the running statistics (C elements).

Not here, because both devices agree: `native_group_norm` (its statistics take
`param_scalar_type`, group_norm.cpp, on either device) and the backward ops (their outputs take the
input's and weight's dtypes, whatever the statistics' dtype).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch import extract_tensor_metadata

__all__ = ["as_captured_on_cuda"]

_aten = torch.ops.aten
_DEVICE_BRANCHING = {
    _aten.native_layer_norm, _aten.native_batch_norm, _aten._native_batch_norm_legit,
    _aten._native_batch_norm_legit_functional, _aten._native_batch_norm_legit_no_training,
    _aten._batch_norm_with_update, _aten._batch_norm_with_update_functional, _aten._batch_norm_no_update,
}


def _on_meta(a):
    v = a.meta.get("val") if isinstance(a, fx.Node) else a
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def _like(fake: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """A fake tensor of `fake`'s mode and device with `meta`'s shape, strides and dtype."""
    if (fake.shape, fake.stride(), fake.dtype) == (meta.shape, meta.stride(), meta.dtype):
        return fake
    with fake.fake_mode:
        return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=fake.device)


def _set_val(node: fx.Node, val) -> None:
    node.meta["val"] = val
    if "tensor_meta" in node.meta and isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = extract_tensor_metadata(val)


def as_captured_on_cuda(gm: fx.GraphModule) -> int:
    """Give the device-branching ops of `gm` (captured with CPU fake tensors) the outputs their fake kernels
    give on a CUDA device: each is run again on meta tensors, which take the same non-CPU branch. Their
    getitem users get the new values too; their other readers (the backward ops) are unaffected (see the
    module docstring). Returns how many nodes changed."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in _DEVICE_BRANCHING:
            continue
        old = node.meta.get("val")
        if not isinstance(old, (tuple, list)):
            continue
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), _on_meta)
        new = tuple(_like(f, m) if isinstance(f, torch.Tensor) else f for f, m in zip(old, node.target(*args, **kwargs)))
        if all(a is b for a, b in zip(old, new)):
            continue
        _set_val(node, new)
        for user in node.users:
            if user.target is operator.getitem and isinstance(user.args[1], int):
                _set_val(user, new[user.args[1]])
        changed += 1
    return changed
