"""The chunked LM head + cross-entropy kernel (fused linear + cross-entropy, in the style of Liger's).

`linear_cross_entropy(hidden, weight_t, labels, chunks, ignore_index, mean, bias, upcast, row_slice,
return_logits)` computes, for the rows (tokens) of `hidden` [N, h] split into `chunks` runs one after
another, the logits of one run (`hidden_rows @ weight_t (+ bias)`, [n, V]), its log-softmax, its share
of the loss and, at once, the gradient of its logits (softmax minus the one-hot label, scaled); from
that the gradient of its hidden rows (written into their rows of one [N, h] buffer) and its share of
the weight's (and bias's) gradient (accumulated into one [V, h] buffer). Only one run's logits exist at
a time (one [n, V] buffer, transformed in place), and no matmul is ever recomputed: the backward only
scales the gradients by the incoming gradient of the loss (`passes/chunking.py` writes that as `mul`
nodes, or as `linear_cross_entropy_backward` when the logits are also a forward output).

What the graphs users have add (`passes/chunking.py` finds each in the captured graph):

- `bias` [V]: `nn.Linear`'s (`addmm`, or `mm` + `add`); its gradient is the fifth output.
- `upcast`: the logits are made in the model's dtype (bf16, fp16) and their log-softmax in float32, as
  transformers' `ForCausalLMLoss` does (`logits.float()`); the logits' gradient is rounded back to the
  model's dtype before the two gradient matmuls, as eager's backward does. Loss and total weight are
  float32 then.
- `row_slice` [length, start, stop, inner]: the loss reads only some rows, `logits[:, :-1]` (the shift of
  causal LMs): the rows viewed as [outer, length, inner], rows [:, start:stop, :] are the loss's, in
  order. `labels` has one entry per row read; the others count as `ignore_index` (no loss, no
  gradient, as eager's `slice_backward` gives them).
- `return_logits`: the logits are a forward output too (HF models return them with the loss): they are
  written whole, in the model's dtype, as the sixth output (else an empty tensor), each run's matmul
  straight into its rows.

Returns (loss, total_weight, grad_hidden, grad_weight, grad_bias, logits): the first two as
`nll_loss_forward` gives them for the log-softmax of the logits (`mean`: the sum over labels other than
`ignore_index` divided by their count; else the sum), then the gradients of that loss with respect to
`hidden`, to `weight_t.t()` (the [V, h] layout eager's weight-gradient matmul produces) and to `bias`
(an empty tensor without one). The weight's and bias's gradients are summed run by run in float32 for
half dtypes (else in their dtype), so they equal eager's to rounding, not bitwise.

They are torch custom ops (namespace `optsched_chunking`, not `optsched`: costs/profiling labels its
profiler ranges `optsched::<node>`), with fake implementations for capture and FLOP formulas for
roofline costs, so the planner times, measures and schedules each as one op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._torch import aten_log_softmax

CHUNK_COUNTS = (1, 2, 4, 8, 16, 32, 64)
"""The chunk counts the planner chooses from."""

KERNELS_PER_CHUNK = 10
"""Kernel launches one chunk makes (matmuls, log-softmax in place, gather, scatter, scaling), for the
roofline's launch overhead; measured costs see the real ones."""

_HALF = (torch.float16, torch.bfloat16)


def chunk_bounds(rows: int, chunks: int) -> list[int]:
    """Row offsets of `chunks` runs as even as possible (first run at 0, last bound `rows`)."""
    k = max(1, min(chunks, rows))
    return [i * rows // k for i in range(k + 1)]


def _all_labels(labels: Tensor, rows: int, row_slice: list[int] | None, ignore_index: int) -> Tensor:
    """One label per row of the logits: the loss's labels where it reads the row, `ignore_index` elsewhere."""
    if row_slice is None:
        return labels
    length, start, stop, inner = row_slice
    outer = rows // (length * inner)
    full = labels.new_full((outer, length, inner), ignore_index)
    full[:, start:stop, :] = labels.view(outer, stop - start, inner)
    return full.view(rows)


def _dtypes(hidden: Tensor, upcast: bool) -> tuple[torch.dtype, torch.dtype]:
    """(the log-softmax's dtype, the dtype the weight's and bias's gradients are summed in)."""
    dtype = hidden.dtype
    return (torch.float32 if upcast else dtype), (torch.float32 if dtype in _HALF else dtype)


@torch.library.custom_op("optsched_chunking::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor, weight_t: Tensor, labels: Tensor, chunks: int, ignore_index: int, mean: bool,
    bias: Tensor | None = None, upcast: bool = False, row_slice: list[int] | None = None, return_logits: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, vocab = hidden.shape[0], weight_t.shape[1]
    dtype, device = hidden.dtype, hidden.device
    cdtype, acc = _dtypes(hidden, upcast)
    wdt = torch.promote_types(cdtype, torch.float32)  # the loss and the per-row scale
    labels = _all_labels(labels, rows, row_slice, ignore_index)
    valid_all = labels != ignore_index
    total = valid_all.sum().to(cdtype)
    scale = 1.0 / total.to(wdt) if mean else torch.ones((), dtype=wdt, device=device)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    grad_weight = torch.zeros(vocab, weight_t.shape[0], dtype=acc, device=device)
    grad_bias = torch.zeros(vocab, dtype=acc, device=device) if bias is not None else hidden.new_empty(0)
    logits_out = hidden.new_empty(rows, vocab) if return_logits else hidden.new_empty(0)
    loss = torch.zeros((), dtype=wdt, device=device)
    bounds = chunk_bounds(rows, chunks)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        h = hidden[lo:hi]
        valid = valid_all[lo:hi]
        target = torch.where(valid, labels[lo:hi], 0).unsqueeze(1)
        if return_logits:  # the run's logits go straight into the output; the log-softmax works on a copy
            z = logits_out[lo:hi]
            if bias is not None:
                torch.addmm(bias, h, weight_t, out=z)
            else:
                torch.mm(h, weight_t, out=z)
            x = z.to(torch.float32) if upcast else z.clone()
        else:
            x = torch.addmm(bias, h, weight_t) if bias is not None else torch.mm(h, weight_t)  # [n, V]
            if upcast:
                x = x.to(torch.float32)  # the model-dtype logits are freed here: one [n, V] buffer again
        aten_log_softmax(x, 1, False, out=x)  # in place: a row-wise kernel, no temporary
        picked = x.gather(1, target).squeeze(1)
        loss -= torch.where(valid, picked, 0).sum(dtype=wdt)
        del picked
        x.exp_()  # softmax
        weight_rows = (valid.to(wdt) * scale).to(cdtype).unsqueeze(1)
        x.scatter_add_(1, target, -torch.ones_like(weight_rows))  # minus the one-hot label
        x.mul_(weight_rows)  # ignored rows: no gradient; mean: divided by the count
        if upcast:  # eager rounds the logits' gradient to the model's dtype before its matmuls
            g = x.to(dtype)
            x.copy_(g)  # the rounded values, in float32 for the sums below
        else:
            g = x
        torch.mm(g, weight_t.t(), out=grad_hidden[lo:hi])
        if acc == dtype:
            grad_weight.addmm_(g.t(), h)
        else:
            grad_weight.addmm_((x if upcast else g.to(acc)).t(), h.to(acc))
        if bias is not None:  # x: the logits' gradient (upcast: its rounded values in float32)
            grad_bias += x.sum(0, dtype=acc)
        del x, g
    loss = (loss * scale).to(cdtype)
    if acc != dtype:
        grad_weight = grad_weight.to(dtype)
    if bias is not None and grad_bias.dtype != bias.dtype:
        grad_bias = grad_bias.to(bias.dtype)
    return loss, total, grad_hidden, grad_weight, grad_bias, logits_out


@linear_cross_entropy.register_fake
def _(hidden, weight_t, labels, chunks, ignore_index, mean, bias=None, upcast=False, row_slice=None,
      return_logits=False):
    cdtype, _ = _dtypes(hidden, upcast)
    rows, vocab = hidden.shape[0], weight_t.shape[1]
    return (
        hidden.new_empty((), dtype=cdtype), hidden.new_empty((), dtype=cdtype),
        torch.empty_like(hidden, memory_format=torch.contiguous_format),
        hidden.new_empty(vocab, weight_t.shape[0]),
        bias.new_empty(vocab) if bias is not None else hidden.new_empty(0),
        hidden.new_empty(rows, vocab) if return_logits else hidden.new_empty(0),
    )


@torch.library.custom_op("optsched_chunking::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_loss: Tensor, grad_hidden: Tensor, grad_weight: Tensor, grad_bias: Tensor, grad_logits: Tensor,
    hidden: Tensor, weight_t: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of a chunked chain whose logits are also a forward output: the precomputed gradients
    scaled by the loss's incoming gradient, plus what the logits' own incoming gradient (`grad_logits`,
    the logits' shape) adds through the head: `grad_logits @ weight` to the hidden rows,
    `grad_logits.t() @ hidden` to the weight, its column sums to the bias. An output no gradient flowed
    into arrives as zeros broadcast from one element (capture/output_usage.zeros_if_missing): a
    broadcast value c adds c times the weight's row sums and the hidden's column sums, no [N, V] matmul."""
    rows = hidden.shape[0]
    gh = grad_hidden * grad_loss
    gw = grad_weight * grad_loss
    gb = grad_bias * grad_loss
    if grad_logits.numel() and all(s == 0 for s in grad_logits.stride()):
        c = grad_logits[(0,) * grad_logits.dim()]
        gh += weight_t.sum(1).to(gh.dtype) * c
        gw += hidden.sum(0).to(gw.dtype) * c
        if gb.numel():
            gb += c * rows
    elif grad_logits.numel():
        g = grad_logits.reshape(rows, -1).to(gh.dtype)
        gh.addmm_(g, weight_t.t())
        gw.addmm_(g.t(), hidden)
        if gb.numel():
            gb += g.sum(0).to(gb.dtype)
    return gh, gw, gb


@linear_cross_entropy_backward.register_fake
def _(grad_loss, grad_hidden, grad_weight, grad_bias, grad_logits, hidden, weight_t):
    return torch.empty_like(grad_hidden), torch.empty_like(grad_weight), torch.empty_like(grad_bias)


OP = torch.ops.optsched_chunking.linear_cross_entropy.default
BACKWARD_OP = torch.ops.optsched_chunking.linear_cross_entropy_backward.default


def _flops(hidden_shape, weight_t_shape, labels_shape=None, chunks=1, ignore_index=-100, mean=True, bias_shape=None,
           *args, out_shape=None, **kwargs) -> int:
    rows, h = hidden_shape
    vocab = weight_t_shape[1]
    bias = rows * vocab + rows * vocab if bias_shape is not None else 0  # added to the logits; summed for its gradient
    return 3 * 2 * rows * h * vocab + 6 * rows * vocab + bias  # three matmuls, the softmax and the loss


def _backward_flops(grad_loss_shape, grad_hidden_shape, grad_weight_shape, grad_bias_shape, *args, out_shape=None,
                    **kwargs) -> int:
    """The scaling (an output no gradient flowed into, the plan's case: its broadcast zeros add row sums)."""
    rows, h = grad_hidden_shape
    vocab = grad_weight_shape[0]
    return 2 * (rows * h + vocab * h) + 2 * vocab + rows * h + vocab * h


try:  # roofline costs read torch's FLOP registry (costs/profiles.node_flops)
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(OP, get_raw=False)(_flops)
    register_flop_formula(BACKWARD_OP, get_raw=False)(_backward_flops)
except Exception:  # pragma: no cover - an older registry: the op costs its bytes only  # noqa: BLE001
    pass
