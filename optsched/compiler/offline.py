"""Plan a training step for a device this machine does not have, without the model's memory.

`plan_offline(model_factory, inputs_factory, "60%", device_profile="h100")` builds the model
and its example inputs inside a `FakeTensorMode`: every parameter, buffer and input is a
FakeTensor (shape, dtype, strides, no data), so a model of gigabytes costs the planner the
graph and the solver's memory (tens of MiB), not its tensors. The training step (forward, then backward of the scalar the module
returns) is captured by AOTAutograd directly (no Dynamo, no torch.compile), planned with the
named profile's roofline times (fake tensors cannot be timed), and never lowered: there is
nothing to run here. The result is the same `Plan` `optimize` reports, fingerprint included,
so `plan.save(path)` writes a plan file that `optimize(..., plan=path)` can replay on the
device it was made for.

The fake tensors are CPU tensors (AOTAutograd cannot trace the backward of fake CUDA tensors in a
CPU-only build). For a CUDA profile the capture is made to be the GPU's graph anyway: devices do
not enter the fingerprint (optsched.capture.fingerprint), and `scaled_dot_product_attention`, the one op
whose kernel depends on the device, calls the CUDA kernel the profile's GPU is predicted to pick
(`predict_sdpa_backend`: cuDNN, flash, memory-efficient or math attention) instead of the CPU one.
The prediction follows PyTorch's dispatch rules; if the GPU picks otherwise, `optimize` refuses
the plan file with a fingerprint mismatch naming the attention node, never runs it. The normalizations
whose fake kernels branch on the device (LayerNorm's and BatchNorm's saved statistics: the input's
dtype on CPU, float32 on CUDA for fp16/bf16) get the CUDA outputs after the capture (`cuda_outputs`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry

from .._torch import (FakeTensor, FakeTensorMode, aot_module_simplified, compiling, tree_leaves, unset_fake_temporarily,
                      use_lazy_graph_module)

from ..passes.prepare import prepare_inference, prepare_training
from ..planning import Planner, ProgramKind, Target
from ..planning.timing import Charged
from ..planning.program import default_offload, host_budget_bytes
from ..settings import PlanningSettings
from .backend import PlanningBackend, aot_hooks
from ..budget import parse_planning_options
from ..costs.profiles import DeviceProfile, NodeCosts, get_profile, node_bytes, node_flops
from ..executors import NAMES as EXECUTORS
from ..capture.joint_graph import build_joint_graph
from ..capture.stamping import CHECK_BLOCKS, TEMPLATE_BLOCKS, BlockBounds, NotRepeating, find_repeated_blocks, first_difference, stamp
from ..plans.plan import Plan
from ..costs.sdpa_prediction import CudaAttention
from .cuda_outputs import as_captured_on_cuda

__all__ = ["OfflineBackend", "capture_offline", "default_dtype", "plan_offline"]


def _not_lowered(*_args):
    raise RuntimeError("an offline plan is never lowered: replay its plan file with optimize()")


class _PlanOnlyExecutor:
    """An executor's fusion rules without its compiler: groups are planned (roofline time) but never built.

    Planning for nvFuser needs neither nvFuser nor a CUDA device: its fusibility rules are applied
    to the graph's ops as if they ran on CUDA.
    """

    fuses_writes = False
    plans_only = True  # compile_group builds nothing: no compile time to charge (executors/groups.compile_cost_s)

    def __init__(self, name: str | None, profile: DeviceProfile):
        name = (name or "eager").lower()
        if name == "eager":
            from ..executors import EagerExecutor

            self._can_fuse = EagerExecutor().can_fuse
        elif name == "inductor":
            from ..executors import InductorExecutor

            self._can_fuse = InductorExecutor().can_fuse
            self.fuses_writes = True
        elif name == "nvfuser":
            if profile.device_type != "cuda":
                raise ValueError(f"the nvfuser executor runs on CUDA devices only; profile {profile.name!r} is not one")
            from ..executors.nvfuser import node_is_fusible

            self._can_fuse = lambda node: node_is_fusible(node, require_cuda=False)
        else:
            raise ValueError(f"unknown executor {name!r}; known: {', '.join(EXECUTORS)}")
        self.name = name

    def can_fuse(self, node: fx.Node) -> bool:
        return self._can_fuse(node)

    def compile_group(self, gm: fx.GraphModule, example_inputs) -> Callable[..., tuple]:
        def not_runnable(*_args):
            raise RuntimeError("an offline plan's fusion groups are not compiled: replay the plan file with optimize()")

        return not_runnable


# Only in a cpu-profile capture (or an attention call no CUDA kernel was predicted for): the CPU kernel,
# which torch's FLOP registry has no formula for -> the CUDA kernel whose formula applies (operands:
# grad_out?, q, k, v, ...). A CUDA-profile capture holds the CUDA kernels, which have formulas.
_CPU_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": ("_scaled_dot_product_flash_attention", 3),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("_scaled_dot_product_flash_attention_backward", 4),
}


def _attention_time(node: fx.Node, stands_for: tuple[str, int], profile: DeviceProfile) -> float:
    """`costs.node_time`'s roofline with the FLOPs of the CUDA kernel `stands_for`."""
    name, n_operands = stands_for
    formula = flop_registry.get(getattr(torch.ops.aten, name))
    operands = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[:n_operands]]
    flops = int(formula(*operands)) if formula is not None else 0
    out = [v for v in tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    half = bool(out) and out[0].dtype in (torch.float16, torch.bfloat16)
    rate = profile.half_flops if half else profile.fp32_flops
    return max(flops / rate, node_bytes(node) / profile.mem_bw) + profile.launch_s


class OfflineBackend(PlanningBackend):
    """PlanningBackend that plans and lowers nothing: roofline times of a named profile.

    Its compile hooks plan as PlanningBackend's do. The training hook (`partition`) then ends AOTAutograd's
    compile with `_Planned`, which `_capture` catches: letting it finish (torch's default partition, then
    compilers returning `_not_lowered`) built programs nobody runs, 1.4 s on GPT-2 large (36 layers, 8 x
    1024 tokens) and 3 s on 80 Llama-7B layers. The forward-only hook returns `_not_lowered` (little follows).

    `PlanningBackend.__call__` (the torch.compile entry) makes its planner's target from the example
    inputs' device; here the target comes from the profile alone, and AOTAutograd is called by
    `capture_offline`, not by Dynamo.
    """

    def __init__(self, settings: PlanningSettings, on_plan: Callable[[Plan], None]):
        if settings.device_profile == "measured":
            raise ValueError("offline planning cannot measure op times (the tensors are fake): name a device profile")
        super().__init__(settings, on_plan)
        profile = get_profile(settings.device_profile or "h100")
        # Only compile_groups makes tensors on this device (example inputs for group compilers, which
        # offline executors ignore): on "meta" they take no memory.
        target = Target(
            torch.device("meta"), False, profile, default_offload(settings.offload, profile.device_type),
            host_budget_bytes(settings.host_budget), _PlanOnlyExecutor(settings.executor, profile),
        )
        self.planner = Planner(settings, target, on_plan, resolution=self.resolution, costs=self._costs)
        # wall times: capture_s (building the fake module and inputs, tracing the joint graph) and
        # plan_s (problem, solve, fingerprint); `start` is set by capture_offline
        self.timings: dict[str, float] = {}
        self._capture_charge: Charged | None = None  # set once captured
        self.stamped: dict[str, float] | None = None  # the capture's units when its graph was stamped (_stamped_joint)

    def __call__(self, gm, example_inputs):  # pragma: no cover - not a torch.compile backend
        raise TypeError("OfflineBackend is not a torch.compile backend; use optsched.compiler.offline.plan_offline")

    def _costs(self, gm: fx.GraphModule, jg) -> NodeCosts | None:
        """Roofline times (as `build_problem` makes them without measurements), except for the CPU
        attention kernels a cpu-profile capture contains: torch's FLOP registry has no formula for
        them, so the roofline would count only their bytes. They get the formula of the CUDA flash
        kernel (same operands). A CUDA-profile capture holds the CUDA kernels themselves (see
        `costs/sdpa_prediction.CudaAttention`), costed by their own formulas; nothing is overridden then."""
        times = {}
        for node in jg.compute:
            stands_for = _CPU_ATTENTION.get(getattr(getattr(node.target, "overloadpacket", None), "__name__", ""))
            if stands_for is not None and node_flops(node) == 0:
                times[node.name] = _attention_time(node, stands_for, self.target.profile)
        return NodeCosts(times, {}, {}) if times else None

    # ---- the compile hooks (compiler.backend.CompileHooks). The plan is made in `partition` (training)
    # or `compile_inference` (forward only), as PlanningBackend makes it; nothing is lowered. `partition`
    # ends AOTAutograd's compile (`_Planned`); a forward-only compile finishes with `_not_lowered`, which
    # nobody calls (capture_offline drops what AOTAutograd returns).

    def partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        """Plan the training step, then end the compile (`_Planned`): nothing is partitioned or run."""
        self._captured(joint)
        prepare_training(joint)  # as optimize() does, so the fingerprints agree
        jg = build_joint_graph(joint, num_fwd_outputs)
        self.planner.plan(joint, jg, ProgramKind.TRAINING, self._training_usage(joint, jg)[0],  # optimize()'s first guess
                          self._capture_charge)
        self._done()
        raise _Planned  # AOTAutograd's own partition and compiles would be dropped unrun (3 s at 80 Llama layers)

    def compile_forward(self, gm: fx.GraphModule, example_inputs):
        return _not_lowered

    def compile_backward(self, gm: fx.GraphModule, example_inputs):
        return _not_lowered

    def compile_inference(self, gm: fx.GraphModule, example_inputs):
        """Plan the forward-only program; nothing to run."""
        self._captured(gm)
        prepare_inference(gm, split_foreach=self.target.executor.fuses_writes)  # as optimize() does, so the fingerprints agree
        jg = build_joint_graph(gm, None)
        self.planner.plan(gm, jg, ProgramKind.FORWARD, charged=self._capture_charge)
        self._done()
        return _not_lowered

    def _captured(self, gm: fx.GraphModule) -> None:
        """The capture is done: on a CUDA profile, its normalizations' statistics as a CUDA capture has them
        (`cuda_outputs`: the CPU fake kernels give them the input's dtype, CUDA float32)."""
        if self.target.profile.device_type == "cuda":
            as_captured_on_cuda(gm)
        self.timings["capture_s"] = time.perf_counter() - self.timings.get("start", time.perf_counter())
        # the time limit covers the capture too (the call a user waits for): the nodes it traced (and stamped) on the
        # deterministic clock
        units = self.stamped or {"graph_node_captured": len(gm.graph.nodes)}
        self._capture_charge = Charged(units, self.timings["capture_s"])
        self._planning_started = time.perf_counter()

    def elapsed(self) -> dict[str, float]:
        """capture_s and plan_s so far (plan_s until now if planning has not returned)."""
        out = {k: v for k, v in self.timings.items() if k in ("capture_s", "plan_s")}
        if "capture_s" in out and "plan_s" not in out:
            out["plan_s"] = time.perf_counter() - self._planning_started
        return out

    def _done(self) -> None:
        self.timings["plan_s"] = time.perf_counter() - self._planning_started

    @property
    def planned(self) -> bool:
        return "plan_s" in self.timings


class _FirstUse(TorchFunctionMode):
    """Records the order in which the watched tensors are first handed to a torch function
    (method calls and attribute reads such as `x.shape` included). Within one call, the
    module's own tensors (`early`) count first: Dynamo wraps a parameter when the forward
    reads the attribute, before the call, and an argument only at the call."""

    def __init__(self, watched: list[torch.Tensor], early: set[int]):
        super().__init__()
        self.index = {id(t): i for i, t in enumerate(watched)}
        self.early = early
        self.order: list[int] = []
        self._seen: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        new = []
        for a in tree_leaves((args, kwargs)):
            i = self.index.get(id(a)) if isinstance(a, torch.Tensor) else None
            if i is not None and i not in self._seen:
                self._seen.add(i)
                new.append(i)
        self.order += sorted(new, key=lambda i: i not in self.early)  # stable: argument order otherwise
        return func(*args, **kwargs)


class _FlatStep(torch.nn.Module):
    """The step as a function of its tensors only, in a chosen order: `forward(*flat)` puts each
    into its place (a parameter or buffer by name, or a positional argument) and calls the module
    through `torch.func.functional_call`. Tensors not in `flat` stay the module's own (or the
    example argument) and, unused, never reach the graph. Returns a tuple (AOTAutograd's format)."""

    def __init__(self, module: torch.nn.Module, args: tuple, slots: list[tuple[str, str | int]]):
        super().__init__()
        object.__setattr__(self, "_module", module)  # not a submodule: its tensors are inputs, not ours
        self._args = args
        self._slots = slots

    def forward(self, *flat):
        state, args = {}, list(self._args)
        for value, (kind, key) in zip(flat, self._slots):
            if kind == "state":
                state[key] = value
            else:
                args[key] = value
        out = torch.func.functional_call(self._module, state, tuple(args))
        return out if isinstance(out, tuple) else (out,)


def _dynamo_order(module: torch.nn.Module, args: tuple) -> tuple[list, list[tuple[str, str | int]]]:
    """The step's tensors (parameters, buffers, tensor arguments) in the order Dynamo makes them
    graph inputs: the order in which the forward first uses them (Dynamo wraps inputs and
    parameters lazily, when first used). Unused ones are left out, as Dynamo leaves them out.
    This makes the captured graph the one `optimize` captures, so the fingerprints agree."""
    candidates: list[tuple[torch.Tensor, tuple[str, str | int]]] = []
    seen: set[int] = set()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:  # tied: the first name only
        if id(t) not in seen:
            seen.add(id(t))
            candidates.append((t, ("state", name)))
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and id(a) not in seen:
            seen.add(id(a))
            candidates.append((a, ("arg", i)))
    early = {i for i, (_t, (kind, _key)) in enumerate(candidates) if kind == "state"}
    recorder = _FirstUse([t for t, _ in candidates], early)
    with recorder:
        module(*args)
    used = [candidates[i] for i in recorder.order]
    return [t for t, _ in used], [slot for _, slot in used]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Layers built inside get floating parameters of `dtype` (torch.set_default_dtype, restored on exit):
    the way to build a bf16 model in a model_factory, where Module.to(dtype) does not work."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _fake_inputs(mode: FakeTensorMode, inputs) -> tuple:
    if isinstance(inputs, (torch.Tensor,)) or not isinstance(inputs, (tuple, list)):
        raise TypeError(f"inputs_factory must return a tuple of positional arguments, got {type(inputs).__name__}")
    return tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
                 for x in inputs)


def _into_mode(module: torch.nn.Module, mode: FakeTensorMode) -> None:
    """Parameters and buffers that are fake tensors of another mode, made this mode's (same geometry, dtype,
    requires_grad; tied ones stay tied): copy.deepcopy of a fake tensor gives one of a new mode (nn.TransformerEncoder
    deep-copies its layer), which AOTAutograd refuses beside the inputs' mode."""
    moved: dict[int, torch.Tensor] = {}

    def ours(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            with unset_fake_temporarily():
                meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            fake = FakeTensor(mode, meta, t.device)
            moved[id(t)] = torch.nn.Parameter(fake, t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake
        return moved[id(t)]

    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if isinstance(t, FakeTensor) and t.fake_mode is not mode:
                    table[name] = ours(t)


def _check_fake(module: torch.nn.Module) -> None:
    real = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if not isinstance(t, FakeTensor)]
    if real:
        raise ValueError(
            f"model_factory returned a module with real tensors ({', '.join(real[:3])}{', ...' if len(real) > 3 else ''}): "
            "it must build the module when called (it runs under FakeTensorMode), e.g. lambda: GPT(config), "
            "not return one built before"
        )


def capture_offline(model_factory: Callable[[], torch.nn.Module], inputs_factory: Callable[[], tuple],
                    backend: OfflineBackend) -> None:
    """Build the module and inputs as fake tensors and run AOTAutograd's capture with `backend`'s hooks.

    The backend plans in its partition hook (training: some input requires grad) or its
    inference compiler (forward only) and reports the plan through its `on_plan`. With a CUDA
    profile, `F.scaled_dot_product_attention` is captured as the CUDA kernel predicted for the
    profile's GPU (`sdpa_prediction.predict_sdpa_backend`); with the cpu profile as the CPU kernel.
    """
    backend.timings["start"] = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # factories that seed leave the caller's random stream alone
        _capture(model_factory, inputs_factory, backend)


class _Planned(Exception):  # noqa: N818 (not an error: the capture's planned end)
    """Raised by `OfflineBackend.partition` once the training step is planned, to end AOTAutograd's compile."""


def _capture(model_factory, inputs_factory, backend: OfflineBackend) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        try:
            module = model_factory()
        except RuntimeError as e:
            if "Couldn't swap" not in str(e):
                raise
            raise RuntimeError(
                f"{e}: converting a module's parameters (Module.to(dtype), .half(), .bfloat16(), ...) fails "
                "under FakeTensorMode (torch.utils.swap_tensors refuses fake parameters, which the fake mode "
                "holds weak references to). Build the module in its dtype instead: pass dtype= to its layers, "
                "or wrap the construction in optsched.compiler.offline.default_dtype(torch.bfloat16)"
            ) from e
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model_factory must return an nn.Module, got {type(module).__name__}")
        inputs = _fake_inputs(mode, inputs_factory())
    _into_mode(module, mode)
    _check_fake(module)
    # The forward sees a tracer, as under torch.compile: code that branches on data unless
    # torch.compiler.iscompiling() (transformers' mask helpers, for one) takes the traceable path.
    # On a CUDA profile, attention is captured as the GPU's kernel (see sdpa_prediction.CudaAttention), not the CPU one.
    profile = backend.target.profile
    attention = CudaAttention(profile) if profile.device_type == "cuda" else contextlib.nullcontext()
    # Graph modules' Python code is generated when first run, as under Dynamo (whose captures optimize() plans),
    # not each time AOTAutograd rebuilds one: nothing here runs them (80 Llama-7B layers: 1 s of the capture).
    lazy = use_lazy_graph_module(True) if use_lazy_graph_module is not None else contextlib.nullcontext()
    with mode, torch.enable_grad(), compiling(), lazy:
        with attention:
            stamped = _stamped_joint(module, inputs)
        if stamped is not None:
            joint, num_fwd_outputs, backend.stamped = stamped
            with contextlib.suppress(_Planned):
                backend.partition(joint, None, num_fwd_outputs=num_fwd_outputs)
        else:
            with attention:
                _trace(module, inputs, backend)
    if not backend.planned:  # pragma: no cover
        raise RuntimeError("AOTAutograd returned without calling the planner")


class _JointCatcher:
    """AOTAutograd hooks that keep a training step's joint graph and end the compile, planning nothing."""

    def __init__(self):
        self.joint: fx.GraphModule | None = None
        self.num_fwd_outputs = 0

    def partition(self, joint: fx.GraphModule, _inputs, *, num_fwd_outputs: int, **_kwargs):
        self.joint, self.num_fwd_outputs = joint, num_fwd_outputs
        raise _Planned

    def compile_inference(self, _gm, _inputs):  # forward only: nothing to stamp
        return _not_lowered

    compile_forward = compile_backward = compile_inference


def _trace(module: torch.nn.Module, inputs: tuple, hooks) -> None:
    """AOTAutograd's capture of the step with `hooks` (compiler.backend.CompileHooks); nothing it builds is run, and a
    partition hook that has what it needs ends it (`_Planned`)."""
    flat, slots = _dynamo_order(module, inputs)
    with contextlib.suppress(_Planned):
        aot_module_simplified(_FlatStep(module, inputs, slots), flat, **aot_hooks(hooks))


def _trace_joint(module: torch.nn.Module, inputs: tuple) -> _JointCatcher:
    catcher = _JointCatcher()
    _trace(module, inputs, catcher)
    return catcher


def _stamped_joint(module: torch.nn.Module, inputs: tuple) -> tuple[fx.GraphModule, int, dict[str, float]] | None:
    """The training step's joint graph stamped from traces of 4 and 5 of the module's repeated blocks
    (capture/stamping.py), its forward output count and the capture's units of work; None where the module
    has no such blocks, is forward only, or the stamp of 4 blocks into 5 is not the trace of 5 (then all
    blocks are traced)."""
    rep = find_repeated_blocks(module)
    if rep is None or not BlockBounds.available():
        return None
    traced = {}
    for k in (TEMPLATE_BLOCKS, CHECK_BLOCKS):
        with rep.shortened(k), BlockBounds(rep.blocks[:k]) as bounds:
            try:
                catcher = _trace_joint(module, inputs)
            except Exception:  # noqa: BLE001 (a forward that needs all its blocks: the full trace says why, if it fails)
                return None
        if catcher.joint is None:
            return None
        traced[k] = (catcher, bounds)
    (template, bounds), (check, _) = traced[TEMPLATE_BLOCKS], traced[CHECK_BLOCKS]
    try:
        if first_difference(stamp(template.joint, bounds, CHECK_BLOCKS), check.joint) is not None:
            return None
        joint = stamp(template.joint, bounds, len(rep.blocks))
    except NotRepeating:
        return None
    units = {"graph_node_captured": len(template.joint.graph.nodes) + len(check.joint.graph.nodes),
             "graph_node_stamped": len(joint.graph.nodes) + len(check.joint.graph.nodes)}
    return joint, template.num_fwd_outputs, units


def plan_offline(
    model_factory: Callable[[], torch.nn.Module],
    inputs_factory: Callable[[], tuple],
    mem_budget: int | float | str | None = None,
    *,
    device_profile: str | DeviceProfile = "h100",
    executor: str | None = None,
    offload: bool | None = None,
    time_limit_s: float | None = None,
    progress: bool = False,
    host_budget: int | str | None = None,
    timings: dict | None = None,
) -> Plan:
    """Plan one training step of `model_factory()` on `inputs_factory()` for `device_profile`,
    allocating none of the model's tensors.

    model_factory: builds the module; called under FakeTensorMode, so it must construct it (not
    return one made before). Its forward takes the inputs and returns the loss (a scalar): the
    plan covers that forward and the backward of the loss. With no parameter or input requiring
    grad, it is a forward-only plan.
    inputs_factory: returns the forward's positional arguments (also made under FakeTensorMode).
    mem_budget: as in `optimize`: bytes, "60GB", "60%" of the unplanned peak, or None.
    device_profile: a GPU profile name ("a100", "h100", "h200"), "cpu" or a DeviceProfile; op times
    are its roofline (nothing can be timed). With a CUDA profile the graph is the one a CUDA
    capture is predicted to give: `F.scaled_dot_product_attention` becomes the fused kernel
    PyTorch's SDPA dispatcher is predicted to pick on that GPU (`predict_sdpa_backend`: on
    h100/h200 cuDNN attention for fp16/bf16 with head dims up to 128, else flash attention for
    fp16/bf16 without a mask, memory-efficient attention for fp32 or with a mask, the math
    composite when no fused kernel fits), with its backward. This is a prediction (the GPU
    process decides from its cuDNN version and SDPA flags: turn the same backends off here, e.g.
    with torch.nn.attention.sdpa_kernel, as in the training process); a wrong one makes optimize
    refuse the plan file (fingerprint mismatch), never run it. Not predicted, left as the CPU
    kernel: nested tensors, enable_gqa with fewer key/value heads, and SDPA called inside another
    overridable torch function (nn.MultiheadAttention). With "cpu" the graph is the CPU capture's.
    executor: "eager" (default), "inductor" or "nvfuser": whose fusion rules form fusion groups
    (nothing is compiled; a group's time is its roofline). `optimize(..., plan=path)` with no executor
    named replays the file with this one where it runs (not the device's default: Inductor or nvFuser on CUDA).
    offload: None (default) allows offloading when the profile is a CUDA device.
    host_budget: host memory offloads may take (default: half of this machine's memory).
    time_limit_s: as in `optimize`, but covering the capture too: this call takes about that long (the default
    grows with the graph, 5 to 30 s). The capture counts as the nodes it traced and stamped (the clock's
    graph_node_captured and graph_node_stamped, fitted on the reference machine) in deterministic mode, its wall
    seconds otherwise; the search keeps at least half the limit however long the capture took. A ModuleList of 12
    or more alike blocks (a transformer's layers) is traced at 4 and 5 blocks and the rest stamped, where the
    stamp of 4 blocks into 5 is the trace of 5 node for node (capture/stamping.py): 80 Llama-7B layers capture in
    about 6 s instead of 23.
    timings: a dict to fill with wall times: capture_s (building the fake module and inputs,
    tracing the joint graph), plan_s (problem, solve, fingerprint).

    Returns the Plan (`plan.fingerprint` set, `plan.save(path)` writes a plan file). Raises
    BudgetInfeasibleError when no plan meets the budget.
    """
    budget, host = parse_planning_options(mem_budget, host_budget, offload, executor, time_limit_s)
    if not callable(model_factory) or not callable(inputs_factory):
        raise TypeError("plan_offline(model_factory, inputs_factory, ...) takes two callables")
    plans: list[Plan] = []
    settings = PlanningSettings(budget, device_profile, time_limit_s, progress, offload, host, executor)
    backend = OfflineBackend(settings, plans.append)
    try:
        capture_offline(model_factory, inputs_factory, backend)
    finally:  # an infeasible budget has timings too
        if timings is not None:
            timings.update(backend.elapsed())
    return plans[-1]
