"""The plan: what the planner decided for one captured graph, and its figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import DeviceProfile
from .solvers.problem import Problem, Schedule, SolveStats
from .solvers.simulator import SimResult

SUMMARY_KEYS = {
    "kind": "'training' (forward+backward) or 'inference' (forward only)",
    "predicted_peak_bytes": "simulated peak of the planned step: parameters, inputs, activations, gradients",
    "unplanned_peak_bytes": "simulated peak of the program as captured (what '60%' budgets refer to)",
    "budget_bytes": "the resolved budget, or None",
    "lower_bound_bytes": "a peak no plan can go below",
    "estimated_time_s": "cost-model time of the planned step",
    "unplanned_time_s": "cost-model time of the program as captured",
    "time_ratio": "estimated_time_s / unplanned_time_s",
    "solver_status": "OPTIMAL (meets its bound), FEASIBLE (a CP-SAT plan) or HEURISTIC (a heuristic or reordered plan)",
    "objective_s": "the solver's objective (estimated step time)",
    "bound_s": "a proven lower bound on it, over plans that run the ops in this plan's order",
    "gap": "(objective - bound) / objective, certified for every status",
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
            "lower_bound_bytes": self.lower_bound_bytes,
            "estimated_time_s": self.estimated_time_s,
            "unplanned_time_s": self.baseline.time_s,
            "time_ratio": self.estimated_time_s / self.baseline.time_s if self.baseline.time_s else 1.0,
            "solver_status": self.solver_status,
            "objective_s": self.stats.objective_s,
            "bound_s": self.stats.bound_s,
            "gap": self.gap,
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
        }
        assert set(out) == set(SUMMARY_KEYS)
        return out

    def __repr__(self) -> str:
        mib = 2**20
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / mib:.2f} MiB"
        return (
            f"Plan({self.kind}, peak {self.predicted_peak_bytes / mib:.2f} MiB "
            f"(unplanned {self.baseline.peak_bytes / mib:.2f}, budget {budget}), "
            f"time x{self.summary()['time_ratio']:.3f}, {self.solver_status}, gap {self.gap:.2%})"
        )
