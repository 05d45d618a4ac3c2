"""The planner: a captured graph becomes a `Planned` (its plan, what each op runs, the graph to lower).

    graph ─fingerprint─> plan file or carried plan that matches? ─yes─> replayed (replay.py, plans.reuse)
      │ no
      └─> candidates (variants.py: as captured, per chunk count), each a Problem (op costs measured, op_costs.py,
          or the roofline's) with the executor's fusion groups merged and offered (fusion.py), solved at the
          program's budget (solving.py), all under one time account (timing.py)
          ─> Plan: budget resolution recorded, plan file saved when asked (plans.cache), reported

The compile hooks (`compiler.backend.PlanningBackend`, `compiler.offline.OfflineBackend`) make one `Planner` per
compiled program, for its `Target`, and call `Planner.plan` from AOTAutograd's hooks; lowering the plan is theirs.
Nothing the planner is given is changed: a chunked graph is a copy, handed back in `Planned.graph`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from ..budget import BudgetResolution
from ..capture.fingerprint import fingerprint
from ..capture.joint_graph import JointGraph
from ..capture.output_usage import OutputUsage
from ..costs.cost_cache import CostCache
from ..costs.cuda_allocator import AllocatorConfig, default_mode_note
from ..costs.measure import unread_state
from ..costs.problem_builder import oversized_storages
from ..executors import get_executor
from ..optim.updates import describe
from ..plans.cache import save_or_warn
from ..plans.file_format import PlanFile, PlanMismatchError
from ..plans.plan import Plan
from ..settings import PlanningSettings
from ..solvers.heap import caller_heap_frozen
from ..solvers.model import clock
from ..solvers.model.problem import collecting_rejections, rejections_in
from ..user_checkpoint import reference_peak
from .fusion import Fusion
from .op_costs import CostsOf, MeasuredCosts
from .optimizer_step import WholeStep, optimizer_state
from .program import Planned, ProgramKind, Target
from .replay import Found, PlanFiles, replay
from .solving import Lending, ProgramSolver
from .timing import Charged, PlanningTime
from .in_backward import variants_for
from .variants import Variants


class Planner:
    """Plans the programs of one compiled callable for one target (see the module docstring).

    `resolution`: the budget as the optimized callable means it, shared by all its planners (see BudgetResolution).
    `carried`: plans a copy of an optimized module carries from its original, by fingerprint hash, replayed instead of
    solved. `observed_usage`: what a backward showed the caller doing with the outputs (None: only the guess, which a plan
    file's record may replace). `costs`: op costs for a graph (default: measured on the device; times by the profile's
    roofline where the target does not measure them). `grads_at_start`: an accumulation step (api.grads_at_start), whose
    `first_micro_batch` is the plan of the same step without gradients to start with."""

    def __init__(
        self, settings: PlanningSettings, target: Target, on_plan: Callable[[Plan], None],
        *,
        resolution: BudgetResolution | None = None,
        carried: dict[str, list[PlanFile]] | None = None,
        observed_usage: OutputUsage | None = None,
        costs: CostsOf | None = None,
        grads_at_start: bool = False,
        cost_cache: CostCache | None = None,
        first_micro_batch: Callable[[], Plan | None] | None = None,
    ):
        self.settings = settings
        self.target = target  # a replayed file's executor may replace its default one (see plan)
        self.on_plan = on_plan
        self.resolution = resolution if resolution is not None else BudgetResolution(settings.budget)
        self.files = PlanFiles(settings, self.resolution, carried or {})
        self.observed_usage = observed_usage
        self.measured = MeasuredCosts(target.device, target.measure, target.measures_memory, settings.time_limit_s,
                                      cost_cache)
        self.costs = costs or self.measured
        self.grads_at_start = grads_at_start
        self.first_micro_batch = first_micro_batch or (lambda: None)
        # on the device the whole step, read by no program: the module's state it does not read and the optimizer's
        # state (see hold_inputs), (name, bytes) each
        self.resident: list[tuple[str, int]] = []
        self.step: WholeStep | None = None  # with optimizer=: its update in the training program (hold_inputs)

    def hold_inputs(self, values: list, state: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        """The real values the captured program's inputs stand for (parameters first): op timing reads
        them in place instead of making copies. Held weakly, so a batch is not kept alive by its plan.
        `state`: the module's named parameters and buffers; those the program does not read are on the
        device all the same, and every plan counts them (an unused 4 MiB Linear was 4 MiB over budget)."""
        self.measured.hold(values)
        state = list(state)
        self.resident = [(f"{n} (module state the program does not read)", b)
                         for n, b in unread_state(state, values, self.target.device)]
        if self.settings.optimizer is not None:
            self.resident += [(f"{n} (optimizer state)", b)
                              for n, b in optimizer_state(self.settings.optimizer, self.target.device, state)]
            self.step = WholeStep(self.settings.optimizer, self.settings.updates, values, {id(t): n for n, t in state})

    def plan(self, gm: fx.GraphModule, jg: JointGraph, kind: ProgramKind, usage: OutputUsage | None = None,
             charged: Charged | None = None) -> Planned:
        """The plan for `gm` (`jg` its joint graph) and, per op of its problem, the node or fusion group it runs: a
        matching plan file's (or carried plan's), else solved (saved when asked) within the limit less `charged`."""
        fp = fingerprint(gm)
        wanted = self.made_for(kind)
        found = self.files.find(fp, wanted, self.target)
        if found.pf is not None:
            replayed, replay_usage = found.replay_usage(usage, self.observed_usage)
            if replayed:
                return self._replayed(found, fp, gm, jg, kind, replay_usage)
            if found.mismatch is not None and not found.lent and self.settings.on_mismatch == "error":
                raise PlanMismatchError(
                    f"plan file {found.path} does not match: {found.mismatch}. Pass on_mismatch='replan' to plan "
                    "again and overwrite it, or use another plan file"
                )
            # else the caller now uses the outputs otherwise, or the loop lends other bytes: plan again
        lending = Lending(self.resolution, grads_at_start=self.grads_at_start,
                          first_micro_batch=self.first_micro_batch, record=found.lent_record)
        solver = ProgramSolver(self.settings, self.target, self.resolution, PlanningTime(), lending,
                               grads_at_start=self.grads_at_start)
        variants = variants_for(self.step, gm, jg, kind, usage, self.observed_usage, solver=solver,
                                fusion=fusion_of(self.target, self.settings), costs_of=self.costs, resident=self.resident)
        planned = solve_timed(variants, solver.time, gm, self.settings.deterministic_planning, charged)
        plan = planned.plan
        if solver.held_outputs and usage is not None:  # planned for a caller that keeps those outputs too
            usage = OutputUsage(usage.grad, tuple(h or i in solver.held_outputs for i, h in enumerate(usage.held)))
        plan.fingerprint, plan.offload_allowed, plan.optimizer = fp, self.target.offload, wanted["optimizer"]
        plan.allocated = oversized_storages(plan.problem, planned.graph) if self.target.device.type == "cpu" else {}
        plan.output_usage = usage.describe() if usage is not None else None
        self._record_budget(plan, fp, planned.items, lending.record, lending.note)
        if found.path is not None:  # a save the file system refuses warns: the plan is made, the step runs
            save_or_warn(plan.save, found.path, cached=self.settings.plan_spec == "auto")
        self.on_plan(plan)
        return planned

    def _replayed(self, found: Found, fp: dict, gm: fx.GraphModule, jg: JointGraph, kind: ProgramKind,
                  usage: OutputUsage | None) -> Planned:
        if (executor := self.files.file_executor(found.pf, self.target)) is not None:  # the one that formed its groups
            self.target = dataclasses.replace(self.target, executor=get_executor(executor, self.target.device))
        planned = replay(found.pf, gm, jg, kind, usage, self.target, fusion_of(self.target, self.settings), self.resident,
                         self.step if kind.training else None)
        self._record_budget(planned.plan, fp, planned.items, found.lent_record, None)
        self.on_plan(planned.plan)
        return planned

    def made_for(self, kind: ProgramKind) -> dict:
        """What a plan file must have been made for (its output usage is checked apart: see `plan`).
        A percentage budget adds how it resolves for this program (a share of its own peak, or the bytes a
        forward-only program takes from a training program: BudgetResolution.made_for), so a plan is never
        reused for other bytes (and the plan cache keys them apart)."""
        t = self.target
        return {"kind": kind.label, "budget": str(self.settings.budget), "device_profile": t.profile.name,
                "executor": t.executor.name, "offload": t.offload, "grads_at_start": self.grads_at_start and kind.training,
                "optimizer": describe(self.settings.optimizer) if self.step is not None and kind.training else None,
                **self.resolution.made_for(training=kind.training)}

    def _record_budget(self, plan: Plan, fp: dict, items: list | None, lent: dict | None, lent_note: str | None) -> None:
        """How the budget was resolved, on the plan (`lent`: the bytes another program lent it, and why); a training
        program records a percentage's bytes for it (the percentage of its unplanned peak, not a cap the plan
        itself applied): the bytes the forward-only programs of its shapes take (BudgetResolution)."""
        peak = reference_peak(plan.problem, items, plan.baseline)
        training = plan.kind == "training"
        plan.budget_from = dict(lent) if lent else self.resolution.source(peak, fp["hash"], training=training)
        if lent_note is not None and lent_note not in plan.stats.notes:
            plan.stats.notes.append(lent_note)
        _note_allocator_mode(plan)
        if training:
            self.resolution.record_training(self.resolution.bytes_for(peak), peak, fp["hash"])


def _note_allocator_mode(plan: Plan) -> None:
    """A CUDA plan with a budget says what the caching allocator's mode does to its prediction (cuda_allocator)."""
    note = default_mode_note(AllocatorConfig.from_env()) if plan.profile.device_type == "cuda" else None
    if note is not None and plan.budget_bytes is not None and note not in plan.stats.notes:
        plan.stats.notes.append(note)


def fusion_of(target: Target, settings: PlanningSettings) -> Fusion:
    """The fusion of a planner's programs: its executor's groups (named: the caller chose it)."""
    return Fusion(target, named=settings.executor is not None)


def solve_timed(variants: Variants, time: PlanningTime, gm: fx.GraphModule, deterministic: bool,
                charged: Charged | None = None) -> Planned:
    """`variants` planned under their time account (op timing, problem building and every solve count against the
    limit), on the deterministic clock when asked; the errors this graph's passes and planning expected and recovered
    from (a fusion group not convex, an op's FLOP formula raising, ...) noted on the plan (the solver's own are in
    its notes already)."""
    with collecting_rejections(rejections_in(gm.meta).copy()) as recovered:
        with clock.deterministic(deterministic), caller_heap_frozen():  # the bound and problem building too
            time.start(charged)
            try:
                planned = variants.plan()
            finally:
                time.finish()
    planned.plan.stats.notes += recovered.notes()
    return planned
