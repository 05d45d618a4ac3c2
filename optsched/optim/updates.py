"""Optimizer updates applied inside the backward, one parameter (or a few) at a time (issue 36).

A parameter's update can run as soon as its gradient is final, and its gradient is freed there: the
gradients of the whole model are then never live at once. `InBackwardUpdates.apply` runs the optimizer's
own `step()` on a view of its `param_groups` that holds only the parameters being updated, each with its
group's hyper-parameters as they are at that moment (an LR scheduler's changes included): the same kernels
as eager's `opt.step()` on the same values, so the same bits, and the optimizer's state is created lazily by
the optimizer itself. The gradient is set to None right after, so the user's `opt.step()` skips those
parameters (torch's optimizers skip a parameter whose `grad` is None) and `opt.zero_grad()` has nothing to
clear: the user's loop keeps working unchanged.

`state_bytes` says how many bytes of state the optimizer will hold after its first step, before it exists,
so a plan can count it from the first step.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from types import TracebackType

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer

from .guards import install as install_guards
from .guards import scaler_in_use, track, untrack

# Optimizers whose update of a parameter reads only that parameter, its gradient, its state and its group's
# hyper-parameters (so a view with fewer parameters computes the same values), and whose state `state_sizes`
# knows. Exact types: a subclass may add state or read other parameters.
SUPPORTED = (SGD, Adam, AdamW)


def _group_indices(optimizer: Optimizer) -> dict[int, int]:
    """id(parameter) -> index of its group in `optimizer.param_groups`."""
    return {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}


def check_supported(optimizer: Optimizer, what: str) -> None:
    """NotImplementedError naming `what` and the optimizers supported, unless `optimizer` is one of them."""
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(t.__name__ for t in SUPPORTED)
        raise NotImplementedError(
            f"{what} is not supported for {type(optimizer).__name__}: only {names} (exact types) are")


class InBackwardUpdates:
    """Applies `optimizer`'s update of the parameters in `params_in_backward` when `apply` is called (from a
    gradient hook or a planned backward), then frees their gradients; the other parameters are updated by the
    user's `opt.step()` as before.

    The caller says what the user's step does, since none of it is visible from here:
    - `clip_grad_norm=True`: the user clips gradients by their global norm, which needs every gradient before
      any update: refused (update those parameters in `opt.step()` instead).
    - `grad_scaler`: an enabled `GradScaler` skips the whole step when any gradient is inf/NaN, known only
      after the backward, and its gradients are still scaled in the backward: refused, so that an update the
      scaler would skip is never applied.
      Both are also caught when not declared (guards.py): `apply` raises before updating once an enabled
      GradScaler scaled a loss, and the clipping functions raise on a parameter updated here since the last step.
    - gradient accumulation: set `step_on_backward = False` for the backward calls of micro-batches that do
      not step; `apply` then keeps the gradient (autograd sums the next micro-batch into it), and updates with
      the summed gradient on the backward where `step_on_backward` is True.

    A parameter is updated at most once per optimizer step: a second `apply` before the user's `opt.step()`
    (an accumulation the caller did not flag) raises rather than update from a partial gradient. `close()`
    (or leaving a `with` block) removes the step hook this installs; the optimizer is then as it was.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        params_in_backward: Iterable[torch.Tensor],
        *,
        clip_grad_norm: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.step_on_backward = True
        groups = _group_indices(optimizer)
        self._group_of: dict[int, int] = {}  # id(parameter) -> its group's index, for the parameters updated here
        for p in params_in_backward:
            if id(p) not in groups:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not in the optimizer's param_groups")
            self._group_of[id(p)] = groups[id(p)]
        if self._group_of:
            check_supported(optimizer, "updating parameters in the backward")
            if clip_grad_norm:
                raise ValueError(
                    "gradient clipping by global norm (clip_grad_norm_) needs every gradient before any update: "
                    "it cannot coexist with updates in the backward; update these parameters in opt.step()")
            if grad_scaler is not None and grad_scaler.is_enabled():
                raise ValueError(
                    "GradScaler skips a step whose gradients hold inf/NaN, known only after the whole backward, and "
                    "its gradients are scaled until then: updates in the backward would apply steps it skips; "
                    "update these parameters in opt.step()")
        # the step function without the optimizer's step hooks: the user's hooks (and ours) belong to opt.step()
        step = type(optimizer).step
        self._step = step.__wrapped__ if getattr(step, "hooked", False) else step
        self.updated: set[int] = set()  # id(parameter) of those updated since the last opt.step()
        self._lock = threading.Lock()  # the autograd engine may call hooks from one thread per device
        self._handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.updated.clear())
        if self._group_of:  # what the user's loop does after the backward: a GradScaler, clipping (guards.py)
            install_guards()
            track(self)

    def apply(self, params: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Update `params` (one tensor, or several in one optimizer step) from their gradients now and free
        the gradients; a parameter without a gradient is left alone. Does nothing while `step_on_backward` is
        False (an accumulation micro-batch)."""
        if not self.step_on_backward:
            return
        params = [params] if isinstance(params, torch.Tensor) else list({id(p): p for p in params}.values())
        with self._lock:
            views: dict[int, list[torch.Tensor]] = {}  # group index -> its parameters to update
            for p in params:
                if id(p) not in self._group_of:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} was not given for updates in the backward")
                if id(p) in self.updated:
                    raise RuntimeError(
                        "a parameter updated in the backward got a gradient again before opt.step(): with gradient "
                        "accumulation, set step_on_backward = False on the micro-batches that do not step")
                if p.grad is not None:
                    views.setdefault(self._group_of[id(p)], []).append(p)
            if not views:
                return
            if why := scaler_in_use():
                raise RuntimeError(why)
            groups = self.optimizer.param_groups
            self.optimizer.param_groups = [{**groups[i], "params": ps} for i, ps in sorted(views.items())]
            try:
                self._step(self.optimizer)
            finally:
                self.optimizer.param_groups = groups
            for ps in views.values():
                for p in ps:
                    p.grad = None
                    self.updated.add(id(p))

    def close(self) -> None:
        """Remove the step hook: the optimizer is left as it was before."""
        self._handle.remove()
        untrack(self)

    def __enter__(self) -> InBackwardUpdates:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


_registry: weakref.WeakKeyDictionary[Optimizer, InBackwardUpdates] = weakref.WeakKeyDictionary()


def in_backward(optimizer: Optimizer) -> InBackwardUpdates:
    """The one `InBackwardUpdates` of `optimizer` (made at the first call, over all its parameters), which the
    plans of `optimize(..., optimizer=optimizer)` update parameters through. Set its `step_on_backward` to False
    for the backward of a micro-batch that does not step (gradient accumulation)."""
    if optimizer not in _registry:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        _registry[optimizer] = InBackwardUpdates(optimizer, params)
    return _registry[optimizer]


def describe(optimizer: Optimizer) -> str:
    """What a plan of the whole step depends on of `optimizer`: its type and, per parameter group, the options that
    change its state or its update's kernels (not learning rates or decay: a plan file made for one replays for
    another)."""
    check_supported(optimizer, "describe")
    keys = ("momentum", "foreach", "fused") if isinstance(optimizer, SGD) else ("amsgrad", "foreach", "fused", "capturable")
    groups = [", ".join(f"{k}={g.get(k)}" for k in keys) + f", {len(g['params'])} params" for g in optimizer.param_groups]
    return f"{type(optimizer).__name__}({'; '.join(groups)})"


def state_sizes(optimizer: Optimizer, param: torch.Tensor) -> list[int]:
    """Bytes of each state tensor `optimizer` will hold for `param` on the parameter's own device once its
    first step ran (torch creates the state lazily there): what a plan must count from the first step, one
    allocation each. A parameter that requires no gradient never gets state."""
    check_supported(optimizer, "state_sizes")
    index = _group_indices(optimizer).get(id(param))
    if index is None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in the optimizer's param_groups")
    return _sizes(optimizer, param, optimizer.param_groups[index])


def _sizes(optimizer: Optimizer, param: torch.Tensor, group: dict) -> list[int]:
    if not param.requires_grad:
        return []
    size = param.numel() * param.element_size()  # zeros_like / clone of the gradient: the parameter's bytes
    if isinstance(optimizer, SGD):
        return [size] if group["momentum"] != 0 else []
    moments = [size] * (3 if group["amsgrad"] else 2)
    # Adam hosts `step` on the CPU unless capturable or fused put it on the parameter's device
    if group["capturable"] or group["fused"] or param.device.type == "cpu":
        wide = torch.get_default_dtype() == torch.float64 and not group["fused"]
        return moments + [(torch.float64 if wide else torch.float32).itemsize]
    return moments


def state_bytes(optimizer: Optimizer, params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes of state `optimizer` will hold for `params` (default: all of its parameters; each counted once) on
    their devices after its first step, before that state exists. Raises NotImplementedError for an optimizer
    other than SGD, Adam and AdamW."""
    check_supported(optimizer, "state_bytes")
    groups = _group_indices(optimizer)
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    unique = {id(p): p for p in params}.values()
    total = 0
    for p in unique:
        if id(p) not in groups:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is not in the optimizer's param_groups")
        total += sum(_sizes(optimizer, p, optimizer.param_groups[groups[id(p)]]))
    return total
