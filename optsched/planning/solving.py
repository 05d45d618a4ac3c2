"""One solve of a program's problem at its budget: the budget resolved for it (its share, or bytes a larger
training program or the first micro-batch's plan lends it), within the user's own checkpointing, a plan that
also fits a caller keeping its outputs tried first, drawing on the program's one time account; its error says
how the budget was reached."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from ..budget import FIRST_MICRO_BATCH, LARGER_TRAINING_PROGRAM, BudgetResolution
from ..capture.joint_graph import JointGraph
from ..capture.output_usage import OutputUsage
from ..executors.groups import Group
from ..plans.plan import Plan
from ..plans.reuse import start_schedule
from ..progress import LiveLine
from ..settings import PlanningSettings
from ..solvers import (
    BudgetInfeasibleError, Problem, Schedule, ScheduleError, SimResult, Solution, default_schedule, simulate, solve,
)
from ..solvers.model import clock
from ..solvers.search.heuristics import lower_bound_peak
from ..user_checkpoint import reference_peak, solve_within_user_checkpointing
from .errors import mib, start_from_note
from .program import Target
from .timing import PlanningTime, time_limit

Hold = tuple[frozenset[int], tuple[int, ...]]  # outputs a plan may hold for the caller: their storages, output indices
NO_HOLD: Hold = (frozenset(), ())


class ProgramSolver:
    """The solves of one program (`Planner.plan` makes one per call), drawing on its one time account `time`, with
    the bytes other plans lend it (`lending`). `held_outputs`: the output indices its last plan holds for a caller
    that keeps them."""

    def __init__(self, settings: PlanningSettings, target: Target, resolution: BudgetResolution, time: PlanningTime,
                 lending: Lending, *, grads_at_start: bool):
        self.settings = settings
        self.target = target
        self.resolution = resolution
        self.time = time
        self.lending = lending
        self.grads_at_start = grads_at_start
        self.held_outputs: tuple[int, ...] = ()

    def solve(self, problem: Problem, graph_nodes: int, items: list | None = None, budget_bytes: int | None = None,
              *, hold: Hold = NO_HOLD, reach: Callable[[int], int] | None = None) -> Plan:
        """The plan of `problem` (per op, `items`: its node or group). `budget_bytes`: a chunk trial's (else the
        program's own, resolved here and explained in the error). `hold`: outputs to hold when a plan holding them
        may fit (`droppable_outputs`). `reach`: chunking="auto"'s floor of the chunked graphs at a budget."""
        baseline = simulate(problem, default_schedule(problem))
        explained = budget_bytes is None  # the program's own budget (not a chunk trial's): say how it was reached
        reference = reference_peak(problem, items, baseline)
        own = None
        if budget_bytes is None:
            own = self.resolution.bytes_for(reference, training=problem.has_backward)

            def bound() -> int:  # "auto": below the chunked graphs' floors too, or chunking may meet the share
                lower = lower_bound_peak(problem)
                return lower if lower <= own or reach is None else min(lower, reach(own))

            # below its bound, a smaller shape takes the bytes already given to a larger one
            budget_bytes = self.lending.lend_larger(own, reference, problem.has_backward, bound)
        limit = time_limit(self.settings.time_limit_s, len(problem.ops))
        progress = LiveLine() if self.settings.progress else False
        limit, start = self.time.slice(limit), clock.now()
        hint = start_schedule(self.settings.start_from, problem)
        dropped = problem
        first = self.lending.first_plan(problem) if explained and self.lending.record is None else None
        hint = hint or (first[0] if first is not None else None)

        def solve_at(b: int | None) -> tuple[int | None, Solution]:
            # checkpointing already in the model caps the budget: never above the user's own plan
            return solve_within_user_checkpointing(
                problem, items, b, lambda b: solve(
                    problem, b, time_limit_s=limit, progress=progress, deterministic=self.settings.deterministic_planning,
                    hint=hint)
            )

        holding = holding_outputs(problem, budget_bytes, hold[0]) if explained else None
        try:
            if holding is not None:  # a plan that also fits a caller keeping its outputs: half the time for it
                problem, whole, limit = holding, limit, limit / 2
                try:
                    budget_bytes, sol = solve_at(budget_bytes)
                    self.held_outputs = hold[1]
                except BudgetInfeasibleError:  # the dropped plan gets what the try left (at least half)
                    problem, holding, limit = dropped, None, max(whole / 2, whole - (clock.now() - start))
            if holding is None:
                try:
                    budget_bytes, sol = solve_at(budget_bytes)
                except BudgetInfeasibleError as e:
                    if first is None or budget_bytes is None or first[1].peak_bytes <= budget_bytes:
                        raise
                    budget_bytes, sol = solve_at(self.lending.accumulate_as_first(first[1], own, e, reference))
        except BudgetInfeasibleError as e:
            how = self._how(e, problem, own, reference, baseline.peak_bytes) if explained else None
            raise e.explained(how, start_from_note(e)) from None
        return self._plan(problem, sol, budget_bytes, graph_nodes, items)

    def _how(self, e: BudgetInfeasibleError, problem: Problem, own: int | None, reference: int, unplanned: int,
             ) -> str | None:
        """How the program's own budget was reached (its share, or lent bytes), and that lending could not help."""
        how = self.lending.explain(e, own, reference, problem.has_backward)
        if how is not None and reference != unplanned:
            how += (f" (the model's own activation checkpointing: its step peaks at {mib(reference)}, the "
                    f"captured program with every activation saved at {mib(unplanned)})")
        return how

    def _plan(self, problem: Problem, sol: Solution, budget_bytes: int | None, graph_nodes: int, items: list | None,
              ) -> Plan:
        t = self.target
        return Plan(
            problem=problem,
            schedule=sol.schedule,
            sim=sol.sim,
            baseline=sol.baseline,
            stats=sol.stats,
            budget_bytes=budget_bytes,
            budget_spec=str(self.settings.budget),
            lower_bound_bytes=sol.lower_bound_bytes,
            profile=t.profile,
            timing="measured" if t.measure else "roofline",
            graph_nodes=graph_nodes,
            executor=t.executor.name,
            fusion_groups=[[n.name for n in it.nodes] for it in items or [] if isinstance(it, Group)],
            grads_at_start=self.grads_at_start and problem.has_backward,
        )


class Lending:
    """The bytes a program plans with when its own share of a percentage cannot be met: a larger training program's
    (`lend_larger`) or, for an accumulation step (`grads_at_start`), what the plan of the same step without
    gradients to start with (`first_micro_batch`) peaks at with them live (`accumulate_as_first`). `record`: those
    bytes as plan files record them (`budget_from`; a replayed file's when it matched), `note`: why."""

    def __init__(self, resolution: BudgetResolution, *, grads_at_start: bool,
                 first_micro_batch: Callable[[], Plan | None], record: dict | None = None):
        self.resolution = resolution
        self.grads_at_start = grads_at_start
        self.first_micro_batch = first_micro_batch
        self.record = record
        self.note: str | None = None

    def lend_larger(self, own: int | None, reference: int, training: bool, bound: Callable[[], int]) -> int | None:
        """A training program whose own share of a percentage (`own`) is below its proven bound (`bound()`, computed
        only when a larger program's bytes could be lent) plans with the bytes of the largest training program
        planned so far (BudgetResolution.lend_larger): recorded for its plan (`record`, `note`)."""
        r = self.resolution
        largest = r.largest if own is not None and training and r.is_percentage else None
        if largest is None or largest["bytes"] <= own:
            return own
        lower = bound()
        record = r.lend_larger(own, lower, training)
        if record is None:
            return own
        self.record = {"program": LARGER_TRAINING_PROGRAM, "unplanned_peak_bytes": record["unplanned_peak_bytes"],
                       "fingerprint": record["fingerprint"], "bytes": record["bytes"], "own_bytes": own,
                       "own_bound_bytes": lower}
        self.note = r.explain_lent(record, own, lower, reference)
        return record["bytes"]

    def explain(self, e: BudgetInfeasibleError, own: int | None, reference: int, training: bool = True) -> str | None:
        """How a program's budget was reached (its share of `reference`, or bytes lent it) and, when `e` is proven,
        that no lending could have helped."""
        how = self.note or self.resolution.explain(reference, training=training)
        below = self.resolution.explain_below_bound(own, e.lower_bound_bytes, training) \
            if e.proven and self.record is None else None
        return f"{how}; {below}" if how is not None and below is not None else how

    def first_plan(self, problem: Problem) -> tuple[Schedule, SimResult] | None:
        """An accumulation step under a percentage: the plan of the same step without gradients to accumulate
        into (the first micro-batch's), simulated here with them live; None when there is none or it plans
        other ops (another fusion or chunk count)."""
        if not (self.grads_at_start and problem.has_backward and self.resolution.is_percentage):
            return None
        first = self.first_micro_batch()
        if first is None or [o.name for o in first.problem.ops] != [o.name for o in problem.ops]:
            return None
        try:
            return first.schedule, simulate(problem, first.schedule)
        except (ScheduleError, KeyError, ValueError):
            return None

    def accumulate_as_first(self, first: SimResult, own: int | None, e: BudgetInfeasibleError, reference: int) -> int:
        """The bytes an accumulation step takes when no plan met its own share: what the first micro-batch's plan
        peaks at with the gradients live (that plan fits them, so the loop goes on at its second micro-batch),
        recorded for its plan (`record`, `note`)."""
        self.record = {"program": FIRST_MICRO_BATCH, "unplanned_peak_bytes": reference, "bytes": first.peak_bytes,
                       "own_bytes": own, "own_bound_bytes": e.lower_bound_bytes if e.proven else None}
        self.note = (
            f"an accumulation step (gradients live from its start): its own share of {self.resolution.budget} is "
            f"{mib(own)}, which no plan met ({'proven' if e.proven else 'none found'}); planned with "
            f"{mib(first.peak_bytes)}, what the first micro-batch's plan peaks at with the gradients live"
        )
        return first.peak_bytes


def droppable_outputs(jg: JointGraph, usage: OutputUsage | None, problem: Problem, observed: OutputUsage | None,
                      resolution: BudgetResolution) -> Hold:
    """On the first call's guess (no backward `observed` yet), the non-scalar outputs a gradient flows into that the
    guess has the caller drop once its loss is made (`default_usage`): their storages and output indices. A caller
    that keeps them through the backward (`out = model(x); loss_fn(out, y).backward()`) holds them longer."""
    if usage is None or observed is not None or not jg.is_training or not resolution.budget.spec:
        return NO_HOLD
    storages: set[int] = set()
    indices = []
    for i, o in enumerate(jg.fw_outputs):
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        if i < len(usage.grad) and usage.grad[i] and not usage.held[i] and isinstance(v, torch.Tensor) and v.dim() > 0:
            storages.update(s for s in jg.node_storages(o) if s in problem.returned)
            indices.append(i)
    return frozenset(storages), tuple(indices)


def holding_outputs(problem: Problem, budget_bytes: int | None, hold: frozenset[int]) -> Problem | None:
    """`problem` with the storages `hold` held to the step's end, when the budget may fit it (not below its
    proven bound): a plan of it fits the caller that drops those outputs and the one that keeps them."""
    if not hold or budget_bytes is None or not problem.has_backward:
        return None
    holding = problem.holding(hold)
    return holding if lower_bound_peak(holding) <= budget_bytes else None
