"""Eager PyTorch: the program as written, every activation autograd needs saved."""

from __future__ import annotations

from ..model.problem import Problem, Schedule, default_schedule


def eager(problem: Problem, budget_bytes: int | None = None) -> Schedule:
    """Program order, save everything (`default_schedule`): what eager PyTorch runs. The budget is ignored."""
    return default_schedule(problem)
