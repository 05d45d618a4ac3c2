"""The chunked LM head + cross-entropy kernel (fused linear + cross-entropy, in the style of Liger's).

`linear_cross_entropy(hidden, weight_t, labels, chunks, ignore_index, mean)` computes, for the rows
(tokens) of `hidden` [N, h] split into `chunks` runs one after another, the logits of one run
(`hidden_rows @ weight_t`, [n, V]), its log-softmax, its share of the loss and, at once, the gradient
of its logits (softmax minus the one-hot label, scaled); from that the gradient of its hidden rows
(written into their rows of one [N, h] buffer) and its share of the weight's gradient (accumulated
into one [V, h] buffer). Only one run's logits exist at a time (one [n, V] buffer, transformed in
place), and no matmul is ever recomputed: the backward only scales the two gradients by the incoming
gradient of the loss (`passes/chunking.py` writes that as two `mul` nodes).

Returns (loss, total_weight, grad_hidden, grad_weight) as `nll_loss_forward` would give the first two
for `log_softmax(hidden @ weight_t)` (`mean`: the sum over labels other than `ignore_index` divided by
their count; else the sum), and the gradients of that loss with respect to `hidden` and to
`weight_t.t()` (the [V, h] layout eager's weight-gradient matmul produces).

It is a torch custom op (namespace `optsched_chunking`, not `optsched`: costs/profiling labels its
profiler ranges `optsched::<node>`), with a fake implementation for capture and a FLOP formula for
roofline costs, so the planner times, measures and schedules it as one op.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_COUNTS = (1, 2, 4, 8, 16, 32, 64)
"""The chunk counts the planner chooses from."""

KERNELS_PER_CHUNK = 10
"""Kernel launches one chunk makes (matmuls, log-softmax in place, gather, scatter, scaling), for the
roofline's launch overhead; measured costs see the real ones."""


def chunk_bounds(rows: int, chunks: int) -> list[int]:
    """Row offsets of `chunks` runs as even as possible (first run at 0, last bound `rows`)."""
    k = max(1, min(chunks, rows))
    return [i * rows // k for i in range(k + 1)]


@torch.library.custom_op("optsched_chunking::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor, weight_t: Tensor, labels: Tensor, chunks: int, ignore_index: int, mean: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows = hidden.shape[0]
    dtype = hidden.dtype
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # weight grad summed across runs
    valid_all = labels != ignore_index
    total = valid_all.sum().to(dtype)
    scale = 1.0 / total.to(acc) if mean else torch.ones((), dtype=acc, device=hidden.device)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    grad_weight = torch.zeros(weight_t.shape[1], weight_t.shape[0], dtype=acc, device=hidden.device)
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    bounds = chunk_bounds(rows, chunks)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        h = hidden[lo:hi]
        valid = valid_all[lo:hi]
        target = torch.where(valid, labels[lo:hi], 0).unsqueeze(1)
        logits = torch.mm(h, weight_t)  # [n, V]: the one buffer of this run
        torch._log_softmax(logits, 1, False, out=logits)  # in place: a row-wise kernel, no temporary
        picked = logits.gather(1, target).squeeze(1)
        loss -= torch.where(valid, picked, 0).sum(dtype=acc)
        del picked
        logits.exp_()  # softmax
        weight_rows = (valid.to(acc) * scale).to(dtype).unsqueeze(1)
        logits.scatter_add_(1, target, -torch.ones_like(weight_rows))  # minus the one-hot label
        logits.mul_(weight_rows)  # ignored rows: no gradient; mean: divided by the count
        torch.mm(logits, weight_t.t(), out=grad_hidden[lo:hi])
        if acc != dtype:
            grad_weight.addmm_(logits.t().to(acc), h.to(acc))
        else:
            grad_weight.addmm_(logits.t(), h)
        del logits
    loss = (loss * scale).to(dtype)
    return loss, total, grad_hidden, grad_weight.to(dtype) if acc != dtype else grad_weight


@linear_cross_entropy.register_fake
def _(hidden, weight_t, labels, chunks, ignore_index, mean):
    loss = hidden.new_empty(())
    return loss, hidden.new_empty(()), torch.empty_like(hidden, memory_format=torch.contiguous_format), \
        hidden.new_empty(weight_t.shape[1], weight_t.shape[0])


OP = torch.ops.optsched_chunking.linear_cross_entropy.default


def _flops(hidden_shape, weight_t_shape, *args, out_shape=None, **kwargs) -> int:
    rows, h = hidden_shape
    vocab = weight_t_shape[1]
    return 3 * 2 * rows * h * vocab + 6 * rows * vocab  # three matmuls, the softmax and the loss


try:  # roofline costs read torch's FLOP registry (costs/profiles.node_flops)
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(OP, get_raw=False)(_flops)
except Exception:  # pragma: no cover - an older registry: the op costs its bytes only  # noqa: BLE001
    pass
