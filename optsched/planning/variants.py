"""The candidate graphs of one program, planned under its one time account: the graph as captured and, for a
training step with an LM head + cross-entropy chain (passes/chunking.py), copies of it with the chain in 2, 4, ...
token chunks (the chunk count is a decision: `settings.chunking`), after their floors (floors.py) allowed the
budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch.fx as fx

from ..capture.joint_graph import JointGraph, build_joint_graph
from ..capture.output_usage import OutputUsage
from ..costs.problem_builder import Built, build_problem
from ..costs.profiles import NodeCosts
from ..passes.chunked_ce import CHUNK_COUNTS
from ..passes.chunking import Chain, chunk, copy_graph, find_chains, why_no_chain
from ..plans.plan import Plan
from ..solvers import BudgetInfeasibleError, SimResult, default_schedule, simulate
from ..solvers.model import clock
from ..user_checkpoint import reference_peak
from .errors import chunked_infeasible, mib, start_from_note
from .floors import Floors
from .fusion import Fusion
from .op_costs import CostsOf, chunked_costs, cost_notes
from .program import ProgramKind, Planned
from .solving import ProgramSolver, droppable_outputs
from .timing import PlanningTime, time_limit

AUTO_FIRST_SHARE = 0.5  # chunking="auto": the share of the time limit the graph as captured gets (the counts the rest)
CHUNK_TIE = 0.01  # more chunks are chosen only when their plan is faster by more than this share
COUNT_MIN_SHARE = 0.1  # after the first count, counts are tried while this share of the time limit is left


@dataclass
class Trial:
    """One chunk count tried: its plan (None: none fits) and items, and its joint graph (a chunked copy above 1)."""

    count: int
    plan: Plan | None
    items: list
    graph: JointGraph


def _time_left(time: PlanningTime, asked: float | None, nodes: int) -> float:
    return time.left_within(time_limit(asked, nodes))


def _floors(v: Variants) -> Floors:
    """The floors of `v`'s graph, their optional work (chunking's reach in an error) within its time limit."""
    left = partial(_time_left, v.time, v.settings.time_limit_s, len(v.gm.graph.nodes))
    return Floors(v.gm, v.jg, v.build, v.costs_of, v.fusion, v.settings, v.resolution,
                  measured=v.target.measures_memory, time_left=left)


class Variants:
    """The candidates of one program (`gm`, `jg`: its graph, never changed) of `kind`, planned for `usage` (the
    caller's, seen in a backward when `observed_usage`): solved by `solver` (whose time account they share), fused
    by `fusion`, their op costs from `costs_of`, refused early by their floors (floors.py)."""

    def __init__(self, gm: fx.GraphModule, jg: JointGraph, kind: ProgramKind, usage: OutputUsage | None,
                 observed_usage: OutputUsage | None, *, solver: ProgramSolver, fusion: Fusion, costs_of: CostsOf,
                 resident: list[tuple[str, int]]):
        self.gm, self.jg, self.kind, self.usage, self.observed_usage = gm, jg, kind, usage, observed_usage
        self.costs: NodeCosts | None = None  # the op costs of `gm`, once measured
        self.captured: Built | None = None  # the problem of `gm` as captured, once built
        self.solver, self.fusion, self.costs_of, self.resident = solver, fusion, costs_of, resident
        self.settings, self.target, self.resolution, self.time = solver.settings, solver.target, solver.resolution, solver.time
        self.floors = _floors(self)

    more_after = False  # something to try where the graph as captured fails (in_backward.py): it gets a share

    def plan(self) -> Planned:
        """The program's plan: the graph as captured, or the chunk count chosen (see passes/chunking.py)."""
        when_needed = self.settings.chunk_when_needed
        asked = self.jg.is_training and (when_needed or self.settings.chunk_counts != (1,))  # "auto", True, a count > 1
        chains, skipped = find_chains(self.gm) if asked else ([], [])  # chunking off: looked for only if nothing fits
        self.floors.refuse_below_floor(chains, skipped, asked)  # before any op is timed
        # "auto": the captured graph's own share is provably out of reach only where no chunk count reaches it either
        reach = (lambda own: min(self.floors.chunk_floors(CHUNK_COUNTS[1:], own).values())) if chains and when_needed else None
        costs = self.costs = self.costs_of(self.gm, self.jg)
        built = self.captured = self.build(self.jg, self.kind.value, costs)
        self.fusion.may_compile = partial(self.time.may_compile, self.settings.time_limit_s, len(built.problem.ops))
        if chains and not when_needed:
            planned = self.plan_chunked(built, costs, chains)
        else:
            planned = self.plan_captured(built, costs, chains, skipped, asked, reach)
        if chains and skipped:
            planned.plan.stats.notes.append("chunking: left alone: " + "; ".join(skipped))
        planned.plan.stats.notes += cost_notes(costs)
        return planned

    def plan_captured(self, built: Built, costs: NodeCosts | None, chains: list[Chain], skipped: list[str], asked: bool,
                      reach: Callable[[int], int] | None) -> Planned:
        """The graph as captured; with chunking="auto" (`chains` found), the chunk counts where it does not fit."""
        # "auto" (or updates in the backward to try after it): the graph as captured gets its share
        self.time.share = AUTO_FIRST_SHARE if chains or self.more_after else 1.0
        hold = droppable_outputs(self.jg, self.usage, built.problem, self.observed_usage, self.resolution)
        solve = lambda problem, nodes, items, b: self.solver.solve(problem, nodes, items, b, hold=hold, reach=reach)
        try:
            plan, items = self.fusion.plan(self.jg, built, len(self.gm.graph.nodes), solve)
        except BudgetInfeasibleError as e:
            if chains:  # "auto": chunks where the budget cannot be met without them
                return self.plan_chunked(built, costs, chains, captured=e)
            raise self.floors.explain_unchunked(e, chains, skipped, asked) from None
        if asked and not chains:
            plan.stats.notes.append(f"chunking: no LM head + cross-entropy chain found: {why_no_chain(self.gm, skipped)}")
        return Planned(plan, items, self.jg)

    def build(self, jg: JointGraph, name: str, costs: NodeCosts | None) -> Built:
        """The problem of `jg` (the program's graph or a chunked copy) named `name`, with op costs `costs`."""
        with clock.stage("problem building"):
            return build_problem(jg, (t := self.target).profile, name=name, measured=costs, offload=t.offload,
                                 host_budget_bytes=t.host_budget_bytes, usage=self.usage, device=t.device,
                                 grads_at_start=self.solver.grads_at_start, resident=self.resident)

    def plan_chunked(self, built: Built, costs: NodeCosts | None, chains: list[Chain],
                     captured: BudgetInfeasibleError | None = None) -> Planned:
        """The chunk count of the LM head + cross-entropy as a decision: the graph as captured (1 chunk) and copies
        with the chain in 2, 4, ... chunks, each planned for the same budget (the captured graph's; `try_counts`);
        the winner's graph is handed back to lower. `captured`: chunking="auto", where the graph as captured did not
        fit (this error): the counts above 1 are tried for the budget it failed. When no count fits, the error
        covers every count tried: its bound is the lowest of theirs (one graph's bound does not hold for another's
        plans)."""
        counts, budget_bytes = counts_to_try(self.settings.chunk_counts, captured)
        baseline = simulate(built.problem, default_schedule(built.problem))
        reference = reference_peak(built.problem, list(built.nodes), baseline)  # the user's checkpointing, if any
        own = self.resolution.bytes_for(reference)  # a training program's own share (or the budget's bytes)
        if budget_bytes is None:  # below every count's floor, a smaller shape takes the bytes given to a larger one
            budget_bytes = self.solver.lending.lend_larger(own, reference, True, lambda: min(
                self.floors.chunk_floors(counts, own).values()))
        tried, failures, best, untried = self.try_counts(built, costs, counts, budget_bytes, captured)
        names = [c.name for c in chains]
        if best is None:
            e = chunked_infeasible(budget_bytes, failures, names, self.settings.chunking, self.time.limit_s, untried)
            raise e.explained(self.solver.lending.explain(e, own, reference), start_from_note(e))
        record_chunks(best, names, tried, untried, baseline, captured, budget_bytes)
        return Planned(best.plan, best.items, best.graph)

    def try_counts(self, built: Built, costs: NodeCosts | None, counts: tuple[int, ...], budget_bytes: int | None,
                   captured: BudgetInfeasibleError | None,
                   ) -> tuple[list[Trial], list[tuple[int, BudgetInfeasibleError]], Trial | None, list[int]]:
        """Each count planned in turn while the time account lasts (each gets half of what is left, the last all of
        it): the trials, the failures, the best trial (None: none fits) and the counts left untried. The fastest plan
        that fits wins, more chunks only when faster by more than CHUNK_TIE (the chunked op is timed and its scratch
        space, one chunk's logits, measured like any op); counts go up until one's plan recomputes nothing and is no
        faster than the best so far: more chunks then only add time."""
        tried: list[Trial] = []
        failures: list[tuple[int, BudgetInfeasibleError]] = []
        if captured is not None:
            tried.append(Trial(1, None, [], self.jg))
            failures.append((1, captured))
        best, untried = None, []
        for i, k in enumerate(counts):
            if i > 0 and self.time.left() < COUNT_MIN_SHARE * self.time.limit_s:
                untried = list(counts[i:])  # the time limit is spent: a count's search would overrun it
                break
            self.time.share = 1.0 / min(2, len(counts) - i)  # half of what is left; the last count all of it
            g, jgk, built_k = self.gm, self.jg, built
            if k > 1:
                g, jgk = chunked_graph(self.gm, self.jg, k)
                built_k = self.build(jgk, built.problem.name, chunked_costs(self.costs_of, g, jgk, costs))
            try:
                plan_k, items_k = self.fusion.plan(jgk, built_k, len(g.graph.nodes), self.solver.solve, budget_bytes)
            except BudgetInfeasibleError as e:
                tried.append(Trial(k, None, [], jgk))
                failures.append((k, e))
                continue
            tried.append(trial := Trial(k, plan_k, items_k, jgk))
            if best is not None and plan_k.sim.time_s >= best.plan.sim.time_s * (1 - CHUNK_TIE):
                if not plan_k.sim.recomputed_ops and not plan_k.sim.offloads:
                    break
                continue
            best = trial
        return tried, failures, best, untried


def counts_to_try(chunk_counts: tuple[int, ...], captured: BudgetInfeasibleError | None,
                  ) -> tuple[tuple[int, ...], int | None]:
    """The chunk counts to plan and the budget they share: chunking="auto" after the graph as captured did not fit
    (`captured`) tries the counts above 1 for the bytes it failed; otherwise the asked counts, the budget unset."""
    if captured is not None:
        return tuple(k for k in CHUNK_COUNTS if k > 1), captured.budget_bytes
    return chunk_counts, None


def chunked_graph(gm: fx.GraphModule, jg: JointGraph, k: int) -> tuple[fx.GraphModule, JointGraph]:
    """A copy of `gm` with its LM head + cross-entropy chains in `k` token chunks, and its joint graph (`gm`, `jg`
    unchanged)."""
    g = copy_graph(gm)
    chunk(g, k)
    return g, build_joint_graph(g, jg.num_fwd_outputs)


def record_chunks(best: Trial, names: list[str], tried: list[Trial], untried: list[int], baseline: SimResult,
                  captured: BudgetInfeasibleError | None, budget_bytes: int | None) -> None:
    """On the chosen count's plan (`best`): its chunk count, the captured program's unplanned baseline (what budgets
    and ratios refer to), each count tried (a note and `chunk_trials`), and why chunking="auto" chunked."""
    plan, k = best.plan, best.count
    plan.chunks = dict.fromkeys(names, k)
    plan.baseline = baseline  # the captured program's, unplanned: what budgets and ratios refer to
    plan.stats.notes.append("chunks of " + ", ".join(names) + ": " + "; ".join(
        f"{t.count}: " + (f"{mib(t.plan.sim.peak_bytes)}, {t.plan.sim.time_s * 1e3:.2f} ms, "
                          f"{len(t.plan.sim.recomputed_ops)} recomputed" if t.plan else "does not fit")
        for t in tried) + f"; chose {k}" + (
        f"; not tried (time limit spent): {', '.join(map(str, untried))}" if untried else ""))
    if captured is not None:
        why = (f"lowest peak found {mib(captured.lowest_peak_bytes)}" if captured.searched else
               f"every plan of it needs {mib(captured.lower_bound_bytes)}")
        plan.stats.notes.append(
            f"chunking='auto': the graph as captured does not fit {mib(budget_bytes)} ({why}), so "
            f"{', '.join(names)} runs in {k} token chunks: "
            "its gradients equal eager's to rounding, not bitwise (the weight's gradient is summed chunk by chunk)")
    plan.chunk_trials = [
        {"chunks": t.count, "fits": t.plan is not None, "predicted_peak_bytes": t.plan.sim.peak_bytes if t.plan else None,
         "estimated_time_s": t.plan.sim.time_s if t.plan else None,
         "n_recomputed": len(t.plan.sim.recomputed_ops) if t.plan else None,
         "recomputed": sorted(t.plan.problem.ops[i].name for i in t.plan.sim.recomputed_ops) if t.plan else None}
        for t in tried
    ]
