"""Thunder-style maximal horizontal fusion ordering: the memory-blind order of Thunder issue 1337.

Thunder's fusion pass pulls ops of the same kind that do not depend on each other together, so one
fused kernel runs them all (ten independent relus as one kernel). As an order: every op at its
earliest level (longest chain of forward producers before it), and within a level the ops of one
kind together. On the seed functions this holds every path's temporaries at once
(`synthetic.parallel_paths_problem`).
"""

from __future__ import annotations

from ..model.problem import Problem, Schedule
from .graph import forward_graph, op_kind, with_forward_order


def thunder_horizontal(problem: Problem, budget_bytes: int | None = None) -> Schedule:
    """Forward sorted by (ASAP level, kind in order of first appearance, program order); backward in
    program order, everything saved. The budget is ignored."""
    g = forward_graph(problem)
    level: dict[int, int] = {}
    for o in g.order:  # program order is topological
        level[o] = 1 + max((level[p] for p in g.preds[o]), default=-1)
    kind_rank: dict[str, int] = {}
    for o in g.order:
        kind_rank.setdefault(op_kind(problem, o), len(kind_rank))
    pos = g.position
    order = sorted(g.order, key=lambda o: (level[o], kind_rank[op_kind(problem, o)], pos[o]))
    return with_forward_order(problem, order)
