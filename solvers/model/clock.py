"""The solvers' clock: wall seconds, or, in deterministic mode, counted work.

Every deadline in the search reads `now()`. Normally that is `time.perf_counter()`. Inside
`deterministic()` it is the work done so far instead: CP-SAT's deterministic time for each
solve (a count of its operations), the constraints each CP-SAT model loads, the steps the simulator
replays, the bound's min cuts, the ops of each problem built and each op timed, each unit turned into
seconds of the reference machine by solvers/model/calibration.py's fitted table. Then every branch
the search takes depends on the problem alone, not on the machine's speed or load, and CP-SAT itself runs single-threaded (or with
interleaved, not raced, workers), a fixed seed and a deterministic limit
(solvers/cpsat/common.make_solver): the same
problem and options give the same plan on every run and on every rank of a distributed job.
The time limit is then a limit on work, which takes about as long as the wall limit on the idle
reference machine (benchmarks/planning_time.py measures it), less on a faster one and longer on a
slower or busier one.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import Counter
from collections.abc import Iterator

from . import calibration

DETERMINISTIC_WORKERS = 1  # CP-SAT workers in deterministic mode: one (interleaved workers were 5-10x slower per solve)


class _Work:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.units: Counter[str] = Counter()
        self.stages: Counter[str] = Counter()  # wall seconds inside each `stage`, its inner stages' left out
        self.open: list[str] = []  # the stages entered, innermost last
        self.mark = 0.0  # when the innermost open stage last took over


_work: contextvars.ContextVar[_Work | None] = contextvars.ContextVar("optsched_solver_work", default=None)


def now() -> float:
    """Seconds on the solvers' clock (a start-independent origin: compare differences only)."""
    work = _work.get()
    return time.perf_counter() if work is None else work.seconds


def is_deterministic() -> bool:
    return _work.get() is not None


def count(unit: str, n: float = 1) -> None:
    """Count `n` units of work done (solvers/model/calibration.py names them); a no-op outside deterministic
    mode, where the wall clock runs by itself."""
    work = _work.get()
    if work is not None:
        work.seconds += calibration.seconds(unit, n)
        work.units[unit] += n


_counted_once: set[str] = set()  # units of set-up work a process does once (a library's first start)


def count_once(unit: str) -> None:
    """Count one `unit` the first time the process does this work, whether or not the clock counts then (work done
    outside deterministic mode is done all the same: a later count would charge what no longer costs)."""
    if unit not in _counted_once:
        _counted_once.add(unit)
        count(unit)


def counted_once(unit: str) -> bool:
    """Whether `count_once(unit)` has been counted in this process (a cost yet to come when not)."""
    return unit in _counted_once


def units_counted() -> dict[str, float]:
    """The units counted so far in this deterministic block (empty outside one): what the calibration fits."""
    work = _work.get()
    return {} if work is None else dict(work.units)


class stage:
    """`with stage(name):` the wall seconds inside, less those of stages opened inside it, are `name`'s
    (`stage_seconds`): where a planning's wall time went, beside the units the clock counted for it
    (benchmarks/planning_time.py shows both; wall seconds no stage holds are the planner's own). Timed in
    deterministic mode only; nothing is done outside it."""

    __slots__ = ("name", "work")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.work = work = _work.get()
        if work is not None:
            t = time.perf_counter()
            if work.open:
                work.stages[work.open[-1]] += t - work.mark
            work.open.append(self.name)
            work.mark = t

    def __exit__(self, *exc) -> None:
        work = self.work
        if work is not None and work.open:
            t = time.perf_counter()
            work.stages[work.open.pop()] += t - work.mark
            work.mark = t


def stage_seconds() -> dict[str, float]:
    """Wall seconds spent so far in each stage of this deterministic block (empty outside one), the stages still
    open counted to now."""
    work = _work.get()
    if work is None:
        return {}
    out = dict(work.stages)
    if work.open:
        out[work.open[-1]] = out.get(work.open[-1], 0.0) + time.perf_counter() - work.mark
    return out


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Within this block, the solvers count work instead of wall time (see the module doc)."""
    if not enabled or _work.get() is not None:
        yield
        return
    token = _work.set(_Work())
    try:
        yield
    finally:
        _work.reset(token)
