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

import dataclasses
import logging
from dataclasses import dataclass, field

from ..cpsat.segment import replan_segment
from ..model import clock
from ..model.problem import Phase, Problem, Schedule, ScheduleError, SolveStats, collecting_rejections, reject
from ..model.simulator import SimResult, simulate
from .segments import splice
from .strategy import Solution, certify, solve

log = logging.getLogger(__name__)

MIB = 2**20
WINDOW = 8  # backward steps on each side of a group's members the segment model may reorder
WINDOW_S = 1.0  # the most that model may take
CERTIFY_S = 1.0  # the most the relaxation may take to bound a plan with groups formed here


@dataclass
class FusionDecision:
    schedule: Schedule
    sim: SimResult
    notes: list[str] = field(default_factory=list)  # per option: formed, or why not
    saved_s: float = 0.0  # time the groups formed here save


def accepts(new: SimResult, old: SimResult, budget: int | None) -> bool:
    """Whether forming a group that turns `old` into `new` is kept (see the module docstring)."""
    t_new, t_old = round(new.time_s, 12), round(old.time_s, 12)
    if budget is None:
        return t_new < t_old and new.peak_bytes <= old.peak_bytes
    if new.peak_bytes > budget:
        return False
    return old.peak_bytes > budget or (t_new, new.peak_bytes) < (t_old, old.peak_bytes)


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
                 ) -> FusionDecision:
    """Each option not formed in `schedule` tried on it (both placements), kept when `accepts` says so."""
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
            modelled = _by_segment_model(problem, out.sim, i, budget)  # may form it without raising the peak
            if modelled is not None and (best is None or _dominates(modelled[1], best[1])):
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


def _dominates(a: SimResult, b: SimResult) -> bool:
    """No slower and no higher, and better in one."""
    ta, tb = round(a.time_s, 12), round(b.time_s, 12)
    return ta <= tb and a.peak_bytes <= b.peak_bytes and (ta, a.peak_bytes) != (tb, b.peak_bytes)


def _by_segment_model(problem: Problem, sim: SimResult, i: int, budget: int | None) -> tuple[Schedule, SimResult] | None:
    """Backward option `i` formed by the segment model on a window around its members (order decided with
    it): within the budget (none: the plan's peak), else at the window's lowest peak (the model does not
    count storage reuse, so it may see the plan above its real peak); kept when the simulator accepts it."""
    n_fw = sim.n_forward_steps
    at = [k for k, (o, rc) in enumerate(sim.steps) if not rc and o in set(problem.fusion_options[i].members)]
    a, b = max(n_fw, at[0] - WINDOW), min(len(sim.steps), at[-1] + WINDOW + 1)
    for cap in (sim.peak_bytes if budget is None else budget, None):
        res = replan_segment(problem, sim, a, b, [], cap, time_limit_s=WINDOW_S / 2, decide_fusion=True)
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


def decided_stats(problem: Problem, budget: int | None, stats: SolveStats, decision: FusionDecision) -> SolveStats:
    """The solve's stats after `form_options`: the plan's time, and a bound for the groups it now forms.
    Without a budget, the solve's bound (each op once) less what the new groups save. With one, the
    relaxation again (`certify`, CERTIFY_S) on the plan with its groups merged: hiding a group's internal
    values and holding its inputs through the run change memory, so the old bound less the time saved
    is not a bound."""
    if not decision.saved_s:
        return dataclasses.replace(stats, notes=stats.notes + decision.notes)
    objective = decision.sim.time_s
    out = dataclasses.replace(stats, objective_s=objective, notes=[n for n in stats.notes if not n.startswith("bound:")])
    if budget is None:
        bound = max(0.0, min(stats.bound_s - decision.saved_s, objective))
        out.bound_s, out.gap = bound, (objective - bound) / objective if objective > 0 else 0.0
        out.status = "FEASIBLE" if stats.status == "OPTIMAL" and out.gap > 1e-9 else stats.status
        out.notes = stats.notes + decision.notes
        return out
    out.status = "FEASIBLE" if stats.status == "OPTIMAL" else stats.status
    certify(problem, decision.schedule, budget, out, CERTIFY_S, workers=1)
    out.notes += decision.notes
    return out


def solve_with_options(
    problem: Problem, budget_bytes: int | None, *, time_limit_s: float = 5.0, workers: int | None = None,
    progress=False, deterministic: bool = False,
) -> Solution:
    """`strategy.solve`, then the fusion options it left unformed decided on its plan (`with_options_decided`);
    this is `optsched.solvers.solve`. Without fusion options it is `strategy.solve` exactly; with them, deciding
    takes up to WINDOW_S per backward option and CERTIFY_S beyond `time_limit_s`."""
    sol = solve(problem, budget_bytes, time_limit_s=time_limit_s, workers=workers, progress=progress,
                deterministic=deterministic)
    return with_options_decided(problem, budget_bytes, sol, deterministic=deterministic)


def with_options_decided(problem: Problem, budget_bytes: int | None, sol: Solution, *, deterministic: bool = False,
                         ) -> Solution:
    """`sol` with the fusion options it left unformed decided on its plan (`form_options`); `sol` itself for
    a problem without options. `deterministic`: as `solve`'s (the segment model's answers repeat)."""
    if not problem.fusion_options:
        return sol
    with clock.deterministic(deterministic), collecting_rejections() as rejected:
        decision = form_options(problem, sol.schedule, budget_bytes, sol.sim)
        decision.notes += rejected.notes()
        stats = decided_stats(problem, budget_bytes, sol.stats, decision)
    return dataclasses.replace(sol, schedule=decision.schedule, sim=decision.sim, stats=stats,
                               lower_bound_bytes=min(sol.lower_bound_bytes, decision.sim.peak_bytes))
