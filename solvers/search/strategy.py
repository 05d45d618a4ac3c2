"""Solving strategy: a portfolio of moves run in turn on one incumbent, within one time budget.

Each move (search/moves.py) offers its plans to the incumbent (search/incumbent.py), which
simulates each once and keeps the best within the budget and the lowest-peak plan. TIME_TABLE
is the portfolio: the moves in the order they run and their weights. A move that applies gets
the time still left times its weight over the weights of the moves still to run that apply, so
time a move does not use flows on and `time_limit_s` is the whole planning time, fusion options
and certification included. Nothing is remembered between solves: an earlier plan is reused only
when the caller passes it (`hint`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from ..heap import caller_heap_frozen
from ..model import clock
from ..model.problem import Problem, Schedule, collecting_rejections, default_schedule
from ..model.simulator import simulate
from ..progress import Display, ProgressLine
from . import joint_bound, moves
from .certify import certify
from .heuristics import lower_bound_peak
from .incumbent import Incumbent
from .moves import Context, Move
from .solution import BudgetInfeasibleError, PlanningTimeLimitError, Solution
from .starts import EXACT_ORDER_MAX_OPS, GAP_TARGET, INTERVAL_MODEL_MAX_OPS

__all__ = ["BudgetInfeasibleError", "PlanningTimeLimitError", "Solution", "TIME_TABLE", "certify", "solve",
           "EXACT_ORDER_MAX_OPS", "GAP_TARGET", "INTERVAL_MODEL_MAX_OPS"]

AIM_STEP = 0.02  # aiming lower: the first target this share below the lowest peak found ...
AIM_MIN_STEP = 0.004  # ... halved after each miss, until this
AIM_SHARE = 0.5  # of the time left, for one aimed search ...
AIM_MIN_S = 1.0  # ... at least this; with less left no aimed search starts (its starts' models alone take about
# that, more in wall time than the clock counts for them: encoder at 40%, 0.2 s slices ran 0.7-0.9 s)


def aim_lower(ctx: Context, inc: Incumbent, deadline: float) -> None:
    """Nothing fits yet. A budget out of reach leaves the moves only the peak to lower, and they stop
    early (a 40% budget on nn.TransformerEncoder: lowest 15.88 MiB in 2.4 s of 5); aimed at a budget just
    below the lowest peak found, from that plan, they find one that fits and lower it again (15.85, 15.45,
    15.08, 14.55, 14.29 MiB in five such searches). So: the portfolio's improvers (the starts ran once; the aimed
    search starts from the lowest plan, passed as its hint) at a target AIM_STEP below the lowest peak (never below
    the budget or the bound), its plans offered here; a miss halves the step. An aim at the budget itself gets all
    the time left. The lowest peak reported can only go down."""
    step = AIM_STEP
    while not inc.found and step >= AIM_MIN_STEP:
        left = deadline - clock.now()
        if left < AIM_MIN_S:
            ctx.cut = True  # still aiming lower when the time ran out
            return
        low = inc.lowest
        aim = max(ctx.budget, ctx.lower, int(low.sim.peak_bytes * (1 - step)))
        if aim >= low.sim.peak_bytes:
            return
        final = aim == ctx.budget  # the budget itself is within reach of one step: all the time left for it
        sub_ctx = dataclasses.replace(ctx, budget=aim, hint=low.schedule, cut=False, notes=[])
        if "blocks" in ctx.__dict__:  # the problem's repeated blocks, found once (a cached property replace drops)
            sub_ctx.__dict__["blocks"] = ctx.blocks
        sub = Incumbent(ctx.problem, aim)
        run_portfolio(sub_ctx, sub, left if final else max(AIM_MIN_S, AIM_SHARE * left), _AIMED_TABLE)
        for cand in (sub.best, sub.lowest):
            if cand is not None:
                inc.offer(cand.schedule, dataclasses.replace(
                    cand.stats, method=f"{cand.stats.method} (aiming at {aim / 2**20:.2f} MiB)"), cand.sim)
        if sub.best is None:
            if final and inc.lowest is low:  # the budget missed with all the time there was, from the same plan
                return
            step /= 2


AIM_LOWER = Move("aim lower", moves.SEGMENTS.applies, aim_lower, wanted=lambda inc: not inc.found)

JOINT_S_PER_OP = 0.004  # of the clock: the joint family's work (its solves, constraints loaded, min cuts) counted for
# the bench-size zoo's tight budgets, 0.29 s at 132 ops (ViT) to 1.17-1.39 s at 358-365 (Llama): it runs when that is left


def joint_floor(ctx: Context, inc: Incumbent, _deadline: float) -> None:
    """Nothing fits after the starts and the improvers' first turns: the joint save/recompute bound
    (search/joint_bound.py), its work on the clock, taken from what aiming lower would get (no slice of its own: a
    weight would shrink every earlier move's, and GPT-2's lowest plan went from 25.54 to 27.15 MiB at 0.3). It raises
    the floor aiming lower aims at, and a budget under it is proven out of reach: the search stops there (`_turn`) and
    says so. OPT (bench size) at 13.2 MiB: the point families' 12.40 MiB left aiming lower its whole time; the joint
    family proves 13.41, the lowest plan's peak."""
    if ctx.end - clock.now() >= JOINT_S_PER_OP * len(ctx.problem.ops):
        ctx.lower = max(ctx.lower, lower_bound_peak(ctx.problem, joint=True))


JOINT_FLOOR = Move("joint bound", lambda c: c.training and c.budget is not None
                   and len(c.problem.ops) <= joint_bound.MAX_OPS, joint_floor, always=True,
                   wanted=lambda inc: not inc.found)
REST = None  # a weight: the move reserves nothing, and gets all the time left when its turn comes
TIME_TABLE: tuple[tuple[Move, float | None], ...] = (  # (move, weight), in the order they run
    (moves.HINT, 0.0),  # the caller's plan, offered first (no search time)
    (moves.FORWARD_ORDER, 1.0),  # forward-only programs: the order is the whole decision
    (moves.EARLY_SEGMENTS, 0.45),  # tight budgets, small graphs: the segment search from the program first. Tried at
    # 2.0 (d4495d6): cut short, its plan is worse than the interval model's, and at 5 s passed to solve() the bundled
    # GPT at 40% fitted on 10 of 10 processes' costs (6 of 10 at 0.45); but at the limit optimize() passes (3.7-4.4 s
    # after op timing) the GPT fitted as often (3 of 4), and OPT's lowest feasible went from 13.41 to 14.05 MiB (the
    # interval model's plan, refined by the improvers, is OPT's way down; they lost their time): reverted
    (moves.INTERVAL_MODEL, 0.15),  # small training graphs: save/recompute per fixed order
    (moves.RELAXATION, 0.35),  # large training graphs: relaxation + repair
    (moves.RELAXATION_OFFLOADS, 1.0),  # large graphs that may offload: the relaxation deciding offloads too (80 Llama-7B
    # layers: its plan, 1.033x at 60%, needs 4.1-4.5 s of the clock; after relaxation + repair's recompute-only slice,
    # weight 0.7 left it too little at 40% (1.129x), 1.0 gives 1.106x)
    (moves.BLOCK_CHECKPOINTING, 0.0),  # repeated blocks: each recomputed from its input (one simulation)
    (moves.RECOMPUTE_SWAPS, 0.4),  # nothing fits: one recomputation more, less or swapped, on the simulator
    (moves.HOIST, 0.1),  # nothing fits: readers of values live across the peak moved before it
    (moves.REORDER, 0.25),  # reorder around the peak (small graphs: recomputation decided again)
    (moves.OFFLOAD, 0.15),  # offloading allowed: the greedy ladder
    (moves.SEGMENTS, 0.35),  # budgeted training: replan segments, copied to repeated blocks
    (moves.CHAIN_MOVE, 0.15),  # 3+ repeated blocks: per-block options combined along the chain
    (moves.REORDER_LOWEST, 0.1),  # nothing fits, offloads: reorder around the lowest plan's copies
    (JOINT_FLOOR, 0.0),  # nothing fits yet, small training graphs: the joint bound (may prove the budget out of reach)
    (AIM_LOWER, REST),  # nothing fits yet: the portfolio again at reachable budgets, down from the lowest peak
    (moves.FUSION, 0.05),  # fusion options the search left unformed
    (moves.CERTIFY, 0.10),  # the bound and status of the plan returned
)
MIN_ROUND_GAIN = 0.001  # a round of improvers that gains less than this share of the step time ends the rounds
# aimed searches: the improvers from the lowest plan (the hint); the starts, which ignore it, ran once (13 problems
# nothing fitted at 3.7-5 s, among them the ViT that aiming lower takes from 6.06 to 5.93-5.95 MiB at 5 s: the same
# lowest peaks as the whole table gave, and the same plans on 21 that fit)
_AIMED_TABLE = tuple((m, w) for m, w in TIME_TABLE if m is moves.HINT or m.improver)
TIME_LIMIT_USED = 0.95  # a search that used this much of its limit was ended by it


# the joint save/recompute bound (search/joint_bound.py, up to a second at a few hundred ops) for budgets under this
# multiple of the point families' bound. 1.0: only to say how far below the bound a refused budget is. At 1.3 (it raised
# no bound by more than 12%) its time inside the solve made the GPT's and GPT-2's 5 s plans at 60% take 1.3-1.7x their
# limit (planning-time benchmark, f86b728) and a 2 s accumulation loop's second micro-batch fail its search: until its
# work is part of the search's own budget, the solve's plans and targets do not depend on it.
JOINT_NEAR = 1.0


def peak_bound_for(problem: Problem, budget_bytes: int | None) -> int:
    """The peak bound `solve` works with and reports: the point families', with the joint family under JOINT_NEAR
    times theirs."""
    lower = lower_bound_peak(problem)
    if budget_bytes is not None and budget_bytes < JOINT_NEAR * lower:
        return lower_bound_peak(problem, joint=True)
    return lower


def solve(
    problem: Problem,
    budget_bytes: int | None,
    *,
    time_limit_s: float = 5.0,
    workers: int | None = None,
    progress: bool | Display = False,
    deterministic: bool = True,
    hint: Schedule | None = None,
) -> Solution:
    """Plan `problem` under `budget_bytes` (None: fastest, then lowest peak) within `time_limit_s` in all.

    `hint`: a plan of this problem to start from (e.g. an earlier `BudgetInfeasibleError.lowest_schedule`):
    it is offered to the incumbent like any move's plan. A budget below the proven bound (`lower_bound_peak`)
    is refused before any search (`BudgetInfeasibleError`, proven, `searched=False`). `deterministic` (default
    True, as in optimize()): the same plan on every run, however fast or busy the machine (solvers/model/clock.py):
    the time limit counts work, CP-SAT runs single-threaded with a fixed seed and `workers` is ignored. False:
    CP-SAT races `workers` against the wall clock (plans may differ between runs and with the machine's load).
    This is `optsched.solvers.solve`.
    """
    with clock.deterministic(deterministic), clock.stage("search"), caller_heap_frozen(), \
            collecting_rejections() as rejected:
        sol = _solve(problem, budget_bytes, time_limit_s, workers, progress, hint)
    sol.stats.notes += rejected.notes()  # the candidates the search dropped on an error, counted per kind
    return sol


def run_portfolio(ctx: Context, inc: Incumbent, time_limit_s: float, table=None) -> None:
    """Each move of TIME_TABLE that applies, in order, on its slice of the time left; a move is skipped
    when the incumbent does not want it (fusion options and certification need a plan that fits, aiming
    lower needs none). Then, at the top level, once a plan fits: the improvers again (`_improve_while_gaining`)
    before the moves after them."""
    end, top = clock.now() + time_limit_s, table is None
    if top:
        ctx.end = end
    table = [(m, w) for m, w in (TIME_TABLE if top else table) if m.applies(ctx)]
    last = max((i for i, (m, _w) in enumerate(table) if m.improver), default=None) if top else None
    yields: dict[Move, tuple[float, float]] = {}
    for i, (move, weight) in enumerate(table):
        _turn(ctx, inc, move, weight, end, _weights(table[i:], move), yields)
        if i == last:
            _improve_while_gaining(ctx, inc, end, yields, _weights(table[i + 1:], None))


def _weights(table: list[tuple[Move, float | None]], move: Move | None) -> float:
    """The weights `move`'s slice is a share of: the moves from it on, less the offload-only moves' when it is not one.
    So where offloading is allowed, every other move gets the slice it gets where it is not (the 8-layer Llama at
    45% on an H200's roofline: 178.2 ms with offloads allowed against 167.1 ms without, its relaxation + repair
    left too little time by the relaxation with offloads before it); the offload-only moves take theirs from
    what is left."""
    return sum(w or 0.0 for m, w in table if move is None or move.offload_only or not m.offload_only)


def _turn(ctx: Context, inc: Incumbent, move: Move, weight: float | None, end: float, weights: float,
          yields: dict[Move, tuple[float, float]]) -> None:
    """One move on `weight` over `weights` of the time left to `end`; an improver's gain per second of the
    clock is kept in `yields`, 0 for a gain under MIN_ROUND_GAIN (a turn that gains less is not worth another:
    32 Llama-7B layers at 60%, the segment search's 0.03% took a second turn of 1.5 s, and certification, left
    0.4 s, could not prove the 0.8% gap it proves in 2 s)."""
    if not move.wanted(inc) or ctx.budget is not None and ctx.budget < ctx.lower:  # proven out of reach: stop
        return
    left = max(0.0, end - clock.now())
    slice_s = left if weight is REST else left * weight / weights if weights > 0 else 0.0
    if slice_s < moves.MIN_SLICE_S and not move.always:
        return
    ctx.line.note(move.name)
    before, t0 = _standing(inc), clock.now()
    move.run(ctx, inc, clock.now() + slice_s)
    if move.improver:
        gained = _gain(before, _standing(inc))
        yields[move] = (weight or 0.0, gained / max(clock.now() - t0, 1e-3) if gained >= MIN_ROUND_GAIN else 0.0)


def _improve_while_gaining(ctx: Context, inc: Incumbent, end: float, yields: dict[Move, tuple[float, float]],
                           reserved: float) -> None:
    """The improvers that gained on their last turn take turns again, the most gain per second first, each on its
    weight's share of the time left (the moves after them keep theirs, `reserved`), while a round gains at least
    MIN_ROUND_GAIN and time is left. Once a plan fits: before, the improvers' second chance was aiming lower only,
    and a search that ended early left its time unspent (12-layer GPT at 50%: 2.4 s of 5)."""
    while inc.found:
        turn = sorted((m for m, (_w, y) in yields.items() if y > 0), key=lambda m: -yields[m][1])
        if not turn:
            return
        start = _standing(inc)
        for k, move in enumerate(turn):
            rest = [(m, yields[m][0]) for m in turn[k:]]
            _turn(ctx, inc, move, yields[move][0], end, _weights(rest, move) + reserved, yields)
        if _gain(start, _standing(inc)) < MIN_ROUND_GAIN:
            return


def _standing(inc: Incumbent) -> tuple[bool, float]:
    """(a plan fits, its time) or (False, the lowest peak): what an improver's gain is measured on."""
    if inc.best is not None:
        return True, inc.best.sim.time_s
    return False, float(inc.lowest.sim.peak_bytes) if inc.lowest is not None else math.inf


def _gain(before: tuple[bool, float], after: tuple[bool, float]) -> float:
    """The share by which the step time (or, while nothing fits, the lowest peak) went down; 1 for a first plan
    that fits."""
    (fit0, v0), (fit1, v1) = before, after
    if fit1 != fit0 or v0 == math.inf:
        return 1.0 if (fit1 and not fit0) or v1 < v0 else 0.0
    return max(0.0, (v0 - v1) / v0) if v0 > 0 else 0.0


def _solve(problem: Problem, budget: int | None, time_limit_s: float, workers: int | None, progress,
           hint: Schedule | None) -> Solution:
    wall0, t0 = time.perf_counter(), clock.now()
    baseline = simulate(problem, default_schedule(problem))
    lower = peak_bound_for(problem, budget)  # its work counted: T includes the bound
    if budget is not None and budget < lower:  # proven: no search can find a plan, so none runs
        raise BudgetInfeasibleError(budget, baseline.peak_bytes, lower, default_schedule(problem),
                                    elapsed_s=time.perf_counter() - wall0, time_limit_s=time_limit_s, searched=False)
    line = ProgressLine(f"planning {len(problem.ops)} ops", enabled=progress is not False,
                        display=None if isinstance(progress, bool) else progress)
    ctx = Context(problem, budget, workers or max(1, min(8, os.cpu_count() or 1)), line, baseline, hint, lower)
    inc = Incumbent(problem, budget)
    try:
        run_portfolio(ctx, inc, max(0.0, time_limit_s - (clock.now() - t0)))  # T includes the bound
        if inc.best is None:
            line.close()
            used = clock.now() - t0
            # below the proven bound no plan fits, however long the search: not a matter of time
            # ctx.lower: the joint family's, where the search took it
            timed_out = (ctx.cut or used >= TIME_LIMIT_USED * time_limit_s) and (budget or 0) >= ctx.lower
            error = PlanningTimeLimitError if timed_out else BudgetInfeasibleError
            low = inc.lowest
            raise error(budget or 0, low.sim.peak_bytes, ctx.lower, low.schedule,
                        elapsed_s=time.perf_counter() - wall0, time_limit_s=time_limit_s)
        best = inc.best
        best.stats.wall_s = time.perf_counter() - wall0
        line.close(f"{best.stats.status}, estimated {best.stats.objective_s * 1e3:.2f} ms, gap {best.stats.gap:.2%}, "
                   f"{best.stats.wall_s:.1f}s")
    except BaseException:  # Ctrl-C or an error: the live line must not outlive the solve
        line.close()
        raise
    # with fusion groups formed the op-operand bound may not hold (a group hides its internal values)
    return Solution(best.schedule, best.sim, best.stats, baseline, budget, min(ctx.lower, best.sim.peak_bytes))
