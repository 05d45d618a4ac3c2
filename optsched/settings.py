"""The planning options, as `optimize()` and `plan_offline()` parse them and every backend and planner of
one optimized callable (and its copies) uses them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .budget import Budget, check_options
from .optim import check_supported

if TYPE_CHECKING:
    from .costs.profiles import DeviceProfile
    from .plans.file_format import PlanFile
    from .solvers import Schedule


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
    chunking: bool | int | str | None = None
    start_from: Schedule | PlanFile | None = field(default=None, compare=False)  # offered to every solve first (a hint)
    # the user's optimizer (issue 36): its state and its update are planned with the step
    optimizer: Any = field(default=None, compare=False)
    # "auto": the planner updates parameters inside the backward where the budget needs it; False: never (the
    # user clips gradients by their global norm or uses a GradScaler: both need every gradient first)
    updates_in_backward: bool | str = "auto"

    def __post_init__(self) -> None:
        """Every option is checked here, as optimize() and plan_offline() build the settings: a bad one raises
        there, not at the first call that plans. (The budgets come parsed; start_from, checked by optimize.)"""
        check_options(**{f.name: getattr(self, f.name) for f in fields(self)
                         if f.name not in ("budget", "host_budget", "start_from")})
        if self.optimizer is not None:
            check_supported(self.optimizer, "planning the whole step with optimizer= (pass none to plan without it)")
        if self.updates_in_backward is False and self.optimizer is None:
            raise ValueError("updates_in_backward=False says how to plan an optimizer's update: pass optimizer= too")

    @property
    def updates(self) -> Any:
        """The optimizer's in-backward updates the plans may use (optim.in_backward), None where they may not."""
        if self.optimizer is None or self.updates_in_backward is False:
            return None
        from .optim import in_backward

        return in_backward(self.optimizer)

    @property
    def chunk_counts(self) -> tuple[int, ...]:
        """The chunk counts the planner gives an LM head + cross-entropy chain (passes/chunking.py) from the
        start: all of CHUNK_COUNTS when chunking is True, the one count forced by an int, only 1 (the graph as
        captured) when None (the default), False or "auto" (which tries the counts above 1 only when the graph
        as captured cannot meet the budget: `chunk_when_needed`). Chunked gradients equal eager's to
        rounding, not bitwise."""
        from .passes.chunked_ce import CHUNK_COUNTS

        if self.chunking is None or self.chunking is False or self.chunk_when_needed:
            return (1,)
        if self.chunking is True:
            return CHUNK_COUNTS
        return (int(self.chunking),)

    @property
    def chunk_when_needed(self) -> bool:
        """chunking="auto": plan the graph as captured, and chunk counts only where it cannot meet the budget
        (planning.variants). Not the default: the default keeps gradients bitwise eager's (tests
        assert that of default plans at budgets recomputation alone cannot meet)."""
        return self.chunking == "auto"

    @property
    def chunk_key(self) -> list[int] | str:
        """What the plan cache keys of the chunking setting: the counts, or "auto", whose plans may be chunked
        (a plan cached under "auto" is not what the default or chunking=False replays)."""
        return "auto" if self.chunk_when_needed else list(self.chunk_counts)

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
