"""The passes a forward-only program (an optimizer step) goes through before planning, in order."""

from __future__ import annotations

import torch.fx as fx

from .batch_norm import drop_unread_running_stats
from .causal_mask import causal_masks
from .foreach_split import split_foreach as split_foreach_ops
from .identity_clones import drop_identity_clones
from .inplace import fold_copy_back
from .restore_ops import restore_fused_pointwise
from .scalar_batching import batch_scalar_foreach, batch_scalar_ops


def prepare_training(joint: fx.GraphModule) -> None:
    """The joint (training) graph's passes, before `build_joint_graph`: drop what eager never keeps."""
    drop_identity_clones(joint)  # dropout(p=0), in-place activations' copies: eager returns the input
    drop_unread_running_stats(joint)  # BatchNorm's backward in training mode: eager saves the buffers
    causal_masks(joint)  # a causal mask traced code builds (transformers without a cache): eager passes is_causal


def prepare_inference(gm: fx.GraphModule, split_foreach: bool = False) -> None:
    """The forward-only (optimizer step) graph as eager would run it, before planning.
    `split_foreach`: per-tensor ops instead of foreach ops, for an executor that fuses them
    (with the writes into parameters and state) into one kernel per tensor."""
    restore_fused_pointwise(gm)  # Dynamo's mul + fma and foreach lerp back to eager's ops
    # input mutations: compute new values into the inputs instead of copying them back; readers of
    # a new value read the input after its write (order_writes keeps them after it)
    fold_copy_back(gm, redirect_readers=True)
    if split_foreach:
        split_foreach_ops(gm)
    # per-parameter scalars (step counts, bias corrections) as vectors: foreach ops, then for-loops
    batch_scalar_foreach(gm)
    batch_scalar_ops(gm)
