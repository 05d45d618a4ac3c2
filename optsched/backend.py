"""The torch.compile backend: AOTAutograd hands us the graph, we plan it and return our programs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .budget import Budget, BudgetResolution
from .capture_errors import check_static_sizes
from .costs import DeviceProfile, NodeCosts, get_profile
from .fingerprint import fingerprint
from .plan_file import PlanFile, PlanMismatchError, cache_dir, load_plan
from .output_usage import OutputUsage, UsageObserver, default_usage, fill_missing_tangents, tangent_outputs
from .plan_reuse import plan_from_file
from .foreach_split import split_foreach as split_foreach_ops
from .identity_clones import drop_identity_clones
from .inplace import fold_copy_back
from .restore_ops import restore_fused_pointwise
from .scalar_batching import batch_scalar_foreach, batch_scalar_ops
from .joint_graph import build_joint_graph
from .lowering import boxed, lower_inference, lower_training
from .offload_runtime import OffloadDeviceError, OffloadRuntime, SlotSpec
from .plan import Plan
from .problem_builder import Built, build_problem, reuse_candidates
from .executors import get_executor
from .fusion import Group, build_group, compile_groups, horizontal_candidates, roofline_time
from .profiling import profile_nodes
from .user_checkpoint import solve_within_user_checkpointing
from .solvers import BudgetInfeasibleError, simulate, solve
from .solvers.fusion import find_groups, fuse_ops
from .solvers.problem import Problem
from .solvers.problem import default_schedule

DEFAULT_TIME_LIMIT_S = 5.0  # at least this long; larger graphs get DEFAULT_S_PER_OP per op
DEFAULT_S_PER_OP = 0.02
DEFAULT_HOST_SHARE = 0.5  # offloads may take this share of the machine's physical memory by default


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_of(example_inputs) -> torch.device | None:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return None


def _scalar_outputs(jg) -> list[bool]:
    return [isinstance(o, fx.Node) and isinstance(v := o.meta.get("val"), torch.Tensor) and v.dim() == 0 for o in jg.fw_outputs]


def _view_outputs(jg) -> list[bool]:
    """Forward outputs AOTAutograd hands out as views it makes anew over our storage (the caller holds a
    tensor we never see). `_unsafe_view` results (a linear layer's 3-d output) go out as they are."""
    return [isinstance(o, fx.Node) and jg.is_view(o) and o.target is not torch.ops.aten._unsafe_view.default
            for o in jg.fw_outputs]


def prepare_inference(gm: fx.GraphModule, split_foreach: bool = False) -> None:
    """The forward-only (optimizer step) graph as eager would run it, before planning.
    `split_foreach`: per-tensor ops instead of foreach ops, for an executor that fuses them
    (with the writes into parameters and state) into one kernel per tensor."""
    restore_fused_pointwise(gm)  # Dynamo's mul + fma and foreach lerp back to eager's ops
    # input mutations: compute new values into the inputs instead of copying them back; readers of
    # a new value read the input after its write (order_writes keeps them after it)
    fold_copy_back(gm, redirect_readers=True)
    if split_foreach:
        split_foreach_ops(gm)
    # per-parameter scalars (step counts, bias corrections) as vectors: foreach ops, then for-loops
    batch_scalar_foreach(gm)
    batch_scalar_ops(gm)


class PlanningBackend:
    """One per optimized callable. Every (re)compilation plans its graph and reports the plan."""

    def __init__(
        self,
        budget: Budget,
        device_profile: str | DeviceProfile | None,
        time_limit_s: float | None,
        on_plan: Callable[[Plan], None],
        progress: bool = False,
        offload: bool | None = None,
        host_budget: Budget | None = None,
        executor: str | None = None,
        plan: str | os.PathLike | None = None,
        on_mismatch: str = "error",
        usage: OutputUsage | None = None,
        on_usage: Callable[[OutputUsage, OutputUsage], None] | None = None,
        resolution: BudgetResolution | None = None,
        carried: dict[str, list[PlanFile]] | None = None,
    ):
        self.budget = budget
        self.device_profile = device_profile
        self.time_limit_s = time_limit_s
        self.on_plan = on_plan
        self.progress = progress
        self.offload_setting = offload
        self.host_budget = host_budget
        self.executor_setting = executor
        self.plan_spec = None if plan is None else (plan if plan == "auto" else os.fspath(plan))
        self.on_mismatch = on_mismatch
        self.profile: DeviceProfile | None = None
        # the budget as the optimized callable means it, shared by all its backends (see BudgetResolution)
        self.resolution = resolution if resolution is not None else BudgetResolution(budget)
        # plans a copy of an optimized module carries from its original, by fingerprint hash: replayed, not solved
        self.carried = carried or {}
        # what the caller does with the outputs (None: output_usage.default_usage's guess), and who
        # hears when a backward shows otherwise (the next call then plans with what was seen)
        self.usage = usage
        self.on_usage = on_usage
        self.observer: UsageObserver | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs):
        check_static_sizes(gm)  # data-dependent sizes: a CaptureError before any planning code sees them
        self.device = _device_of(example_inputs) or torch.device("cpu")
        wants = self.device_profile
        # default on CPU: measure op times on this machine; a named profile means the roofline
        self.measure = wants == "measured" or (wants is None and self.device.type == "cpu")
        self.profile = get_profile(None if wants == "measured" else wants, self.device)
        # default: offload where host memory is really another memory (on CUDA, not on CPU)
        self.offload = self.device.type == "cuda" if self.offload_setting is None else self.offload_setting
        physical = physical_memory_bytes()
        self.host_budget_bytes = (
            self.host_budget.resolve(physical) if self.host_budget and self.host_budget.spec is not None
            else int(DEFAULT_HOST_SHARE * physical)
        )
        self.executor = get_executor(self.executor_setting, self.device)
        return aot_autograd(
            fw_compiler=self._compile_forward,
            bw_compiler=self._compile_backward,
            inference_compiler=self._inference,
            partition_fn=self._partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    @staticmethod
    def _compile(gm: fx.GraphModule, example_inputs):
        return boxed(gm)

    def _compile_forward(self, gm: fx.GraphModule, example_inputs):
        run, observer = boxed(gm), self.observer
        if observer is None:
            return run
        n_outputs = observer.n_outputs

        def forward(args: list):
            out = run(args)
            observer.forward_done(out, n_outputs)
            return out

        forward._boxed_call = True  # type: ignore[attr-defined]
        return forward

    def _compile_backward(self, gm: fx.GraphModule, example_inputs):
        """The backward, taking None for an output no gradient flowed into (see output_usage)."""
        run, observer = boxed(gm), self.observer
        positions = [(i, n.meta["val"]) for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))
                     if n.name.startswith("tangents")]

        def backward(args: list):
            tangents = fill_missing_tangents(args, positions)
            if observer is not None:
                observer.backward_start(tangents)
            del tangents
            return run(args)

        backward._boxed_call = True  # type: ignore[attr-defined]
        return backward

    def _costs(self, gm: fx.GraphModule, jg) -> NodeCosts | None:
        return profile_nodes(gm, self.device, reuse_candidates(jg)) if self.measure else None

    def _fuse(self, jg, built: Built, groups_of_ops: list[list[int]], cache: dict | None = None) -> tuple[Problem, list]:
        """The problem the solver sees (each group merged into one op) and, per op, its node or group.
        `cache`: kernels and their timings from earlier calls for this graph."""
        if not groups_of_ops:
            return built.problem, list(built.nodes)
        groups = [build_group(jg, built.problem, c, built.nodes) for c in groups_of_ops]
        compile_groups(groups, self.executor, self.device, self.measure, cache)
        times = [g.time_s if self.measure else roofline_time(g, self.profile) for g in groups]
        fused = fuse_ops(built.problem, groups_of_ops, times)
        by_first = {c[0]: g for c, g in zip(groups_of_ops, groups)}
        ops = [
            dataclasses.replace(op, workspace_bytes=by_first[unit[0]].workspace_bytes) if unit[0] in by_first else op
            for op, unit in zip(fused.problem.ops, fused.members)
        ]
        problem = dataclasses.replace(fused.problem, ops=ops)
        items = [by_first[unit[0]] if unit[0] in by_first else built.nodes[unit[0]] for unit in fused.members]
        return problem, items

    def _plan_fused(self, jg, built: Built, graph_nodes: int) -> tuple[Plan, list]:
        """Plan with the executor's vertical groups; then try each horizontal group, kept only if the
        plan with it is faster and its peak no higher (fusing independent ops makes their outputs
        live together, which is how memory-blind fusion inflates peaks)."""
        fusible = [self.executor.can_fuse(n) for n in built.nodes]
        groups = find_groups(built.problem, fusible)
        compiled: dict = {}
        problem, items = self._fuse(jg, built, groups, compiled)
        plan = self._plan(problem, graph_nodes, items)
        taken = {o for c in groups for o in c}
        for cand in horizontal_candidates(built.problem, built.nodes, fusible, taken):
            trial_problem, trial_items = self._fuse(jg, built, groups + [cand], compiled)
            label = f"horizontal group of {len(cand)} {built.nodes[cand[0]].target}"
            try:
                trial = self._plan(trial_problem, graph_nodes, trial_items, plan.budget_bytes)
            except BudgetInfeasibleError:
                plan.stats.notes.append(f"{label}: rejected, no plan fits the budget with it")
                continue
            mib = 2**20
            if trial.sim.time_s < plan.sim.time_s and trial.sim.peak_bytes <= plan.sim.peak_bytes:
                trial.stats.notes += plan.stats.notes + [f"{label}: kept"]
                plan, items, groups = trial, trial_items, groups + [cand]
            else:
                plan.stats.notes.append(
                    f"{label}: rejected, peak {trial.sim.peak_bytes / mib:.2f} MiB vs {plan.sim.peak_bytes / mib:.2f}, "
                    f"time {trial.sim.time_s * 1e3:.3f} ms vs {plan.sim.time_s * 1e3:.3f}"
                )
        return plan, items

    def _plan(self, problem, graph_nodes: int, items: list | None = None, budget_bytes: int | None = None) -> Plan:
        baseline = simulate(problem, default_schedule(problem))
        from_reference = budget_bytes is None and self.resolution.resolved
        if budget_bytes is None:
            budget_bytes = self.resolution.bytes_for(baseline.peak_bytes)
        limit = self.time_limit_s
        if limit is None:  # grows with the graph: planning stays a small share of compile time
            limit = max(DEFAULT_TIME_LIMIT_S, DEFAULT_S_PER_OP * len(problem.ops))
        # checkpointing already in the model caps the budget: never above the user's own plan
        try:
            budget_bytes, sol = solve_within_user_checkpointing(
                problem, items, budget_bytes, lambda b: solve(problem, b, time_limit_s=limit, progress=self.progress)
            )
        except BudgetInfeasibleError as e:
            if from_reference:
                e.args = (f"{e.args[0]}; {self.resolution.explain()}, and this program's unplanned peak is "
                          f"{baseline.peak_bytes / 2**20:.2f} MiB",)
            raise
        plan = Plan(
            problem=problem,
            schedule=sol.schedule,
            sim=sol.sim,
            baseline=sol.baseline,
            stats=sol.stats,
            budget_bytes=budget_bytes,
            budget_spec=str(self.budget),
            lower_bound_bytes=sol.lower_bound_bytes,
            profile=self.profile,
            timing="measured" if self.measure else "roofline",
            graph_nodes=graph_nodes,
            executor=self.executor.name,
            fusion_groups=[[n.name for n in it.nodes] for it in items or [] if isinstance(it, Group)],
        )
        return plan

    def _planned(self, gm: fx.GraphModule, jg, name: str, usage: OutputUsage | None = None) -> tuple[Plan, list]:
        """The plan for this graph: from the plan file when one matches, else solved (and saved when asked)."""
        fp = fingerprint(gm)
        path = self._plan_path(fp, name)
        pf = self._carried_plan(fp, name)  # a copy of an optimized module replays its original's plans
        if pf is None and path is not None and path.exists():
            pf = load_plan(path)
        if pf is not None:
            mismatch = pf.describe_mismatch(fp, **self._made_for(name))
            recorded = pf.data["made_for"].get("outputs")
            if mismatch is None and usage is not None and recorded is not None and self.usage is None:
                usage = OutputUsage.parse(recorded)  # our guess, against what the file's run saw the caller do
            if mismatch is None and (usage.describe() if usage is not None else None) == recorded:
                plan, items = plan_from_file(self, jg, gm, pf, name, usage)
                self._record_budget(plan, fp)
                self.on_plan(plan)
                return plan, items
            if mismatch is None:
                pass  # the caller now uses the outputs otherwise than when the file was made: plan again
            elif self.on_mismatch == "error":
                raise PlanMismatchError(
                    f"plan file {path} does not match: {mismatch}. Pass on_mismatch='replan' to plan again and "
                    "overwrite it, or use another plan file"
                )
        costs = self._costs(gm, jg)
        built = build_problem(
            jg, self.profile, name=name, measured=costs,
            offload=self.offload, host_budget_bytes=self.host_budget_bytes, usage=usage,
        )
        plan, items = self._plan_fused(jg, built, len(gm.graph.nodes))
        if costs is not None and not costs.scratch_measured:
            plan.stats.notes.append("planned while another profiler was running: kernel scratch space was not measured "
                                    "(counted as 0) and no op writes into a dying input")
        plan.fingerprint, plan.offload_allowed = fp, self.offload
        plan.output_usage = usage.describe() if usage is not None else None
        self._record_budget(plan, fp)
        if path is not None:  # a save the file system refuses warns: the plan is made, the step runs
            from .plan_file import save_or_warn

            save_or_warn(plan.save, path, cached=self.plan_spec == "auto")
        self.on_plan(plan)
        return plan, items

    def _made_for(self, name: str) -> dict:
        """What a plan file must have been made for (its output usage is checked apart: see `_planned`).
        A percentage budget adds how it resolves now (its fixed bytes, or this program's own peak), so a
        plan is never reused for other bytes (and the plan cache keys them apart)."""
        return {"kind": "training" if name == "training step" else "inference", "budget": str(self.budget),
                "device_profile": self.profile.name, "executor": self.executor.name, "offload": self.offload,
                **self.resolution.made_for()}

    def _carried_plan(self, fp: dict, name: str) -> PlanFile | None:
        wanted = self._made_for(name)
        return next((pf for pf in self.carried.get(fp["hash"], ()) if pf.describe_mismatch(fp, **wanted) is None), None)

    def _record_budget(self, plan: Plan, fp: dict) -> None:
        """How the budget was resolved, on the plan; the first training program fixes a percentage's bytes
        (the percentage of its unplanned peak, not a cap the plan itself applied)."""
        peak = plan.baseline.peak_bytes
        plan.budget_from = self.resolution.source(peak, fp["hash"])
        if plan.kind == "training":
            self.resolution.fix(self.resolution.bytes_for(peak), peak, fp["hash"])

    def _plan_path(self, fp: dict, name: str) -> Path | None:
        if self.plan_spec is None:
            return None
        if self.plan_spec != "auto":
            return Path(self.plan_spec)
        key = hashlib.sha256(json.dumps(self._made_for(name), sort_keys=True).encode()).hexdigest()[:12]
        return cache_dir() / f"{fp['hash'][:20]}-{key}.json"

    def _partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_kwargs):
        drop_identity_clones(joint)  # dropout(p=0) and the like: eager returns the input, the trace copies it
        jg = build_joint_graph(joint, num_fwd_outputs)
        usage, tangent_of = self._training_usage(joint, jg)
        plan, items = self._planned(joint, jg, "training step", usage)
        self.observer = UsageObserver(
            OutputUsage.parse(plan.output_usage), tangent_of, self.on_usage, _scalar_outputs(jg), _view_outputs(jg)
        )
        fw, bw, _saved = lower_training(
            jg, plan.problem, items, plan.schedule, plan.sim.reused, plan.sim.offloads, self._runtime
        )
        return fw, bw

    def _training_usage(self, joint: fx.GraphModule, jg) -> tuple[OutputUsage, list[int | None]]:
        """The output usage to plan with (the observed one, else the guess), and each tangent's output."""
        tangent_of = tangent_outputs(joint, jg.tangents)
        if self.usage is not None and len(self.usage.grad) == len(jg.fw_outputs):
            return self.usage, tangent_of
        return default_usage(jg.fw_outputs, tangent_of), tangent_of

    def _runtime(self, slots: list[SlotSpec]) -> OffloadRuntime:
        # partitioning runs under fake tensors; the host pool must be real, and allocated now, not in a step
        with unset_fake_temporarily():
            try:
                return OffloadRuntime(slots, self.device, planned_for=self.profile.device_type)
            except OffloadDeviceError as e:
                raise OffloadDeviceError(f"device profile {self.profile.name!r}: {e}") from None

    def _inference(self, gm: fx.GraphModule, example_inputs):
        prepare_inference(gm, split_foreach=self.executor.fuses_writes)
        jg = build_joint_graph(gm, None)
        plan, items = self._planned(gm, jg, "forward")
        return boxed(lower_inference(jg, items, plan.schedule, plan.sim.reused))
