"""Fusion options decided on a plan: form a group where the simulator says the plan gets better.

The segment model decides the backward options of its segment together with order and
save/recompute/offload (cpsat/segment.py). What it does not reach (forward options: the forward's
order is not its to change; forward-only programs; segments the search never replans) is decided
here, one option at a time, on the solved plan: the members are moved together (to the last
member's place, ops between that depend on them after it; or to the first member's place, ops
they depend on before it; a recomputed forward group likewise in the backward) and the option is
formed when the simulator says the plan is better: within a budget, faster (or as fast and lower);
with none, faster with no higher peak (fusing independent ops makes their outputs live together,
the way memory-blind fusion inflates peaks). Each try costs one simulation, not a solve. A backward
option neither placement can form is given to the segment model once, on a window of the backward
around its members (order and formation decided together, within the budget, or with none within
the plan's peak); the simulator judges that too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..cpsat.segment import replan_segment
from ..model import clock
from ..model.problem import Phase, Problem, Schedule, ScheduleError, reject
from ..model.simulator import SimResult, simulate
from .incumbent import better, fits
from .segments import splice

log = logging.getLogger(__name__)

MIB = 2**20
WINDOW = 8  # backward steps on each side of a group's members the segment model may reorder
WINDOW_S = 1.0  # the most that model may take (and no more than the move's slice of the time limit has left)


@dataclass
class FusionDecision:
    schedule: Schedule
    sim: SimResult
    notes: list[str] = field(default_factory=list)  # per option: formed, or why not
    saved_s: float = 0.0  # time the groups formed here save


def accepts(new: SimResult, old: SimResult, budget: int | None) -> bool:
    """Whether forming a group that turns `old` into `new` is kept: `incumbent.better` within the budget;
    with none, within `old`'s peak and faster (fusing independent ops can raise the peak)."""
    if budget is None:
        return better(new, old, old.peak_bytes) and round(new.time_s, 12) < round(old.time_s, 12)
    return fits(new, budget) and better(new, old, budget)


def together(problem: Problem, order: list[int], members: set[int], at_last: bool = True,
             formed_of: dict[int, int] | None = None) -> tuple[list[int], int, int] | None:
    """`order` with `members` consecutive: at the last member's place, the ops between that read what
    members make (or what such ops make) moved after them; or (`at_last=False`) at the first
    member's place, the ops between that members read from moved before. Runs of formed groups
    (`formed_of`: op -> option) move as one. Also the window [a, b] that changed. None when a member
    is missing."""
    pos = [k for k, o in enumerate(order) if o in members]
    if len(pos) != len(members):
        return None
    a, b = pos[0], pos[-1]
    formed_of = formed_of or {}
    units: list[list[int]] = []  # the window's ops, formed runs as one unit
    for o in order[a:b + 1]:
        i = formed_of.get(o)
        if i is not None and units and formed_of.get(units[-1][0]) == i:
            units[-1].append(o)
        else:
            units.append([o])
    group = [o for o in order[a:b + 1] if o in members]
    rest = [u for u in units if u[0] not in members]
    before: list[list[int]] = []
    after: list[list[int]] = []
    if at_last:
        made = {t for o in group for t in problem.ops[o].outputs}
        for u in rest:
            if any(t in made for o in u for t in problem.ops[o].inputs):
                after.append(u)
                made.update(t for o in u for t in problem.ops[o].outputs)
            else:
                before.append(u)
    else:
        needed = {t for o in group for t in problem.ops[o].inputs}
        for u in reversed(rest):
            if any(t in needed for o in u for t in problem.ops[o].outputs):
                before.insert(0, u)
                needed.update(t for o in u for t in problem.ops[o].inputs)
            else:
                after.insert(0, u)
    middle = [o for u in before for o in u] + group + [o for u in after for o in u]
    return order[:a] + middle + order[b + 1:], a, b


def with_option(problem: Problem, schedule: Schedule, i: int, at_last: bool = True) -> Schedule | None:
    """`schedule` with option `i` formed, its members moved together (see `together`); None when a
    forward group is recomputed in part (or a member is missing)."""
    members = set(problem.fusion_options[i].members)
    fw_group = problem.ops[min(members)].phase is Phase.FW
    fw, bw, offload = list(schedule.fw_order), list(schedule.bw_order), dict(schedule.offload)
    formed_of = {o: j for j in schedule.formed for o in problem.fusion_options[j].members}
    if fw_group:
        moved = together(problem, fw, members, at_last, formed_of)
        if moved is None:
            return None
        fw = moved[0]
    in_bw = members & set(bw)
    if in_bw:
        if in_bw != members:
            return None
        moved = together(problem, bw, members, at_last, formed_of)
        if moved is None:
            return None
        bw, a, b = moved
        offload = {t: a if a <= j <= b else j for t, j in offload.items()}
    return Schedule(fw, bw, offload, (*schedule.formed, i))


def form_options(problem: Problem, schedule: Schedule, budget: int | None, sim: SimResult | None = None,
                 deadline: float | None = None) -> FusionDecision:
    """Each option not formed in `schedule` tried on it (both placements), kept when `accepts` says so;
    `deadline` (a clock.now()): no segment model is started after it."""
    sim = simulate(problem, schedule) if sim is None else sim
    out = FusionDecision(schedule, sim)
    for i, opt in enumerate(problem.fusion_options):
        label = opt.name or f"fusion option {problem.option_name(i)} ({len(opt.members)} ops)"
        if i in out.schedule.formed:
            out.notes.append(f"{label}: kept (formed by the solver)")
            continue
        best: tuple[Schedule, SimResult] | None = None
        tried: list[SimResult] = []
        for at_last in (True, False):
            cand = with_option(problem, out.schedule, i, at_last)
            if cand is None:
                continue
            try:
                csim = simulate(problem, cand)
            except ScheduleError as e:  # this placement of the members does not run in this plan
                reject(log, "candidate(s) rejected forming fusion options (members placed together)", e)
                continue
            tried.append(csim)
            if accepts(csim, out.sim, budget) and (best is None or accepts(csim, best[1], budget)):
                best = (cand, csim)
        how = ""
        if problem.ops[opt.members[0]].phase is Phase.BW and (best is None or best[1].peak_bytes > out.sim.peak_bytes):
            left = WINDOW_S if deadline is None else min(WINDOW_S, deadline - clock.now())
            # may form it without raising the peak
            modelled = _by_segment_model(problem, out.sim, i, budget, left) if left > 0.05 else None
            if modelled is not None and (best is None or better(modelled[1], best[1], best[1].peak_bytes)):
                best, how = modelled, " (the backward around it reordered by the segment model)"
        if best is not None:
            out.saved_s += out.sim.time_s - best[1].time_s
            out.notes.append(f"{label}: kept, peak {best[1].peak_bytes / MIB:.2f} MiB vs {out.sim.peak_bytes / MIB:.2f}, "
                             f"time {best[1].time_s * 1e3:.3f} ms vs {out.sim.time_s * 1e3:.3f}{how}")
            out.schedule, out.sim = best
        elif not tried:
            out.notes.append(f"{label}: rejected, its members cannot run together in this plan (recomputed in part, "
                             "or across another group)")
        else:
            low = min(tried, key=lambda s: (s.peak_bytes, s.time_s))
            why = ", ".join(w for w, bad in (
                ("over the budget", budget is not None and low.peak_bytes > budget),
                ("higher peak", budget is None and low.peak_bytes > out.sim.peak_bytes),
                ("no faster", round(low.time_s, 12) >= round(out.sim.time_s, 12))) if bad) or "no better"
            out.notes.append(f"{label}: rejected, peak {low.peak_bytes / MIB:.2f} MiB vs {out.sim.peak_bytes / MIB:.2f}, "
                             f"time {low.time_s * 1e3:.3f} ms vs {out.sim.time_s * 1e3:.3f} ({why})")
    return out


def _by_segment_model(problem: Problem, sim: SimResult, i: int, budget: int | None, time_s: float = WINDOW_S,
                      ) -> tuple[Schedule, SimResult] | None:
    """Backward option `i` formed by the segment model on a window around its members (order decided with
    it): within the budget (none: the plan's peak), else at the window's lowest peak (the model does not
    count storage reuse, so it may see the plan above its real peak); kept when the simulator accepts it."""
    n_fw = sim.n_forward_steps
    at = [k for k, (o, rc) in enumerate(sim.steps) if not rc and o in set(problem.fusion_options[i].members)]
    a, b = max(n_fw, at[0] - WINDOW), min(len(sim.steps), at[-1] + WINDOW + 1)
    for cap in (sim.peak_bytes if budget is None else budget, None):
        res = replan_segment(problem, sim, a, b, [], cap, time_limit_s=time_s / 2, decide_fusion=True)
        if res is None or not res.fusion.get(i):
            continue
        cand = splice(problem, sim, a, b, res.steps, fusion=res.fusion)
        try:
            csim = simulate(problem, cand)
        except ScheduleError as e:  # the segment model's order does not replay: not kept
            reject(log, "candidate(s) rejected forming fusion options (by the segment model)", e)
            continue
        if i in cand.formed and accepts(csim, sim, budget):
            return cand, csim
    return None
