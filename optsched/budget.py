"""Parse memory budgets (bytes, sizes with units, or a share of the unplanned peak) and the planning
options `optimize` and `plan_offline` share."""

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
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")


@dataclass(frozen=True)
class Budget:
    """Either absolute bytes or a fraction of the unplanned program's peak (None: no budget)."""

    spec: object
    nbytes: int | None = None
    fraction: float | None = None

    def resolve(self, unplanned_peak_bytes: int) -> int | None:
        if self.fraction is not None:
            return int(self.fraction * unplanned_peak_bytes)
        return self.nbytes

    def __str__(self) -> str:
        return "none" if self.spec is None else str(self.spec)


def parse_budget(spec: object, name: str = "mem_budget", of: str = "the unplanned peak") -> Budget:
    """Parse a budget; raise ValueError naming the argument and the accepted forms.

    `of`: what a percentage is a share of, for the error messages."""
    forms = _FORMS.replace("the unplanned peak", of)
    if spec is None:
        return Budget(None)
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
    mem_budget: object, host_budget: object, offload: object, executor: object, time_limit_s: object
) -> tuple[Budget, Budget]:
    """Check the options `optimize` and `plan_offline` share, with the same messages; returns the
    device budget and the host budget."""
    from .executors import NAMES as executors  # torch-free

    budget = parse_budget(mem_budget)
    host = parse_budget(host_budget, name="host_budget", of="this machine's physical memory")
    if offload is not None and not isinstance(offload, bool):
        raise ValueError(f"offload must be None (automatic), True or False, got {offload!r}")
    if executor is not None and (not isinstance(executor, str) or executor.lower() not in executors):
        raise ValueError(f"unknown executor {executor!r}; known: {', '.join(executors)}")
    positive_number = isinstance(time_limit_s, (int, float)) and not isinstance(time_limit_s, bool) and time_limit_s > 0
    if time_limit_s is not None and not positive_number:
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    return budget, host


THIS_PROGRAM = "this program"
FIRST_TRAINING_PROGRAM = "the first training program"


class BudgetResolution:
    """A budget as one optimized callable means it, shared by all the programs it compiles (every
    input shape, grad mode and train/eval mode) and carried by its copies.

    A percentage is resolved once, against the unplanned peak of the first training program planned
    (forward+backward); from then on it means those bytes for every program. A forward-only program
    planned before any training program takes the percentage of its own unplanned peak, and that
    does not fix the bytes. Budgets in bytes (and no budget) need no resolving."""

    def __init__(self, budget: Budget, nbytes: int | None = None, reference: dict | None = None):
        self.budget = budget
        self.nbytes = nbytes  # the resolved bytes of a percentage, once a training program fixed them
        self.reference = reference  # that program: {"unplanned_peak_bytes", "fingerprint"}

    @property
    def is_percentage(self) -> bool:
        return self.budget.fraction is not None

    @property
    def resolved(self) -> bool:
        return self.nbytes is not None

    def bytes_for(self, unplanned_peak_bytes: int) -> int | None:
        """The budget of a program with this unplanned peak."""
        if self.budget.fraction is None:
            return self.budget.nbytes
        return self.nbytes if self.nbytes is not None else self.budget.resolve(unplanned_peak_bytes)

    def source(self, unplanned_peak_bytes: int, fingerprint: str | None = None) -> dict | None:
        """How a program with this unplanned peak gets its bytes (Plan.budget_from), None unless a percentage:
        the program the percentage is taken of (which, its unplanned peak, its fingerprint hash) and the bytes."""
        if self.budget.fraction is None:
            return None
        if self.reference is not None:
            return {"program": FIRST_TRAINING_PROGRAM, **self.reference, "bytes": self.nbytes}
        return {"program": THIS_PROGRAM, "unplanned_peak_bytes": unplanned_peak_bytes, "fingerprint": fingerprint,
                "bytes": self.budget.resolve(unplanned_peak_bytes)}

    def made_for(self) -> dict:
        """What a plan file must have been made for, beyond the budget's spec, to be reused now: the
        resolved bytes once they are fixed; before, a percentage of the program's own peak (which the
        fingerprint and the spec determine)."""
        if self.budget.fraction is None:
            return {}
        if self.nbytes is not None:
            return {"budget_resolved_bytes": self.nbytes}
        return {"budget_from": THIS_PROGRAM}

    def fix(self, nbytes: int, unplanned_peak_bytes: int, fingerprint: str | None) -> None:
        """A training program was planned with `nbytes`: the first one fixes a percentage's bytes."""
        if self.budget.fraction is not None and self.nbytes is None:
            self.nbytes = nbytes
            self.reference = {"unplanned_peak_bytes": unplanned_peak_bytes, "fingerprint": fingerprint}

    def explain(self) -> str:
        """For error messages: where the bytes of a fixed percentage came from."""
        ref = self.reference or {}
        mib = 2**20
        return (
            f"the budget {self.budget.spec!r} was resolved from the first training program this callable planned "
            f"({self.budget.spec} of its unplanned peak of {ref.get('unplanned_peak_bytes', 0) / mib:.2f} MiB = "
            f"{(self.nbytes or 0) / mib:.2f} MiB) and means those bytes for every later program"
        )

    def copy(self) -> BudgetResolution:
        return BudgetResolution(self.budget, self.nbytes, dict(self.reference) if self.reference else None)

    def __repr__(self) -> str:
        return f"BudgetResolution({self.budget}, nbytes={self.nbytes}, reference={self.reference})"
