"""Rebuild a plan from its file for the graph at hand, without solving.

The problem is rebuilt from the graph (same fingerprint, so the same ops in the same
order), fusion groups are re-formed from their member names, and every op gets the
costs the plan was made with (so nothing is measured again). The recorded decisions are
replayed by the simulator: a schedule that does not run, or whose replayed peak is not
the recorded one, is refused, never run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..costs.problem_builder import Built, build_problem
from ..solvers import Problem, Schedule, ScheduleError, SolveStats, default_schedule, simulate
from .file_format import PlanFile, PlanFileError
from .plan import Plan

if TYPE_CHECKING:
    import torch.fx as fx

    from ..capture.joint_graph import JointGraph
    from ..capture.output_usage import OutputUsage
    from ..costs.profiles import DeviceProfile


def plan_from_file(
    jg: JointGraph, gm: fx.GraphModule, pf: PlanFile, name: str, usage: OutputUsage | None = None, *,
    profile: DeviceProfile, offload: bool, fuse: Callable[[Built, list[list[int]]], tuple[Problem, list]],
    resident: Sequence[tuple[str, int]] = (),
) -> tuple[Plan, list]:
    """The plan `pf` records, for graph `gm` (its joint graph `jg`). `fuse(built, groups)`: the problem
    with those fusion groups merged and, per op, its node or group (compiled, not timed: the file's
    costs replace the times). `resident`: what is on the device all step though the program reads none of it
    (build_problem's), as the plan was made with: without it a module with state its program does not read
    replayed to another peak than its file's, and was refused."""
    d, where = pf.data, str(pf.path)
    made_for, decisions = d["made_for"], d["decisions"]
    built = build_problem(
        jg, profile, name=name, offload=offload, host_budget_bytes=made_for.get("host_budget_bytes"), usage=usage,
        grads_at_start=bool(made_for.get("grads_at_start", False)), resident=resident,
    )
    node_id = {n.name: i for i, n in enumerate(built.nodes)}
    try:
        groups = [[node_id[m] for m in g] for g in decisions["fusion_groups"]]
    except KeyError as e:
        raise PlanFileError(f"{where}: fusion group member {e.args[0]!r} is not an op of this graph") from None
    problem, items = fuse(built, groups)
    if decisions["ops"] != [o.name for o in problem.ops]:
        raise PlanFileError(f"{where}: its ops are not this graph's ops (same fingerprint, other fusion or version?)")
    problem = _with_costs(problem, d["costs"], where)
    allocated = d.get("allocated") or {}  # (checked by plans/schema.py) files before it was recorded: none
    problem = _with_allocated(problem, allocated)
    try:
        schedule = file_schedule(pf, problem)
        sim = simulate(problem, schedule)
    except (KeyError, ScheduleError, TypeError, ValueError) as e:
        raise PlanFileError(f"{where}: its schedule does not run on this graph: {e}") from None
    recorded = d["summary"].get("predicted_peak_bytes")
    if sim.peak_bytes != recorded:
        raise PlanFileError(f"{where}: replaying its decisions gives a peak of {sim.peak_bytes} bytes, the file records {recorded}")
    stats = SolveStats(**{k: d["solver"][k] for k in ("status", "objective_s", "bound_s", "gap", "wall_s", "method")},
                       notes=list(d["solver"].get("notes", [])) + [f"loaded from {where}"])
    plan = Plan(
        problem=problem, schedule=schedule, sim=sim, baseline=simulate(problem, default_schedule(problem)), stats=stats,
        budget_bytes=made_for["budget_bytes"], budget_spec=made_for["budget"],
        lower_bound_bytes=d["summary"]["lower_bound_bytes"], profile=profile, timing=made_for["timing"],
        graph_nodes=len(gm.graph.nodes), executor=made_for["executor"], fusion_groups=decisions["fusion_groups"],
        fingerprint=pf.fingerprint, offload_allowed=made_for["offload"], output_usage=made_for.get("outputs"),
        grads_at_start=bool(made_for.get("grads_at_start", False)), allocated=allocated,
    )
    return plan, items


def _with_allocated(problem: Problem, allocated: dict[str, int]) -> Problem:
    """The storages the plan measured larger than their values, at the size measured."""
    if not allocated:
        return problem
    tensors = [dataclasses.replace(t, bytes=allocated[t.name]) if t.name in allocated else t for t in problem.tensors]
    return dataclasses.replace(problem, tensors=tensors)


def file_schedule(pf: PlanFile, problem: Problem) -> Schedule:
    """The schedule `pf` records, on `problem`: a file names the offloaded tensors, the problem numbers them.
    KeyError (a tensor this problem lacks), TypeError or ValueError for decisions that are not this problem's."""
    decisions, tensor_id = pf.data["decisions"], {t.name: t.id for t in problem.tensors}
    return Schedule(
        [int(o) for o in decisions["fw_order"]],
        [int(o) for o in decisions["bw_order"]],
        {tensor_id[t]: int(j) for t, j in decisions["offload"].items()},
    )


def start_schedule(start: Schedule | PlanFile | None, problem: Problem) -> Schedule | None:
    """optimize's `start_from` as a solve's hint on `problem`: a plan file's schedule, its offloads found by name
    here (None when its ops or tensors are not this problem's: the file plans another step, nothing to start from)."""
    if not isinstance(start, PlanFile):
        return start
    if start.data["decisions"]["ops"] != [o.name for o in problem.ops]:  # another graph, fusion or chunking
        return None
    try:
        return file_schedule(start, problem)
    except (KeyError, TypeError, ValueError):
        return None


def _with_costs(problem, costs: dict, where: str):
    """Each op's recorded time, scratch space and in-place writes."""
    names = {t.name: t.id for t in problem.tensors}
    ops = []
    for op in problem.ops:
        try:
            time_s, workspace, reuse = costs[op.name]
            pairs = tuple((names[a], names[b]) for a, b in reuse)
        except (KeyError, TypeError, ValueError):
            raise PlanFileError(f"{where}: no usable costs for op {op.name!r}") from None
        ops.append(dataclasses.replace(op, time_s=float(time_s), workspace_bytes=int(workspace), reuse=pairs))
    try:
        return dataclasses.replace(problem, ops=ops)
    except ValueError as e:
        raise PlanFileError(f"{where}: its costs do not fit this graph: {e}") from None
