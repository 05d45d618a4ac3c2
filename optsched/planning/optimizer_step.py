"""The optimizer's part of a training step in its plan (issue 36, `optimize(..., optimizer=opt)`).

Its state is on the device the whole step from the first one on (torch creates it lazily at the first
`opt.step()`, which a plan must already fit): each state tensor is a constant of the problem, as the module's
state the program does not read is. The update is a node of the graph (`WholeStep`, optim/in_graph.py): after
the backward (the user's `opt.step()`: it holds what the step ends with plus the update's temporaries, which
foreach kernels make for a whole list at once, measured once on small CPU replicas) or, per parameter, inside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.fx as fx
from torch.optim import Optimizer

from .._torch import unset_fake_temporarily
from ..costs.measure import measure_peak
from ..optim import state_sizes
from ..capture.joint_graph import JointGraph, build_joint_graph
from ..optim import InBackwardUpdates
from ..optim.in_graph import PASSES, UpdateNode, add_updates, is_update
from ..solvers import simulate
from .errors import mib
from ..passes.chunking import copy_graph
from ..solvers.model.problem import Phase, TensorKind

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
    flags = tuple(_options(g) for g in optimizer.param_groups)
    key = (type(optimizer), flags, tuple(tuple((tuple(p.shape), p.dtype) for p in ps) for ps in groups))
    if key not in _scratch:
        with unset_fake_temporarily():
            _scratch[key] = _measured_scratch(optimizer, groups)
    return _scratch[key]


_scratch: dict[tuple, int] = {}
_RATES = ("lr", "initial_lr")  # change between steps (schedulers), never the temporaries


def _options(group: dict) -> tuple:
    """A group's options that may change the update's temporaries (weight decay, nesterov, maximize, foreach, ...):
    all but the parameters and the rates; a tensor option by its kind only."""
    return tuple(sorted((k, ("tensor", v.dtype) if isinstance(v, torch.Tensor) else v) for k, v in group.items()
                        if k != "params" and k not in _RATES and (isinstance(v, torch.Tensor) or _hashable(v))))


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


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


class WholeStep:
    """The optimizer's update in one training program's graph (optim/in_graph.py): after the backward, as the
    user's `opt.step()` makes it (`after_graph`), or each parameter's inside the backward where its gradient is
    final (`in_backward_graph`: offered where the budget is out of reach otherwise). `inputs`: the program's real
    inputs in order (the parameters among them are the optimizer's); `names`: id(parameter) -> its name."""

    def __init__(self, optimizer: Optimizer, updates: InBackwardUpdates | None, inputs: list,
                 names: dict[int, str]):
        self.optimizer, self.updates = optimizer, updates
        mine = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        # primal index -> parameter (the parameters only: the batch's tensors are not kept alive by the plan)
        self.params = {i: v for i, v in enumerate(inputs) if isinstance(v, torch.Tensor) and id(v) in mine}
        self.names = {i: names.get(id(p), f"parameter {i}") for i, p in self.params.items()}
        self.passes = PASSES[type(optimizer).__name__]

    def after_graph(self, gm: fx.GraphModule, jg: JointGraph) -> tuple[fx.GraphModule, JointGraph]:
        """A copy of the program with the update of every parameter after the backward (a no-op when run)."""
        return self._with(gm, jg, [])

    def in_backward_graph(self, gm: fx.GraphModule, jg: JointGraph) -> tuple[fx.GraphModule, JointGraph] | None:
        """A copy of the program with each parameter that can be updated in the backward updated there, the rest
        after it; None when none can (no in-backward updates allowed, or no gradient the backward makes alone)."""
        if self.updates is None:
            return None
        made = [i for i in sorted(self.params) if _own_gradient(jg, i)]
        return self._with(gm, jg, made) if made else None

    def _with(self, gm: fx.GraphModule, jg: JointGraph, inside: list[int]) -> tuple[fx.GraphModule, JointGraph]:
        g = copy_graph(gm)
        nodes = {i: UpdateNode((self.params[i],), (self.names[i],), update_scratch_bytes(self.optimizer, [self.params[i]]),
                               self.passes, self.updates) for i in inside}
        rest = [i for i in sorted(self.params) if i not in nodes and _has_gradient(jg, i)]
        after = None
        if rest:
            ps = [self.params[i] for i in rest]
            after = (rest, UpdateNode(tuple(ps), tuple(self.names[i] for i in rest),
                                      update_scratch_bytes(self.optimizer, ps), self.passes))
        add_updates(g, jg.num_fwd_outputs, nodes, after)
        freed = any(s.kind is TensorKind.TANGENT_FREED for s in jg.storages)
        return g, build_joint_graph(g, jg.num_fwd_outputs, freed_tangents=freed)


def _has_gradient(jg: JointGraph, i: int) -> bool:
    return i < len(jg.bw_outputs) and isinstance(jg.bw_outputs[i], fx.Node)


def _own_gradient(jg: JointGraph, i: int) -> bool:
    """Primal `i`'s gradient (or the view of one) lies in a storage the backward makes and no other output holds:
    freed at its update, nothing else lost."""
    if not _has_gradient(jg, i):
        return False
    storages = jg.node_storages(jg.bw_outputs[i])
    if len(storages) != 1:
        return False
    storage = jg.storages[storages[0]]
    if storage.kind is not TensorKind.ACTIVATION or jg.phase.get(storage.node) is not Phase.BW:
        return False
    others = [o for k, o in enumerate(jg.fw_outputs + jg.bw_outputs) if k != len(jg.fw_outputs) + i]
    return all(not isinstance(o, fx.Node) or storages[0] not in jg.node_storages(o) for o in others)


def warn_when_not_stepping(plan, items: list, budget_bytes: int | None) -> int:
    """The peak of the plan's schedule on a backward that does not step (`step_on_backward = False`: each
    in-backward update hands its gradient back, kept to the end as eager keeps it) and, where that is over
    `budget_bytes`, the warning each update node gives when run so (a micro-batch of an accumulation)."""
    problem = plan.problem
    updates = [(o, item.target) for o, item in enumerate(items)
               if isinstance(item, fx.Node) and is_update(item) and item.target.in_backward]
    kept_grads = {t for o, _ in updates for t in problem.ops[o].inputs
                  if problem.tensors[t].kind is TensorKind.ACTIVATION and t not in problem.ops[o].writes}
    updated = {o for o, _ in updates}
    ops = [dataclasses.replace(op, workspace_bytes=0) if op.id in updated else op for op in problem.ops]
    peak = simulate(dataclasses.replace(problem, ops=ops, outputs=problem.outputs | kept_grads), plan.schedule).peak_bytes
    warning = None
    if budget_bytes is not None and peak > budget_bytes:
        warning = (f"this backward does not step (step_on_backward=False): its gradients stay live to its end, as "
                   f"eager keeps them, and its peak is {mib(peak)}, over the budget of {mib(budget_bytes)} its plan "
                   "(updates inside the backward) was made for; micro-batches that accumulate hold every gradient "
                   "whatever the plan: raise the budget to cover them")
    for _, target in updates:
        target.not_stepping_warning = warning
    return peak
