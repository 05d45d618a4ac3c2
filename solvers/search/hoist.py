"""Hoisting: a value live across the backward's peak, its next reader run before the peak instead.

Moves that splice plans together (segment search, swaps, window reorders) decide the steps near the peak, but the
values live there may be held by a reader far after it: GPT-NeoX's lowest plan at a tight budget kept a recomputed MLP
output live across the attention's backward because the down projection's weight gradient, which reads it, ran after
(12.17 MiB; that reader and what it needs run before the attention's backward: 11.67). TinyLM under user
checkpointing: 12.55 -> 11.80 MiB, below the budget the search had missed. A reader is moved with the backward
steps between the peak and it that it needs, and, where they can go too, the steps that read what the moved steps
make (so a moved step's output does not stay live instead); a move is kept when the simulator finds the plan
`better`. Each try is one simulation, on the clock.
"""

from __future__ import annotations

from ..model import clock
from ..model.problem import Problem, Schedule, ScheduleError
from ..model.simulator import SimResult, simulate
from .incumbent import better

MAX_GROUP = 12  # the most steps one move carries before the peak (the reader, its needs, their outputs' readers)
EARLIER_POINTS = 2  # places tried before the peak's step: before the steps making its largest backward values


def hoist_readers(problem: Problem, schedule: Schedule, sim: SimResult, budget: int | None, deadline: float,
                  ) -> tuple[Schedule, SimResult]:
    """The plan after hoisting readers above the peak while it helps and time is left (never worse than
    `schedule`). Plans with offloads or formed fusion groups are returned as they are: their positions index steps."""
    if schedule.offload or schedule.formed:
        return schedule, sim
    while clock.now() < deadline:
        moved = _first_better(problem, schedule, sim, budget, deadline)
        if moved is None:
            return schedule, sim
        schedule, sim = moved
    return schedule, sim


def _first_better(problem: Problem, schedule: Schedule, sim: SimResult, budget: int | None, deadline: float,
                  ) -> tuple[Schedule, SimResult] | None:
    """The first hoist of a value live across the peak (largest first) that the simulator finds better: to just
    before the peak's step, else before the steps that made the largest backward values live there (moved between
    such a step and the peak, a reader would still see them live)."""
    k = sim.peak_step - sim.n_forward_steps
    if k < 0:  # the peak is in the forward
        return None
    bw = list(schedule.bw_order)
    made_at = _producers(problem, bw)
    at_peak = set(problem.ops[bw[k]].inputs)
    across = sorted((lt for lt in sim.lifetimes if lt.start <= sim.peak_step <= lt.end),
                    key=lambda lt: (-problem.tensors[lt.tensor].bytes, lt.tensor))
    points = [k] + list(dict.fromkeys(lt.start - sim.n_forward_steps for lt in across
                                      if sim.n_forward_steps <= lt.start < sim.peak_step))[:EARLIER_POINTS]
    tried: set[tuple[int, tuple[int, ...]]] = set()
    for lt in across:
        if lt.start == sim.peak_step or lt.tensor in at_peak:
            continue
        j = next((i for i in range(k + 1, len(bw)) if lt.tensor in problem.ops[bw[i]].inputs), None)
        for m in points if j is not None else ():
            needs = _needs(problem, bw, made_at, j, m)
            if needs is None:
                continue
            for group in (needs, _with_readers(problem, bw, made_at, needs, m)):
                if (m, group) in tried or len(group) > MAX_GROUP:
                    continue
                tried.add((m, group))
                if clock.now() >= deadline:
                    return None
                members = set(group)
                rest = [o for i, o in enumerate(bw) if i not in members]
                cand = Schedule(list(schedule.fw_order), rest[:m] + [bw[i] for i in group] + rest[m:])
                try:
                    csim = simulate(problem, cand)
                except ScheduleError:  # an in-place update a moved reader would now precede, say
                    continue
                if better(csim, sim, budget):
                    return cand, csim
    return None


def _producers(problem: Problem, bw: list[int]) -> dict[int, list[int]]:
    """Tensor -> the backward positions that make it (a recomputation makes a forward value again)."""
    made_at: dict[int, list[int]] = {}
    for i, o in enumerate(bw):
        for t in problem.ops[o].outputs:
            made_at.setdefault(t, []).append(i)
    return made_at


def _needs(problem: Problem, bw: list[int], made_at: dict[int, list[int]], j: int, k: int) -> tuple[int, ...] | None:
    """Position j and the positions in (k, j) it transitively reads from, sorted; None when it needs step k
    itself (it cannot run before it)."""
    need, stack = {j}, [j]
    while stack:
        i = stack.pop()
        for t in problem.ops[bw[i]].inputs:
            for p in made_at.get(t, ()):
                if p == k and p < i:
                    return None
                if k < p < i and p not in need:
                    need.add(p)
                    stack.append(p)
    return tuple(sorted(need))


def _with_readers(problem: Problem, bw: list[int], made_at: dict[int, list[int]], group: tuple[int, ...], k: int,
                  ) -> tuple[int, ...]:
    """`group` and, while the group stays within MAX_GROUP, the later steps reading what it makes, each with its own
    needs (none of them step k)."""
    out = set(group)
    grew = True
    while grew:
        grew = False
        made = {t for i in out for t in problem.ops[bw[i]].outputs}
        for i in range(k + 1, len(bw)):
            if i in out or not made.intersection(problem.ops[bw[i]].inputs):
                continue
            needs = _needs(problem, bw, made_at, i, k)
            if needs is None or len(out.union(needs)) > MAX_GROUP:
                continue
            out.update(needs)
            grew = True
    return tuple(sorted(out))
