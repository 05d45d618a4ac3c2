"""What the baselines share: the forward's dependency graph, schedules with a given forward order,
and checkpointing (recompute everything inside a segment but what leaves it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..model.liveness import recompute_candidates
from ..model.problem import Phase, Problem, Schedule
from ..search.heuristics import place_recomputes


@dataclass
class ForwardGraph:
    """The forward ops as a DAG: an edge from the op making a tensor to each forward op reading it."""

    order: list[int]  # forward op ids, program order
    preds: dict[int, list[int]]  # op -> forward ops making its inputs (each once, program order)
    succs: dict[int, list[int]]  # op -> forward ops reading its outputs (each once, program order)
    readers: dict[int, list[int]]  # tensor id -> ops reading it (forward and backward, program order)

    @property
    def position(self) -> dict[int, int]:
        return {o: k for k, o in enumerate(self.order)}


def forward_graph(problem: Problem) -> ForwardGraph:
    order = [o.id for o in problem.fw_ops]
    fw = set(order)
    readers = problem.consumers()
    preds: dict[int, list[int]] = {}
    succs: dict[int, list[int]] = {o: [] for o in order}
    for o in order:
        made_by = (problem.tensors[t].producer for t in problem.ops[o].inputs)
        preds[o] = sorted({p for p in made_by if p is not None and p in fw})
        for p in preds[o]:
            succs[p].append(o)
    return ForwardGraph(order, preds, succs, readers)


def op_kind(problem: Problem, op_id: int) -> str:
    """An op's name without its counter (`relu_3` -> `relu`), as `search.blocks.op_signature` reads it."""
    return re.sub(r"_?\d+$", "", problem.ops[op_id].name)


def with_forward_order(problem: Problem, fw_order: list[int]) -> Schedule:
    """`fw_order` for the forward, the backward in program order, everything saved."""
    return Schedule(fw_order=list(fw_order), bw_order=[o.id for o in problem.bw_ops])


def recompute_inside(problem: Problem, segments: list[list[int]]) -> set[int]:
    """Forward ops to recompute so that each segment keeps only its boundary.

    An op is recomputed when it is a recompute candidate and none of its outputs is read by a forward
    op outside its segment: the tensors crossing segment boundaries (and whatever is not recomputable)
    stay saved, everything else is made again in the backward. Ops in no segment keep everything.
    """
    seg_of = {o: i for i, seg in enumerate(segments) for o in seg}
    readers = problem.consumers()
    candidates = set(recompute_candidates(problem))
    chosen = set()
    for o, i in seg_of.items():
        if o not in candidates:
            continue
        leaves = any(
            problem.ops[r].phase is Phase.FW and seg_of.get(r) != i
            for t in problem.ops[o].outputs
            for r in readers[t]
        )
        if not leaves:
            chosen.add(o)
    return chosen


def checkpointed(problem: Problem, segments: list[list[int]]) -> Schedule:
    """Program order, with `recompute_inside(segments)` placed by `place_recomputes` (each recomputation
    just before the first backward step needing it, its recomputed inputs pulled in first)."""
    return place_recomputes(
        problem,
        [o.id for o in problem.fw_ops],
        [o.id for o in problem.bw_ops],
        recompute_inside(problem, segments),
    )
