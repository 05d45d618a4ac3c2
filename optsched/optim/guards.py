"""What a user's step does to gradients after the backward, seen before an update inside the backward makes it
wrong (issue 36): a `GradScaler` and clipping by norm or value.

Neither is visible to a plan: both run in the user's loop after `loss.backward()`. An update inside the backward
is applied before either, so:

- an enabled `GradScaler` would unscale the gradients and skip the step when one holds inf/NaN, known only after
  the whole backward: `GradScaler.scale` is wrapped to remember each enabled scaler that scaled a loss, and
  `scaler_in_use()` lets `InBackwardUpdates.apply` refuse before it updates anything;
- `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` would clip gradients the backward already applied and
  freed (it would see none of them and clip nothing, silently): they are wrapped to raise when a parameter
  they are given was updated inside the backward since the optimizer's last step. The update before it ran
  unclipped; the error stops training at the first such step.

`install()` wraps them once per process (idempotent); `InBackwardUpdates` calls it when it updates parameters.
A name bound before (`from torch.nn.utils import clip_grad_norm_` run earlier) keeps torch's own function.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad

_scalers: weakref.WeakSet = weakref.WeakSet()  # enabled GradScalers that scaled a loss
_updates: weakref.WeakSet = weakref.WeakSet()  # live InBackwardUpdates (their `updated`: ids since the last step)

UPDATES_OFF = "optimize(..., updates_in_backward=False) (the update after the backward, in opt.step())"


def scaler_in_use() -> str | None:
    """Why an update inside the backward must not run (an enabled GradScaler scaled a loss), or None."""
    if not any(s.is_enabled() for s in list(_scalers)):
        return None
    return ("an enabled GradScaler scaled a loss in this process: it skips a step whose gradients hold inf/NaN, "
            "known only after the whole backward, and the gradients are scaled until it unscales them, so a "
            f"parameter updated inside the backward would take a step the scaler skips or a scaled gradient; use "
            f"{UPDATES_OFF}, or InBackwardUpdates without the scaler")


def track(updates) -> None:
    """Watch `updates` (an InBackwardUpdates: `updated` holds the ids of the parameters it updated since the
    optimizer's last step) for the clipping functions; `untrack` stops."""
    _updates.add(updates)


def untrack(updates) -> None:
    _updates.discard(updates)


def _refuse_updated(parameters: torch.Tensor | Iterable[torch.Tensor], what: str) -> list[torch.Tensor]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    updated = set().union(*(u.updated for u in list(_updates)))
    if n := sum(id(p) in updated for p in params):
        raise RuntimeError(
            f"{what} was called on {n} parameter(s) already updated inside the backward, unclipped (their gradients "
            f"were applied and freed before {what} could see them): clipping cannot coexist with updates inside the "
            f"backward; use {UPDATES_OFF}")
    return params


def _wrap_clip(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def clip(parameters, *args, **kwargs):
        return fn(_refuse_updated(parameters, f"torch.nn.utils.{fn.__name__}"), *args, **kwargs)

    clip.optsched_guard = True
    return clip


def _wrap_scale(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def scale(self, outputs):
        if self.is_enabled():
            _scalers.add(self)
        return fn(self, outputs)

    scale.optsched_guard = True
    return scale


def install() -> None:
    """Wrap `GradScaler.scale` and the clipping functions, each once (a wrapper is marked `optsched_guard`)."""
    if not getattr(torch.amp.GradScaler.scale, "optsched_guard", False):
        torch.amp.GradScaler.scale = _wrap_scale(torch.amp.GradScaler.scale)
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        fn = getattr(clip_grad, name)
        if not getattr(fn, "optsched_guard", False):
            wrapped = _wrap_clip(fn)
            setattr(clip_grad, name, wrapped)  # clip_grad_norm (deprecated) calls the module's own
            if getattr(nn_utils, name, None) is fn:
                setattr(nn_utils, name, wrapped)
