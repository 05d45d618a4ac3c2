"""Fusion groups as ops: a group runs as one kernel, so the planner sees it as one op.

Merging a group's ops into one op says all the memory model needs: the group runs
contiguously; its materialized inputs and outputs are live together while it runs
(the simulator's rule for any op); a value made and consumed only inside the group is
never materialized, so it takes no memory (its storage keeps its id with 0 bytes). The
group's time is the executor's estimate for the fused kernel, given by the caller.

Which ops form groups: `find_groups` (vertical fusion: ops joined by values only they read,
order tokens of writes included, never fanning out across independent ops), with
`find_chains` as the fallback for a set that is not convex. `merge_formed`: a schedule's formed fusion
options (`Problem.fusion_options`, decided by the solver) merged the same way, for lowering.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import networkx as nx

from ..model.fusion_sim import internal_tensors
from ..model.problem import Op, Phase, Problem, Schedule, ScheduleError, convexity_violation, reject

log = logging.getLogger(__name__)


@dataclass
class Fused:
    problem: Problem
    members: list[list[int]]  # fused op id -> original op ids, in program order
    internal: set[int]  # tensors no longer materialized


def check_group(problem: Problem, group: list[int]) -> None:
    """A group must be one phase, in program order, and convex: no path leaves it and comes back."""
    if not group:
        raise ValueError("an empty fusion group")
    if sorted(group) != list(group) or len(set(group)) != len(group):
        raise ValueError(f"fusion group {group} is not in program order")
    if len({problem.ops[o].phase for o in group}) != 1:
        raise ValueError(f"fusion group {[problem.ops[o].name for o in group]} mixes forward and backward ops")
    # ops reachable from the group through an outside op must not include a member
    if convexity_violation(problem, group) is not None:
        raise ValueError(f"fusion group {[problem.ops[g].name for g in group]} is not convex")


def fuse_ops(problem: Problem, groups: list[list[int]], times: list[float], workspaces: list[int] | None = None,
             ) -> Fused:
    """`problem` with each group (disjoint lists of op ids) merged into one op taking `times[i]` (and
    `workspaces[i]` bytes of scratch space; default 0). Fusion options are dropped (their ids change)."""
    if len(groups) != len(times) or (workspaces is not None and len(workspaces) != len(groups)):
        raise ValueError("one time per fusion group")
    group_of: dict[int, int] = {}
    for i, g in enumerate(groups):
        check_group(problem, g)
        for o in g:
            if o in group_of:
                raise ValueError(f"op {problem.ops[o].name!r} is in two fusion groups")
            group_of[o] = i
    units = _units_in_order(problem, groups, group_of)
    internal: set[int] = set()
    new_id = {}
    for k, unit in enumerate(units):
        for o in unit:
            new_id[o] = k
        if len(unit) > 1 or unit[0] in group_of:
            internal |= internal_tensors(problem, unit)
    tensors = [
        dataclasses.replace(t, bytes=0 if t.id in internal else t.bytes,
                            producer=None if t.producer is None else new_id[t.producer])
        for t in problem.tensors
    ]
    ops = []
    for k, unit in enumerate(units):
        members = [problem.ops[o] for o in unit]
        if len(unit) == 1 and unit[0] not in group_of:
            ops.append(dataclasses.replace(members[0], id=k))
            continue
        made = [t for m in members for t in m.outputs]
        reads = [t for m in members for t in m.inputs if t not in made]
        ops.append(Op(
            id=k,
            name="+".join(m.name for m in members) if len(members) <= 4 else f"{members[0].name}+{len(members) - 1} more",
            phase=members[0].phase,
            inputs=tuple(dict.fromkeys(reads)),
            outputs=tuple(made),
            time_s=times[group_of[unit[0]]],
            recomputable=all(m.recomputable for m in members),
            workspace_bytes=0 if workspaces is None else workspaces[group_of[unit[0]]],
            writes=tuple(t for m in members for t in m.writes),
        ))
    fused = Problem(ops, tensors, problem.outputs, returned=problem.returned, name=problem.name,
                    host_bw=problem.host_bw, host_budget_bytes=problem.host_budget_bytes)
    return Fused(fused, units, internal)


def merge_formed(problem: Problem, schedule: Schedule) -> tuple[Fused, Schedule]:
    """The schedule's formed fusion options merged into ops (`fuse_ops`) and the schedule on that problem:
    each run of a group's members becomes the group's op, offload positions follow. The simulator gives
    both the same peak and time (the formed-group semantics); ScheduleError when a group is not formed
    as one run."""
    opts = [problem.fusion_options[i] for i in schedule.formed]
    fused = fuse_ops(problem, [list(o.members) for o in opts], [o.time_s for o in opts],
                     [o.workspace_bytes for o in opts])
    new_id = {o: k for k, unit in enumerate(fused.members) for o in unit}
    grouped = {o for opt in opts for o in opt.members}

    def mapped(order: list[int]) -> tuple[list[int], list[int]]:
        out: list[int] = []
        where = []
        for o in order:
            if not (o in grouped and out and out[-1] == new_id[o]):
                out.append(new_id[o])
            where.append(len(out) - 1)
        if len(set(out)) != len(out):
            raise ScheduleError("a formed fusion group's members do not run consecutively")
        return out, where

    fw, _ = mapped(schedule.fw_order)
    bw, where = mapped(schedule.bw_order)
    offload = {t: where[j] if 0 <= j < len(where) else j for t, j in schedule.offload.items()}
    return fused, Schedule(fw, bw, offload)


def _units_in_order(problem: Problem, groups: list[list[int]], group_of: dict[int, int]) -> list[list[int]]:
    """Ops and groups in an order that runs: as close to program order as dependencies allow.

    A group takes the place of its last member (its inputs all exist by then); a consumer
    of an earlier member that ran before that place moves after it. Forward before backward.
    """
    units: dict[int, list[int]] = {}  # key: position it would like
    unit_of: dict[int, int] = {}
    for op in problem.ops:
        i = group_of.get(op.id)
        key = op.id if i is None else groups[i][-1]
        units.setdefault(key, []).append(op.id)
        unit_of[op.id] = key
    dag = nx.DiGraph()
    dag.add_nodes_from(units)
    for op in problem.ops:
        for t in op.inputs:
            p = problem.tensors[t].producer
            if p is not None and unit_of[p] != unit_of[op.id]:
                dag.add_edge(unit_of[p], unit_of[op.id])
    phase = {k: problem.ops[u[0]].phase is Phase.BW for k, u in units.items()}
    return [units[k] for k in nx.lexicographical_topological_sort(dag, key=lambda k: (phase[k], k))]


def find_chains(problem: Problem, fusible: list[bool]) -> list[list[int]]:
    """Chains of at least two fusible ops linked by values no one else reads."""
    readers = problem.consumers()
    chains: list[list[int]] = []
    chain_of: dict[int, int] = {}
    for op in problem.ops:
        if not fusible[op.id]:
            continue
        joined = None
        for t in op.inputs:
            p = problem.tensors[t].producer
            c = chain_of.get(p) if p is not None else None
            if (
                c is not None
                and chains[c][-1] == p
                and problem.ops[p].phase is op.phase
                and problem.ops[p].outputs == (t,)
                and readers[t] == [op.id]
                and t not in problem.visible
            ):
                joined = c
                break
        if joined is None:
            chain_of[op.id] = len(chains)
            chains.append([op.id])
        else:
            chain_of[op.id] = joined
            chains[joined].append(op.id)
    return [c for c in chains if len(c) > 1]


def find_groups(problem: Problem, fusible: list[bool]) -> list[list[int]]:
    """Vertical fusion: connected sets of at least two fusible ops of one phase, joined by values
    only fusible ops of that phase read (so none of those values needs memory), order tokens of
    writes among them. A value read by one op joins it to its producer; a value read by several
    joins them only when they already belong together (a diamond), never fanning out into
    independent groups (that is horizontal fusion, which the planner tries separately). A set
    that is not convex (a path leaves it and comes back) falls back to its chains."""
    readers = problem.consumers()
    group = nx.utils.UnionFind(op.id for op in problem.ops if fusible[op.id])
    fanned: list[tuple[int, list[int]]] = []
    for t in problem.tensors:
        p, rs = t.producer, readers[t.id]
        if p is None or not fusible[p] or t.id in problem.visible or not rs:
            continue
        if not all(fusible[r] and problem.ops[r].phase is problem.ops[p].phase for r in rs):
            continue
        if len(set(rs)) == 1:
            group.union(p, rs[0])
        else:
            fanned.append((p, rs))
    for p, rs in sorted(fanned, reverse=True):  # later producers first: their diamonds close first
        if len({group[r] for r in rs}) == 1:
            group.union(p, rs[0])
    groups: list[list[int]] = []
    for component in group.to_sets():
        members = sorted(component)
        if len(members) < 2:
            continue
        try:
            check_group(problem, members)
        except ValueError as e:
            if convexity_violation(problem, members) is None:
                raise  # the sets above are of one phase, in order: only not being convex is expected
            reject(log, "vertical fusion group(s) not convex, fused as their chains", e)
            groups += find_chains(problem, [f and i in component for i, f in enumerate(fusible)])
        else:
            groups.append(members)
    return sorted(groups)
