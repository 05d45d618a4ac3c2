"""The portfolio's moves: each a name, when it applies, and a run that offers plans to the incumbent.

A move gets the search context and a deadline (its slice of the time limit, strategy.TIME_TABLE) and
never returns a plan: it offers what it finds to the incumbent, which judges. The solving methods
are in starts.py, segments.py, offload.py, chain.py, fusion_options.py and certify.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from ..model import clock
from ..model.problem import Problem, Schedule, default_schedule
from ..model.simulator import SimResult
from ..progress import ProgressLine
from . import starts
from .blocks import Groups, find_blocks
from .certify import certify_plan
from .chain import MIN_BLOCKS, improve_by_chain
from .fusion_options import form_options
from .heuristics import base_orders
from .hoist import hoist_readers
from .incumbent import Incumbent
from .offload import add_offloads, mix_offload_and_recompute
from .reorder import refine_order
from .segments import improve_by_segments

TIGHT_BUDGET = 0.5  # below this share of the unplanned peak, the segment search also runs first, from the program
CHAIN = True  # combine per-block options along the chain (search/chain.py) after the segment search
SWAP_MAX_OPS = 2000  # the recompute swaps' neighbourhood (candidates x recomputations, a simulation each) above this
# is too large to walk in a slice
MIN_SLICE_S = 0.1  # a move whose slice is shorter than this does not start (but `Move.always`)


@dataclass
class Context:
    """What every move may read: the problem, the budget, and flags the table's `applies` use."""

    problem: Problem
    budget: int | None
    workers: int
    line: ProgressLine
    baseline: SimResult
    hint: Schedule | None = None
    lower: int = 0  # a lower bound on every plan's peak
    cut: bool = False  # a move was ended by its deadline while it still improved the plan
    end: float = math.inf  # the whole search's deadline (clock.now()): what a move with no slice of its own may take
    notes: list[str] = field(default_factory=list)

    @property
    def training(self) -> bool:
        return self.problem.has_backward

    @property
    def small(self) -> bool:
        return len(self.problem.ops) <= starts.INTERVAL_MODEL_MAX_OPS

    @property
    def offload(self) -> bool:
        return self.problem.host_bw > 0 and self.budget is not None

    @property
    def tight(self) -> bool:
        return self.budget is not None and self.budget < TIGHT_BUDGET * self.baseline.peak_bytes

    @cached_property
    def blocks(self) -> Groups:
        return find_blocks(self.problem)


@dataclass(frozen=True)
class Move:
    name: str
    applies: Callable[[Context], bool]
    run: Callable[[Context, Incumbent, float], None]  # (context, incumbent, deadline on clock.now())
    always: bool = False  # runs whatever its slice (a start, the hint, the certification); else from MIN_SLICE_S
    wanted: Callable[[Incumbent], bool] = lambda _inc: True  # given what the incumbent holds when its turn comes
    improver: bool = False  # starts from the incumbent's plan: runs again while it still gains (strategy.run_portfolio)
    offload_only: bool = False  # applies only where offloading is allowed: the other moves' slices leave its weight out


def _left(deadline: float) -> float:
    return deadline - clock.now()


def offer_hint(ctx: Context, inc: Incumbent, _deadline: float) -> None:
    inc.offer(ctx.hint, "the plan passed as a hint (an earlier solve's)",
              rejected="candidate(s) rejected: the hint is not a plan of this problem")


def forward_order(ctx: Context, inc: Incumbent, deadline: float) -> None:
    starts.forward_order(ctx.problem, inc, max(MIN_SLICE_S, _left(deadline)), ctx.workers)


def early_segments(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """Tight budgets: from the program as captured (whole-program models there tend to recompute the chain
    between blocks, which this never does)."""
    found, _cut = improve_by_segments(ctx.problem, default_schedule(ctx.problem), ctx.budget, deadline=deadline,
                                      workers=ctx.workers)
    inc.offer(found, "segment search (order and save/recompute per block)")


def interval_model(ctx: Context, inc: Incumbent, deadline: float) -> None:
    starts.interval_model(ctx.problem, inc, max(MIN_SLICE_S, _left(deadline)), ctx.workers)


def relaxation(ctx: Context, inc: Incumbent, deadline: float) -> None:
    starts.relaxation_and_repair(ctx.problem, inc, max(MIN_SLICE_S, _left(deadline)), ctx.workers, ctx.line)


def relaxation_with_offloads(ctx: Context, inc: Incumbent, deadline: float) -> None:
    starts.relaxation_with_offloads(ctx.problem, inc, max(MIN_SLICE_S, _left(deadline)), ctx.workers, ctx.line)


def block_checkpointing(ctx: Context, inc: Incumbent, _deadline: float) -> None:
    starts.block_checkpointing(ctx.problem, inc, ctx.blocks)


def recompute_swaps(ctx: Context, inc: Incumbent, deadline: float) -> None:
    starts.swap_recomputes(ctx.problem, inc, deadline)


def hoist(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """Nothing fits: the lowest plan with readers of values live across its peak run before it (hoist.py)."""
    low = inc.lowest
    if low is None:
        return
    sched, sim = hoist_readers(ctx.problem, low.schedule, low.sim, ctx.budget, deadline)
    if sched is not low.schedule:
        inc.offer(sched, f"{low.stats.method}, readers hoisted above the peak", sim)


def reorder_windows(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """Small graphs: reorder, then decide recomputation again for the new order; large ones: reorder only
    (it keeps the time, so it gets half its slice once a plan fits)."""
    if inc.start is None:
        return
    if ctx.small:
        starts.reorder_and_redecide(ctx.problem, inc, deadline, ctx.workers)
    elif _left(deadline) > 0.5:
        starts.reorder_only(ctx.problem, inc, _left(deadline) * (0.5 if inc.found else 1.0), ctx.workers)


def offload_ladder(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """Recompute-only plans at looser budgets with offloads on top: a first offloading plan for the
    segment search to refine, and perhaps a lower peak than any recompute-only plan. First, offloads on top of
    a faster plan just over the budget (`Incumbent.near`), when there is one: Llama-7B, 80 layers at 40%, the
    relaxation's plan is 0.14% over at 1.12x the unplanned step's time, where block checkpointing's fits at 1.28x."""
    start, lowest = inc.start, inc.lowest
    if start is None:
        return
    near = inc.near
    if near is not None:
        fitted = add_offloads(ctx.problem, near.schedule, ctx.budget, deadline)
        if fitted is not None:
            inc.offer(fitted, f"{near.stats.method}, then offloads to fit")
    fw, bw = base_orders(ctx.problem, start.schedule)
    for sched in mix_offload_and_recompute(ctx.problem, fw, bw, ctx.budget, deadline,
                                           set(lowest.schedule.recomputed(ctx.problem))):
        inc.offer(sched, "recompute plan at a looser budget + greedy offload")


def reorder_lowest(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """Nothing fits: reorder windows around the lowest plan's peak, its copies to and from the host kept.
    The moves before decide what to offload in an order chosen without copies (the offload ladder, the
    segment search per block); a copy back then holds a consumer back, and what that consumer reads with
    it (the whole step's GPT at 54.45 MiB: a 4 MiB gradient held 20 steps for a weight gradient waiting on
    a 1 MiB copy back; reordered, 54.51 -> 53.31 MiB)."""
    low = inc.lowest
    if low is None or not low.schedule.offload:
        return
    inc.offer(refine_order(ctx.problem, low.schedule, time_limit_s=_left(deadline), workers=ctx.workers,
                           max_rounds=50), f"{low.stats.method}, then reordered around its copies")


def segment_search(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """From the plan found when it fits (to make it faster), else from the lowest (to make one fit). Where offloading
    is allowed and nothing fits, from the lowest plan that offloads nothing, recompute-only, while it is not the
    lowest: as where offloading is not allowed. The offload ladder's plan, lower, was a worse start: the bundled GPT at
    40%, six processes' costs: recompute-only fitted on three, with offloading allowed on none (37.19-37.22 MiB)."""
    if inc.start is None:
        return
    start, offload, plain = inc.start, ctx.offload, inc.lowest_plain
    if offload and not inc.found and plain is not None and plain is not inc.lowest:
        start, offload = plain, False
    found, cut = improve_by_segments(ctx.problem, start.schedule, ctx.budget, deadline=deadline,
                                     workers=ctx.workers, offload=offload)
    ctx.cut = ctx.cut or cut
    inc.offer(found, "segment search (order, save/recompute and offload per block)" if offload
              else "segment search (order and save/recompute per block)")


def chain(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """Per-block options combined along the chain, then the segment search again from its answer."""
    if inc.start is None:
        return
    start = inc.start.schedule
    found = improve_by_chain(ctx.problem, start, ctx.budget, deadline=deadline, workers=ctx.workers,
                             offload=ctx.offload)
    if found is start:
        return
    if _left(deadline) > MIN_SLICE_S:
        found, _cut = improve_by_segments(ctx.problem, found, ctx.budget, deadline=deadline, workers=ctx.workers,
                                          offload=ctx.offload)
    inc.offer(found, "per-block options combined along the chain")


def fusion_options(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """The options the search left unformed decided on the best plan, one simulation each (search/fusion_options.py)."""
    best = inc.best
    if best is None:
        return
    decision = form_options(ctx.problem, best.schedule, ctx.budget, best.sim, deadline=deadline)
    stats = dataclasses.replace(best.stats, notes=best.stats.notes + decision.notes)
    if decision.saved_s:
        inc.offer(decision.schedule, dataclasses.replace(stats, method=f"{stats.method}, then fusion options formed"),
                  decision.sim)
    else:
        best.stats = stats


def certify(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """The bound, gap and status of the plan returned (search/certify.py)."""
    best = inc.best
    if best is not None:
        best.stats = dataclasses.replace(best.stats, notes=list(best.stats.notes))
        certify_plan(ctx.problem, best.schedule, best.sim, ctx.budget, best.stats, _left(deadline), ctx.workers)


# when each move applies (the order and weights are strategy.TIME_TABLE's)
HINT = Move("hint", lambda c: c.hint is not None, offer_hint, always=True)
FORWARD_ORDER = Move("forward order", lambda c: not c.training, forward_order, always=True)
EARLY_SEGMENTS = Move("segment search from the program", lambda c: c.training and c.small and c.tight, early_segments)
INTERVAL_MODEL = Move("interval model", lambda c: c.training and c.small, interval_model, always=True)
RELAXATION = Move("relaxation + repair", lambda c: c.training and not c.small, relaxation, always=True)
RELAXATION_OFFLOADS = Move("relaxation with offloads", lambda c: c.training and not c.small and c.offload
                           and c.budget is not None, relaxation_with_offloads, always=True, offload_only=True)
BLOCK_CHECKPOINTING = Move("block checkpointing", lambda c: c.training and c.budget is not None
                           and bool(c.blocks.blocks), block_checkpointing, always=True)
RECOMPUTE_SWAPS = Move("recompute swaps", lambda c: c.training and c.budget is not None
                       and len(c.problem.ops) <= SWAP_MAX_OPS, recompute_swaps, wanted=lambda inc: not inc.found,
                       improver=True)
HOIST = Move("hoist readers", lambda c: c.training and c.budget is not None, hoist, wanted=lambda inc: not inc.found,
             improver=True)
REORDER = Move("reorder windows", lambda c: c.training, reorder_windows, improver=True)
OFFLOAD = Move("offload ladder", lambda c: c.training and c.offload, offload_ladder, improver=True, offload_only=True)
REORDER_LOWEST = Move("reorder windows (copies kept)", lambda c: c.training and c.offload, reorder_lowest,
                      wanted=lambda inc: not inc.found, improver=True, offload_only=True)
SEGMENTS = Move("segment search", lambda c: c.training and c.budget is not None, segment_search, improver=True)
CHAIN_MOVE = Move("chain", lambda c: CHAIN and c.training and c.budget is not None
                  and len(c.blocks.blocks) >= MIN_BLOCKS, chain, improver=True)
FUSION = Move("fusion options", lambda c: bool(c.problem.fusion_options), fusion_options, wanted=lambda inc: inc.found)
CERTIFY = Move("certify", lambda c: True, certify, always=True, wanted=lambda inc: inc.found)
