"""`optimize`: the public entry point."""

from __future__ import annotations

import dataclasses

import copy
import functools
import gc
import hashlib
import itertools
import json
import os
import sys
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._torch import SUPPORTED_NODES, BackendCompilerFailed, dynamo_config, dynamo_reset_code, tree_flatten
from .compiler.backend import PlanningBackend
from .budget import BudgetResolution, auto_device, parse_budget, parse_planning_options
from .attribute_sync import AttributeSync
from .capture.errors import CaptureError, capturing
from .lower.offload_runtime import OffloadDeviceError
from .capture.output_usage import OutputUsage, SeenPeak, release_unused_grads, warn_if_underplanned
from .costs.profiles import DeviceProfile
from .costs.cost_cache import CostCache
from .plans.plan import Plan
from .settings import PlanningSettings
from .state_snapshot import StateSnapshot
from .plans.file_format import PlanFile, seal, validate
from .solvers import BudgetInfeasibleError

SHAPE_CACHE_SIZE = 32
"""Compiled programs (each with its plan) an optimized callable keeps: one per input signature (shapes,
dtypes, devices, requires_grad of the tensors, other argument values, grad mode, train/eval mode). Beyond
it the least recently used one is dropped, and planned again if its signature comes back."""


def _own_code(call: Callable) -> Callable:
    """A trampoline to `call` with a code object of its own.

    Dynamo caches compiled graphs per code object and stops compiling after a few
    entries for one code object; every optimize() gets its own so that optimizing the
    same function or module class many times never hits that limit.
    """

    def trampoline(*args, **kwargs):
        return call(*args, **kwargs)

    # a name of its own too: Dynamo keeps what it saw of a frame's scalars and sizes (automatic dynamic) per
    # file, line and name, which would otherwise be shared by every optimized callable's programs
    name = f"optsched_step_{next(_CODE_NUMBERS)}"
    names = {"co_name": name, "co_qualname": name} if sys.version_info >= (3, 11) else {"co_name": name}
    code = trampoline.__code__.replace(**names)
    return types.FunctionType(code, trampoline.__globals__, name, None, trampoline.__closure__)


_CODE_NUMBERS = itertools.count()


def _scalars_unspecialized(compiled: Callable) -> Callable:
    """`compiled` with int attributes of modules traced as inputs once they change, as floats are (Dynamo
    specializes every value of an int attribute otherwise)."""

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        # profile-guided dynamism off: what another process saw must not make this program's sizes dynamic
        with dynamo_config.patch(allow_unspec_int_on_nn_module=True, automatic_dynamic_local_pgo=False):
            return compiled(*args, **kwargs)

    return call


def _unwrap_errors(compiled: Callable, eager: Callable | None = None) -> Callable:
    """Dynamo wraps backend exceptions; surface ours (budget, bad input) as themselves. `eager`: the callable
    compiled, run as written when the user's code raises while traced, so the user's exception is raised."""
    compiled = capturing(compiled, eager)  # logging ignored while tracing; graph breaks as CaptureError

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, (BudgetInfeasibleError, ValueError, OffloadDeviceError)):  # plan file errors too
                raise inner from None
            raise

    return call


_Settings = PlanningSettings  # the name copies pickled before it was shared refer to


@dataclass
class _CopySpec:
    """What a copy of an optimized module is optimized again with: the settings, the budget as the original
    resolved it, and the original's plans (sealed plan-file JSON) to replay instead of solving."""

    settings: PlanningSettings
    resolution: BudgetResolution
    carried: tuple[str, ...]


CARRIED = Path("<plan carried from the copied module>")  # where a carried plan says it was loaded from


class _Entry:
    __slots__ = ("call", "plan", "backend", "__weakref__")

    def __init__(self):
        self.call: Callable | None = None
        self.plan: Plan | None = None
        self.backend: PlanningBackend | None = None


class _WeakBackend:
    """What torch.compile gets as the backend. Dynamo keeps every backend it was given for the life of the
    process (eval_frame.cached_backends); this keeps only a weak reference to the PlanningBackend, which
    its entry holds, so a dropped entry frees its backend and plan."""

    def __init__(self, backend: PlanningBackend):
        self.backend = weakref.ref(backend)

    def __call__(self, gm, example_inputs):
        return self.backend()(gm, example_inputs)


class Dispatcher:
    """Runs each call with the compiled program of its input signature: one `torch.compile` (own code
    object, own PlanningBackend, sharing the callable's BudgetResolution) per signature, at most
    SHAPE_CACHE_SIZE of them, least recently used dropped. So Dynamo's per-code-object recompile limit is
    never reached, and `plan` of the owner is, after every call, the plan of the program that ran.

    Extension point: `extra_key(args, kwargs)` is one more part of the signature (default None);
    override it (or assign an instance attribute) to keep programs apart by anything else."""

    def __init__(self, settings: PlanningSettings, resolution: BudgetResolution, carried: tuple[str, ...] = (),
                 *, fn: Callable | None = None, module: torch.nn.Module | None = None):
        self.settings = settings
        self.resolution = resolution
        self.fn = fn
        self.module = module
        self.owner: Any = module  # whose `plan` describes what runs (the module, or the OptimizedFunction)
        self.entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.usage: dict[Hashable, OutputUsage] = {}  # per signature: what a backward saw the caller do
        self.cost_cache = CostCache()  # op costs measured per graph: a re-plan for another usage measures nothing
        self.sync: Callable[[], None] | None = None  # plain attributes and mode shared with the original (attribute_sync)
        self.carried_json = carried
        self.carried: dict[str, list[PlanFile]] = {}
        for text in carried:
            data = validate(json.loads(text), str(CARRIED))
            self.carried.setdefault(data["fingerprint"]["hash"], []).append(PlanFile(CARRIED, data))

    def extra_key(self, args: tuple, kwargs: dict) -> Hashable:
        return None

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        module = self.module
        base = (
            torch.is_grad_enabled(),
            module.training if module is not None else None,
            grads_at_start(module, args, kwargs),
            _autocast_state(),
            _hooks_state(module),
            _signature(args, kwargs),
            self.extra_key(args, kwargs),
        )
        # what the caller was last seen doing with this program's outputs (output_usage): a new usage, a new plan
        return base, self.usage.get(_usage_key(base))

    def __call__(self, *args, **kwargs):
        if self.sync is not None:  # what the caller set on the original module since the last call, and back
            self.sync()
        if self.resolution.needs_device:  # mem_budget="auto": the device's memory at the first call fixes the bytes
            self.resolution.resolve_auto(self.module, args, kwargs, optimizer=self.settings.optimizer)
        key = self.key(args, kwargs)
        entry = self.entries.get(key)
        if entry is None:
            entry = self._add(key)
        else:
            self.entries.move_to_end(key)
        planned, backend = entry.plan, entry.backend
        if backend is not None:
            backend.ran = None
        try:
            out = entry.call(*args, **kwargs)
        finally:
            # the variant that ran (Dynamo may go back to an earlier compile of this signature: see PlanningBackend)
            variant = backend.ran if backend is not None else None
            self.owner.__dict__["plan"] = variant.plan if variant is not None and variant.plan is not None else entry.plan
        if key[0][0] and variant is not None:  # grad mode: outputs no gradient flows into get None in the backward
            _hand_over_outputs(out, variant, compiled_now=entry.plan is not planned)
        return out

    def _add(self, key: Hashable) -> _Entry:
        _refuse_backward_hooks(self.module)
        entry = _Entry()
        call = self.module._call_impl if self.module is not None else self.fn
        entry.backend = _planning_backend(self, entry, *key)
        fn = _own_code(call)
        # dynamic=None: a float or int attribute that changes between steps (a scheduled temperature, a step
        # counter) becomes an input of the program after its first change, not a re-plan per value and a
        # crash at Dynamo's recompile limit; shapes stay static (one entry per input signature)
        compiled = torch.compile(fn, backend=_WeakBackend(entry.backend), fullgraph=True, dynamic=None)
        entry.call = _unwrap_errors(_scalars_unspecialized(compiled), call)
        # Dynamo's cache on the code object refers back to the code (a cycle the garbage collector cannot see
        # through): emptied when the entry goes (dropped, or its module gone), or no program would ever be
        # freed. A backward still to run holds what it needs itself.
        weakref.finalize(entry, dynamo_reset_code, fn.__code__).atexit = False
        self.entries[key] = entry
        while len(self.entries) > SHAPE_CACHE_SIZE:
            (base, _usage), _dropped = self.entries.popitem(last=False)
            if not any(_usage_key(b) == _usage_key(base) for b, _ in self.entries):  # its signature is gone:
                self.usage.pop(_usage_key(base), None)  # forget what was seen of it
        return entry

    def copy_spec(self, replayed_with_optimizer: bool = False) -> _CopySpec:
        """For a copy: settings, budget resolution and plans to replay (most recent first); with `optimizer=`, neither
        it nor its plans (a copy's parameters are not its), but the plans when a rank replays them with its own."""
        settings = self.settings
        if settings.optimizer is not None:  # never the optimizer: a copy plans without it, a rank gives its own
            settings = dataclasses.replace(settings, optimizer=None, updates_in_backward="auto")
            if not replayed_with_optimizer:
                return _CopySpec(settings, self.resolution.copy(), ())
        texts = [json.dumps(seal(e.plan.to_file_data()), separators=(",", ":"))
                 for e in reversed(self.entries.values()) if e.plan is not None and e.plan.fingerprint is not None]
        texts += [t for t in self.carried_json if t not in texts]
        return _CopySpec(settings, self.resolution.copy(), tuple(texts[: 2 * SHAPE_CACHE_SIZE]))

    def reduce_module(self, protocol: int = 2) -> tuple:
        """The optimized module's `__reduce_ex__` (copy.copy, copy.deepcopy, pickle, torch.save): its state
        without what optimize() installed, rebuilt by `_rebuild_module`, which optimizes the copy again."""
        module = self.module
        state = module.__getstate__()
        state = {k: v for k, v in state.items() if k not in _INSTALLED}
        return _rebuild_module, (type(module), self.copy_spec()), state

    def deepcopy_module(self, memo: dict) -> torch.nn.Module:
        """The optimized parametrized module's `__deepcopy__`: parametrize's class-level one would deep-copy the
        instance `__dict__`, this dispatcher included; instead, an independent copy optimized again, as
        `reduce_module` makes for other modules (copy and pickle stay refused, as torch refuses them)."""
        module = self.module
        new = _rebuild_module(type(module), self.copy_spec())
        memo[id(module)] = new
        state = {k: v for k, v in _shared_state(module).items() if k not in _INSTALLED}
        new.__dict__.update(copy.deepcopy(state, memo))
        return new


def _hand_over_outputs(out: Any, variant: Any, compiled_now: bool) -> None:
    """After a grad-mode call: the backward frees the output gradients at their last use, and the output-usage
    observer watches the caller's tensors (views included)."""
    nodes = release_unused_grads(out)
    handover = variant.handover
    if handover is not None:
        for node in nodes:
            handover.attach(node)
    observer = variant.observer
    if observer is not None:
        observer.bind_visible(out)  # view outputs: watch the caller's tensor, not ours
        if compiled_now:
            # this call compiled: Dynamo leaves the frames of its compile in reference cycles that hold what
            # the call returned until a full collection; freed now, so the first backward sees only what the
            # caller holds (else a spurious "held", and a second plan)
            gc.collect()


def _planning_backend(dispatcher: Dispatcher, entry: _Entry, base: Hashable = None,
                      usage: OutputUsage | None = None) -> PlanningBackend:
    """The PlanningBackend of one entry (signature `base`, planned for `usage`), reporting its plan and what the
    caller did with its outputs back to the entry and the dispatcher."""
    s = dispatcher.settings
    # weak: the compiled code (which the garbage collector does not see through) holds the backend, and
    # the entry holds the compiled code; a strong reference back would keep a dropped entry alive
    entry_ref, owner_ref = weakref.ref(entry), weakref.ref(dispatcher)

    def on_plan(plan: Plan) -> None:
        entry, dispatcher = entry_ref(), owner_ref()
        if entry is not None:
            entry.plan = plan
        if dispatcher is not None:
            dispatcher.owner.__dict__["plan"] = plan

    def on_usage(seen: OutputUsage, planned: OutputUsage, peak: SeenPeak | None = None) -> None:
        dispatcher = owner_ref()
        if dispatcher is not None:
            # the next call with this signature plans for everything seen so far: a caller whose use varies
            # from step to step (garbage collected late, an extra loss now and then) converges on one plan
            wanted = seen.union(dispatcher.usage.get(_usage_key(base)))
            if wanted != planned:
                dispatcher.usage[_usage_key(base)] = wanted
        warn_if_underplanned(seen, planned, s.budget.spec is not None, peak)

    # the budget as this signature's programs see it: a forward-only one takes its training program's bytes
    resolution = dispatcher.resolution.for_shapes(_shapes_key(base))
    return PlanningBackend(
        s, on_plan, resolution=resolution, carried=dispatcher.carried, usage=usage, on_usage=on_usage,
        grads_at_start=bool(base and base[2]), cost_cache=dispatcher.cost_cache, state=_module_state(dispatcher.module),
        first_micro_batch=_first_micro_batch(dispatcher, base) if base and base[2] else None,
    )


def _first_micro_batch(dispatcher: Dispatcher, base: tuple) -> Callable[[], Plan | None]:
    """For an accumulation step's planner: the plan of the same signature without gradients to start with, when
    asked (weakly: the entries may be dropped meanwhile)."""
    owner_ref = weakref.ref(dispatcher)

    def plan() -> Plan | None:
        dispatcher = owner_ref()
        if dispatcher is None:
            return None
        for (other, _usage), entry in reversed(dispatcher.entries.items()):
            if not other[2] and other[:2] == base[:2] and other[3:] == base[3:] and entry.plan is not None:
                return entry.plan
        return None

    return plan


def _module_state(module: torch.nn.Module | None) -> Callable[[], list] | None:
    """The module's named parameters and buffers when asked (weakly: a plan must not keep it alive)."""
    if module is None:
        return None
    ref = weakref.ref(module)

    def state() -> list:
        module = ref()
        return [] if module is None else [*module.named_parameters(), *module.named_buffers()]

    return state


_INSTALLED = ("_compiled_call_impl", "plan", "__reduce_ex__", "__deepcopy__")  # what _install puts in an optimized module's __dict__
_CONSTANTS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def grads_at_start(module: torch.nn.Module | None, args: tuple, kwargs: dict) -> bool:
    """Whether the step starts with gradients it will accumulate into (`.grad` set on a parameter of the
    module, or on an `nn.Parameter` passed to a function): they are live through the whole step, and the
    backward's new gradients are added to them after it returns. Part of the signature, so an accumulation
    step gets its own plan (planned as if every gradient the step makes already had one: the worst case).
    Other tensors' `.grad` (an input that requires grad) is not looked at."""
    if module is not None:
        return any(p.grad is not None for p in module.parameters())
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(a, torch.nn.Parameter) and a.grad is not None for a in leaves)


def _usage_key(base: tuple) -> tuple:
    """What the caller does with the outputs belongs to the signature, not to whether the step accumulates:
    a micro-batch with gradients present plans for the usage the first micro-batch showed."""
    return base[:2] + base[3:]


def _autocast_state() -> tuple:
    """Autocast on or off, and its dtype, per device type: another program (and plan) when it changes, so
    `.plan` always describes the program that ran (Dynamo alone would recompile under the same entry)."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = tuple(f"_global{h}" for h in _MODULE_HOOKS)


def _hooks_state(module: torch.nn.Module | None) -> tuple:
    """The module hooks registered now (each hook dict's handle ids, per submodule, and torch's global ones):
    part of the signature, so a hook added or removed between steps gets a program traced with it, as eager
    runs it (Dynamo does not guard on submodules' hooks and would keep running the program traced without)."""
    if module is None:
        return ()
    registry = torch.nn.modules.module
    state = [tuple(getattr(registry, name, None) or ()) for name in _GLOBAL_HOOKS]
    for i, m in enumerate(module.modules()):
        d = m.__dict__
        if any(d.get(name) for name in _MODULE_HOOKS):
            state.append((i, *(tuple(d.get(name) or ()) for name in _MODULE_HOOKS)))
    return tuple(state)


def _refuse_backward_hooks(module: torch.nn.Module | None) -> None:
    """A module backward hook runs between two modules' backwards, which one planned backward program has not:
    refused at the call that would compile with it, naming the module and what works instead."""
    if module is None:
        return
    registry = torch.nn.modules.module
    hooked = [f"global ({name[1:]})" for name in ("_global_backward_pre_hooks", "_global_backward_hooks")
              if getattr(registry, name, None)]
    hooked += [f"{name or 'the model'} ({type(m).__name__})" for name, m in module.named_modules()
               if m.__dict__.get("_backward_hooks") or m.__dict__.get("_backward_pre_hooks")]
    if hooked:
        raise CaptureError(
            f"optsched cannot run module backward hooks (register_full_backward_hook, register_full_backward_pre_hook) "
            f"on {', '.join(hooked[:4])}{' and others' if len(hooked) > 4 else ''}: the backward is planned and runs as one "
            "program, with no point between two modules' backwards. Hook tensors instead (Tensor.register_hook on an "
            "input or output, Tensor.register_post_accumulate_grad_hook on a parameter), or remove the hook",
            construct="module backward hook", fix="Tensor.register_hook / register_post_accumulate_grad_hook",
        )


def _shapes_key(base: tuple | None) -> str | None:
    """What a training program and the forward-only programs that evaluate it share, from a key's base (its
    last two parts: `_signature` and `extra_key`): the signature without requires_grad (grad mode, train/eval
    mode, accumulation and autocast are other parts), hashed so that copies in other processes match it.
    BudgetResolution keys a percentage's training bytes by it."""
    if not base:
        return None
    signature, extra = base[-2], base[-1]
    shapes = tuple(p[:-1] if isinstance(p, tuple) and len(p) == 6 and isinstance(p[0], type)
                   and issubclass(p[0], torch.Tensor) else p for p in signature)
    return hashlib.sha256(repr((shapes, extra)).encode()).hexdigest()[:16]


def _signature(args: tuple, kwargs: dict) -> Hashable:
    """What Dynamo specializes on in the arguments, over their pytree leaves: per tensor its type, shape,
    strides, dtype, device and requires_grad; other leaves' values when they are constants (ints, floats,
    strings...), else their type; and the containers' structure. (Tuples, lists and dicts are walked
    here, other pytree containers through torch's pytree, which costs ~10 us.)"""
    parts: list = []
    for a in args:
        _leaf_signature(a, parts)
    if kwargs:
        parts.append(tuple(kwargs))
        for a in kwargs.values():
            _leaf_signature(a, parts)
    return tuple(parts)


def _leaf_signature(a: Any, parts: list) -> None:
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        parts.append((t, a.shape, a.stride(), a.dtype, a.device, a.requires_grad))
    elif isinstance(a, (tuple, list)):  # namedtuples too
        parts.append((t, len(a)))
        for x in a:
            _leaf_signature(x, parts)
    elif isinstance(a, dict):
        parts.append((t, tuple(a)))
        for x in a.values():
            _leaf_signature(x, parts)
    elif isinstance(a, _CONSTANTS):
        parts.append((t, a))
    elif t in SUPPORTED_NODES:  # namedtuples, registered dataclasses, model-output classes...
        leaves, spec = tree_flatten(a)
        parts.append(spec)
        for x in leaves:
            _leaf_signature(x, parts)
    else:
        parts.append(t)


def _install(module: torch.nn.Module, settings: PlanningSettings, resolution: BudgetResolution,
             carried: tuple[str, ...] = ()) -> Dispatcher:
    """Make `module` run through a new Dispatcher; copies of it are optimized again (see reduce_module)."""
    dispatcher = Dispatcher(settings, resolution, carried, module=module)
    # in __dict__, not through nn.Module.__setattr__; copy and pickle look `__reduce_ex__` up on the instance
    module.__dict__.update({"plan": None, "_compiled_call_impl": dispatcher, "__reduce_ex__": dispatcher.reduce_module})
    if torch.nn.utils.parametrize.is_parametrized(module):  # its class's __deepcopy__ comes before __reduce_ex__
        module.__dict__["__deepcopy__"] = dispatcher.deepcopy_module
    return dispatcher


def _rebuild_module(cls: type, spec: _CopySpec) -> torch.nn.Module:
    """A copy of an optimized module, before copy/pickle sets its state: optimized with the original's
    settings and resolved budget; it replays the original's plans for the programs they were made for."""
    module = object.__new__(cls)  # not cls.__new__: FSDP2's classes construct the original class there (see _shallow_copy)
    _install(module, spec.settings, spec.resolution.copy(), spec.carried)
    return module


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """copy.copy(module) (shares parameters, buffers and submodules) without calling the class's `__new__`:
    FSDP2 (`fully_shard`) gives a module a class whose `__new__` builds the original class by calling its
    `__init__` with no arguments. An optimized module is copied as copy.copy copies it (its plans carried), but
    a parametrized one, which copy.copy refuses (`_install` replaces what the state carries of optimize())."""
    if "__reduce_ex__" in module.__dict__ and not torch.nn.utils.parametrize.is_parametrized(module):
        return copy.copy(module)
    new = object.__new__(type(module))
    new.__setstate__(_shared_state(module))
    return new


def _shared_state(module: torch.nn.Module) -> dict:
    """`module.__getstate__()`; for a parametrized module (torch.nn.utils.parametrize gives it a class whose
    `__getstate__` refuses, to stop pickling), the state its class had before: the shared parts a copy
    needs, the parametrizations included, as `nn.Module.__getstate__` (a copy of `__dict__`) gives them."""
    if torch.nn.utils.parametrize.is_parametrized(module):
        return super(type(module), module).__getstate__()
    return module.__getstate__()


class OptimizedFunction:
    """A planned function: call it like the original; `plan` is the plan of the program that ran last."""

    def __init__(self, fn: Callable, dispatcher: Dispatcher):
        functools.update_wrapper(self, fn)
        self._call = dispatcher
        dispatcher.owner = self
        self.plan: Plan | None = None

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __reduce__(self):
        d = self._call
        return _rebuild_function, (self.__wrapped__, d.copy_spec())


def _rebuild_function(fn: Callable, spec: _CopySpec) -> OptimizedFunction:
    return OptimizedFunction(fn, Dispatcher(spec.settings, spec.resolution.copy(), spec.carried, fn=fn))


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
    deterministic: bool | None = None,
    chunking: bool | int | str | None = None,
    start_from: BudgetInfeasibleError | Plan | PlanFile | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    updates_in_backward: bool | str = "auto",
) -> Any:
    """Plan `fn_or_module` to run within `mem_budget` (peak device bytes of forward+backward: bytes, "12GB",
    "60%" of each training program's unplanned peak, "auto" on CUDA, or None for the fastest plan) at the least
    estimated time.

    A module comes back as a module of the same class sharing the original's parameters, buffers and submodules
    (its copies and pickles stay optimized and replay its plans); a function as a callable. Each input signature
    is planned at its first call (or now, on `example_inputs`); `result.plan` is the plan of the program the latest
    call ran. A budget no plan can meet raises BudgetInfeasibleError. Every argument, its type, default and
    errors: docs/api.md ("Arguments"). Nothing else is carried between calls: the same arguments plan the same
    way in any process.
    """
    settings = _checked_settings(
        mem_budget, device_profile, time_limit_s, progress, offload, host_budget, executor, plan, on_mismatch,
        deterministic, chunking, start_from, optimizer, updates_in_backward,
    )
    if not callable(fn_or_module):
        raise TypeError(f"optimize() needs a function or an nn.Module, got {type(fn_or_module).__name__}")
    fn_or_module = _unoptimized(fn_or_module)

    if isinstance(fn_or_module, torch.nn.Module):
        _refuse_fsdp(fn_or_module)
        target = _shallow_copy(fn_or_module)  # shares parameters, buffers and submodules
        _install(target, settings, BudgetResolution(settings.budget)).sync = AttributeSync(target, fn_or_module)
    else:
        target = OptimizedFunction(fn_or_module, Dispatcher(settings, BudgetResolution(settings.budget), fn=fn_or_module))

    if example_inputs is not None:
        _plan_now(target, tuple(example_inputs))
    return target


def _checked_settings(mem_budget, device_profile, time_limit_s, progress, offload, host_budget, executor, plan,
                      on_mismatch, deterministic, chunking, start_from, optimizer, updates_in_backward) -> PlanningSettings:
    """optimize()'s options, every one checked now: none is first checked at the first call."""
    budget, host = parse_planning_options(mem_budget, host_budget, offload, executor, time_limit_s, auto=True)
    settings = PlanningSettings(
        budget, device_profile, time_limit_s, progress, offload, host, executor, plan, on_mismatch, deterministic,
        chunking, _start_plan(start_from), optimizer, updates_in_backward,
    )
    if budget.auto and not torch.cuda.is_available():
        auto_device([])  # raises: "auto" needs a CUDA device, and says what to pass instead
    from .plans.cache import check_plan_option  # a path that cannot be written: PlanFileError now, before any solving

    check_plan_option(plan, stacklevel=4)  # "auto" with an unwritable cache: one PlanCacheWarning, planning goes on
    return settings


def _start_plan(start_from: Any):
    """The plan `start_from` carries (optimize's argument), checked."""
    if start_from is None:
        return None
    if isinstance(start_from, Plan):
        return start_from.schedule
    if isinstance(start_from, PlanFile):  # its offloads name tensors: the planner finds them (plans.reuse.start_schedule)
        decisions = start_from.data.get("decisions") if isinstance(start_from.data, dict) else None
        fields = (("fw_order", list), ("bw_order", list), ("offload", dict), ("ops", list))
        if not isinstance(decisions, dict) or not all(isinstance(decisions.get(k), t) for k, t in fields):
            raise ValueError(f"start_from: {start_from.path or 'this PlanFile'} holds no schedule (decisions.fw_order, "
                             "bw_order, offload, ops); pass a plan file optsched wrote, read with optsched.load_plan")
        return start_from
    if not isinstance(start_from, BudgetInfeasibleError):
        raise TypeError(f"start_from must be a BudgetInfeasibleError raised by an earlier optimize(), an "
                        f"optimized step's plan or a plan file (optsched.load_plan), got {type(start_from).__name__}")
    if start_from.lowest_schedule is None:
        raise ValueError("start_from: this BudgetInfeasibleError carries no plan (it came from a search that found "
                         "none, or from the distributed planner); plan without start_from")
    return start_from.lowest_schedule


def _unoptimized(fn_or_module: Any) -> Any:
    """What optimize() optimizes when given something optimize() returned: the original function (an
    OptimizedFunction's `__wrapped__`; compiling the optimized one would trace optsched itself), or the
    module (an optimized module's copy gets a new dispatcher in place of the old one), with a warning
    saying so. Anything else as it is."""
    if isinstance(fn_or_module, OptimizedFunction):
        original = fn_or_module.__wrapped__
        what = f"function {getattr(original, '__qualname__', original)!r}"
    elif isinstance(fn_or_module, torch.nn.Module) and isinstance(fn_or_module.__dict__.get("_compiled_call_impl"), Dispatcher):
        original = fn_or_module
        what = f"module {type(original).__name__}"
    else:
        return fn_or_module
    warnings.warn(
        f"optimize() got a {what} that optimize() already returned: the original is optimized with these settings "
        "(the earlier plans and settings are not reused; the earlier result keeps working as it was)",
        UserWarning, stacklevel=3,
    )
    return original


def _refuse_fsdp(module: torch.nn.Module) -> None:
    """A module sharded by FSDP2 runs all-gathers and reduce-scatters in hooks torch.compile does not trace
    (as one graph): its blocks are optimized before sharding instead (optsched.distributed.optimize_fsdp)."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is not None and any(isinstance(m, fsdp) for m in module.modules()):
        raise TypeError(
            f"optimize() got a module sharded by FSDP2 (fully_shard): {type(module).__name__}. Its all-gathers run in "
            "hooks that cannot be captured in one graph. Plan the unsharded model's blocks and shard them with "
            "optsched.distributed.optimize_fsdp(model, mem_budget, example_inputs=...) (see docs/distributed.md)"
        )


def optimized_spec(optimized: Any, replayed_with_optimizer: bool = False) -> _CopySpec:
    """What an optimized module or function is optimized with: its settings, its budget as resolved so far and
    its plans (sealed plan-file JSON), as copies of it carry them; picklable. `optimize_like` applies it.
    `replayed_with_optimizer`: a plan made with `optimizer=` is kept (Dispatcher.copy_spec), the optimizer is not."""
    dispatcher = optimized._call if isinstance(optimized, OptimizedFunction) else optimized.__dict__.get("_compiled_call_impl")
    if not isinstance(dispatcher, Dispatcher):
        raise TypeError(f"not an optimized module or function: {type(optimized).__name__}")
    return dispatcher.copy_spec(replayed_with_optimizer)


def optimize_like(fn_or_module: Callable | torch.nn.Module, spec: _CopySpec, example_inputs: tuple | list | None = None) -> Any:
    """`fn_or_module` optimized with `spec` (from `optimized_spec`): the same settings and resolved budget, and its
    plans replayed (by fingerprint, as a plan file is) instead of solved. Plans now when `example_inputs` are given."""
    if isinstance(fn_or_module, torch.nn.Module):
        _refuse_fsdp(fn_or_module)
        target = _shallow_copy(fn_or_module)
        _install(target, spec.settings, spec.resolution.copy(), spec.carried).sync = AttributeSync(target, fn_or_module)
    else:
        target = OptimizedFunction(fn_or_module, Dispatcher(spec.settings, spec.resolution.copy(), spec.carried, fn=fn_or_module))
    if example_inputs is not None:
        _plan_now(target, tuple(example_inputs))
    return target


def _rng_untouched():
    """A planning run must not advance the random streams the user's training will draw from."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=cuda)


def _plan_now(target: Any, example_inputs: tuple) -> None:
    """Compile (and so plan) by running one forward whose effects are undone (state_snapshot)."""
    module = target if isinstance(target, torch.nn.Module) else None
    snapshot = StateSnapshot(module, example_inputs, skip=_INSTALLED)
    try:
        with _rng_untouched():
            out = target(*example_inputs)
        del out
    finally:
        snapshot.restore()


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
    settings = PlanningSettings(parse_budget(None), device_profile, time_limit_s=1.0, offload=True)
    backend = PlanningBackend(settings, lambda plan: problems.append(plan.problem))
    compiled = torch.compile(_own_code(call), backend=backend, fullgraph=True, dynamic=False)
    with _rng_untouched():
        _unwrap_errors(compiled)(*example_inputs)
    return problems[-1]
