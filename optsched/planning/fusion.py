"""Fusion groups in a plan: the executor's vertical groups merged into ops before solving, its horizontal
candidates offered as fusion options decided in the solve, and the formed ones merged for lowering.

Vertical groups are merged, not offered: they save launches and memory (their intermediates are never
materialized), a win in nearly every plan, and merging them shrinks the problem every solver sees. Horizontal
groups trade memory for time (their members' outputs live together), which only the solver, knowing the budget
and the order, can judge: they are options (`solvers.search.fusion_options`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.fx as fx

from ..capture.joint_graph import JointGraph
from ..costs.problem_builder import Built
from ..executors.groups import (Group, build_group, compile_cost_s, compile_groups, group_key, horizontal_candidates,
                                roofline_time)
from ..plans.plan import Plan
from ..solvers import Problem, Schedule, default_schedule, simulate
from ..solvers.model.problem import FusionOption, convexity_violation
from ..solvers.search.fusion_groups import find_groups, fuse_ops, merge_formed
from .program import Target

# solves a fused problem: (problem, graph nodes, per op its node or group, budget) -> its plan
Solve = Callable[[Problem, int, list, "int | None"], Plan]


class Fusion:
    """The fusion groups of `target`'s executor on a program's graph. `named`: the user named the executor
    (then every group is kept, even one whose kernel measures slower than its ops)."""

    def __init__(self, target: Target, named: bool):
        self.target = target
        self.named = named
        # whether the planning time allows a compile of these seconds and this one-time set-up (timing.PlanningTime.
        # may_compile); a group not compiled stays unfused, a candidate unoffered
        self.may_compile: Callable[[float, float], bool] = lambda cost_s, setup_s: True

    def affordable(self, group: Group, compiled: dict) -> bool:
        """Compiled already (this graph's same group), free (plan_offline's groups are planned, not built), or the
        planning time left allows compiling it."""
        cost_s, setup_s = compile_cost_s(self.target.executor, self.target.measure)
        return group_key(group, self.target.measure) in compiled or cost_s + setup_s == 0 or self.may_compile(cost_s, setup_s)

    def fusible(self, jg: JointGraph, nodes: list[fx.Node]) -> list[bool]:
        """Per op, whether the executor may put it in a group."""
        return [self.target.executor.can_fuse(n) and not reads_tangent(jg, n) for n in nodes]

    def fuse(self, jg: JointGraph, built: Built, groups_of_ops: list[list[int]], cache: dict | None = None, *,
             measure: bool | None = None) -> tuple[Problem, list]:
        """The problem the solver sees (each group merged into one op) and, per op, its node or group.
        `cache`: kernels and their timings from earlier calls for this graph. `measure`: time the groups
        (default: as the target does); otherwise their time is the roofline's."""
        if not groups_of_ops:
            return built.problem, list(built.nodes)
        t = self.target
        measure = t.measure if measure is None else measure
        groups = [build_group(jg, built.problem, c, built.nodes) for c in groups_of_ops]
        compile_groups(groups, t.executor, t.device, measure, cache)
        times = [g.time_s if measure else roofline_time(g, t.profile) for g in groups]
        fused = fuse_ops(built.problem, groups_of_ops, times)
        by_first = {c[0]: g for c, g in zip(groups_of_ops, groups)}
        ops = [
            dataclasses.replace(op, workspace_bytes=by_first[unit[0]].workspace_bytes) if unit[0] in by_first else op
            for op, unit in zip(fused.problem.ops, fused.members)
        ]
        problem = dataclasses.replace(fused.problem, ops=ops)
        items = [by_first[unit[0]] if unit[0] in by_first else built.nodes[unit[0]] for unit in fused.members]
        return problem, items

    def plan(self, jg: JointGraph, built: Built, graph_nodes: int, solve: Solve, budget_bytes: int | None = None,
             ) -> tuple[Plan, list]:
        """Plan with the vertical groups merged into ops and the horizontal candidates offered as fusion options,
        decided in one `solve` (formed where the simulator says the plan gets better; fusing independent ops
        makes their outputs live together, which is how memory-blind fusion inflates peaks). The formed ones are
        merged too, for lowering."""
        fusible = self.fusible(jg, built.nodes)
        groups = find_groups(built.problem, fusible)
        compiled: dict = {}
        groups, slower = self.faster_groups(jg, built, groups, compiled)
        problem, items = self.fuse(jg, built, groups, compiled)
        taken = {o for c in groups for o in c}
        cands = horizontal_candidates(built.problem, built.nodes, fusible, taken)
        offered, options, notes = fusion_options(self.target, jg, built, problem, items, cands, compiled,
                                                 lambda g: self.affordable(g, compiled))
        plan = solve(offered, graph_nodes, items, budget_bytes)
        plan.stats.notes += slower + notes
        if not options:
            return plan, items
        formed = [options[i] for i in plan.schedule.formed]
        return self.merge_formed(jg, built, groups + formed, plan, items, compiled)

    def faster_groups(self, jg: JointGraph, built: Built, groups: list[list[int]], compiled: dict,
                      ) -> tuple[list[list[int]], list[str]]:
        """The groups to merge, each compiled (`compiled`) while the planning time allows (`affordable`): with the
        default executor (chosen for the device, not by the user) and measured times, those whose fused kernel runs
        faster than their ops one by one (a kernel that is slower, as a small group's can be, stays unfused: its
        ops run as eager runs them); an executor the user named, or roofline times, keep every group compiled.
        Notes on the groups left out."""
        t = self.target
        compare = not self.named and t.measure
        kept, slower, late = [], [], []
        for members in groups:
            group = build_group(jg, built.problem, members, built.nodes)
            if not self.affordable(group, compiled):
                late.append(members)
                continue
            compile_groups([group], t.executor, t.device, t.measure, compiled)
            one_by_one = sum(built.problem.ops[o].time_s for o in members)
            (kept if not compare or group.time_s < one_by_one else slower).append(members)
        notes = []
        if slower:
            notes.append(f"{len(slower)} fusion group(s) left unfused: their {t.executor.name} kernel measured no "
                         f"faster than their ops one by one (e.g. {', '.join(built.nodes[o].name for o in slower[0][:4])})")
        if late:
            notes.append(f"{len(late)} fusion group(s) left unfused: compiling them would overrun the planning time "
                         "limit (compiles stop once the work outside the search took its share)")
        return kept, notes

    def merge_formed(self, jg: JointGraph, built: Built, groups: list[list[int]], plan: Plan, solved_items: list,
                     compiled: dict) -> tuple[Plan, list]:
        """The plan on the problem with its formed groups merged too (what is lowered and what plan files
        replay): the schedule mapped onto it, its simulated peak and time the solve's. `solved_items`: per
        op of the solved problem, its node or group."""
        problem, items = self.fuse(jg, built, groups, compiled)
        if (problem.outputs, problem.returned) != (plan.problem.outputs, plan.problem.returned):  # planned holding outputs
            problem = dataclasses.replace(problem, outputs=plan.problem.outputs, returned=plan.problem.returned)
        merged, schedule = merge_formed(plan.problem, plan.schedule)
        # merge_formed's ops are this problem's ops, maybe in another order: match them by their first node
        node_id = {n: i for i, n in enumerate(built.nodes)}
        final = {node_id[first_node(it)]: k for k, it in enumerate(items)}
        to_final = [final[min(node_id[first_node(solved_items[o])] for o in unit)] for unit in merged.members]
        schedule = Schedule([to_final[o] for o in schedule.fw_order], [to_final[o] for o in schedule.bw_order],
                            dict(schedule.offload))
        sim = simulate(problem, schedule)
        if sim.peak_bytes != plan.sim.peak_bytes or round(sim.time_s, 12) != round(plan.sim.time_s, 12):
            raise RuntimeError(
                f"internal error: the plan with its fusion groups merged simulates to {sim.peak_bytes} bytes and "
                f"{sim.time_s:.9f} s, the solve's to {plan.sim.peak_bytes} bytes and {plan.sim.time_s:.9f} s"
            )
        baseline = simulate(problem, default_schedule(problem))
        plan = dataclasses.replace(
            plan, problem=problem, schedule=schedule, sim=sim, baseline=baseline,
            fusion_groups=[[n.name for n in it.nodes] for it in items if isinstance(it, Group)],
        )
        return plan, items


def fusion_options(
    target: Target, jg: JointGraph, built: Built, problem: Problem, items: list, cands: list[list[int]], compiled: dict,
    affordable: Callable[[Group], bool] = lambda g: True,
) -> tuple[Problem, list[list[int]], list[str]]:
    """`problem` offering each horizontal candidate (op ids of `built.problem`) as a fusion option, its
    kernel compiled and timed like a group's while `affordable` (the planning time) allows; the candidates offered,
    in option order; notes on those that cannot be offered."""
    op_of = op_ids(built, items)
    options, offered, notes = [], [], []
    for cand in cands:
        label = f"horizontal group of {len(cand)} {built.nodes[cand[0]].target}"
        members = sorted(op_of[o] for o in cand)
        if convexity_violation(problem, members) is not None:
            notes.append(f"{label}: rejected, not convex once the vertical groups are merged")
            continue
        group = build_group(jg, built.problem, cand, built.nodes)
        if not affordable(group):
            notes.append(f"{label}: not offered, compiling it would overrun the planning time limit")
            continue
        compile_groups([group], target.executor, target.device, target.measure, compiled)
        time_s = group.time_s if target.measure else roofline_time(group, target.profile)
        options.append(FusionOption(tuple(members), time_s, group.workspace_bytes, label))
        offered.append(cand)
    return dataclasses.replace(problem, fusion_options=tuple(options)), offered, notes


def op_ids(built: Built, items: list) -> dict[int, int]:
    """Op id in `built.problem` -> id of the op (itself, or its group's) in the problem `items` describes."""
    node_id = {n: i for i, n in enumerate(built.nodes)}
    out = {}
    for k, it in enumerate(items):
        for n in it.nodes if isinstance(it, Group) else [it]:
            out[node_id[n]] = k
    return out


def first_node(item: Group | fx.Node) -> fx.Node:
    """An op's node, or its group's first (groups' nodes are in program order)."""
    return item.nodes[0] if isinstance(item, Group) else item


def reads_tangent(jg: JointGraph, node: fx.Node) -> bool:
    """Whether `node` reads a tangent, directly or through views. A tangent no gradient flowed into arrives
    as a zero broadcast from one element (capture/output_usage.zeros_if_missing), a layout a group
    kernel compiled for the traced strides cannot take: such ops stay out of fusion groups."""
    tangents = set(jg.tangents)
    stack = list(node.all_input_nodes)
    while stack:
        a = stack.pop()
        if a in tangents:
            return True
        if jg.is_view(a):
            stack.extend(a.all_input_nodes)
    return False
