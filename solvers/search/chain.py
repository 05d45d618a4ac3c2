"""Block options combined along the chain: each group's backward segment picks one of a few plans, together.

The segment search copies one block's answer to every sibling, so all blocks end up alike.
But what a block keeps to the backward raises every step from its forward to its segment:
an early block's lives through every later block's forward and backward, a late block's
only through the head's. So the best plan keeps less early (recomputes or offloads more:
early blocks also have the most forward left to hide copies) and more late. Here one
representative block's segment is planned for a ladder of caps on the bytes it keeps
(solvers/cpsat/segment.py; what that does to the rest of the plan is the chain model's
business), giving its options; the stem and the head (embeddings, final norm, LM head,
loss) get ladders of their own. Each option is measured by the simulator on its group
alone (time, bytes kept, the segment's own peak, bytes offloaded), as a change against the
plan now; solvers/cpsat/chain.py picks one per group for the least time under the budget
and the copy queues' limits; the choice is applied to every group (a block's translated
from the representative's by position in the forward, restricted to what is free in its
own segment) and the simulator judges. A segment it finds over budget gets the excess as a
margin and the chain is solved again; a pass that helps is followed by another from its plan.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ..cpsat.chain import BlockOption, ChainSegment, CopyLimits, choose_options
from ..cpsat.common import memory_unit
from ..cpsat.segment import free_ops, replan_segment
from ..model import clock
from ..model.problem import Phase, Problem, Schedule, ScheduleError, reject
from ..model.simulator import SimResult, simulate
from .blocks import Groups, find_blocks, segments
from .heuristics import place_recomputes
from .incumbent import better
from .segments import SEGMENT_S, offload_window, replace_run, same_shape, translate

log = logging.getLogger(__name__)

MIN_BLOCKS = 3  # fewer repeated blocks: copying one answer is as good
KEPT_NOW = (0.75, 0.5, 1.25, 0.0, 1.5, 2.0)  # caps on a segment's kept bytes, tried in this order: shares of
# what it keeps now (a little less or more first), then of all it could keep
KEPT_ALL = (0.5, 1.0)
REPAIR_ROUNDS = 3
MAX_PASSES = 4
OPTION_S = 0.3  # the most one option's segment model may take
FAR = -(1 << 60)  # live bytes of the steps outside that must not constrain an option


@dataclass(frozen=True)
class _Option:
    """A plan of one group's segment: the forward ops it decided, those recomputed and offloaded, its steps."""

    free: tuple[int, ...]
    recompute: frozenset[int]
    offload: frozenset[int]
    steps: tuple[tuple[int, bool], ...]
    old: tuple[tuple[int, bool], ...]  # the segment's steps it was planned from
    windowed: bool  # offloads were decided (else the plan's offloads of `free` stay)


def improve_by_chain(
    problem: Problem, schedule: Schedule, budget: int, *, deadline: float, workers: int = 1, offload: bool = False
) -> Schedule:
    """The plan with each group's segment replaced by the option the chain model picks for it, as long as
    the simulator says that is better (each pass starts from the last one's plan); else `schedule` itself."""
    best = schedule
    for _pass in range(MAX_PASSES):
        if deadline - clock.now() < 0.1:
            break
        found = _one_pass(problem, best, budget, deadline, workers, offload)
        if found is best:
            break
        best = found
    return best


def _one_pass(problem: Problem, schedule: Schedule, budget: int, deadline: float, workers: int, offload: bool) -> Schedule:
    sim = simulate(problem, schedule)
    groups = find_blocks(problem, schedule.fw_order)
    segs = segments(problem, sim, groups)
    runs: dict[int, int] = {}
    for _a, _b, g in segs:
        runs[g] = runs.get(g, 0) + 1
    seg_of = {g: (a, b) for a, b, g in segs if runs[g] == 1}  # a group split over two runs is left alone
    blocks = [g for g in groups.blocks if g in seg_of]
    if len(blocks) < MIN_BLOCKS:
        return schedule
    offload = offload and problem.host_bw > 0
    rep = blocks[len(blocks) // 2]
    units = sorted(seg_of)  # every group with one segment: the blocks and the parts outside them
    sources = [rep] + [u for u in units if u not in groups.block_set]
    measured: dict[int, list[tuple[_Option, BlockOption]]] = {}
    for i, g in enumerate(sources):
        share = (deadline - clock.now()) * (0.6 if i == 0 else 0.5 / (len(sources) - i))
        if share < 0.05:
            measured[g] = []
            continue
        opts = _options(problem, sim, groups, seg_of[g], g, budget, clock.now() + share, workers, offload)
        pairs = [(o, _measure(problem, sim, groups, g, o)) for o in opts]
        measured[g] = [(o, m) for o, m in pairs if m is not None]
    options: list[list[BlockOption]] = []
    usable: list[list[_Option | None]] = []
    for g in units:
        src = rep if g in groups.block_set else g
        fit = [(o, m) for o, m in measured[src] if g == src or _applies(problem, sim, groups, src, g, o, seg_of[g])]
        options.append([BlockOption(0.0, 0, 0, 0)] + [m for _o, m in fit])
        usable.append([None] + [o for o, _m in fit])
    if not any(len(row) > 1 for row in options):
        return schedule
    index = {g: i for i, g in enumerate(units)}
    chain = [ChainSegment(max(sim.timeline[a:b]), index.get(g), tuple(index[h] for h in units if h < g))
             for a, b, g in segs]
    forward_peak = max(sim.timeline[:sim.n_forward_steps] + [sim.boundary_bytes])
    copies = _copy_limits(problem, sim, groups, units, seg_of) if offload else None
    for _round in range(REPAIR_ROUNDS):
        left = deadline - clock.now()
        if left < 0.05:
            break
        choice = choose_options(options, chain, forward_peak, budget, time_limit_s=min(left, SEGMENT_S), workers=workers,
                                copies=copies)
        if choice is None or not any(choice):
            break
        picked = {g: usable[index[g]][j] for g, j in zip(units, choice) if j}
        trial = _apply(problem, sim, groups, rep, picked)
        if trial is None:
            break
        tsim = simulate(problem, trial)
        if tsim.peak_bytes <= budget:
            return trial if better(tsim, sim, budget) else schedule
        over = {g: max(tsim.timeline[ta:tb]) - budget for ta, tb, g in segments(problem, tsim, groups)}
        chain = [dataclasses.replace(s, margin_bytes=s.margin_bytes + max(0, over.get(g, 0)))
                 for s, (_a, _b, g) in zip(chain, segs)]
        if tsim.peak_step < tsim.n_forward_steps:
            forward_peak += tsim.peak_bytes - budget
    return schedule


def _copy_limits(problem: Problem, sim: SimResult, groups: Groups, units: list[int], seg_of) -> CopyLimits:
    """What each unit offloads now, the forward's compute from its first op on, the backward's before its segment."""
    n_fw = sim.n_forward_steps
    fw_times = [problem.ops[o].time_s for o, _rc in sim.steps[:n_fw]]
    fw_pos = {o: k for k, (o, _rc) in enumerate(sim.steps[:n_fw])}
    bw_before = [0.0]
    for o, _rc in sim.steps[n_fw:]:
        bw_before.append(bw_before[-1] + problem.ops[o].time_s)
    now = dict.fromkeys(units, 0)
    for t in sim.offloads:
        g = groups.of_op.get(problem.tensors[t].producer)
        if g in now:
            now[g] += problem.tensors[t].bytes
    return CopyLimits(
        problem.host_bw,
        tuple(now[g] for g in units),
        tuple(sum(fw_times[min(fw_pos[o] for o in groups.members[g]):]) for g in units),
        tuple(bw_before[seg_of[g][0] - n_fw] for g in units),
    )


def _options(problem: Problem, sim: SimResult, groups: Groups, seg: tuple[int, int], g: int, budget: int,
             deadline: float, workers: int, offload: bool) -> list[_Option]:
    """Distinct plans of group `g`'s segment, one per cap on the bytes it keeps to the backward: the
    least recompute time within the budget inside the segment, under that cap and nothing else outside."""
    a, b = seg
    free = free_ops(problem, sim, a, b, groups.members[g], offload=offload)
    if not free:
        return []
    window = offload_window(problem, sim, a, free) if offload else None
    outs = [t for f in free for t in problem.ops[f].outputs]
    total = sum(problem.tensors[t].bytes for t in outs)
    saved = set(sim.saved)
    now = sum(problem.tensors[t].bytes for t in outs if t in saved and t not in sim.offloads)
    caps = list(dict.fromkeys([int(x * now) for x in KEPT_NOW] + [int(x * total) for x in KEPT_ALL]))
    out: list[_Option] = []
    seen = {tuple(sim.steps[a:b])}
    for cap in caps:
        left = deadline - clock.now()
        if left < 0.05:
            break
        capped = _capped(problem, sim, a, outs, budget, cap)
        res = replan_segment(problem, capped, a, b, free, budget, time_limit_s=min(left, OPTION_S), workers=workers,
                             window=window)
        if res is None or (tuple(res.steps), frozenset(res.offload)) in seen:
            continue
        seen.add((tuple(res.steps), frozenset(res.offload)))
        out.append(_Option(tuple(free), frozenset(res.recompute), frozenset(res.offload), tuple(res.steps),
                           tuple(sim.steps[a:b]), window is not None))
    return out


def _capped(problem: Problem, sim: SimResult, a: int, outs: list[int], budget: int, cap: int) -> SimResult:
    """`sim` as the segment model should see it to keep at most `cap` bytes of `outs` to the backward: every
    step before the segment is far below the budget but the forward's last, which holds the rest of the
    budget besides what of `outs` is live there now (in the model's memory units, rounding up each output)."""
    last = sim.n_forward_steps - 1
    mine = set(outs)
    live = sum(problem.tensors[lt.tensor].bytes for lt in sim.lifetimes
               if lt.tensor in mine and not lt.recomputed and lt.start <= last <= lt.end)
    unit = memory_unit(problem)
    timeline = [FAR] * a + sim.timeline[a:]
    timeline[last] = (budget // unit - -(-cap // unit) - len(outs)) * unit + live
    return dataclasses.replace(sim, timeline=timeline, boundary_bytes=0)


def _measure(problem: Problem, sim: SimResult, groups: Groups, g: int, opt: _Option) -> BlockOption | None:
    """What the option changes when group `g` alone runs it (the simulator's numbers)."""
    trial = _apply(problem, sim, groups, g, {g: opt})
    if trial is None:
        return None
    tsim = simulate(problem, trial)  # _apply returns only a plan that replayed: an error here is a bug
    outs = {t for f in opt.free for t in problem.ops[f].outputs}

    def kept(s: SimResult) -> int:
        saved = set(s.saved)
        return sum(problem.tensors[t].bytes for t in outs if t in saved and t not in s.offloads)

    def offloaded(s: SimResult) -> int:
        return sum(problem.tensors[t].bytes for t in outs if t in s.offloads)

    old = {x: (a, b) for a, b, x in segments(problem, sim, groups)}
    new = {x: (a, b) for a, b, x in segments(problem, tsim, groups)}
    if g not in old or g not in new:
        return None
    (a0, b0), (a1, b1) = old[g], new[g]
    return BlockOption(tsim.time_s - sim.time_s, kept(tsim) - kept(sim),
                       max(tsim.timeline[a1:b1]) - max(sim.timeline[a0:b0]), offloaded(tsim) - offloaded(sim))


def _apply(problem: Problem, sim: SimResult, groups: Groups, rep: int, picked: dict[int, _Option]) -> Schedule | None:
    """Each group's segment run by its picked option (a block's translated from `rep`'s by forward position,
    restricted to the ops free in its own segment): its steps when the segment runs the same op shapes,
    else its recomputations placed before their first readers in the group's own steps. A group whose
    segment cannot take its option keeps its plan; None when none can."""
    cur, sched = sim, None
    for g, opt in sorted(picked.items()):
        trial = _apply_one(problem, cur, groups, rep if g in groups.block_set else g, g, opt)
        if trial is None:
            continue
        try:
            cur, sched = simulate(problem, trial), trial
        except ScheduleError as e:  # the option does not run in this group's plan: it keeps its own
            reject(log, "candidate(s) rejected in the chain search (a block option that does not run in its plan)", e)
            continue
    return sched


def _apply_one(problem: Problem, sim: SimResult, groups: Groups, src: int, g: int, opt: _Option) -> Schedule | None:
    fw_map = dict(zip(groups.members[src], groups.members[g]))
    seg = {x: (a, b) for a, b, x in segments(problem, sim, groups)}.get(g)
    if seg is None:
        return None
    a, b = seg
    free = set(free_ops(problem, sim, a, b, groups.members[g], offload=opt.windowed))
    mine = {fw_map[f] for f in opt.free if fw_map.get(f) in free}
    if not mine:
        return None
    old = sim.steps[a:b]
    new = None
    if len(mine) == len(opt.free) and same_shape(problem, opt.old, old):  # the same op shapes as the option's segment
        new = translate(opt.steps, {s: i for i, s in enumerate(opt.old)}, old, fw_map)
    if new is None:
        new = _place(problem, [s for s in old if not (s[1] and s[0] in mine)], {fw_map[f] for f in opt.recompute} & mine)
    moved = None
    if opt.windowed:
        outs = {t for f in mine for t in problem.ops[f].outputs}
        moved = (outs, {t for f in opt.offload for t in problem.ops[fw_map[f]].outputs if fw_map[f] in mine})
    return replace_run(problem, sim, old, new, moved)


def _applies(problem: Problem, sim: SimResult, groups: Groups, src: int, g: int, opt: _Option,
             seg: tuple[int, int]) -> bool:
    """Whether group `g` can run `src`'s option: most ops it decided have a counterpart free in `g`'s segment."""
    fw_map = dict(zip(groups.members[src], groups.members[g]))
    free = set(free_ops(problem, sim, *seg, groups.members[g], offload=opt.windowed))
    return sum(fw_map.get(f) in free for f in opt.free) >= 0.8 * len(opt.free)


def _place(problem: Problem, fixed: list[tuple[int, bool]], recompute: set[int]) -> list[tuple[int, bool]]:
    """`fixed` with each op of `recompute` run just before the first step that needs it (depth first); in the
    backward a step is a recomputation exactly when its op is a forward op."""
    bw = place_recomputes(problem, [], [o for o, _rc in fixed], recompute).bw_order
    return [(o, problem.ops[o].phase is Phase.FW) for o in bw]
