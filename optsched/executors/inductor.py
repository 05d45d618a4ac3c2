"""TorchInductor as a fusion-group executor: each group is compiled on its own, so Inductor
fuses within the group and cannot reorder or fuse across the plan (that is the planner's job)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

_REDUCTIONS = {"sum", "mean", "amax", "amin", "prod"}
_CASTS = {"_to_copy", "clone"}


def _tensor_out(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


class InductorExecutor:
    name = "inductor"

    def can_fuse(self, node: fx.Node) -> bool:
        """Pointwise ops, casts and plain reductions with one tensor output; nothing random or mutating."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
            return False
        if torch.Tag.nondeterministic_seeded in target.tags or not _tensor_out(node):
            return False
        name = target.overloadpacket.__name__
        return torch.Tag.pointwise in target.tags or name in _REDUCTIONS or name in _CASTS

    def compile_group(self, gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., tuple]:
        compiled = torch._inductor.compile(gm, list(example_inputs))

        def run(*xs: torch.Tensor) -> tuple:
            return tuple(compiled(*xs))

        return run
