"""What a fixed op order implies about liveness, before any save/recompute decision.

Shared by the CP-SAT models: step positions, the fixed memory profile (inputs,
tangents, backward tensors, forward tensors up to their last forward use) and, for
each forward activation, the facts its decision variables hang on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .problem import Phase, Problem, TensorKind


@dataclass
class Activation:
    tensor: int
    producer: int
    start: int  # position of its producer
    fw_last: int  # last forward position reading it (or start)
    direct: list[int] = field(default_factory=list)  # backward positions reading it
    rc_readers: list[int] = field(default_factory=list)  # recompute candidates reading it


class OrderedProblem:
    """`problem` with its forward and backward order fixed (positions 0..F-1, F..F+B-1).

    `optimistic_reuse`: where a backward op's storage reuse depends on recompute
    decisions, assume it happens (for lower bounds) instead of assuming it does not
    (for plans that must fit).
    """

    def __init__(self, problem: Problem, fw_order: list[int], bw_order: list[int], optimistic_reuse: bool = False):
        self.p = problem
        self.F, self.B = len(fw_order), len(bw_order)
        self.T = self.F + self.B
        self.pos = {o: k for k, o in enumerate(fw_order)}
        self.pos.update({o: self.F + k for k, o in enumerate(bw_order)})
        self.optimistic = optimistic_reuse
        self.candidates = [
            o for o in recompute_candidates(problem)
            if any(problem.tensors[t].kind is TensorKind.ACTIVATION for t in problem.ops[o].outputs)
        ]
        cand = set(self.candidates)
        self.fw_readers: dict[int, list[int]] = {t.id: [] for t in problem.tensors}
        self.bw_readers: dict[int, list[int]] = {t.id: [] for t in problem.tensors}
        for op in problem.ops:
            for t in op.inputs:
                (self.fw_readers if op.phase is Phase.FW else self.bw_readers)[t].append(op.id)
        self._delta = [0] * (self.T + 1)  # the fixed profile as differences: a parameter's span is the whole step
        self.activations: list[Activation] = []
        for t in problem.tensors:
            self._classify(t, cand)
        for o, k in self.pos.items():  # kernel scratch space, during the op's own step
            self._add_static(problem.ops[o].workspace_bytes, k, k)
        self.static = list(itertools.accumulate(self._delta[:self.T]))
        del self._delta

    def _add_static(self, nbytes: int, start: int, end: int) -> None:
        if start <= end:
            self._delta[start] += nbytes
            self._delta[end + 1] -= nbytes

    def _classify(self, t, cand: set[int]) -> None:
        p, F, T = self.p, self.F, self.T
        if t.kind is TensorKind.INPUT:
            self._add_static(t.bytes, 0, T - 1)
            return
        if t.kind is TensorKind.TANGENT:  # held by the autograd engine through the whole backward
            self._add_static(t.bytes, F, T - 1)
            return
        if t.kind is TensorKind.TANGENT_FREED:  # taken over by the backward: to its last reader
            self._add_static(t.bytes, F, min(T - 1, max([F] + [self.pos[b] for b in self.bw_readers[t.id]])))
            return
        if t.kind is TensorKind.CALLER:
            # the caller's loss between forward and backward, counted at the backward's first step: above
            # what the simulator counts there (it adds it to what crosses the boundary only), so a plan these
            # models accept fits; the relaxation (optimistic) leaves it out to stay a lower bound
            if not self.optimistic:
                self._add_static(t.bytes, F, min(F, T - 1))
            return
        start = self.pos[t.producer]
        if p.ops[t.producer].phase is Phase.BW:
            end = T - 1 if t.id in p.outputs else max([start] + [self.pos[b] for b in self.bw_readers[t.id]])
            if end > start and t.id not in p.outputs and self._reused_at(end, t.id):
                end -= 1  # its last reader writes its output into this storage
            self._add_static(t.bytes, start, end)
            return
        fw_last = max([start] + [self.pos[c] for c in self.fw_readers[t.id]])
        if t.id in p.returned:  # the caller holds it until the forward returns
            fw_last = max(fw_last, F - 1)
        if t.id in p.outputs:
            self._add_static(t.bytes, start, T - 1)
            return
        # optimistic: its last forward reader may write into it, as the simulator lets it when it is not saved
        reused = self.optimistic and fw_last > start and t.id not in p.returned and self._fw_reuses(fw_last, t.id)
        self._add_static(t.bytes, start, fw_last - 1 if reused else fw_last)
        direct = sorted(self.pos[b] for b in self.bw_readers[t.id])
        rc_readers = [c for c in self.fw_readers[t.id] if c in cand]
        if direct or rc_readers:
            self.activations.append(Activation(t.id, t.producer, start, fw_last, direct, rc_readers))

    def _fw_reuses(self, k: int, tid: int) -> bool:
        """Whether the forward op at step `k` has `tid` among the inputs it may write into."""
        return any(
            self.pos[r] == k and any(inp == tid for _out, inp in self.p.ops[r].reuse) for r in self.fw_readers[tid]
        )

    def _reused_at(self, end: int, tid: int) -> bool:
        """Whether the op at step `end` takes over `tid`'s storage, by the simulator's rule
        (the first qualifying pair wins)."""
        for r in self.bw_readers[tid]:
            if self.pos[r] != end:
                continue
            for _out, inp in self.p.ops[r].reuse:
                src = self.p.tensors[inp]
                if src.kind is not TensorKind.ACTIVATION or inp in self.p.visible:
                    continue
                if src.producer is None or self.p.ops[src.producer].phase is not Phase.BW:
                    return self.optimistic  # depends on decisions
                return inp == tid
        return False


def recompute_candidates(problem: Problem) -> list[int]:
    """Forward ops whose recomputation could free memory: recomputable, not producing a step output."""
    return [
        o.id
        for o in problem.fw_ops
        if o.recomputable and o.outputs and not any(t in problem.outputs for t in o.outputs)
    ]
