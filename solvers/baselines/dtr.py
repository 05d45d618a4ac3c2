"""Greedy eviction as Dynamic Tensor Rematerialization does it (Kirisame et al., "Dynamic Tensor
Rematerialization", ICLR 2021), made static.

DTR runs the program and, whenever an allocation would exceed the budget, evicts the resident tensor
with the smallest h(t) = cost(t) / (bytes(t) x staleness(t)); an evicted tensor is recomputed when next
read. Here: walk the simulated timeline of the current plan to the first step over the budget, evict
the saved activation live there with the smallest h, i.e. recompute its producer in the backward
(`place_recomputes`), simulate again, and repeat until the plan fits or nothing evictable is left.

- cost(t): its producer's time plus that of the already evicted forward ops it reads through (DTR's
  cost over the evicted neighbourhood, the ones a rematerialization may have to redo);
- staleness(t): steps since it was last made or read;
- evictable at step k: an activation saved for the backward, not read at or after k in the forward and
  (in the backward) not read yet, whose producer may be recomputed: evicting it frees it at k.
"""

from __future__ import annotations

from ..model.liveness import recompute_candidates
from ..model.problem import Problem, Schedule, default_schedule
from ..model.simulator import SimResult, simulate
from ..search.heuristics import place_recomputes


def dtr_eviction(problem: Problem, budget_bytes: int | None = None, max_evictions: int | None = None) -> Schedule:
    """The first plan of the walk that fits `budget_bytes`, else the lowest-peak plan it passed through
    (program order, everything saved, included). No budget: nothing is evicted."""
    fw = [o.id for o in problem.fw_ops]
    bw = [o.id for o in problem.bw_ops]
    sched = default_schedule(problem)
    if budget_bytes is None:
        return sched
    sim = simulate(problem, sched)
    best, best_peak = sched, sim.peak_bytes
    candidates = set(recompute_candidates(problem))
    evicted: set[int] = set()
    limit = len(candidates) if max_evictions is None else max_evictions
    while sim.peak_bytes > budget_bytes and len(evicted) < limit:
        victim = pick_victim(problem, sim, budget_bytes, candidates - evicted, evicted)
        if victim is None:
            break
        evicted.add(victim)
        sched = place_recomputes(problem, fw, bw, evicted)
        sim = simulate(problem, sched)
        if sim.peak_bytes < best_peak:
            best, best_peak = sched, sim.peak_bytes
    return sched if sim.peak_bytes <= budget_bytes else best


def pick_victim(problem: Problem, sim: SimResult, budget: int, allowed: set[int], evicted: set[int]) -> int | None:
    """The producer of the tensor DTR evicts at the first step over `budget` where something is evictable."""
    n_fw = sim.n_forward_steps
    reads: dict[int, list[int]] = {}  # saved tensor -> steps reading its forward copy
    for k, step_reads in enumerate(sim.reads):
        for t, rc in step_reads:
            if not rc:
                reads.setdefault(t, []).append(k)
    saved = set(sim.saved)
    for k, live in enumerate(sim.timeline):
        if live <= budget:
            continue
        scored = []
        for lt in sim.lifetimes:
            t = lt.tensor
            producer = problem.tensors[t].producer
            if lt.recomputed or lt.prefetched or t not in saved or producer not in allowed or not lt.start < k <= lt.end:
                continue
            fw_reads = [r for r in reads.get(t, []) if r < n_fw]
            last_fw = max(fw_reads, default=lt.start)
            first_bw = min((r for r in reads.get(t, []) if r >= n_fw), default=None)
            if last_fw >= k or (k >= n_fw and first_bw is not None and first_bw <= k):
                continue  # still needed here: evicting it frees nothing at k
            nbytes = problem.tensors[t].bytes
            if nbytes == 0:
                continue
            staleness = k - max(last_fw, lt.start)
            score = rematerialization_cost(problem, producer, evicted) / (nbytes * staleness)
            scored.append((score, lt.start, producer))
        if scored:
            return min(scored)[2]
    return None


def rematerialization_cost(problem: Problem, op_id: int, evicted: set[int]) -> float:
    """The op's time plus that of the evicted forward ops it reads through, transitively."""
    total, seen, todo = 0.0, {op_id}, [op_id]
    while todo:
        o = todo.pop()
        total += problem.ops[o].time_s
        for t in problem.ops[o].inputs:
            p = problem.tensors[t].producer
            if p is not None and p in evicted and p not in seen:
                seen.add(p)
                todo.append(p)
    return total + 1e-12
