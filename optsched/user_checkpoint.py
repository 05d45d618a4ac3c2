"""Activation checkpointing the user already put in the model: a cap the plan never goes above.

Dynamo captures `torch.utils.checkpoint.checkpoint` (non-reentrant, and reentrant too: Dynamo
traces both as the `tag_activation_checkpoint` higher-order op) and AOTAutograd copies its tags
onto the joint graph: every forward node inside a checkpointed region carries
`meta["recompute"]` (a `CheckpointPolicy`: PREFER_RECOMPUTE for plain checkpointing; a selective
policy from `create_selective_checkpoint_contexts` may say MUST_SAVE / PREFER_SAVE / MUST_RECOMPUTE)
and `meta["ac_graph_id"]` (one id per region).

From the tags we build the user's own plan: the captured order, every forward op of a region
recomputed in the backward, except

- ops whose output leaves the region (a forward op outside it reads it: eager keeps what the
  next consumer saves, and the next region saves its input),
- ops the policy marks *_SAVE (selective checkpointing keeps them),
- ops we never recompute (random ops, mutations: `Op.recomputable`). Eager checkpointing replays
  dropout with the saved RNG state; we keep its output instead, so a checkpointed region with
  dropout can cost more here than in eager.

The simulator's peak for that plan caps the budget (`effective = min(budget, cap)`), so at
budget None the planner returns the fastest plan no higher than the user's checkpointing (saving
more where that is free), and at any budget no plan above it. MUST_* policies are not hard
decisions for the solver: the tags only define this reference plan. If the solver finds nothing
under the cap, or only something slower, the reference plan itself is returned.

torch-specific only in reading node metadata; the planning itself goes through `solvers`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .solvers import BudgetInfeasibleError, simulate
from .solvers.search.heuristics import lower_bound_peak, place_recomputes
from .solvers.model.problem import Problem, Schedule, SolveStats, default_schedule
from .solvers.model.simulator import SimResult
from .solvers.search.strategy import Solution

_RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
_MIB = 2**20


@dataclass
class UserCheckpointing:
    """The user's checkpointing as a plan of `problem`: what it recomputes and its simulated figures."""

    schedule: Schedule
    sim: SimResult
    recomputed: list[int]  # op ids recomputed in the backward
    regions: int  # checkpointed regions (ac_graph_ids) seen in the graph
    kept_bytes: int = 0  # outputs of tagged ops we never recompute (random ops) that the backward reads

    @property
    def cap_bytes(self) -> int:
        return self.sim.peak_bytes


def _members(item) -> list[fx.Node]:
    nodes = getattr(item, "nodes", None)  # a fusion group
    return list(nodes) if nodes is not None else [item]


def _tags(item) -> tuple[frozenset, bool, bool]:
    """(region ids, every member asks to be recomputed, some member is tagged at all)."""
    nodes = [n for n in _members(item) if isinstance(n, fx.Node)]
    policies = [n.meta.get("recompute") for n in nodes]
    regions = frozenset(n.meta["ac_graph_id"] for n in nodes if n.meta.get("ac_graph_id") is not None)
    recompute = bool(nodes) and all(p in _RECOMPUTE for p in policies)
    return regions, recompute, any(p is not None for p in policies)


def user_checkpointing(problem: Problem, items: list | None) -> UserCheckpointing | None:
    """The user's checkpointing as a plan of `problem` (`items`: per op, its fx node or fusion group),
    or None when the graph has no checkpointed region or nothing in it can be recomputed."""
    if not items or not problem.has_backward:
        return None
    tags = [_tags(it) for it in items]
    regions = set().union(*(r for r, _, _ in tags))
    if not any(tagged for _, _, tagged in tags):
        return None
    fw = problem.fw_ops
    readers: dict[int, list[int]] = {}
    for op in fw:
        for t in op.inputs:
            readers.setdefault(t, []).append(op.id)
    bw_read = {t for op in problem.bw_ops for t in op.inputs}

    def leaves_region(op_id: int) -> bool:
        region = tags[op_id][0]
        for t in problem.ops[op_id].outputs:
            for r in readers.get(t, ()):
                if not (tags[r][0] & region):  # read outside the region (saved ops of the region are inside)
                    return True
        return False

    # every tagged op that stays inside its region; place_recomputes runs the ones the backward needs
    # (and, depth first, the ones those read), so a region's chain is recomputed, not saved
    inner = [
        op.id
        for op in fw
        if tags[op.id][1]
        and op.recomputable
        and not any(t in problem.outputs for t in op.outputs)
        and not leaves_region(op.id)
    ]
    if not any(t in bw_read for o in inner for t in problem.ops[o].outputs):
        return None
    fw_order = [o.id for o in fw]
    schedule = place_recomputes(problem, fw_order, [o.id for o in problem.bw_ops], inner)
    sim = simulate(problem, schedule)
    # eager replays a random op of a region with its saved RNG state; here its outputs stay saved
    kept = {t for op in fw if tags[op.id][1] and not op.recomputable for t in op.outputs if t in bw_read}
    kept_bytes = sum(problem.tensors[t].bytes for t in kept)
    return UserCheckpointing(schedule, sim, list(sim.recomputed_ops), len(regions), kept_bytes)


def reference_peak(problem: Problem, items: list | None, baseline: SimResult) -> int:
    """The unplanned peak a percentage budget is a share of: the step as the user wrote it, so their own
    checkpointing's peak where the model has some (not the captured program with every activation saved,
    which checkpointing users never run), else the program as captured."""
    user = user_checkpointing(problem, items)
    return user.cap_bytes if user is not None else baseline.peak_bytes


def solve_within_user_checkpointing(
    problem: Problem, items: list | None, budget_bytes: int | None, solve: Callable[[int | None], Solution]
) -> tuple[int | None, Solution]:
    """Solve at min(budget, the user's checkpointed peak); returns (the budget used, the solution).

    The plan is never above the user's checkpointing and never slower than it at the same budget:
    when the solver finds nothing under the cap, or only a slower plan, the user's plan is returned.
    """
    user = user_checkpointing(problem, items)
    if user is None:
        return budget_bytes, solve(budget_bytes)
    cap = user.cap_bytes
    capped = budget_bytes is None or cap < budget_bytes
    effective = cap if capped else budget_bytes
    asked = "no budget" if budget_bytes is None else f"the budget {budget_bytes / _MIB:.2f} MiB"
    note = (
        f"user checkpointing ({user.regions} region{'s' if user.regions != 1 else ''}, "
        f"{len(user.recomputed)} ops recomputed) peaks at {cap / _MIB:.2f} MiB: "
        + (f"the plan's budget is capped there (asked: {asked})" if capped else f"{asked} is below it")
    )
    if user.kept_bytes:
        note += (
            f" (random ops in checkpointed regions are not recomputed: their {user.kept_bytes / _MIB:.2f} MiB "
            "the backward reads stay saved, which eager checkpointing replays instead)"
        )
    fits = user.sim.peak_bytes <= effective
    try:
        sol = solve(effective)
    except BudgetInfeasibleError:
        if not fits:
            raise
        sol = _as_solution(problem, user, effective)
        sol.stats.notes.append(note + "; the solver found nothing under it, the user's plan is kept")
        return effective, sol
    if fits and round(user.sim.time_s, 12) < round(sol.sim.time_s, 12):
        sol = _as_solution(problem, user, effective)
        sol.stats.notes.append(note + "; the user's plan is faster than the solver's and is kept")
        return effective, sol
    sol.stats.notes.append(note)
    return effective, sol


def _as_solution(problem: Problem, user: UserCheckpointing, budget_bytes: int | None) -> Solution:
    bound = sum(o.time_s for o in problem.ops)
    t = user.sim.time_s
    stats = SolveStats(
        status="OPTIMAL" if t <= bound else "HEURISTIC",
        objective_s=t,
        bound_s=bound,
        gap=max(0.0, (t - bound) / t) if t else 0.0,
        wall_s=0.0,
        method="the user's activation checkpointing",
    )
    t0 = time.perf_counter()
    baseline = simulate(problem, default_schedule(problem))
    stats.wall_s = time.perf_counter() - t0
    return Solution(user.schedule, user.sim, stats, baseline, budget_bytes, lower_bound_peak(problem))

