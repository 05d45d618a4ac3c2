"""The reference executor: every op is its own ATen call, nothing is fused."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.fx as fx


class EagerExecutor:
    name = "eager"
    fuses_writes = False  # out= writes into inputs never join a group

    def can_fuse(self, node: fx.Node) -> bool:
        return False

    def compile_group(self, gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., tuple]:
        return gm  # never called with a real group: nothing is fusible
