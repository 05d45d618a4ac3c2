"""Parse memory budgets (bytes, sizes with units, a share of the unplanned peak, or "auto": what a CUDA
device has free at the first call) and check the planning options `optimize` and `plan_offline` share
(`check_options`). A parsed budget becomes a kind (`FixedBytes`, `AutoBytes`, `ShareOfPeak`, behind the
`BudgetKind` protocol) that answers, per program, the bytes it gets and how (`BudgetResolution`)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from copy import copy as shallow_copy
from dataclasses import dataclass, field
from typing import Protocol

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_FORMS = (
    "an int number of bytes (e.g. 2_000_000_000), a size string with a unit "
    "(e.g. '12GB', '512MiB', '1.5 GiB'; KB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB powers of 2), "
    "a percentage of the unplanned peak (e.g. '60%'), or None for no budget"
)
_AUTO_FORM = "'auto' (on a CUDA device: the memory free there at the first call, see auto_budget)"
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")


@dataclass(frozen=True)
class Budget:
    """Either absolute bytes or a fraction of the unplanned program's peak (None: no budget), or "auto":
    bytes the device's free memory decides at the first call (`BudgetResolution.resolve_auto`)."""

    spec: object
    nbytes: int | None = None
    fraction: float | None = None
    auto: bool = False

    def resolve(self, unplanned_peak_bytes: int) -> int | None:
        if self.auto:
            raise ValueError("mem_budget='auto' is resolved from the device's memory (BudgetResolution.resolve_auto), "
                             "not from a program's peak")
        if self.fraction is not None:
            return int(self.fraction * unplanned_peak_bytes)
        return self.nbytes

    def __str__(self) -> str:
        return "none" if self.spec is None else str(self.spec)


def parse_budget(spec: object, name: str = "mem_budget", of: str = "the unplanned peak", *, auto: bool = False) -> Budget:
    """Parse a budget; raise ValueError naming the argument and the accepted forms.

    `of`: what a percentage is a share of, for the error messages. `auto`: whether "auto" is accepted
    (optimize()'s mem_budget only: it needs the device the step runs on)."""
    forms = _FORMS.replace("the unplanned peak", of)
    if auto:
        forms = forms.replace(", or None", f", {_AUTO_FORM}, or None")
    if spec is None:
        return Budget(None)
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        if auto:
            return Budget("auto", auto=True)
        raise ValueError(
            f"{name}='auto' (the memory a CUDA device has free at the first call) is accepted only by optimize()'s "
            f"mem_budget, which sees the device; here use {forms}"
        )
    if isinstance(spec, bool):
        raise ValueError(f"{name}={spec!r} is not a budget; use {forms}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"{name} must be positive, got {spec}; use {forms}")
        return Budget(spec, nbytes=spec)
    if isinstance(spec, float):
        if spec.is_integer() and spec > 0:
            return Budget(spec, nbytes=int(spec))
        raise ValueError(f"{name}={spec!r}: a number means bytes and must be a positive whole number; use {forms}")
    if isinstance(spec, str):
        m = _PERCENT.match(spec)
        if m:
            pct = float(m.group(1))
            if pct <= 0:
                raise ValueError(f"{name}={spec!r} must be above 0%; use {forms}")
            return Budget(spec, fraction=pct / 100.0)
        m = _SIZE.match(spec)
        if m:
            unit = m.group(2).lower() or "b"
            if unit in _UNITS:
                nbytes = int(float(m.group(1)) * _UNITS[unit])
                if nbytes <= 0:
                    raise ValueError(f"{name}={spec!r} must be at least one byte; use {forms}")
                return Budget(spec, nbytes=nbytes)
            raise ValueError(f"{name}={spec!r}: unknown unit {m.group(2)!r}; use {forms}")
    raise ValueError(f"{name}={spec!r} is not a budget; use {forms}")


def parse_planning_options(
    mem_budget: object, host_budget: object, offload: object, executor: object, time_limit_s: object,
    *, auto: bool = False,
) -> tuple[Budget, Budget]:
    """Check the options `optimize` and `plan_offline` share, with the same messages; returns the
    device budget and the host budget. `auto`: mem_budget="auto" is accepted (optimize(), not plan_offline)."""
    budget = parse_budget(mem_budget, auto=auto)
    host = parse_budget(host_budget, name="host_budget", of="this machine's physical memory")
    check_options(offload=offload, executor=executor, time_limit_s=time_limit_s)
    return budget, host


def _option_rules(v: object) -> dict[str, tuple[bool, str]]:
    """Per option of optimize() (a PlanningSettings field): whether `v` is accepted, and the error if not."""
    from .costs.profiles import PROFILES, DeviceProfile  # torch-free
    from .executors import NAMES as executors  # torch-free

    flag = v is None or isinstance(v, bool)
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    return {
        "device_profile": (v is None or isinstance(v, DeviceProfile) or (isinstance(v, str) and v.lower() in PROFILES),
                           f"unknown device profile {v!r}; known: {', '.join(sorted(PROFILES))}"),
        "time_limit_s": (v is None or (number and v > 0), f"time_limit_s must be a positive number of seconds, got {v!r}"),
        "progress": (isinstance(v, bool), f"progress must be True or False, got {v!r}"),
        "offload": (flag, f"offload must be None (automatic), True or False, got {v!r}"),
        "executor": (v is None or (isinstance(v, str) and v.lower() in executors),
                     f"unknown executor {v!r}; known: {', '.join(executors)}"),
        "plan": (v is None or isinstance(v, (str, os.PathLike)), f"plan must be a path or 'auto', got {v!r}"),
        "on_mismatch": (isinstance(v, str) and v in ("error", "replan"), f"on_mismatch must be 'error' or 'replan', got {v!r}"),
        "deterministic": (flag, f"deterministic must be True, False or None, got {v!r}"),
        "optimizer": (v is None or _is_optimizer(v), f"optimizer must be a torch.optim.Optimizer, got {type(v).__name__}"),
        "updates_in_backward": (v == "auto" if isinstance(v, str) else v is False,
                                f"updates_in_backward must be 'auto' or False, got {v!r}"),
        "chunking": (flag or (v == "auto" if isinstance(v, str) else isinstance(v, int) and v >= 1),
                     f"chunking must be True, False, None, 'auto' or a chunk count (an int from 1), got {v!r}"),
    }


def _is_optimizer(v: object) -> bool:
    import torch

    return isinstance(v, torch.optim.Optimizer)


def check_options(**options: object) -> None:
    """Raise ValueError, naming the option and what it accepts, for the first of `options` (optimize()'s
    keyword arguments) that is not accepted. PlanningSettings checks every field when it is built, so a bad
    option fails at optimize() (or plan_offline()), not at the first call that plans."""
    for name, value in options.items():
        ok, error = _option_rules(value)[name]
        if not ok:
            raise ValueError(error)


AUTO_HEADROOM_SHARE = 0.05  # "auto" leaves this share of the device's total memory unused...
AUTO_HEADROOM_MIN = 256 * 2**20  # ...and at least this much: allocator fragmentation, cuBLAS/cuDNN workspaces
AUTO_GRANULE = 64 * 2**20  # "auto" bytes are rounded down to a multiple of this (plan files key the bytes)


@dataclass(frozen=True)
class DeviceMemory:
    """What "auto" is decided from: one CUDA device's memory as this process sees it at the first call."""

    device: str
    total: int  # the device's memory
    free: int  # free on the device (torch.cuda.mem_get_info: what no process, this one included, has reserved)
    reserved: int  # held by this process's caching allocator
    allocated: int  # of which in tensors
    limit: int | None = None  # the allocator's cap (torch.cuda.set_per_process_memory_fraction), None when uncapped

    @classmethod
    def of(cls, device) -> DeviceMemory:
        import torch

        free, total = torch.cuda.mem_get_info(device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get_fraction(device) if get_fraction is not None else 1.0
        return cls(str(device), int(total), int(free), int(torch.cuda.memory_reserved(device)),
                   int(torch.cuda.memory_allocated(device)), int(fraction * total) if fraction < 1.0 else None)


def auto_budget(mem: DeviceMemory, resident_bytes: int) -> dict:
    """The bytes mem_budget="auto" means, and how they were reached:

        bytes = resident + available - headroom, rounded down to AUTO_GRANULE
        available = free + (reserved - allocated)    (capped: min(free + reserved, limit) - allocated)
        headroom = max(AUTO_HEADROOM_SHARE * total, AUTO_HEADROOM_MIN)

    `resident_bytes`: the step's own inputs already on the device (parameters, buffers, input tensors):
    a budget counts them (it bounds everything on the device during the step) and they are allocated
    already, so they are added back. Everything else this process holds (optimizer state, other models,
    tensors kept from earlier steps) stays out of the budget, and so does what other processes hold.
    Raises ValueError when nothing would be left for the step beyond its inputs."""
    mib = 2**20
    obtainable = mem.free + mem.reserved  # what the caching allocator can hold in all
    if mem.limit is not None:
        obtainable = min(obtainable, mem.limit)
    available = max(obtainable - mem.allocated, 0)
    headroom = max(int(AUTO_HEADROOM_SHARE * mem.total), AUTO_HEADROOM_MIN)
    nbytes = (resident_bytes + available - headroom) // AUTO_GRANULE * AUTO_GRANULE
    detail = {
        "device": mem.device, "total_bytes": mem.total, "free_bytes": mem.free, "reserved_bytes": mem.reserved,
        "allocated_bytes": mem.allocated, "limit_bytes": mem.limit, "available_bytes": available,
        "resident_bytes": resident_bytes, "headroom_bytes": headroom, "bytes": nbytes,
    }
    if nbytes <= resident_bytes:
        raise ValueError(
            f"mem_budget='auto': {mem.device} has {available / mib:.0f} MiB available to this process (free "
            f"{mem.free / mib:.0f} MiB + cached {max(mem.reserved - mem.allocated, 0) / mib:.0f} MiB"
            + (f", capped at {mem.limit / mib:.0f} MiB by set_per_process_memory_fraction" if mem.limit is not None else "")
            + f"), less {headroom / mib:.0f} MiB headroom: nothing is left for the step beyond its inputs' "
            f"{resident_bytes / mib:.0f} MiB. Free device memory, or pass a budget in bytes ('12GB')"
        )
    return detail


def step_tensors(module, args: tuple, kwargs: dict, optimizer=None) -> list:
    """The tensors a call of an optimized callable starts from: the module's parameters and buffers, and
    the tensors (and modules' parameters and buffers) among the call's arguments, with the gradients they
    already have (an accumulation step is planned with them live: api.grads_at_start), and the state `optimizer`
    (optimize's `optimizer=`, whose state every plan counts) already holds."""
    import torch
    from ._torch import tree_leaves

    out: list = []
    for leaf in ([module] if module is not None else []) + tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.nn.Module):
            out += [*leaf.parameters(), *leaf.buffers()]
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)] if optimizer else []
    return out + [t.grad for t in out if t.is_leaf and t.grad is not None] + state


def resident_bytes(tensors: list, device) -> int:
    """Bytes of the distinct storages among `tensors` on `device` (views and tied weights counted once); on
    CUDA as the caching allocator counts them (whole 512-byte blocks)."""
    block = 512 if device.type == "cuda" else 1
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device == device:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = -(-storage.nbytes() // block) * block
    return sum(seen.values())


def auto_device(tensors: list):
    """The CUDA device "auto" reads: that of the step's first CUDA tensor (the current CUDA device when the
    step has no tensors). ValueError when there is none: "auto" needs a CUDA device."""
    import torch

    devices = []
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
        if t.device not in devices:
            devices.append(t.device)
    if not devices and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    on = f"the step's tensors are on {', '.join(map(str, devices))}" if devices else "CUDA is not available"
    raise ValueError(
        f"mem_budget='auto' means the memory a CUDA device has free at the first call, and {on}. On this device pass "
        "a budget in bytes (e.g. 2_000_000_000 or '12GB') or a percentage of the unplanned peak (e.g. '60%')"
    )


THIS_PROGRAM = "this program"
SAME_SHAPES = "the training program of the same shapes"
LARGEST_TRAINING_PROGRAM = "the largest training program"
FIRST_TRAINING_PROGRAM = "the first training program"  # files made before issue 24: its bytes for every program
# a training program whose own share is below its proven bound, given the bytes of a larger one (issue 33)
LARGER_TRAINING_PROGRAM = "a larger training program"
# an accumulation step (gradients live from its start) whose own share no plan met, given what the plan of the same
# step without gradients to accumulate into peaks at with them (issue 33: a loop never stops at its second micro-batch)
FIRST_MICRO_BATCH = "the first micro-batch's plan"
AUTO_SOURCE = "the device's free memory at the first call"
TRAINING_SHAPES_KEPT = 1024  # training signatures a resolution remembers the bytes of, the oldest forgotten first
_MIB = 2**20


@dataclass(frozen=True)
class PeakRecord:
    """A training program planned under a share of its peak: the bytes it got, its unplanned peak and its
    fingerprint hash. What a forward-only program, or a smaller shape below its bound, may take from it."""

    nbytes: int
    unplanned_peak_bytes: int
    fingerprint: str | None

    def as_dict(self) -> dict:
        """As plan files (`budget_from`, `budget_reference`) and the planner read it."""
        return {"unplanned_peak_bytes": self.unplanned_peak_bytes, "fingerprint": self.fingerprint, "bytes": self.nbytes}

    @classmethod
    def of(cls, record: PeakRecord | Mapping | None) -> PeakRecord | None:
        """A record from its dict form (`as_dict`, old pickles); a record or None as it is."""
        if record is None or isinstance(record, PeakRecord):
            return record
        return cls(record["bytes"], record.get("unplanned_peak_bytes", 0), record.get("fingerprint"))


class BudgetKind(Protocol):
    """What a budget answers for each program of one optimized callable: `training` (the program has a
    backward) and `shapes` (its signature's key; None for plan_offline's) say which program asks. Only a share
    of each program's peak lends bytes between programs: the others give every program the same bytes, and
    the lending questions' defaults below are their answers."""

    def bytes_for(self, unplanned_peak_bytes: int, training: bool, shapes: str | None) -> int | None:
        """The budget of a program with this unplanned peak (None: no budget)."""

    def fixed_bytes(self, training: bool, shapes: str | None) -> int | None:
        """The bytes a program gets whatever its own peak, known before its ops are timed (None: not known)."""

    def source(self, unplanned_peak_bytes: int, fingerprint: str | None, training: bool, shapes: str | None,
               ) -> dict | None:
        """How the program got its bytes, as plans record it (Plan.budget_from); None for bytes given."""

    def made_for(self, training: bool, shapes: str | None) -> dict:
        """What a plan file must have been made for, beyond the budget's spec, to be reused for the program."""

    def explain(self, unplanned_peak_bytes: int, training: bool, shapes: str | None) -> str | None:
        """For error messages: how the program got its bytes (None: bytes given)."""

    def copy(self) -> BudgetKind:
        """The kind as a copy of the optimized callable starts with it: what it learned so far, its own from then."""

    needs_device: bool = False  # "auto" not resolved yet: the first call reads the device (AutoBytes.resolve)
    largest: PeakRecord | None = None  # the training program given the most bytes so far

    def lender(self, training: bool, shapes: str | None) -> tuple[str, PeakRecord] | None:
        """The training program a forward-only program takes its bytes from (which, and its record)."""
        return None

    def record_training(self, record: PeakRecord, shapes: str | None) -> None:
        """A training program was planned (or replayed) with its share of its unplanned peak."""

    def lend_larger(self, own_bytes: int, bound_bytes: int, training: bool) -> PeakRecord | None:
        """For a training program whose own bytes are below its proven bound: a larger one's record to take."""
        return None

    def explain_below_bound(self, own_bytes: int, bound_bytes: int, training: bool) -> str | None:
        """For the error of a program below its bound that took no larger one's bytes: why not."""
        return None


@dataclass(frozen=True)
class FixedBytes(BudgetKind):
    """Bytes the user gave (`nbytes`; None: no budget), the same for every program."""

    nbytes: int | None

    def bytes_for(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> int | None:
        return self.nbytes

    def fixed_bytes(self, training: bool = True, shapes: str | None = None) -> int | None:
        return self.nbytes

    def source(self, unplanned_peak_bytes: int, fingerprint: str | None = None, training: bool = True,
               shapes: str | None = None) -> dict | None:
        return None

    def made_for(self, training: bool = True, shapes: str | None = None) -> dict:
        return {}  # the spec is the bytes

    def explain(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> str | None:
        return None

    def copy(self) -> FixedBytes:
        return self


@dataclass
class AutoBytes(BudgetKind):
    """mem_budget="auto": bytes the device's free memory decides at the first call, before anything is captured
    (`resolve`), then the same for every program. `detail`: how they were reached (auto_budget's figures)."""

    nbytes: int | None = None
    detail: dict | None = None

    @property
    def needs_device(self) -> bool:
        return self.nbytes is None

    def resolve(self, module, args: tuple, kwargs: dict, memory: DeviceMemory | None = None, optimizer=None) -> None:
        """Fix the bytes from the device the call's tensors are on (`auto_budget`); `memory` for tests; `optimizer`:
        optimize's, whose state the plans count (what it holds already is added back, like the inputs).
        ValueError when the step is not on a CUDA device or nothing is left for it."""
        tensors = step_tensors(module, args, kwargs, optimizer)
        device = auto_device(tensors)
        detail = auto_budget(memory if memory is not None else DeviceMemory.of(device), resident_bytes(tensors, device))
        self.nbytes, self.detail = detail["bytes"], detail

    def bytes_for(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> int:
        if self.nbytes is None:
            raise RuntimeError("mem_budget='auto' was not resolved before planning: the optimized callable's first "
                               "call resolves it (BudgetResolution.resolve_auto)")
        return self.nbytes

    def fixed_bytes(self, training: bool = True, shapes: str | None = None) -> int | None:
        return self.nbytes

    def source(self, unplanned_peak_bytes: int, fingerprint: str | None = None, training: bool = True,
               shapes: str | None = None) -> dict:
        return {"program": AUTO_SOURCE, "unplanned_peak_bytes": unplanned_peak_bytes, "fingerprint": fingerprint,
                "bytes": self.nbytes, "auto": dict(self.detail or {})}

    def made_for(self, training: bool = True, shapes: str | None = None) -> dict:
        return {"budget_resolved_bytes": self.nbytes}

    def explain(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> str:
        a = self.detail or {}
        cap = f", capped at {a['limit_bytes'] / _MIB:.0f} MiB" if a.get("limit_bytes") is not None else ""
        return (
            f"the budget 'auto' was resolved at the first call on {a.get('device')}: {a.get('available_bytes', 0) / _MIB:.0f} "
            f"MiB available (free {a.get('free_bytes', 0) / _MIB:.0f} MiB + cached "
            f"{(a.get('reserved_bytes', 0) - a.get('allocated_bytes', 0)) / _MIB:.0f} MiB{cap}) + the step's inputs "
            f"{a.get('resident_bytes', 0) / _MIB:.0f} MiB - headroom {a.get('headroom_bytes', 0) / _MIB:.0f} MiB = "
            f"{(self.nbytes or 0) / _MIB:.0f} MiB, and means those bytes for every later program; this program's "
            f"unplanned peak is {unplanned_peak_bytes / _MIB:.2f} MiB"
        )

    def copy(self) -> AutoBytes:
        return AutoBytes(self.nbytes, dict(self.detail) if self.detail else None)


@dataclass
class ShareOfPeak(BudgetKind):
    """A percentage: a share of each training program's (forward+backward) own unplanned peak, for every
    training signature apart, so a loop whose shapes change (bucketed or growing sequence lengths, a smaller
    last batch) gets that share of each step's own peak, whatever the order the shapes come in.

    A forward-only program (eval, no_grad) takes the bytes of the training program it evaluates: the one of
    the same shapes (`SAME_SHAPES`: the same input shapes, strides, dtypes, devices and constants, whatever
    the grad mode, train/eval mode, requires_grad and accumulation) when one was planned, else the largest
    planned so far (`LARGEST_TRAINING_PROGRAM`: the most bytes the loop was already given), else, with no
    training program planned yet, the share of its own unplanned peak (`THIS_PROGRAM`), which a forward-only
    program rarely reaches: it saves no activations to recompute. Those bytes are recorded per training
    signature (`trained`, the larger when two programs share shapes, e.g. with and without gradients to
    accumulate into); with no signature (plan_offline) a forward-only program takes the largest's.

    A training program whose own share is below its proven bound (no plan can fit it: at a small last batch
    the parameters and gradients, which do not shrink with the batch, dominate the peak) takes the bytes of
    the largest training program planned so far when they are not below that bound (`lend_larger`,
    `LARGER_TRAINING_PROGRAM`): memory the loop has already been allowed. With no larger one planned yet (the
    small shape first) it raises, saying so (`explain_below_bound`)."""

    budget: Budget
    trained: dict[str, PeakRecord] = field(default_factory=dict, repr=False)  # per signature's shapes, the latest last
    largest: PeakRecord | None = None

    def own(self, unplanned_peak_bytes: int) -> int:
        """The share of a program's own unplanned peak."""
        return self.budget.resolve(unplanned_peak_bytes)

    def lender(self, training: bool, shapes: str | None) -> tuple[str, PeakRecord] | None:
        """None for a training program, and for a forward-only one before any training program."""
        if training:
            return None
        if shapes is not None and shapes in self.trained:
            return SAME_SHAPES, self.trained[shapes]
        return (LARGEST_TRAINING_PROGRAM, self.largest) if self.largest is not None else None

    def bytes_for(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> int:
        lender = self.lender(training, shapes)
        return lender[1].nbytes if lender is not None else self.own(unplanned_peak_bytes)

    def fixed_bytes(self, training: bool = True, shapes: str | None = None) -> int | None:
        lender = self.lender(training, shapes)
        return lender[1].nbytes if lender is not None else None

    def source(self, unplanned_peak_bytes: int, fingerprint: str | None = None, training: bool = True,
               shapes: str | None = None) -> dict:
        """The program the share is taken of (which, its unplanned peak, its fingerprint hash) and the bytes."""
        program, record = self.lender(training, shapes) or (
            THIS_PROGRAM, PeakRecord(self.own(unplanned_peak_bytes), unplanned_peak_bytes, fingerprint))
        return {"program": program, **record.as_dict()}

    def made_for(self, training: bool = True, shapes: str | None = None) -> dict:
        """A share of the program's own peak (the fingerprint and the spec determine the bytes), or the bytes a
        forward-only program takes (a plan made for the same bytes is reused, whichever program they came from)."""
        lender = self.lender(training, shapes)
        return {"budget_resolved_bytes": lender[1].nbytes} if lender is not None else {"budget_from": THIS_PROGRAM}

    def explain(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> str:
        spec, here = self.budget.spec, f"this program's unplanned peak is {unplanned_peak_bytes / _MIB:.2f} MiB"
        lender = self.lender(training, shapes)
        if lender is not None:
            program, record = lender
            return (
                f"the budget {spec!r} gives a forward-only program the bytes of {program} this callable planned "
                f"({spec} of its unplanned peak of {record.unplanned_peak_bytes / _MIB:.2f} MiB = "
                f"{record.nbytes / _MIB:.2f} MiB), and {here}"
            )
        nbytes = self.own(unplanned_peak_bytes)
        if training:
            return (f"the budget {spec!r} is {spec} of each training program's own unplanned peak: here "
                    f"{unplanned_peak_bytes / _MIB:.2f} MiB, so {nbytes / _MIB:.2f} MiB")
        return (
            f"the budget {spec!r} is {spec} of this forward-only program's own unplanned peak ({unplanned_peak_bytes / _MIB:.2f} "
            f"MiB, so {nbytes / _MIB:.2f} MiB): no training program was planned before it (once one is, forward-only "
            "programs take a training program's bytes)"
        )

    def record_training(self, record: PeakRecord, shapes: str | None) -> None:
        """The bytes forward-only programs of its shapes take, and the largest for those of shapes not trained."""
        if shapes is not None:
            had = self.trained.pop(shapes, None)  # put back last: the most recently planned are kept
            self.trained[shapes] = record if had is None or record.nbytes > had.nbytes else had
            while len(self.trained) > TRAINING_SHAPES_KEPT:
                del self.trained[next(iter(self.trained))]
        if self.largest is None or record.nbytes > self.largest.nbytes:
            self.largest = record

    def lend_larger(self, own_bytes: int, bound_bytes: int, training: bool = True) -> PeakRecord | None:
        """The largest training program's record when its bytes are not below the bound; else None (raise)."""
        if not training or own_bytes >= bound_bytes or self.largest is None:
            return None
        return self.largest if self.largest.nbytes >= bound_bytes else None

    def explain_lent(self, record: PeakRecord, own_bytes: int, bound_bytes: int, unplanned_peak_bytes: int) -> str:
        """How a training program came to plan with a larger one's bytes (`lend_larger`), for its notes."""
        spec = self.budget.spec
        return (
            f"budget: {spec} of this training program's unplanned peak ({unplanned_peak_bytes / _MIB:.2f} MiB) is "
            f"{own_bytes / _MIB:.2f} MiB, below the {bound_bytes / _MIB:.2f} MiB every plan of it needs; planned with "
            f"{record.nbytes / _MIB:.2f} MiB, the bytes {spec} gave {LARGER_TRAINING_PROGRAM} of this callable "
            f"(unplanned peak {record.unplanned_peak_bytes / _MIB:.2f} MiB): memory the loop was already allowed"
        )

    def explain_below_bound(self, own_bytes: int, bound_bytes: int, training: bool = True) -> str | None:
        """Why no larger program's bytes were taken: none planned yet, or theirs are below the bound too."""
        if not training or own_bytes >= bound_bytes:
            return None
        if self.largest is None or self.largest.nbytes <= own_bytes:
            return ("no larger training program of this callable was planned before this one: a smaller shape whose "
                    "own share is below its bound takes the bytes a larger shape was given, once one is planned")
        return (f"the most bytes {self.budget.spec} gave a training program of this callable, "
                f"{self.largest.nbytes / _MIB:.2f} MiB, are below this bound too")

    def copy(self) -> ShareOfPeak:
        return ShareOfPeak(self.budget, dict(self.trained), self.largest)


def budget_kind(budget: Budget, nbytes: int | None = None, *, auto: dict | None = None,
                trained: Mapping | None = None, largest: PeakRecord | Mapping | None = None) -> BudgetKind:
    """The kind of a parsed budget; `nbytes`, `auto`: "auto"'s bytes and figures once resolved; `trained`,
    `largest`: a share's training programs so far (records or their dicts)."""
    if budget.auto:
        return AutoBytes(nbytes, auto)
    if budget.fraction is not None:
        return ShareOfPeak(budget, {k: PeakRecord.of(v) for k, v in (trained or {}).items()}, PeakRecord.of(largest))
    return FixedBytes(budget.nbytes)


class BudgetResolution:
    """A budget as one optimized callable means it, shared by all the programs it compiles (every input
    signature, grad mode and train/eval mode) and carried by its copies: a thin façade over its kind
    (`FixedBytes`, `AutoBytes`, `ShareOfPeak`), which answers every question. `shapes` is the key of a
    signature (the Dispatcher's, `for_shapes`); None (plan_offline) records no signature. Records come out
    as dicts ({"bytes", "unplanned_peak_bytes", "fingerprint"}) where the planner and plan files read them."""

    def __init__(self, budget: Budget, nbytes: int | None = None, *, auto: dict | None = None,
                 trained: dict | None = None, largest: dict | None = None):
        self.budget = budget
        self.kind: BudgetKind = budget_kind(budget, nbytes, auto=auto, trained=trained, largest=largest)

    def __setstate__(self, state: dict) -> None:
        """Pickles made before budgets had kinds hold the kind's state in the resolution ("nbytes", "auto",
        "trained", "largest"); those made before issue 24 fixed a percentage's bytes at the first training
        program ("nbytes", "reference"): bytes a training program was given, which forward-only programs may take."""
        if "kind" in state:
            self.__dict__.update(state)
            return
        budget, nbytes, largest = state["budget"], state.get("nbytes"), state.get("largest")
        if budget.fraction is not None and nbytes is not None:
            reference = state.get("reference") or {}
            largest = largest or {"bytes": nbytes, "unplanned_peak_bytes": reference.get("unplanned_peak_bytes", 0),
                                  "fingerprint": reference.get("fingerprint")}
        self.__init__(budget, nbytes, auto=state.get("auto"), trained=state.get("trained"), largest=largest)

    @property
    def is_percentage(self) -> bool:
        return isinstance(self.kind, ShareOfPeak)

    @property
    def needs_device(self) -> bool:
        """"auto", not resolved yet: the first call resolves it (`resolve_auto`) before anything is captured."""
        return self.kind.needs_device

    @property
    def largest(self) -> dict | None:
        """The record of the training program given the most bytes so far (a share's), as a dict."""
        return self.kind.largest.as_dict() if self.kind.largest is not None else None

    def resolve_auto(self, module, args: tuple, kwargs: dict, memory: DeviceMemory | None = None, optimizer=None) -> None:
        """Fix "auto"'s bytes from the device the call's tensors are on (AutoBytes.resolve)."""
        self.kind.resolve(module, args, kwargs, memory, optimizer)

    def for_shapes(self, shapes: str | None) -> SignatureResolution:
        """This resolution as the programs of one input signature see it (what they record is shared)."""
        return SignatureResolution(self, shapes)

    def lender(self, training: bool, shapes: str | None = None) -> tuple[str, PeakRecord] | None:
        return self.kind.lender(training, shapes)

    def fixed_bytes(self, training: bool = True, shapes: str | None = None) -> int | None:
        return self.kind.fixed_bytes(training, shapes)

    def lend_larger(self, own_bytes: int, bound_bytes: int, training: bool = True) -> dict | None:
        record = self.kind.lend_larger(own_bytes, bound_bytes, training)
        return record.as_dict() if record is not None else None

    def explain_lent(self, record: dict | PeakRecord, own_bytes: int, bound_bytes: int, unplanned_peak_bytes: int) -> str:
        """`record`: what `lend_larger` returned (only a share lends)."""
        return self.kind.explain_lent(PeakRecord.of(record), own_bytes, bound_bytes, unplanned_peak_bytes)

    def explain_below_bound(self, own_bytes: int, bound_bytes: int, training: bool = True) -> str | None:
        return self.kind.explain_below_bound(own_bytes, bound_bytes, training)

    def bytes_for(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> int | None:
        return self.kind.bytes_for(unplanned_peak_bytes, training, shapes)

    def source(self, unplanned_peak_bytes: int, fingerprint: str | None = None, training: bool = True,
               shapes: str | None = None) -> dict | None:
        return self.kind.source(unplanned_peak_bytes, fingerprint, training, shapes)

    def made_for(self, training: bool = True, shapes: str | None = None) -> dict:
        return self.kind.made_for(training, shapes)

    def record_training(self, nbytes: int, unplanned_peak_bytes: int, fingerprint: str | None,
                        shapes: str | None = None) -> None:
        self.kind.record_training(PeakRecord(nbytes, unplanned_peak_bytes, fingerprint), shapes)

    def explain(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> str | None:
        return self.kind.explain(unplanned_peak_bytes, training, shapes)

    def copy(self) -> BudgetResolution:
        new = shallow_copy(self)
        new.kind = self.kind.copy()
        return new

    def __repr__(self) -> str:
        return f"BudgetResolution({self.budget}, {self.kind!r})"


class SignatureResolution:
    """A BudgetResolution as the programs of one input signature see it (each PlanningBackend of a Dispatcher
    has one): `shapes` says which training program a forward-only program of the signature evaluates. What
    they record goes to the shared resolution; what is not defined here is read from it."""

    def __init__(self, shared: BudgetResolution, shapes: str | None):
        self.shared = shared
        self.shapes = shapes

    def __getattr__(self, name: str):
        if name in ("shared", "shapes"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.shared, name)

    def lender(self, training: bool) -> tuple[str, PeakRecord] | None:
        return self.shared.lender(training, self.shapes)

    def bytes_for(self, unplanned_peak_bytes: int, training: bool = True) -> int | None:
        return self.shared.bytes_for(unplanned_peak_bytes, training, self.shapes)

    def fixed_bytes(self, training: bool = True) -> int | None:
        return self.shared.fixed_bytes(training, self.shapes)

    def source(self, unplanned_peak_bytes: int, fingerprint: str | None = None, training: bool = True) -> dict | None:
        return self.shared.source(unplanned_peak_bytes, fingerprint, training, self.shapes)

    def made_for(self, training: bool = True) -> dict:
        return self.shared.made_for(training, self.shapes)

    def record_training(self, nbytes: int, unplanned_peak_bytes: int, fingerprint: str | None) -> None:
        self.shared.record_training(nbytes, unplanned_peak_bytes, fingerprint, self.shapes)

    def explain(self, unplanned_peak_bytes: int, training: bool = True) -> str | None:
        return self.shared.explain(unplanned_peak_bytes, training, self.shapes)

    def copy(self) -> BudgetResolution:
        return self.shared.copy()

    def __repr__(self) -> str:
        return f"SignatureResolution({self.shapes}, {self.shared!r})"
