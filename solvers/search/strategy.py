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

import gc
import os
import time
from contextlib import contextmanager

from ..model import clock
from ..model.problem import Problem, Schedule, collecting_rejections, default_schedule
from ..model.simulator import simulate
from ..progress import Display, ProgressLine
from . import moves
from .certify import certify
from .heuristics import lower_bound_peak
from .incumbent import Incumbent
from .moves import Context, Move
from .solution import BudgetInfeasibleError, PlanningTimeLimitError, Solution
from .starts import EXACT_ORDER_MAX_OPS, GAP_TARGET, INTERVAL_MODEL_MAX_OPS

__all__ = ["BudgetInfeasibleError", "PlanningTimeLimitError", "Solution", "TIME_TABLE", "certify", "solve",
           "EXACT_ORDER_MAX_OPS", "GAP_TARGET", "INTERVAL_MODEL_MAX_OPS"]

REST = None  # a weight: the move reserves nothing, and gets all the time left when its turn comes
TIME_TABLE: tuple[tuple[Move, float | None], ...] = (  # (move, weight), in the order they run
    (moves.HINT, 0.0),  # the caller's plan, offered first (no search time)
    (moves.FORWARD_ORDER, 1.0),  # forward-only programs: the order is the whole decision
    (moves.EARLY_SEGMENTS, 0.45),  # tight budgets, small graphs: the segment search from the program first
    (moves.INTERVAL_MODEL, 0.15),  # small training graphs: save/recompute per fixed order
    (moves.RELAXATION, 0.35),  # large training graphs: relaxation + repair
    (moves.REORDER, 0.25),  # reorder around the peak (small graphs: recomputation decided again)
    (moves.OFFLOAD, 0.15),  # offloading allowed: the greedy ladder
    (moves.SEGMENTS, 0.35),  # budgeted training: replan segments, copied to repeated blocks
    (moves.CHAIN_MOVE, 0.15),  # 3+ repeated blocks: per-block options combined along the chain
    (moves.SEGMENTS_AGAIN, REST),  # nothing fits yet: the segment search again, from the lowest plan
    (moves.FUSION, 0.05),  # fusion options the search left unformed
    (moves.CERTIFY, 0.10),  # the bound and status of the plan returned
)
TIME_LIMIT_USED = 0.95  # a search that used this much of its limit was ended by it


def solve(
    problem: Problem,
    budget_bytes: int | None,
    *,
    time_limit_s: float = 5.0,
    workers: int | None = None,
    progress: bool | Display = False,
    deterministic: bool = False,
    hint: Schedule | None = None,
) -> Solution:
    """Plan `problem` under `budget_bytes` (None: fastest, then lowest peak) within `time_limit_s` in all.

    `hint`: a plan of this problem to start from (e.g. an earlier `BudgetInfeasibleError.lowest_schedule`):
    it is offered to the incumbent like any move's plan. `deterministic`: the same plan on every run
    (solvers/model/clock.py); the time limit then counts work. This is `optsched.solvers.solve`.
    """
    with clock.deterministic(deterministic), _caller_heap_frozen(), collecting_rejections() as rejected:
        sol = _solve(problem, budget_bytes, time_limit_s, workers, progress, hint)
    sol.stats.notes += rejected.notes()  # the candidates the search dropped on an error, counted per kind
    return sol


@contextmanager
def _caller_heap_frozen():
    """The caller's objects are left out of garbage collection while we solve: a captured graph with its
    fake tensors is millions of objects, and every full collection scanned them all (Llama 80 layers,
    plan_offline at 40%: 56.6 s -> 40.9 s, the same plan). Not when the caller froze objects itself:
    unfreezing would release theirs."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_portfolio(ctx: Context, inc: Incumbent, time_limit_s: float) -> None:
    """Each move of TIME_TABLE that applies, in order, on its slice of the time left; a move is skipped
    when the incumbent does not want it (fusion options and certification need a plan that fits, the
    segment search again needs none)."""
    end = clock.now() + time_limit_s
    table = [(m, w) for m, w in TIME_TABLE if m.applies(ctx)]
    for i, (move, weight) in enumerate(table):
        if not move.wanted(inc):
            continue
        left = max(0.0, end - clock.now())
        weights = sum(w or 0.0 for _m, w in table[i:])
        slice_s = left if weight is REST else left * weight / weights if weights > 0 else 0.0
        if slice_s < moves.MIN_SLICE_S and not move.always:
            continue
        ctx.line.note(move.name)
        move.run(ctx, inc, clock.now() + slice_s)


def _solve(problem: Problem, budget: int | None, time_limit_s: float, workers: int | None, progress,
           hint: Schedule | None) -> Solution:
    wall0, t0 = time.perf_counter(), clock.now()
    baseline = simulate(problem, default_schedule(problem))
    lower = lower_bound_peak(problem)
    clock.charge(clock.BOUND_PER_OP2_S * len(problem.ops) ** 2)  # its min cuts: work too
    line = ProgressLine(f"planning {len(problem.ops)} ops", enabled=progress is not False,
                        display=None if isinstance(progress, bool) else progress)
    ctx = Context(problem, budget, workers or max(1, min(8, os.cpu_count() or 1)), line, baseline, hint)
    inc = Incumbent(problem, budget)
    try:
        run_portfolio(ctx, inc, max(0.0, time_limit_s - (clock.now() - t0)))  # T includes the bound
        if inc.best is None:
            line.close()
            used = clock.now() - t0
            error = PlanningTimeLimitError if ctx.cut or used >= TIME_LIMIT_USED * time_limit_s else BudgetInfeasibleError
            low = inc.lowest
            raise error(budget or 0, low.sim.peak_bytes, lower, low.schedule,
                        elapsed_s=time.perf_counter() - wall0, time_limit_s=time_limit_s)
        best = inc.best
        best.stats.wall_s = time.perf_counter() - wall0
        line.close(f"{best.stats.status}, estimated {best.stats.objective_s * 1e3:.2f} ms, gap {best.stats.gap:.2%}, "
                   f"{best.stats.wall_s:.1f}s")
    except BaseException:  # Ctrl-C or an error: the live line must not outlive the solve
        line.close()
        raise
    # with fusion groups formed the op-operand bound may not hold (a group hides its internal values)
    return Solution(best.schedule, best.sim, best.stats, baseline, budget, min(lower, best.sim.peak_bytes))
