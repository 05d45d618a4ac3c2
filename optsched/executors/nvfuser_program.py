"""A fusion group as a small program of nvFuser primitives, and a torch replay of it.

`record(gm)` translates a fusion group (an fx.GraphModule of ATen ops, see `base.py`) into a
`FusionProgram`: input specs, a list of `FusionOp`s named after nvFuser's Python frontend ops
(`fd.ops.<name>`), and output indices. Everything nvFuser leaves implicit or does differently
from ATen is made explicit here, so that the program means the same thing on both sides:

- broadcasting is a `broadcast_in_dim` (nvFuser's binary ops take operands of one shape);
- type promotion is explicit `cast`s: every elementwise op sees tensor operands of one dtype.
  Arithmetic on float16/bfloat16 runs in float32 and is cast back, which is what ATen's
  kernels do (they compute in "opmath" and round once per op); comparisons run in the
  promoted dtype with Python scalars rounded to it, as ATen does;
- composite ATen ops (gelu, layer norm, softmax, lerp, addcdiv, ...) become primitives.

`FusionProgram.replay` runs the program with torch ops, one per fusion op, and checks every
value against the shape and dtype the recorder claimed. That makes the translation testable
on a machine without nvFuser; `optsched/executors/nvfuser.py` emits the same program into a
`FusionDefinition`. This module never imports nvFuser.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# The IR


@dataclass(frozen=True)
class Ref:
    """A reference to an earlier value of the program (inputs first, then op results)."""

    index: int

    def __repr__(self) -> str:
        return f"%{self.index}"


@dataclass(frozen=True)
class ValueInfo:
    """What the recorder promises about a value: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorSpec:
    """A group input as nvFuser's `define_tensor` wants it: shape, dtype and memory layout."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    device: str = "cpu"

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype, tuple(t.stride()), t.device.type)

    @property
    def is_cpu_scalar(self) -> bool:
        """A 0-d CPU tensor (Adam's `step`): nvFuser takes it as a host scalar (`is_cpu=True`)."""
        return self.device == "cpu" and not self.shape

    @property
    def symbolic_shape(self) -> list[int]:
        """nvFuser's shape convention: 1 marks a broadcast dimension, -1 any other size."""
        return [1 if s == 1 else -1 for s in self.shape]

    @property
    def contiguity(self) -> list[bool | None]:
        """Per dimension in allocation order (outermost first): whether its stride equals the
        extent of the next non-broadcast dimension inward (1 for the innermost); None for
        broadcast dimensions (size 1 or stride 0)."""
        order = self._allocation_order()
        out: list[bool | None] = []
        for pos, d in enumerate(order):
            if self._is_broadcast(d):
                out.append(None)
                continue
            inner = [e for e in order[pos + 1 :] if not self._is_broadcast(e)]
            expected = self.stride[inner[0]] * self.shape[inner[0]] if inner else 1
            out.append(self.stride[d] == expected)
        return out

    @property
    def stride_order(self) -> list[int]:
        """nvFuser's `stride_order`: entry d is 0 for the innermost dimension, rank-1 for the
        outermost. Empty when the layout is row-major (nvFuser's default)."""
        order = self._allocation_order()
        rank = len(order)
        result = [0] * rank
        for pos, d in enumerate(order):
            result[d] = rank - 1 - pos
        return [] if order == list(range(rank)) else result

    def _is_broadcast(self, d: int) -> bool:
        return self.stride[d] == 0 or self.shape[d] == 1

    def _allocation_order(self) -> list[int]:
        """Dimensions outermost first: strided ones by decreasing stride (stable), stride-0
        ones kept at their logical position."""
        strided = sorted((d for d in range(len(self.shape)) if self.stride[d] != 0), key=lambda d: -self.stride[d])
        for d in range(len(self.shape)):
            if self.stride[d] == 0:
                strided.insert(d, d)
        return strided


@dataclass(frozen=True)
class FusionOp:
    """One nvFuser op. `args` are operands (Refs, Python scalars, or lists of Refs/ints);
    `kwargs` are attributes passed by keyword (dims, shapes, dtypes). `results` are the value
    indices it defines (var_mean and split define several). `origin` is the ATen node it came
    from, for error messages."""

    name: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    results: tuple[int, ...] = ()
    origin: str = ""

    def __str__(self) -> str:
        lhs = ", ".join(f"%{i}" for i in self.results)
        parts = [repr(a) for a in self.args] + [f"{k}={_fmt(v)}" for k, v in self.kwargs.items()]
        return f"{lhs} = {self.name}({', '.join(parts)})" + (f"  # {self.origin}" if self.origin else "")


def _fmt(v: Any) -> str:
    return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else repr(v)


@dataclass
class FusionProgram:
    inputs: list[TensorSpec]
    ops: list[FusionOp]
    outputs: tuple[int, ...]
    values: list[ValueInfo]

    def __str__(self) -> str:
        lines = [f"%{i}: input {tuple(s.shape)} {_fmt(s.dtype)}" for i, s in enumerate(self.inputs)]
        lines += [str(op) for op in self.ops]
        lines.append("outputs: " + ", ".join(f"%{i}" for i in self.outputs))
        return "\n".join(lines)

    def replay(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the program with torch ops (one per fusion op) and check every value's shape
        and dtype against what `record` promised."""
        if len(tensors) != len(self.inputs):
            raise ValueError(f"program takes {len(self.inputs)} inputs, got {len(tensors)}")
        env: dict[int, torch.Tensor] = {}
        for i, (t, spec) in enumerate(zip(tensors, self.inputs)):
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise ValueError(f"input {i}: expected {spec.shape} {spec.dtype}, got {tuple(t.shape)} {t.dtype}")
            env[i] = t
        device = tensors[0].device if tensors else torch.device("cpu")
        for op in self.ops:
            out = _run(op, env, device)
            outs = out if isinstance(out, tuple) else (out,)
            for idx, value in zip(op.results, outs, strict=True):
                _check(op, idx, value, self.values[idx])
                env[idx] = value
        return tuple(env[i] for i in self.outputs)


def _run(op: FusionOp, env: dict[int, torch.Tensor], device: torch.device) -> Any:
    def resolve(a: Any) -> Any:
        if isinstance(a, Ref):
            return env[a.index]
        if isinstance(a, (list, tuple)):
            return [resolve(x) for x in a]
        return a

    args = [resolve(a) for a in op.args]
    kwargs = {k: resolve(v) for k, v in op.kwargs.items()}
    if op.name in _NEEDS_DEVICE:
        kwargs["device"] = device
    return REPLAY_OPS[op.name](*args, **kwargs)


def _check(op: FusionOp, idx: int, value: torch.Tensor, info: ValueInfo) -> None:
    if tuple(value.shape) != info.shape or value.dtype != info.dtype:
        raise AssertionError(
            f"replay of `{op}` gave %{idx} as {tuple(value.shape)} {value.dtype}; "
            f"the recorder promised {info.shape} {info.dtype}"
        )


# ---------------------------------------------------------------------------------------------
# Replay: the torch meaning of each fusion op


def _scalar_first(fn: Callable) -> Callable:
    """torch's binary functions want a tensor first; nvFuser's also take (scalar, tensor)."""

    def call(a: Any, b: Any) -> torch.Tensor:
        if not isinstance(a, torch.Tensor):
            a = torch.tensor(a, dtype=b.dtype, device=b.device)
        return fn(a, b)

    return call


def _broadcast_in_dim(t: torch.Tensor, shape: list[int], broadcast_dims: list[int]) -> torch.Tensor:
    view = [1] * len(shape)
    for src, dst in enumerate(broadcast_dims):
        view[dst] = t.shape[src]
    return t.reshape(view).expand(shape)


def _slice(t: torch.Tensor, start_indices: list[int], end_indices: list[int], strides: list[int]) -> torch.Tensor:
    return t[tuple(slice(s, e, st) for s, e, st in zip(start_indices, end_indices, strides))]


def _full(shape: list[int], fill_value: Any, dtype: torch.dtype, *, device: torch.device) -> torch.Tensor:
    return torch.full(shape, fill_value, dtype=dtype, device=device)


def _iota(length: int, start: Any, step: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return start + step * torch.arange(length, dtype=dtype, device=device)


REPLAY_OPS: dict[str, Callable[..., Any]] = {
    **{
        name: _scalar_first(getattr(torch, name))
        for name in ("add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge")
    },
    "pow": torch.pow,
    **{
        name: getattr(torch, name)
        for name in ("neg", "abs", "exp", "log", "tanh", "erf", "sqrt", "rsqrt", "reciprocal", "sigmoid", "relu")
    },
    "where": torch.where,
    "cast": lambda t, dtype: t.to(dtype),
    "set": lambda t: t.clone(),
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": lambda t, new_shape: t.reshape(new_shape),
    "permute": lambda t, dims: t.permute(dims),
    "squeeze": lambda t, dims: t.squeeze(tuple(dims)),
    "slice": _slice,
    "cat": lambda tensors, dim: torch.cat(tensors, dim),
    "sum": lambda t, dims, keepdim=False: torch.sum(t, dims, keepdim),
    "max": lambda t, dims, keepdim=False: torch.amax(t, dims, keepdim),
    "var_mean": lambda t, dims, correction, keepdim=False: torch.var_mean(
        t, dims, correction=correction, keepdim=keepdim
    ),
    "full": _full,
    "iota": _iota,
}
_NEEDS_DEVICE = {"full", "iota"}


# ---------------------------------------------------------------------------------------------
# Recording


class UnsupportedOp(ValueError):
    """An fx node the nvFuser translation does not cover; the message names the op."""


_REDUCED = {torch.float16, torch.bfloat16}
Operand = Ref | int | float | bool


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype ATen computes in: float32 for float16/bfloat16, the dtype itself otherwise."""
    return torch.float32 if dtype in _REDUCED else dtype


def _as_scalar(value: Any, dtype: torch.dtype) -> int | float | bool:
    """A Python scalar of dtype's category, so nvFuser's scalar never promotes the tensor."""
    if dtype.is_floating_point:
        return float(value)
    if dtype == torch.bool:
        return bool(value)
    return int(value)


def _round_to(value: Any, dtype: torch.dtype) -> int | float | bool:
    """`value` as ATen sees it once converted to dtype (comparisons convert their scalar)."""
    if dtype.is_floating_point:
        return float(torch.tensor(value, dtype=dtype))
    return _as_scalar(value, dtype)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _norm_dims(dims: Sequence[int] | int | None, ndim: int) -> list[int]:
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(_norm_dim(d, ndim) for d in dims)


class _Recorder:
    """Builds a FusionProgram: emits ops, tracks each value's shape and dtype, and offers the
    explicit-cast, explicit-broadcast elementwise builder the lowerings use."""

    def __init__(self) -> None:
        self.values: list[ValueInfo] = []
        self.ops: list[FusionOp] = []
        self.origin = ""

    def info(self, ref: Ref) -> ValueInfo:
        return self.values[ref.index]

    def new_value(self, info: ValueInfo) -> Ref:
        self.values.append(info)
        return Ref(len(self.values) - 1)

    def emit(self, name: str, *args: Any, out: ValueInfo, **kwargs: Any) -> Ref:
        ref = self.new_value(out)
        self.ops.append(FusionOp(name, args, kwargs, (ref.index,), self.origin))
        return ref

    def emit_multi(self, name: str, *args: Any, outs: Sequence[ValueInfo], **kwargs: Any) -> tuple[Ref, ...]:
        refs = tuple(self.new_value(o) for o in outs)
        self.ops.append(FusionOp(name, args, kwargs, tuple(r.index for r in refs), self.origin))
        return refs

    # -- layout and dtype -----------------------------------------------------------------

    def cast(self, ref: Ref, dtype: torch.dtype) -> Ref:
        info = self.info(ref)
        return ref if info.dtype == dtype else self.emit("cast", ref, out=ValueInfo(info.shape, dtype), dtype=dtype)

    def copy(self, ref: Ref) -> Ref:
        return self.emit("set", ref, out=self.info(ref))

    def broadcast(self, ref: Ref, shape: Sequence[int]) -> Ref:
        """Right-aligned broadcast (torch's rule) spelled out as nvFuser's broadcast_in_dim."""
        info, shape = self.info(ref), tuple(shape)
        if info.shape == shape:
            return ref
        offset = len(shape) - len(info.shape)
        if offset < 0 or any(s not in (1, shape[offset + i]) for i, s in enumerate(info.shape)):
            raise AssertionError(f"cannot broadcast {info.shape} to {shape}")
        dims = [offset + i for i in range(len(info.shape))]
        return self.emit(
            "broadcast_in_dim", ref, out=ValueInfo(shape, info.dtype), shape=list(shape), broadcast_dims=dims
        )

    def reshape(self, ref: Ref, shape: Sequence[int]) -> Ref:
        info = self.info(ref)
        if info.shape == tuple(shape):
            return ref
        return self.emit("reshape", ref, out=ValueInfo(tuple(shape), info.dtype), new_shape=list(shape))

    def permute(self, ref: Ref, dims: Sequence[int]) -> Ref:
        info = self.info(ref)
        dims = [_norm_dim(d, len(info.shape)) for d in dims]
        if dims == sorted(dims):
            return ref
        shape = tuple(info.shape[d] for d in dims)
        return self.emit("permute", ref, out=ValueInfo(shape, info.dtype), dims=dims)

    # -- elementwise ------------------------------------------------------------------------

    def ew(
        self, name: str, *operands: Operand, dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None
    ) -> Ref:
        """An elementwise op. With `dtype`, tensor operands are cast to it and scalars made of its
        category first; then tensors are broadcast to the common shape. The tensor operands must
        end up with one dtype: promotion is the caller's decision, never nvFuser's."""
        refs = [o for o in operands if isinstance(o, Ref)]
        if not refs:
            raise AssertionError(f"{name}: elementwise op without a tensor operand")
        if dtype is not None:
            operands = tuple(self.cast(o, dtype) if isinstance(o, Ref) else _as_scalar(o, dtype) for o in operands)
            refs = [o for o in operands if isinstance(o, Ref)]
        dtypes = {self.info(r).dtype for r in refs}
        if len(dtypes) != 1:
            raise AssertionError(f"{name}: operands of different dtypes {dtypes}; cast them first")
        shape = tuple(torch.broadcast_shapes(*(self.info(r).shape for r in refs)))
        operands = tuple(self.broadcast(o, shape) if isinstance(o, Ref) else o for o in operands)
        return self.emit(name, *operands, out=ValueInfo(shape, out_dtype or dtypes.pop()))

    def where(self, cond: Ref, a: Operand, b: Operand, dtype: torch.dtype) -> Ref:
        refs = [cond] + [o for o in (a, b) if isinstance(o, Ref)]
        if not isinstance(a, Ref) and not isinstance(b, Ref):
            a = self.full(self.info(cond).shape, a, dtype)
            refs.append(a)
        shape = tuple(torch.broadcast_shapes(*(self.info(r).shape for r in refs)))
        cond = self.broadcast(self.cast(cond, torch.bool), shape)
        a, b = (
            self.broadcast(self.cast(o, dtype), shape) if isinstance(o, Ref) else _as_scalar(o, dtype) for o in (a, b)
        )
        return self.emit("where", cond, a, b, out=ValueInfo(shape, dtype))

    def full(self, shape: Sequence[int], value: Any, dtype: torch.dtype) -> Ref:
        return self.emit("full", list(shape), _as_scalar(value, dtype), dtype, out=ValueInfo(tuple(shape), dtype))

    # -- reductions -------------------------------------------------------------------------

    def reduce(self, name: str, ref: Ref, dims: list[int], keepdim: bool) -> Ref:
        info = self.info(ref)
        shape = (
            tuple(1 if d in dims else s for d, s in enumerate(info.shape))
            if keepdim
            else tuple(s for d, s in enumerate(info.shape) if d not in dims)
        )
        return self.emit(name, ref, out=ValueInfo(shape, info.dtype), dims=dims, keepdim=keepdim)


# ---------------------------------------------------------------------------------------------
# Lowerings: one handler per ATen overload


_LOWERINGS: dict[Any, Callable[..., Any]] = {}


def _lowers(*targets: Any) -> Callable:
    def register(fn: Callable) -> Callable:
        for t in targets:
            _LOWERINGS[t] = fn
        return fn

    return register


def _bind(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    positional = list(args)
    for a in target._schema.arguments:
        if positional and not a.kwarg_only:
            bound[a.name] = positional.pop(0)
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
        else:
            raise UnsupportedOp(f"{target}: missing argument {a.name!r}")
    return bound


def _val(node: fx.Node) -> Any:
    return node.meta["val"]


def _probe(r: _Recorder, x: Operand) -> Any:
    """Something torch.result_type accepts standing for x: a meta tensor of x's rank-class."""
    if not isinstance(x, Ref):
        return x
    info = r.info(x)
    return torch.empty((1,) * len(info.shape), dtype=info.dtype, device="meta")


# -- elementwise arithmetic -------------------------------------------------------------------


def _arith(r: _Recorder, node: fx.Node, name: str, a: Operand, b: Operand) -> Ref:
    """One arithmetic op in ATen's opmath dtype, cast to the node's dtype."""
    out = _val(node).dtype
    return r.cast(r.ew(name, a, b, dtype=_opmath(out)), out)


def _scaled(r: _Recorder, x: Operand, alpha: Any, dtype: torch.dtype) -> Operand:
    """alpha * x (the `alpha` of add/sub); folded when x is a Python scalar."""
    if alpha == 1:
        return x
    if not isinstance(x, Ref):
        return x * alpha
    return r.ew("mul", x, alpha, dtype=dtype)


@_lowers(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
def _add_sub(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    cd = _opmath(_val(node).dtype)
    name = "add" if node.target in (aten.add.Tensor, aten.add.Scalar) else "sub"
    return _arith(r, node, name, a["self"], _scaled(r, a["other"], a["alpha"], cd))


@_lowers(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    cd = _opmath(_val(node).dtype)
    return _arith(r, node, "sub", a["other"], _scaled(r, a["self"], a["alpha"], cd))


@_lowers(aten.mul.Tensor, aten.mul.Scalar)
def _mul(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return _arith(r, node, "mul", a["self"], a["other"])


@_lowers(aten.div.Tensor, aten.div.Scalar)
def _div(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return _arith(r, node, "div", a["self"], a["other"])


@_lowers(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def _pow(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return _arith(r, node, "pow", a["self"], a["exponent"])


@_lowers(
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
)
def _compare(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x, y = a["self"], a["other"]
    cd = torch.result_type(_probe(r, x), _probe(r, y))
    x, y = (o if isinstance(o, Ref) else _round_to(o, cd) for o in (x, y))
    return r.ew(node.target.overloadpacket.__name__, x, y, dtype=cd, out_dtype=torch.bool)


_UNARY = {
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.tanh.default: "tanh",
    aten.erf.default: "erf",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.reciprocal.default: "reciprocal",
    aten.sigmoid.default: "sigmoid",
    aten.relu.default: "relu",
}


@_lowers(*_UNARY)
def _unary(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    out = _val(node).dtype
    return r.cast(r.ew(_UNARY[node.target], a["self"], dtype=_opmath(out)), out)


@_lowers(aten.where.self)
def _where(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return r.where(a["condition"], a["self"], a["other"], _val(node).dtype)


@_lowers(aten.threshold_backward.default)
def _threshold_backward(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """grad where self > threshold, else 0 (ATen: `self <= threshold ? 0 : grad`)."""
    x = a["self"]
    below = r.ew("le", x, _round_to(a["threshold"], r.info(x).dtype), out_dtype=torch.bool)
    return r.where(below, 0, a["grad_output"], _val(node).dtype)


# -- composite pointwise ops, lowered in opmath ---------------------------------------------

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_GELU_PDF = 2.0 / math.sqrt(math.pi) * _SQRT1_2 * 0.5  # 1/sqrt(2*pi)
_GELU_BETA = math.sqrt(2.0) * 2.0 / math.sqrt(math.pi) * 0.5  # sqrt(2/pi)
_GELU_KAPPA = 0.044715


def _gelu_tanh_inner(r: _Recorder, x: Ref) -> tuple[Ref, Ref]:
    """(x*x, tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    x2 = r.ew("mul", x, x)
    x3 = r.ew("mul", x2, x)
    inner = r.ew("mul", r.ew("add", x, r.ew("mul", x3, _GELU_KAPPA)), _GELU_BETA)
    return x2, r.ew("tanh", inner)


@_lowers(aten.gelu.default)
def _gelu(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    out = _val(node).dtype
    x = r.cast(a["self"], _opmath(out))
    half_x = r.ew("mul", x, 0.5)
    if a["approximate"] == "tanh":
        _, t = _gelu_tanh_inner(r, x)
    else:
        t = r.ew("erf", r.ew("mul", x, _SQRT1_2))
    return r.cast(r.ew("mul", half_x, r.ew("add", t, 1.0)), out)


@_lowers(aten.gelu_backward.default)
def _gelu_backward(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """d/dx gelu: cdf(x) + x*pdf(x) for the erf form; product rule on 0.5x(1+tanh(u)) else."""
    out = _val(node).dtype
    cd = _opmath(out)
    x, g = r.cast(a["self"], cd), r.cast(a["grad_output"], cd)
    if a["approximate"] == "tanh":
        x2, t = _gelu_tanh_inner(r, x)
        left = r.ew("mul", x, 0.5)
        d_left = r.ew("mul", r.ew("add", t, 1.0), 0.5)
        d_tanh = r.ew("sub", 1.0, r.ew("mul", t, t))
        d_inner = r.ew("mul", r.ew("add", r.ew("mul", x2, 3.0 * _GELU_KAPPA), 1.0), _GELU_BETA)
        d_right = r.ew("mul", r.ew("mul", left, d_tanh), d_inner)
        return r.cast(r.ew("mul", g, r.ew("add", d_left, d_right)), out)
    cdf = r.ew("mul", r.ew("add", r.ew("erf", r.ew("mul", x, _SQRT1_2)), 1.0), 0.5)
    pdf = r.ew("mul", r.ew("exp", r.ew("mul", r.ew("mul", x, x), -0.5)), _GELU_PDF)
    return r.cast(r.ew("mul", g, r.ew("add", cdf, r.ew("mul", x, pdf))), out)


def _add_combined(r: _Recorder, node: fx.Node, a: dict, combine: str) -> Ref:
    """self + (value * t1) <combine> t2, in ATen's order, in the op-math dtype."""
    out = _val(node).dtype
    cd = _opmath(out)
    t1 = r.cast(a["tensor1"], cd)
    if a["value"] != 1:
        t1 = r.ew("mul", t1, a["value"], dtype=cd)
    term = r.ew(combine, t1, a["tensor2"], dtype=cd)
    return r.cast(r.ew("add", a["self"], term, dtype=cd), out)


@_lowers(aten.addcmul.default)
def _addcmul(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """self + value * t1 * t2."""
    return _add_combined(r, node, a, "mul")


@_lowers(aten.addcdiv.default)
def _addcdiv(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """self + value * t1 / t2."""
    return _add_combined(r, node, a, "div")


@_lowers(aten.lerp.Scalar, aten.lerp.Tensor)
def _lerp(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """ATen's two-sided formula: start + w*(end-start) for |w| < 0.5, else end - (end-start)*(1-w),
    exact at both ends. A scalar weight picks its side here; a tensor weight selects per element."""
    out = _val(node).dtype
    cd = _opmath(out)
    start, end, w = r.cast(a["self"], cd), r.cast(a["end"], cd), a["weight"]
    diff = r.ew("sub", end, start)
    if not isinstance(w, Ref):
        if abs(w) < 0.5:
            res = r.ew("add", start, r.ew("mul", diff, w))
        else:
            res = r.ew("sub", end, r.ew("mul", diff, 1.0 - w))
        return r.cast(res, out)
    w = r.cast(w, cd)
    low = r.ew("add", start, r.ew("mul", w, diff))
    high = r.ew("sub", end, r.ew("mul", diff, r.ew("sub", 1.0, w)))
    small = r.ew("lt", r.ew("abs", w), 0.5, out_dtype=torch.bool)
    return r.cast(r.where(small, low, high, cd), out)


def _fma(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """prims.fma (made by dynamo from `addcmul_` with a value): a*b + c. Its eager kernel rounds
    after the multiply too, so this is the same formula."""
    out = _val(node).dtype
    cd = _opmath(out)
    prod = r.ew("mul", a["a"], a["b"], dtype=cd)
    return r.cast(r.ew("add", prod, a["c"], dtype=cd), out)


@_lowers(aten.native_dropout_backward.default)
def _dropout_backward(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """grad * mask * scale, as ATen writes it."""
    out = _val(node).dtype
    cd = _opmath(out)
    masked = r.cast(r.ew("mul", a["grad_output"], a["mask"], dtype=cd), out)
    return r.cast(r.ew("mul", masked, a["scale"], dtype=cd), out)


# -- dtype, copies, constants -----------------------------------------------------------------


@_lowers(aten._to_copy.default)
def _to_copy(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x = a["self"]
    src = node.args[0].meta["val"]
    if _val(node).device != src.device:
        raise UnsupportedOp(f"{node.target}: device change {src.device} -> {_val(node).device} is not fusible")
    out = _val(node).dtype
    return r.copy(x) if r.info(x).dtype == out else r.cast(x, out)


@_lowers(aten.clone.default)
def _clone(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return r.copy(a["self"])


@_lowers(aten.copy.default)
def _copy(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """Functional copy: src converted to self's dtype and broadcast to self's shape."""
    dst = r.info(a["self"])
    src = a["src"]
    res = r.broadcast(r.cast(src, dst.dtype), dst.shape)
    return r.copy(res) if res == src else res


@_lowers(aten.detach.default, aten.alias.default)
def _identity(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return a["self"]


@_lowers(
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.scalar_tensor.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
)
def _constant(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    fill = {aten.zeros.default: 0, aten.zeros_like.default: 0, aten.ones.default: 1, aten.ones_like.default: 1}
    value = fill.get(node.target, a.get("fill_value", a.get("s")))
    v = _val(node)
    return r.full(tuple(v.shape), value, v.dtype)


@_lowers(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    v = _val(node)
    if v.dtype.is_floating_point:
        raise UnsupportedOp(f"{node.target}: floating-point arange (its rounding is ATen's own)")
    start, step = int(a.get("start", 0)), int(a.get("step", 1))
    return r.emit("iota", v.shape[0], start, step, out=ValueInfo(tuple(v.shape), v.dtype), dtype=v.dtype)


@_lowers(aten.tril.default)
def _tril(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """Keep x[..., i, j] where j - i <= diagonal, built from two iotas."""
    x = a["self"]
    info = r.info(x)
    rows, cols = info.shape[-2:]
    i = r.emit("iota", rows, 0, 1, out=ValueInfo((rows,), torch.int64), dtype=torch.int64)
    j = r.emit("iota", cols, 0, 1, out=ValueInfo((cols,), torch.int64), dtype=torch.int64)
    i = r.emit("broadcast_in_dim", i, out=ValueInfo((rows, cols), torch.int64), shape=[rows, cols], broadcast_dims=[0])
    j = r.emit("broadcast_in_dim", j, out=ValueInfo((rows, cols), torch.int64), shape=[rows, cols], broadcast_dims=[1])
    keep = r.ew("le", r.ew("sub", j, i), int(a["diagonal"]), out_dtype=torch.bool)
    return r.where(keep, x, 0, info.dtype)


# -- views (nvFuser makes them copies when they leave the kernel) -----------------------------


@_lowers(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return r.reshape(a["self"], tuple(_val(node).shape))


@_lowers(aten.permute.default)
def _permute(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return r.permute(a["self"], a["dims"])


@_lowers(aten.t.default)
def _t(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x = a["self"]
    return r.permute(x, [1, 0]) if len(r.info(x).shape) == 2 else x


@_lowers(aten.transpose.int)
def _transpose(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x = a["self"]
    ndim = len(r.info(x).shape)
    dims = list(range(ndim))
    d0, d1 = _norm_dim(a["dim0"], ndim), _norm_dim(a["dim1"], ndim)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return r.permute(x, dims)


@_lowers(aten.expand.default)
def _expand(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    return r.broadcast(a["self"], tuple(_val(node).shape))


@_lowers(aten.unsqueeze.default)
def _unsqueeze(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x = a["self"]
    shape = tuple(_val(node).shape)
    dim = _norm_dim(a["dim"], len(shape))
    dims = [d for d in range(len(shape)) if d != dim]
    return r.emit("broadcast_in_dim", x, out=ValueInfo(shape, r.info(x).dtype), shape=list(shape), broadcast_dims=dims)


@_lowers(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x = a["self"]
    info = r.info(x)
    dims = _norm_dims(a.get("dim"), len(info.shape))
    dims = [d for d in dims if info.shape[d] == 1]
    if not dims:
        return x
    shape = tuple(s for d, s in enumerate(info.shape) if d not in dims)
    return r.emit("squeeze", x, out=ValueInfo(shape, info.dtype), dims=dims)


def _slice_of(r: _Recorder, x: Ref, dim: int, start: int, end: int, step: int = 1) -> Ref:
    info = r.info(x)
    starts = [0] * len(info.shape)
    ends = list(info.shape)
    steps = [1] * len(info.shape)
    starts[dim], ends[dim], steps[dim] = start, end, step
    shape = list(info.shape)
    shape[dim] = max(0, -(-(end - start) // step))
    return r.emit(
        "slice", x, out=ValueInfo(tuple(shape), info.dtype), start_indices=starts, end_indices=ends, strides=steps
    )


@_lowers(aten.slice.Tensor)
def _slice_tensor(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x = a["self"]
    info = r.info(x)
    dim = _norm_dim(a["dim"], len(info.shape))
    start, end, step = slice(a["start"], a["end"], a["step"]).indices(info.shape[dim])
    if (start, end, step) == (0, info.shape[dim], 1):
        return x
    return _slice_of(r, x, dim, start, end, step)


@_lowers(aten.split.Tensor, aten.split_with_sizes.default)
def _split(r: _Recorder, node: fx.Node, a: dict) -> tuple[Ref, ...]:
    x = a["self"]
    dim = _norm_dim(a["dim"], len(r.info(x).shape))
    pieces, start = [], 0
    for v in _val(node):
        size = v.shape[dim]
        pieces.append(_slice_of(r, x, dim, start, start + size))
        start += size
    return tuple(pieces)


def _take(r: _Recorder, x: Ref, dim: int, index: int) -> Ref:
    """x.select(dim, index): a one-wide slice with that dim squeezed away."""
    info = r.info(x)
    piece = _slice_of(r, x, dim, index, index + 1)
    shape = tuple(s for d, s in enumerate(info.shape) if d != dim)
    return r.emit("squeeze", piece, out=ValueInfo(shape, info.dtype), dims=[dim])


@_lowers(aten.select.int)
def _select(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x = a["self"]
    shape = r.info(x).shape
    dim = _norm_dim(a["dim"], len(shape))
    return _take(r, x, dim, _norm_dim(a["index"], shape[dim]))


@_lowers(aten.unbind.int)
def _unbind(r: _Recorder, node: fx.Node, a: dict) -> tuple[Ref, ...]:
    x = a["self"]
    shape = r.info(x).shape
    dim = _norm_dim(a["dim"], len(shape))
    return tuple(_take(r, x, dim, i) for i in range(shape[dim]))


@_lowers(aten.cat.default)
def _cat(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    v = _val(node)
    tensors = [r.cast(t, v.dtype) for t in a["tensors"]]
    dim = _norm_dim(a["dim"], v.dim())
    return r.emit("cat", tensors, out=ValueInfo(tuple(v.shape), v.dtype), dim=dim)


# -- reductions and normalizations ------------------------------------------------------------


@_lowers(aten.sum.dim_IntList, aten.sum.default)
def _sum(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """Sums accumulate in float32 for half types and in int64 for bool/int (torch's rule)."""
    x, out = a["self"], _val(node).dtype
    dims = _norm_dims(a.get("dim"), len(r.info(x).shape))
    s = r.reduce("sum", r.cast(x, _opmath(out)), dims, bool(a.get("keepdim", False)))
    return r.cast(s, out)


@_lowers(aten.mean.dim)
def _mean(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """sum / n, as ATen's CPU mean does."""
    x, out = a["self"], _val(node).dtype
    shape = r.info(x).shape
    dims = _norm_dims(a["dim"], len(shape))
    s = r.reduce("sum", r.cast(x, _opmath(out)), dims, bool(a["keepdim"]))
    return r.cast(r.ew("div", s, float(math.prod(shape[d] for d in dims))), out)


@_lowers(aten.amax.default)
def _amax(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    x = a["self"]
    return r.reduce("max", x, _norm_dims(a["dim"], len(r.info(x).shape)), bool(a["keepdim"]))


def _keep(r: _Recorder, x: Ref, dim: int, name: str) -> Ref:
    """A keepdim reduction over one dim, broadcast back to x's shape."""
    return r.broadcast(r.reduce(name, x, [dim], True), r.info(x).shape)


def _softmax_parts(r: _Recorder, x: Ref, dim: int) -> tuple[Ref, Ref, Ref]:
    """(max, x - max, exp(x - max)) along dim, max broadcast back."""
    m = _keep(r, x, dim, "max")
    shifted = r.ew("sub", x, m)
    return m, shifted, r.ew("exp", shifted)


@_lowers(aten._softmax.default, aten._safe_softmax.default)
def _softmax(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """exp(x - max) / sum; `_safe_softmax` gives 0 on rows that are all -inf (their max is -inf)."""
    out = _val(node).dtype
    x = r.cast(a["self"], _opmath(out))
    dim = _norm_dim(a["dim"], len(r.info(x).shape))
    m, _, e = _softmax_parts(r, x, dim)
    y = r.ew("div", e, _keep(r, e, dim, "sum"))
    if node.target == aten._safe_softmax.default:
        y = r.where(r.ew("eq", m, float("-inf"), out_dtype=torch.bool), 0.0, y, r.info(y).dtype)
    return r.cast(y, out)


@_lowers(aten._log_softmax.default)
def _log_softmax(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    out = _val(node).dtype
    x = r.cast(a["self"], _opmath(out))
    dim = _norm_dim(a["dim"], len(r.info(x).shape))
    _, shifted, e = _softmax_parts(r, x, dim)
    lse = r.ew("log", _keep(r, e, dim, "sum"))
    return r.cast(r.ew("sub", shifted, lse), out)


@_lowers(aten._softmax_backward_data.default)
def _softmax_backward(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """y * (g - sum(g*y))."""
    out = _val(node).dtype
    cd = _opmath(out)
    g, y = r.cast(a["grad_output"], cd), r.cast(a["output"], cd)
    dim = _norm_dim(a["dim"], len(r.info(g).shape))
    dot = _keep(r, r.ew("mul", g, y), dim, "sum")
    return r.cast(r.ew("mul", y, r.ew("sub", g, dot)), out)


@_lowers(aten._log_softmax_backward_data.default)
def _log_softmax_backward(r: _Recorder, node: fx.Node, a: dict) -> Ref:
    """g - exp(y) * sum(g)."""
    out = _val(node).dtype
    cd = _opmath(out)
    g, y = r.cast(a["grad_output"], cd), r.cast(a["output"], cd)
    dim = _norm_dim(a["dim"], len(r.info(g).shape))
    return r.cast(r.ew("sub", g, r.ew("mul", r.ew("exp", y), _keep(r, g, dim, "sum"))), out)


def _affine(r: _Recorder, y: Ref, param: Ref | None, name: str) -> Ref:
    return y if param is None else r.ew(name, y, r.cast(param, r.info(y).dtype))


@_lowers(aten.native_layer_norm.default)
def _layer_norm(r: _Recorder, node: fx.Node, a: dict) -> tuple[Ref, Ref, Ref]:
    """(x - mean) * rsqrt(var + eps) * w + b with a biased variance; returns (out, mean, rstd)
    with mean and rstd keeping the normalized dims as size 1, like ATen."""
    out, mean_val, rstd_val = _val(node)
    x = r.cast(a["input"], _opmath(out.dtype))
    shape = r.info(x).shape
    dims = list(range(len(shape) - len(a["normalized_shape"]), len(shape)))
    stats = ValueInfo(tuple(1 if d in dims else s for d, s in enumerate(shape)), r.info(x).dtype)
    var, mean = r.emit_multi("var_mean", x, outs=[stats, stats], dims=dims, correction=0, keepdim=True)
    rstd = r.ew("rsqrt", r.ew("add", var, float(a["eps"])))
    y = r.ew("mul", r.ew("sub", x, mean), rstd)
    y = _affine(r, _affine(r, y, a["weight"], "mul"), a["bias"], "add")
    return r.cast(y, out.dtype), r.cast(mean, mean_val.dtype), r.cast(rstd, rstd_val.dtype)


@_lowers(aten.native_layer_norm_backward.default)
def _layer_norm_backward(r: _Recorder, node: fx.Node, a: dict) -> tuple[Ref | None, ...]:
    """With x_hat = (x - mean) * rstd and g = grad * w over the N normalized elements:
    dx = rstd * (g - sum(g)/N - x_hat * sum(g * x_hat)/N); dw = sum over the outer dims of
    grad * x_hat; db = sum of grad over them."""
    vals = _val(node)
    cd = _opmath(node.args[1].meta["val"].dtype)
    grad, x = r.cast(a["grad_out"], cd), r.cast(a["input"], cd)
    shape = r.info(x).shape
    inner = list(range(len(shape) - len(a["normalized_shape"]), len(shape)))
    outer = list(range(inner[0]))
    n = float(math.prod(shape[d] for d in inner))
    mean, rstd = (r.broadcast(r.cast(a[k], cd), shape) for k in ("mean", "rstd"))
    x_hat = r.ew("mul", r.ew("sub", x, mean), rstd)
    g = _affine(r, grad, a["weight"], "mul")
    mask = a["output_mask"]
    results: list[Ref | None] = [None, None, None]
    if mask[0]:
        mean_g = r.ew("div", r.broadcast(r.reduce("sum", g, inner, True), shape), n)
        mean_gx = r.ew("div", r.broadcast(r.reduce("sum", r.ew("mul", g, x_hat), inner, True), shape), n)
        dx = r.ew("mul", rstd, r.ew("sub", r.ew("sub", g, mean_g), r.ew("mul", x_hat, mean_gx)))
        results[0] = r.cast(dx, vals[0].dtype)
    if mask[1] and a["weight"] is not None:
        results[1] = r.cast(r.reduce("sum", r.ew("mul", grad, x_hat), outer, False), vals[1].dtype)
    if mask[2] and a["bias"] is not None:
        results[2] = r.cast(r.reduce("sum", grad, outer, False), vals[2].dtype)
    return tuple(results)


# ---------------------------------------------------------------------------------------------
# The public entry points

FMA_NAME = "prims::fma"

FUSIBLE_TARGETS: frozenset = frozenset(_LOWERINGS)
"""The ATen overloads `record` translates. `prims.fma` is also translated, matched by name
(`is_fusible`): it only exists once torch._inductor.inductor_prims is imported, which takes
seconds and which dynamo does itself when it makes one."""


def _op_name(target: Any) -> str:
    name = getattr(target, "name", None)
    return name() if callable(name) else ""


def is_fusible(target: Any) -> bool:
    """Whether `record` translates call_function nodes with this target."""
    return target in FUSIBLE_TARGETS or _op_name(target) == FMA_NAME or target is operator.getitem


def _lowering(target: Any) -> Callable | None:
    if target in _LOWERINGS:
        return _LOWERINGS[target]
    return _fma if _op_name(target) == FMA_NAME else None


def _input_spec(node: fx.Node, example: Any) -> TensorSpec:
    val = node.meta.get("val", example)
    if not isinstance(val, torch.Tensor):
        raise UnsupportedOp(f"placeholder {node.name}: only tensor inputs are supported, got {type(val).__name__}")
    return TensorSpec.of(val)


def record(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None) -> FusionProgram:
    """Translate a fusion group into a FusionProgram. Raises UnsupportedOp for a node it does
    not cover. `example_inputs` stand in for placeholders without meta['val']."""
    r = _Recorder()
    env: dict[fx.Node, Any] = {}
    inputs: list[TensorSpec] = []
    examples = list(example_inputs or [])
    outputs: tuple[Ref, ...] = ()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = _input_spec(node, examples[len(inputs)] if len(inputs) < len(examples) else None)
            inputs.append(spec)
            env[node] = r.new_value(ValueInfo(spec.shape, spec.dtype))
        elif node.op == "call_function":
            env[node] = _record_call(r, node, env)
        elif node.op == "output":
            outputs = _record_outputs(r, node, env, len(inputs))
        else:
            raise UnsupportedOp(f"{node.op} node {node.name} ({node.target}) is not supported in a fusion group")
    return FusionProgram(inputs, r.ops, tuple(o.index for o in outputs), r.values)


def _record_call(r: _Recorder, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    if node.target is operator.getitem:
        return args[0][args[1]]
    lower = _lowering(node.target)
    if lower is None:
        raise UnsupportedOp(f"{node.target} ({node.name}) has no nvFuser translation")
    r.origin = f"{node.name} = {node.target}"
    return lower(r, node, _bind(node.target, args, kwargs))


def _record_outputs(r: _Recorder, node: fx.Node, env: dict[fx.Node, Any], n_inputs: int) -> tuple[Ref, ...]:
    """Every output must be a value the kernel computes: an input passed through, or a value
    returned twice, gets its own copy (nvFuser returns fresh tensors)."""
    result = node.args[0]
    items = result if isinstance(result, (tuple, list)) else (result,)
    outs: list[Ref] = []
    for item in items:
        ref = env.get(item) if isinstance(item, fx.Node) else None
        if not isinstance(ref, Ref):
            raise UnsupportedOp(f"output {item!r} is not a tensor value of the group")
        if ref.index < n_inputs or ref in outs:
            r.origin = f"output copy of {item.name}"
            ref = r.copy(ref)
        outs.append(ref)
    return tuple(outs)
