"""Plain-data planning problem and schedule: the contract between optsched and its solvers.

Nothing here imports torch. A `Problem` is what the planner knows about one training
step: ops in program order (forward, then backward), the storages they allocate and
read, and what each op costs. A `Schedule` is one answer: the order in which ops run
and which forward ops are recomputed inside the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(str, Enum):
    FW = "fw"
    BW = "bw"


class TensorKind(str, Enum):
    INPUT = "input"  # parameters, buffers, user inputs: held by the caller all step
    TANGENT = "tangent"  # gradient seeds handed to the backward
    ACTIVATION = "activation"  # allocated by an op of this step
    # what the caller allocates between forward and backward (its loss on the outputs): live as the
    # backward starts, gone after its first step
    CALLER = "caller"


@dataclass(frozen=True)
class Tensor:
    """One storage. Views are not tensors here: they read their base's storage."""

    id: int
    name: str
    bytes: int
    kind: TensorKind = TensorKind.ACTIVATION
    producer: int | None = None  # op id; None for inputs and tangents
    offloadable: bool = True  # an activation whose storage can be copied to the host and back as one block


@dataclass(frozen=True)
class Op:
    id: int
    name: str
    phase: Phase
    inputs: tuple[int, ...]  # tensor ids read (deduplicated)
    outputs: tuple[int, ...]  # tensor ids allocated
    time_s: float = 0.0
    recomputable: bool = True  # False for random, mutating or side-effecting ops
    # (output, input) pairs: the output may be written into the input's storage when
    # that input dies at this op (an elementwise op with an out= variant)
    reuse: tuple[tuple[int, int], ...] = ()
    # the pairs are taken together or not at all (a foreach op writes its whole first list in
    # place): every input must die at this op; otherwise one pair is taken, the first that can be
    reuse_all: bool = False
    workspace_bytes: int = 0  # allocated and freed inside the op (kernel scratch), on top of its outputs


@dataclass
class Problem:
    """Ops are listed in the program's order: all forward ops, then all backward ops."""

    ops: list[Op]
    tensors: list[Tensor]
    outputs: frozenset[int] = frozenset()  # tensor ids returned by the step: live to its end
    # forward results handed to a caller that drops them once the forward returns: live at least to the
    # forward's end (and on, while the backward reads them)
    returned: frozenset[int] = frozenset()
    name: str = "step"
    host_bw: float = 0.0  # bytes/s of host<->device copies; 0: no offloading
    host_budget_bytes: int | None = None  # host memory offloaded activations may take; None: unlimited

    def __post_init__(self) -> None:
        self.outputs = frozenset(self.outputs)
        self.returned = frozenset(self.returned) - self.outputs
        self.validate()

    @property
    def visible(self) -> frozenset[int]:
        """Tensors someone outside the step holds (outputs, and forward results until the forward ends):
        never hidden inside a fusion group, never written over by another op."""
        return self.outputs | self.returned

    @property
    def fw_ops(self) -> list[Op]:
        return [o for o in self.ops if o.phase is Phase.FW]

    @property
    def bw_ops(self) -> list[Op]:
        return [o for o in self.ops if o.phase is Phase.BW]

    @property
    def has_backward(self) -> bool:
        return any(o.phase is Phase.BW for o in self.ops)

    def consumers(self) -> dict[int, list[int]]:
        """tensor id -> ids of ops reading it, in program order."""
        users: dict[int, list[int]] = {t.id: [] for t in self.tensors}
        for op in self.ops:
            for t in op.inputs:
                users[t].append(op.id)
        return users

    def validate(self) -> None:
        """Reject malformed problems early, with the offending name."""
        if self.host_bw < 0:
            raise ValueError(f"host bandwidth must be >= 0, got {self.host_bw}")
        if self.host_budget_bytes is not None and self.host_budget_bytes < 0:
            raise ValueError(f"host budget must be >= 0 bytes, got {self.host_budget_bytes}")
        for i, t in enumerate(self.tensors):
            if t.id != i:
                raise ValueError(f"tensor {t.name!r} has id {t.id}, expected {i}")
            if t.bytes < 0:
                raise ValueError(f"tensor {t.name!r} has negative size {t.bytes}")
        seen_fw_end = False
        produced: set[int] = {t.id for t in self.tensors if t.producer is None}
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise ValueError(f"op {op.name!r} has id {op.id}, expected {i}")
            if op.phase is Phase.BW:
                seen_fw_end = True
            elif seen_fw_end:
                raise ValueError(f"forward op {op.name!r} listed after a backward op")
            for t in op.inputs:
                if t not in produced:
                    raise ValueError(f"op {op.name!r} reads tensor {self.tensors[t].name!r} before it exists")
            for out, inp in op.reuse:
                if out not in op.outputs or inp not in op.inputs:
                    raise ValueError(f"op {op.name!r} reuse pair ({out}, {inp}) is not (output, input)")
                if self.tensors[out].bytes != self.tensors[inp].bytes:
                    raise ValueError(f"op {op.name!r} reuses a storage of another size")
            if op.reuse_all and (
                len({o for o, _ in op.reuse}) != len(op.reuse) or len({i for _, i in op.reuse}) != len(op.reuse)
            ):
                raise ValueError(f"op {op.name!r} reuses storages together, but its pairs share an output or input")
            for t in op.outputs:
                if self.tensors[t].producer != op.id:
                    raise ValueError(f"tensor {self.tensors[t].name!r} does not name op {op.name!r} as producer")
                produced.add(t)
        for t in self.tensors:
            if t.kind is TensorKind.TANGENT and any(
                self.ops[c].phase is Phase.FW for c in self.consumers()[t.id]
            ):
                raise ValueError(f"tangent {t.name!r} is read in the forward")


class ScheduleError(ValueError):
    """The schedule cannot run: missing op, bad order, value read before it exists."""


@dataclass
class Schedule:
    """Run `fw_order`, then `bw_order`. Forward ops inside `bw_order` are recomputations.

    `offload` maps a saved activation to the backward position (index into `bw_order`)
    before which it is copied back from the host; it is copied out as soon as it is made.
    """

    fw_order: list[int]
    bw_order: list[int]
    offload: dict[int, int] = field(default_factory=dict)

    def recomputed(self, problem: Problem) -> list[int]:
        return [o for o in self.bw_order if problem.ops[o].phase is Phase.FW]

    def to_dict(self) -> dict:
        return {
            "fw_order": list(self.fw_order),
            "bw_order": list(self.bw_order),
            "offload": {str(t): j for t, j in sorted(self.offload.items())},
        }

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        return cls(
            fw_order=[int(i) for i in d["fw_order"]],
            bw_order=[int(i) for i in d["bw_order"]],
            offload={int(t): int(j) for t, j in d.get("offload", {}).items()},
        )


@dataclass
class SolveStats:
    """What a solve reports; `gap` is relative: (objective - bound) / objective."""

    status: str  # OPTIMAL, FEASIBLE, HEURISTIC, INFEASIBLE
    objective_s: float
    bound_s: float
    gap: float
    wall_s: float
    method: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "objective_s": self.objective_s,
            "bound_s": self.bound_s,
            "gap": self.gap,
            "wall_s": self.wall_s,
            "method": self.method,
            "notes": list(self.notes),
        }


def default_schedule(problem: Problem) -> Schedule:
    """The program as captured: its own order, every needed activation saved."""
    return Schedule(
        fw_order=[o.id for o in problem.fw_ops],
        bw_order=[o.id for o in problem.bw_ops],
    )
