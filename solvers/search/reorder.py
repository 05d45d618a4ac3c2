"""Lower a schedule's peak by reordering windows around it (CP-SAT per window, simulator to accept)."""

from __future__ import annotations

import logging

from ..cpsat.window import reorder_window
from ..model.problem import Problem, Schedule, ScheduleError, reject
from ..model.simulator import SimResult, simulate
from ..model import clock
from .segments import still_consecutive

log = logging.getLogger(__name__)


def refine_order(
    problem: Problem,
    schedule: Schedule,
    *,
    time_limit_s: float = 2.0,
    window: int = 40,
    workers: int = 2,
    max_rounds: int = 12,
) -> Schedule:
    """Reorder the window around the current peak while that lowers the simulated peak.

    Windows never cross from the forward into the backward. Time is unchanged by
    reordering, so the result is never slower than `schedule`, but for copies back from the host
    (`schedule.offload`), issued again as far ahead of their first reader as before: one that waits
    longer may cost time, and a plan that fits keeps its time only where no copy does.
    """
    deadline = clock.now() + time_limit_s
    sim = simulate(problem, schedule)
    for _ in range(max_rounds):
        improved = False
        for a, b in _windows(sim.peak_step, sim.n_forward_steps, len(sim.steps), window):
            left = deadline - clock.now()
            if left <= 0.05:
                return schedule
            new = reorder_window(problem, sim, a, b, time_limit_s=min(left, 2.0), workers=workers)
            if new is None:
                continue
            cand = reordered(problem, schedule, sim, a, b, new)
            try:
                csim = simulate(problem, cand)
            except ScheduleError as e:  # an order the window model allowed and the replay does not
                reject(log, "candidate(s) rejected in window reordering", e)
                continue
            if csim.peak_bytes < sim.peak_bytes:
                schedule, sim, improved = cand, csim, True
                break
        if not improved:
            break
    return schedule


def reordered(problem: Problem, schedule: Schedule, sim: SimResult, a: int, b: int,
              new: list[tuple[int, bool]]) -> Schedule:
    """`schedule` with steps [a, b) run in the order `new`. A copy back from the host issued inside the
    window is issued again the same number of steps ahead of its first reader (within the window); one
    issued outside keeps its place. Fusion options formed across the window are left unformed when
    their members no longer run together."""
    steps = sim.steps[:a] + new + sim.steps[b:]
    n_fw = sim.n_forward_steps
    bw = [o for o, _ in steps[n_fw:]]
    offload = dict(schedule.offload)
    if offload and a >= n_fw:
        readers = _first_readers(problem, steps, a, b, offload)
        for t in schedule.offload:
            ev = sim.offloads.get(t)
            if ev is None or not a <= ev.prefetch < b or t not in readers:
                continue
            offload[t] = max(a, readers[t] - (ev.first_read - ev.prefetch)) - n_fw
    fw = [o for o, _ in steps[:n_fw]]
    return Schedule(fw, bw, offload, tuple(i for i in schedule.formed if still_consecutive(problem, i, fw, bw)))


def _first_readers(problem: Problem, steps: list[tuple[int, bool]], a: int, b: int, offload: dict[int, int]
                   ) -> dict[int, int]:
    """Per offloaded tensor, the first step in [a, b) that reads its stored (not recomputed) copy."""
    first: dict[int, int] = {}
    for k in range(a, b):
        o, _rc = steps[k]
        for t in problem.ops[o].inputs:
            if t in offload and t not in first:
                first[t] = k
    return first


def _windows(k: int, n_fw: int, n: int, w: int) -> list[tuple[int, int]]:
    """Windows around step k, within its phase: centred, then shifted back and forth, then wider."""
    lo, hi = (0, n_fw) if k < n_fw else (n_fw, n)
    out = []
    for start, width in ((k - w // 2, w), (k - 3 * w // 4, w), (k - w // 4, w), (k - w, 2 * w)):
        a = max(lo, min(start, hi - width))
        b = min(hi, a + width)
        if b - a >= 2 and (a, b) not in out:
            out.append((a, b))
    return out

