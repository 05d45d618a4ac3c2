"""Floors of a program's candidate graphs, proven before any op is timed or fusion group compiled: the budget no
candidate can meet is refused at once (issue 33), and an error of the graph as captured says whether chunking
could have met it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx

from ..budget import BudgetResolution
from ..capture.joint_graph import JointGraph, build_joint_graph
from ..costs.problem_builder import Built, reuse_candidates
from ..costs.profiles import NodeCosts
from ..passes.chunked_ce import CHUNK_COUNTS
from ..passes.chunking import Chain, chunk, copy_graph, find_chains
from ..settings import PlanningSettings
from ..solvers import BudgetInfeasibleError, TensorKind, default_schedule, simulate
from ..solvers.model.problem import FusionOption
from ..solvers.search.fusion_groups import find_groups
from ..solvers.search.strategy import peak_bound_for
from .errors import chunked_infeasible, why_not_chunked
from .fusion import Fusion
from .op_costs import CostsOf

Build = Callable[[JointGraph, str, "NodeCosts | None"], Built]  # a graph's problem: (joint graph, name, op costs)


@dataclass(frozen=True)
class Floor:
    """Peaks proven before any op is timed or fusion group compiled (`Floors.floor`): they hold whatever
    the measured costs and whichever fusion groups are formed."""

    bound: int  # no plan of the graph as captured goes below it (0: not computed, the unplanned plan meets the budget)
    resident: int  # parameters, buffers, the batch, unread state and the step's outputs (gradients): any graph of the step
    unplanned: int  # the graph as captured, unplanned, kernel scratch not counted


class Floors:
    """The floors of one program's graph (`gm`, `jg`) and of its chunked copies, their problems made by `build`
    (op costs from `costs_of` where nothing is measured on the device: `measured`), fusion groups by `fusion`."""

    def __init__(self, gm: fx.GraphModule, jg: JointGraph, build: Build, costs_of: CostsOf, fusion: Fusion,
                 settings: PlanningSettings, resolution: BudgetResolution, *, measured: bool,
                 time_left: Callable[[], float] | None = None):
        self.gm, self.jg, self.build, self.costs_of, self.fusion = gm, jg, build, costs_of, fusion
        self.settings, self.resolution, self.measured = settings, resolution, measured
        self.time_left = time_left  # seconds of the program's time limit left (PlanningTime.left_within)

    def floor(self, jg: JointGraph, budget: int | None = None) -> Floor:
        """The floor of `jg` (the program's graph or a chunked copy), before its ops are timed: its problem as the
        most favourable measurement would make it (no kernel scratch, every in-place write profiling could allow: a
        superset of the plans of any measured problem, so its bound is below theirs; where no op is measured, the
        problem itself), with the executor's vertical fusion groups offered as fusion options (their inner values
        count 0 for any subset formed, as merged groups' do; horizontal candidates, ops of one depth, hide no
        value). Where the program runs on this device, scratch and in-place writes are measured even under a
        profile's roofline, so the favourable problem is the floor then too. Tens of milliseconds on the 4-layer
        GPT; the bound is not computed (0) for a `budget` the unplanned peak meets."""
        costs = NodeCosts({}, {}, dict.fromkeys(reuse_candidates(jg), True)) if self.measured else self.costs_of(jg.gm, jg)
        built = self.build(jg, "floor", costs)
        p = built.problem
        groups = find_groups(p, self.fusion.fusible(jg, built.nodes))
        if groups:
            p = dataclasses.replace(p, fusion_options=tuple(FusionOption(tuple(g), 0.0) for g in groups))
        inputs = sum(x.bytes for x in p.tensors if x.kind is TensorKind.INPUT)
        outputs = sum(p.tensors[i].bytes for i in p.outputs if p.tensors[i].kind is not TensorKind.INPUT)
        unplanned = simulate(p, default_schedule(p)).peak_bytes
        # no plan goes below; a budget it refuses is told the bound the solve would tell it
        bound = 0 if budget is not None and budget >= unplanned else peak_bound_for(p, budget)
        return Floor(bound, inputs + outputs, unplanned)

    def counts_tried(self, chains: list[Chain]) -> tuple[int, ...]:
        """The chunk counts this planning tries (1: the graph as captured)."""
        if not chains:
            return (1,)
        return CHUNK_COUNTS if self.settings.chunk_when_needed else self.settings.chunk_counts

    def chunk_floors(self, counts: tuple[int, ...], budget: int, floor: Floor | None = None) -> dict[int, int]:
        """Per chunk count (1: the graph as captured), its graph's floor, until one is at or below `budget` (then
        the rest are not needed). Below the resident bytes no chunked graph is built: they bound every count
        (chunking rewrites the head's inside, not the step's inputs and outputs)."""
        floor = floor or self.floor(self.jg)
        out: dict[int, int] = {}
        for k in counts:
            if k == 1:
                out[k] = floor.bound
            elif budget < floor.resident:
                out[k] = floor.resident
            else:
                g = copy_graph(self.gm)
                chunk(g, k)
                out[k] = self.floor(build_joint_graph(g, self.jg.num_fwd_outputs), budget).bound
            if out[k] <= budget:
                break
        return out

    def reach_of_chunking(self, budget: int, floor: Floor | None = None) -> tuple[int, int] | None:
        """(the lowest floor of the chunked graphs, at or below `budget` when one is; the resident bytes): the
        error of the graph as captured with chunking off suggests chunking only where it might reach the budget.
        None when the program's time limit ran out before every count's floor was found (each is a chunked graph's
        bound: 0.1-0.2 s on the planning-time benchmark's checkpointed model, six of them 1.5x its 5 s limit
        uncounted): the error then claims nothing of chunking's reach."""
        floor = floor or self.floor(self.jg)
        lowest: int | None = None
        for k in CHUNK_COUNTS[1:]:
            if self.time_left is not None and self.time_left() <= 0:
                return None
            got = self.chunk_floors((k,), budget, floor)[k]
            lowest = got if lowest is None else min(lowest, got)
            if lowest <= budget:
                break
        return (lowest, floor.resident) if lowest is not None else None

    def explain_unchunked(self, e: BudgetInfeasibleError, chains: list[Chain], skipped: list[str], asked: bool,
                          floor: Floor | None = None) -> BudgetInfeasibleError:
        """The error of the graph as captured, saying what chunking could have done (errors.why_not_chunked)."""
        if self.jg.is_training and not asked:
            chains, skipped = find_chains(self.gm)
        reach = self.reach_of_chunking(e.budget_bytes, floor) if chains and not asked else None
        return why_not_chunked(e, self.gm, chains, skipped, self.settings.chunking, asked, reach)

    def refuse_below_floor(self, chains: list[Chain], skipped: list[str], asked: bool) -> None:
        """Raise the proven BudgetInfeasibleError before any op is timed, fusion group compiled or search run when
        the budget's bytes are known already (bytes, "auto", a forward-only program's lender's) and below the floor
        of every graph this planning would try: the graph as captured, its chunked graphs where chunking is on
        (issue 33: a 1000-byte budget on the 4-layer GPT timed its ops and searched for 11-50 s to say so)."""
        training = self.jg.is_training
        budget = self.resolution.fixed_bytes(training=training)
        if budget is None:
            return
        floor = self.floor(self.jg, budget)
        counts = self.counts_tried(chains)
        if 1 in counts and budget >= floor.bound:
            return
        floors = self.chunk_floors(counts, budget, floor)
        if min(floors.values()) <= budget:
            return
        if chains:
            failures = [(k, BudgetInfeasibleError(budget, floor.unplanned, b, searched=False)) for k, b in floors.items()]
            e = chunked_infeasible(budget, failures, [c.name for c in chains], self.settings.chunking,
                                   resident=floor.resident)
        else:
            e = BudgetInfeasibleError(budget, floor.unplanned, floor.bound, searched=False)
            e = self.explain_unchunked(e, chains, skipped, asked, floor)
        raise e.explained(self.resolution.explain(floor.unplanned, training=training))
