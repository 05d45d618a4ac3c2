"""What each unit of planning work costs on the reference machine, in seconds: the solvers' clock's table.

Deterministic mode (solvers/model/clock.py) never reads the wall clock: it counts work in these units, and
this table turns counts into seconds. The coefficients are fitted by least squares
(`python -m benchmarks.planning_time --fit`: wall seconds of each planning stage against the units it counted,
every run of the planning-time benchmark, inside `optimize()`), on the reference machine (the 2-core CI
machine, idle). A unit missing from a run's stages is fitted on the runs that have it. FITTED_AT says which
commit and runs the numbers come from; docs/benchmarks.md shows the fit and its residuals.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    seconds: float  # per unit counted, on the reference machine
    counts: str  # what one unit is


UNITS: dict[str, Unit] = {
    "cpsat_dtime": Unit(1.87, "a unit of CP-SAT's deterministic time (its own count of operations)"),
    "cpsat_constraint": Unit(8.49e-05, "a constraint of a CP-SAT model solved: loading and presolve, left out of dtime"),
    "simulated_step": Unit(1.23e-05, "a step (an op run or a tensor's copy) the simulator replays"),
    "bound_op": Unit(0.0, "an op of a problem the peak bound covers"),
    "bound_scan": Unit(0.0, "a tensor the bound's per-op passes look at"),
    "bound_edge": Unit(0.0, "an edge of the bound's min-cut networks"),
    "problem_op": Unit(0.000887, "an op of a problem built from a graph (costs, tensors, fusion groups)"),
    "op_timed": Unit(0.0101, "an op (or a fusion group's kernel) timed on the device (inputs made, warm-up, repeats)"),
    "op_profiled": Unit(0.0, "an op run under the allocation profiler (its scratch space, its out= form)"),
    "profiler_pass": Unit(0.0, "the allocation profiler started and its events read, once per graph timed"),
    "profiler_first_start": Unit(0.0, "the process's first start of the profiler (its libraries set up)"),
    "group_compiled_eager": Unit(0.002, "a fusion group made into a kernel by the eager executor"),
    "group_compiled_inductor": Unit(0.446, "a fusion group compiled by Inductor"),
    "group_compiled_nvfuser": Unit(0.5, "a fusion group compiled by nvFuser"),
    "group_compiled": Unit(0.5, "a fusion group compiled by another executor"),
}

# Where the numbers above come from: `python -m benchmarks.planning_time` at T = 5 s (7 models, 60% and 40%, 4T reruns
# of infeasible ones: 16 programs, fusion compiles capped by the time limit), refit with a pull of 0.001 towards the
# table before it (benchmarks/calibration_fit.py); a unit at 0 was dropped by the fit (its cost shows in the units
# counted with it: the bound's units with problem building, op profiling with op timing). The executors' units no
# run compiled (eager, nvfuser, other) keep their hand-set values.
FITTED_AT = {"commit": "e1fecc7 + the caller's loss scalars", "runs": 16,
             "how": "least squares on the planning-time benchmark, idle 2-core machine, 2026-11-27"}


def compile_unit(executor: str) -> str:
    """The unit a fusion group compiled by `executor` counts in."""
    unit = f"group_compiled_{executor}"
    return unit if unit in UNITS else "group_compiled"


def seconds(unit: str, count: float) -> float:
    return UNITS[unit].seconds * count
