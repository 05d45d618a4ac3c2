"""What the CP-SAT models share: integer units for time and memory, and solver settings."""

from __future__ import annotations

import math

from ortools.sat.python import cp_model

from .problem import Problem

NS = 1e-9  # time unit: op costs are whole nanoseconds (at least 1)
RESOLUTION = 1 << 20  # memory units across all of a step's storages


def memory_unit(problem: Problem, resolution: int = RESOLUTION) -> int:
    """Bytes per model unit: exact (the sizes' common divisor) when that keeps numbers
    small, else about a millionth of all storage, because CP-SAT's bounds degrade with
    huge coefficients. Models that must fit round demands up and budgets down; the
    relaxation rounds the other way; the simulator stays exact."""
    total = sum(t.bytes for t in problem.tensors)
    common = math.gcd(*(t.bytes for t in problem.tensors)) or 1
    if total // common <= resolution:
        return common
    return max(1, total // resolution)


def cost_ns(time_s: float) -> int:
    return max(1, round(time_s / NS))


def make_solver(time_limit_s: float, workers: int, linearization_level: int | None = None) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    solver.parameters.num_workers = workers
    if linearization_level is not None:
        solver.parameters.linearization_level = linearization_level
    return solver
