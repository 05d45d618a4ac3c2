"""Lower a schedule's peak by reordering windows around it (CP-SAT per window, simulator to accept)."""

from __future__ import annotations


from ..cpsat.window import reorder_window
from ..model.problem import Problem, Schedule
from ..model.simulator import simulate
from ..model import clock


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
    reordering, so the result is never slower than `schedule`.
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
            steps = sim.steps[:a] + new + sim.steps[b:]
            n_fw = sim.n_forward_steps
            cand = Schedule([o for o, _ in steps[:n_fw]], [o for o, _ in steps[n_fw:]])
            csim = simulate(problem, cand)
            if csim.peak_bytes < sim.peak_bytes:
                schedule, sim, improved = cand, csim, True
                break
        if not improved:
            break
    return schedule


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


def base_orders(problem: Problem, schedule: Schedule) -> tuple[list[int], list[int]]:
    """The schedule's forward order and its backward order without recomputations."""
    bw = [o for o in schedule.bw_order if problem.ops[o].phase.value == "bw"]
    return list(schedule.fw_order), bw
