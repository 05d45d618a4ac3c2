"""The optimizer's part of a training step in its plan (issue 36, `optimize(..., optimizer=opt)`).

Its state is on the device the whole step from the first one on (torch creates it lazily at the first
`opt.step()`, which a plan must already fit): each state tensor is a constant of the problem, as the module's
state the program does not read is. The update after the backward (the user's `opt.step()`) holds what the
step ends with (parameters, gradients, state, kept outputs) plus the update's temporaries, which foreach
kernels make for a whole list at once: measured once on small CPU replicas, then checked against the budget.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from .._torch import unset_fake_temporarily
from ..costs.measure import measure_peak
from ..optim import state_sizes
from ..solvers import BudgetInfeasibleError
from ..solvers.model.problem import Problem, TensorKind
from .errors import mib

def optimizer_state(optimizer: Optimizer, device: torch.device,
                    names: Iterable[tuple[str, torch.Tensor]] = ()) -> list[tuple[str, int]]:
    """(name, bytes) of each state tensor `optimizer` holds (or will hold after its first step) on `device`,
    one allocation each; `names`: the module's named parameters, to name them."""
    named = {id(p): n for n, p in names}
    out: list[tuple[str, int]] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen or p.device.type != device.type or device.index not in (None, p.device.index):
                continue
            seen.add(id(p))
            name = named.get(id(p), f"parameter {len(seen) - 1}")
            out += [(f"{name} state {i}", b) for i, b in enumerate(state_sizes(optimizer, p))]
    return out


REPLICA_BYTES = 2**20  # the update's temporaries are measured on CPU replicas of at most this many bytes in all


def update_scratch_bytes(optimizer: Optimizer, params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes of temporaries one `opt.step()` over `params` (default: all with requires_grad) allocates beyond
    the parameters, gradients and state. Measured on small CPU replicas (each parameter shrunk by one factor,
    so the replicas, their gradients, state and temporaries take about REPLICA_BYTES: planning never holds
    more than that, whatever the model) and scaled back up: foreach kernels make one temporary per parameter
    of its size, so the total scales with the parameters (per-tensor constants scaled too: an overcount).
    Real tensors even while planning runs under fake ones; cached per optimizer type, flags and parameter layout."""
    chosen = None if params is None else {id(p) for p in params}
    groups = [[p for p in g["params"] if p.requires_grad and (chosen is None or id(p) in chosen)]
              for g in optimizer.param_groups]
    flags = tuple((g.get("foreach"), g.get("fused"), g.get("momentum"), g.get("amsgrad")) for g in optimizer.param_groups)
    key = (type(optimizer), flags, tuple(tuple((tuple(p.shape), p.dtype) for p in ps) for ps in groups))
    if key not in _scratch:
        with unset_fake_temporarily():
            _scratch[key] = _measured_scratch(optimizer, groups)
    return _scratch[key]


_scratch: dict[tuple, int] = {}


def _measured_scratch(optimizer: Optimizer, params: list[list[torch.Tensor]]) -> int:
    total = sum(p.numel() * p.element_size() for ps in params for p in ps)
    if not total:
        return 0
    shrink = max(1, -(-total // REPLICA_BYTES))
    groups = []
    for group, ps in zip(optimizer.param_groups, params):
        if ps:
            replicas = [torch.zeros(max(1, p.numel() // shrink), dtype=p.dtype, requires_grad=True) for p in ps]
            for r in replicas:
                r.grad = torch.zeros_like(r)
            # on the CPU: `capturable` needs the parameters on a GPU (its effect on temporaries is a few scalars)
            groups.append({**group, "params": replicas, **({"capturable": False} if "capturable" in group else {})})
    replica = type(optimizer)(groups)
    replica.step()  # the state, as the user's first step makes it
    return shrink * measure_peak(replica.step, "cpu").peak_bytes


def end_bytes(problem: Problem) -> int:
    """What the planned program holds when it returns: the step's inputs and constants (the optimizer's state
    included) and what it hands the caller (gradients, kept outputs)."""
    return sum(t.bytes for t in problem.tensors if t.kind is TensorKind.INPUT or t.id in problem.outputs)


def check_update_fits(problem: Problem, budget_bytes: int | None, scratch_bytes: int, optimizer: Optimizer) -> int:
    """The peak of the update after the backward (`end_bytes` + its temporaries); BudgetInfeasibleError naming
    the optimizer when it is over `budget_bytes` (no plan of the program can lower it)."""
    peak = end_bytes(problem) + scratch_bytes
    if budget_bytes is not None and peak > budget_bytes:
        name = type(optimizer).__name__
        raise BudgetInfeasibleError(
            budget_bytes, peak, peak, searched=False,
            summary=f"{name}.step() after the backward needs {mib(peak)} (parameters, gradients, "
                    f"{name}'s state and {mib(scratch_bytes)} of its temporaries) and the budget is "
                    f"{mib(budget_bytes)}: raise the budget (updates inside the backward, which free each "
                    "gradient early, are not planned yet)")
    return peak
