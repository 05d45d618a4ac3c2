"""Undo what a discarded forward wrote: `optimize(..., example_inputs=)` plans by running one forward.

A forward may write more than buffers: an EMA codebook kept as a frozen `nn.Parameter`, a tensor counter
bumped in place, `nn.Embedding(max_norm=...)` renormalizing rows of its weight, an attribute rebound to a
new tensor or number, an example input changed in place. The user asked for a plan, not a step, so every
such write is undone: each tensor is copied before (to host memory: nothing on the device the budget
covers; on a CPU the copy is host memory the size of the module's state, for that call only) and put back
if its version counter moved; each plain attribute rebound is bound back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._torch import tree_leaves

_PLAIN = (int, float, bool, str, bytes, type(None), torch.Tensor)
_MISSING = object()


class StateSnapshot:
    """The tensors and plain attributes of `module` (and the tensors in `inputs`) as they are now."""

    def __init__(self, module: torch.nn.Module | None, inputs: Iterable = (), *, skip: Iterable[str] = ()):
        self._tensors: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._attrs: list[tuple[dict, str, object]] = []
        skip = set(skip)
        for t in tree_leaves(list(inputs)):
            self._add(t)
        for m in module.modules() if module is not None else ():
            for t in (*m._parameters.values(), *m._buffers.values()):
                self._add(t)
            for name, value in m.__dict__.items():
                if name not in skip and isinstance(value, _PLAIN):
                    self._attrs.append((m.__dict__, name, value))
                    self._add(value)

    def _add(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or id(t) in self._tensors or t.is_meta:
            return
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return  # tensor subclasses (fake, sharded) hold no values of their own to restore here
        copy = t.detach().to("cpu", copy=True)
        self._tensors[id(t)] = (t, t._version, copy)

    def restore(self) -> None:
        """Put back everything written since the snapshot (once)."""
        for d, name, value in self._attrs:
            if d.get(name, _MISSING) is not value:
                d[name] = value
        with torch.no_grad():
            for t, version, copy in self._tensors.values():
                if t._version != version:
                    t.copy_(copy)
        self._tensors.clear()
        self._attrs.clear()


__all__ = ["StateSnapshot"]
