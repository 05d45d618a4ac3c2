"""The planning options, as `optimize()` and `plan_offline()` parse them and every backend and planner of
one optimized callable (and its copies) uses them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .budget import Budget

if TYPE_CHECKING:
    from .costs.profiles import DeviceProfile


@dataclass(frozen=True)
class PlanningSettings:
    """optimize()'s planning options (see its docstring for each)."""

    budget: Budget
    device_profile: str | DeviceProfile | None = None
    time_limit_s: float | None = None
    progress: bool = False
    offload: bool | None = None
    host_budget: Budget | None = None
    executor: str | None = None
    plan: str | os.PathLike | None = None
    on_mismatch: str = "error"
    deterministic: bool | None = None
    chunking: bool | int | None = None

    @property
    def chunk_counts(self) -> tuple[int, ...]:
        """The chunk counts the planner may give an LM head + cross-entropy chain (passes/chunking.py):
        all of CHUNK_COUNTS when it is on, only 1 (the graph as captured) when off (the default: chunked
        gradients equal eager's to rounding, not bitwise), or the one count forced."""
        from .lower.chunked_ce import CHUNK_COUNTS

        if self.chunking is None or self.chunking is False:
            return (1,)
        if self.chunking is True:
            return CHUNK_COUNTS
        return (int(self.chunking),)

    @property
    def deterministic_planning(self) -> bool:
        """Deterministic solving (solvers/model/clock.py) unless turned off."""
        return self.deterministic is not False

    @property
    def plan_spec(self) -> str | None:
        """The plan option as a string: None, "auto" or a file path."""
        if self.plan is None:
            return None
        return self.plan if self.plan == "auto" else os.fspath(self.plan)
