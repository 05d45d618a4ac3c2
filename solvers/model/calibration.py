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
    "cpsat_dtime": Unit(3.25, "a unit of CP-SAT's deterministic time (its own count of operations)"),
    "cpsat_constraint": Unit(3.9e-5, "a constraint of a CP-SAT model solved: loading and presolve, left out of dtime"),
    "simulated_step": Unit(1.3e-5, "a step (an op run or a tensor's copy) the simulator replays"),
    "bound_op": Unit(3.9e-5, "an op of a problem the peak bound covers"),
    "bound_scan": Unit(3.25e-7, "a tensor the bound's per-op passes look at"),
    "bound_edge": Unit(1.3e-6, "an edge of the bound's min-cut networks"),
    "problem_op": Unit(2e-4, "an op of a problem built from a graph (costs, tensors, fusion groups)"),
    "op_timed": Unit(2e-3, "an op (or a fusion group's kernel) timed on the device (inputs made, warm-up, repeats)"),
    "group_compiled_eager": Unit(2e-3, "a fusion group made into a kernel by the eager executor"),
    "group_compiled_inductor": Unit(1.0, "a fusion group compiled by Inductor"),
    "group_compiled_nvfuser": Unit(0.5, "a fusion group compiled by nvFuser"),
    "group_compiled": Unit(0.5, "a fusion group compiled by another executor"),
}

# Where the numbers above come from. Before the fit they were hand-set: the solver units from solves alone
# times 1.3 (the wall time the same solves took inside optimize()), the planner's units from profiles.
FITTED_AT = {"commit": None, "runs": 0, "how": "hand-set from profiles, not yet fitted"}


def compile_unit(executor: str) -> str:
    """The unit a fusion group compiled by `executor` counts in."""
    unit = f"group_compiled_{executor}"
    return unit if unit in UNITS else "group_compiled"


def seconds(unit: str, count: float) -> float:
    return UNITS[unit].seconds * count
