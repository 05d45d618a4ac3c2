"""The nvFuser executor: fusion groups become nvFuser `FusionDefinition`s.

All the translation lives in `fusion_program.py` (ATen graph -> `FusionProgram`, tested by
replaying it with torch). This module only emits a program into nvFuser's Python frontend,
one `fd.ops.<name>` call per `FusionOp`, and is the only place that imports nvFuser.

nvFuser is an optional extra (`pip install optsched[nvfuser]`). Its wheels are built against
one torch release and one CUDA major version each, so the extra only installs next to the torch
it was built for, and it needs a CUDA device to run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from optsched.executors.nvfuser_program import (
    FusionProgram,
    Ref,
    TensorSpec,
    is_fusible,
    record,
)

FUSIBLE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64})

INSTALL_HINT = (
    "nvFuser is an optional extra of optsched: `pip install optsched[nvfuser]`. Its wheels pair "
    "with specific torch builds (the newest, nvfuser-cu128-torch210 and its CUDA 13.0 sibling, "
    "need torch 2.10 with CUDA 12.8 or 13.0; there is none for torch {torch}), and it needs a CUDA "
    "device. Without it, fusion groups run eagerly or with another executor."
)


def _load() -> tuple[Any, str]:
    """(the nvfuser module or None, why it cannot be used)."""
    try:
        import nvfuser
    except Exception as e:  # noqa: BLE001 -- ImportError, or OSError/RuntimeError from a wheel built for another torch
        return None, f"importing nvfuser failed: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return None, "no CUDA device is available"
    return nvfuser, ""


def nvfuser_available() -> bool:
    """Whether nvFuser imports and a CUDA device is there to run it."""
    return _load()[0] is not None


def node_is_fusible(node: fx.Node, *, require_cuda: bool = True) -> bool:
    """A call_function node `record` translates whose tensors (inputs and outputs) all have
    dtypes nvFuser handles here; with `require_cuda`, they must also be CUDA tensors (0-d CPU
    tensors are fine: nvFuser takes them as host scalars)."""
    if node.op != "call_function" or not is_fusible(node.target):
        return False
    vals = [n.meta.get("val") for n in node.all_input_nodes] + [node.meta.get("val")]
    tensors = [t for v in vals for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
    if any(t.dtype not in FUSIBLE_DTYPES for t in tensors):
        return False
    return not require_cuda or all(
        t.device.type == "cuda" or (t.device.type == "cpu" and t.dim() == 0) for t in tensors
    )


def emit_definition(fd: Any, program: FusionProgram, data_type: Any) -> None:
    """Emit `program` into an open FusionDefinition `fd`. `data_type` is nvFuser's DataType enum
    (passed in so this runs, and is tested, without nvFuser). Positional operands are tensors or
    scalars (scalars become `fd.define_scalar`); keyword arguments are attributes, passed as they
    are except dtypes."""
    values: dict[int, Any] = {}
    for i, spec in enumerate(program.inputs):
        values[i] = _define_input(fd, spec, data_type)

    def operand(a: Any) -> Any:
        if isinstance(a, Ref):
            return values[a.index]
        if isinstance(a, torch.dtype):
            return to_nvfuser_dtype(a, data_type)
        if isinstance(a, (list, tuple)):
            return [values[x.index] if isinstance(x, Ref) else x for x in a]
        return fd.define_scalar(a)

    def attribute(a: Any) -> Any:
        if isinstance(a, torch.dtype):
            return to_nvfuser_dtype(a, data_type)
        return operand(a) if isinstance(a, Ref) else a

    for op in program.ops:
        fn = getattr(fd.ops, op.name)
        out = fn(*(operand(a) for a in op.args), **{k: attribute(v) for k, v in op.kwargs.items()})
        outs = tuple(out) if len(op.results) > 1 else (out,)
        values.update(zip(op.results, outs, strict=True))
    for i in program.outputs:
        fd.add_output(values[i])


def _define_input(fd: Any, spec: TensorSpec, data_type: Any) -> Any:
    if spec.device != "cuda" and not spec.is_cpu_scalar:
        raise ValueError(
            f"nvFuser inputs must be CUDA tensors (or 0-d CPU scalars), got a {spec.device} tensor of shape {spec.shape}"
        )
    return fd.define_tensor(
        shape=spec.symbolic_shape,
        contiguity=spec.contiguity,
        dtype=to_nvfuser_dtype(spec.dtype, data_type),
        is_cpu=spec.is_cpu_scalar,
        stride_order=spec.stride_order,
    )


_DTYPE_NAMES = {
    torch.float64: "Double",
    torch.float32: "Float",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Int",
    torch.int32: "Int32",
    torch.bool: "Bool",
}


def to_nvfuser_dtype(dtype: torch.dtype, data_type: Any) -> Any:
    """torch dtype -> nvFuser DataType member."""
    try:
        return getattr(data_type, _DTYPE_NAMES[dtype])
    except KeyError:
        raise ValueError(f"nvFuser has no dtype for {dtype}") from None


def build_fusion_definition(program: FusionProgram) -> Any:
    """A finished nvFuser FusionDefinition for `program` (needs nvFuser)."""
    nvfuser, why = _load()
    if nvfuser is None:
        raise RuntimeError(f"{INSTALL_HINT.format(torch=torch.__version__)} ({why})")
    fd = nvfuser.FusionDefinition()
    with fd:
        emit_definition(fd, program, nvfuser.DataType)
    return fd


class NvFuserExecutor:
    """Runs fusion groups as nvFuser kernels (see `base.Executor`)."""

    name = "nvfuser"
    fuses_writes = False  # out= writes into inputs never join a group

    def __init__(self) -> None:
        nvfuser, why = _load()
        if nvfuser is None:
            raise RuntimeError(f"{INSTALL_HINT.format(torch=torch.__version__)} ({why})")

    def can_fuse(self, node: fx.Node) -> bool:
        return node_is_fusible(node)

    def compile_group(self, gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., tuple]:
        fd = build_fusion_definition(record(gm, example_inputs))
        return lambda *xs: tuple(fd.execute(list(xs)))
