"""The solvers' clock: wall seconds, or, in deterministic mode, counted work.

Every deadline in the search reads `now()`. Normally that is `time.perf_counter()`. Inside
`deterministic()` it is the work done so far instead: CP-SAT's deterministic time for each
solve (a count of its operations, scaled by CPSAT_UNIT_S to about a wall second of the reference
machine) plus a fixed charge per simulated step. Then every branch the search takes depends on the problem alone,
not on the machine's speed or load, and CP-SAT itself runs single-threaded (or with
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
from collections.abc import Iterator

# Inside optimize() the same solves take 1.1-1.5x the wall time they take alone (GPT batch 8 at 60% with chunking:
# 1.3 s alone, 1.5-2.1 s in the planner; cause not found: not the other threads, not the heap), and
# time_limit_s is optimize()'s planning time: every charge below is what the work takes alone times IN_PLANNER.
IN_PLANNER = 1.3
SIMULATED_STEP_S = 1e-5 * IN_PLANNER  # work charged per step the simulator replays
# clock seconds per unit of CP-SAT's deterministic time. Its unit is not a second here: wall / deterministic time
# of the search's solves on the reference machine (the 2-core CI machine, idle) was 2.6 for ViT's segment models,
# 2.3 for GPT's and 0.85 for GPT-NeoX's relaxation, so a time limit counted in raw units ran 1.7x over on ViT
CPSAT_UNIT_S = 2.5 * IN_PLANNER
CPSAT_CONSTRAINT_S = 3e-5 * IN_PLANNER  # charged per constraint of each CP-SAT model solved: loading and presolve, which its
# deterministic time leaves out (fit on the same solves: about 2-4e-5 s per constraint term)
DETERMINISTIC_WORKERS = 1  # CP-SAT workers in deterministic mode: one (interleaved workers were 5-10x slower per solve)


class _Work:
    def __init__(self) -> None:
        self.seconds = 0.0


_work: contextvars.ContextVar[_Work | None] = contextvars.ContextVar("optsched_solver_work", default=None)


def now() -> float:
    """Seconds on the solvers' clock (a start-independent origin: compare differences only)."""
    work = _work.get()
    return time.perf_counter() if work is None else work.seconds


def is_deterministic() -> bool:
    return _work.get() is not None


def charge(seconds: float) -> None:
    """Count work done (no-op outside deterministic mode, where the wall clock runs by itself)."""
    work = _work.get()
    if work is not None:
        work.seconds += seconds


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
