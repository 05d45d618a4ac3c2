"""The whole step with parameters updated inside the backward (issue 36): planned for a budget no plan with the
optimizer's update after the backward meets (variants.py tries that first), each gradient freed at its update."""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from ..capture.joint_graph import JointGraph
from ..optim.in_graph import is_update
from ..settings import PlanningSettings
from ..solvers import BudgetInfeasibleError, default_schedule, simulate
from .errors import mib
from .op_costs import cost_notes
from .optimizer_step import WholeStep, warn_when_not_stepping
from .program import Planned, ProgramKind
from .variants import Variants


class WholeStepVariants(Variants):
    """The candidates of a training step whose optimizer's update runs after the backward (optimizer_step.WholeStep:
    `gm`, `jg` hold it) and, where none meets the budget, the step with parameters updated inside the backward
    (`in_backward()`: its graph, None where none can be)."""

    more_after = True

    def __init__(self, *args, in_backward: Callable[[], tuple[fx.GraphModule, JointGraph] | None], **kwargs):
        super().__init__(*args, **kwargs)
        self.in_backward = in_backward

    def plan(self) -> Planned:
        try:
            return super().plan()
        except BudgetInfeasibleError as e:
            graph = self.in_backward()
            if graph is None:
                raise e.explained(update_note(self.jg, self.settings)) from None
            return self.plan_in_backward(*graph, e)

    def plan_in_backward(self, gm: fx.GraphModule, jg: JointGraph, after: BudgetInfeasibleError) -> Planned:
        """The step with its parameters updated inside the backward, each gradient freed at its update, for the
        bytes the step with the update after the backward could not meet (`after`). Its budgets and ratios refer
        to that step's unplanned peak (eager's `loss.backward(); opt.step()`). When it does not fit either, the
        error's bound is the lower of the two (a bound for every plan of both)."""
        costs = self.costs if self.costs is not None else self.costs_of(self.gm, self.jg)  # None: floors refused it
        plain = self.captured if self.captured is not None else self.build(self.jg, self.kind.value, costs)
        built = self.build(jg, self.kind.value, costs)
        self.time.share = 1.0
        try:
            plan, items = self.fusion.plan(jg, built, len(gm.graph.nodes), self.solver.solve, after.budget_bytes)
        except BudgetInfeasibleError as e:
            if after.lower_bound_bytes < e.lower_bound_bytes:  # the bound of both: the lower
                e = type(e)(e.budget_bytes, min(e.lowest_peak_bytes, after.lowest_peak_bytes), after.lower_bound_bytes,
                            e.lowest_schedule, elapsed_s=e.elapsed_s, time_limit_s=e.time_limit_s,
                            searched=e.searched, scope=e.scope, summary=e.summary, notes=e.notes)
            raise e.explained(f"with {type(self.settings.optimizer).__name__}'s update after the backward: "
                              f"{after_figures(after)}; the figures above are the step's with updates inside the "
                              "backward") from None
        plan.baseline = simulate(plain.problem, default_schedule(plain.problem))
        plan.updates_in_backward = [op.target.names[0] for op in jg.compute if is_update(op) and op.target.in_backward]
        plan.stats.notes.append(
            f"the optimizer updates {len(plan.updates_in_backward)} parameter(s) inside the backward, each as soon as its "
            f"gradient is final, which frees it: with the update after the backward, {after_figures(after)}, "
            f"over {mib(after.budget_bytes)}. Clipping gradients or an enabled GradScaler then raise (they would see "
            "gradients already applied): pass updates_in_backward=False with them")
        kept = warn_when_not_stepping(plan, items, plan.budget_bytes)
        plan.stats.notes.append(f"a backward that does not step (step_on_backward=False, accumulating) keeps its "
                                f"gradients to its end: peak {mib(kept)}")
        plan.stats.notes += cost_notes(costs)
        return Planned(plan, items, jg)


def variants_for(step: WholeStep | None, gm: fx.GraphModule, jg: JointGraph, kind: ProgramKind, *args,
                 **kwargs) -> Variants:
    """The candidates of a program (Variants' arguments): with an optimizer's `step`, a training program's with the
    update after the backward, then inside it (WholeStepVariants)."""
    if step is None or not kind.training:
        return Variants(gm, jg, kind, *args, **kwargs)
    return WholeStepVariants(*step.after_graph(gm, jg), kind, *args, **kwargs,
                             in_backward=lambda: step.in_backward_graph(gm, jg))


def update_note(jg: JointGraph, settings: PlanningSettings) -> str:
    """What an error of a step with the optimizer's update after the backward says of it ('' without one)."""
    if not any(is_update(n) for n in jg.compute):
        return ""
    name = type(settings.optimizer).__name__
    why = ("updates_in_backward=False" if settings.updates_in_backward is False
           else "no parameter's gradient is one the backward makes alone")
    return (f"the step includes {name}.step() after the backward (parameters, every gradient, {name}'s state and "
            f"its temporaries); updates inside the backward, which free each gradient at its update, are not "
            f"planned: {why}")

def after_figures(e: BudgetInfeasibleError) -> str:
    """The lowest peak a search found and the bound, or the bound alone when none searched."""
    if e.searched:
        return f"the lowest peak found was {mib(e.lowest_peak_bytes)} (bound {mib(e.lower_bound_bytes)})"
    return f"every plan needs at least {mib(e.lower_bound_bytes)}"
