"""Plain-data planning problem and schedule: the contract between optsched and its solvers.

Nothing here imports torch. A `Problem` is what the planner knows about one training
step: ops in program order (forward, then backward), the storages they allocate and
read, and what each op costs. A `Schedule` is one answer: the order in which ops run
and which forward ops are recomputed inside the backward.

A problem may offer fusion options (`FusionOption`): groups of ops that may run as one kernel,
formed or not as the solver decides (`Schedule.formed`). A formed group's members run
consecutively as one step in time and memory: its time is the option's; every input and output
of the group is live while it runs; values made and read only inside it take no memory
(`simulator.py` implements this; merging the group with `search.fusion_groups.fuse_ops` gives
the same peak and time).
"""

from __future__ import annotations

import dataclasses

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum


class Phase(str, Enum):
    FW = "fw"
    BW = "bw"


class TensorKind(str, Enum):
    INPUT = "input"  # parameters, buffers, user inputs: held by the caller all step
    TANGENT = "tangent"  # gradient seeds handed to the backward, held by the autograd engine all backward
    # a gradient seed the backward takes over from the engine (capture/tangent_handover.py): freed after
    # its last read, like an activation made at the backward's start
    TANGENT_FREED = "tangent_freed"
    ACTIVATION = "activation"  # allocated by an op of this step
    # what the caller allocates between forward and backward (its loss on the outputs): live as the
    # backward starts, gone after its first step
    CALLER = "caller"


TANGENTS = (TensorKind.TANGENT, TensorKind.TANGENT_FREED)  # the gradient seeds, however long they live


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
    # inputs (the step's own inputs) this backward op overwrites in place, as an optimizer's update writes its
    # parameter: every op reading one, a recomputation included, runs before it (the simulator refuses others)
    writes: tuple[int, ...] = ()


@dataclass(frozen=True)
class FusionOption:
    """Ops that may run as one kernel: one phase, in program order, convex, disjoint from other options.
    `time_s` and `workspace_bytes` are the fused kernel's."""

    members: tuple[int, ...]
    time_s: float
    workspace_bytes: int = 0
    name: str = ""


@dataclass(frozen=True, eq=False)
class Phases:
    """`Problem.phases`: the forward and backward ops; the forward ops' ids in order, the backward's as a set,
    the forward ops that may not be recomputed, and whether any op writes over an input (`Op.writes`)."""

    ops: list[Op]  # the list these were made from
    fw: tuple[Op, ...]
    bw: tuple[Op, ...]
    fw_ids: list[int]
    bw_ids: frozenset[int]
    not_recomputable: frozenset[int]
    writes: bool

    @classmethod
    def of(cls, ops: list[Op]) -> Phases:
        fw = tuple(o for o in ops if o.phase is Phase.FW)
        bw = tuple(o for o in ops if o.phase is Phase.BW)
        return cls(ops, fw, bw, sorted(o.id for o in fw), frozenset(o.id for o in bw),
                   frozenset(o.id for o in fw if not o.recomputable), any(o.writes for o in ops))


@dataclass(frozen=True, eq=False)
class TensorFacts:
    """`Problem.tensor_facts`: what every simulation asks of the tensors, made once per tensors list and outputs."""

    tensors: list[Tensor]  # the list these were made from
    outputs: frozenset[int]  # and the outputs
    returned: frozenset[int]  # and the forward results the caller drops
    bytes: list[int]  # per tensor
    caller_bytes: int  # the caller's own intermediates (`TensorKind.CALLER`), summed
    inputs: tuple[int, ...]  # live all program
    tangents: tuple[int, ...]  # live the whole backward
    freed_tangents: tuple[int, ...]  # from the backward's start to their last read
    tangent_set: frozenset[int]  # both kinds of tangents
    saveable: frozenset[int]  # activations that are not outputs: what autograd saves when they cross the boundary
    reusable: frozenset[int]  # activations no one outside the step holds: an op may write its output into one

    @classmethod
    def of(cls, tensors: list[Tensor], outputs: frozenset[int], returned: frozenset[int]) -> TensorFacts:
        def kind(k: TensorKind) -> tuple[int, ...]:
            return tuple(t.id for t in tensors if t.kind is k)

        activations = frozenset(t.id for t in tensors if t.kind is TensorKind.ACTIVATION)
        return cls(tensors, outputs, returned, [t.bytes for t in tensors],
                   sum(t.bytes for t in tensors if t.kind is TensorKind.CALLER), kind(TensorKind.INPUT),
                   kind(TensorKind.TANGENT), kind(TensorKind.TANGENT_FREED),
                   frozenset(t.id for t in tensors if t.kind in TANGENTS), activations - outputs,
                   activations - outputs - returned)


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
    fusion_options: tuple[FusionOption, ...] = ()  # groups the solver may form (Schedule.formed)

    def __post_init__(self) -> None:
        self.outputs = frozenset(self.outputs)
        self.returned = frozenset(self.returned) - self.outputs
        self.fusion_options = tuple(self.fusion_options)
        self.validate()

    @property
    def visible(self) -> frozenset[int]:
        """Tensors someone outside the step holds (outputs, and forward results until the forward ends):
        never hidden inside a fusion group, never written over by another op."""
        return self.outputs | self.returned

    def holding(self, storages: frozenset[int] | set[int]) -> Problem:
        """This problem with `storages` (forward results the caller would drop) held by the caller to the
        step's end, as outputs are: the step of a caller that keeps them through the backward."""
        storages = frozenset(storages)
        return dataclasses.replace(self, outputs=self.outputs | storages, returned=self.returned - storages)

    @property
    def fw_ops(self) -> list[Op]:
        return list(self.phases.fw)

    @property
    def bw_ops(self) -> list[Op]:
        return list(self.phases.bw)

    @property
    def phases(self) -> Phases:
        """The ops split by phase and what checking an order needs of them, made once per ops list (a simulation
        of a 9000-op problem spent a third of its time rebuilding them)."""
        cached = self.__dict__.get("_phases")
        if cached is None or cached.ops is not self.ops or len(cached.fw) + len(cached.bw) != len(self.ops):
            cached = self.__dict__["_phases"] = Phases.of(self.ops)
        return cached

    @property
    def tensor_facts(self) -> TensorFacts:
        """What the simulator asks of the tensors, made once per tensors list (a simulation of a 450-step Llama
        spent a tenth of its time summing and sorting them again)."""
        cached = self.__dict__.get("_tensor_facts")
        if cached is None or cached.tensors is not self.tensors or cached.outputs is not self.outputs \
                or cached.returned is not self.returned or len(cached.bytes) != len(self.tensors):
            cached = self.__dict__["_tensor_facts"] = TensorFacts.of(self.tensors, self.outputs, self.returned)
        return cached

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
            for t in op.writes:
                if t not in op.inputs or op.phase is not Phase.BW or self.tensors[t].kind is not TensorKind.INPUT:
                    raise ValueError(f"op {op.name!r} writes {self.tensors[t].name!r}: only a backward op writes, "
                                     "and only a step input it reads")
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
            if t.kind in TANGENTS and any(
                self.ops[c].phase is Phase.FW for c in self.consumers()[t.id]
            ):
                raise ValueError(f"tangent {t.name!r} is read in the forward")
        self._validate_fusion_options()

    def option_name(self, i: int) -> str:
        opt = self.fusion_options[i]
        if opt.name:
            return opt.name
        names = [self.ops[o].name for o in opt.members if 0 <= o < len(self.ops)]
        return "+".join(names) if len(names) <= 4 else f"{names[0]}+{len(names) - 1} more"

    def _validate_fusion_options(self) -> None:
        """Each option: existing ops of one phase, in program order, convex, in no other option."""
        if not self.fusion_options:
            return
        readers = self.consumers()
        owner: dict[int, int] = {}
        for i, opt in enumerate(self.fusion_options):
            members = list(opt.members)
            if not members:
                raise ValueError(f"fusion option {i} has no members")
            bad = [o for o in members if not 0 <= o < len(self.ops)]
            if bad:
                raise ValueError(f"fusion option {i} names op {bad[0]}, which does not exist")
            label = f"fusion option {i} ({self.option_name(i)})"
            if members != sorted(set(members)):
                raise ValueError(f"{label}: members are not in program order")
            if len({self.ops[o].phase for o in members}) != 1:
                raise ValueError(f"{label} mixes forward and backward ops")
            if opt.time_s < 0 or opt.workspace_bytes < 0:
                raise ValueError(f"{label}: negative time or scratch bytes")
            for o in members:
                if o in owner:
                    raise ValueError(f"op {self.ops[o].name!r} is in fusion options {owner[o]} and {i}")
                owner[o] = i
            path = convexity_violation(self, members, readers)
            if path is not None:
                raise ValueError(f"{label} is not convex: a path leaves it through op {self.ops[path].name!r} and comes back")


def convexity_violation(problem: Problem, group: list[int], readers: dict[int, list[int]] | None = None) -> int | None:
    """An op outside `group` (sorted op ids) on a path from a member to a member, or None (convex)."""
    inside = set(group)
    readers = problem.consumers() if readers is None else readers
    frontier = [(r, r) for o in group for t in problem.ops[o].outputs for r in readers[t] if r not in inside]
    seen: set[int] = set()
    while frontier:
        o, first = frontier.pop()
        if o in seen or o > group[-1]:
            continue
        seen.add(o)
        for t in problem.ops[o].outputs:
            for r in readers[t]:
                if r in inside:
                    return first
                frontier.append((r, first))
    return None


class ScheduleError(ValueError):
    """The schedule cannot run: missing op, bad order, value read before it exists."""


@dataclass
class Schedule:
    """Run `fw_order`, then `bw_order`. Forward ops inside `bw_order` are recomputations.

    `offload` maps a saved activation to the backward position (index into `bw_order`)
    before which it is copied back from the host; it is copied out as soon as it is made.

    `formed`: indices of the problem's fusion options run as one kernel (members consecutive in their
    phase's order; a recomputed forward group is recomputed whole, consecutively).
    """

    fw_order: list[int]
    bw_order: list[int]
    offload: dict[int, int] = field(default_factory=dict)
    formed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.formed = tuple(sorted(set(self.formed)))

    def recomputed(self, problem: Problem) -> list[int]:
        return [o for o in self.bw_order if problem.ops[o].phase is Phase.FW]

    def to_dict(self) -> dict:
        return {
            "fw_order": list(self.fw_order),
            "bw_order": list(self.bw_order),
            "offload": {str(t): j for t, j in sorted(self.offload.items())},
            **({"formed": list(self.formed)} if self.formed else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        return cls(
            fw_order=[int(i) for i in d["fw_order"]],
            bw_order=[int(i) for i in d["bw_order"]],
            offload={int(t): int(j) for t, j in d.get("offload", {}).items()},
            formed=tuple(int(i) for i in d.get("formed", ())),
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


NOTE_ITEMS = 5  # items a `Rejections` note names; the rest are counted


class Rejections:
    """Errors a search expected and recovered from (a candidate plan the simulator refuses, a fusion group
    that is not convex, ...): counted per kind, the first error of each kind kept, and summed up as notes
    (`SolveStats.notes`, a plan's notes), so that nothing is dropped unsaid. `solve()` collects the search's;
    the planner opens one around the planning of a graph for its own (groups, FLOP formulas). Collectors
    nest: an error is counted once, in the innermost one open (`collecting_rejections`)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}  # (what, error type) -> how many
        self.first: dict[tuple[str, str], str] = {}  # (what, error type) -> the first error's message
        self.items: dict[str, dict[str, str]] = {}  # what -> item -> its error ("Type: message"), the first per item

    def add(self, what: str, error: BaseException) -> None:
        key = (what, type(error).__name__)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.first.setdefault(key, str(error))

    def add_item(self, what: str, item: str, error: BaseException) -> None:
        """An error about `item` (an op): noted once per item, with its error."""
        self.items.setdefault(what, {}).setdefault(item, f"{type(error).__name__}: {error}")

    def copy(self) -> Rejections:
        out = Rejections()
        out.counts, out.first = dict(self.counts), dict(self.first)
        out.items = {k: dict(v) for k, v in self.items.items()}
        return out

    def __bool__(self) -> bool:
        return bool(self.counts or self.items)

    def notes(self) -> list[str]:
        """One note per kind: "N <what>: <error type>: <first message>" (e.g. "3 candidate(s) rejected in the
        segment search: ScheduleError: ...") and, for items, "N <what>: <item>: <error>; ..."."""
        out = [f"{n} {what}: {kind}: {self.first[(what, kind)]}" for (what, kind), n in self.counts.items()]
        for what, items in self.items.items():
            shown = "; ".join(f"{item}: {e}" for item, e in list(items.items())[:NOTE_ITEMS])
            more = f"; and {len(items) - NOTE_ITEMS} more" if len(items) > NOTE_ITEMS else ""
            out.append(f"{len(items)} {what}: {shown}{more}")
        return out


_REJECTIONS: contextvars.ContextVar[Rejections | None] = contextvars.ContextVar("optsched_rejections", default=None)
REJECTIONS_META = "optsched_rejections"  # a GraphModule's meta key for what its passes recovered from (`rejections_in`)


@contextlib.contextmanager
def collecting_rejections(into: Rejections | None = None) -> Iterator[Rejections]:
    """Within this block `reject` counts into `into` (a new `Rejections` by default), which it yields."""
    sink = Rejections() if into is None else into
    token = _REJECTIONS.set(sink)
    try:
        yield sink
    finally:
        _REJECTIONS.reset(token)


def open_rejections() -> Rejections | None:
    """The innermost collector open here, or None."""
    return _REJECTIONS.get()


def rejections_in(meta: dict) -> Rejections:
    """The `Rejections` kept in a graph's `meta` dict (made on first use): what passes that run before
    planning recovered from, for the planner to note on the graph's plan."""
    found = meta.get(REJECTIONS_META)
    if not isinstance(found, Rejections):
        found = meta[REJECTIONS_META] = Rejections()
    return found


def reject(log: logging.Logger, what: str, error: BaseException, *, item: str | None = None,
           into: Rejections | None = None) -> None:
    """An expected error that makes the caller drop a candidate and go on (`what`: what happened, counted,
    e.g. "candidate(s) rejected in the chain search"): logged at debug with the exception, and counted
    in `into`, else in the innermost collector open (none open: logged only). `item`: the error is about
    one named thing (an op), noted once per item."""
    log.debug("%s: %s: %s", what, type(error).__name__, error, exc_info=error)
    sink = into if into is not None else _REJECTIONS.get()
    if sink is None:
        return
    if item is None:
        sink.add(what, error)
    else:
        sink.add_item(what, item, error)


def default_schedule(problem: Problem) -> Schedule:
    """The program as captured: its own order, every needed activation saved."""
    return Schedule(
        fw_order=[o.id for o in problem.fw_ops],
        bw_order=[o.id for o in problem.bw_ops],
    )
