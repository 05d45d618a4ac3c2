"""Executors: who runs a fusion group. `eager` fuses nothing; `inductor` compiles each group
with TorchInductor (C++ on CPU, Triton on CUDA); `nvfuser` builds nvFuser fusions on CUDA.

Importing this package does not import torch: `NAMES` is plain data (the `optsched`
command's `--executor` choices); the executor classes load on first use.
"""

from __future__ import annotations

import importlib as _importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .base import Executor
    from .eager import EagerExecutor
    from .inductor import InductorExecutor

NAMES = ("eager", "inductor", "nvfuser")

# public name -> the submodule that defines it (imported on first access, PEP 562)
_LAZY = {"Executor": "base", "EagerExecutor": "eager", "InductorExecutor": "inductor"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def get_executor(name: str | None, device: torch.device) -> Executor:
    """Resolve `optimize(executor=...)`. None: on CUDA, nvFuser where its wheel loads (it pairs with particular
    torch builds), else Inductor where Triton imports (the planner keeps only the groups whose kernel measures
    faster than their ops one by one), else eager; on other devices, eager."""
    from .eager import EagerExecutor
    from .inductor import InductorExecutor

    if name is None:
        if device.type == "cuda":
            if runs_on("nvfuser", device):
                from .nvfuser import NvFuserExecutor

                return NvFuserExecutor()
            if runs_on("inductor", device):
                return InductorExecutor()
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


def runs_on(name: object, device: torch.device) -> bool:
    """Whether executor `name` can run fusion groups on `device` (what the default picks from; a plan file's
    executor replaces the default only where this holds): eager anywhere, Inductor where Triton imports on CUDA,
    nvFuser where its wheel loads on CUDA."""
    if name == "eager":
        return True
    if name == "inductor":
        return device.type != "cuda" or importlib.util.find_spec("triton") is not None
    if name == "nvfuser":
        from .nvfuser import nvfuser_available

        return device.type == "cuda" and nvfuser_available()
    return False


__all__ = ["NAMES", "EagerExecutor", "Executor", "InductorExecutor", "get_executor", "runs_on"]
