"""The plan: what the planner decided for one captured graph, and its figures."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path

from ..costs.profiles import DeviceProfile
from .file_format import downsample, seal, write_plan_file
from ..solvers.model.problem import Problem, Schedule, SolveStats
from ..solvers.model.simulator import SimResult

SUMMARY_KEYS = {
    "kind": "'training' (forward+backward) or 'inference' (forward only)",
    "predicted_peak_bytes": "simulated peak of the planned step: parameters, inputs, activations, gradients",
    "unplanned_peak_bytes": "simulated peak of the program as captured (what '60%' budgets refer to)",
    "budget_bytes": "the resolved budget, or None",
    "budget_from": "how a percentage budget became budget_bytes: 'this program' (a share of this program's own "
    "unplanned peak: every training program, and a forward-only one planned before any), 'the training program of "
    "the same shapes' or 'the largest training program' (a forward-only program takes that program's bytes), 'a "
    "larger training program' (a training program whose own share is below its bound takes the largest one's), "
    "'the first micro-batch\'s plan' (an accumulation step no plan met the share of takes that plan's peak with "
    "the gradients live), or "
    "'the device's free memory at the first call' (\"auto\"); None for a budget in bytes or no budget",
    "budget_reference_peak_bytes": "the unplanned peak the percentage was taken of: the program as captured, or, "
    "for a model with its own activation checkpointing, the step as it checkpoints (None unless budget_from is set)",
    "lower_bound_bytes": "a peak no plan of this captured program can go below (every order, save/recompute/offload "
    "choice, storage reuse and fusion option; not other captures, e.g. a chunked loss)",
    "estimated_time_s": "cost-model time of the planned step",
    "unplanned_time_s": "cost-model time of the program as captured",
    "time_ratio": "estimated_time_s / unplanned_time_s",
    "solver_status": "OPTIMAL (meets its bound), FEASIBLE (a CP-SAT plan) or HEURISTIC (a heuristic or reordered plan)",
    "objective_s": "the solver's objective (estimated step time)",
    "bound_s": "a proven lower bound on it, over the plans bound_valid_for names",
    "gap": "(objective - bound) / objective, certified for every status",
    "bound_valid_for": "what bound_s is proven over: every save/recompute(/offload) plan in this op order, or every "
    "plan (each op once); None for forward-only plans and plans older than this key",
    "solve_time_s": "wall time of planning",
    "method": "which model or heuristic produced the plan",
    "graph_nodes": "fx nodes in the captured graph (views, getitems, placeholders included)",
    "n_ops": "ops the planner scheduled (views excluded; a fusion group counts once)",
    "n_forward_ops": "forward ops",
    "n_backward_ops": "backward ops",
    "n_saved": "activations kept on the device from the forward for the backward",
    "saved_bytes": "their bytes",
    "n_offloaded": "activations kept in host memory from the forward for the backward",
    "offloaded_bytes": "their bytes",
    "transfer_s": "estimated busy time of the two copy queues (to and from the host); they overlap compute",
    "exposed_transfer_s": "the part of it compute waits for (included in estimated_time_s)",
    "host_bytes": "host memory the offloaded copies take",
    "host_budget_bytes": "host memory offloads may take (None: offloading is off)",
    "n_recomputed": "forward ops recomputed in the backward",
    "recompute_s": "their estimated time",
    "executor": "who runs fusion groups: 'eager' (no fusion), 'inductor' or 'nvfuser'",
    "n_fusion_groups": "fusion groups (each runs as one kernel)",
    "n_fused_ops": "ops inside them",
    "device_profile": "the profile times were estimated for",
    "timing": "'measured' (op times measured on the device) or 'roofline' (the profile's cost model)",
    "output_usage": "what the plan assumes the caller does with each forward output: 'g' a gradient flows into it, "
    "'h' it is held through the backward, '-' not (e.g. 'gh,--' for a loss used and logits dropped); None forward-only",
    "grads_at_start": "the step starts with gradients it accumulates into (a later micro-batch): planned with them "
    "live the whole step",
    "updates_in_backward": "the parameters the optimizer updates inside the backward (optimize(..., optimizer=)), "
    "each as soon as its gradient is final; empty: the user's opt.step() updates them all after it",
    "chunks": "per LM head + cross-entropy chain (passes/chunking.py), the number of token chunks it runs in "
    "(1: as captured); empty when there is none or chunking is off",
}


@dataclass
class Plan:
    problem: Problem
    schedule: Schedule
    sim: SimResult
    baseline: SimResult
    stats: SolveStats
    budget_bytes: int | None
    budget_spec: str
    lower_bound_bytes: int
    profile: DeviceProfile
    timing: str = "roofline"  # or "measured": op times measured on the planning device
    graph_nodes: int = 0  # fx nodes of the captured graph, views and getitems included
    executor: str = "eager"
    fusion_groups: list[list[str]] = field(default_factory=list)  # member node names per group
    fingerprint: dict | None = None  # of the captured graph (see optsched.capture.fingerprint)
    offload_allowed: bool = False
    # how a percentage budget was resolved (BudgetResolution.source): {"program", "unplanned_peak_bytes",
    # "fingerprint"} of the program the percentage was taken of; None for bytes or no budget
    budget_from: dict | None = None
    output_usage: str | None = None  # OutputUsage.describe() of the training program's outputs
    chunks: dict[str, int] = field(default_factory=dict)  # chain name -> chunk count (passes/chunking.py)
    chunk_trials: list[dict] = field(default_factory=list)  # per chunk count tried: fits, peak, time
    grads_at_start: bool = False  # an accumulation step: the gradients it adds into are live from its start
    updates_in_backward: list[str] = field(default_factory=list)  # parameters updated inside the backward
    optimizer: str | None = None  # the optimizer whose state and update the plan counts (optim.describe), if any
    allocated: dict[str, int] = field(default_factory=dict)  # storages measured larger than their values: name -> bytes

    @property
    def kind(self) -> str:
        return "training" if self.problem.has_backward else "inference"

    @property
    def predicted_peak_bytes(self) -> int:
        return self.sim.peak_bytes

    @property
    def estimated_time_s(self) -> float:
        return self.sim.time_s

    @property
    def solver_status(self) -> str:
        return self.stats.status

    @property
    def gap(self) -> float:
        return self.stats.gap

    @property
    def solve_time_s(self) -> float:
        return self.stats.wall_s

    def summary(self) -> dict:
        """The plan's figures; keys and meanings are listed in `SUMMARY_KEYS`."""
        on_device = [t for t in self.sim.saved if t not in self.sim.offloads]
        saved_bytes = sum(self.problem.tensors[t].bytes for t in on_device)
        out = {
            "kind": self.kind,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "unplanned_peak_bytes": self.baseline.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "budget_from": (self.budget_from or {}).get("program"),
            "budget_reference_peak_bytes": (self.budget_from or {}).get("unplanned_peak_bytes"),
            "lower_bound_bytes": self.lower_bound_bytes,
            "estimated_time_s": self.estimated_time_s,
            "unplanned_time_s": self.baseline.time_s,
            "time_ratio": self.estimated_time_s / self.baseline.time_s if self.baseline.time_s else 1.0,
            "solver_status": self.solver_status,
            "objective_s": self.stats.objective_s,
            "bound_s": self.stats.bound_s,
            "gap": self.gap,
            "bound_valid_for": next((n[len("bound: "):] for n in reversed(self.stats.notes) if n.startswith("bound: ")), None),
            "solve_time_s": self.solve_time_s,
            "method": self.stats.method,
            "graph_nodes": self.graph_nodes,
            "n_ops": len(self.problem.ops),
            "n_forward_ops": len(self.problem.fw_ops),
            "n_backward_ops": len(self.problem.bw_ops),
            "n_saved": len(on_device),
            "saved_bytes": saved_bytes,
            "n_offloaded": len(self.sim.offloads),
            "offloaded_bytes": self.sim.offloaded_bytes,
            "transfer_s": self.sim.transfer_s,
            "exposed_transfer_s": self.sim.exposed_transfer_s,
            "host_bytes": self.sim.host_bytes,
            "host_budget_bytes": self.problem.host_budget_bytes if self.problem.host_bw > 0 else None,
            "n_recomputed": len(self.sim.recomputed_ops),
            "recompute_s": self.sim.recompute_s,
            "executor": self.executor,
            "n_fusion_groups": len(self.fusion_groups),
            "n_fused_ops": sum(len(g) for g in self.fusion_groups),
            "device_profile": self.profile.name,
            "timing": self.timing,
            "output_usage": self.output_usage,
            "chunks": dict(self.chunks),
            "grads_at_start": self.grads_at_start,
            "updates_in_backward": list(self.updates_in_backward),
        }
        assert set(out) == set(SUMMARY_KEYS)
        return out

    def to_file_data(self) -> dict:
        """Everything a plan file holds (see optsched.plans.file_format), before sealing."""
        return _file_data(self)

    def timeline_data(self) -> dict:
        """The predicted memory over the step, for plots: live bytes per step, what each step is."""
        return _timeline_data(self)

    def save(self, path) -> Path:
        """Write this plan as a plan file (atomically); `optsched.load_plan` reads it back."""
        return write_plan_file(seal(self.to_file_data()), path)

    def __repr__(self) -> str:
        mib = 2**20
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / mib:.2f} MiB"
        return (
            f"Plan({self.kind}, peak {self.predicted_peak_bytes / mib:.2f} MiB "
            f"(unplanned {self.baseline.peak_bytes / mib:.2f}, budget {budget}), "
            f"time x{self.summary()['time_ratio']:.3f}, {self.solver_status}, gap {self.gap:.2%})"
        )


def _file_data(plan: Plan) -> dict:
    """Plan.to_file_data: the plan as a plan file's fields, its timeline included."""
    p, sim = plan.problem, plan.sim
    return {
        "optsched_version": _version(),
        "torch_version": _torch_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kind": plan.kind,
        "fingerprint": plan.fingerprint or {"hash": "", "nodes": []},
        "made_for": {
            "kind": plan.kind,
            "budget": plan.budget_spec,
            "budget_bytes": plan.budget_bytes,
            "budget_from": (plan.budget_from or {}).get("program"),
            "budget_resolved_bytes": (plan.budget_from or {}).get("bytes"),  # before any cap the plan applied
            "budget_reference": plan.budget_from,
            "device_profile": plan.profile.name,
            "executor": plan.executor,
            "offload": plan.offload_allowed,
            "host_budget_bytes": p.host_budget_bytes,
            "profile": plan.profile.to_dict(),
            "timing": plan.timing,
            "outputs": plan.output_usage,
            "grads_at_start": plan.grads_at_start,
            "optimizer": plan.optimizer,
        },
        "decisions": {
            "ops": [o.name for o in p.ops],
            "fw_order": list(plan.schedule.fw_order),
            "bw_order": list(plan.schedule.bw_order),
            "offload": {p.tensors[t].name: j for t, j in sorted(plan.schedule.offload.items())},
            "fusion_groups": [list(g) for g in plan.fusion_groups],
            "recomputed": [p.ops[o].name for o in sim.recomputed_ops],
            "offloaded": [p.tensors[t].name for t in sorted(sim.offloads)],
        },
        "costs": {o.name: [o.time_s, o.workspace_bytes, [[p.tensors[a].name, p.tensors[b].name] for a, b in o.reuse]]
                  for o in p.ops},
        "allocated": dict(plan.allocated),
        "summary": plan.summary(),
        "solver": plan.stats.to_dict(),
        "timeline": plan.timeline_data(),
    }


def _timeline_data(plan: Plan) -> dict:
    """Plan.timeline_data: live bytes downsampled, recompute steps and offloads, planned and unplanned."""
    sim, p = plan.sim, plan.problem
    live, chunk = downsample(sim.timeline)
    return {
        "live_bytes": live,
        "steps_per_point": chunk,
        "n_steps": len(sim.timeline),
        "n_forward_steps": sim.n_forward_steps,
        "recompute_steps": [k for k, (_o, rc) in enumerate(sim.steps) if rc],
        "offloads": [
            {"tensor": p.tensors[t].name, "bytes": p.tensors[t].bytes, "produced": e.produced,
             "release": e.release, "prefetch": e.prefetch, "first_read": e.first_read}
            for t, e in sorted(sim.offloads.items())
        ],
        "peak_bytes": sim.peak_bytes,
        "peak_step": sim.peak_step,
        "budget_bytes": plan.budget_bytes,
        "unplanned_live_bytes": downsample(plan.baseline.timeline)[0],
        "unplanned_steps_per_point": downsample(plan.baseline.timeline)[1],
        "unplanned_n_steps": len(plan.baseline.timeline),
        "unplanned_n_forward_steps": plan.baseline.n_forward_steps,
        "unplanned_peak_bytes": plan.baseline.peak_bytes,
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("optsched")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        return "0+unknown"


def _torch_version() -> str:
    import torch

    return torch.__version__
