"""What a solve returns: a `Solution`, or an error carrying the lowest-peak plan found and a proven bound."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.problem import Schedule, SolveStats
from ..model.simulator import SimResult


class BudgetInfeasibleError(Exception):
    """No plan found within the budget. Carries the lowest peak found and a proven lower bound.

    `proven`: the budget is below the bound, so no plan can fit. Otherwise a plan may exist
    between the bound and the lowest peak found; `PlanningTimeLimitError` (a subclass) says the
    time limit ended the search, this class alone that every move of the search ended by itself.
    `lowest_schedule` can be passed back as a solve's `hint`. `searched`: False when the budget was refused
    from the bound alone, before any search (then `lowest_peak_bytes` is the unplanned program's peak and
    `lowest_schedule` its plan, or None when refused before the program's problem was built).
    """

    def __init__(
        self, budget_bytes: int, lowest_peak_bytes: int, lower_bound_bytes: int, lowest_schedule: Schedule | None = None,
        *, elapsed_s: float | None = None, time_limit_s: float | None = None, searched: bool = True,
        scope: str | None = None, summary: str | None = None, notes: tuple[str, ...] = (),
    ):
        self.budget_bytes = budget_bytes
        self.lowest_peak_bytes = lowest_peak_bytes
        self.lowest_schedule = lowest_schedule  # a plan that reaches lowest_peak_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.elapsed_s = elapsed_s
        self.time_limit_s = time_limit_s
        self.searched = searched
        self.scope = scope  # what a proven bound covers, when not every plan ("with the LM head ... as captured")
        self.summary = summary  # the first sentence, when the caller's (several graphs tried) replaces the solve's
        self.notes = tuple(notes)  # what the caller adds: how the budget was reached, what else could fit it
        super().__init__("; ".join([summary or self._message(), *self.notes]))

    def explained(self, *notes: str, scope: str | None = None, summary: str | None = None) -> BudgetInfeasibleError:
        """This error with `notes` added (empty ones left out) and `scope` or `summary` replaced: a new error of the
        same class, its message built once from its fields, carrying this one's traceback."""
        new = type(self)(
            self.budget_bytes, self.lowest_peak_bytes, self.lower_bound_bytes, self.lowest_schedule,
            elapsed_s=self.elapsed_s, time_limit_s=self.time_limit_s, searched=self.searched,
            scope=scope or self.scope, summary=summary or self.summary, notes=(*self.notes, *(n for n in notes if n)),
        )
        return new.with_traceback(self.__traceback__)

    @property
    def proven(self) -> bool:
        """No plan can fit: the budget is below a peak every plan reaches."""
        return self.budget_bytes < self.lower_bound_bytes

    @property
    def peak_gap(self) -> float:
        """(lowest peak found - bound) / lowest peak found: how far the search may be from the lowest peak."""
        if self.lowest_peak_bytes <= 0:
            return 0.0
        return max(0.0, (self.lowest_peak_bytes - self.lower_bound_bytes) / self.lowest_peak_bytes)

    def _message(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        found = f"the lowest peak found is {mib(self.lowest_peak_bytes)}"
        if not self.searched:  # below the bound: no search can change that, so none ran
            found = f"refused before any search; unplanned, the program peaks at {mib(self.lowest_peak_bytes)}"
        if self.proven:
            every = f" {self.scope}: every such plan" if self.scope else ": every plan"
            return f"no plan fits {mib(self.budget_bytes)}, and none can{every} needs at least {mib(self.lower_bound_bytes)} ({found})"
        took = f" after {self.elapsed_s:.1f}s" if self.elapsed_s is not None else ""
        # no claim about larger limits: the moves' time slices grow with the limit and may find lower plans
        return (
            f"no plan fits {mib(self.budget_bytes)}: none found{took}; {found}, and no plan can go below "
            f"{mib(self.lower_bound_bytes)} (gap {self.peak_gap:.1%}); every move of the search ended before its "
            "share of the time limit"
        )


class PlanningTimeLimitError(BudgetInfeasibleError):
    """The time limit ended the search before a plan within the budget was found: one may exist."""

    def _message(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        return (
            f"no plan fits {mib(self.budget_bytes)} within the time limit: it ended the search ({self.time_limit_s:g}s, "
            f"{self.elapsed_s:.1f}s used) before one was found; the lowest peak found is {mib(self.lowest_peak_bytes)} and no "
            f"plan can go below {mib(self.lower_bound_bytes)} (gap {self.peak_gap:.1%}); a larger time_limit_s may find one"
        )


@dataclass
class Solution:
    schedule: Schedule
    sim: SimResult
    stats: SolveStats
    baseline: SimResult  # the program as captured, unplanned
    budget_bytes: int | None
    lower_bound_bytes: int
