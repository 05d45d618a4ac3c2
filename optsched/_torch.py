"""Every private torch symbol optsched uses, looked up in one place (tests/test_layout.py keeps it so).

torch promises nothing about `torch._dynamo`, `torch._C._...`, `torch.utils._pytree` and the like: a release
may rename or drop any of them. Each one optsched reaches for is a line of `SYMBOLS` below: where it lives,
what optsched needs it for, and the torch versions it was checked on. `from optsched._torch import X` gives it.

A symbol the installed torch lacks does not fail the import. It stands in as:
- "raise" (the default): a stub whose call, attribute or isinstance check raises `MissingTorchSymbol`, which
  names the symbol and the feature that needs it;
- "none": None, where the caller has a safe path without it (its comment says which);
- "never": a fresh exception class, for exception types caught and classes checked with isinstance: nothing
  raises it and nothing is an instance of it, so the caller takes the path it takes when nothing matches.
`missing()` lists what this torch lacks and why.

Symbols are looked up at each access, not cached at import: `from optsched._torch import X` inside a function
sees what torch has now (a test that takes `torch._C._storage_Use_Count` away, one that replaces
`torch._inductor.compile`), exactly as the direct `torch._...` access it replaces did. A module-level import binds
once, as the module-level `from torch._... import` it replaces did. Nothing heavy is imported until asked for:
`torch._dynamo` and `torch._inductor` load when a symbol of theirs is first read.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any, NamedTuple


class MissingTorchSymbol(RuntimeError):
    """A private torch symbol optsched needs is not in the installed torch."""


class Symbol(NamedTuple):
    path: str  # "module:attribute", or "module" for a module itself
    needed_for: str  # what optsched needs it for (the error a stub raises says it)
    checked: str = "2.11, 2.13"  # the torch versions it was checked on
    stand_in: str = "raise"  # what stands in where torch lacks it: "raise", "none" or "never" (module docstring)


# name -> Symbol, one line each: where it lives and what optsched needs it for. Each was checked on torch 2.11 and 2.13
# (Symbol.checked) unless its line says otherwise.
SYMBOLS: dict[str, Symbol] = {
    # ATen ops and the C++ core's bindings
    "OpOverload": Symbol("torch._ops:OpOverload", "telling ATen op calls in a graph from everything else"),
    "aten_log_softmax": Symbol("torch:_log_softmax", "chunked cross-entropy: log-softmax written into its input (out=)"),
    "dispatch_has_kernel_for_dispatch_key": Symbol(
        "torch._C:_dispatch_has_kernel_for_dispatch_key", "the in-place pass: whether an out= form has a native kernel"),
    "current_graph_task_id": Symbol(
        "torch._C:_current_graph_task_id", "refusing retain_graph: whether a backward runs in the autograd engine"),
    "get_current_graph_task_keep_graph": Symbol(
        "torch._C._autograd:_get_current_graph_task_keep_graph", "refusing retain_graph/create_graph in a planned backward"),
    # None: plan_offline traces every block instead of stamping repeated ones
    "get_sequence_nr": Symbol("torch._C._autograd:_get_sequence_nr",
                              "plan_offline's stamped capture: which block a traced node comes from", "2.13", "none"),
    # None: the offload runtime takes a fresh host buffer set each step, and warns that it does
    "storage_use_count": Symbol("torch._C:_storage_Use_Count", "offloading: when a host buffer set is free again",
                                stand_in="none"),
    # None: problem_builder assumes cuBLAS (used there directly until it moves here)
    "BlasBackend": Symbol("torch._C:_BlasBackend", "CUDA memory: which BLAS library's workspace to count", stand_in="none"),
    "profiler_enabled": Symbol("torch.autograd:_profiler_enabled",
                               "op profiling: not starting a profiler inside the user's profiling session"),
    # torch.utils: pytrees and dispatch modes
    "tree_leaves": Symbol("torch.utils._pytree:tree_leaves", "the tensors in nested inputs and outputs"),
    "tree_flatten": Symbol("torch.utils._pytree:tree_flatten", "the dispatcher's input signature"),
    "tree_map": Symbol("torch.utils._pytree:tree_map", "FLOP formulas: meta tensors for the node's arguments"),
    "SUPPORTED_NODES": Symbol("torch.utils._pytree:SUPPORTED_NODES", "the dispatcher: containers pytree flattens"),
    "disable_current_modes": Symbol("torch.utils._python_dispatch:_disable_current_modes",
                                    "the Inductor executor: compiling a kernel for a new layout while traced"),
    # fake tensors and tracing contexts
    "FakeTensor": Symbol("torch._subclasses.fake_tensor:FakeTensor", "the Inductor executor: symbolic example inputs"),
    "FakeTensorMode": Symbol("torch._subclasses.fake_tensor:FakeTensorMode", "the Inductor executor: symbolic sizes"),
    "FunctionalTensor": Symbol("torch._subclasses.functional_tensor:FunctionalTensor",
                               "the Inductor executor: telling traced inputs from real ones"),
    "unset_fake_temporarily": Symbol("torch._subclasses.fake_tensor:unset_fake_temporarily",
                                     "running real ops (timing, fusion groups, output buffers) while Dynamo traces"),
    "detect_fake_mode": Symbol("torch._guards:detect_fake_mode", "chunking: the fake mode a rewritten graph's values need"),
    "tracing": Symbol("torch._guards:tracing", "the Inductor executor: a tracing context per kernel"),
    "TracingContext": Symbol("torch._guards:TracingContext",
                             "the Inductor executor's kernels; the backend clears AOTAutograd's donated buffers"),
    # Dynamo and AOTAutograd
    "dynamo_config": Symbol("torch._dynamo.config", "ignored logging functions, unspecialized int attributes"),
    "dynamo_reset": Symbol("torch._dynamo:reset", "the min-cut baseline: a fresh Dynamo cache per capture"),
    "dynamo_reset_code": Symbol("torch._dynamo:reset_code", "the dispatcher: freeing a dropped program's code cache"),
    "BackendCompilerFailed": Symbol("torch._dynamo.exc:BackendCompilerFailed",
                                    "raising optsched's own errors, not Dynamo's wrapper of them", stand_in="never"),
    "Unsupported": Symbol("torch._dynamo.exc:Unsupported", "graph breaks as CaptureError", stand_in="never"),
    "UserError": Symbol("torch._dynamo.exc:UserError", "data-dependent sizes as CaptureError", stand_in="never"),
    # None: the user's own exception is not told from a graph break (a CaptureError is raised)
    "ObservedException": Symbol("torch._dynamo.exc:ObservedException", "raising the user's exception as itself",
                                stand_in="none"),
    "observed_exception_map": Symbol("torch._dynamo.exc:observed_exception_map",
                                     "the type of the user's exception Dynamo observed", stand_in="none"),
    "aot_autograd": Symbol("torch._dynamo.backends.common:aot_autograd",
                           "the torch.compile backend and the min-cut baseline: AOTAutograd with our hooks"),
    "aot_module_simplified": Symbol("torch._functorch.aot_autograd:aot_module_simplified",
                                    "plan_offline's capture (used there directly until it moves here)"),
    "default_partition": Symbol("torch._functorch.partitioners:default_partition",
                                "the min-cut baseline's capture (and plan_offline's, until it moves here)"),
    "min_cut_rematerialization_partition": Symbol("torch._functorch.partitioners:min_cut_rematerialization_partition",
                                                  "the min-cut baseline: torch's own choice"),
    "functorch_config": Symbol("torch._functorch.config", "activation_memory_budget; no AOTAutograd cache per kernel"),
    # None: the lowered forward's outputs go without descriptors
    "SavedForBackwardsAOTOutput": Symbol("torch._functorch._aot_autograd.descriptors:SavedForBackwardsAOTOutput",
                                         "labelling the lowered forward's saved outputs for AOTAutograd", stand_in="none"),
    # None: plan_offline sets torch.compiler._is_compiling_flag instead (there, until it moves here)
    "compile_session_context": Symbol("torch.compiler:_compile_session_context",
                                      "plan_offline: torch.compiler.is_compiling() while capturing", checked="2.13 (2.11 lacks it)",
                                      stand_in="none"),
    # Inductor
    "inductor_config": Symbol("torch._inductor.config", "the Inductor executor: no FX graph cache per kernel"),
    "inductor_compile": Symbol("torch._inductor:compile", "the Inductor executor: one kernel per fusion group"),
    # FX and nn internals
    "BoxedCodeGen": Symbol("torch.fx.graph:_BoxedCodeGen", "lowered programs take their inputs as one list (boxed)"),
    "extract_tensor_metadata": Symbol("torch.fx.passes.shape_prop:_extract_tensor_metadata",
                                      "plan_offline's CUDA outputs: tensor_meta for rewritten nodes"),
    # None: plan_offline's capture then generates each graph module's code as it is built, as before
    "use_lazy_graph_module": Symbol("torch.fx._lazy_graph_module:_use_lazy_graph_module",
                                    "plan_offline's capture: graph code generated when first run, as in Dynamo's",
                                    stand_in="none"),
    # None: a stamped graph's code is generated as it is built
    "make_graph_module": Symbol("torch.fx._lazy_graph_module:_make_graph_module",
                                "plan_offline's stamped capture: graph code generated when first run", "2.13", "none"),
    "BatchNormBase": Symbol("torch.nn.modules.batchnorm:_BatchNorm",
                            "the BatchNorm momentum=None capture error names the user's layers", stand_in="never"),
}

# Classes optsched recognizes by name: an isinstance check would import their modules, and the autograd node
# has no class to import (autograd makes one per compiled function). NAMED_CLASSES says where each lives.
PLAIN_AOT_OUTPUT = "PlainAOTOutput"  # a forward output that is the user's own (tangent hand-over, output usage); 2.11, 2.13
INPUT_MUTATION_AOT_OUTPUT = "InputMutationAOTOutput"  # a forward output writing an input (problem_builder); 2.11, 2.13
ALLOCATION_EVENT = "_ExtraFields_Allocation"  # the profiler's allocation events (CPU peaks, op scratch); 2.11, 2.13
COMPILED_FUNCTION_BACKWARD = "CompiledFunctionBackward"  # AOTAutograd's autograd node (output usage); 2.11, 2.13
NAMED_CLASSES: dict[str, str | None] = {  # class name -> its module (None: made at run time)
    PLAIN_AOT_OUTPUT: "torch._functorch._aot_autograd.descriptors",
    INPUT_MUTATION_AOT_OUTPUT: "torch._functorch._aot_autograd.descriptors",
    ALLOCATION_EVENT: "torch._C._profiler",
    COMPILED_FUNCTION_BACKWARD: None,
}
# the logger torch 2.11 logs an unsortable-config traceback to on every compile (capture/errors filters it); 2.11, 2.13
DYNAMO_METRICS_LOGGER = "torch._dynamo.metrics_context"


class _Stub(type):
    """The type of a stand-in for a missing symbol: calling it, reading its attributes or an isinstance check
    against it raises MissingTorchSymbol naming the feature that needs it."""

    def _fail(cls) -> MissingTorchSymbol:
        return MissingTorchSymbol(cls.why)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise cls._fail()

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):  # introspection (copy, inspect, pickle) asks for these: not a use
            raise AttributeError(name)
        raise cls._fail()

    def __instancecheck__(cls, instance: Any) -> bool:
        raise cls._fail()


def _why(name: str, symbol: Symbol, error: Exception) -> str:
    return (f"optsched needs torch's private {symbol.path.replace(':', '.')} ({name}) for {symbol.needed_for}; "
            f"this torch lacks it ({type(error).__name__}: {error}); checked on torch {symbol.checked}")


def _find(path: str) -> Any:
    module, _, attr = path.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attr) if attr else found


def lookup(name: str, symbol: Symbol) -> Any:
    """`symbol` as the installed torch has it, or its stand-in (see the module docstring)."""
    try:
        return _find(symbol.path)
    except (ImportError, AttributeError) as e:
        why = _why(name, symbol, e)
    if symbol.stand_in == "none":
        return None
    if symbol.stand_in == "never":
        return type(name, (Exception,), {"__doc__": why})
    return _Stub(name, (), {"why": why, "__doc__": why})


def missing() -> dict[str, str]:
    """The symbols the installed torch lacks: name -> why (what stands in is `lookup`'s)."""
    out = {}
    for name, symbol in SYMBOLS.items():
        try:
            _find(symbol.path)
        except (ImportError, AttributeError) as e:
            out[name] = _why(name, symbol, e)
    return out


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """torch.compiler.is_compiling() is True inside (plan_offline's capture, as torch.export's non-strict tracing
    does): torch's own session context where it has one (2.13), else its module flag (2.11)."""
    compiler = importlib.import_module("torch.compiler")
    session = getattr(compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = old


def storage_refs(t: Any) -> int | None:
    """How many references hold tensor `t`'s storage (torch's use count of its C++ storage, `_cdata`); None where
    this torch cannot say (the symbol or the storage's handle is missing): callers treat None as "in use"."""
    use_count = lookup("storage_use_count", SYMBOLS["storage_use_count"])
    handle = getattr(t.untyped_storage(), "_cdata", None)
    return use_count(handle) if use_count is not None and handle is not None else None


def __getattr__(name: str) -> Any:
    symbol = SYMBOLS.get(name)
    if symbol is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return lookup(name, symbol)


def __dir__() -> list[str]:
    return sorted([*globals(), *SYMBOLS])


__all__ = ["SYMBOLS", "NAMED_CLASSES", "Symbol", "MissingTorchSymbol", "lookup", "missing", "compiling", "storage_refs", "PLAIN_AOT_OUTPUT",
           "INPUT_MUTATION_AOT_OUTPUT", "ALLOCATION_EVENT", "COMPILED_FUNCTION_BACKWARD", "DYNAMO_METRICS_LOGGER", *SYMBOLS]
