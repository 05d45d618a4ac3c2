"""PyTorch's own choice: what `torch.compile`'s min-cut partitioner saves and recomputes, as an optsched `Schedule`.

The comparison is with the real thing, not a re-implementation: `capture_training_step` captures a
model's joint forward+backward graph through AOTAutograd exactly as optsched's backend does (the same
`prepare_training` passes, `build_joint_graph`, `build_problem`, the same guessed output usage), and
keeps an untouched copy of the joint graph. `mincut_choice` hands a copy of that graph to
`torch._functorch.partitioners.min_cut_rematerialization_partition` under
`torch._functorch.config.patch(activation_memory_budget=...)` and reads its answer back:

- recomputed = the forward compute nodes that reappear in torch's backward graph (both graphs keep the
  joint graph's node names);
- saved = what torch's forward returns beyond the forward's own outputs.

The schedule runs the forward in program order and the backward in program order with each recomputed
forward op placed just before the first backward step that needs it (`place_recomputes`), which is where
torch's `reordering_to_mimic_autograd_engine` puts it too. The simulator then judges it like any plan;
`MinCutChoice.saved_storages` lets a caller check that the storages the simulator keeps across the
forward/backward boundary are exactly the ones torch saves (tests/test_pytorch_mincut.py does).

Where the two views of the graph cannot agree, the choice says so in `notes` rather than guessing:
a backward-only op of the problem that torch computes in its forward (its "unclaimed" nodes) stays in the
backward; a recomputation the problem forbids (random ops) is dropped; joint nodes torch's CSE merged are
listed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .._torch import aot_autograd, default_partition, dynamo_reset, functorch_config, min_cut_rematerialization_partition
from ..capture.joint_graph import JointGraph, build_joint_graph
from ..capture.output_usage import default_usage, tangent_outputs
from ..costs.problem_builder import Built, build_problem, reuse_candidates
from ..costs.profiles import DeviceProfile, get_profile
from ..costs.profiling import profile_nodes
from ..passes.prepare import prepare_training
from ..solvers import Phase, Problem, Schedule, SimResult, TensorKind, simulate
from ..solvers.search.heuristics import place_recomputes


@dataclass
class CapturedStep:
    """One training step's joint graph as AOTAutograd handed it to the partitioner, and optsched's Problem of it."""

    joint: fx.GraphModule  # after optsched's own pass (identity clones dropped), never handed to a partitioner
    num_fwd_outputs: int
    partition_kwargs: dict  # what AOTAutograd passed the partitioner besides num_fwd_outputs
    graph: JointGraph  # of `joint`
    built: Built  # problem + op id -> node

    @property
    def problem(self) -> Problem:
        return self.built.problem


@dataclass
class MinCutChoice:
    activation_memory_budget: float
    schedule: Schedule
    sim: SimResult
    recomputed: list[str]  # forward ops (problem op names) torch's backward runs again
    saved: list[str]  # node names torch's forward hands its backward (tensors only)
    saved_storages: set[int]  # problem tensor ids of the saved activations (not inputs, not step outputs)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "activation_memory_budget": self.activation_memory_budget,
            "peak_bytes": self.sim.peak_bytes,
            "time_s": self.sim.time_s,
            "n_recomputed": len(self.recomputed),
            "n_saved": len(self.saved),
            "notes": list(self.notes),
        }


def capture_training_step(
    model: torch.nn.Module, inputs: tuple, *, profile: str | DeviceProfile = "cpu", measure: bool = False
) -> CapturedStep:
    """Capture `model(*inputs)`'s training step (the forward returns the loss) and build optsched's Problem.

    Op times are `profile`'s roofline, or measured on this machine when `measure` (as optimize() does on
    CPU by default; measured times vary between runs). Nothing is compiled or run beyond one forward call."""
    prof = get_profile(profile, torch.device("cpu"))
    captured: dict = {}

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        prepare_training(joint)
        jg = build_joint_graph(joint, num_fwd_outputs)
        usage = default_usage(jg, tangent_outputs(joint, jg.tangents))
        costs = profile_nodes(joint, torch.device("cpu"), reuse_candidates(jg)) if measure else None
        built = build_problem(jg, prof, name=type(model).__name__, measured=costs, usage=usage)
        kept = copy.deepcopy(joint)
        captured["step"] = CapturedStep(kept, num_fwd_outputs, dict(kwargs), build_joint_graph(kept, num_fwd_outputs), built)
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    def keep(gm, _example_inputs):
        return gm

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition)
    dynamo_reset()
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        with torch.enable_grad():
            compiled(*inputs)
    finally:
        dynamo_reset()
    if "step" not in captured:
        raise RuntimeError("no training graph was captured: does some parameter or input require grad?")
    step = captured["step"]
    names = [o.name for o in step.problem.ops]
    kept_names = {n.name for n in step.joint.graph.nodes}
    if not set(names) <= kept_names:  # pragma: no cover - deepcopy keeps node names
        raise RuntimeError("the kept joint graph lost node names")
    return step


def torch_partition(step: CapturedStep, activation_memory_budget: float, compiler: str = "inductor"
                    ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut partition of a fresh copy of the step's joint graph at `activation_memory_budget`.
    `compiler`: the partitioner's op lists ("inductor", torch.compile's default)."""
    joint = copy.deepcopy(step.joint)
    with functorch_config.patch(activation_memory_budget=float(activation_memory_budget)):
        return min_cut_rematerialization_partition(
            joint, None, compiler, num_fwd_outputs=step.num_fwd_outputs, **step.partition_kwargs
        )


def mincut_choice(step: CapturedStep, activation_memory_budget: float, compiler: str = "inductor") -> MinCutChoice:
    """torch's saved-vs-recomputed decision at `activation_memory_budget`, as a Schedule of `step.problem`,
    simulated."""
    problem = step.problem
    fw, bw = torch_partition(step, activation_memory_budget, compiler)
    op_of = {o.name: o.id for o in problem.ops}
    fw_calls = [n.name for n in fw.graph.nodes if n.op == "call_function"]
    bw_calls = [n.name for n in bw.graph.nodes if n.op == "call_function"]
    notes: list[str] = []

    recompute, forbidden = [], []
    for name in bw_calls:
        oid = op_of.get(name)
        if oid is None or problem.ops[oid].phase is not Phase.FW:
            continue  # a view (no op of its own) or a backward op
        (recompute if problem.ops[oid].recomputable else forbidden).append(oid)
    if forbidden:
        notes.append(f"torch recomputes {len(forbidden)} op(s) optsched never recomputes (kept saved): "
                     + ", ".join(problem.ops[o].name for o in forbidden[:5]))
    moved = [n for n in fw_calls if n in op_of and problem.ops[op_of[n]].phase is Phase.BW]
    if moved:
        notes.append(f"torch runs {len(moved)} backward-only op(s) in its forward (kept in the backward here): "
                     + ", ".join(moved[:5]))
    present = set(fw_calls) | set(bw_calls)
    merged = [o.name for o in problem.ops if o.name not in present and o.outputs]
    if merged:
        notes.append(f"{len(merged)} op(s) absent from both of torch's graphs (merged by its CSE or dead): "
                     + ", ".join(merged[:5]))

    schedule = place_recomputes(problem, [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops], recompute)
    sim = simulate(problem, schedule)
    saved_nodes = [n for n in _fw_saved(fw, step.num_fwd_outputs)
                   if isinstance(n.meta.get("val"), torch.Tensor)]
    node_of = {n.name: n for n in step.joint.graph.nodes}
    storages = {step.graph.storage_of[node_of[n.name]] for n in saved_nodes
                if n.name in node_of and node_of[n.name] in step.graph.storage_of}
    saved_storages = {s for s in storages
                      if problem.tensors[s].kind is TensorKind.ACTIVATION and s not in problem.outputs}
    return MinCutChoice(
        activation_memory_budget=float(activation_memory_budget),
        schedule=schedule,
        sim=sim,
        recomputed=[problem.ops[o].name for o in sorted(set(recompute))],
        saved=[n.name for n in saved_nodes],
        saved_storages=saved_storages,
        notes=notes,
    )


def mincut_sweep(step: CapturedStep, budgets: Iterable[float], compiler: str = "inductor") -> list[MinCutChoice]:
    return [mincut_choice(step, b, compiler) for b in budgets]


def non_monotone(choices: list[MinCutChoice], key: str = "peak_bytes") -> list[tuple[float, float]]:
    """Pairs (lower budget, higher budget) of adjacent settings where the lower `activation_memory_budget`
    gives the higher `key` (a simulated peak above the next larger budget's: not monotone)."""
    by_budget = sorted(choices, key=lambda c: c.activation_memory_budget)
    out = []
    for lo, hi in zip(by_budget, by_budget[1:]):
        if lo.summary()[key] > hi.summary()[key]:
            out.append((lo.activation_memory_budget, hi.activation_memory_budget))
    return out


def _fw_saved(fw: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    (out,) = fw.graph.find_nodes(op="output")
    values = out.args[0]
    return [v for v in list(values)[num_fwd_outputs:] if isinstance(v, fx.Node)]
