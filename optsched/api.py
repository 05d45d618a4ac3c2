"""`optimize`: the public entry point."""

from __future__ import annotations

import copy
import functools
import os
import types
from collections.abc import Callable
from typing import Any

import torch

from .backend import PlanningBackend
from .budget import parse_budget, parse_planning_options
from .offload_runtime import OffloadDeviceError
from .costs import DeviceProfile
from .plan import Plan
from .solvers import BudgetInfeasibleError


def _own_code(call: Callable) -> Callable:
    """A trampoline to `call` with a code object of its own.

    Dynamo caches compiled graphs per code object and stops compiling after a few
    entries for one code object; every optimize() gets its own so that optimizing the
    same function or module class many times never hits that limit.
    """

    def trampoline(*args, **kwargs):
        return call(*args, **kwargs)

    code = trampoline.__code__.replace()
    return types.FunctionType(code, trampoline.__globals__, "optsched_step", None, trampoline.__closure__)


def _unwrap_errors(compiled: Callable) -> Callable:
    """Dynamo wraps backend exceptions; surface ours (budget, bad input) as themselves."""

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, (BudgetInfeasibleError, ValueError, OffloadDeviceError)):  # plan file errors too
                raise inner from None
            raise

    return call


class OptimizedFunction:
    """A planned function: call it like the original; `plan` is the plan of its latest compilation."""

    def __init__(self, fn: Callable, compiled: Callable):
        functools.update_wrapper(self, fn)
        self._call = compiled
        self.plan: Plan | None = None

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)


def optimize(
    fn_or_module: Callable | torch.nn.Module,
    mem_budget: int | float | str | None = None,
    *,
    example_inputs: tuple | list | None = None,
    device_profile: str | DeviceProfile | None = None,
    time_limit_s: float | None = None,
    progress: bool = False,
    offload: bool | None = None,
    host_budget: int | str | None = None,
    executor: str | None = None,
    plan: str | os.PathLike | None = None,
    on_mismatch: str = "error",
) -> Any:
    """Plan `fn_or_module` to run within `mem_budget` at the least estimated time.

    mem_budget: peak bytes of everything on the device during forward+backward
    (parameters, buffers, inputs, activations, gradients, temporaries): an int of
    bytes, a string with a unit ("12GB", "512MiB", "1.5 GiB"), a percentage of the
    unplanned peak ("60%"), or None (fastest plan, lowest peak among the fastest).

    A module comes back as a module of the same class that shares the original's
    parameters, buffers and submodules. Planning happens at the first call, or at
    once when `example_inputs` are given (one forward is run on them and discarded).
    The plan is `result.plan`. A budget no plan can meet raises BudgetInfeasibleError.

    time_limit_s: planning time limit; by default the larger of 5 s and 0.02 s per op.
    progress: show a live line (elapsed, best estimate, bound, gap) on stderr while solving.
    offload: let saved activations wait in host memory between forward and backward,
    copied on side streams that overlap compute, where that is cheaper than
    recomputing them. None (default): on CUDA yes, on CPU no (there host memory is the
    same memory). True on CPU runs the same program with a separate host pool (for tests).
    A plan with offloads runs only on the kind of device its profile describes.
    host_budget: host memory offloads may take: bytes, a size string ("64GB") or a
    percentage of this machine's physical memory; default 50% of it.
    executor: who runs fusion groups (chains of pointwise ops, casts and reductions that
    the planner schedules as one kernel): "inductor" (TorchInductor per group, CPU or
    CUDA), "nvfuser" (CUDA, optional extra) or "eager" (no fusion). None: nvfuser where
    it loads on CUDA, otherwise eager.
    plan: a plan file. If it exists and was made for this graph (fingerprint), budget,
    profile, executor and offload setting, it is used without solving; if it does not
    exist, the plan is solved and saved there. "auto": a file in the plan cache
    ($OPTSCHED_CACHE_DIR, else ~/.cache/optsched/plans) keyed by all of these.
    on_mismatch: "error" (default: PlanMismatchError naming what differs) or "replan"
    (solve again and overwrite the file). A corrupted or edited file raises PlanFileError.
    """
    budget, host = parse_planning_options(mem_budget, host_budget, offload, executor, time_limit_s)
    if on_mismatch not in ("error", "replan"):
        raise ValueError(f"on_mismatch must be 'error' or 'replan', got {on_mismatch!r}")
    if plan is not None and not isinstance(plan, (str, os.PathLike)):
        raise ValueError(f"plan must be a path or 'auto', got {plan!r}")
    if not callable(fn_or_module):
        raise TypeError(f"optimize() needs a function or an nn.Module, got {type(fn_or_module).__name__}")

    if isinstance(fn_or_module, torch.nn.Module):
        target = copy.copy(fn_or_module)  # shares parameters, buffers and submodules
        backend = PlanningBackend(
            budget, device_profile, time_limit_s, lambda p: _set_plan(target, p), progress, offload, host, executor, plan, on_mismatch
        )
        target.plan = None
        compiled = torch.compile(_own_code(target._call_impl), backend=backend, fullgraph=True, dynamic=False)
        target._compiled_call_impl = _unwrap_errors(compiled)
    else:
        holder: dict[str, OptimizedFunction] = {}
        backend = PlanningBackend(
            budget, device_profile, time_limit_s, lambda p: _set_plan(holder["f"], p), progress, offload, host, executor, plan, on_mismatch
        )
        compiled = torch.compile(_own_code(fn_or_module), backend=backend, fullgraph=True, dynamic=False)
        target = holder["f"] = OptimizedFunction(fn_or_module, _unwrap_errors(compiled))

    if example_inputs is not None:
        _plan_now(target, tuple(example_inputs))
    return target


def _rng_untouched():
    """A planning run must not advance the random streams the user's training will draw from."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=cuda)


def _set_plan(target: Any, plan: Plan) -> None:
    target.__dict__["plan"] = plan


def _plan_now(target: Any, example_inputs: tuple) -> None:
    """Compile (and so plan) by running one forward whose effects are undone."""
    module = target if isinstance(target, torch.nn.Module) else None
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()} if module is not None else {}
    with _rng_untouched():
        out = target(*example_inputs)
    del out
    if module is not None:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])


def capture_problem(
    fn_or_module: Callable | torch.nn.Module, example_inputs: tuple, *, device_profile: str | DeviceProfile | None = None
):
    """The planning `Problem` of one call (forward+backward when gradients are needed), without a budget.

    For notebooks, tests and solver work: the torch-free problem that `optimize` would
    hand to the solvers. Runs one forward on `example_inputs`. The problem allows
    offloading at the profile's host bandwidth (solving it with a budget may offload).
    """
    problems = []
    call = fn_or_module._call_impl if isinstance(fn_or_module, torch.nn.Module) else fn_or_module
    backend = PlanningBackend(
        parse_budget(None), device_profile, 1.0, lambda plan: problems.append(plan.problem), offload=True
    )
    compiled = torch.compile(_own_code(call), backend=backend, fullgraph=True, dynamic=False)
    with _rng_untouched():
        _unwrap_errors(compiled)(*example_inputs)
    return problems[-1]
