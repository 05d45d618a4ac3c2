"""CP-SAT chain model: one option per repeated block, chosen together for the least time under a budget.

Each block's backward segment can run one of a few plans (options), each known by what it
changes against the plan now: step time, bytes the block keeps on the device from its
forward to its segment, the segment's own peak, and bytes prefetched during the segment
before it. A block's kept bytes raise every segment that runs before its own (the later
blocks', and the head's), and the forward's end; that is what makes the choice a chain
problem rather than one per block: early blocks should keep less than late ones. The
offloads of all blocks share one copy queue each way (`CopyLimits`): each option's alone may
hide behind compute while all of them together stall the step.

The model is linear in these deltas, an estimate: solvers/search/chain.py applies the choice,
the simulator judges it, and a violated segment gets the difference as a margin.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from .common import NS, make_solver, run_solver


@dataclass(frozen=True)
class BlockOption:
    """What one plan of a block's segment changes, against the plan now (option 0 changes nothing)."""

    time_s: float
    kept_bytes: int  # held from the block's forward to its segment
    segment_peak_bytes: int  # the segment's own peak
    prefetch_bytes: int  # offloaded: copied back during the segment that runs just before this block's


@dataclass(frozen=True)
class ChainSegment:
    """A segment of the backward, in backward order: its peak now, and which block (if any) it is.
    `after_blocks`: the blocks whose kept bytes are live during it (those before it in the forward)."""

    peak_bytes: int
    block: int | None
    after_blocks: tuple[int, ...]
    margin_bytes: int = 0


@dataclass(frozen=True)
class CopyLimits:
    """Offloads share one copy queue each way. What blocks i, i+1, ... (forward order) offload must be copied
    out within the forward from block i's start to its end, and back within the backward before block i's
    segment (theirs run first). Per block: bytes offloaded now, and those two stretches of compute."""

    host_bw: float
    now_bytes: tuple[int, ...]
    forward_after_s: tuple[float, ...]
    backward_before_s: tuple[float, ...]


def choose_options(
    options: list[list[BlockOption]],
    segments: list[ChainSegment],
    forward_peak_bytes: int,
    budget_bytes: int,
    *,
    time_limit_s: float = 2.0,
    workers: int = 1,
    copies: CopyLimits | None = None,
) -> list[int] | None:
    """One option index per block (options[i][0] must be 'no change'), or None when no choice fits.
    `copies`: the copy queues' limits on what the blocks offload together (a limit the plan now already
    exceeds only forbids offloading more there)."""
    m = cp_model.CpModel()
    unit = max(1, budget_bytes // (1 << 20))
    units = lambda b: b // unit if b >= 0 else -((-b) // unit)  # noqa: E731  (rounded toward zero)
    pick = [[m.NewBoolVar(f"block{i}_option{j}") for j in range(len(opts))] for i, opts in enumerate(options)]
    for row in pick:
        m.AddExactlyOne(row)

    def total(i: int, field: str):
        return sum(units(getattr(o, field)) * x for o, x in zip(options[i], pick[i]))

    cap = budget_bytes // unit
    m.Add(units(forward_peak_bytes) + sum(total(i, "kept_bytes") for i in range(len(options))) <= cap)
    for k, seg in enumerate(segments):
        expr = units(seg.peak_bytes + seg.margin_bytes) + sum(total(i, "kept_bytes") for i in seg.after_blocks)
        if seg.block is not None:
            expr += total(seg.block, "segment_peak_bytes")
        following = segments[k + 1].block if k + 1 < len(segments) else None
        if following is not None and following != seg.block:
            expr += total(following, "prefetch_bytes")  # the next block's offloads come back during this segment
        m.Add(expr <= cap)
    if copies is not None:
        for i in range(len(options)):
            later = range(i, len(options))
            now = sum(copies.now_bytes[h] for h in later)
            for window in (copies.forward_after_s[i], copies.backward_before_s[i]):
                room = max(int(copies.host_bw * window), now)
                m.Add(units(now) + sum(total(h, "prefetch_bytes") for h in later) <= units(room))
    m.Minimize(sum(round(o.time_s / NS) * x for i, opts in enumerate(options) for o, x in zip(opts, pick[i])))
    for row in pick:
        m.AddHint(row[0], 1)
    solver = make_solver(time_limit_s, workers, "chain")
    status = run_solver(solver, m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [next(j for j, x in enumerate(row) if solver.Value(x)) for row in pick]
