"""What the caller does with a training step's outputs, which decides memory the program cannot see.

AOTAutograd runs the model as one autograd function. Two things about its outputs are up to the
caller, not the model:

- **whether a gradient flows into an output.** `model(ids, labels=ids).loss.backward()` uses the
  loss only; logits and key/value caches get no gradient. By default the autograd engine then
  hands the backward a full-size tensor of zeros per such output (10-24% of a small LM's peak);
  eager autograd never makes it. We turn that off (`release_unused_grads`) and the backward reads a
  zero broadcast from one element instead, made at each op that reads it (`zeros_if_missing`):
  same values, no memory.
- **how long the caller holds an output.** `out = model(x); loss_fn(out, y).backward()` keeps `out`
  through the backward; `loss_fn(model(x), y).backward()` drops it as soon as the loss is made.

The plan is made on a guess (`default_usage`): only scalar outputs get gradients when there is a
differentiable scalar (a loss), else the outputs no forward op reads (logits, not the key/value cache
the model also returns; `final_outputs`); and the caller holds none of them through the backward
(`loss_fn(model(x), y).backward()`: the loss's graph keeps what the loss saves, cross-entropy its
log-softmax, not the output), so the first plan, its budget's reference and its bound are those of the
step as it runs there. Each backward observes what the caller really did
(`UsageObserver`); when that differs from the plan's guess, the next call plans again with the
observed usage, so from the second step on the plan follows the caller. A caller that holds an output
the plan assumed dropped (`out = model(x); loss_fn(out, y).backward()`) runs that first step up to the
output's bytes above the prediction: the warning (`warn_if_underplanned`) gives the planned schedule's
peak with the outputs held, simulated, against the budget.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import COMPILED_FUNCTION_BACKWARD, PLAIN_AOT_OUTPUT, tree_leaves
from ..solvers.model.problem import Phase
from .joint_graph import JointGraph


@dataclass(frozen=True)
class OutputUsage:
    """Per forward output of the captured program (AOTAutograd's order)."""

    grad: tuple[bool, ...]  # a gradient flows into it in the backward
    held: tuple[bool, ...]  # the caller still holds it when the backward starts

    def describe(self) -> str:
        return ",".join(("g" if g else "-") + ("h" if h else "-") for g, h in zip(self.grad, self.held))

    def union(self, other: OutputUsage | None) -> OutputUsage:
        """Everything either saw: a gradient into an output, or an output held, in one step or another."""
        if other is None or len(other.grad) != len(self.grad):
            return self
        return OutputUsage(tuple(a or b for a, b in zip(self.grad, other.grad)), tuple(a or b for a, b in zip(self.held, other.held)))

    @classmethod
    def parse(cls, text: str) -> OutputUsage:
        parts = [p for p in text.split(",") if p]
        return cls(tuple(p[0] == "g" for p in parts), tuple(p[1] == "h" for p in parts))


def tangent_outputs(joint: fx.GraphModule, tangents: list[fx.Node]) -> list[int | None]:
    """For each tangent placeholder, the index of the forward output it is the gradient of
    (None for a tangent of something else, e.g. a mutated input)."""
    out = []
    for t in tangents:
        desc = t.meta.get("desc")
        idx = getattr(getattr(desc, "output", None), "idx", None)
        out.append(idx if isinstance(idx, int) and type(desc.output).__name__ == PLAIN_AOT_OUTPUT else None)
    return out


def default_usage(jg: JointGraph, tangent_of: list[int | None]) -> OutputUsage:
    """The plan's guess before any backward was seen (see the module docstring): gradients into the loss, else
    into the step's final outputs (`final_outputs`), else into every differentiable output; nothing held but a
    scalar loss (whose hold no plan feels)."""
    fw_outputs = jg.fw_outputs
    n = len(fw_outputs)
    differentiable = {i for i in tangent_of if i is not None}

    def is_scalar(i: int) -> bool:
        v = fw_outputs[i].meta.get("val") if isinstance(fw_outputs[i], fx.Node) else None
        return isinstance(v, torch.Tensor) and v.dim() == 0

    scalars = {i for i in differentiable if is_scalar(i)}
    wanted = scalars or (differentiable & final_outputs(jg)) or differentiable
    grad = tuple(i in wanted for i in range(n))
    return OutputUsage(grad, tuple(g and i in scalars for i, g in enumerate(grad)))


def final_outputs(jg: JointGraph) -> set[int]:
    """The forward outputs no forward op reads: what the model computes last (logits), as against the intermediates
    it also hands out (a key/value cache, a hidden state its head reads). A loss outside the model is computed from
    those; guessing that gradients flow into the intermediates too planned a tangent and a caller's loss for each
    (Hugging Face models return their key/value cache by default): 1.9x the bound of the step the caller runs, and
    a first call refused at budgets that step fits, with no backward ever run to correct the guess. A caller that
    does differentiate an intermediate (a VAE's mean and variance) gets its first step warned and the next planned
    for it (`warn_if_underplanned`); its gradients are right either way (`zeros_if_missing`)."""
    read = {s for n in jg.compute if jg.phase.get(n) is Phase.FW
            for s in jg.arg_storages(n) if s not in jg.outputs_of.get(n, ())}
    return {i for i, o in enumerate(jg.fw_outputs)
            if isinstance(o, fx.Node) and not read.intersection(jg.node_storages(o))}


class UsageObserver:
    """Watches one compiled program's outputs between its forward and its backward.

    `forward_done` keeps weak references to the tensors the forward returned; for a view output (which
    AOTAutograd hands the caller as a new tensor over our storage) `bind_visible` takes the caller's tensor
    instead. `backward_start` reads which tangents arrived and which outputs are still alive (`backward_done`
    those the backward itself holds), and reports a usage that differs from the plan's through `on_change`
    (once per program: the next call re-plans)."""

    def __init__(
        self, planned: OutputUsage, tangent_of: list[int | None], on_change: Callable[..., None] | None,
        scalar: list[bool] | None = None, views: list[bool] | None = None,
        peak_of: Callable[[OutputUsage], SeenPeak | None] | None = None,
    ):
        n = len(planned.grad)
        self.planned = planned
        self.tangent_of = tangent_of
        self.on_change = on_change  # on_change(seen, planned, peak): peak from `peak_of` (None without it)
        self.peak_of = peak_of  # the plan's peak with the outputs used as seen (see SeenPeak)
        self.scalar = scalar or [False] * n  # whether a 0-dim scalar is held changes no plan: not observed
        self.views = views or [False] * n
        self.refs: list[weakref.ref | None] = []
        self.storages: list[int | None] = []
        self.bound = [False] * n
        self.reported = False
        self.n_outputs = n
        self.pending: tuple[list[bool], list[bool], list[bool]] | None = None  # a check left for backward_done

    def forward_done(self, outputs: list, n_fw_outputs: int) -> None:
        outs = outputs[:n_fw_outputs]
        self.refs = [weakref.ref(o) if isinstance(o, torch.Tensor) else None for o in outs]
        self.storages = [o.untyped_storage().data_ptr() if isinstance(o, torch.Tensor) else None for o in outs]
        self.bound = [False] * self.n_outputs

    def bind_visible(self, outputs) -> None:
        """The caller's own tensors for view outputs: the leaf of what the call returned over the same storage."""
        pending = {self.storages[i]: i for i in range(min(len(self.storages), self.n_outputs))
                   if self.views[i] and not self.bound[i] and self.storages[i] is not None}
        if not pending:
            return
        for t in tree_leaves(outputs):
            if isinstance(t, torch.Tensor) and (i := pending.pop(t.untyped_storage().data_ptr(), None)) is not None:
                self.refs[i], self.bound[i] = weakref.ref(t), True

    def backward_start(self, tangents: list, saved: list | None = None) -> None:
        """Which tangents arrived, and which outputs the caller still holds. `saved`: the backward's arguments.
        An output the backward also reads may be that very tensor (autograd saves an output no gradient flows
        into as the original, e.g. a frozen layer's key/value cache), so it is alive whatever the caller did:
        such an output is looked at again once the backward is done (`backward_done`), when only the caller
        can still hold it."""
        self.pending = None
        if self.reported or self.on_change is None or not self.refs:
            return
        grad = [False] * len(self.planned.grad)
        for t, i in zip(tangents, self.tangent_of):
            if i is not None and t is not None:
                grad[i] = True
        ours = {id(a) for a in saved or () if isinstance(a, torch.Tensor)}
        alive = [r() if r is not None else None for r in self.refs]
        deferred = [t is not None and id(t) in ours for t in alive]
        held = [t is not None and not d for t, d in zip(alive, deferred)]
        del alive  # no strong reference past this point: the backward frees what it reads
        if any(deferred):
            self.pending = (grad, held, deferred)
        else:
            self._report(grad, held)

    def backward_done(self) -> None:
        """After the backward ran: outputs it read as its own arguments are held if something still holds them."""
        if self.pending is None:
            return
        grad, held, deferred = self.pending
        self.pending = None
        held = [h or (d and r is not None and r() is not None) for h, d, r in zip(held, deferred, self.refs)]
        self._report(grad, held)

    def _report(self, grad: list[bool], held: list[bool]) -> None:
        held = held + [False] * (len(grad) - len(held))
        unseen = [s or (v and not b) for s, v, b in zip(self.scalar, self.views, self.bound)]
        held = [self.planned.held[i] if unseen[i] else h for i, h in enumerate(held[: len(grad)])]
        seen = OutputUsage(tuple(grad), tuple(held))
        if seen != self.planned:
            self.reported = True
            self.on_change(seen, self.planned, self.peak_of(seen) if self.peak_of is not None else None)


class OutputUsageWarning(UserWarning):
    """A step used its outputs in a way that needs more memory than its plan assumed."""


@dataclass(frozen=True)
class SeenPeak:
    """A plan's schedule simulated with the outputs used as the caller was seen to (a held output live to the
    step's end): the peak that step had, against the plan's prediction and budget."""

    peak_bytes: int
    predicted_bytes: int
    budget_bytes: int | None

    def describe(self) -> str:
        mib = 2**20
        text = f"with them so used its plan peaks at {self.peak_bytes / mib:.2f} MiB (predicted {self.predicted_bytes / mib:.2f} MiB"
        if self.budget_bytes is None:
            return text + ")"
        where = "within" if self.peak_bytes <= self.budget_bytes else "over"
        return text + f"; {where} the budget {self.budget_bytes / mib:.2f} MiB)"


def warn_if_underplanned(seen: OutputUsage, planned: OutputUsage, budgeted: bool, peak: SeenPeak | None = None) -> None:
    """A gradient into an output the plan thought gets none, or an output held that it thought dropped:
    this step may have gone above its predicted peak (`peak`: by how much, when known; the next call plans
    for it). Said once per program, and only when there is a budget to go over."""
    more = [i for i, (g, h, pg, ph) in enumerate(zip(seen.grad, seen.held, planned.grad, planned.held)) if (g and not pg) or (h and not ph)]
    if budgeted and more:
        warnings.warn(
            f"optsched: forward output(s) {more} were used in a way this step's plan did not assume "
            f"(planned {planned.describe()!r}, seen {seen.describe()!r}: g = a gradient flows in, h = held through "
            "the backward), so this step may have gone above its predicted peak"
            + (f": {peak.describe()}" if peak is not None else "")
            + "; the next call plans for it",
            OutputUsageWarning, stacklevel=2,
        )


def release_unused_grads(outputs) -> list:
    """Let the compiled backward receive None for outputs no gradient flowed into (instead of the
    full-size zeros autograd makes by default). Call on what an optimized call returned. Returns the
    compiled function's autograd nodes it found."""
    seen: set[int] = set()
    found = []
    for t in tree_leaves(outputs):
        if not isinstance(t, torch.Tensor) or t.grad_fn is None:
            continue
        stack = [t.grad_fn]
        for _ in range(4):  # the compiled function's node, or the view node AOTAutograd put on top of it
            if not stack:
                break
            node = stack.pop()
            if id(node) in seen:
                break
            seen.add(id(node))
            if type(node).__name__ == COMPILED_FUNCTION_BACKWARD:
                node.set_materialize_grads(False)
                found.append(node)
                break
            stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


def zeros_if_missing(tangent: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """`tangent`, or where it arrived as None, zeros broadcast from one element: the values autograd would
    have made, without their memory. Called just before each op that reads the tangent, so the element lives
    only while that op runs."""
    if tangent is not None:
        return tangent
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


__all__ = [
    "OutputUsage", "OutputUsageWarning", "SeenPeak", "UsageObserver", "default_usage",
    "release_unused_grads", "tangent_outputs", "warn_if_underplanned", "zeros_if_missing",
]
