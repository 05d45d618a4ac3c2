"""Which fused attention kernel PyTorch's SDPA picks on a given GPU, and a torch function mode that
calls it during an offline capture.

A CPU-only machine capturing for a CUDA profile would otherwise record the CPU flash kernel, so
its plan could never match the graph the GPU captures. What the GPU picks is a prediction from
PyTorch's dispatch rules (sdp_utils): see `predict_sdpa_backend`.
"""

from __future__ import annotations

import math
import os

import torch
from torch.overrides import TorchFunctionMode

from .profiles import DeviceProfile, compute_capability

__all__ = ["CudaAttention", "host_outputs", "predict_sdpa_backend"]


_SDPA = torch.nn.functional.scaled_dot_product_attention
_HALF = (torch.float16, torch.bfloat16)


# Memory-efficient attention with dropout returns its philox seed and offset (outputs 2 and 3) as host
# tensors (mem_eff attention.cu, `_efficient_attention_forward`: at::scalar_tensor(..., at::dtype(at::kLong))
# outside CUDA-graph capture). The fake kernels (torch/_meta_registrations.py) make them on the inputs'
# device, so the graph shows them on the GPU. Every other seed/offset output is a GPU tensor:
# flash attention's rng_state (2 x uint64) and its unused offset, cuDNN attention's seed and offset,
# memory-efficient attention's without dropout (at::empty({}, ..., device)).
_HOST_SEED_OFFSET = {"_scaled_dot_product_efficient_attention": (2, 3), "_efficient_attention_forward": (2, 3)}


def host_outputs(op_name: str, dropout_p: float) -> tuple[int, ...]:
    """Which outputs of the attention op `op_name` (an aten overload packet name) its CUDA kernel returns
    as host tensors, though the captured graph shows them on the device: none but memory-efficient
    attention's philox seed and offset with dropout (see `_HOST_SEED_OFFSET`). They take no GPU memory."""
    return _HOST_SEED_OFFSET.get(op_name, ()) if dropout_p > 0.0 else ()


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on", "y")


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa)


def predict_sdpa_backend(profile: DeviceProfile, q, k, v, attn_mask=None, dropout_p: float = 0.0,
                         is_causal: bool = False, enable_gqa: bool = False) -> str | None:
    """The kernel `scaled_dot_product_attention` is predicted to run on `profile`'s GPU:
    "cudnn", "flash", "efficient", "math", or None (not predicted: the call is left as it is).

    A prediction, not a query: PyTorch decides at run time (aten/src/ATen/native/transformers/
    cuda/sdp_utils.cpp, `select_sdp_backend`) from the device, the cuDNN version and global flags.
    The rules kept here, in PyTorch's priority order:

    ============ ==================================================================================
    order        sm90 (h100, h200): cudnn, flash, efficient, math. Other CUDA profiles (a100):
                 flash, efficient, math. (sm90 puts cuDNN first when the bundled cuDNN is newer than
                 9.15, as in the wheels of torch >= 2.11, unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1.)
    all fused    4-D q, k, v; same batch and heads; non-empty sequences; last-dim stride 1 (mask too)
    cudnn        fp16/bf16; mask 2-D or 4-D (broadcastable) without grad; dropout a multiple of 1/16;
                 batch, heads <= 65535; head dims <= 128 and multiples of 8 (up to 256 needs a newer
                 cuDNN than assumed here); key length != 1; not deterministic-only mode
    flash        fp16/bf16; no mask; equal head dims <= 256 (padded to a multiple of 8); causal only
                 with as many queries as keys
    efficient    fp16/bf16/fp32; q, k head dims equal; head dims and storage offsets multiples of 8
                 (fp16/bf16) or 4 (fp32)
    math         the composite `_scaled_dot_product_attention_math` (matmuls, softmax)
    ============ ==================================================================================

    A backend turned off here (torch.backends.cuda.enable_*_sdp, torch.nn.attention.sdpa_kernel) is
    skipped, as the GPU process skips it when it turns the same one off. None for nested tensors and
    for grouped-query attention with fewer key/value heads (enable_gqa), which are not predicted.
    """
    if not all(isinstance(t, torch.Tensor) and not t.is_nested for t in (q, k, v)):
        return None
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        return None
    if enable_gqa and not (q.dim() >= 3 and q.size(-3) == k.size(-3) == v.size(-3)):
        return None
    enabled = _enabled_backends()
    fused = _fused_shapes(q, k, v, attn_mask)
    fits = {
        "cudnn": lambda: _cudnn_fits(q, k, v, attn_mask, dropout_p),
        "flash": lambda: _flash_fits(q, k, v, attn_mask, is_causal),
        "efficient": lambda: _efficient_fits(q, k, v),
        "math": lambda: True,
    }
    for name in _backend_order(profile):
        if enabled[name] and (name == "math" or fused) and fits[name]():
            return name
    return None


def _backend_order(profile: DeviceProfile) -> tuple[str, ...]:
    """PyTorch's priority order on the profile's GPU (see `predict_sdpa_backend`)."""
    sm = compute_capability(profile)
    cudnn_first = sm[0] in (9, 10) and not _env_true("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    return ("cudnn", "flash", "efficient", "math") if cudnn_first else ("flash", "efficient", "math", "cudnn")


def _enabled_backends() -> dict[str, bool]:
    """The backends this process has not turned off (torch.backends.cuda.enable_*_sdp, sdpa_kernel)."""
    return {
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled(),
    }


def _fused_shapes(q, k, v, attn_mask) -> bool:
    """What every fused kernel needs: 4-D q, k, v with the same batch and heads, non-empty sequences, and a
    mask whose last dim has stride 1."""
    return (
        all(t.dim() == 4 for t in (q, k, v))
        and q.size(0) == k.size(0) == v.size(0) and q.size(1) == k.size(1) == v.size(1)
        and q.size(2) > 0 and k.size(2) > 0
        and (attn_mask is None or attn_mask.stride(-1) == 1)
    )


def _last_dim_stride_1(q, k, v, or_singleton: bool) -> bool:
    return all(t.stride(-1) == 1 for t in (q, k, v)) or (or_singleton and q.size(-1) == 1)


def _cudnn_fits(q, k, v, attn_mask, dropout_p: float) -> bool:
    if not (_last_dim_stride_1(q, k, v, or_singleton=True) and q.dtype in _HALF):
        return False
    if attn_mask is not None:
        m = attn_mask
        if m.requires_grad or m.size(-2) not in (q.size(2), 1) or m.size(-1) not in (k.size(2), 1):
            return False
        if not (m.dim() == 2 or (m.dim() == 4 and m.size(0) in (1, q.size(0)) and m.size(1) in (1, q.size(1)))):
            return False
    if dropout_p * 16 != math.floor(dropout_p * 16):
        return False
    if q.size(0) > 65535 or q.size(1) > 65535:
        return False
    d_qk, d_v = q.size(3), v.size(3)
    if d_qk > 128 or d_v > 128 or d_qk % 8 or d_v % 8:
        return False
    if k.size(2) == 1 or (dropout_p != 0.0 and q.size(2) == 1):
        return False
    return not (torch.are_deterministic_algorithms_enabled()
                and not torch.is_deterministic_algorithms_warn_only_enabled())


def _flash_fits(q, k, v, attn_mask, is_causal: bool) -> bool:
    return (_last_dim_stride_1(q, k, v, or_singleton=True) and q.dtype in _HALF and attn_mask is None
            and q.size(-1) == k.size(-1) == v.size(-1) <= 256
            and not (is_causal and q.size(2) != k.size(2)))


def _efficient_fits(q, k, v) -> bool:
    if not (_last_dim_stride_1(q, k, v, or_singleton=False) and q.dtype in (*_HALF, torch.float32)):
        return False
    align = 8 if q.dtype in _HALF else 4  # minimum_gemm_alignment on sm80+ (tensor cores)
    return (q.size(-1) == k.size(-1) and q.size(-1) % align == 0 and v.size(-1) % align == 0
            and all(t.storage_offset() % align == 0 for t in (q, k, v)))


def _bool_mask_to_additive(mask, dtype, fill: float, on_mask_device: bool):
    """convert_boolean_attn_mask (fill -inf) and its cuDNN variant (fill -65504, a CPU zero) in attention.cpp."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device) if on_mask_device else torch.scalar_tensor(0.0, dtype=dtype)
    return torch.where(mask.logical_not(), fill, zero)


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    size = t.size(-1)
    return t if size % alignment == 0 else torch.ops.aten.pad(t, [0, alignment - size % alignment])


def _cuda_sdpa(profile: DeviceProfile, *args, **kwargs):
    """`scaled_dot_product_attention` as its CUDA composite (attention.cpp) calls the predicted kernel,
    or NotImplemented when no kernel is predicted."""
    q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(*args, **kwargs)
    backend = predict_sdpa_backend(profile, q, k, v, mask, dropout_p, is_causal, enable_gqa)
    aten = torch.ops.aten
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))  # should_compute_logsumexp
    if backend == "cudnn":
        mask = _bool_mask_to_additive(mask, q.dtype, -65504.0, on_mask_device=False)
        return aten._scaled_dot_product_cudnn_attention(q, k, v, mask, lse, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "flash":
        head_dim = q.size(-1)
        og_scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)  # sdp::calculate_scale
        out = aten._scaled_dot_product_flash_attention(
            _pad_last_dim(q, 8), _pad_last_dim(k, 8), _pad_last_dim(v, 8), dropout_p, is_causal, False, scale=og_scale,
        )[0]
        return out if out.size(-1) == head_dim else aten.slice(out, -1, 0, head_dim)
    if backend == "efficient":
        mask = _bool_mask_to_additive(mask, q.dtype, -math.inf, on_mask_device=True)
        if mask is not None:  # preprocess_mask: the mask's rows aligned to 8 elements, expanded to (B, H, L, S)
            aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
            if not aligned:
                size = mask.size(-1)
                mask = aten.slice(aten.pad(mask, [0, 8 - size % 8]), -1, 0, size)
            mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, dropout_p, is_causal, scale=scale)[0]
    if backend == "math":
        mask = _bool_mask_to_additive(mask, q.dtype, -math.inf, on_mask_device=True)
        return aten._scaled_dot_product_attention_math(
            q, k, v, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa,
        )[0]
    return NotImplemented


class CudaAttention(TorchFunctionMode):
    """Active during an offline capture for a CUDA profile: `F.scaled_dot_product_attention` calls the
    fused kernel the profile's GPU is predicted to pick (`predict_sdpa_backend`), as SDPA's CUDA
    composite does, instead of the CPU flash kernel the fake CPU tensors would select. The graph
    then has the CUDA capture's attention ops (their FLOP formulas included).

    A torch function mode does not see calls made inside another overridable torch function (its
    handler runs with the mode off): SDPA reached through `F.multi_head_attention_forward`
    (nn.MultiheadAttention) keeps the CPU kernel."""

    def __init__(self, profile: DeviceProfile):
        super().__init__()
        self.profile = profile

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            out = _cuda_sdpa(self.profile, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)
