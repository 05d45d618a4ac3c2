"""Plans replayed instead of solved: the plan a copy of an optimized module carries from its original, or a plan
file (plan=PATH, or the plan cache with plan="auto"), when it was made for this graph, these settings and this use
of the outputs. plans.reuse rebuilds its problem with the recorded costs and re-simulates its decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.fx as fx

from ..budget import FIRST_MICRO_BATCH, LARGER_TRAINING_PROGRAM, BudgetResolution
from ..capture.joint_graph import JointGraph, build_joint_graph
from ..capture.output_usage import OutputUsage
from ..executors import runs_on
from ..passes.chunking import chunk, copy_graph
from ..plans.cache import accumulation_path, find_plan_file, plan_path
from ..plans.file_format import PlanFile, PlanFileError
from ..plans.reuse import plan_from_file
from ..settings import PlanningSettings
from .fusion import Fusion
from .optimizer_step import WholeStep, warn_when_not_stepping
from .program import Planned, ProgramKind, Target


@dataclass
class Found:
    """Where a solved plan of the graph is saved (`path`, None: nowhere) and the plan file or carried plan found for
    it (`pf`): what makes that not this program's plan (`mismatch`, None: it is), whether it was made with bytes
    another program lent (`lent`: then a difference is the loop's history, planned again without a
    PlanMismatchError) and, when it matches, the record of those bytes (`lent_record`)."""

    path: Path | None
    pf: PlanFile | None = None
    mismatch: str | None = None
    lent: bool = False
    lent_record: dict | None = None

    def replay_usage(self, usage: OutputUsage | None, observed: OutputUsage | None) -> tuple[bool, OutputUsage | None]:
        """Whether `pf` is replayed, and for which output usage: the file's record replaces our guess (`usage`
        when no backward was `observed`); it must then be the usage planned for."""
        recorded = self.pf.data["made_for"].get("outputs")
        if self.mismatch is None and usage is not None and recorded is not None and observed is None:
            usage = OutputUsage.parse(recorded)  # our guess, against what the file's run saw the caller do
        return self.mismatch is None and (usage.describe() if usage is not None else None) == recorded, usage


class PlanFiles:
    """Where one planner's plans are found and saved: `settings`' plan option, the plans a copy carries from its
    original (`carried`, by fingerprint hash), compared under the budget's `resolution`."""

    def __init__(self, settings: PlanningSettings, resolution: BudgetResolution, carried: dict[str, list[PlanFile]]):
        self.settings = settings
        self.resolution = resolution
        self.carried = carried

    def find(self, fp: dict, wanted: dict, target: Target) -> Found:
        """The plan for graph `fp` made for `wanted` (Planner.made_for): a carried one that matches, else the file
        of the plan option (plans.cache); and the path a solved plan is saved to."""
        s = self.settings
        # the cache keys the chunking setting too: a plan chunked under chunking=True is not replayed without it
        path = plan_path(s.plan_spec, fp["hash"], {**wanted, "chunk_counts": s.chunk_key})
        pf = next((pf for pf in self.carried.get(fp["hash"], ()) if self.mismatch(pf, fp, wanted, target)[0] is None), None)
        if path is not None and s.plan_spec != "auto" and wanted["grads_at_start"]:
            path = accumulation_path(path)  # the same graph, started with gradients: a file of its own
        if pf is None and path is not None:  # plan=PATH: PATH, or the file beside it for this graph (plans.cache)
            path, pf = find_plan_file(path, fp, cached=s.plan_spec == "auto")
        if pf is None:
            return Found(path)
        return Found(path, pf, *self.mismatch(pf, fp, wanted, target))

    def mismatch(self, pf: PlanFile, fp: dict, wanted: dict, target: Target) -> tuple[str | None, bool, dict | None]:
        """What makes `pf` not the plan of graph `fp` made for `wanted` (None: it is); whether it was made with the
        bytes a larger training program or the first micro-batch's plan lent (`BudgetResolution.lend_larger`); and,
        when it matches, the record of those bytes. Such a plan is this program's while the loop lends the same
        bytes; otherwise the program is planned again: what differs is the loop's history, not the settings."""
        wanted = dict(wanted)
        if (executor := self.file_executor(pf, target)) is not None:
            wanted["executor"] = executor
        made = pf.data["made_for"]
        if made.get("budget_from") == FIRST_MICRO_BATCH and self.resolution.is_percentage:
            # an accumulation step's bytes came from the first micro-batch's plan (replayed from its own file)
            mismatch = pf.describe_mismatch(fp, **{**wanted, "budget_from": FIRST_MICRO_BATCH,
                                                   "budget_resolved_bytes": made.get("budget_resolved_bytes")})
        elif made.get("budget_from") != LARGER_TRAINING_PROGRAM or not self.resolution.is_percentage:
            return pf.describe_mismatch(fp, **wanted), False, None
        else:
            largest = self.resolution.largest
            mismatch = pf.describe_mismatch(fp, **{**wanted, "budget_from": LARGER_TRAINING_PROGRAM,
                                                   "budget_resolved_bytes": largest["bytes"] if largest is not None else None})
        return mismatch, True, dict(made.get("budget_reference") or {}) if mismatch is None else None

    def file_executor(self, pf: PlanFile, target: Target) -> str | None:
        """The executor `pf` was made with, where it may replace the target's: the caller named none (the default
        is this device's pick, not a setting: a plan made elsewhere, as plan_offline's "eager" for a GPU whose
        default is Inductor, is replayed, not refused) and it runs here. None otherwise: an executor the caller
        named, or one that cannot run here, is compared as it is (a mismatch)."""
        name = pf.data["made_for"].get("executor")
        if self.settings.executor is not None or name == target.executor.name or not runs_on(name, target.device):
            return None
        return name


def replay(pf: PlanFile, gm: fx.GraphModule, jg: JointGraph, kind: ProgramKind, usage: OutputUsage | None,
           target: Target, fusion: Fusion, resident: Sequence[tuple[str, int]] = (), step: WholeStep | None = None) -> Planned:
    """`pf`'s plan on this graph, or on a chunked copy of it when the plan was made for the chunked graph (then that
    copy is what to lower); its groups compiled, not timed (the file's costs replace the times). `step`: the
    optimizer's update the plan was made with (its graph: the update after the backward, or inside it for the
    parameters the file lists), `resident`: what is on the device all step that no program reads."""
    inside = pf.data["summary"].get("updates_in_backward") or []
    if step is not None:
        graph = step.in_backward_graph(gm, jg) if inside else step.after_graph(gm, jg)
        if graph is None:
            raise PlanFileError(f"{pf.path}: it updates {len(inside)} parameter(s) inside the backward, which this "
                                "step cannot (updates_in_backward=False, or no gradient the backward makes alone)")
        gm, jg = graph
    planned = _replay(pf, gm, jg, kind, usage, target, fusion, resident)
    planned.plan.optimizer = pf.data["made_for"].get("optimizer")
    if inside:
        planned.plan.updates_in_backward = list(inside)
        warn_when_not_stepping(planned.plan, planned.items, planned.plan.budget_bytes)
    return planned


def _replay(pf: PlanFile, gm: fx.GraphModule, jg: JointGraph, kind: ProgramKind, usage: OutputUsage | None,
            target: Target, fusion: Fusion, resident: Sequence[tuple[str, int]]) -> Planned:
    chunks = pf.data.get("summary", {}).get("chunks") or {}
    if any(k > 1 for k in chunks.values()):
        gm = copy_graph(gm)
        chunk(gm, chunks)
        jg = build_joint_graph(gm, jg.num_fwd_outputs)
    plan, items = plan_from_file(jg, gm, pf, kind.value, usage, profile=target.profile, offload=target.offload,
                                 fuse=lambda built, groups: fusion.fuse(jg, built, groups, measure=False),
                                 resident=resident)
    plan.chunks = dict(chunks)
    return Planned(plan, items, jg)
