"""Parse memory budgets (bytes, sizes with units, a share of the unplanned peak, or "auto": what a CUDA
device has free at the first call) and the planning options `optimize` and `plan_offline` share."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    from .executors import NAMES as executors  # torch-free

    budget = parse_budget(mem_budget, auto=auto)
    host = parse_budget(host_budget, name="host_budget", of="this machine's physical memory")
    if offload is not None and not isinstance(offload, bool):
        raise ValueError(f"offload must be None (automatic), True or False, got {offload!r}")
    if executor is not None and (not isinstance(executor, str) or executor.lower() not in executors):
        raise ValueError(f"unknown executor {executor!r}; known: {', '.join(executors)}")
    positive_number = isinstance(time_limit_s, (int, float)) and not isinstance(time_limit_s, bool) and time_limit_s > 0
    if time_limit_s is not None and not positive_number:
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    return budget, host


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


def step_tensors(module, args: tuple, kwargs: dict) -> list:
    """The tensors a call of an optimized callable starts from: the module's parameters and buffers, and
    the tensors (and modules' parameters and buffers) among the call's arguments, with the gradients they
    already have (an accumulation step is planned with them live: api.grads_at_start)."""
    import torch
    from ._torch import tree_leaves

    out: list = []
    for leaf in ([module] if module is not None else []) + tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.nn.Module):
            out += [*leaf.parameters(), *leaf.buffers()]
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf)
    return out + [t.grad for t in out if t.is_leaf and t.grad is not None]


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


class BudgetResolution:
    """A budget as one optimized callable means it, shared by all the programs it compiles (every
    input signature, grad mode and train/eval mode) and carried by its copies.

    A percentage is a share of a training program's (forward+backward) own unplanned peak, for every
    training signature apart: a loop whose shapes change (bucketed or growing sequence lengths, a smaller
    last batch) gets that share of each step's own peak, whatever the order the shapes come in. Bytes are
    fixed only when the user gives bytes. A forward-only program (eval, no_grad) takes the bytes of the
    training program it evaluates: the one of the same shapes (`SAME_SHAPES`: the same input shapes,
    strides, dtypes, devices and constants, whatever the grad mode, train/eval mode, requires_grad and
    accumulation) when one was planned, else the largest planned so far (`LARGEST_TRAINING_PROGRAM`: the
    most bytes the loop was already given), else, with no training program planned yet, the percentage of
    its own unplanned peak (`THIS_PROGRAM`), which a forward-only program rarely reaches: it saves no
    activations to recompute. Those bytes are recorded per training signature (`record_training`, the
    larger when two programs share shapes, e.g. with and without gradients to accumulate into) and carried
    by copies. `shapes` is the key of a signature (the Dispatcher's, `for_shapes`); None (plan_offline)
    records no signature, and a forward-only program then takes the largest training program's bytes.

    A smaller shape may use the bytes already given to a larger shape of the same program: a training
    program whose own share is below its proven bound (no plan can fit it: at a small last batch the
    parameters and gradients, which do not shrink with the batch, dominate the peak) takes the bytes of the
    largest training program planned so far when they are not below that bound (`lend_larger`,
    `LARGER_TRAINING_PROGRAM`): memory the loop has already been allowed. With no larger one planned yet (the
    small shape first) it raises, saying so (`explain_below_bound`).

    "auto" is resolved once, at the first call, before anything is captured (`resolve_auto`), from the
    device's memory then; from then on it means those bytes for every program. Budgets in bytes (and no
    budget) need no resolving."""

    auto: dict | None = None  # how "auto" was resolved (auto_budget's figures); a class default for old pickles

    def __init__(self, budget: Budget, nbytes: int | None = None, *, auto: dict | None = None,
                 trained: dict | None = None, largest: dict | None = None):
        self.budget = budget
        self.nbytes = nbytes  # the resolved bytes of "auto", once resolved
        self.auto = auto
        # the training programs planned under a percentage, {"bytes", "unplanned_peak_bytes", "fingerprint"}:
        # per signature's shapes, and the one with the most bytes
        self.trained: dict[str, dict] = {k: dict(v) for k, v in (trained or {}).items()}
        self.largest = dict(largest) if largest else None

    def __setstate__(self, state: dict) -> None:
        """Pickles made before issue 24 fixed a percentage's bytes at the first training program (`nbytes`,
        `reference`): those are bytes a training program was given, which forward-only programs may take."""
        state = dict(state)
        reference = state.pop("reference", None) or {}
        if state["budget"].fraction is not None and state.get("nbytes") is not None:
            state.setdefault("largest", {"unplanned_peak_bytes": reference.get("unplanned_peak_bytes", 0),
                                         "fingerprint": reference.get("fingerprint"), "bytes": state["nbytes"]})
            state["nbytes"] = None
        state.setdefault("trained", {})
        state.setdefault("largest", None)
        self.__dict__.update(state)

    @property
    def is_percentage(self) -> bool:
        return self.budget.fraction is not None

    @property
    def resolved(self) -> bool:
        """Bytes fixed for every program: "auto" once resolved (a percentage never is)."""
        return self.nbytes is not None

    @property
    def needs_device(self) -> bool:
        """"auto", not resolved yet: the first call resolves it (`resolve_auto`) before anything is captured."""
        return self.budget.auto and self.nbytes is None

    def resolve_auto(self, module, args: tuple, kwargs: dict, memory: DeviceMemory | None = None) -> None:
        """Fix "auto"'s bytes from the device the call's tensors are on (`auto_budget`); `memory` for tests.
        ValueError when the step is not on a CUDA device or nothing is left for it."""
        tensors = step_tensors(module, args, kwargs)
        device = auto_device(tensors)
        detail = auto_budget(memory if memory is not None else DeviceMemory.of(device), resident_bytes(tensors, device))
        self.nbytes, self.auto = detail["bytes"], detail

    def for_shapes(self, shapes: str | None) -> SignatureResolution:
        """This resolution as the programs of one input signature see it (what they record is shared)."""
        return SignatureResolution(self, shapes)

    def lender(self, training: bool, shapes: str | None = None) -> tuple[str, dict] | None:
        """Under a percentage, the training program a forward-only program takes its bytes from (which, and
        its record); None for a training program, before any training program, or for other budgets."""
        if self.budget.fraction is None or training:
            return None
        if shapes is not None and shapes in self.trained:
            return SAME_SHAPES, self.trained[shapes]
        if self.largest is not None:
            return LARGEST_TRAINING_PROGRAM, self.largest
        return None

    def fixed_bytes(self, training: bool = True, shapes: str | None = None) -> int | None:
        """The bytes a program gets whatever its own peak, known before its ops are timed: bytes given, "auto"
        resolved, a forward-only program's lender's. None for no budget and for a share of its own peak."""
        if self.budget.auto:
            return self.nbytes
        if self.budget.fraction is None:
            return self.budget.nbytes
        lender = self.lender(training, shapes)
        return lender[1]["bytes"] if lender is not None else None

    def lend_larger(self, own_bytes: int, bound_bytes: int, training: bool = True) -> dict | None:
        """Under a percentage, for a training program whose own share (`own_bytes`) is below its proven bound
        (`bound_bytes`): the record of the largest training program planned so far ({"bytes",
        "unplanned_peak_bytes", "fingerprint"}) when its bytes are not below that bound; else None (raise)."""
        if self.budget.fraction is None or not training or own_bytes >= bound_bytes or self.largest is None:
            return None
        return self.largest if self.largest["bytes"] >= bound_bytes else None

    def explain_lent(self, record: dict, own_bytes: int, bound_bytes: int, unplanned_peak_bytes: int) -> str:
        """How a training program came to plan with a larger one's bytes (`lend_larger`), for its notes."""
        mib = 2**20
        spec = self.budget.spec
        return (
            f"budget: {spec} of this training program's unplanned peak ({unplanned_peak_bytes / mib:.2f} MiB) is "
            f"{own_bytes / mib:.2f} MiB, below the {bound_bytes / mib:.2f} MiB every plan of it needs; planned with "
            f"{record['bytes'] / mib:.2f} MiB, the bytes {spec} gave {LARGER_TRAINING_PROGRAM} of this callable "
            f"(unplanned peak {record['unplanned_peak_bytes'] / mib:.2f} MiB): memory the loop was already allowed"
        )

    def explain_below_bound(self, own_bytes: int, bound_bytes: int, training: bool = True) -> str | None:
        """For the error of a training program whose own share is below its bound and that took no larger
        program's bytes: why not (none planned yet, or theirs are below the bound too). None otherwise."""
        if self.budget.fraction is None or not training or own_bytes >= bound_bytes:
            return None
        mib = 2**20
        if self.largest is None or self.largest["bytes"] <= own_bytes:
            return ("no larger training program of this callable was planned before this one: a smaller shape whose "
                    "own share is below its bound takes the bytes a larger shape was given, once one is planned")
        return (f"the most bytes {self.budget.spec} gave a training program of this callable, "
                f"{self.largest['bytes'] / mib:.2f} MiB, are below this bound too")

    def bytes_for(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> int | None:
        """The budget of a program with this unplanned peak (`training`: it has a backward)."""
        if self.budget.auto:
            if self.nbytes is None:
                raise RuntimeError("mem_budget='auto' was not resolved before planning: the optimized callable's first "
                                   "call resolves it (BudgetResolution.resolve_auto)")
            return self.nbytes
        if self.budget.fraction is None:
            return self.budget.nbytes
        lender = self.lender(training, shapes)
        return lender[1]["bytes"] if lender is not None else self.budget.resolve(unplanned_peak_bytes)

    def source(self, unplanned_peak_bytes: int, fingerprint: str | None = None, training: bool = True,
               shapes: str | None = None) -> dict | None:
        """How a program with this unplanned peak gets its bytes (Plan.budget_from), None unless a percentage:
        the program the percentage is taken of (which, its unplanned peak, its fingerprint hash) and the bytes.
        For "auto": AUTO_SOURCE, this program's unplanned peak, the bytes and how they were reached ("auto")."""
        if self.budget.auto:
            return {"program": AUTO_SOURCE, "unplanned_peak_bytes": unplanned_peak_bytes, "fingerprint": fingerprint,
                    "bytes": self.nbytes, "auto": dict(self.auto or {})}
        if self.budget.fraction is None:
            return None
        lender = self.lender(training, shapes)
        if lender is not None:
            program, record = lender
            return {"program": program, "unplanned_peak_bytes": record["unplanned_peak_bytes"],
                    "fingerprint": record["fingerprint"], "bytes": record["bytes"]}
        return {"program": THIS_PROGRAM, "unplanned_peak_bytes": unplanned_peak_bytes, "fingerprint": fingerprint,
                "bytes": self.budget.resolve(unplanned_peak_bytes)}

    def made_for(self, training: bool = True, shapes: str | None = None) -> dict:
        """What a plan file must have been made for, beyond the budget's spec, to be reused now, so that a
        plan is never reused for other bytes: a percentage of the program's own peak (`budget_from: "this
        program"`: the fingerprint and the spec determine the bytes), or the bytes a forward-only program
        takes from a training program (`budget_resolved_bytes`; a plan made for the same bytes is reused,
        whichever program they came from). "auto": its resolved bytes."""
        if self.budget.auto:
            return {"budget_resolved_bytes": self.nbytes}
        if self.budget.fraction is None:
            return {}
        lender = self.lender(training, shapes)
        if lender is not None:
            return {"budget_resolved_bytes": lender[1]["bytes"]}
        return {"budget_from": THIS_PROGRAM}

    def record_training(self, nbytes: int, unplanned_peak_bytes: int, fingerprint: str | None,
                        shapes: str | None = None) -> None:
        """A training program was planned (or replayed) with `nbytes`, the percentage of its unplanned peak:
        the bytes forward-only programs of its shapes take, and the largest for those of shapes not trained."""
        if self.budget.fraction is None:
            return
        record = {"bytes": nbytes, "unplanned_peak_bytes": unplanned_peak_bytes, "fingerprint": fingerprint}
        if shapes is not None:
            had = self.trained.pop(shapes, None)  # put back last: the most recently planned are kept
            self.trained[shapes] = record if had is None or nbytes > had["bytes"] else had
            while len(self.trained) > TRAINING_SHAPES_KEPT:
                del self.trained[next(iter(self.trained))]
        if self.largest is None or nbytes > self.largest["bytes"]:
            self.largest = record

    def explain(self, unplanned_peak_bytes: int, training: bool = True, shapes: str | None = None) -> str | None:
        """For error messages: how a program with this unplanned peak got its bytes (None: bytes given)."""
        mib = 2**20
        here = f"this program's unplanned peak is {unplanned_peak_bytes / mib:.2f} MiB"
        if self.budget.auto:
            a = self.auto or {}
            cap = f", capped at {a['limit_bytes'] / mib:.0f} MiB" if a.get("limit_bytes") is not None else ""
            return (
                f"the budget 'auto' was resolved at the first call on {a.get('device')}: {a.get('available_bytes', 0) / mib:.0f} "
                f"MiB available (free {a.get('free_bytes', 0) / mib:.0f} MiB + cached "
                f"{(a.get('reserved_bytes', 0) - a.get('allocated_bytes', 0)) / mib:.0f} MiB{cap}) + the step's inputs "
                f"{a.get('resident_bytes', 0) / mib:.0f} MiB - headroom {a.get('headroom_bytes', 0) / mib:.0f} MiB = "
                f"{(self.nbytes or 0) / mib:.0f} MiB, and means those bytes for every later program; {here}"
            )
        if self.budget.fraction is None:
            return None
        spec = self.budget.spec
        lender = self.lender(training, shapes)
        if lender is not None:
            program, record = lender
            return (
                f"the budget {spec!r} gives a forward-only program the bytes of {program} this callable planned "
                f"({spec} of its unplanned peak of {record['unplanned_peak_bytes'] / mib:.2f} MiB = "
                f"{record['bytes'] / mib:.2f} MiB), and {here}"
            )
        nbytes = self.budget.resolve(unplanned_peak_bytes)
        if training:
            return (f"the budget {spec!r} is {spec} of each training program's own unplanned peak: here "
                    f"{unplanned_peak_bytes / mib:.2f} MiB, so {nbytes / mib:.2f} MiB")
        return (
            f"the budget {spec!r} is {spec} of this forward-only program's own unplanned peak ({unplanned_peak_bytes / mib:.2f} "
            f"MiB, so {nbytes / mib:.2f} MiB): no training program was planned before it (once one is, forward-only "
            "programs take a training program's bytes)"
        )

    def copy(self) -> BudgetResolution:
        return BudgetResolution(self.budget, self.nbytes, auto=dict(self.auto) if self.auto else None,
                                trained=self.trained, largest=self.largest)

    def __repr__(self) -> str:
        return (f"BudgetResolution({self.budget}, nbytes={self.nbytes}, trained={len(self.trained)} signatures, "
                f"largest={self.largest})")


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

    def lender(self, training: bool) -> tuple[str, dict] | None:
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
