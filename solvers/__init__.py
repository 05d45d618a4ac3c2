"""optsched.solvers: the torch-free optimization core (problem, simulator, heuristics, CP-SAT)."""

from .model.problem import Op, Phase, Problem, Schedule, SolveStats, Tensor, TensorKind, default_schedule
from .model.simulator import ScheduleError, SimResult, simulate
from .search.strategy import BudgetInfeasibleError, PlanningTimeLimitError, Solution, solve  # fusion options included

__all__ = [
    "BudgetInfeasibleError",
    "Op",
    "Phase",
    "PlanningTimeLimitError",
    "Problem",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Solution",
    "SolveStats",
    "Tensor",
    "TensorKind",
    "default_schedule",
    "simulate",
    "solve",
]
