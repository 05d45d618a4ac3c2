"""Gradient seeds handed to the compiled backward outside the autograd engine, so they die at their last use.

The autograd engine passes a node its incoming gradients as arguments and holds them until the node
returns. Our whole backward is one node (AOTAutograd's `CompiledFunctionBackward`), so without this an
output's gradient (the logits' gradient of a loss the caller computes, 10% of a small LM's peak) stays
allocated through the whole backward, although the planned program reads it once, at the start. Inside
the model the same gradient dies after the LM head's backward.

A pre-hook on the node takes the gradients out of the engine's hands (it keeps them here and gives the
node None in their place) and the compiled backward takes them back as its own arguments, which it frees
at their last use. The plan models such seeds as `TensorKind.TANGENT_FREED` (live from the backward's
start to their last reader). Where the hand-over cannot apply (the node was not found, the backward builds
a graph of its own, a tensor subclass arrives) the gradients stay where the engine put them: correct
values, more memory than planned, and a warning.
"""

from __future__ import annotations

import logging
import threading
import warnings

import torch
import torch.fx as fx

from .._torch import PLAIN_AOT_OUTPUT

log = logging.getLogger(__name__)


def can_hand_over(joint: fx.GraphModule, n_fw_outputs: int, tangent_of: list[int | None]) -> bool:
    """Whether the node's incoming gradients line up with the forward's outputs one to one: each forward output
    is the user's output of the same index (no mutated input or intermediate base among them) and every
    tangent is one such output's gradient."""
    (out,) = joint.graph.find_nodes(op="output")
    descs = out.meta.get("desc")
    if not isinstance(descs, (list, tuple)) or len(descs) < n_fw_outputs:
        return False
    for i, d in enumerate(descs[:n_fw_outputs]):
        if type(d).__name__ != PLAIN_AOT_OUTPUT or getattr(d, "idx", None) != i:
            return False
    return bool(tangent_of) and all(i is not None for i in tangent_of)


class TangentHandover:
    """One program's gradients in transit from the engine's pre-hook to its compiled backward."""

    def __init__(self, n_fw_outputs: int, tangent_of: list[int]):
        self.n_fw_outputs = n_fw_outputs
        self.tangent_of = tangent_of  # per tangent of the backward (in order): the forward output it belongs to
        self._local = threading.local()  # the engine runs a device's nodes on that device's thread
        self.warned = False

    def attach(self, node: torch.autograd.graph.Node) -> None:
        """Take `node`'s incoming gradients when the engine calls it (one node per call of the program)."""
        node.register_prehook(self._take)

    def _take(self, grad_outputs: tuple) -> tuple | None:
        if torch.is_grad_enabled() or len(grad_outputs) != self.n_fw_outputs:
            return None  # create_graph=True, or not the outputs we know: the engine keeps them
        plain = [type(g) is torch.Tensor for g in grad_outputs]
        self._local.taken = [g if p else None for g, p in zip(grad_outputs, plain)]
        return tuple(None if p else g for g, p in zip(grad_outputs, plain))

    def give(self, args: list, positions: list[tuple[int, torch.Tensor]]) -> None:
        """Put the gradients the pre-hook took into the backward's arguments (`positions`: each tangent's
        argument index and traced value, in tangent order), in the layout the backward was traced with;
        keeps no reference."""
        taken = getattr(self._local, "taken", None)
        self._local.taken = None
        if taken is None:
            if any(args[i] is not None and args[i].numel() > 1 for i, _m in positions) and not self.warned:
                self.warned = True
                warnings.warn(
                    "optsched: the autograd engine held this backward's output gradients (its node was not "
                    "hooked), so they stayed allocated through the whole backward: above the plan's prediction",
                    RuntimeWarning, stacklevel=3,
                )
            return
        for (i, meta), out in zip(positions, self.tangent_of, strict=True):
            g, taken[out] = taken[out], None
            if g is not None and args[i] is None:
                args[i] = _traced_layout(g, meta)
            del g
        taken.clear()


def _traced_layout(g: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """`g` with the strides the backward was traced for (what AOTAutograd's own tangent handling ensures)."""
    if g.shape != meta.shape or g.numel() <= 1 or g.stride() == meta.stride():
        return g
    out = torch.empty_strided(meta.shape, meta.stride(), dtype=g.dtype, device=g.device)
    out.copy_(g)
    return out


__all__ = ["TangentHandover", "can_hand_over"]
