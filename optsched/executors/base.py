"""What an executor is: which ops it can fuse, and how it runs one fusion group.

A fusion group reaches an executor as a small fx.GraphModule of ATen ops: its
placeholders are the group's inputs (tensors made outside it), its output is the tuple
of the values it materializes (read outside the group). Intermediates stay inside the
kernel and never take memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.fx as fx


class Executor(Protocol):
    name: str
    fuses_writes: bool  # whether pointwise out= writes into the step's inputs may join its groups

    def can_fuse(self, node: fx.Node) -> bool:
        """Whether `node` (a call_function on an ATen OpOverload, with meta['val']) may join a fusion group."""

    def compile_group(self, gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., tuple]:
        """A callable taking the group's inputs (as tensors, in placeholder order) and returning the
        tuple of its outputs. `example_inputs` may be fake tensors: use only their metadata."""
