"""What users write in a forward, captured or explained.

optsched captures the whole step as one graph (`torch.compile(fullgraph=True)`), so anything
Dynamo cannot put into a graph stops the capture. Three things here:

- `capturing(compiled)`: wraps the compiled call. Logging inside the traced code never stops
  capture: every `logging.Logger` emitting method (`debug` ... `critical`, `log`, and the ones
  libraries attach to the class, such as transformers' `warning_once` / `info_once`), the
  `logging` module's functions and `warnings.warn` are added to
  `torch._dynamo.config.ignore_logging_functions` for the duration of the call only (Dynamo
  reads the set while tracing and guards on nothing about it, so the patch neither recompiles
  nor outlives the call). Those calls are dropped from the captured step: they are not emitted
  while it runs. Dynamo's graph-break exceptions become a `CaptureError` naming the user's
  file and line, the construct and the fix, with Dynamo's exception chained (a break inside torch's
  BatchNorm with momentum=None names the user's layer and the momentum to give it). An exception the
  user's own code raises (`raise ValueError("bad input")` in forward) is not a graph break: the call
  is run as written, and that exception reaches the caller as itself.
- `check_static_sizes(gm)`: called by the backend on the graph Dynamo hands it, before any
  planning code: a value whose size depends on tensor data (boolean-mask indexing, nonzero,
  unique, a size taken from `.item()`) gets a `CaptureError` naming its source line.
- `CaptureError`: a RuntimeError, as the Dynamo exceptions it replaces are (code that caught
  those as RuntimeError still catches it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import re
import warnings
from collections.abc import Callable

import torch
import torch.fx as fx

from .._torch import DYNAMO_METRICS_LOGGER, BatchNormBase, tree_leaves


class CaptureError(RuntimeError):
    """The step cannot be captured as one graph. `filename`, `lineno` (the user's code, when known),
    `construct` (what was found there), `fix` (what to write instead) and `reason` (Dynamo's own text)."""

    def __init__(self, message: str, *, filename: str | None = None, lineno: int | None = None,
                 construct: str = "", fix: str = "", reason: str = ""):
        super().__init__(message)
        self.filename, self.lineno, self.construct, self.fix, self.reason = filename, lineno, construct, fix, reason


# ---------------------------------------------------------------------------------------------
# logging never stops capture

_LEVEL_NAMES = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")


def _is_emitter(name: str) -> bool:
    """`info`, `warning`, ... and library helpers named after a level (`warning_once`, `info_once`,
    `warning_advice`); `isEnabledFor` too (ignored, it reads as false: the logging it guards is dropped)."""
    return name == "isEnabledFor" or any(name == lv or name.startswith(lv + "_") for lv in _LEVEL_NAMES)


_cache: dict[tuple, tuple[tuple, frozenset]] = {}


def ignored_logging_functions() -> frozenset[Callable]:
    """What Dynamo should treat as a no-op while tracing: looked up at each call, so helpers a
    library attaches to `logging.Logger` after `optimize()` (transformers on import) are covered."""
    module_functions = tuple(getattr(logging, n, None) for n in _LEVEL_NAMES)
    watched = (*vars(logging.Logger).values(), *module_functions, warnings.warn, warnings.warn_explicit)
    key = tuple(map(id, watched))  # the cache holds `watched`: none of these ids can be reused meanwhile
    found = _cache.get(key)
    if found is None:
        out = {attr for name, attr in vars(logging.Logger).items() if _is_emitter(name) and callable(attr)}
        out.update(fn for fn in module_functions if callable(fn))  # logging.warning(...): the root logger
        out.update((warnings.warn, warnings.warn_explicit))
        _cache.clear()
        _cache[key] = (watched, frozenset(out))
        return frozenset(out)
    return found[1]


def _unsortable_config_error(record: logging.LogRecord) -> bool:
    """False for torch 2.11's error on logging a compile's metrics: it sorts every set in Dynamo's config for
    JSON, and the functions `logging_ignored` puts in `ignore_logging_functions` do not sort (compiles inside the
    backend, op timing's and fusion groups', log it too). The compile itself succeeded; the record (a 14-line
    traceback each time) would keep the traced frames, the model's outputs among them, alive wherever logs are
    captured (pytest's log capture: steps re-planned, peaks over-predicted)."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, TypeError) and str(exc).startswith("'<' not supported between instances of"))


logging.getLogger(DYNAMO_METRICS_LOGGER).addFilter(_unsortable_config_error)  # idempotent: a set


@contextlib.contextmanager
def logging_ignored():
    """For one compiled call: our functions added to Dynamo's ignore set (the user's own entries stay,
    and the set is back as it was afterwards), and `logging.getLogger` evaluated while tracing (as
    `torch._dynamo.assume_constant_result` does, for this call only), so that
    `logging.getLogger(name).info(...)` in traced code reaches a logger whose methods are ignored."""
    from .._torch import dynamo_config as config

    # set and restored directly: what config.patch does, at a quarter of its cost
    users = config.ignore_logging_functions
    marked = getattr(logging.getLogger, "_dynamo_marked_constant", None)
    config.ignore_logging_functions = users | ignored_logging_functions()
    logging.getLogger._dynamo_marked_constant = True
    try:
        yield
    finally:
        config.ignore_logging_functions = users
        if marked is None:
            del logging.getLogger._dynamo_marked_constant
        else:
            logging.getLogger._dynamo_marked_constant = marked


def capturing(compiled: Callable, eager: Callable | None = None) -> Callable:
    """`compiled` with logging ignored while Dynamo traces and graph breaks as CaptureError.

    `eager`: the callable `compiled` compiles. When the user's own code raises while Dynamo traces it
    (`raise ValueError("bad input")` in forward: Dynamo reports an "Observed exception", not the exception),
    the call is run as written instead, so the user's exception reaches the caller as itself (type, message,
    traceback), as it would without optsched; should it not raise when run, the CaptureError stands."""
    from .._torch import BackendCompilerFailed, Unsupported, UserError

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        try:
            with logging_ignored():
                return compiled(*args, **kwargs)
        except (Unsupported, UserError) as e:
            root = getattr(eager, "__self__", None)  # the module, when `eager` is its _call_impl
            error = from_dynamo(e, root if isinstance(root, torch.nn.Module) else None)
            error.__cause__ = e
            if eager is None or user_exception_type(e) is None:
                raise error from e
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, CaptureError):  # raised by check_static_sizes in our backend
                raise inner from None
            raise
        # outside the except clause: the user's exception is raised without Dynamo's as its context
        eager(*args, **kwargs)
        raise error

    return call


def user_exception_type(e: BaseException) -> type[BaseException] | None:
    """The type of the exception the user's code raised while Dynamo traced it, when `e` (a graph break) is
    Dynamo's report of one ("Observed exception": the code raised and nothing in the step caught it); else None."""
    from .._torch import ObservedException as observed, observed_exception_map

    if observed is None or not str(getattr(e, "gb_type", "") or "").startswith("Observed exception"):
        return None
    types_of = {v: k for k, v in (observed_exception_map or {}).items()}
    cause = e.__cause__
    while cause is not None and not isinstance(cause, observed):
        cause = cause.__cause__
    if cause is None:
        return None
    return next((types_of[t] for t in type(cause).__mro__ if t in types_of), BaseException)


# ---------------------------------------------------------------------------------------------
# graph breaks

_PRINT_FIX = ("remove the print, or move it outside forward (print what the step returns after the call); "
              "optsched captures the step as one graph and print cannot be part of one")
_BRANCH_FIX = ("compute both sides and select with torch.where(cond, a, b) (or torch.clamp / masked_fill), "
               "or move the branch out of forward: decide it before the call and pass the decision in as a "
               "Python value")
_TO_PYTHON_FIX = ("keep the values as a tensor and use tensor ops (indexing, torch.where, arithmetic), "
                  "or do this outside forward on the returned tensors")
_LOGGING_FIX = ("optsched drops logging.Logger methods, logging.* and warnings.warn during capture; this "
                "call is not one of them: move it outside forward")
_GENERIC_FIX = "move this out of forward, or rewrite it with torch operations"


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # optsched/, not optsched/capture/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _ours(filename: str) -> bool:
    """A frame of optsched itself (the trampoline around the user's call), not the user's code."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _user_frames(e: BaseException) -> list:
    """The user's stack at the break, innermost last, without optsched's own frames (the trampoline)."""
    stack = list(getattr(e, "real_stack", None) or [])
    if not stack and getattr(e, "innermost_user_frame_summary", None) is not None:
        stack = [e.innermost_user_frame_summary]
    return [f for f in stack if not _ours(f.filename)]


def _reason(e: BaseException) -> str:
    """Dynamo's own account: its message up to the stack it appends."""
    text = str(e)
    text = re.sub(r"\n *Developer debug context:[^\n]*", "", text)
    for cut in ("\n\nfrom user code:", "\nfrom user code:", "\n\nUser Stack", "\nFor C++ stack trace",
                "\nFor more information, run with", "\n\nSet TORCHDYNAMO_VERBOSE"):
        text = text.split(cut)[0]
    return text.strip()


def _classify(e: BaseException, line: str) -> tuple[str, str]:
    """(construct, fix) for a Dynamo exception raised at source line `line`."""
    from .._torch import UserError

    gb = getattr(e, "gb_type", "") or ""
    text = str(e)
    if "`print`" in text or re.search(r"\bprint\s*\(", line):
        return "print(...)", _PRINT_FIX
    if "logging" in gb or "_warnings" in text or "logging.Logger" in text:
        return "a logging call", _LOGGING_FIX
    if "tolist" in gb or ".tolist()" in line:
        return ".tolist() (a tensor's values as Python numbers)", _TO_PYTHON_FIX
    if "numpy" in gb.lower() or ".numpy()" in line:
        return ".numpy() (a tensor's values as a NumPy array)", _TO_PYTHON_FIX
    if gb == "Data-dependent branching":
        return f"a Python branch on a tensor's value (`{line}`)", _BRANCH_FIX
    if isinstance(e, UserError) and "data-dependent" in text:
        m = re.search(r"data-dependent expression (.+?) \(", text)
        expr = f" (Dynamo needs the value of {m.group(1)})" if m else ""
        if ".item()" in line:
            what = "a Python decision on .item()"
        elif re.search(r"\b(int|float|bool)\s*\(", line):
            what = "a Python decision on a tensor converted to a Python number"
        else:
            what = "Python control flow on a tensor's value"
        return what + expr, _BRANCH_FIX
    if gb == "Attempted to call function marked as skipped":
        m = re.search(r"qualname: (\S+?),", text) or re.search(r"`([\w.]+)`", text)
        name = m.group(1) if m else "a function"
        return f"a call to {name}, which torch.compile does not trace", _GENERIC_FIX
    return gb or type(e).__name__, _GENERIC_FIX


_BATCHNORM_FILE = "torch/nn/modules/batchnorm.py"
_CMA_FIX = ("give it a float momentum before optimize() ({how}; 0.1 is torch's default, an exponential moving "
            "average). To keep the cumulative average exactly, set before each step the factor momentum=None "
            "computes: {exact} (a float attribute that changes becomes an input of the program)")


def _cumulative_batchnorm(frames: list, root: torch.nn.Module | None) -> tuple[str, str] | None:
    """(construct, fix) when the break is in torch's BatchNorm forward and a training BatchNorm has
    momentum=None: its cumulative moving average divides by `float(num_batches_tracked)`, a tensor's value
    that changes every step, which neither one graph nor torch.compile(fullgraph=True) can hold."""
    if not frames or not frames[-1].filename.replace(os.sep, "/").endswith(_BATCHNORM_FILE):
        return None
    found = [(name, m) for name, m in (root.named_modules() if root is not None else ())
             if isinstance(m, BatchNormBase) and m.momentum is None
             and m.training and m.track_running_stats]
    if root is not None and not found:
        return None
    names = [f"`{name or 'the module itself'}`" for name, _m in found]
    kinds = sorted({type(m).__name__ for _n, m in found}) or ["BatchNorm"]
    what = f"{'/'.join(kinds)} {', '.join(names)}" if names else "a BatchNorm layer"
    construct = (f"{what} with momentum=None (a cumulative moving average: each training step divides the "
                 "running statistics' update by float(num_batches_tracked), a tensor's value)")
    bns = [_submodule(name) for name, _m in found] or ["bn"]
    how = ", ".join(f"{bn}.momentum = 0.1" for bn in bns)
    exact = ", ".join(f"{bn}.momentum = 1 / ({bn}.num_batches_tracked.item() + 1)" for bn in bns)
    return construct, _CMA_FIX.format(how=how, exact=exact)


def _submodule(name: str) -> str:
    """Python for submodule `name` of `model`."""
    if all(part.isidentifier() for part in name.split(".")):
        return f"model.{name}" if name else "model"
    return f'model.get_submodule("{name}")'


def _torch_frame(f) -> bool:
    return os.path.abspath(f.filename).startswith(_TORCH_DIR + os.sep)


_FSDP_DIR = "torch/distributed/fsdp/"
_FSDP_FIX = ("optimize the blocks before sharding them, with the per-rank budget counting the shards: "
             "optsched.distributed.optimize_fsdp(model, mem_budget, example_inputs=...) applies fully_shard itself "
             "(see docs/distributed.md)")


def from_dynamo(e: BaseException, root: torch.nn.Module | None = None) -> CaptureError:
    """A CaptureError for a Dynamo graph break (Unsupported, UserError): where, what, how to fix it.
    `root`: the module optimized, to name its submodule when the break is in torch's own module code."""
    frames = _user_frames(e)
    where = frames[-1] if frames else None
    line = (where.line or "").strip() if where is not None else ""
    construct, fix = _classify(e, line)
    if any(_FSDP_DIR in f.filename.replace(os.sep, "/") for f in frames):
        construct, fix = "FSDP2's all-gather and reduce-scatter hooks (fully_shard applied to an optimized module)", _FSDP_FIX
    elif (cma := _cumulative_batchnorm(frames, root)) is not None:
        construct, fix = cma
        if not all(map(_torch_frame, frames)):  # point at the user's call of the module, not into torch
            frames = [f for f in frames if not _torch_frame(f)]
            where = frames[-1]
            line = (where.line or "").strip()
    reason = _reason(e)
    head = "optsched cannot capture the step as one graph"
    at = f"{where.filename}:{where.lineno} in {where.name}" if where is not None else "an unknown place"
    parts = [f"{head}: {construct} at {at}"]
    if line:
        parts.append(f"    {line}")
    if len(frames) > 1:
        parts.append("called from:\n" + "\n".join(f"    {f.filename}:{f.lineno} in {f.name}" for f in frames[-2::-1]))
    parts.append(f"Fix: {fix}.")
    parts.append("Dynamo's reason: " + reason.replace("\n", "\n    "))
    return CaptureError("\n".join(parts), filename=where.filename if where else None,
                        lineno=where.lineno if where else None, construct=construct, fix=fix, reason=reason)


# ---------------------------------------------------------------------------------------------
# data-dependent sizes

_MASK_FIX = ("keep the shape fixed: torch.where(mask, x, 0) or x.masked_fill(~mask, 0), then reduce "
             "(e.g. (x * mask).sum() / mask.sum() for a masked mean), or use a fixed-size op "
             "(topk, sort, gather with a fixed count)")
_SIZE_FROM_VALUE_FIX = ("use a size known before the call (a Python int argument, a tensor's .shape, a config "
                        "value), not one read from a tensor's values")

_SIZE_OPS = {  # op name (Dynamo's torch function / method or ATen packet) -> construct
    "nonzero": "torch.nonzero / argwhere", "argwhere": "torch.nonzero / argwhere",
    "masked_select": "torch.masked_select", "unique": "unique", "_unique2": "unique",
    "unique_consecutive": "unique_consecutive", "repeat_interleave": "repeat_interleave with tensor repeats",
    "index": "boolean-mask indexing x[mask]", "getitem": "boolean-mask indexing x[mask]",
    "item": "a size taken from .item()", "_local_scalar_dense": "a size taken from .item()",
    "tolist": "a size taken from .tolist()",
}


def _op_name(node: fx.Node) -> str:
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, str):
        return t
    packet = getattr(t, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(t, "__name__", str(t))


def _value(node: fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def _source(node: fx.Node) -> tuple[str | None, int | None, str]:
    """(file, line, code) of the innermost frame of `node.meta['stack_trace']`."""
    trace = node.meta.get("stack_trace") or ""
    found = list(re.finditer(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)', trace))
    found = [m for m in found if not _ours(m.group(1))] or found
    if not found:
        return None, None, ""
    m = found[-1]
    return m.group(1), int(m.group(2)), m.group(3).strip()


def check_static_sizes(gm: fx.GraphModule) -> None:
    """Raise CaptureError at the first value whose size depends on tensor data (unbacked symbols):
    planning needs every tensor's size when the step is captured."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    binders: dict = {}  # unbacked symbol -> the node that made it
    for node in gm.graph.nodes:
        for sym in (node.meta.get("unbacked_bindings") or {}):
            binders.setdefault(sym, node)
        tensors = [v for v in tree_leaves(_value(node)) if isinstance(v, torch.Tensor)]
        symbols = set().union(*(free_unbacked_symbols(t) for t in tensors)) if tensors else set()
        if not symbols:
            continue
        origin = next((binders[s] for s in sorted(symbols, key=str) if s in binders), node)
        op = _op_name(origin)
        construct = _SIZE_OPS.get(op, f"{op} (its output size depends on tensor values)")
        filename, lineno, code = _source(origin)
        if filename is None:
            filename, lineno, code = _source(node)
        from_value = op in ("item", "_local_scalar_dense", "tolist")
        if from_value and ".tolist()" in code:  # Dynamo traces an int tensor's tolist() as item()
            construct = _SIZE_OPS["tolist"]
        fix = _SIZE_FROM_VALUE_FIX if from_value else _MASK_FIX
        at = f"{filename}:{lineno}" if filename else f"graph node {node.name}"
        raise CaptureError(
            f"optsched cannot plan a step whose tensor sizes depend on tensor values: {construct} at {at}"
            + (f"\n    {code}" if code else "")
            + f"\nnode {node.name} has size {tuple(tensors[0].shape)}; optsched plans memory for sizes known "
            f"when the step is captured.\nFix: {fix}.",
            filename=filename, lineno=lineno, construct=construct, fix=fix,
            reason=f"unbacked symbols {sorted(map(str, symbols))} in the size of {node.name}",
        )
