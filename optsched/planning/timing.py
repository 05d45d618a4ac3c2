"""How long one program's planning may take: its time limit, and the account every solve of it draws on
(the graph as captured and each chunk count), counted on the solvers' clock (work in deterministic mode)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..solvers.model import calibration, clock

DEFAULT_TIME_LIMIT_S = 5.0  # at least this long; larger graphs get DEFAULT_S_PER_OP per op
DEFAULT_S_PER_OP = 0.02
DEFAULT_TIME_LIMIT_MAX_S = 30.0  # and at most this: repeated blocks are searched alike, so depth costs little
MIN_SEARCH_SHARE = 0.5  # the solves keep at least this share of the limit, whatever op timing and compiles took
OP_TIMING_SHARE = 0.5  # op timing stops after this share of the time limit (solvers' clock): the ops left, the roofline's


def time_limit(asked: float | None, ops: int) -> float:
    """The planning time limit of a graph of `ops` ops: `asked`, or one that grows with the graph (planning
    stays a small share of compile time)."""
    if asked is not None:
        return asked
    return max(DEFAULT_TIME_LIMIT_S, min(DEFAULT_TIME_LIMIT_MAX_S, DEFAULT_S_PER_OP * ops))


@dataclass(frozen=True)
class Charged:
    """Work done for a program before its planning started that its time limit covers all the same:
    plan_offline's capture (the call a user waits for is capture and planning). On the deterministic clock it
    counts as its `units` of work (unit -> count: the same charge on every run), on the wall clock as the `wall_s`
    it took."""

    units: dict[str, float]
    wall_s: float


class PlanningTime:
    """One program's planning time: its limit (set by the first solve: it depends on the problem's size) and
    everything spent since `start()`, counted on the solvers' clock: op timing, problem building, bounds,
    simulations and every solve (the graph as captured, each chunk count, fusion options), so `time_limit_s`
    is what the user waits for the plan after capture (plan_offline: with its capture, `Charged`). Each solve gets
    `share` of what is left. The solves together
    keep at least MIN_SEARCH_SHARE of the limit from the first one on: where op timing, fusion compiles and
    problem building took more than the rest, planning takes longer than the limit by that much (a plan found in
    no time is no plan; benchmarks/planning_time.py reports it).

    `finish()` keeps what the planning took: wall seconds, clock seconds, the units of work it counted
    (benchmarks/planning_time.py fits the clock's calibration on them) and the wall seconds of each stage
    (`clock.stage`: op timing, problem building, bound, simulation, CP-SAT, search, fusion compiles), and apart
    from them what was charged before it (`Charged`: counted in `spent`, so in the limit, not in the planning's
    own figures)."""

    def __init__(self) -> None:
        self.limit: float | None = None  # as asked or by default (time_limit)
        self.setup_s = 0.0  # a default limit grows by the process's one-time set-ups it paid for (outside_search_left)
        self.share = 1.0
        self._start: float | None = None
        self._search_start: float | None = None  # the first solve's start
        self._wall0 = 0.0
        self._units0: dict[str, float] = {}
        self._stages0: dict[str, float] = {}
        self.charged: Charged | None = None
        self._charged_s = 0.0  # its seconds on the solvers' clock
        self.taken: dict | None = None  # after finish(): {"wall_s", "clock_s", "units", "stages"} (+ "charged")

    def start(self, charged: Charged | None = None) -> None:
        """Planning starts now (inside the solvers' deterministic block, where the clock counts work), with
        `charged` already spent."""
        self._start, self._wall0, self._units0 = clock.now(), time.perf_counter(), clock.units_counted()
        self._stages0 = clock.stage_seconds()
        self.charged = charged
        if charged is not None:
            self._charged_s = (sum(calibration.seconds(u, n) for u, n in charged.units.items())
                               if clock.is_deterministic() else charged.wall_s)

    @property
    def spent(self) -> float:
        """Seconds of the limit spent: the charge before planning, then the planning so far."""
        return 0.0 if self._start is None else clock.now() - self._start + self._charged_s

    def slice(self, limit: float) -> float:
        if self.limit is None:
            self.limit = limit
        if self._search_start is None:
            self._search_start = clock.now()
        return self.left() * self.share

    @property
    def limit_s(self) -> float:
        """This program's limit: `limit` and the set-ups a default limit was given."""
        return (self.limit or 0.0) + self.setup_s

    def left(self) -> float:
        searched = 0.0 if self._search_start is None else clock.now() - self._search_start
        return max(0.0, self.limit_s - self.spent, MIN_SEARCH_SHARE * (self.limit or 0.0) - searched)

    def left_within(self, limit: float) -> float:
        """Seconds left of this program's limit, or of `limit` before a solve set it (a budget refused before any
        search)."""
        return max(0.0, (self.limit or limit) + self.setup_s - self.spent)

    def outside_search_left(self, limit: float, upcoming_s: float = 0.0, setup_s: float = 0.0) -> bool:
        """Whether work outside the search (a fusion group compiled) that costs `upcoming_s` on the clock fits in the
        share of the limit the search does not keep (1 - MIN_SEARCH_SHARE): priced before it starts, since once
        started it is spent. `setup_s`: a set-up the process does once beside it (Inductor's first compile, about
        3 s: more than half a 5 s limit), which a default limit grows by when the work goes ahead (else the first
        program of every process would stay unfused at the default limit); under a limit the user set it belongs in
        `upcoming_s`. `limit`: this program's, before the first solve sets it."""
        if self.spent + upcoming_s > (1 - MIN_SEARCH_SHARE) * (self.limit or limit) + self.setup_s:
            return False
        self.setup_s += setup_s
        return True

    def may_compile(self, asked: float | None, ops: int, cost_s: float, setup_s: float) -> bool:
        """Whether a fusion group's compile (`cost_s`, and `setup_s` of the process's one-time set-up) goes ahead in
        a program of `ops` ops: a default limit (`asked` None) grows by the set-up, one the user set counts it with
        the compile (outside_search_left)."""
        default = asked is None
        return self.outside_search_left(time_limit(asked, ops), cost_s + (0.0 if default else setup_s),
                                        setup_s if default else 0.0)

    def finish(self) -> None:
        units, stages = clock.units_counted(), clock.stage_seconds()
        self.taken = {"wall_s": time.perf_counter() - self._wall0, "clock_s": self.spent - self._charged_s,
                      "units": {k: v - self._units0.get(k, 0.0) for k, v in units.items() if v - self._units0.get(k, 0.0)},
                      "stages": {k: v - self._stages0.get(k, 0.0) for k, v in stages.items()
                                 if v - self._stages0.get(k, 0.0)}}
        if self.charged is not None:
            c = self.charged
            self.taken["charged"] = {"units": dict(c.units), "wall_s": c.wall_s, "clock_s": self._charged_s}
