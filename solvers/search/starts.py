"""The solving methods behind the portfolio's start moves and reordering (strategy.PORTFOLIO).

Each offers its plans to the incumbent (search/incumbent.py) instead of returning them: the
incumbent judges. Forward-only programs: the exact order model or windows. Training programs:
the interval save/recompute model per fixed order (small graphs), the relaxation with repair
(large ones), and reordering windows around the peak with recomputation decided again.
"""

from __future__ import annotations

import logging
import time

from ..cpsat.bound import solve_bound_and_repair
from ..cpsat.order import solve_order
from ..cpsat.remat import min_peak_remat, solve_remat
from ..model import clock
from ..model.problem import Phase, Problem, Schedule, SolveStats, default_schedule, reject
from ..model.simulator import ScheduleError, SimResult, simulate
from ..progress import ProgressLine
from .blocks import Groups, find_blocks
from .heuristics import (
    base_orders, greedy_forward_order, greedy_recompute, place_recomputes, prune_recomputes, recompute_candidates,
)
from .incumbent import Incumbent, aim_bytes, bytes_over, fits, gap
from .offload import prefetch_positions
from .reorder import refine_order

log = logging.getLogger(__name__)

EXACT_ORDER_MAX_OPS = 300  # the exact order model proves optimality up to about this size
INTERVAL_MODEL_MAX_OPS = 200  # the interval save/recompute model finds good plans up to about this size
UNTIE_MAX_BLOCKS = 4  # a relaxation over more repeated blocks than this is not untied once solved tied to its optimum
TIED_SHARE = 0.6  # of the relaxation's slice, for the model whose repeated blocks decide alike (the rest: its repair)
GAP_TARGET = 0.002  # stop a model once its plan is provably within 0.2% of the step time
OFFLOAD_ALTERNATIVES = 64  # the relaxation with offloads' other solutions kept, simulated while its slice lasts
MODEL_MIN_S = 0.05  # the least time an interval model gets (small graphs solve in milliseconds; a start's slice
# on a large one can be far shorter, e.g. a late chunk count's, and the greedy plan is there anyway)
SWAP_WIDTH = 16  # the swap search swaps a recomputation for one of this many candidates relieving the most
SWAP_MIN_S = 0.1  # the exact swap search's least time when nothing fits (small graphs: a few simulations)


def forward_order(problem: Problem, inc: Incumbent, time_limit_s: float, workers: int,
                  exact_max_ops: int = EXACT_ORDER_MAX_OPS) -> None:
    """Forward-only: the program's and the greedy order, then the exact order model up to `exact_max_ops`
    ops, above it the better of those refined by CP-SAT windows. The order model ignores scratch space and
    in-place reuse, so its OPTIMAL is a note, not a proof (the certification decides the status)."""
    program = [o.id for o in problem.fw_ops]
    greedy = greedy_forward_order(problem)
    for name, order in (("program", program), ("greedy", greedy)):
        inc.offer(Schedule(order, []), _forward_stats(f"order from {name}", "greedy order", "HEURISTIC"))
    start = inc.lowest.schedule
    if len(program) > exact_max_ops:  # the greedy order has no lookahead: a path it starts early may only finish late
        refined = refine_order(problem, start, time_limit_s=time_limit_s, workers=workers, max_rounds=50)
        inc.offer(refined, _forward_stats("order from windows", "greedy order + cp-sat windows", "HEURISTIC"))
        return
    res = solve_order(problem, hint=start.fw_order, time_limit_s=time_limit_s, workers=workers)
    if res is not None:
        note = (f"order model {res.status} at {res.bound_bytes} bytes (it ignores scratch space and in-place reuse: "
                "not a proof)" if res.bound_bytes else f"order model {res.status}")
        inc.offer(Schedule(res.order, []), _forward_stats("order from cp-sat", "cp-sat exact order", "FEASIBLE", note))


def _forward_stats(*notes_method_status: str) -> SolveStats:
    first, method, status, *more = notes_method_status
    return SolveStats(status, 0.0, 0.0, 0.0, 0.0, method, [first, *more])


def interval_model(problem: Problem, inc: Incumbent, time_limit_s: float, workers: int) -> None:
    """Save/recompute by the interval model in the program's and the greedy forward order; when nothing
    fits, the lowest peak each order allows."""
    bw = [o.id for o in problem.bw_ops]
    program = [o.id for o in problem.fw_ops]
    orders = [(program, "program order")]
    greedy_fw = greedy_forward_order(problem)
    if greedy_fw != program:
        orders.append((greedy_fw, "greedy forward order"))
    deadline = clock.now() + time_limit_s
    for fw, label in orders:
        remat_candidates(problem, inc, fw, bw, 0.7 * time_limit_s / len(orders), workers, label)
    if not inc.found:  # over budget in every fixed order: start reordering from the lowest peak instead
        min_peak(problem, inc, program, bw, deadline - clock.now(), workers, "program order")
    if not inc.found and deadline - clock.now() > 0:
        swap_recomputes(problem, inc, max(deadline, clock.now() + SWAP_MIN_S))


def swap_recomputes(problem: Problem, inc: Incumbent, deadline: float) -> None:
    """From the lowest plan, in its order: add, drop or swap one recomputation, each placed at its first use,
    while that lowers the simulated peak, until a plan fits or no change helps.

    The interval model counts memory conservatively (no in-place reuse), so it can miss a plan that fits
    by a few bytes: e.g. recomputing an op whose output an in-place op would otherwise have to keep. The
    simulator judges each neighbour here, exactly. A plan whose peak is flat (many steps at about the same
    height) has no single change that lowers its peak: then the change that leaves the peak as it is and lowers
    the bytes over the budget summed over the steps the most (`incumbent.bytes_over`) is taken, a step towards one that does
    (nn.TransformerEncoder at 40%: 12.82 MiB on the peak alone, 11.83 with such steps). The changes, each kind
    only when the kinds before it found none that helps: additions of ops whose outputs are live over the budget
    and removals of recomputations whose copies are (`_relieving`), an op added with an operand's producer
    (`_feeding`), swaps, and last the other removals (a removal seldom helps where its copy is not over the budget:
    the Llama at 14.5 MiB took none, and with them first each step weighed a hundred); the first change that lowers
    the peak is taken as soon as it is seen."""
    low = inc.lowest
    if low is None or low.schedule.offload or low.schedule.formed:  # positions index an offload's or group's steps
        return
    fw, bw = base_orders(problem, low.schedule)
    chosen = frozenset(low.sim.recomputed_ops)
    candidates = sorted(set(recompute_candidates(problem)))
    sim = low.sim
    while not inc.found and clock.now() < deadline:
        peak, over = sim.peak_bytes, bytes_over(sim, inc.budget)
        outside = [c for c in _relieving(problem, sim, candidates, inc.budget, False) if c not in chosen]
        inside = _relieving(problem, sim, sorted(chosen), inc.budget, True)
        single = [chosen | {c} for c in outside] + [chosen - {r} for r in inside]
        pairs = (chosen | {c, q} for c in outside for q in _feeding(problem, c, candidates, chosen))
        swaps = ((chosen - {r}) | {c} for r in inside[:SWAP_WIDTH] for c in outside[:SWAP_WIDTH])
        rest = (chosen - {r} for r in sorted(chosen.difference(inside)))
        for neighbours in (single, pairs, swaps, rest):
            level = None  # the best change that keeps the peak: ((bytes over, time), its set, its simulation)
            for nxt in neighbours:
                if clock.now() >= deadline:
                    return
                cand = inc.offer(place_recomputes(problem, fw, bw, set(nxt)), "recomputations swapped on the simulator")
                if cand is None or cand.sim.peak_bytes > peak:
                    continue
                if cand.sim.peak_bytes < peak:
                    level = ((0, 0.0), nxt, cand.sim)
                    break
                key = (bytes_over(cand.sim, inc.budget), round(cand.sim.time_s, 12))
                if key[0] < over and (level is None or key < level[0]):
                    level = (key, nxt, cand.sim)
            if level is not None:
                _key, chosen, sim = level
                break
        else:
            return


def _feeding(problem: Problem, op: int, candidates: list[int], chosen: frozenset[int]) -> list[int]:
    """The candidates not recomputed whose outputs `op` reads: recomputed with it, their forward copies end in the
    forward too. Recomputing `op` alone keeps its operands live until its recomputation (a held operand as large as
    `op`'s output gains nothing): the Llama's residual after attention, 0.5 MiB held across two MLP backwards, went
    only with the attention projection it adds (15.31 to 14.81 MiB, bound 14.45)."""
    inputs = {problem.tensors[t].producer for t in problem.ops[op].inputs}
    return [q for q in candidates if q in inputs and q != op and q not in chosen]


def _relieving(problem: Problem, sim: SimResult, candidates: list[int], budget: int | None,
               recomputed: bool) -> list[int]:
    """The candidates with outputs live at steps over the budget, those with the most bytes there first: their
    original copies (`recomputed` False: recomputing the op could end them early; an op whose outputs live only at
    steps within the budget cannot lower any step over it by being recomputed) or their recomputed copies
    (True: the recomputations whose removal could lower such a step most directly). The whole neighbourhood is
    too large to walk on a few hundred ops (Llama, 365 ops: 250 candidates, 100 recomputed)."""
    level = aim_bytes(sim, budget)
    over = [live > level for live in sim.timeline]
    at = [0]
    for o in over:
        at.append(at[-1] + o)
    relief: dict[int, int] = {}
    for (t, rec), (start, end) in sim.spans.items():
        prod = problem.tensors[t].producer
        if rec != recomputed or prod is None or start > end:
            continue
        steps = at[min(end, len(over) - 1) + 1] - at[max(0, start)]
        if steps:
            relief[prod] = relief.get(prod, 0) + steps * problem.tensors[t].bytes
    return sorted((c for c in candidates if relief.get(c, 0) > 0), key=lambda c: (-relief[c], c))


def reorder_and_redecide(problem: Problem, inc: Incumbent, deadline: float, workers: int) -> None:
    """Reorder around the peak, then decide recomputation again for the new order, while that lowers the peak."""
    for round_ in range(8):
        left = deadline - clock.now()
        if left < 0.2:
            return
        base = inc.start
        refined = refine_order(problem, base.schedule, time_limit_s=0.25 * left, workers=workers)
        label = f"reordered x{round_ + 1}"
        cand = inc.offer(refined, f"{base.stats.method}, then {label}")
        if cand.sim.peak_bytes >= base.sim.peak_bytes:
            return
        fw, bw = base_orders(problem, refined)
        remat_candidates(problem, inc, fw, bw, 0.5 * (deadline - clock.now()), workers, label)
        if not inc.found:  # still over budget: push the peak down as far as this order allows
            min_peak(problem, inc, fw, bw, 0.3 * (deadline - clock.now()), workers, label)


def reorder_only(problem: Problem, inc: Incumbent, time_limit_s: float, workers: int) -> None:
    """Large graphs: reorder windows around the peak; the recompute set (so the time) stays."""
    base = inc.start
    inc.offer(refine_order(problem, base.schedule, time_limit_s=time_limit_s, workers=workers), base.stats)


def min_peak(problem: Problem, inc: Incumbent, fw: list[int], bw: list[int], time_s: float, workers: int,
             label: str) -> None:
    res = min_peak_remat(problem, fw, bw, time_limit_s=max(MODEL_MIN_S, time_s), workers=workers)
    if res is not None:
        inc.offer(place_recomputes(problem, fw, bw, res[0]), f"cp-sat lowest-peak recompute, {label}")


def remat_candidates(problem: Problem, inc: Incumbent, fw: list[int], bw: list[int], time_s: float, workers: int,
                     label: str) -> None:
    """The greedy plan and the interval model's (warm-started from it) for one fixed order."""
    budget = inc.budget
    heur = inc.offer(greedy_recompute(problem, budget, fw, bw), f"greedy recompute, {label}")
    hint = set(heur.sim.recomputed_ops) if fits(heur.sim, budget) else None
    t_start = time.perf_counter()
    res = solve_remat(problem, fw, bw, budget, time_limit_s=max(MODEL_MIN_S, time_s), workers=workers, hint=hint)
    if res is None or res.status == "INFEASIBLE":
        return
    kept = prune_recomputes(problem, budget, fw, bw, res.recompute) if budget is not None else res.recompute
    sched = place_recomputes(problem, fw, bw, kept)
    sim = simulate(problem, sched)
    repaired = ""
    if not fits(sim, budget):  # the model's plan is over in the simulator: recompute more, greedily, from it
        fixed = simulate(problem, greedy_recompute(problem, budget, fw, bw, start=set(kept)))
        if fits(fixed, budget):
            kept = prune_recomputes(problem, budget, fw, bw, set(fixed.recomputed_ops))
            sched = place_recomputes(problem, fw, bw, kept)
            sim, repaired = simulate(problem, sched), " (repaired greedily)"
    bound = sum(problem.ops[o].time_s for o in fw + bw)  # each op once: the interval model's bound is not valid
    # the interval model counts memory conservatively: its OPTIMAL proves nothing about the simulator's plans
    notes = list(res.notes) + ([f"interval model {res.status} (conservative memory: not a proof)"]
                               if res.status == "OPTIMAL" else [])
    inc.offer(sched, SolveStats("FEASIBLE", sim.time_s, bound, gap(sim.time_s, bound), time.perf_counter() - t_start,
                                f"cp-sat save/recompute{repaired}, {label}", notes), sim)


def relaxation_and_repair(problem: Problem, inc: Incumbent, time_limit_s: float, workers: int,
                          line: ProgressLine) -> None:
    """Large graphs: the relaxation in the program's order (repeated blocks deciding alike first), repaired
    until the simulator agrees, a greedy finish if needed, recomputations the budget does not need taken back."""
    budget = inc.budget
    if budget is None:
        inc.offer(default_schedule(problem), "no recomputation needed")
        return
    deadline = clock.now() + time_limit_s
    fw, bw = [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops]
    base_s = sum(o.time_s for o in problem.ops)
    groups = find_blocks(problem, fw)
    ties = _ties(groups)
    res = None
    if ties:  # repeated blocks decide alike first: a model L times smaller to search, solved in seconds
        line.note(f"relaxation + repair, {len(groups.blocks)} blocks deciding alike")
        res = solve_bound_and_repair(problem, fw, bw, budget, _step_profile(problem, fw, bw, budget),
                                     time_limit_s=TIED_SHARE * time_limit_s, workers=workers, ties=ties,
                                     gap_s=GAP_TARGET * base_s)
    # a tied optimum over more than UNTIE_MAX_BLOCKS blocks is repaired first: untying a model L times larger did not
    # pay within its slice on the Llama-7B graphs (8 to 80 layers, 60% and 40%: the same plan or a slower one after
    # the improvers, 0.3-2.5 s more wall time) and took the time the repair needed (80 layers at 40% in a 3.8 s
    # slice: no plan fitting). Untied when that repair does not fit (a long chain of layers all alike may not)
    sched = sim = None
    if res is not None and res.status == "OPTIMAL" and len(groups.blocks) > UNTIE_MAX_BLOCKS:
        sched = _greedy_repair(problem, budget, fw, bw, set(res.recompute), deadline, line)
        sim = simulate(problem, sched)
        if sim.peak_bytes > budget:  # kept as the lowest plan yet, if it is
            inc.offer(sched, "cp-sat relaxation + repair, program order, blocks alike + greedy", sim)
    if sim is None or sim.peak_bytes > budget:
        # each block on its own, from the tied plan: kept when it fits and is faster
        untied = solve_bound_and_repair(
            problem, fw, bw, budget, _step_profile(problem, fw, bw, budget),
            time_limit_s=(0.6 if res is None or not res.fits else 0.4) * (deadline - clock.now()), workers=workers,
            hint=set(res.recompute) if res is not None else None,
            on_solution=lambda obj, bound: line.update(base_s + obj, base_s + bound), gap_s=GAP_TARGET * base_s,
        )
        if untied is not None and (res is None or _faster_fit(problem, fw, bw, untied, res)):
            res = untied
        sched = _greedy_repair(problem, budget, fw, bw, set(res.recompute) if res is not None else set(), deadline,
                               line)
        sim = simulate(problem, sched)
    chosen = set(res.recompute) if res is not None else set()
    bound = base_s + (res.bound_s if res is not None else 0.0)
    method = "cp-sat relaxation + repair, program order" + (
        ", blocks alike" if ties and res is not None and res.bound_s == 0.0 else "")
    if res is not None and set(sim.recomputed_ops) != chosen:
        method += " + greedy"
    notes = [f"relaxation {res.status}, {res.rounds} rounds" if res is not None else "relaxation found nothing"]
    inc.offer(sched, SolveStats("FEASIBLE" if res is not None else "HEURISTIC", sim.time_s, bound,
                                gap(sim.time_s, bound), 0.0, method, notes), sim)
    if not inc.found:
        # the repair ran out of time or budget: recomputing every candidate is a cheap plan whose peak
        # is often lower, so the lowest peak reported (and the start of reordering) is never worse
        inc.offer(place_recomputes(problem, fw, bw, recompute_candidates(problem)),
                  "recompute every candidate, program order")


def _ties(groups: Groups) -> list[list[int]]:
    """Per position in a repeated block, that op in every block: the relaxation decides them alike."""
    return [[groups.members[b][j] for b in groups.blocks] for j in range(groups.period)] if groups.blocks else []


def _greedy_repair(problem: Problem, budget: int, fw: list[int], bw: list[int], chosen: set[int], deadline: float,
                   line: ProgressLine) -> Schedule:
    """The relaxation's recomputations `chosen`, more recomputed greedily until the simulator says the plan fits, then
    those the budget does not need taken back."""
    line.note("repairing with the greedy heuristic")
    sched = greedy_recompute(problem, budget, fw, bw, start=chosen, deadline=deadline)
    if simulate(problem, sched).peak_bytes <= budget:
        line.note("dropping recomputations the budget does not need")
        kept = prune_recomputes(problem, budget, fw, bw, set(sched.recomputed(problem)), deadline=deadline)
        sched = place_recomputes(problem, fw, bw, kept)
    return sched


def relaxation_with_offloads(problem: Problem, inc: Incumbent, time_limit_s: float, workers: int,
                             line: ProgressLine) -> None:
    """Large graphs that may offload: the relaxation deciding save, recompute or offload per activation in the
    program's order (repeated blocks alike), repaired until the simulator agrees. Recompute-only starts leave the
    offloads to greedy moves one tensor at a time, each a simulation: 80 Llama-7B layers at 40% took the relaxation's
    plan, 0.14% over the budget, to 1.134x with offloads; this model's own plan fits at 1.107x in 2 s."""
    budget = inc.budget
    if budget is None or problem.host_bw <= 0:
        return
    deadline = clock.now() + time_limit_s
    fw, bw = [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops]
    base_s = sum(o.time_s for o in problem.ops)
    groups = find_blocks(problem, fw)
    ties = _ties(groups)
    line.note("relaxation with offloads" + (f", {len(groups.blocks)} blocks deciding alike" if ties else ""))
    method = "cp-sat relaxation with offloads, program order" + (", blocks alike" if ties else "")
    try:
        res = solve_bound_and_repair(problem, fw, bw, budget, _step_profile(problem, fw, bw, budget),
                                     time_limit_s=time_limit_s, workers=workers, ties=ties, gap_s=GAP_TARGET * base_s,
                                     offload_plans=True, alternatives=OFFLOAD_ALTERNATIVES)
        if res is None or res.status in ("INFEASIBLE", "UNKNOWN", "MODEL_INVALID"):
            return
        inc.offer(with_offloads(problem, fw, bw, res.recompute, res.offload), method)
        for recompute, offloaded in res.alternatives:  # what the model ranked lower, while the slice lasts
            if clock.now() >= deadline:
                break
            inc.offer(with_offloads(problem, fw, bw, set(recompute), offloaded), f"{method} (an earlier solution)")
    except ScheduleError as e:  # an offload the replay refuses (the host's budget): no plan from this start
        reject(log, "candidate(s) rejected in the relaxation with offloads", e)


def block_checkpointing(problem: Problem, inc: Incumbent, groups: Groups) -> None:
    """Activation checkpointing per repeated block (a transformer layer), as users write it: each block keeps
    what leaves it in the forward (its output, the next block's input) and recomputes the rest just before its
    backward. The relaxation and the segment search may not reach it at tight budgets (8-layer Llama at full
    checkpointing's peak: 11226 MiB found, 9397 MiB for this plan); offered, it is a start they improve."""
    readers = problem.consumers()
    candidates = set(recompute_candidates(problem))

    def leaves(o: int) -> bool:
        g = groups.of_op[o]
        return any(problem.ops[r].phase is Phase.FW and groups.of_op.get(r) != g
                   for t in problem.ops[o].outputs for r in readers[t])

    recompute = {o for b in groups.blocks for o in groups.members[b] if o in candidates and not leaves(o)}
    if recompute:
        fw, bw = [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops]
        inc.offer(place_recomputes(problem, fw, bw, recompute), "each repeated block recomputed from its input")


def _step_profile(problem: Problem, fw_order: list[int], bw_order: list[int], budget: int):
    """For the relaxation's repair: simulated live bytes per model step, or None when the plan fits (offloading
    `offloaded` too, when given: copies are not steps, so the steps stand as they do without them)."""

    def run(recompute: set[int], offloaded: frozenset[int] = frozenset()) -> list[int] | None:
        sim = simulate(problem, with_offloads(problem, fw_order, bw_order, recompute, offloaded))
        if sim.peak_bytes <= budget:
            return None
        per_step, j = [], -1
        for k, (_o, is_rc) in enumerate(sim.steps):
            if k < sim.n_forward_steps:
                per_step.append(sim.timeline[k])
                continue
            if not per_step or len(per_step) == sim.n_forward_steps + j + 1:
                per_step.append(0)
            per_step[-1] = max(per_step[-1], sim.timeline[k])
            if not is_rc:
                j += 1
        return per_step

    return run


def with_offloads(problem: Problem, fw: list[int], bw: list[int], recompute: set[int],
                  offloaded: frozenset[int] = frozenset()) -> Schedule:
    """The plan in this order recomputing `recompute` (each just before its first backward reader) and offloading
    `offloaded`, each copied back one copy time of compute ahead of its first backward read (one it never has
    stays on the device)."""
    sched = place_recomputes(problem, fw, bw, recompute)
    if not offloaded:
        return sched
    back = prefetch_positions(problem, simulate(problem, sched), offloaded)
    return Schedule(sched.fw_order, sched.bw_order, back, sched.formed)


def _faster_fit(problem: Problem, fw: list[int], bw: list[int], a, b) -> bool:
    """Whether relaxation result `a` is a better start than `b`: it fits and `b` does not, or both fit and it
    is faster, or neither fits and its peak is lower (the greedy repair has less to do)."""
    if a.fits != b.fits:
        return a.fits
    sa, sb = (simulate(problem, place_recomputes(problem, fw, bw, x.recompute)) for x in (a, b))
    return sa.time_s < sb.time_s if a.fits else sa.peak_bytes < sb.peak_bytes
