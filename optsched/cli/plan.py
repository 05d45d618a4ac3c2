"""`optsched plan`: import a model factory, build the model and its inputs as fake tensors and
plan one training step for a device profile (`optsched.compiler.offline.plan_offline`).

The only command that imports torch, and only when it runs: this module imports without it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import sys
import typing

from .args import CliError
from .render import print_show
from ..costs.profiles import PROFILES
from ..plans.cache import check_writable
from ..plans.file_format import load_plan


def _dataclass_in(annotation):
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return annotation
    for arg in typing.get_args(annotation):
        found = _dataclass_in(arg)
        if found is not None:
            return found
    return None


def bind_kwargs(factory, kwargs: dict) -> dict:
    """JSON kwargs for `factory`: an object given for a parameter annotated with a dataclass
    (e.g. `cfg: GPTConfig | None`) becomes that dataclass."""
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - unresolvable annotations: pass values as given
        hints = {}
    out = {}
    for key, value in kwargs.items():
        cls = _dataclass_in(hints.get(key)) if isinstance(value, dict) else None
        if cls is not None:
            try:
                value = cls(**value)
            except TypeError as e:
                raise CliError(f"--kwargs: {key}={json.dumps(value)} does not make a {cls.__name__}: {e}", 2) from None
        out[key] = value
    return out


def load_factory(target: str, traceback: bool = False):
    """'package.module:factory' (or 'module:Class', 'module:obj.attr') -> the callable. A module that does not
    import (not found, or its own code or imports fail) is a CliError with status 2 (`traceback`: raised as is)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{target!r} is not MODULE:FACTORY (e.g. benchmarks.models.gpt:build)", 2)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does: modules of the current directory import
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise CliError(f"cannot import module {module_name!r} (from {target!r}): {e}; "
                           "run from the folder that contains it or set PYTHONPATH", 2) from None
        if traceback:
            raise
        raise CliError(f"cannot import module {module_name!r} (from {target!r}): {_where(e)}{type(e).__name__}: {e} "
                       "(install what it needs; --traceback shows where)", 2) from None
    except Exception as e:  # noqa: BLE001 - the module's own code: a SyntaxError, an ImportError, any error at import
        if traceback:
            raise
        message = e.msg if isinstance(e, SyntaxError) else e
        raise CliError(f"cannot import module {module_name!r} (from {target!r}): {_where(e)}{type(e).__name__}: "
                       f"{message} (--traceback shows where)", 2) from None
    try:
        obj = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        callables = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise CliError(f"module {module_name!r} has no attribute {attr!r}"
                       + (f"; callables defined there: {', '.join(callables)}" if callables else ""), 2) from None
    if not callable(obj):
        raise CliError(f"{target!r} is a {type(obj).__name__}, not a callable that returns a module", 2)
    return obj


def _where(e: BaseException) -> str:
    """'file.py:12: ', the innermost frame of the module's own code where it failed (not importlib's)."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "importlib" not in f.filename and "<frozen" not in f.filename]
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}: "
    return f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""


def _module_of(result):
    """A factory may return the module, or (module, example_inputs) as tests.models' builders do."""
    import torch

    if isinstance(result, tuple) and result and isinstance(result[0], torch.nn.Module):
        return result[0]
    return result


def make_inputs(specs) -> tuple:
    """Tensors of the given shapes: floats ~N(0, 1), integers in [0, 2) (valid token ids), bools False."""
    import torch

    out = []
    for shape, dtype_name in specs:
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            out.append(torch.randn(shape, dtype=dtype))
        elif dtype == torch.bool:
            out.append(torch.zeros(shape, dtype=dtype))
        else:
            out.append(torch.randint(0, 2, shape, dtype=dtype))
    return tuple(out)


def cmd_plan(args, parser) -> int:
    unwritable = check_writable(args.output)  # before importing torch, capturing and solving, not after
    if unwritable is not None:
        raise CliError(f"cannot write the plan to {args.output}: {unwritable}", 2)
    from ..compiler.offline import plan_offline
    from ..solvers import BudgetInfeasibleError

    factory = load_factory(args.target, traceback=args.traceback)
    kwargs = bind_kwargs(factory, args.kwargs or {})
    specs = args.inputs

    def model_factory():
        return _module_of(factory(**kwargs))

    def inputs_factory():
        return make_inputs(specs)

    shapes = ", ".join(f"{'x'.join(map(str, s)) or 'scalar'}:{d}" for s, d in specs)
    offload = PROFILES[args.profile].device_type == "cuda" if args.offload is None else args.offload
    print(f"planning {args.target}({', '.join(f'{k}={v!r}' for k, v in (args.kwargs or {}).items())}) on {shapes}; "
          f"budget {args.budget}, profile {args.profile}, executor {args.executor or 'eager'}, "
          f"offload {'on' if offload else 'off'}{' (default for this profile)' if args.offload is None else ''}",
          file=sys.stderr)
    try:
        plan = plan_offline(
            model_factory, inputs_factory, args.budget.spec,
            device_profile=args.profile, executor=args.executor, offload=args.offload,
            time_limit_s=args.time_limit, progress=args.progress,
        )
    except BudgetInfeasibleError as e:
        raise CliError(f"{e} (try a larger --budget{'' if offload else ', or --offload'})", 1) from None
    except Exception as e:  # the model, its factory or its inputs: one line unless asked
        if args.traceback:
            raise
        raise CliError(f"planning failed: {type(e).__name__}: {e} (--traceback shows where)", 1) from None
    try:
        out = plan.save(args.output)
    except OSError as e:  # writable when checked, not now (disk full, permissions changed)
        raise CliError(f"planned, but cannot write the plan to {args.output}: {e.strerror or e}", 1) from None
    print(f"wrote {out}", file=sys.stderr)
    print_show(load_plan(out).data, out)
    return 0
