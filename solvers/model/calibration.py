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
    # a unit of CP-SAT's deterministic time (its own count of operations) in each kind of model (solvers/cpsat/common.py)
    "cpsat_dtime_segment": Unit(4.79, "a unit of CP-SAT's deterministic time in a segment model (cumulative memory)"),
    "cpsat_dtime_remat": Unit(7.25, "a unit of CP-SAT's deterministic time in a recompute-set model (cumulative, LP)"),
    "cpsat_dtime_window": Unit(1.25, "a unit of CP-SAT's deterministic time in a reorder window model"),
    "cpsat_dtime_bound": Unit(3.74, "a unit of CP-SAT's deterministic time in the time-bound model"),
    "cpsat_dtime_order": Unit(1.0, "a unit of CP-SAT's deterministic time in a whole-order model (timed alone)"),
    "cpsat_dtime_chain": Unit(1.25, "a unit of CP-SAT's deterministic time in the chain's option model (a window's)"),
    "cpsat_dtime_joint": Unit(1.33, "a unit of CP-SAT's deterministic time in the joint save/recompute bound's model"),
    "joint_arc": Unit(1.45e-06, "an arc of the joint bound's checks (a backward op's minimum cut with the recomputed set fixed)"),
    "joint_constraint": Unit(3.13e-05, "a constraint of the joint bound's model, built and loaded for one of its solves"),
    "cpsat_constraint": Unit(7.68e-05, "a constraint of a CP-SAT model solved: loading and presolve, left out of dtime"),
    "simulated_step": Unit(6.1e-06, "a step (an op run or a tensor's copy) the simulator replays"),
    "bound_op": Unit(9.9e-05, "an op of a problem the peak bound covers"),
    "bound_scan": Unit(0.0, "a tensor the bound's per-op passes look at"),
    "bound_edge": Unit(0.0, "an edge of the bound's min-cut networks"),
    "bound_flow": Unit(1.85e-07, "an edge a max flow of the bound scanned or advanced past (per phase), or walked (per path)"),
    "bound_state": Unit(3.5e-05, "a state the bound's region searches expanded (solvers/search/region_bound.py)"),
    "problem_op": Unit(0.000744, "an op of a problem built from a graph (costs, tensors, fusion groups)"),
    "op_timed": Unit(0.00484, "an op (or a fusion group's kernel) timed on the device (inputs made, warm-up, repeats)"),
    "op_profiled": Unit(0.000486, "an op run under the allocation profiler (its scratch space, its out= form)"),
    "profiler_pass": Unit(0.0872, "the allocation profiler started and its events read (a graph's ops, a fusion kernel's peak)"),
    "profiler_first_start": Unit(0.831, "the process's first start of the profiler (its libraries set up)"),
    "graph_node_captured": Unit(1.46e-3, "a node of the joint graph plan_offline's capture traced (fake tensors; the "
                                        "forward run twice, then forward and backward traced), charged to its limit"),
    "graph_node_stamped": Unit(1.5e-4, "a node of a joint graph stamped from traced blocks (capture/stamping.py: the "
                                       "check's 5 blocks and the model's N), charged to plan_offline's limit"),
    "group_compiled_eager": Unit(0.002, "a fusion group made into a kernel by the eager executor"),
    "group_compiled_inductor": Unit(0.429, "a fusion group compiled by Inductor"),
    "inductor_first_start": Unit(2.85, "the process's first Inductor compile (its set-up), beside its group's unit"),
    "group_compiled_nvfuser": Unit(0.5, "a fusion group compiled by nvFuser"),
    "group_compiled": Unit(0.5, "a fusion group compiled by another executor"),
}

# Where the numbers above come from: `python -m benchmarks.planning_time` at T = 5 s (7 models, 60% and 40%, 4T reruns
# of infeasible ones, and the 80-layer Llama-7B offline: 20 programs) on an idle 2-core AMD EPYC (the CI machine
# since 2026-11-28; benchmarks/meta.py's CPU probe 0.19-0.21 s), least squares (benchmarks/calibration_fit.py) with a
# pull of 0.05 towards priors. CP-SAT's deterministic time is priced per kind of model: one unit of it took 1.1-1.4 s
# of wall time in a reorder window, 2.8-5.4 s in a segment model, 3-4.7 s in the time-bound model and 8-23 s in a
# recompute-set model (solves of saved GPT, ViT, Llama and nn.TransformerEncoder problems timed one by one), so one
# price for all (1.69 s, fitted on another machine where segment solves dominated less) let a recompute-set solve run
# 12x its limit. Those timings are the kinds' priors. No benchmark run solved a whole-order model (forward-only
# programs): timed alone on a seed function's (0.84-1.07 s a unit); the chain's option model's solves took
# milliseconds: a window's price. The other units' priors are the previous table's, timed alone on
# the previous (faster) idle 2-core machine: the bound by timing lower_bound_peak on four problems (133, 365 and 9075 ops: per op and
# per edge built nothing measurable: those stay 0), the profiler by timing measure_peak and profile_nodes, Inductor's
# first compile (2.9 s against 0.07-0.3 s after it). Without priors the fit is not identifiable where units are always
# counted together (each fusion group compiled is profiled once: the compile's and the pass's costs trade off freely)
# and sets some to 0, their cost folded into others: problem building was once charged the bound's cost, and a
# 9075-op plan's clock ran 1.7x its wall time. The executors' units no run compiled (eager, nvfuser, other) keep their
# hand-set values.
# bound_*: lower_bound_peak timed alone here (best of 3) on 11 saved problems of 132 to 9075 ops (GPT, GPT-2, GPT-NeoX,
# ViT, nn.TransformerEncoder, Llama, Llama-7B x 8, 16, 80 layers), fitted by non-negative least squares on relative
# errors: 1.10e-4 s an op and 1.67e-7 a flow step, within 17% on each (the scan and edge counts add nothing once
# those two are in). The previous prices (the faster machine's) charged 0.3-0.6x of its time: the planning-time
# benchmark's llama-outside at 40% took 1.67x its limit, its bounds charged a third of what they took.
# bound_op, bound_flow, bound_state: refitted with the region searches (solvers/search/region_bound.py) the same way,
# lower_bound_peak timed alone (best of 2) on 18 saved problems (GPT, GPT-2 and its chunked loss heads, GPT-NeoX, OPT,
# Llama x 3, nn.TransformerEncoder, the checkpointed TinyLM's variants, 80 Llama-7B layers), CPU probe 0.18-0.20 s:
# 9.9e-5 s an op, 1.85e-7 a flow step (each augmenting path's edges now counted too), 3.5e-5 a state of the region
# searches, within 27% on each (the previous prices, 1.1e-4 / 1.67e-7 / a 1.5e-5 prior, undercharged the regions'
# problems by up to 1.5x alone).
# cpsat_dtime_joint, joint_constraint: the joint bound (solvers/search/joint_bound.py) timed alone here (best of 2,
# against the same bound without it) on 7 problems of 133 to 358 ops (nn.TransformerEncoder, GPT-NeoX, the bundled
# GPT, a transformers Llama, OPT, synthetic chains of 40 and 60 layers), its max flows at bound_flow's price, the rest
# fitted by least squares on relative errors: 1.33 s a unit of deterministic time (one worker, no LP) and 3.1e-5 s a
# constraint solved (the model is built in Python for each solve), within 30% on each (cpsat_constraint's price, a
# shared 7.68e-5, charged these 2-3x their time). joint_arc: its checks (network built in Python, OR-tools' max flow)
# timed alone on 8 saved problems of 133 to 365 ops: 0.58 s for 399,361 arcs.
# graph_node_captured: plan_offline's capture of Llama-7B's layer x 80 under fake tensors took 25.1-25.5 s for 16706
# nodes here (1.5 ms a node; the previous machine took 0.73-0.84), fitted on the benchmark's two captures.
# graph_node_stamped: the 80-layer stamp (16546 nodes, and the 5-block check's 1266) took 1.9-2.7 s beside its traces
# here, timed alone (the benchmark's captures are stamped since).
# simulated_step: fitted at 8.88e-6; then the simulator was made faster (the tensors' facts made once per problem, the
# lifetimes made only when asked): new/old 0.36-0.64 a simulation, median 0.55 (both versions in one process, timed
# alternately, best of 15 x 10 simulations, 11 saved plans of 133 to 469 steps, identical results). The unit prices what
# a simulation's caller does around it too: in the swap search, the move that simulates the most, the simulator took
# 86% of the wall time (profiled, Llama). So 8.88e-6 x (0.14 + 0.86 x 0.64, the slowest problem's ratio) = 6.1e-6.
FITTED_AT = {"commit": "3ff81d7 + CP-SAT's time priced per kind of model",
             "runs": 20, "how": "least squares with priors (pull 0.05), planning-time benchmark, idle 2-core AMD EPYC, "
                                "2026-11-28"}


def compile_unit(executor: str) -> str:
    """The unit a fusion group compiled by `executor` counts in."""
    unit = f"group_compiled_{executor}"
    return unit if unit in UNITS else "group_compiled"


def seconds(unit: str, count: float) -> float:
    return UNITS[unit].seconds * count
