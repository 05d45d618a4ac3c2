"""Memory-greedy topological orders of the forward, as TorchInductor's peak-memory reordering makes them
(`torch/_inductor/memory.py`: `topological_sort_lpmf`, `_bfs`, `_dfs`, chosen among by
`reorder_for_peak_memory`).

Read on our problem: nodes are the forward ops, buffers the activations they make. A buffer read by
the backward or held by the caller (outputs, returned values) counts one reader more, as a graph
output does in Inductor, so the forward never frees it; inputs (parameters, user inputs) are held by
the caller all step and are never freed (Inductor may free graph inputs at their last use). Op
scratch space is ignored, as Inductor ignores it. The backward runs in program order, everything saved.
"""

from __future__ import annotations

import heapq

from ..model.problem import Phase, Problem, Schedule
from ..model.simulator import simulate
from .graph import ForwardGraph, forward_graph, with_forward_order


def outdegrees(problem: Problem, g: ForwardGraph) -> tuple[dict[int, int], set[int]]:
    """Activations made in the forward -> their forward readers, +1 for those the backward or the caller
    needs (Inductor's graph outputs, returned as the second value)."""
    out: dict[int, int] = {}
    needed_after: set[int] = set()
    for o in g.order:
        for t in problem.ops[o].outputs:
            readers = g.readers[t]
            fw_readers = sum(1 for r in readers if problem.ops[r].phase is Phase.FW)
            if t in problem.visible or len(readers) > fw_readers:
                needed_after.add(t)
            out[t] = fw_readers + (t in needed_after)
    return out, needed_after


def lpmf_order(problem: Problem) -> list[int]:
    """Least Peak Memory First (Inductor's `topological_sort_lpmf`, after "Buffer memory optimization for
    video codec application modeled in Simulink", DAC 2006): keep the highest memory so far; among the
    ready ops, those whose allocation stays under it go first, the one leaving the least memory
    behind; otherwise the one allocating least. Ties: program order."""
    g = forward_graph(problem)
    pos = g.position
    nbytes = [t.bytes for t in problem.tensors]
    outdeg, needed_after = outdegrees(problem, g)
    freeable = set(outdeg)
    size = {o: sum(nbytes[t] for t in problem.ops[o].outputs) for o in g.order}
    to_free = dict.fromkeys(g.order, 0)
    for o in g.order:
        op = problem.ops[o]
        to_free[o] += sum(nbytes[t] for t in op.inputs if t in freeable and outdeg[t] == 1)
        to_free[o] += sum(nbytes[t] for t in op.outputs if outdeg[t] == 0)
    indegree = {o: len(g.preds[o]) for o in g.order}
    ready = {o for o in g.order if indegree[o] == 0}
    live = 0
    max_memory = sum(nbytes[t] for t in needed_after)  # the forward's outputs: a lower bound on its peak
    gap = max_memory - live
    order: list[int] = []
    while ready:
        best = min(ready, key=lambda o: (size[o] if size[o] > gap else 0, size[o] - to_free[o], pos[o]))
        ready.discard(best)
        order.append(best)
        live += size[best]
        max_memory = max(max_memory, live)
        live -= to_free[best]
        gap = max_memory - live
        for s in g.succs[best]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.add(s)
        for t in problem.ops[best].inputs:
            if t not in freeable:
                continue
            outdeg[t] -= 1
            if outdeg[t] == 1:  # its one remaining reader will free it
                for r in g.readers[t]:
                    if problem.ops[r].phase is Phase.FW:
                        to_free[r] += nbytes[t]
    return order


def bfs_order(problem: Problem) -> list[int]:
    """Inductor's `topological_sort_bfs`: run the ready op whose producers ran earliest (the sorted
    positions of its producers, compared as lists), first in, first out; ties: program order."""
    g = forward_graph(problem)
    pos = g.position
    ran_at: dict[int, int] = {}
    indegree = {o: len(g.preds[o]) for o in g.order}
    heap = [([], pos[o], o) for o in g.order if indegree[o] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _prio, _pos, o = heapq.heappop(heap)
        ran_at[o] = len(order)
        order.append(o)
        for s in g.succs[o]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(heap, (sorted(ran_at[p] for p in g.preds[s]), pos[s], s))
    return order


def dfs_order(problem: Problem) -> list[int]:
    """Inductor's `topological_sort_dfs`: visit ops by ascending bytes made plus bytes read (ties:
    program order), each after its producers, visited in the same order."""
    g = forward_graph(problem)
    pos = g.position
    nbytes = [t.bytes for t in problem.tensors]
    weight = {
        o: sum(nbytes[t] for t in problem.ops[o].outputs) + sum(nbytes[t] for t in problem.ops[o].inputs)
        for o in g.order
    }
    key = lambda o: (weight[o], pos[o])  # noqa: E731
    seen: set[int] = set()
    order: list[int] = []
    for root in sorted(g.order, key=key):
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(sorted(g.preds[root], key=key)))]
        while stack:  # depth first, without recursion (forwards have thousands of ops)
            node, deps = stack[-1]
            nxt = next((d for d in deps if d not in seen), None)
            if nxt is None:
                stack.pop()
                order.append(node)
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(g.preds[nxt], key=key))))
    return order


def order_lpmf(problem: Problem, budget_bytes: int | None = None) -> Schedule:
    """Forward in `lpmf_order`; the budget is ignored."""
    return with_forward_order(problem, lpmf_order(problem))


def order_bfs(problem: Problem, budget_bytes: int | None = None) -> Schedule:
    """Forward in `bfs_order`; the budget is ignored."""
    return with_forward_order(problem, bfs_order(problem))


def order_dfs(problem: Problem, budget_bytes: int | None = None) -> Schedule:
    """Forward in `dfs_order`; the budget is ignored."""
    return with_forward_order(problem, dfs_order(problem))


def order_inductor(problem: Problem, budget_bytes: int | None = None) -> Schedule:
    """What `reorder_for_peak_memory` keeps: the program order or one of the three orders, whichever
    peaks lowest (here by the simulator, where Inductor uses its own estimate; ties: program order,
    then lpmf, bfs, dfs). The budget is ignored."""
    orders = [[o.id for o in problem.fw_ops], lpmf_order(problem), bfs_order(problem), dfs_order(problem)]
    schedules = [with_forward_order(problem, order) for order in orders]
    return min(schedules, key=lambda s: simulate(problem, s).peak_bytes)

