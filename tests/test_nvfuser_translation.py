"""The nvFuser executor's translation, tested without nvFuser by replaying it with torch.

`record(gm)` turns a fusion group into a `FusionProgram` of nvFuser primitives; `replay` runs
that program with one torch op per fusion op. Comparing replay with running the GraphModule
eagerly checks the translation: lowered formulas, explicit broadcasts, explicit casts (type
promotion), views, reductions. `emit_definition` is checked against a stand-in
FusionDefinition that accepts only the op names and keywords nvFuser's Python frontend
binds (csrc `python_frontend/python_bindings.cpp`) and interprets the calls with torch.

Which ATen ops GPT and Adam produce (torch 2.13, captured with `torch.compile` +
`aot_autograd`; the fixtures below capture them again and `test_captured_ops_are_classified`
keeps this list honest):

- GPT forward (`benchmarks/models/gpt.py`, dropout 0, fp32): add.Tensor, native_layer_norm,
  gelu, view, _unsafe_view, t, transpose.int, split.Tensor, clone, detach, arange.default,
  _log_softmax; not fusible: addmm, mm, embedding,
  _scaled_dot_product_flash_attention_for_cpu, nll_loss_forward.
- GPT backward: add.Tensor, sum.dim_IntList, gelu_backward, native_layer_norm_backward,
  _log_softmax_backward_data, view, t, transpose.int, cat, detach; not fusible: mm,
  embedding_dense_backward, nll_loss_backward, the sdpa backward.
- GPT with dropout 0.1 under bf16 autocast adds: _to_copy, mul.Scalar, expand, ones, tril,
  scalar_tensor, where.self, _safe_softmax, _softmax_backward_data, native_dropout_backward;
  not fusible: bmm, native_dropout (random).
- Adam step, foreach=False (`torch.compile`, inference graph with input mutations kept):
  add.Tensor, lerp.Scalar, mul.Tensor, prims.fma (dynamo's rewrite of `addcmul_` with a
  value), copy.default, pow.Scalar (beta ** step, step a 0-d CPU tensor), rsub.Scalar,
  reciprocal, neg, sqrt, div.Tensor, addcdiv; not fusible: copy_ (the mutations).
- Adam step, foreach=True: _foreach_{add,sub,mul,div,addcmul,addcdiv,pow,neg,sqrt,reciprocal}
  (lists of tensors, not fusible by nature), full_like, copy_. Their per-tensor forms
  (addcmul.default, sub, div.Scalar, ...) are covered below.

Tolerances. "Bitwise" (k = 0) means replay produces the same bits as eager: the lowering calls
the same torch kernel, or spells out the same formula in the same order (e.g. addcdiv, fma,
mean, dropout backward, every view and cast). Otherwise a check allows k ulps of the output
dtype of the largest magnitude in the expected tensor, |replay - eager| <= k * eps * max|eager|
(a normwise bound: cancellation in a few elements needs no loose relative tolerance). Each k
below is about twice the worst error measured on 5 seeds of 4096-65536 elements:

- FMA_ULPS = 1: ATen fuses multiply-adds (add/sub with alpha, addcmul, lerp use `fmadd`);
  the program rounds after the multiply (measured <= 0.9). ATen's CPU add also rounds a scalar
  operand to bfloat16 where its CUDA kernels keep it in float32; the program follows CUDA.
- MATH_ULPS = 4: ATen's CPU gelu, and its bfloat16 erf/rsqrt/pow kernels, use other
  approximations or orders than the float32 primitives (measured <= 1.75, on N(0, 1) inputs
  whose largest value is small, so that the normwise bound is tightest).
- GELU_BACKWARD_ULPS = 4 (measured <= 1.8).
- GELU_TANH_BACKWARD_ULPS = 16: 1 - tanh(u)^2 cancels for large |x|, and the product rule
  multiplies a 1-ulp difference in tanh by ~x^3 (measured 6.7 for x ~ 3 N(0, 1), 8.1 for 4 N(0, 1)).
- REDUCTION_ULPS = 4: softmaxes and layer norm forward and backward accumulate in another order
  or algorithm (Welford vs var_mean, 1/sqrt vs rsqrt) (measured <= 2.5 at 1024 elements a row).
- BF16_ULPS = 2: bfloat16 outputs of float32 computations that differ slightly; the final
  rounding dominates (measured <= 1.06).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from optsched.executors.nvfuser_program import (
    FUSIBLE_TARGETS,
    REPLAY_OPS,
    FusionProgram,
    TensorSpec,
    UnsupportedOp,
    is_fusible,
    record,
)
from optsched.executors.nvfuser import (
    NvFuserExecutor,
    emit_definition,
    node_is_fusible,
    nvfuser_available,
)

A = torch.ops.aten
F32, BF16 = torch.float32, torch.bfloat16

# torch.compile's capture warns about torch.jit internals it touches; not ours to act on.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

FMA_ULPS = 1
MATH_ULPS = 4
GELU_BACKWARD_ULPS = 4
GELU_TANH_BACKWARD_ULPS = 16
REDUCTION_ULPS = 4
BF16_ULPS = 2

needs_nvfuser = pytest.mark.skipif(
    not nvfuser_available(),
    reason="nvFuser is not installed: it has no wheel for torch 2.13 and needs a CUDA device; "
    "the translation is tested by replay",
)


# ---------------------------------------------------------------------------------------------
# Helpers


def rnd(*shape: int, dtype: torch.dtype = F32, positive: bool = False, seed: int = 0) -> torch.Tensor:
    """Deterministic test data (positive: in [0.1, 3) for sqrt, log, ...)."""
    gen = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    t = torch.randn(shape, generator=gen)
    return (t.abs() + 0.1 if positive else t).to(dtype)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, ulps: int) -> None:
    """ulps == 0: the same bits. Otherwise |actual - expected| <= ulps * eps * max|expected|."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        actual.shape,
        actual.dtype,
        expected.shape,
        expected.dtype,
    )
    if ulps == 0 or not expected.dtype.is_floating_point:
        if expected.dtype.is_floating_point:
            bits = {
                torch.float32: torch.int32,
                torch.bfloat16: torch.int16,
                torch.float16: torch.int16,
                torch.float64: torch.int64,
            }[expected.dtype]
            actual, expected = actual.contiguous().view(bits), expected.contiguous().view(bits)
        assert torch.equal(actual, expected), f"not bitwise equal: {actual} vs {expected}"
        return
    scale = expected.abs().max().item() if expected.numel() else 1.0
    atol = ulps * torch.finfo(expected.dtype).eps * max(scale, torch.finfo(expected.dtype).tiny)
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, equal_nan=True)


def outputs_of(result: Any) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def check_replay(gm: fx.GraphModule, inputs: tuple, ulps: int = 0) -> FusionProgram:
    """record + replay against running gm eagerly."""
    program = record(gm)
    got = program.replay(*inputs)
    want = outputs_of(gm(*inputs))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_matches(g, w, ulps)
    return program


def targets(gm: fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def one_op_group(target: Any, inputs: tuple, *args: Any, **kwargs: Any) -> fx.GraphModule:
    """A group with a single call to `target` (for overloads make_fx decomposes, e.g.
    aten.reshape). `args` use "in0", "in1", ... for the inputs; meta['val'] comes from running it."""
    g = fx.Graph()
    phs = []
    for i, t in enumerate(inputs):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = t
        phs.append(p)
    sub = lambda a: phs[int(a[2:])] if isinstance(a, str) and a.startswith("in") else a
    node = g.call_function(target, tuple(sub(a) for a in args), kwargs)
    node.meta["val"] = target(
        *(inputs[int(a[2:])] if isinstance(a, str) and a.startswith("in") else a for a in args), **kwargs
    )
    g.output((node,))
    return fx.GraphModule(torch.nn.Module(), g)


# ---------------------------------------------------------------------------------------------
# Single ATen ops


@dataclass
class Case:
    id: str
    fn: Callable
    inputs: Callable[[], tuple]
    target: Any  # the overload the case must exercise
    ulps: int = 0


def _calling(op: Any, *extra: Any) -> Callable:
    """fn(*tensors) = op(*tensors, *extra). (make_fx traces every parameter of the function it is
    given, so cases cannot bind the op through default arguments.)"""

    def fn(*tensors: torch.Tensor) -> Any:
        return op(*tensors, *extra)

    return fn


def _unary_cases() -> list[Case]:
    ops = {
        "neg": A.neg.default,
        "abs": A.abs.default,
        "exp": A.exp.default,
        "log": A.log.default,
        "tanh": A.tanh.default,
        "erf": A.erf.default,
        "sqrt": A.sqrt.default,
        "rsqrt": A.rsqrt.default,
        "reciprocal": A.reciprocal.default,
        "sigmoid": A.sigmoid.default,
        "relu": A.relu.default,
    }
    positive = {"log", "sqrt", "rsqrt"}
    inexact_bf16 = {"erf", "rsqrt"}  # ATen's bf16 kernels differ from float32 + rounding by 1 ulp
    cases = []
    for name, op in ops.items():
        for dtype in (F32, BF16):
            cases.append(
                Case(
                    f"{name}-{dtype}".replace("torch.", ""),
                    _calling(op),
                    lambda dtype=dtype, p=name in positive: (rnd(5, 7, dtype=dtype, positive=p),),
                    op,
                    MATH_ULPS if dtype == BF16 and name in inexact_bf16 else 0,
                )
            )
    return cases


def _compare_cases() -> list[Case]:
    cases = []
    for name in ("eq", "ne", "lt", "le", "gt", "ge"):
        pkt = getattr(A, name)
        same = lambda: (rnd(4, 6), torch.where(rnd(4, 6, seed=1) > 0, rnd(4, 6), rnd(4, 6, seed=2)))
        cases += [
            Case(f"{name}.Tensor-broadcast", _calling(pkt.Tensor), lambda: (rnd(4, 6), rnd(6)), pkt.Tensor),
            Case(f"{name}.Tensor-ties", _calling(pkt.Tensor), same, pkt.Tensor),
            Case(f"{name}.Scalar-bf16", _calling(pkt.Scalar, 0.1), lambda: (rnd(8, 8, dtype=BF16) * 0.2,), pkt.Scalar),
        ]
    return cases


MASK = lambda *s: rnd(*s) > 0

CASES: list[Case] = [
    # arithmetic, broadcasting and promotion
    Case("add.Tensor-broadcast", lambda x, b: A.add.Tensor(x, b), lambda: (rnd(4, 8), rnd(8)), A.add.Tensor),
    Case(
        "add.Tensor-bf16+f32", lambda x, y: A.add.Tensor(x, y), lambda: (rnd(4, 8, dtype=BF16), rnd(4, 1)), A.add.Tensor
    ),
    Case(
        "add.Tensor-bf16+bf16",
        lambda x, y: A.add.Tensor(x, y),
        lambda: (rnd(4, 8, dtype=BF16), rnd(8, dtype=BF16)),
        A.add.Tensor,
    ),
    # ATen's CPU add rounds a scalar operand to bfloat16 first; its CUDA kernels, which nvFuser
    # replaces, keep it in float32 as mul and div do on both: the program follows CUDA.
    Case(
        "add.Tensor-bf16+0d-f32",
        lambda x, s: A.add.Tensor(x, s),
        lambda: (rnd(4, 8, dtype=BF16), rnd()),
        A.add.Tensor,
        FMA_ULPS,
    ),
    Case(
        "mul.Tensor-bf16*0d-f32", lambda x, s: A.mul.Tensor(x, s), lambda: (rnd(4, 8, dtype=BF16), rnd()), A.mul.Tensor
    ),
    Case("add.Tensor-int+float", lambda i, x: A.add.Tensor(i, x), lambda: (torch.arange(8), rnd(3, 8)), A.add.Tensor),
    Case(
        "add.Tensor-alpha",
        lambda x, y: A.add.Tensor(x, y, alpha=0.3),
        lambda: (rnd(4, 8), rnd(4, 8)),
        A.add.Tensor,
        FMA_ULPS,
    ),
    Case(
        "add.Tensor-alpha-bf16",
        lambda x, y: A.add.Tensor(x, y, alpha=0.3),
        lambda: (rnd(4, 8, dtype=BF16), rnd(4, 8, dtype=BF16)),
        A.add.Tensor,
        FMA_ULPS,
    ),
    Case("add.Tensor-scalar-other", lambda x: A.add.Tensor(x, 2), lambda: (rnd(4, 8),), A.add.Tensor),
    Case("add.Scalar", lambda x: A.add.Scalar(x, 1.5), lambda: (rnd(4, 8),), A.add.Scalar),
    Case("sub.Tensor", lambda x, y: A.sub.Tensor(x, y), lambda: (rnd(4, 8), rnd(1, 8)), A.sub.Tensor),
    Case(
        "sub.Tensor-alpha",
        lambda x, y: A.sub.Tensor(x, y, alpha=2.5),
        lambda: (rnd(4, 8), rnd(4, 8)),
        A.sub.Tensor,
        FMA_ULPS,
    ),
    Case("sub.Scalar", lambda x: A.sub.Scalar(x, 0.25), lambda: (rnd(4, 8),), A.sub.Scalar),
    Case("rsub.Scalar", lambda x: A.rsub.Scalar(x, 1), lambda: (rnd(4, 8),), A.rsub.Scalar),
    Case("rsub.Tensor", lambda x, y: A.rsub.Tensor(x, y), lambda: (rnd(4, 8), rnd(8)), A.rsub.Tensor),
    Case(
        "mul.Tensor-bf16*f32", lambda x, y: A.mul.Tensor(x, y), lambda: (rnd(4, 8, dtype=BF16), rnd(4, 1)), A.mul.Tensor
    ),
    Case("mul.Tensor-mask", lambda x, m: A.mul.Tensor(x, m), lambda: (rnd(4, 8), MASK(4, 8)), A.mul.Tensor),
    Case("mul.Scalar-bf16", lambda x: A.mul.Scalar(x, 0.1), lambda: (rnd(4, 8, dtype=BF16),), A.mul.Scalar),
    Case("div.Tensor", lambda x, y: A.div.Tensor(x, y), lambda: (rnd(4, 8), rnd(8, positive=True)), A.div.Tensor),
    Case(
        "div.Tensor-int",
        lambda i, j: A.div.Tensor(i, j),
        lambda: (torch.arange(1, 9), torch.arange(3, 11)),
        A.div.Tensor,
    ),
    Case("div.Scalar", lambda x: A.div.Scalar(x, 3.0), lambda: (rnd(4, 8),), A.div.Scalar),
    Case("pow.Tensor_Scalar-2", lambda x: A.pow.Tensor_Scalar(x, 2), lambda: (rnd(4, 8),), A.pow.Tensor_Scalar),
    Case(
        "pow.Tensor_Scalar-0.7",
        lambda x: A.pow.Tensor_Scalar(x, 0.7),
        lambda: (rnd(4, 8, positive=True),),
        A.pow.Tensor_Scalar,
    ),
    Case(
        "pow.Tensor_Scalar-bf16",
        lambda x: A.pow.Tensor_Scalar(x, 0.7),
        lambda: (rnd(4, 8, dtype=BF16, positive=True),),
        A.pow.Tensor_Scalar,
        MATH_ULPS,
    ),
    Case("pow.Scalar-0d-step", lambda s: A.pow.Scalar(0.999, s), lambda: (torch.tensor(7.0),), A.pow.Scalar),
    Case(
        "pow.Tensor_Tensor",
        lambda x, y: A.pow.Tensor_Tensor(x, y),
        lambda: (rnd(4, 8, positive=True), rnd(8)),
        A.pow.Tensor_Tensor,
    ),
    *_unary_cases(),
    *_compare_cases(),
    Case(
        "where.self-mixed",
        lambda m, x, y: A.where.self(m, x, y),
        lambda: (MASK(4, 1), rnd(4, 8, dtype=BF16), rnd(8)),
        A.where.self,
    ),
    Case(
        "where.self-scalar-tensors",
        lambda m: A.where.self(m, A.scalar_tensor.default(0.0), A.scalar_tensor.default(float("-inf"))),
        lambda: (MASK(5, 5),),
        A.where.self,
    ),
    Case(
        "threshold_backward",
        lambda g, x: A.threshold_backward.default(g, x, 0.0),
        lambda: (rnd(4, 8), rnd(4, 8)),
        A.threshold_backward.default,
    ),
    # composite pointwise ops
    Case("gelu", lambda x: A.gelu.default(x), lambda: (rnd(6, 32) * 3,), A.gelu.default, MATH_ULPS),
    Case(
        "gelu-tanh",
        lambda x: A.gelu.default(x, approximate="tanh"),
        lambda: (rnd(6, 32) * 3,),
        A.gelu.default,
        MATH_ULPS,
    ),
    Case("gelu-bf16", lambda x: A.gelu.default(x), lambda: (rnd(6, 32, dtype=BF16) * 3,), A.gelu.default, MATH_ULPS),
    Case(
        "gelu_backward",
        lambda g, x: A.gelu_backward.default(g, x),
        lambda: (rnd(6, 32), rnd(6, 32) * 3),
        A.gelu_backward.default,
        GELU_BACKWARD_ULPS,
    ),
    Case(
        "gelu_backward-tanh",
        lambda g, x: A.gelu_backward.default(g, x, approximate="tanh"),
        lambda: (rnd(6, 32), rnd(6, 32) * 3),
        A.gelu_backward.default,
        GELU_TANH_BACKWARD_ULPS,
    ),
    Case(
        "gelu_backward-bf16",
        lambda g, x: A.gelu_backward.default(g, x),
        lambda: (rnd(6, 32, dtype=BF16), rnd(6, 32, dtype=BF16) * 3),
        A.gelu_backward.default,
        BF16_ULPS,
    ),
    Case(
        "addcmul",
        lambda x, a, b: A.addcmul.default(x, a, b, value=0.001),
        lambda: (rnd(4, 8), rnd(4, 8), rnd(8)),
        A.addcmul.default,
        FMA_ULPS,
    ),
    Case(
        "addcmul-value1",
        lambda x, a, b: A.addcmul.default(x, a, b),
        lambda: (rnd(4, 8), rnd(4, 8), rnd(4, 8)),
        A.addcmul.default,
        FMA_ULPS,
    ),
    Case(
        "addcdiv",
        lambda x, a, b: A.addcdiv.default(x, a, b, value=-0.01),
        lambda: (rnd(4, 8), rnd(4, 8), rnd(4, 8, positive=True)),
        A.addcdiv.default,
    ),
    Case(
        "addcdiv-bf16",
        lambda x, a, b: A.addcdiv.default(x, a, b),
        lambda: tuple(rnd(4, 8, dtype=BF16, positive=True, seed=i) for i in range(3)),
        A.addcdiv.default,
    ),
    Case(
        "lerp.Scalar-small",
        lambda x, y: A.lerp.Scalar(x, y, 0.1),
        lambda: (rnd(4, 8), rnd(4, 8, seed=1)),
        A.lerp.Scalar,
        FMA_ULPS,
    ),
    Case(
        "lerp.Scalar-large",
        lambda x, y: A.lerp.Scalar(x, y, 0.9),
        lambda: (rnd(4, 8), rnd(4, 8, seed=1)),
        A.lerp.Scalar,
        FMA_ULPS,
    ),
    Case(
        "lerp.Tensor",
        lambda x, y, w: A.lerp.Tensor(x, y, w),
        lambda: (rnd(4, 8), rnd(4, 8, seed=1), torch.rand(4, 8, generator=torch.Generator().manual_seed(0))),
        A.lerp.Tensor,
        FMA_ULPS,
    ),
    Case(
        "native_dropout_backward",
        lambda g, m: A.native_dropout_backward.default(g, m, 1.25),
        lambda: (rnd(4, 8), MASK(4, 8)),
        A.native_dropout_backward.default,
    ),
    Case(
        "native_dropout_backward-bf16",
        lambda g, m: A.native_dropout_backward.default(g, m, 1.1111111),
        lambda: (rnd(4, 8, dtype=BF16), MASK(4, 8)),
        A.native_dropout_backward.default,
    ),
    # dtype, copies, constants
    Case("_to_copy-f32->bf16", lambda x: A._to_copy.default(x, dtype=BF16), lambda: (rnd(4, 8),), A._to_copy.default),
    Case(
        "_to_copy-bf16->f32",
        lambda x: A._to_copy.default(x, dtype=F32),
        lambda: (rnd(4, 8, dtype=BF16),),
        A._to_copy.default,
    ),
    Case("_to_copy-same-dtype", lambda x: A._to_copy.default(x), lambda: (rnd(4, 8),), A._to_copy.default),
    Case(
        "clone",
        lambda x: A.clone.default(A.t.default(x), memory_format=torch.contiguous_format),
        lambda: (rnd(4, 8),),
        A.clone.default,
    ),
    Case(
        "copy-broadcast-cast",
        lambda d, s: A.copy.default(d, s),
        lambda: (rnd(4, 8), rnd(8, dtype=BF16)),
        A.copy.default,
    ),
    Case("copy-same", lambda d, s: A.copy.default(d, s), lambda: (rnd(4, 8), rnd(4, 8, seed=3)), A.copy.default),
    Case("detach", lambda x: A.detach.default(x), lambda: (rnd(4, 8),), A.detach.default),
    Case("alias", lambda x: A.alias.default(x), lambda: (rnd(4, 8),), A.alias.default),
    Case("full", lambda x: A.add.Tensor(x, A.full.default([4, 8], 2.5)), lambda: (rnd(4, 8),), A.full.default),
    Case("zeros", lambda: A.zeros.default([3, 2]), lambda: (), A.zeros.default),
    Case("ones-bool", lambda: A.ones.default([3, 2], dtype=torch.bool), lambda: (), A.ones.default),
    Case(
        "scalar_tensor",
        lambda x: A.mul.Tensor(x, A.scalar_tensor.default(3.0)),
        lambda: (rnd(4, 8),),
        A.scalar_tensor.default,
    ),
    Case("full_like", lambda x: A.full_like.default(x, 0.1), lambda: (rnd(4, 8, dtype=BF16),), A.full_like.default),
    Case("zeros_like", lambda x: A.zeros_like.default(x), lambda: (rnd(4, 8),), A.zeros_like.default),
    Case("ones_like", lambda x: A.ones_like.default(x), lambda: (rnd(4, 8),), A.ones_like.default),
    Case("arange", lambda: A.arange.default(8), lambda: (), A.arange.default),
    Case("arange.start", lambda: A.arange.start(3, 11), lambda: (), A.arange.start),
    Case("arange.start_step", lambda: A.arange.start_step(1, 12, 3), lambda: (), A.arange.start_step),
    Case(
        "tril-causal-mask", lambda: A.tril.default(A.ones.default([6, 6], dtype=torch.bool)), lambda: (), A.tril.default
    ),
    Case("tril-diagonal", lambda x: A.tril.default(x, -1), lambda: (rnd(2, 5, 7),), A.tril.default),
    # views
    Case("view", lambda x: A.view.default(x, [2, 16]), lambda: (rnd(4, 8),), A.view.default),
    Case(
        "_unsafe_view",
        lambda x: A._unsafe_view.default(A.clone.default(A.t.default(x), memory_format=torch.contiguous_format), [32]),
        lambda: (rnd(4, 8),),
        A._unsafe_view.default,
    ),
    Case("permute", lambda x: A.permute.default(x, [2, 0, 1]), lambda: (rnd(2, 3, 4),), A.permute.default),
    Case("t", lambda x: A.t.default(x), lambda: (rnd(4, 8),), A.t.default),
    Case("transpose.int", lambda x: A.transpose.int(x, 1, -1), lambda: (rnd(2, 3, 4),), A.transpose.int),
    Case("expand", lambda x: A.expand.default(x, [2, 4, 8]), lambda: (rnd(4, 1),), A.expand.default),
    Case("unsqueeze", lambda x: A.unsqueeze.default(x, -2), lambda: (rnd(4, 8),), A.unsqueeze.default),
    Case("squeeze.dim", lambda x: A.squeeze.dim(x, 1), lambda: (rnd(4, 1, 8),), A.squeeze.dim),
    Case("squeeze.dims", lambda x: A.squeeze.dims(x, [0, 2, 3]), lambda: (rnd(1, 4, 1, 8),), A.squeeze.dims),
    Case("squeeze.default", lambda x: A.squeeze.default(x), lambda: (rnd(1, 4, 1),), A.squeeze.default),
    Case("slice.Tensor", lambda x: A.slice.Tensor(x, 1, 1, 7, 2), lambda: (rnd(4, 8),), A.slice.Tensor),
    Case("split.Tensor", lambda x: A.split.Tensor(x, 3, 1), lambda: (rnd(4, 8),), A.split.Tensor),
    Case("select.int", lambda x: A.select.int(x, 1, -2), lambda: (rnd(3, 5, 4),), A.select.int),
    Case("unbind.int", lambda x: A.unbind.int(x, 0), lambda: (rnd(3, 4),), A.unbind.int),
    Case(
        "split_with_sizes",
        lambda x: A.split_with_sizes.default(x, [1, 3], 0),
        lambda: (rnd(4, 8),),
        A.split_with_sizes.default,
    ),
    Case(
        "cat-mixed", lambda x, y: A.cat.default([x, y], -1), lambda: (rnd(4, 3), rnd(4, 5, dtype=BF16)), A.cat.default
    ),
    # reductions and normalizations
    Case("sum.dim_IntList", lambda x: A.sum.dim_IntList(x, [0, 1]), lambda: (rnd(4, 6, 8),), A.sum.dim_IntList),
    Case(
        "sum.dim_IntList-keepdim",
        lambda x: A.sum.dim_IntList(x, [-1], True),
        lambda: (rnd(4, 6, 8),),
        A.sum.dim_IntList,
    ),
    Case(
        "sum.dim_IntList-bf16",
        lambda x: A.sum.dim_IntList(x, [0]),
        lambda: (rnd(64, 8, dtype=BF16),),
        A.sum.dim_IntList,
        BF16_ULPS,
    ),
    Case("sum.dim_IntList-bool", lambda m: A.sum.dim_IntList(m, [1]), lambda: (MASK(4, 8),), A.sum.dim_IntList),
    Case("sum.default", lambda x: A.sum.default(x), lambda: (rnd(4, 8),), A.sum.default),
    Case("mean.dim", lambda x: A.mean.dim(x, [1], True), lambda: (rnd(4, 8),), A.mean.dim),
    Case("mean.dim-bf16", lambda x: A.mean.dim(x, [-1]), lambda: (rnd(4, 64, dtype=BF16),), A.mean.dim, BF16_ULPS),
    Case("amax", lambda x: A.amax.default(x, [1]), lambda: (rnd(4, 8),), A.amax.default),
    Case(
        "_softmax",
        lambda x: A._softmax.default(x, -1, False),
        lambda: (rnd(4, 16) * 4,),
        A._softmax.default,
        REDUCTION_ULPS,
    ),
    Case(
        "_softmax-bf16",
        lambda x: A._softmax.default(x, -1, False),
        lambda: (rnd(4, 16, dtype=BF16) * 4,),
        A._softmax.default,
        BF16_ULPS,
    ),
    Case(
        "_safe_softmax-masked-row",
        lambda x: A._safe_softmax.default(x, -1),
        lambda: (torch.cat([rnd(3, 8), torch.full((1, 8), float("-inf"))]).tril(),),
        A._safe_softmax.default,
        REDUCTION_ULPS,
    ),
    Case(
        "_log_softmax",
        lambda x: A._log_softmax.default(x, 1, False),
        lambda: (rnd(4, 16) * 4,),
        A._log_softmax.default,
        REDUCTION_ULPS,
    ),
    Case(
        "_softmax_backward_data",
        lambda g, y: A._softmax_backward_data.default(g, y, -1, F32),
        lambda: (rnd(4, 16), torch.softmax(rnd(4, 16, seed=1), -1)),
        A._softmax_backward_data.default,
        REDUCTION_ULPS,
    ),
    Case(
        "_log_softmax_backward_data",
        lambda g, y: A._log_softmax_backward_data.default(g, y, -1, F32),
        lambda: (rnd(4, 16), torch.log_softmax(rnd(4, 16, seed=1), -1)),
        A._log_softmax_backward_data.default,
        REDUCTION_ULPS,
    ),
    Case(
        "native_layer_norm",
        lambda x, w, b: A.native_layer_norm.default(x, [32], w, b, 1e-5),
        lambda: (rnd(2, 5, 32) * 2 + 1, rnd(32, seed=1), rnd(32, seed=2)),
        A.native_layer_norm.default,
        REDUCTION_ULPS,
    ),
    Case(
        "native_layer_norm-no-affine",
        lambda x: A.native_layer_norm.default(x, [4, 8], None, None, 1e-5),
        lambda: (rnd(3, 4, 8),),
        A.native_layer_norm.default,
        REDUCTION_ULPS,
    ),
    Case(
        "native_layer_norm-bf16",
        lambda x, w, b: A.native_layer_norm.default(x, [32], w, b, 1e-5),
        lambda: (rnd(2, 5, 32, dtype=BF16), rnd(32, seed=1, dtype=BF16), rnd(32, seed=2, dtype=BF16)),
        A.native_layer_norm.default,
        BF16_ULPS,
    ),
]


def _layer_norm_backward_inputs(dtype: torch.dtype) -> tuple:
    """(grad, x, mean, rstd, w, b), mean and rstd as the forward makes them (bfloat16 on CPU when
    everything is bfloat16)."""
    x, w, b = rnd(2, 5, 32, dtype=dtype) * 2 + 1, rnd(32, seed=1, dtype=dtype), rnd(32, seed=2, dtype=dtype)
    _, mean, rstd = A.native_layer_norm.default(x, [32], w, b, 1e-5)
    return rnd(2, 5, 32, seed=3, dtype=dtype), x, mean, rstd, w, b


CASES += [
    Case(
        "native_layer_norm_backward",
        lambda g, x, m, r, w, b: A.native_layer_norm_backward.default(g, x, [32], m, r, w, b, [True, True, True]),
        lambda: _layer_norm_backward_inputs(F32),
        A.native_layer_norm_backward.default,
        REDUCTION_ULPS,
    ),
    Case(
        "native_layer_norm_backward-input-only",
        lambda g, x, m, r, w, b: A.native_layer_norm_backward.default(g, x, [32], m, r, w, b, [True, False, False])[0],
        lambda: _layer_norm_backward_inputs(F32),
        A.native_layer_norm_backward.default,
        REDUCTION_ULPS,
    ),
    Case(
        "native_layer_norm_backward-bf16",
        lambda g, x, m, r, w, b: A.native_layer_norm_backward.default(g, x, [32], m, r, w, b, [True, True, True]),
        lambda: _layer_norm_backward_inputs(BF16),
        A.native_layer_norm_backward.default,
        BF16_ULPS,
    ),
]


@cache
def traced(case_id: str) -> fx.GraphModule:
    case = next(c for c in CASES if c.id == case_id)
    return make_fx(case.fn)(*case.inputs())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_single_op_replays_like_eager(case: Case) -> None:
    gm = traced(case.id)
    assert case.target in targets(gm), f"make_fx did not produce {case.target}: {targets(gm)}"
    check_replay(gm, case.inputs(), case.ulps)


def test_reshape_overload() -> None:
    """aten.reshape is CompositeImplicit (make_fx turns it into view), so build it by hand."""
    x = rnd(4, 8).t()
    check_replay(one_op_group(A.reshape.default, (x,), "in0", [2, 16]), (x,))


def test_every_fusible_target_is_exercised() -> None:
    covered = set().union(*(targets(traced(c.id)) for c in CASES)) | {A.reshape.default}
    missing = {str(t) for t in FUSIBLE_TARGETS - covered}
    assert not missing, f"no replay test for {sorted(missing)}"


def test_bf16_scalar_comparison_rounds_the_scalar_like_aten() -> None:
    """ATen compares bf16 against the scalar rounded to bf16; the program says so explicitly."""
    gm = make_fx(lambda x: A.gt.Scalar(x, 0.1))(rnd(4, dtype=BF16))
    (op,) = [op for op in record(gm).ops if op.name == "gt"]
    assert op.args[1] == float(torch.tensor(0.1, dtype=BF16))


# ---------------------------------------------------------------------------------------------
# Multi-op groups


def _mlp_tail(h: torch.Tensor, b1: torch.Tensor, y: torch.Tensor, b2: torch.Tensor, res: torch.Tensor) -> tuple:
    """The pointwise work around a GELU MLP's two matmuls (h = x@W1, y = gelu(..)@W2)."""
    act = torch.nn.functional.gelu(h + b1)
    return act, res + (y + b2)


def _mlp_tail_backward(g_act: torch.Tensor, pre: torch.Tensor) -> tuple:
    g = A.gelu_backward.default(g_act, pre)
    return g, A.sum.dim_IntList(A.view.default(g, [-1, g.shape[-1]]), [0])


def _bias_gelu_chain(x: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x + b, approximate="tanh") * scale + x


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b)


def _adam_update(param, grad, exp_avg, exp_avg_sq, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=3):
    """One Adam step written functionally (torch.optim.Adam's math, step known)."""
    bias_c1 = 1 - beta1**step
    bias_c2 = 1 - beta2**step
    exp_avg = exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    param = param - lr * exp_avg / ((exp_avg_sq / bias_c2).sqrt() + eps) / bias_c1
    return param, exp_avg, exp_avg_sq


def _softmax_xent_tail(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1)


GROUPS = {
    # name: (fn, inputs, ulps)
    "gelu-mlp-tail": (_mlp_tail, lambda: (rnd(2, 4, 64), rnd(64), rnd(2, 4, 16), rnd(16), rnd(2, 4, 16)), MATH_ULPS),
    "gelu-mlp-tail-bf16": (
        _mlp_tail,
        lambda: tuple(
            rnd(*s, dtype=BF16, seed=i) for i, s in enumerate([(2, 4, 64), (64,), (2, 4, 16), (16,), (2, 4, 16)])
        ),
        BF16_ULPS,
    ),
    "gelu-mlp-tail-backward": (_mlp_tail_backward, lambda: (rnd(2, 4, 64), rnd(2, 4, 64, seed=1)), GELU_BACKWARD_ULPS),
    "bias-gelu-tanh-chain": (_bias_gelu_chain, lambda: (rnd(8, 32), rnd(32), rnd(8, 1)), MATH_ULPS),
    "layer-norm": (_layer_norm, lambda: (rnd(2, 6, 32) + 3, rnd(32, seed=1), rnd(32, seed=2)), REDUCTION_ULPS),
    "layer-norm-bf16": (
        _layer_norm,
        lambda: (rnd(2, 6, 32, dtype=BF16), rnd(32, seed=1, dtype=BF16), rnd(32, seed=2, dtype=BF16)),
        BF16_ULPS,
    ),
    "layer-norm-bf16-x-f32-params": (
        _layer_norm,
        lambda: (rnd(2, 6, 32, dtype=BF16), rnd(32, seed=1), rnd(32, seed=2)),
        BF16_ULPS,
    ),
    "adam-update": (
        lambda p, g, m, v: _adam_update(p, g, m, v),
        lambda: (rnd(4, 8), rnd(4, 8, seed=1), rnd(4, 8, seed=2) * 0.1, rnd(4, 8, seed=3, positive=True) * 0.01),
        FMA_ULPS,
    ),
    "log-softmax-of-bf16-logits": (_softmax_xent_tail, lambda: (rnd(4, 64, dtype=BF16) * 3,), REDUCTION_ULPS),
}


@pytest.mark.parametrize("name", GROUPS)
def test_group_replays_like_eager(name: str) -> None:
    fn, inputs, ulps = GROUPS[name]
    args = inputs()
    check_replay(make_fx(fn)(*args), args, ulps)


def test_broadcasts_and_casts_are_explicit() -> None:
    """Every elementwise op of a recorded program sees tensor operands of one shape and dtype:
    nvFuser is never left to broadcast or promote."""
    elementwise = {"add", "sub", "mul", "div", "pow", "eq", "ne", "lt", "le", "gt", "ge"}
    for fn, inputs, _ in GROUPS.values():
        program = record(make_fx(fn)(*inputs()))
        for op in program.ops:
            if op.name in elementwise | {"where"}:
                infos = [program.values[a.index] for a in op.args if hasattr(a, "index")]
                if op.name == "where":
                    infos = infos[1:]
                assert len({i.shape for i in infos}) <= 1 and len({i.dtype for i in infos}) <= 1, str(op)


# ---------------------------------------------------------------------------------------------
# Real graphs: GPT's joint graph and a compiled Adam step, every fusible node replayed in place

NOT_FUSIBLE = {
    # by nature: matmuls, attention, lookups and scatters, randomness, lists, mutations
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "aten.embedding.default",
    "aten.embedding_dense_backward.default",
    "aten.nll_loss_forward.default",
    "aten.nll_loss_backward.default",
    "aten.native_dropout.default",
    "aten.copy_.default",
}

# Ops whose replay in place is not bitwise, with the ulps they need (see the module docstring).
IN_SITU_ULPS = {
    A.gelu.default: MATH_ULPS,
    A.gelu_backward.default: GELU_BACKWARD_ULPS,
    A.lerp.Scalar: FMA_ULPS,
    **dict.fromkeys(
        [
            A.native_layer_norm.default,
            A.native_layer_norm_backward.default,
            A._log_softmax.default,
            A._log_softmax_backward_data.default,
            A._safe_softmax.default,
            A._softmax_backward_data.default,
            A.sum.dim_IntList,
        ],
        REDUCTION_ULPS,
    ),
}


def _capture(fn: Callable[[], Any], **aot_kwargs: Any) -> list[tuple[fx.GraphModule, list]]:
    """Compile and run `fn` once; return each AOT graph with the real inputs it was called with."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    captured: list[tuple[fx.GraphModule, list]] = []

    def compiler(gm: fx.GraphModule, example_inputs: Any) -> Callable:
        entry: tuple[fx.GraphModule, list] = (gm, [])
        captured.append(entry)
        run = make_boxed_func(gm.forward)

        def call(args: list) -> Any:
            entry[1][:] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return run(args)

        call._boxed_call = True  # type: ignore[attr-defined]
        return call

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, inference_compiler=compiler, **aot_kwargs)
    torch.compile(fn, backend=backend)()
    torch._dynamo.reset()
    return captured


def _gpt_graphs(autocast_dropout: bool) -> list[tuple[fx.GraphModule, list]]:
    from benchmarks.models.gpt import GPTConfig, build, make_batch

    cfg = GPTConfig(
        vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1 if autocast_dropout else 0.0
    )
    model = build(cfg)
    idx, tgt = make_batch(cfg, batch_size=2, seq_len=8)

    def step() -> None:
        with torch.autocast("cpu", dtype=BF16, enabled=autocast_dropout):
            loss = model(idx, tgt)
        loss.backward()

    return _capture(step)


def _adam_graphs(foreach: bool) -> list[tuple[fx.GraphModule, list]]:
    p = torch.nn.Parameter(rnd(4, 8))
    p.grad = rnd(4, 8, seed=1)
    opt = torch.optim.Adam([p], lr=1e-2, foreach=foreach)
    return _capture(opt.step, keep_inference_input_mutations=True)


@pytest.fixture(scope="module")
def real_graphs() -> dict[str, list[tuple[fx.GraphModule, list]]]:
    return {
        "gpt": _gpt_graphs(False),
        "gpt-bf16-autocast-dropout": _gpt_graphs(True),
        "adam": _adam_graphs(False),
        "adam-foreach": _adam_graphs(True),
    }


def _run_keeping_values(gm: fx.GraphModule, args: list) -> dict[fx.Node, Any]:
    """Every node's value (tensors cloned, so later in-place ops cannot change them)."""
    values: dict[fx.Node, Any] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            v = super().run_node(n)
            values[n] = (
                tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in v)
                if isinstance(v, (tuple, list))
                else (v.clone() if isinstance(v, torch.Tensor) else v)
            )
            return v

    Keep(gm).run(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    return values


def _node_group(node: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]]:
    """`node` alone as a fusion group: its inputs become placeholders, its tensors outputs."""
    g = fx.Graph()
    env = {}
    for n in node.all_input_nodes:
        env[n] = g.placeholder(n.name)
        env[n].meta["val"] = n.meta["val"]
    new = g.node_copy(node, lambda n: env[n])
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        outs = []
        for i, v in enumerate(val):
            if isinstance(v, torch.Tensor):
                item = g.call_function(operator.getitem, (new, i))
                item.meta["val"] = v
                outs.append(item)
        g.output(tuple(outs))
    else:
        g.output((new,))
    return fx.GraphModule(torch.nn.Module(), g), list(node.all_input_nodes)


def test_captured_ops_are_classified(real_graphs: dict) -> None:
    """Every op GPT and Adam produce is either fusible or knowingly left out (the module docstring
    lists them)."""
    for name, graphs in real_graphs.items():
        for gm, _ in graphs:
            for n in gm.graph.nodes:
                if (
                    n.op == "call_function"
                    and not is_fusible(n.target)
                    and not str(n.target).startswith("aten._foreach_")
                ):
                    assert str(n.target) in NOT_FUSIBLE, f"{name}: {n.target} is neither fusible nor known not to be"


@pytest.mark.parametrize("name", ["gpt", "gpt-bf16-autocast-dropout", "adam"])
def test_every_fusible_node_of_real_graphs_replays_in_place(real_graphs: dict, name: str) -> None:
    """Each fusible node, with the inputs it really got, as a one-op group."""
    checked = 0
    for gm, args in real_graphs[name]:
        values = _run_keeping_values(gm, args)
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem or not is_fusible(node.target):
                continue
            group, inputs = _node_group(node)
            got = record(group).replay(*(values[n] for n in inputs))
            want = [v for v in outputs_of(values[node]) if isinstance(v, torch.Tensor)]
            for g, w in zip(got, want, strict=True):
                assert_matches(g, w, IN_SITU_ULPS.get(node.target, 0))
            checked += 1
    assert checked > 10


def _fusible_components(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Maximal connected sets of fusible nodes (a getitem belongs to its tuple's node), in
    graph order: the largest groups a partitioner could hand the executor."""

    def fusible(n: fx.Node) -> bool:
        if n.op != "call_function":
            return False
        if n.target is operator.getitem:
            return fusible(n.args[0])
        return is_fusible(n.target)

    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            n = parent[n]
        return n

    nodes = [n for n in gm.graph.nodes if fusible(n)]
    parent.update({n: n for n in nodes})
    for n in nodes:
        for m in n.all_input_nodes:
            if m in parent:
                parent[find(m)] = find(n)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def _component_group(members: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The members as one fusion group: values from outside become placeholders, tensor values
    read outside (or returned by the graph) become outputs."""
    inside = set(members)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [m for n in members for m in n.all_input_nodes if m not in inside]
    inputs = list(dict.fromkeys(inputs))
    for m in inputs:
        env[m] = g.placeholder(m.name)
        env[m].meta["val"] = m.meta["val"]
    for n in members:
        env[n] = g.node_copy(n, lambda m: env[m])
    outputs = [
        n for n in members if isinstance(n.meta.get("val"), torch.Tensor) and any(u not in inside for u in n.users)
    ]
    g.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), g), inputs, outputs


@pytest.mark.parametrize("name", ["gpt", "gpt-bf16-autocast-dropout", "adam"])
def test_fusible_components_of_real_graphs_replay_in_place(real_graphs: dict, name: str) -> None:
    """Multi-op groups cut from the real graphs (views feeding casts feeding layer norms, the
    whole optimizer step, ...), replayed with the inputs they really got."""
    sizes = []
    for gm, args in real_graphs[name]:
        values = _run_keeping_values(gm, args)
        for members in _fusible_components(gm):
            group, inputs, outputs = _component_group(members)
            if not outputs:
                continue
            got = record(group).replay(*(values[n] for n in inputs))
            ulps = max([IN_SITU_ULPS.get(n.target, 0) for n in members] + [0])
            for g, n in zip(got, outputs, strict=True):
                assert_matches(g, values[n], max(ulps, BF16_ULPS) if ulps and g.dtype == BF16 else ulps)
            sizes.append(len(members))
    assert max(sizes) > 5, sizes


def _without_mutations(gm: fx.GraphModule) -> fx.GraphModule:
    """The compiled optimizer step as one fusion group: the values it copies into parameters
    and state become the group's outputs."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    outs = []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n.target == A.copy_.default:
            outs.append(env[n.args[1]])
            continue
        env[n] = g.node_copy(n, lambda m: env[m])
    g.output(tuple(outs))
    return fx.GraphModule(gm, g)


def test_compiled_adam_step_is_one_group(real_graphs: dict) -> None:
    """The whole foreach=False Adam step (prims.fma, pow of the 0-d CPU step, lerp, addcdiv)
    records as one program and replays like eager."""
    ((gm, args),) = [(gm, a) for gm, a in real_graphs["adam"] if A.copy_.default in targets(gm)]
    group = _without_mutations(gm)
    program = check_replay(group, tuple(a.clone() for a in args), FMA_ULPS)
    assert any(s.is_cpu_scalar for s in program.inputs), "the step counter is a host scalar"


# ---------------------------------------------------------------------------------------------
# Input layouts: what define_tensor gets


@pytest.mark.parametrize(
    "make, contiguity, stride_order",
    [
        (lambda: torch.empty(2, 3, 4), [True, True, True], []),
        (lambda: torch.empty(4, 3).t(), [True, True], [0, 1]),
        (lambda: torch.empty(2, 3, 4).permute(2, 0, 1), [True, True, True], [0, 2, 1]),
        (lambda: torch.empty(4, 1).expand(4, 5), [True, None], []),
        (lambda: torch.empty(1, 5), [None, True], []),
        (lambda: torch.empty(4, 8)[:, ::2], [True, False], []),
        (lambda: torch.empty(4, 8)[:, :3], [False, True], []),
        (lambda: torch.tensor(1.0), [], []),
    ],
    ids=["contiguous", "transposed", "permuted", "expanded", "size-1", "strided-inner", "sliced", "0-d"],
)
def test_tensor_spec_layout(make: Callable, contiguity: list, stride_order: list) -> None:
    spec = TensorSpec.of(make())
    assert spec.contiguity == contiguity
    assert spec.stride_order == stride_order


def test_tensor_spec_marks_host_scalars() -> None:
    assert TensorSpec.of(torch.tensor(3.0)).is_cpu_scalar
    assert not TensorSpec.of(torch.ones(1)).is_cpu_scalar
    assert TensorSpec.of(torch.ones(1, 5)).symbolic_shape == [1, -1]


# ---------------------------------------------------------------------------------------------
# Emission into a FusionDefinition, checked against nvFuser's bindings without nvFuser

# nvFuser's frontend ops we emit: (max positional operands, keyword names), from its bindings.
NVFUSER_OPS: dict[str, tuple[int, set[str]]] = {
    **{
        n: (1, set())
        for n in ("neg", "abs", "exp", "log", "tanh", "erf", "sqrt", "rsqrt", "reciprocal", "sigmoid", "relu", "set")
    },
    **{n: (2, set()) for n in ("add", "sub", "mul", "div", "pow", "eq", "ne", "lt", "le", "gt", "ge")},
    "where": (3, set()),
    "cast": (1, {"dtype"}),
    "broadcast_in_dim": (1, {"shape", "broadcast_dims"}),
    "reshape": (1, {"new_shape"}),
    "permute": (1, {"dims"}),
    "squeeze": (1, {"dims", "squeeze_expanded"}),
    "slice": (1, {"start_indices", "end_indices", "strides", "manual_normalization"}),
    "cat": (1, {"dim", "manual_padding"}),
    "sum": (1, {"dims", "keepdim", "dtype"}),
    "max": (1, {"dims", "keepdim", "dtype"}),
    "var_mean": (1, {"dims", "correction", "keepdim"}),
    "full": (3, set()),
    "iota": (3, {"dtype"}),
}
NVFUSER_DTYPES = {
    "Double": torch.float64,
    "Float": F32,
    "Half": torch.float16,
    "BFloat16": BF16,
    "Int": torch.int64,
    "Int32": torch.int32,
    "Bool": torch.bool,
}


class FakeDataType:
    """Stands in for nvfuser.DataType: members are their own names."""

    def __getattr__(self, name: str) -> str:
        if name not in NVFUSER_DTYPES:
            raise AttributeError(name)
        return f"DataType.{name}"


@dataclass(frozen=True)
class FakeTensor:
    index: int


@dataclass(frozen=True)
class FakeScalar:
    value: Any


class FakeFusionDefinition:
    """Records a definition made through nvFuser's frontend API, rejects calls nvFuser's bindings
    would reject (unknown ops or keywords, raw Python numbers as operands), and executes the
    record with torch."""

    def __init__(self) -> None:
        self.inputs: list[dict] = []
        self.calls: list[tuple[str, tuple, dict, tuple]] = []
        self.outputs: list[FakeTensor] = []
        self.n = 0
        self.ops = self._Ops(self)

    def _new(self) -> FakeTensor:
        self.n += 1
        return FakeTensor(self.n - 1)

    def define_tensor(
        self, *, shape: list, contiguity: list, dtype: str, is_cpu: bool, stride_order: list
    ) -> FakeTensor:
        assert all(s in (-1, 1) for s in shape) and len(contiguity) == len(shape) and dtype.startswith("DataType.")
        assert not stride_order or sorted(stride_order) == list(range(len(shape)))
        t = self._new()
        self.inputs.append(
            {
                "tensor": t,
                "shape": shape,
                "contiguity": contiguity,
                "dtype": dtype,
                "is_cpu": is_cpu,
                "stride_order": stride_order,
            }
        )
        return t

    def define_scalar(self, value: Any, dtype: Any = None) -> FakeScalar:
        assert isinstance(value, (bool, int, float)), value
        return FakeScalar(value)

    def add_output(self, t: FakeTensor) -> None:
        assert isinstance(t, FakeTensor)
        self.outputs.append(t)

    class _Ops:
        def __init__(self, fd: FakeFusionDefinition) -> None:
            self.fd = fd

        def __getattr__(self, name: str) -> Callable:
            assert name in NVFUSER_OPS, f"nvFuser has no op {name!r}"
            max_pos, keywords = NVFUSER_OPS[name]

            def call(*args: Any, **kwargs: Any) -> Any:
                assert len(args) <= max_pos and set(kwargs) <= keywords, (name, args, kwargs)
                for a in args:
                    ok = (list, str) if name in ("full", "cat") else ()
                    assert isinstance(a, (FakeTensor, FakeScalar, *ok)), (
                        f"{name}: operand {a!r} must be a Tensor or Scalar"
                    )
                outs = tuple(self.fd._new() for _ in range(2 if name == "var_mean" else 1))
                self.fd.calls.append((name, args, kwargs, outs))
                return outs if len(outs) > 1 else outs[0]

            return call

    def execute(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        env = {spec["tensor"]: t for spec, t in zip(self.inputs, tensors, strict=True)}

        def val(a: Any) -> Any:
            if isinstance(a, FakeTensor):
                return env[a]
            if isinstance(a, FakeScalar):
                return a.value
            if isinstance(a, str):
                return NVFUSER_DTYPES[a.removeprefix("DataType.")]
            if isinstance(a, list):
                return [val(x) for x in a]
            return a

        for name, args, kwargs, outs in self.calls:
            kw = {k: val(v) for k, v in kwargs.items()}
            if name in ("full", "iota"):
                kw["device"] = tensors[0].device if tensors else torch.device("cpu")
            res = REPLAY_OPS[name](*(val(a) for a in args), **kw)
            env.update(zip(outs, res if len(outs) > 1 else (res,)))
        return [env[o] for o in self.outputs]


def as_if_on_cuda(program: FusionProgram) -> FusionProgram:
    """The same program with its non-scalar inputs marked as CUDA tensors."""
    inputs = [s if s.is_cpu_scalar else dataclasses.replace(s, device="cuda") for s in program.inputs]
    return dataclasses.replace(program, inputs=inputs)


def test_emitted_ops_exist_in_nvfuser() -> None:
    assert set(REPLAY_OPS) <= set(NVFUSER_OPS)


@pytest.mark.parametrize("name", GROUPS)
def test_emitted_definition_computes_the_group(name: str) -> None:
    fn, inputs, ulps = GROUPS[name]
    args = inputs()
    gm = make_fx(fn)(*args)
    fd = FakeFusionDefinition()
    emit_definition(fd, as_if_on_cuda(record(gm)), FakeDataType())
    for got, want in zip(fd.execute(list(args)), outputs_of(gm(*args)), strict=True):
        assert_matches(got, want, ulps)


def test_emitted_definition_of_adam_step(real_graphs: dict) -> None:
    ((gm, args),) = [(gm, a) for gm, a in real_graphs["adam"] if A.copy_.default in targets(gm)]
    group = _without_mutations(gm)
    fd = FakeFusionDefinition()
    emit_definition(fd, as_if_on_cuda(record(group)), FakeDataType())
    assert [spec["is_cpu"] for spec in fd.inputs].count(True) == 1
    for got, want in zip(
        fd.execute([a.clone() for a in args]), outputs_of(group(*[a.clone() for a in args])), strict=True
    ):
        assert_matches(got, want, FMA_ULPS)


def test_emit_passes_layouts_to_define_tensor() -> None:
    x = torch.empty(4, 3).t()
    gm = make_fx(lambda x: A.exp.default(x))(x)
    fd = FakeFusionDefinition()
    emit_definition(fd, as_if_on_cuda(record(gm)), FakeDataType())
    (spec,) = fd.inputs
    assert spec["stride_order"] == [0, 1] and spec["contiguity"] == [True, True] and spec["dtype"] == "DataType.Float"


def test_emit_refuses_non_cuda_inputs() -> None:
    gm = make_fx(lambda x: A.exp.default(x))(rnd(3))
    with pytest.raises(ValueError, match="CUDA"):
        emit_definition(FakeFusionDefinition(), record(gm), FakeDataType())


# ---------------------------------------------------------------------------------------------
# Errors, can_fuse, the executor


def test_unsupported_op_is_named() -> None:
    gm = make_fx(lambda a, b: A.mm.default(a, b))(rnd(2, 3), rnd(3, 2))
    with pytest.raises(UnsupportedOp, match=r"aten\.mm\.default"):
        record(gm)
    assert issubclass(UnsupportedOp, ValueError)


def test_float_arange_is_unsupported() -> None:
    gm = make_fx(lambda: A.arange.start_step(0.0, 1.0, 0.1))()
    with pytest.raises(UnsupportedOp, match="arange"):
        record(gm)


def test_replay_checks_its_inputs() -> None:
    program = record(make_fx(lambda x: A.exp.default(x))(rnd(3)))
    with pytest.raises(ValueError, match="expected"):
        program.replay(rnd(4))


def test_node_is_fusible() -> None:
    gm = make_fx(lambda a, b, d: (A.mm.default(a, b), A.add.Tensor(a, 1), A.add.Tensor(d, 1)))(
        rnd(2, 3), rnd(3, 2), rnd(2, dtype=torch.float64)
    )
    verdict = {
        str(n.target) + str(n.args[0]): node_is_fusible(n, require_cuda=False)
        for n in gm.graph.nodes
        if n.op == "call_function"
    }
    assert verdict == {"aten.mm.defaulta_1": False, "aten.add.Tensora_1": True, "aten.add.Tensord_1": False}
    add = next(n for n in gm.graph.nodes if n.target == A.add.Tensor)
    assert not node_is_fusible(add)  # CPU tensors: not for nvFuser


@pytest.mark.skipif(nvfuser_available(), reason="nvFuser is available here")
def test_executor_without_nvfuser_explains_the_extra() -> None:
    with pytest.raises(RuntimeError) as err:
        NvFuserExecutor()
    msg = str(err.value)
    assert "optional" in msg and "torch 2.10" in msg and "pip install optsched[nvfuser]" in msg and "CUDA" in msg


@needs_nvfuser
@pytest.mark.gpu
@pytest.mark.parametrize(
    "name", ["gelu-mlp-tail", "gelu-mlp-tail-bf16", "layer-norm", "adam-update", "bias-gelu-tanh-chain"]
)
def test_compile_group_on_cuda_matches_eager(name: str) -> None:
    """The only test that runs nvFuser: its kernels use CUDA's own math functions, so allow a
    few more ulps than the replay needs."""
    fn, inputs, ulps = GROUPS[name]
    args = tuple(a.cuda() for a in inputs())
    gm = make_fx(fn)(*args)
    run = NvFuserExecutor().compile_group(gm, args)
    for got, want in zip(run(*args), outputs_of(gm(*args)), strict=True):
        assert_matches(got, want, max(4, 2 * ulps))
