"""Executors: who runs a fusion group. `eager` fuses nothing; `inductor` compiles each group
with TorchInductor (C++ on CPU, Triton on CUDA); `nvfuser` builds nvFuser fusions on CUDA."""

from __future__ import annotations

import torch

from .base import Executor
from .eager import EagerExecutor
from .inductor import InductorExecutor

NAMES = ("eager", "inductor", "nvfuser")


def get_executor(name: str | None, device: torch.device) -> Executor:
    """Resolve `optimize(executor=...)`; None picks nvFuser where it loads on CUDA, else eager."""
    if name is None:
        if device.type == "cuda":
            from .nvfuser import NvFuserExecutor, nvfuser_available

            if nvfuser_available():
                return NvFuserExecutor()
        return EagerExecutor()
    if not isinstance(name, str) or name.lower() not in NAMES:
        raise ValueError(f"unknown executor {name!r}; known: {', '.join(NAMES)}")
    name = name.lower()
    if name == "eager":
        return EagerExecutor()
    if name == "inductor":
        return InductorExecutor()
    if device.type != "cuda":
        raise ValueError(f"the nvfuser executor runs on CUDA devices only, and this step runs on {device}")
    from .nvfuser import NvFuserExecutor

    return NvFuserExecutor()


__all__ = ["NAMES", "EagerExecutor", "Executor", "InductorExecutor", "get_executor"]
