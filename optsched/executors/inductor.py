"""TorchInductor as a fusion-group executor: each group is compiled on its own, so Inductor
fuses within the group and cannot reorder or fuse across the plan (that is the planner's job).

Kernels are shape-generic: a group is compiled once with symbolic sizes and reused by every
group of the same structure and layout whose shapes satisfy the compile's shape guards
(the same update in every layer, or an optimizer's per-parameter update for every
parameter shape). Writes into the step's inputs (an optimizer's `out=` updates of
parameters and state) may join a group: Inductor stores the new value straight into the
input, in the same kernel, instead of a separate pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from .._torch import FakeTensor, FakeTensorMode, FunctionalTensor, OpOverload, TracingContext, disable_current_modes, tracing
from ..capture.fingerprint import structure_hash

log = logging.getLogger(__name__)

_REDUCTIONS = {"sum", "mean", "amax", "amin", "prod"}
_CASTS = {"_to_copy", "clone"}


def _tensor_out(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def is_pointwise_write(target) -> bool:
    """An `out=` form of a pointwise op (how a folded copy-back writes a new value into an input)."""
    return (
        isinstance(target, OpOverload)
        and _is_out_variant(target)
        and torch.Tag.pointwise in target.tags
        and not target.overloadpacket.__name__.startswith("_foreach")
    )


def _is_out_variant(target: OpOverload) -> bool:
    """torch 2.13 tags `out=` overloads (`Tag.out`); torch 2.11 has no such tag, so its schema says it: an
    argument written as the op's output."""
    out_tag = getattr(torch.Tag, "out", None)
    if out_tag is not None and out_tag in target.tags:
        return True
    return any(a.is_out for a in target._schema.arguments)


def _layout(x: torch.Tensor) -> tuple:
    """What a shape-generic kernel is specialized on: everything but the sizes themselves."""
    order = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
    return (x.dtype, x.device.type, x.dim(), order, tuple(s == 1 for s in x.shape), x.is_contiguous())


_TRACED = (FakeTensor, FunctionalTensor)  # inputs of a group called while a program is traced, not run


def _exact_layout(xs: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(x.shape), x.stride(), x.dtype, x.device) for x in xs)


@dataclass
class _Kernel:
    run: Callable
    fakes: list | None  # symbolic example inputs; None: compiled for exact shapes
    shape_env: ShapeEnv | None
    exact: list | None = None  # the (shape, stride) it was compiled for, when not shape-generic

    def accepts(self, xs: Sequence[torch.Tensor]) -> bool:
        if self.shape_env is None:
            return self.exact == [(tuple(x.shape), x.stride()) for x in xs]
        return self.shape_env.evaluate_guards_for_args(self.fakes, list(xs))


def _symbolic_inputs(example: Sequence[torch.Tensor]) -> tuple[list, FakeTensorMode]:
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = []
    for x in example:
        dims = [DimDynamic.DYNAMIC if s > 1 else DimDynamic.STATIC for s in x.shape]
        fakes.append(mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)))
    return fakes, mode


class InductorExecutor:
    name = "inductor"
    fuses_writes = True  # out= writes into inputs join groups (prepare_inference splits foreach ops for them)

    def __init__(self) -> None:
        self._kernels: dict[tuple, list[_Kernel]] = {}
        self.compilations = 0
        self.exact_shape_fallbacks: list[str] = []  # why a group got a kernel for its exact shapes only

    def can_fuse(self, node: fx.Node) -> bool:
        """Pointwise ops, casts and plain reductions with one tensor output, and pointwise `out=`
        writes; nothing random and no other mutation."""
        target = node.target
        if not isinstance(target, OpOverload):
            return False
        if target._schema.is_mutable and not is_pointwise_write(target):
            return False
        if torch.Tag.nondeterministic_seeded in target.tags or not _tensor_out(node):
            return False
        name = target.overloadpacket.__name__
        return torch.Tag.pointwise in target.tags or name in _REDUCTIONS or name in _CASTS

    def compile_group(self, gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., tuple]:
        """The group's kernel for inputs laid out like `example_inputs`, and for others when they come: the
        examples follow the traced values' strides, but at run time an input may be laid out otherwise (a
        transposed view where the trace had a contiguous tensor, e.g. Llama's attention under a plan), and
        an Inductor kernel asserts the strides it was compiled for."""
        first = self._kernel_run(gm, example_inputs)
        by_layout: dict[tuple, Callable[..., tuple]] = {_exact_layout(example_inputs): first}

        def run(*xs: torch.Tensor) -> tuple:
            layout = _exact_layout(xs)
            kernel = by_layout.get(layout)
            if kernel is None:
                if any(isinstance(x, _TRACED) for x in xs):  # traced, not run: the ops themselves
                    return tuple(gm(*xs))
                with disable_current_modes():
                    kernel = by_layout[layout] = self._kernel_run(gm, xs)
            return kernel(*xs)

        return run

    def _kernel_run(self, gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., tuple]:
        key = (structure_hash(gm), tuple(_layout(x) for x in example_inputs))
        kernels = self._kernels.setdefault(key, [])
        for k in kernels:
            if k.accepts(example_inputs):
                return k.run
        kernel = self._compile(gm, example_inputs)
        kernels.append(kernel)
        return kernel.run

    def _compile(self, gm: fx.GraphModule, example: Sequence[torch.Tensor]) -> _Kernel:
        from .._torch import functorch_config, inductor_compile, inductor_config  # Inductor loads here, at the first group

        self.compilations += 1
        try:
            fakes, mode = _symbolic_inputs(example)
            # a tracing context of its own: guards on these sizes belong to this kernel, not to the
            # Dynamo compilation that is planning the step. No graph caches: a cache hit does not
            # put the cached kernel's shape guards into this shape env, and `accepts` needs them
            # all (32-bit indexing, reduction strategies)
            with (
                tracing(TracingContext(mode)),
                inductor_config.patch(fx_graph_cache=False),
                functorch_config.patch(enable_autograd_cache=False),
            ):
                compiled = inductor_compile(gm, fakes)
            kernel = _Kernel(_as_tuple(compiled), fakes, mode.shape_env)
            if kernel.accepts(example):
                return kernel
            reason = "the symbolic kernel's shape guards reject its own example"
        except Exception as e:  # noqa: BLE001 - some graphs do not compile with symbolic sizes: exact shapes, said and counted
            reason = f"the symbolic compile failed: {type(e).__name__}: {e}"
        self.exact_shape_fallbacks.append(reason)
        log.info("inductor executor: a group of %d nodes gets a kernel for its exact shapes only (%s)",
                 len(gm.graph.nodes), reason)
        real = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in example]
        with tracing(None):
            compiled = inductor_compile(gm, real)
        return _Kernel(_as_tuple(compiled), None, None, [(tuple(x.shape), x.stride()) for x in example])


def _as_tuple(compiled: Callable) -> Callable[..., tuple]:
    def run(*xs: torch.Tensor) -> tuple:
        return tuple(compiled(*xs))

    return run
