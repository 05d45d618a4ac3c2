"""Repeated blocks (transformer layers, CNN stages) and the backward's segments.

A block is a run of forward ops whose signatures (op kind and storage sizes) repeat with a
period: the longest such run in the forward is cut, where the fewest bytes cross, into
blocks of one period each. The ops before the first block (the stem: embeddings) and
after the last (the head: final norm, LM head, loss) are groups of their own. A graph
with no repetition is cut into groups of about `CHUNK_OPS` forward ops, so the search
below works on any graph; only repetition lets it copy one block's answer to the others.

The backward is cut into segments: maximal runs of steps that read one group's
activations (or recompute its ops). Each segment is planned as a whole by
solvers/cpsat/segment.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..model.problem import Phase, Problem, TensorKind
from ..model.simulator import SimResult

MIN_REPEATS = 2
CHUNK_OPS = 12  # forward ops per group when the graph does not repeat


@dataclass
class Groups:
    """Forward ops split into groups along the program; `blocks` lists the repeated ones."""

    of_op: dict[int, int]  # forward op id -> group index (program order)
    members: list[list[int]]  # group index -> forward op ids, in program order
    blocks: list[int]  # indices of the groups that are repetitions of one block
    period: int  # forward ops per block (0: no repetition)

    @property
    def block_set(self) -> set[int]:
        return set(self.blocks)


def op_signature(problem: Problem, op_id: int) -> tuple:
    """What makes two ops interchangeable for memory and time: kind (the name without its counter),
    storage sizes read and made, recomputability, scratch space."""
    op = problem.ops[op_id]
    kind = re.sub(r"_?\d+$", "", op.name)
    return (
        kind,
        tuple(problem.tensors[t].bytes for t in op.inputs if problem.tensors[t].kind is not TensorKind.INPUT),
        tuple(problem.tensors[t].bytes for t in op.outputs),
        op.recomputable,
        op.workspace_bytes,
    )


def _longest_period(codes: np.ndarray) -> tuple[int, int, int]:
    """(start, period, repeats) of the run covering the most ops with at least MIN_REPEATS periods;
    the smallest period among equal covers."""
    n = len(codes)
    best = (0, 0, 0, 0)  # cover, -period, start, repeats
    for p in range(1, n // MIN_REPEATS + 1):
        eq = codes[:-p] == codes[p:]
        if not eq.any():
            continue
        # longest run of True in eq
        padded = np.concatenate(([0], eq.astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(padded))
        starts, ends = edges[::2], edges[1::2]
        lengths = ends - starts
        i = int(np.argmax(lengths))
        run = int(lengths[i])
        repeats = (run + p) // p
        if repeats < MIN_REPEATS:
            continue
        cover = repeats * p
        if (cover, -p) > best[:2]:
            best = (cover, -p, int(starts[i]), repeats)
    return best[2], -best[1], best[3]


def find_blocks(problem: Problem, fw_order: list[int] | None = None) -> Groups:
    fw = fw_order if fw_order is not None else [o.id for o in problem.fw_ops]
    sigs: dict[tuple, int] = {}
    codes = np.array([sigs.setdefault(op_signature(problem, o), len(sigs)) for o in fw], dtype=np.int64)
    start, period, repeats = _longest_period(codes) if len(fw) >= 2 else (0, 0, 0)
    if period >= 2 and repeats >= MIN_REPEATS:
        # the blocks' first op: the rotation of the period where the fewest bytes cross
        cut = min(range(start, start + period), key=lambda c: _crossing_bytes(problem, fw, c))
        count = (start + repeats * period - cut) // period
        if count < MIN_REPEATS:
            cut, count = start, repeats
        bounds = [0] + [cut + i * period for i in range(count + 1)] + [len(fw)]
        members = [fw[x:y] for x, y in zip(bounds, bounds[1:])]
        blocks = list(range(1, 1 + count))
    else:
        members = [fw[i:i + CHUNK_OPS] for i in range(0, len(fw), CHUNK_OPS)]
        blocks, period = [], 0
    keep = [i for i, m in enumerate(members) if m]
    renum = {old: new for new, old in enumerate(keep)}
    members = [members[i] for i in keep]
    blocks = [renum[b] for b in blocks if b in renum]
    of_op = {o: g for g, ms in enumerate(members) for o in ms}
    return Groups(of_op, members, blocks, period)


def _crossing_bytes(problem: Problem, fw: list[int], cut: int) -> int:
    """Bytes made before forward position `cut` and read at or after it (in the forward)."""
    before = set(fw[:cut])
    after = fw[cut:]
    made = {t for o in before for t in problem.ops[o].outputs}
    read = {t for o in after for t in problem.ops[o].inputs if t in made}
    return sum(problem.tensors[t].bytes for t in read)


def segments(problem: Problem, sim: SimResult, groups: Groups) -> list[tuple[int, int, int]]:
    """(first step, end step, group) runs of the backward: each step's group is the latest group
    whose activations it reads (a recomputation: its op's group); a step reading none stays with
    the run before it."""
    n_fw = sim.n_forward_steps
    owner: list[int | None] = []
    for k in range(n_fw, len(sim.steps)):
        o, rc = sim.steps[k]
        if rc:
            owner.append(groups.of_op.get(o))
            continue
        gs = [
            groups.of_op[problem.tensors[t].producer]
            for t in problem.ops[o].inputs
            if problem.tensors[t].producer is not None and problem.ops[problem.tensors[t].producer].phase is Phase.FW
        ]
        owner.append(max(gs) if gs else None)
    for i in range(len(owner)):
        if owner[i] is None:
            owner[i] = owner[i - 1] if i else None
    first = next((g for g in owner if g is not None), None)
    out: list[tuple[int, int, int]] = []
    for i, g in enumerate(owner):
        g = first if g is None else g
        if out and out[-1][2] == g:
            out[-1] = (out[-1][0], n_fw + i + 1, g)
        else:
            out.append((n_fw + i, n_fw + i + 1, g))
    return [seg for seg in out if seg[2] is not None]
