"""What the planner's BudgetInfeasibleErrors add to the solver's: what a plan kept by the error offers, one error for
every chunk count tried, and what chunking could or could not have done. Each returns fields (notes, a scope, a
summary) that the error is built with (`BudgetInfeasibleError.explained`); none edits an error's text."""

from __future__ import annotations

import torch.fx as fx

from ..passes.chunked_ce import CHUNK_COUNTS
from ..passes.chunking import Chain, why_no_chain
from ..solvers import BudgetInfeasibleError, PlanningTimeLimitError


def mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def start_from_note(e: BudgetInfeasibleError) -> str:
    """How to get the lowest plan the error found ("" when it kept none): the search depends on the budget, so
    asking for its peak alone may not find it again (optimize's `start_from`)."""
    if e.proven or e.lowest_schedule is None:
        return ""
    return (f"that plan is kept: optimize(..., mem_budget={e.lowest_peak_bytes}, start_from=<this error>) "
            f"starts from it")


def chunked_infeasible(budget_bytes: int, failures: list[tuple[int, BudgetInfeasibleError]], names: list[str],
                       chunking, time_limit_s: float | None = None, untried: list[int] = (),
                       resident: int | None = None) -> BudgetInfeasibleError:
    """No chunk count tried fits: one error for all of them. Each count's bound holds for its own graph's plans
    only, so the bound of all is the lowest of theirs, and "none can" covers the counts tried, no others.
    `untried`: counts the spent time limit left out (then a larger limit may find a plan). `resident`: what
    every count keeps on the device all step (Floor.resident), named when the budget is below it."""
    low = min((e for _, e in failures), key=lambda e: e.lowest_peak_bytes)
    bound = min(e.lower_bound_bytes for _, e in failures)
    timed = [e for _, e in failures if isinstance(e, PlanningTimeLimitError)]
    searched = any(x.searched for _, x in failures)
    if (timed or untried) and budget_bytes >= bound:
        e = PlanningTimeLimitError(budget_bytes, low.lowest_peak_bytes, bound, low.lowest_schedule,
                                   elapsed_s=sum(x.elapsed_s or 0 for _, x in failures),
                                   time_limit_s=time_limit_s or failures[0][1].time_limit_s)
    else:
        e = BudgetInfeasibleError(budget_bytes, low.lowest_peak_bytes, bound, low.lowest_schedule, searched=searched)
    counts = [k for k, _ in failures]
    heads = ", ".join(names)
    if len(counts) == 1:
        scope = f"{heads} in {counts[0]} chunk{'s' if counts[0] > 1 else ''} (chunking={chunking!r}: no other count tried)"
    else:
        scope = f"{heads} in {', '.join(map(str, counts))} chunks (each count chunking chooses from)"
    per = "; ".join(f"{k}: {mib(x.lowest_peak_bytes)}" if x.searched else f"{k}: none searched, below its bound "
                    f"{mib(x.lower_bound_bytes)}" for k, x in failures)
    if e.proven and not searched:
        kept = "" if resident is None or budget_bytes >= resident else (
            f": the parameters, buffers, inputs and the step's outputs (gradients) alone take {mib(resident)} "
            "whatever the chunk count")
        text = (f"no plan fits {mib(budget_bytes)}, and none can with {scope}: every such plan needs at least "
                f"{mib(bound)} (refused before any search{kept})")
    elif e.proven:
        text = (f"no plan fits {mib(budget_bytes)}, and none can with {scope}: every such plan needs at least "
                f"{mib(bound)} (lowest peak found per chunk count: {per})")
    elif isinstance(e, PlanningTimeLimitError):
        left_out = f"; counts {', '.join(map(str, untried))} not tried (the limit was spent)" if untried else ""
        text = (f"no plan fits {mib(budget_bytes)} with {scope} within the time limit ({e.time_limit_s:g}s, shared by the counts): "
                f"lowest peak found per chunk count: {per}{left_out}; none can go below {mib(bound)} "
                f"(gap {e.peak_gap:.1%}); a larger time_limit_s may find one")
    else:
        text = (f"no plan fits {mib(budget_bytes)} with {scope}: none found; lowest peak found per chunk count: {per}, "
                f"and none can go below {mib(bound)} (gap {e.peak_gap:.1%}); the search ended before its time limit")
    return e.explained(summary=text)


def why_not_chunked(e: BudgetInfeasibleError, gm: fx.GraphModule, chains: list[Chain], skipped: list[str],
                    chunking, asked: bool, reach: tuple[int, int] | None = None) -> BudgetInfeasibleError:
    """The error of a graph planned as captured, saying what chunking could have done: with chunking off (the
    default, False, or 1) and a chain, that its bound is the captured graph's only (chunked plans are not
    covered), unless chunking cannot reach the budget either (`reach`: the chunked graphs' lowest floor and
    the resident bytes, Floors.reach_of_chunking); with chunking asked for, or a cross-entropy refused, why
    no chain was found."""
    if chains and not asked and reach is not None and e.budget_bytes < reach[0]:
        lowest, resident = reach
        heads = ", ".join(c.name for c in chains)
        why = (f"the parameters, buffers, inputs and the step's outputs (gradients) alone take {mib(resident)}, "
               "whatever the chunk count" if e.budget_bytes < resident else
               f"with {heads} in {', '.join(map(str, CHUNK_COUNTS[1:]))} token chunks every plan needs at least "
               f"{mib(lowest)}")
        return e.explained(f"chunking cannot reach it either: {why}")
    if chains and not asked:
        heads = ", ".join(f"{c.name} ({c.shape[0]} tokens, vocabulary {c.shape[2]})" for c in chains)
        return e.explained(f"chunking={chunking!r}: {heads} could run in token chunks, which that bound does not "
                           "cover (chunking='auto' chunks it where the budget needs it, True lets the planner choose)",
                           scope="with the LM head + cross-entropy as captured")
    if not chains and (skipped or asked):
        return e.explained(f"chunking found no LM head + cross-entropy chain to run in chunks "
                           f"({why_no_chain(gm, skipped)}), so this covers every plan")
    return e
