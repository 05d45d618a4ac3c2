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
    "cpsat_dtime": Unit(1.69, "a unit of CP-SAT's deterministic time (its own count of operations)"),
    "cpsat_constraint": Unit(5.83e-05, "a constraint of a CP-SAT model solved: loading and presolve, left out of dtime"),
    "simulated_step": Unit(8.21e-06, "a step (an op run or a tensor's copy) the simulator replays"),
    "bound_op": Unit(0.0, "an op of a problem the peak bound covers"),
    "bound_scan": Unit(1.87e-08, "a tensor the bound's per-op passes look at"),
    "bound_edge": Unit(0.0, "an edge of the bound's min-cut networks"),
    "bound_flow": Unit(5.71e-08, "an edge a max flow of the bound scanned or advanced past (per phase)"),
    "problem_op": Unit(0.000472, "an op of a problem built from a graph (costs, tensors, fusion groups)"),
    "op_timed": Unit(0.00548, "an op (or a fusion group's kernel) timed on the device (inputs made, warm-up, repeats)"),
    "op_profiled": Unit(0.000491, "an op run under the allocation profiler (its scratch space, its out= form)"),
    "profiler_pass": Unit(0.0914, "the allocation profiler started and its events read (a graph's ops, a fusion kernel's peak)"),
    "profiler_first_start": Unit(0.702, "the process's first start of the profiler (its libraries set up)"),
    "graph_node_captured": Unit(8.2e-4, "a node of the joint graph plan_offline's capture traced (fake tensors; the "
                                        "forward run twice, then forward and backward traced), charged to its limit"),
    "group_compiled_eager": Unit(0.002, "a fusion group made into a kernel by the eager executor"),
    "group_compiled_inductor": Unit(0.433, "a fusion group compiled by Inductor"),
    "inductor_first_start": Unit(2.27, "the process's first Inductor compile (its set-up), beside its group's unit"),
    "group_compiled_nvfuser": Unit(0.5, "a fusion group compiled by nvFuser"),
    "group_compiled": Unit(0.5, "a fusion group compiled by another executor"),
}

# Where the numbers above come from: `python -m benchmarks.planning_time` at T = 5 s (7 models, 60% and 40%, 4T reruns
# of infeasible ones, and the 80-layer Llama-7B offline: 19 programs), least squares (benchmarks/calibration_fit.py)
# with a pull of 0.05 towards priors timed alone on this machine, idle: the bound by timing lower_bound_peak on four
# problems (133, 365 and 9075 ops: 0.07, 0.41, 0.82 s: 2.0e-8 s per tensor scanned, 1.6e-7 s per max-flow edge step,
# per op and per edge built nothing measurable: those stay 0), the profiler by timing measure_peak (its first start
# 0.84 s, then 0.145 s a pass) and profile_nodes (95 ops profiled in 0.108 s), Inductor's first compile (2.9 s
# against 0.07-0.3 s after it). Without priors the fit is not identifiable where units are always counted together
# (each fusion group compiled is profiled once: the compile's and the pass's costs trade off freely) and sets
# some to 0, their cost folded into others: problem building was once charged the bound's cost (0.000887 s an op),
# and a 9075-op plan's clock ran 1.7x its wall time. The executors' units no run compiled (eager, nvfuser, other)
# keep their hand-set values.
# graph_node_captured: plan_offline's capture of Llama-7B's layer x 8, 16, 32, 80 under fake tensors is linear in the
# joint graph's nodes (1730 to 16706 nodes in 1.32 to 12.2 s timed alone, 0.73-0.76 ms a node, no intercept); the
# planning-time benchmark's captures, in a process that planned 15 programs before, and the scaling runs later the
# same day took 0.80-0.84 ms a node: 0.82 (the refit at 530ceba), not refitted with the rest.
FITTED_AT = {"commit": "c806fee + the units above (bound_flow, inductor_first_start, profiler passes counted)",
             "runs": 19, "how": "least squares with priors timed alone (pull 0.05), planning-time benchmark, idle "
                                "2-core machine, 2026-11-28"}


def compile_unit(executor: str) -> str:
    """The unit a fusion group compiled by `executor` counts in."""
    unit = f"group_compiled_{executor}"
    return unit if unit in UNITS else "group_compiled"


def seconds(unit: str, count: float) -> float:
    return UNITS[unit].seconds * count
