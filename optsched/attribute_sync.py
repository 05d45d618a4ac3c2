"""The optimized module and the module it was made from keep one set of plain attributes and one mode.

`optimize(model)` returns a second instance of the model's class that shares its parameters, buffers,
submodules and hooks (the same dicts), so `model` itself stays eager. Plain attributes (`model.scale = 2`)
and the train/eval flag live in each instance's own `__dict__`, though: set on one after `optimize`, the
other would silently keep the old value (an optimized step computing with a stale scale, or in training
mode after `model.eval()`). Before each call of the optimized module, whatever changed on either side since
the last call is carried to the other (a change on both: the optimized module's wins), so the step runs with
the state the caller last set on either.
"""

from __future__ import annotations

import weakref

import torch

_SHARED = ("_parameters", "_buffers", "_modules")  # the same dict objects in both already
_OWN = ("plan", "_compiled_call_impl", "__reduce_ex__", "__deepcopy__")  # the optimized module's own (api._install)
_MISSING = object()


class AttributeSync:
    """Two-way sync of plain attributes between `optimized` and `original` (held weakly: a dropped original
    leaves the optimized module on its own)."""

    def __init__(self, optimized: torch.nn.Module, original: torch.nn.Module):
        self.optimized = weakref.ref(optimized)
        self.original = weakref.ref(original)
        self.seen = {k: v for k, v in original.__dict__.items() if _plain(k)}

    def __call__(self) -> None:
        opt, orig = self.optimized(), self.original()
        if opt is None or orig is None:
            return
        mine, theirs = opt.__dict__, orig.__dict__
        for k in {k for k in (*mine, *theirs) if _plain(k)} | set(self.seen):
            before, o, t = self.seen.get(k, _MISSING), mine.get(k, _MISSING), theirs.get(k, _MISSING)
            value = o if o is not before else t  # ours changed (or neither): ours; else theirs changed
            for d in (mine, theirs):
                if value is _MISSING:
                    d.pop(k, None)
                elif d.get(k, _MISSING) is not value:
                    d[k] = value
            if value is _MISSING:
                self.seen.pop(k, None)
            else:
                self.seen[k] = value


def _plain(name: str) -> bool:
    return name not in _SHARED and name not in _OWN


__all__ = ["AttributeSync"]
