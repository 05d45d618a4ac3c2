"""The torch.compile backend: AOTAutograd hands us the graph, the planner plans it, we return our programs.

Only the compile hooks live here: the partition hook (training: the joint forward+backward graph) and
the inference compiler (forward only) hand their graph to a `planning.Planner` and lower the graph it planned; the
forward and backward wrappers observe what the caller does with the outputs (`output_usage`).
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.fx as fx

from .._torch import TracingContext, aot_autograd, unset_fake_temporarily
from ..budget import BudgetResolution
from ..costs.measure import device_of
from ..lower.offload_runtime import OffloadDeviceError, OffloadRuntime, SlotSpec
from ..lower.programs import boxed, lower_inference, lower_training
from ..passes.prepare import prepare_inference, prepare_training
from ..planning import Planner, ProgramKind, Target
from ..costs.cost_cache import CostCache
from ..plans.file_format import PlanFile
from ..plans.plan import Plan
from ..settings import PlanningSettings
from ..capture.errors import check_static_sizes
from ..capture.joint_graph import build_joint_graph
from ..capture.output_usage import (
    OutputUsage, SeenPeak, UsageObserver, default_usage, tangent_outputs,
)
from ..solvers import simulate
from ..capture.tangent_handover import TangentHandover, can_hand_over


def _scalar_outputs(jg) -> list[bool]:
    return [isinstance(o, fx.Node) and isinstance(v := o.meta.get("val"), torch.Tensor) and v.dim() == 0 for o in jg.fw_outputs]


def _view_outputs(jg) -> list[bool]:
    """Forward outputs AOTAutograd hands out as views it makes anew over our storage (the caller holds a
    tensor we never see). `_unsafe_view` results (a linear layer's 3-d output) go out as they are."""
    return [isinstance(o, fx.Node) and jg.is_view(o) and o.target is not torch.ops.aten._unsafe_view.default
            for o in jg.fw_outputs]


def _peak_as_seen(plan: Plan, jg) -> Callable[[OutputUsage], SeenPeak | None]:
    """For a usage the observer saw: the plan's schedule simulated with the outputs it saw held live to the
    step's end (what that step peaked at). None when a gradient came that the plan did not expect (the
    caller's loss is then unknown) or nothing more is held."""
    storages = [jg.node_storages(o) if isinstance(o, fx.Node) else () for o in jg.fw_outputs]

    def peak(seen: OutputUsage) -> SeenPeak | None:
        problem = plan.problem
        planned = OutputUsage.parse(plan.output_usage or "")
        held = {s for i, h in enumerate(seen.held[: len(storages)]) if h for s in storages[i]} - problem.outputs
        if any(g and not p for g, p in zip(seen.grad, planned.grad)) or not held:
            return None
        return SeenPeak(simulate(problem.holding(held), plan.schedule).peak_bytes, plan.predicted_peak_bytes,
                        plan.budget_bytes)

    return peak


class CompileHooks(Protocol):
    """What AOTAutograd calls while it compiles a captured program, as methods of one object.

    Training: `partition(joint, joint_inputs, num_fwd_outputs=...)` gets the joint forward+backward
    graph and returns the forward and backward graphs; AOTAutograd then hands those to
    `compile_forward` and `compile_backward`, which return what runs (a backward may be compiled at
    its first call). Forward only (under `torch.no_grad()`): `compile_inference` gets the forward graph
    and returns what runs. `aot_hooks` passes them to `aot_autograd` / `aot_module_simplified`.

    `PlanningBackend` plans in `partition` and `compile_inference` and returns the planned programs;
    `compiler.offline.OfflineBackend` plans there too and returns programs that only refuse to run."""

    def partition(
        self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs
    ) -> tuple[fx.GraphModule, fx.GraphModule]: ...

    def compile_forward(self, gm: fx.GraphModule, example_inputs) -> Callable: ...

    def compile_backward(self, gm: fx.GraphModule, example_inputs) -> Callable: ...

    def compile_inference(self, gm: fx.GraphModule, example_inputs) -> Callable: ...


def aot_hooks(hooks: CompileHooks) -> dict:
    """`hooks` as AOTAutograd's keyword arguments (input mutations of forward-only programs kept in
    the graph, as `passes/prepare.prepare_inference` expects)."""
    return dict(
        fw_compiler=hooks.compile_forward,
        bw_compiler=hooks.compile_backward,
        inference_compiler=hooks.compile_inference,
        partition_fn=hooks.partition,
        keep_inference_input_mutations=True,
    )


class PlanningBackend:
    """One per input signature of an optimized callable. Every (re)compilation plans its graph and reports the plan.

    Dynamo may compile several variants of one signature (a guard on a module flag, a global, a
    parameter's requires_grad) and later run any of them again. Each compile therefore gets its own
    copy of these hooks (`variant`: its planner, plan, gradient hand-over and usage observer), and each
    variant's forward records itself in `ran`, so the caller attaches the hand-over of the program that
    actually ran and reports its plan.

    `settings`: optimize()'s options. `resolution`: the budget as the optimized callable means it, shared
    by all its backends. `carried`: plans a copy of an optimized module replays. `usage`: what the caller
    was seen doing with the outputs (None: output_usage.default_usage's guess), and `on_usage` hears when
    a backward shows otherwise (the next call then plans with what was seen)."""

    def __init__(
        self,
        settings: PlanningSettings,
        on_plan: Callable[[Plan], None],
        *,
        usage: OutputUsage | None = None,
        on_usage: Callable[[OutputUsage, OutputUsage], None] | None = None,
        resolution: BudgetResolution | None = None,
        carried: dict[str, list[PlanFile]] | None = None,
        grads_at_start: bool = False,
        cost_cache: CostCache | None = None,
        state: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
        first_micro_batch: Callable[[], Plan | None] | None = None,
    ):
        self.settings = settings
        self.state = state  # the module's named parameters and buffers (see Planner.hold_inputs)
        self.cost_cache = cost_cache  # measured op costs shared with the optimized callable's other programs
        self.grads_at_start = grads_at_start  # an accumulation step: gradients live from the start (api.grads_at_start)
        self.first_micro_batch = first_micro_batch  # its plan without gradients to start with (Planner.first_micro_batch)
        self.on_plan = on_plan
        self.resolution = resolution if resolution is not None else BudgetResolution(settings.budget)
        self.carried = carried or {}
        self.usage = usage
        self.on_usage = on_usage
        self.observer: UsageObserver | None = None
        self.handover: TangentHandover | None = None  # output gradients taken from the engine (tangent_handover)
        self.planner: Planner | None = None  # made when the graph (and so the device) is known
        self.plan: Plan | None = None  # this variant's plan
        self.ran: PlanningBackend | None = None  # the variant whose forward ran last (set on the signature's backend)
        self._signature_backend: Callable[[], PlanningBackend | None] = lambda: None  # a variant's (weakly)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        check_static_sizes(gm)  # data-dependent sizes: a CaptureError before any planning code sees them
        variant = self.variant()
        target = Target.for_device(self.settings, device_of(example_inputs) or torch.device("cpu"))
        variant.planner = Planner(
            self.settings, target, variant._on_plan, resolution=self.resolution, carried=self.carried,
            observed_usage=self.usage, grads_at_start=self.grads_at_start, cost_cache=self.cost_cache,
            first_micro_batch=self.first_micro_batch,
        )
        variant.planner.hold_inputs(list(example_inputs), self.state() if self.state is not None else ())
        return aot_autograd(**aot_hooks(variant))(gm, example_inputs)

    def variant(self) -> PlanningBackend:
        """Hooks of one compile of this signature: the same settings and callbacks, its own planner, plan,
        hand-over and observer (a backward is compiled at its first call, maybe after other variants)."""
        variant = copy.copy(self)
        variant.planner = variant.plan = variant.handover = variant.observer = variant.ran = None
        variant._signature_backend = weakref.ref(self)  # weak: this backend holds the variant that ran
        return variant

    def _on_plan(self, plan: Plan) -> None:
        self.plan = plan
        self.on_plan(plan)

    def _ran(self) -> None:
        backend = self._signature_backend()
        if backend is not None:
            backend.ran = self

    @property
    def target(self) -> Target:
        return self.planner.target

    # ---- the compile hooks (CompileHooks)

    def compile_forward(self, gm: fx.GraphModule, example_inputs):
        """The planned forward, saying that this variant ran and telling the usage observer what the caller was handed."""
        _no_donated_buffers()
        return recording_forward(boxed(gm), self._ran, self.observer)

    def compile_backward(self, gm: fx.GraphModule, example_inputs):
        """The backward, taking None for an output no gradient flowed into (see output_usage)."""
        return observed_backward(gm, self.observer, self.handover)

    def partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_kwargs):
        """Plan the training step and lower it: the planned forward and backward."""
        prepare_training(joint)  # dropout(p=0), in-place activations, BatchNorm: what eager never keeps
        self.handover = _tangent_handover(joint, num_fwd_outputs)
        jg = build_joint_graph(joint, num_fwd_outputs, freed_tangents=self.handover is not None)
        usage, tangent_of = self._training_usage(joint, jg)
        planned = self.planner.plan(joint, jg, ProgramKind.TRAINING, usage)
        plan, jg = planned.plan, planned.graph  # the graph planned: a chunked copy of the joint graph, maybe
        self.observer = _usage_observer(plan, jg, tangent_of, self.on_usage)
        fw, bw, _saved = lower_training(jg, plan.problem, planned.items, plan.schedule, plan.sim.reused,
                                        plan.sim.offloads, functools.partial(offload_runtime, self.target))
        return fw, bw

    def _training_usage(self, joint: fx.GraphModule, jg) -> tuple[OutputUsage, list[int | None]]:
        """The output usage to plan with (the observed one, else the guess), and each tangent's output."""
        tangent_of = tangent_outputs(joint, jg.tangents)
        if self.usage is not None and len(self.usage.grad) == len(jg.fw_outputs):
            return self.usage, tangent_of
        return default_usage(jg, tangent_of), tangent_of

    def compile_inference(self, gm: fx.GraphModule, example_inputs):
        """Plan a forward-only program (its passes first) and lower it."""
        prepare_inference(gm, split_foreach=self.target.executor.fuses_writes)
        jg = build_joint_graph(gm, None)
        planned = self.planner.plan(gm, jg, ProgramKind.FORWARD)
        plan = planned.plan
        return recording_forward(boxed(lower_inference(planned.graph, planned.items, plan.schedule, plan.sim.reused)),
                                 self._ran)


# ---- the programs' wrappers and parts of the hooks, apart from the backend that holds them


def _no_donated_buffers() -> None:
    """No donated buffers for the forward being compiled: our backward frees (and may write into) saved tensors
    itself, and refuses a kept graph with its own error (lower.programs.KeptGraphError), which AOTAutograd's
    donated-buffer check would pre-empt."""
    context = TracingContext.try_get()
    if context is not None and context.fw_metadata is not None:
        context.fw_metadata.bw_donated_idxs = []


def recording_forward(run: Callable, ran: Callable[[], None], observer: UsageObserver | None = None) -> Callable:
    """The boxed forward `run`, calling `ran` first (the variant that ran) and telling `observer` what the caller
    was handed."""
    n_outputs = observer.n_outputs if observer is not None else 0

    def forward(args: list):
        ran()
        out = run(args)
        if observer is not None:
            observer.forward_done(out, n_outputs)
        return out

    forward._boxed_call = True  # type: ignore[attr-defined]
    forward.graph_module = getattr(run, "graph_module", None)  # type: ignore[attr-defined]
    return forward


def observed_backward(gm: fx.GraphModule, observer: UsageObserver | None, handover: TangentHandover | None) -> Callable:
    """The boxed backward `gm`, given the output gradients `handover` took from the engine, and telling `observer`
    which came (None where no gradient flowed: see output_usage)."""
    run = boxed(gm)
    positions = [(i, n.meta["val"]) for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))
                 if n.name.startswith("tangents")]
    if handover is not None and len(positions) != len(handover.tangent_of):  # pragma: no cover
        raise RuntimeError(f"the lowered backward has {len(positions)} tangents, the joint graph {len(handover.tangent_of)}")

    def backward(args: list):
        if handover is not None:
            handover.give(args, positions)  # the gradients the engine's pre-hook took (tangent_handover)
        tangents = [args[i] for i, _meta in positions]  # None where no gradient came (zeros_if_missing)
        if observer is None:
            del tangents
            return run(args)
        observer.backward_start(tangents, args)  # args: an output the backward reads may be the caller's tensor
        del tangents
        grads = run(args)
        observer.backward_done()
        return grads

    backward._boxed_call = True  # type: ignore[attr-defined]
    return backward


def _tangent_handover(joint: fx.GraphModule, num_fwd_outputs: int) -> TangentHandover | None:
    """The hand-over of output gradients from the engine to the backward, where the joint graph allows it."""
    tangent_of = tangent_outputs(joint, [p for p in joint.graph.find_nodes(op="placeholder") if "tangents" in p.name])
    return TangentHandover(num_fwd_outputs, tangent_of) if can_hand_over(joint, num_fwd_outputs, tangent_of) else None


def _usage_observer(plan: Plan, jg, tangent_of: list[int | None], on_usage: Callable | None) -> UsageObserver:
    """The observer of what the caller does with the planned program's outputs (planned for `plan.output_usage`)."""
    return UsageObserver(OutputUsage.parse(plan.output_usage), tangent_of, on_usage, _scalar_outputs(jg),
                         _view_outputs(jg), _peak_as_seen(plan, jg))


def offload_runtime(target: Target, slots: list[SlotSpec]) -> OffloadRuntime:
    """The host pool and copy queues of a plan's offloads on `target`: real and allocated now, while partitioning
    runs under fake tensors, not in a step."""
    with unset_fake_temporarily():
        try:
            return OffloadRuntime(slots, target.device, planned_for=target.profile.device_type)
        except OffloadDeviceError as e:
            raise OffloadDeviceError(f"device profile {target.profile.name!r}: {e}") from None
