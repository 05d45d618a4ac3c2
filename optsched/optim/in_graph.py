"""The optimizer's update as nodes of the joint graph, so the planner places it like any op (issue 36).

Two forms, both a call of an `UpdateNode` reading gradients and the parameters it overwrites:

- after the backward (`after_backward`): one node, last, reading every gradient and parameter. It does
  nothing when run: the user's `opt.step()` makes the update. In the problem it holds what that update
  holds: every gradient to the end, plus the update's temporaries (foreach kernels make them for a whole
  list at once), so a plan fits the step including its update.
- in the backward (`in_backward`): one node per parameter, right after its gradient is final and the
  backward's last reader of the parameter ran. Run, it hands the gradient to `InBackwardUpdates.apply`
  (the optimizer's own kernels) and returns None in the gradient's place (the engine then accumulates
  nothing), so the gradient dies at the update. On a micro-batch that does not step
  (`step_on_backward = False`) it returns the gradient untouched, as if no update were planned.

`problem_builder` makes each node an op that writes its parameters (`Op.writes`: nothing reads them after,
a recomputation included) and allocates `scratch_bytes` while it runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from .updates import InBackwardUpdates

# memory passes of an update per parameter byte (reads and writes of the parameter, its gradient and state),
# for its roofline time: Adam/AdamW read p, g, m, v and write p, m, v; SGD is counted with momentum (reads p, g,
# buf, writes p, buf) whether it has one or not (3 without: an overcount)
PASSES = {"Adam": 7, "AdamW": 7, "SGD": 5}
KERNELS = 6  # kernel launches per update call (foreach or not: a few elementwise kernels)


@dataclass(eq=False)
class UpdateNode:
    """The target of an update node. `updates` None: the user's `opt.step()` updates `params` after the backward
    (the node does nothing); else `params` (one parameter) is updated here through `updates`."""

    params: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    scratch_bytes: int
    passes: int
    updates: InBackwardUpdates | None = None
    # set by the planner: the warning a backward that does not step (`step_on_backward = False`) gives, where
    # keeping its gradients to its end takes it over the budget the plan was made for (None: it fits)
    not_stepping_warning: str | None = None
    __name__ = "optimizer_update"  # fx names the call after its target

    @property
    def in_backward(self) -> bool:
        return self.updates is not None

    def time_s(self, mem_bw: float, launch_s: float) -> float:
        """Roofline time of the update: `passes` over the parameters' bytes, and its kernel launches."""
        nbytes = sum(p.numel() * p.element_size() for p in self.params)
        return self.passes * nbytes / mem_bw + KERNELS * launch_s * (1 if self.in_backward else len(self.params))

    def __call__(self, grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        if self.updates is None:
            return None
        (grad,) = grads
        _refuse_data_parallel()
        if not self.updates.step_on_backward:
            if self.not_stepping_warning is not None:
                warnings.warn(self.not_stepping_warning, OverBudgetWarning, stacklevel=2)
            return grad  # a micro-batch that does not step: the engine accumulates the gradient as usual
        (p,) = self.params
        if grad is not None:
            if p.grad is None:
                p.grad = grad
            else:  # the micro-batches before summed into p.grad, as the engine sums: in place
                p.grad.add_(grad)
        self.updates.apply(p)
        return None

    def __repr__(self) -> str:
        where = "in the backward" if self.in_backward else "after the backward"
        return f"optimizer_update({', '.join(self.names[:3])}{', ...' if len(self.names) > 3 else ''}; {where})"


def _refuse_data_parallel() -> None:
    """An update inside the backward takes the gradient before the autograd engine accumulates it, where DDP's
    hooks all-reduce it: under a process group of more than one rank it would update from this rank's gradient
    alone, so it raises instead."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("a plan updates parameters inside the backward under torch.distributed (world size "
                           f"{dist.get_world_size()}): the update would skip the gradients' all-reduce; optimize "
                           "with updates_in_backward=False")


class OverBudgetWarning(UserWarning):
    """A backward runs over the budget its plan was made for (one that does not step, whose plan updates
    parameters inside the backward: it keeps every gradient, as eager does)."""


def is_update(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, UpdateNode)


def add_updates(gm: fx.GraphModule, num_fwd_outputs: int, in_backward: dict[int, UpdateNode],
                after: tuple[list[int], UpdateNode] | None) -> None:
    """Insert into `gm` (a joint graph the caller owns) an update node per primal index in `in_backward` (it takes
    the place of the primal's gradient output) and `after`: (primal indices, node) updated after the backward, a
    last node reading their gradients and parameters. Each in-backward node goes right after the latest of its
    gradient and the backward's readers of the parameter."""
    graph = gm.graph
    primals = [p for p in graph.find_nodes(op="placeholder") if "tangents" not in p.name]
    (out,) = graph.find_nodes(op="output")
    outs = list(out.args[0])
    position = {n: i for i, n in enumerate(graph.nodes)}
    for i, target in sorted(in_backward.items()):
        grad, param = outs[num_fwd_outputs + i], primals[i]
        if not isinstance(grad, fx.Node):
            raise ValueError(f"primal {i} ({param.name}) has no gradient to update it from")
        readers = [u for u in param.users if u.op == "call_function" and position[u] > position[grad]]
        anchor = max([grad, *readers], key=position.__getitem__)
        with graph.inserting_after(anchor):
            node = graph.call_function(target, ([grad], [param]))
        node.meta["val"] = None
        outs[num_fwd_outputs + i] = node
    if after is not None:
        indices, target = after
        grads = [outs[num_fwd_outputs + i] for i in indices if isinstance(outs[num_fwd_outputs + i], fx.Node)]
        with graph.inserting_before(out):
            node = graph.call_function(target, (grads, [primals[i] for i in indices]))
        node.meta["val"] = None
    out.args = (type(out.args[0])(outs),)
    graph.lint()
    gm.recompile()
