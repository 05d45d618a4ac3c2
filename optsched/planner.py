"""The one orchestrator: a captured graph becomes a `Plan`.

    graph ─fingerprint─> plan file or carried plan that matches? ─yes─> replayed (plans.reuse)
      │ no
      └─> Problem (costs.problem_builder, op times measured or roofline)
          ─> the executor's fusion groups merged into ops (solvers.search.fusion_groups; compiled and
             timed by executors.groups)
          ─> horizontal candidates offered as fusion options (compiled and timed alike), solved once within
             the user's own checkpointing (user_checkpoint, solvers.solve: search.fusion_options decides them)
          ─> the formed ones merged too, for lowering (the merged plan simulates to the solve's peak and time)
          ─> Plan: budget resolution recorded, plan file saved when asked (plans.cache), reported

Vertical groups are merged before solving, not offered: they save launches and memory (their
intermediates are never materialized), a win in nearly every plan, and merging them shrinks the
problem every solver sees. Horizontal groups trade memory for time (their members' outputs live
together), which only the solver, knowing the budget and the order, can judge: they are options.

The compile hooks (`compiler.backend.PlanningBackend`, `compiler.offline.OfflineBackend`) make one
`Planner` per compiled program, for its `Target` (device, timing, profile, offloads, executor), and
call `Planner.plan` from AOTAutograd's hooks; lowering the plan is theirs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from .budget import FIRST_MICRO_BATCH, LARGER_TRAINING_PROGRAM, Budget, BudgetResolution
from .capture.fingerprint import fingerprint
from .capture.joint_graph import JointGraph, build_joint_graph
from .capture.output_usage import OutputUsage
from .costs.problem_builder import Built, build_problem, reuse_candidates
from .costs.profiles import DeviceProfile, NodeCosts, get_profile
from .costs.measure import unread_state
from .costs.profiling import profile_nodes, real_placeholders
from .executors import get_executor, runs_on
from .executors.base import Executor
from .executors.groups import Group, build_group, compile_groups, horizontal_candidates, roofline_time
from .lower.chunked_ce import CHUNK_COUNTS
from .passes.chunking import Chain, chunk, copy_graph, find_chains, why_no_chain
from .plans.cache import accumulation_path, find_plan_file, plan_path, save_or_warn
from .plans.file_format import PlanFile, PlanMismatchError
from .plans.plan import Plan
from .plans.reuse import plan_from_file, start_schedule
from .progress import LiveLine
from .settings import PlanningSettings
from .solvers import (
    BudgetInfeasibleError, PlanningTimeLimitError, Problem, Schedule, ScheduleError, SimResult, Solution, TensorKind,
    default_schedule, simulate, solve,
)
from .solvers.model import clock
from .solvers.model.problem import FusionOption, convexity_violation
from .solvers.search.fusion_groups import find_groups, fuse_ops, merge_formed
from .solvers.search.heuristics import lower_bound_peak
from .user_checkpoint import reference_peak, solve_within_user_checkpointing

DEFAULT_TIME_LIMIT_S = 5.0  # at least this long; larger graphs get DEFAULT_S_PER_OP per op
DEFAULT_S_PER_OP = 0.02
DEFAULT_TIME_LIMIT_MAX_S = 30.0  # and at most this: repeated blocks are searched alike, so depth costs little
OP_TIMING_SHARE = 0.5  # op timing stops after this share of the time limit (wall seconds): the ops left, the roofline's
DEFAULT_HOST_SHARE = 0.5  # offloads may take this share of the machine's physical memory by default
CHUNK_TIE = 0.01  # more chunks are chosen only when their plan is faster by more than this share
COUNT_MIN_SHARE = 0.1  # after the first count, counts are tried while this share of the time limit is left


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_budget_bytes(host_budget: Budget | None) -> int:
    """The host memory offloads may take: the option's bytes, else DEFAULT_HOST_SHARE of physical memory."""
    physical = physical_memory_bytes()
    if host_budget is not None and host_budget.spec is not None:
        return host_budget.resolve(physical)
    return int(DEFAULT_HOST_SHARE * physical)


def default_offload(offload: bool | None, device_type: str) -> bool:
    """None: offload where host memory is really another memory (on CUDA, not on CPU)."""
    return device_type == "cuda" if offload is None else offload


COST_CACHE_SIZE = 8  # graphs whose measured op costs one optimized callable keeps (CostCache)


class CostCache:
    """Measured op costs by graph, the COST_CACHE_SIZE most recent: shared by the planners of one optimized
    callable, so a program planned again for the same graph (the caller used its outputs otherwise than the
    first plan assumed: capture/output_usage.py) reuses the op times, scratch space and in-place checks
    measured the first time instead of running every op again. Keyed by the graph's fingerprint hash, its
    node names (what the costs are keyed by) and the device."""

    def __init__(self, size: int = COST_CACHE_SIZE):
        self.size = size
        self.entries: OrderedDict[tuple[str, str, str], NodeCosts] = OrderedDict()

    @staticmethod
    def key(gm: fx.GraphModule, device: torch.device) -> tuple[str, str, str]:
        fp = fingerprint(gm)
        names = hashlib.sha256("\n".join(row[0] for row in fp["nodes"]).encode()).hexdigest()
        return fp["hash"], names, str(device)

    def get(self, key: tuple[str, str, str]) -> NodeCosts | None:
        costs = self.entries.get(key)
        if costs is not None:
            self.entries.move_to_end(key)
        return costs

    def put(self, key: tuple[str, str, str], costs: NodeCosts) -> None:
        self.entries[key] = costs
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


@dataclass
class Target:
    """What one program is planned for: its device, whether op times are measured there (else the
    profile's roofline), the profile, whether saved activations may wait in host memory and how much of
    it, and who runs fusion groups."""

    device: torch.device
    measure: bool
    profile: DeviceProfile
    offload: bool
    host_budget_bytes: int
    executor: Executor

    @classmethod
    def for_device(cls, settings: PlanningSettings, device: torch.device) -> Target:
        """The target of a program captured on `device` (torch.compile)."""
        wants = settings.device_profile
        # default: measure op times on the device at hand (on an H200 the roofline put a Llama step at 0.56x of
        # what ran); a named profile means the roofline
        measure = wants == "measured" or (wants is None and device.type in ("cpu", "cuda"))
        profile = get_profile(None if wants == "measured" else wants, device)
        return cls(
            device, measure, profile, default_offload(settings.offload, device.type),
            host_budget_bytes(settings.host_budget), get_executor(settings.executor, device),
        )


@dataclass(frozen=True)
class Floor:
    """Peaks proven before any op is timed or fusion group compiled (`Planner.floor`): they hold whatever
    the measured costs and whichever fusion groups are formed."""

    bound: int  # no plan of the graph as captured goes below it (0: not computed, the unplanned plan meets the budget)
    resident: int  # parameters, buffers, the batch, unread state and the step's outputs (gradients): any graph of the step
    unplanned: int  # the graph as captured, unplanned, kernel scratch not counted


class ScratchNotMeasuredWarning(UserWarning):
    """A plan made while another profiler ran: kernel scratch space is unknown (counted as 0)."""


class Planner:
    """Plans the programs of one compiled callable for one target (see the module docstring).

    `resolution`: the budget as the optimized callable means it, shared by all its planners
    (see BudgetResolution). `carried`: plans a copy of an optimized module carries from its original,
    by fingerprint hash, replayed instead of solved. `observed_usage`: what a backward showed the
    caller doing with the outputs (None: only the guess, which a plan file's record may replace).
    `costs`: op times for a graph (default: measured on the device when the target measures, else
    None, the profile's roofline)."""

    def __init__(
        self,
        settings: PlanningSettings,
        target: Target,
        on_plan: Callable[[Plan], None],
        *,
        resolution: BudgetResolution | None = None,
        carried: dict[str, list[PlanFile]] | None = None,
        observed_usage: OutputUsage | None = None,
        costs: Callable[[fx.GraphModule, JointGraph], NodeCosts | None] | None = None,
        grads_at_start: bool = False,
        cost_cache: CostCache | None = None,
        first_micro_batch: Callable[[], Plan | None] | None = None,
    ):
        self.settings = settings
        self.target = target
        self.on_plan = on_plan
        self.resolution = resolution if resolution is not None else BudgetResolution(settings.budget)
        self.carried = carried or {}
        self.observed_usage = observed_usage
        self.costs = costs or self.measured_costs
        self.cost_cache = cost_cache  # measured costs of graphs planned before (shared by one optimized callable's planners)
        self.grads_at_start = grads_at_start  # an accumulation step (api.grads_at_start)
        # an accumulation step's plan of the same step without gradients to start with (see _accumulate_as_first)
        self.first_micro_batch = first_micro_batch or (lambda: None)
        self.caller_inputs: list[Callable[[], object]] = []  # the compiled call's inputs, weakly (see hold_inputs)
        self.unread_state: list[tuple[str, int]] = []  # the module's state the program does not read (see hold_inputs)
        self._lent: dict | None = None  # this program's budget: a larger training program's bytes (_lend_larger)
        self._lent_note: str | None = None
        self._reach: Callable[[int], int] | None = None  # chunking="auto": the chunked graphs' floor (_solve_graph_timed)
        # the first call's guess drops outputs the caller may keep through the backward: their storages, held by the
        # plan too when a plan with them held fits the same bytes (`_solve`), and whether it did (see `plan`)
        self._hold_if_fits: tuple[frozenset[int], tuple[int, ...]] = (frozenset(), ())  # storages, output indices
        self._held_outputs: tuple[int, ...] = ()

    def hold_inputs(self, values: list, state: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        """The real values the captured program's inputs stand for (parameters first): op timing reads
        them in place instead of making copies. Held weakly, so a batch is not kept alive by its plan.
        `state`: the module's named parameters and buffers; those the program does not read are on the
        device all the same, and every plan counts them (an unused 4 MiB Linear was 4 MiB over budget)."""
        self.caller_inputs = [weakref.ref(v) if isinstance(v, torch.Tensor) else (lambda v=v: v) for v in values]
        self.unread_state = unread_state(state, values, self.target.device)

    def measured_costs(self, gm: fx.GraphModule, jg: JointGraph) -> NodeCosts | None:
        t = self.target
        if not t.measure:
            return None
        key = CostCache.key(gm, t.device) if self.cost_cache is not None else None
        if key is not None and (known := self.cost_cache.get(key)) is not None:
            return known  # the same graph planned again (another use of its outputs): its ops timed once
        real = real_placeholders(gm, [ref() for ref in self.caller_inputs])
        ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        limit = OP_TIMING_SHARE * time_limit(self.settings.time_limit_s, ops)
        costs = profile_nodes(gm, t.device, reuse_candidates(jg), real_inputs=real, time_limit_s=limit)
        if key is not None and costs.scratch_measured:  # measured under another profiler: measure again next time
            self.cost_cache.put(key, costs)
        return costs

    def plan(self, gm: fx.GraphModule, jg: JointGraph, name: str, usage: OutputUsage | None = None) -> tuple[Plan, list]:
        """The plan for this graph and, per op of its problem, the node or fusion group it runs: from
        the plan file (or a carried plan) when one matches, else solved (and saved when asked)."""
        fp = fingerprint(gm)
        self._lent, self._lent_note = None, None  # a larger training program's bytes, when this one takes them
        self._held_outputs = ()
        # the cache keys the chunking setting too: a plan chunked under chunking=True is not replayed without it
        path = plan_path(self.settings.plan_spec, fp["hash"],
                         {**self.made_for(name), "chunk_counts": self.settings.chunk_key})
        pf = self._carried_plan(fp, name)  # a copy of an optimized module replays its original's plans
        if path is not None and self.settings.plan_spec != "auto" and self.made_for(name)["grads_at_start"]:
            path = accumulation_path(path)  # the same graph, started with gradients: a file of its own
        if pf is None and path is not None:  # plan=PATH: PATH, or the file beside it for this graph (plans.cache)
            path, pf = find_plan_file(path, fp, cached=self.settings.plan_spec == "auto")
        if pf is not None:
            mismatch, lent = self._mismatch(pf, fp, name)
            recorded = pf.data["made_for"].get("outputs")
            if mismatch is None and usage is not None and recorded is not None and self.observed_usage is None:
                usage = OutputUsage.parse(recorded)  # our guess, against what the file's run saw the caller do
            if mismatch is None and (usage.describe() if usage is not None else None) == recorded:
                t = self.target
                if (executor := self._file_executor(pf)) is not None:  # the executor that formed the file's groups
                    t.executor = get_executor(executor, t.device)
                chunks = pf.data.get("summary", {}).get("chunks") or {}
                if any(k > 1 for k in chunks.values()):  # the plan was made for the chunked graph: make it again
                    chunk(gm, chunks)
                    vars(jg).update(vars(build_joint_graph(gm, jg.num_fwd_outputs)))
                plan, items = plan_from_file(
                    jg, gm, pf, name, usage, profile=t.profile, offload=t.offload,
                    fuse=lambda built, groups: self.fuse(jg, built, groups, measure=False),  # costs come from the file
                )
                plan.chunks = dict(chunks)
                self._record_budget(plan, fp, items)
                self.on_plan(plan)
                return plan, items
            if mismatch is None or lent:
                pass  # the caller now uses the outputs otherwise, or the loop lends other bytes: plan again
            elif self.settings.on_mismatch == "error":
                raise PlanMismatchError(
                    f"plan file {path} does not match: {mismatch}. Pass on_mismatch='replan' to plan again and "
                    "overwrite it, or use another plan file"
                )
        from .solvers.model.problem import collecting_rejections, rejections_in

        # errors this graph's passes and planning expected and recovered from (a fusion group not convex, an op's
        # FLOP formula raising, ...): counted on the plan (the solver's own are in its notes already)
        with collecting_rejections(rejections_in(gm.meta).copy()) as recovered:
            plan, items = self._solve_graph(gm, jg, name, usage)
        plan.stats.notes += recovered.notes()
        if self._held_outputs and usage is not None:  # planned for a caller that keeps those outputs too (`_solve`)
            usage = OutputUsage(usage.grad, tuple(h or i in self._held_outputs for i, h in enumerate(usage.held)))
        plan.fingerprint, plan.offload_allowed = fp, self.target.offload
        plan.output_usage = usage.describe() if usage is not None else None
        self._record_budget(plan, fp, items)
        if path is not None:  # a save the file system refuses warns: the plan is made, the step runs
            save_or_warn(plan.save, path, cached=self.settings.plan_spec == "auto")
        self.on_plan(plan)
        return plan, items

    def made_for(self, name: str) -> dict:
        """What a plan file must have been made for (its output usage is checked apart: see `plan`).
        A percentage budget adds how it resolves for this program (a share of its own peak, or the bytes a
        forward-only program takes from a training program: BudgetResolution.made_for), so a plan is never
        reused for other bytes (and the plan cache keys them apart)."""
        t = self.target
        return {"kind": "training" if name == "training step" else "inference", "budget": str(self.settings.budget),
                "device_profile": t.profile.name, "executor": t.executor.name, "offload": t.offload,
                "grads_at_start": self.grads_at_start and name == "training step",
                **self.resolution.made_for(training=name == "training step")}

    def floor(self, jg: JointGraph, usage: OutputUsage | None = None, budget: int | None = None) -> Floor:
        """The graph's floor, before its ops are timed: its problem as the most favourable measurement would
        make it (no kernel scratch, every in-place write profiling could allow: a superset of the plans of any
        measured problem, so its bound is below theirs; where no op is measured, the problem itself), with the
        executor's vertical fusion groups offered as fusion options (their inner values count 0 for any subset
        formed, as merged groups' do; horizontal candidates, ops of one depth, hide no value). Tens of
        milliseconds on the 4-layer GPT; the bound is not computed (0) for a `budget` the unplanned peak meets."""
        t = self.target
        costs = self.costs(jg.gm, jg) if not t.measure else NodeCosts({}, {}, dict.fromkeys(reuse_candidates(jg), True))
        built = build_problem(jg, t.profile, name="floor", measured=costs, offload=t.offload,
                              host_budget_bytes=t.host_budget_bytes, usage=usage, device=t.device,
                              grads_at_start=self.grads_at_start, unread_state=self.unread_state)
        p = built.problem
        fusible = [t.executor.can_fuse(n) and not _reads_tangent(jg, n) for n in built.nodes]
        groups = find_groups(p, fusible)
        if groups:
            p = dataclasses.replace(p, fusion_options=tuple(FusionOption(tuple(g), 0.0) for g in groups))
        inputs = sum(x.bytes for x in p.tensors if x.kind is TensorKind.INPUT)
        outputs = sum(p.tensors[i].bytes for i in p.outputs if p.tensors[i].kind is not TensorKind.INPUT)
        unplanned = simulate(p, default_schedule(p)).peak_bytes
        bound = 0 if budget is not None and budget >= unplanned else lower_bound_peak(p)  # no plan goes below
        return Floor(bound, inputs + outputs, unplanned)

    def _counts_tried(self, chains: list[Chain]) -> tuple[int, ...]:
        """The chunk counts this planning tries (1: the graph as captured)."""
        if not chains:
            return (1,)
        return CHUNK_COUNTS if self.settings.chunk_when_needed else self.settings.chunk_counts

    def _chunk_floors(self, gm: fx.GraphModule, jg: JointGraph, usage: OutputUsage | None, counts: Iterable[int],
                      budget: int, floor: Floor | None = None) -> dict[int, int]:
        """Per chunk count (1: the graph as captured), its graph's floor, until one is at or below `budget` (then
        the rest are not needed). Below the resident bytes no chunked graph is built: they bound every count
        (chunking rewrites the head's inside, not the step's inputs and outputs)."""
        floor = floor or self.floor(jg, usage)
        out: dict[int, int] = {}
        for k in counts:
            if k == 1:
                out[k] = floor.bound
            elif budget < floor.resident:
                out[k] = floor.resident
            else:
                g = copy_graph(gm)
                chunk(g, k)
                out[k] = self.floor(build_joint_graph(g, jg.num_fwd_outputs), usage, budget).bound
            if out[k] <= budget:
                break
        return out

    def _reach_of_chunking(self, gm: fx.GraphModule, jg: JointGraph, usage: OutputUsage | None, budget: int,
                           floor: Floor | None = None) -> tuple[int, int]:
        """(the lowest floor of the chunked graphs, at or below `budget` when one is; the resident bytes): the
        error of the graph as captured with chunking off suggests chunking only where it might reach the budget."""
        floor = floor or self.floor(jg, usage)
        return min(self._chunk_floors(gm, jg, usage, CHUNK_COUNTS[1:], budget, floor).values()), floor.resident

    def _refuse_below_floor(self, gm: fx.GraphModule, jg: JointGraph, usage: OutputUsage | None, chains: list[Chain],
                            skipped: list[str], asked: bool) -> None:
        """Raise the proven BudgetInfeasibleError before any op is timed, fusion group compiled or search run when
        the budget's bytes are known already (bytes, "auto", a forward-only program's lender's) and below the floor
        of every graph this planning would try: the graph as captured, its chunked graphs where chunking is on
        (issue 33: a 1000-byte budget on the 4-layer GPT timed its ops and searched for 11-50 s to say so)."""
        budget = self.resolution.fixed_bytes(training=jg.is_training)
        if budget is None:
            return
        floor = self.floor(jg, usage, budget)
        counts = self._counts_tried(chains)
        if 1 in counts and budget >= floor.bound:
            return
        floors = self._chunk_floors(gm, jg, usage, counts, budget, floor)
        if min(floors.values()) <= budget:
            return
        if chains:
            failures = [(k, BudgetInfeasibleError(budget, floor.unplanned, b, searched=False)) for k, b in floors.items()]
            e = _chunked_infeasible(budget, failures, [c.name for c in chains], self.settings.chunking,
                                    resident=floor.resident)
        else:
            e = BudgetInfeasibleError(budget, floor.unplanned, floor.bound, searched=False)
            if jg.is_training and not asked:
                chains, skipped = find_chains(gm)
            reach = self._reach_of_chunking(gm, jg, usage, budget, floor) if chains and not asked else None
            _say_why_not_chunked(e, gm, chains, skipped, self.settings.chunking, asked, reach)
        how = self.resolution.explain(floor.unplanned, training=jg.is_training)
        if how is not None:
            e.args = (f"{e.args[0]}; {how}",)
        raise e

    def _lend_larger(self, own: int | None, reference: int, training: bool, bound: Callable[[], int]) -> int | None:
        """A training program whose own share of a percentage (`own`) is below its proven bound (`bound()`, computed
        only when a larger program's bytes could be lent) plans with the bytes of the largest training program
        planned so far (BudgetResolution.lend_larger): recorded for its plan (`_lent`, a note)."""
        r = self.resolution
        largest = r.largest if own is not None and training and r.is_percentage else None
        if largest is None or largest["bytes"] <= own:
            return own
        lower = bound()
        record = r.lend_larger(own, lower, training)
        if record is None:
            return own
        self._lent = {"program": LARGER_TRAINING_PROGRAM, "unplanned_peak_bytes": record["unplanned_peak_bytes"],
                      "fingerprint": record["fingerprint"], "bytes": record["bytes"], "own_bytes": own,
                      "own_bound_bytes": lower}
        self._lent_note = r.explain_lent(record, own, lower, reference)
        return record["bytes"]

    def _droppable_outputs(self, jg: JointGraph, usage: OutputUsage | None, problem: Problem,
                           ) -> tuple[frozenset[int], tuple[int, ...]]:
        """On the first call's guess (no backward seen yet), the non-scalar outputs a gradient flows into that the
        guess has the caller drop once its loss is made (`default_usage`): their storages and output indices. A
        caller that keeps them through the backward (`out = model(x); loss_fn(out, y).backward()`) holds them longer."""
        if usage is None or self.observed_usage is not None or not jg.is_training or not self.resolution.budget.spec:
            return frozenset(), ()
        storages: set[int] = set()
        indices = []
        for i, o in enumerate(jg.fw_outputs):
            v = o.meta.get("val") if isinstance(o, fx.Node) else None
            if i < len(usage.grad) and usage.grad[i] and not usage.held[i] and isinstance(v, torch.Tensor) and v.dim() > 0:
                storages.update(s for s in jg.node_storages(o) if s in problem.returned)
                indices.append(i)
        return frozenset(storages), tuple(indices)

    def _holding(self, problem: Problem, budget_bytes: int | None) -> Problem | None:
        """`problem` with the outputs `_droppable_outputs` found held to the step's end, when the budget may fit it
        (not below its proven bound): a plan of it fits the caller that drops them and the one that keeps them."""
        hold = self._hold_if_fits[0]
        if not hold or budget_bytes is None or not problem.has_backward:
            return None
        holding = problem.holding(hold)
        return holding if lower_bound_peak(holding) <= budget_bytes else None

    def _first_micro_batch(self, problem: Problem) -> tuple[Schedule, SimResult] | None:
        """An accumulation step under a percentage: the plan of the same step without gradients to accumulate
        into (the first micro-batch's), simulated here with them live; None when there is none or it plans
        other ops (another fusion or chunk count)."""
        if not (self.grads_at_start and problem.has_backward and self.resolution.is_percentage):
            return None
        first = self.first_micro_batch()
        if first is None or [o.name for o in first.problem.ops] != [o.name for o in problem.ops]:
            return None
        try:
            return first.schedule, simulate(problem, first.schedule)
        except (ScheduleError, KeyError, ValueError):
            return None

    def _accumulate_as_first(self, first: SimResult, own: int | None, e: BudgetInfeasibleError, reference: int) -> int:
        """The bytes an accumulation step takes when no plan met its own share: what the first micro-batch's plan
        peaks at with the gradients live (that plan fits them, so the loop goes on at its second micro-batch),
        recorded for its plan (`_lent`, a note)."""
        mib = 2**20
        self._lent = {"program": FIRST_MICRO_BATCH, "unplanned_peak_bytes": reference, "bytes": first.peak_bytes,
                      "own_bytes": own, "own_bound_bytes": e.lower_bound_bytes if e.proven else None}
        self._lent_note = (
            f"an accumulation step (gradients live from its start): its own share of {self.settings.budget} is "
            f"{own / mib:.2f} MiB, which no plan met ({'proven' if e.proven else 'none found'}); planned with "
            f"{first.peak_bytes / mib:.2f} MiB, what the first micro-batch's plan peaks at with the gradients live"
        )
        return first.peak_bytes

    def fuse(
        self, jg: JointGraph, built: Built, groups_of_ops: list[list[int]], cache: dict | None = None, *,
        measure: bool | None = None,
    ) -> tuple[Problem, list]:
        """The problem the solver sees (each group merged into one op) and, per op, its node or group.
        `cache`: kernels and their timings from earlier calls for this graph. `measure`: time the groups
        (default: as the target does); otherwise their time is the roofline's."""
        if not groups_of_ops:
            return built.problem, list(built.nodes)
        t = self.target
        measure = t.measure if measure is None else measure
        groups = [build_group(jg, built.problem, c, built.nodes) for c in groups_of_ops]
        compile_groups(groups, t.executor, t.device, measure, cache)
        times = [g.time_s if measure else roofline_time(g, t.profile) for g in groups]
        fused = fuse_ops(built.problem, groups_of_ops, times)
        by_first = {c[0]: g for c, g in zip(groups_of_ops, groups)}
        ops = [
            dataclasses.replace(op, workspace_bytes=by_first[unit[0]].workspace_bytes) if unit[0] in by_first else op
            for op, unit in zip(fused.problem.ops, fused.members)
        ]
        problem = dataclasses.replace(fused.problem, ops=ops)
        items = [by_first[unit[0]] if unit[0] in by_first else built.nodes[unit[0]] for unit in fused.members]
        return problem, items

    def _solve_graph(self, gm: fx.GraphModule, jg: JointGraph, name: str, usage: OutputUsage | None) -> tuple[Plan, list]:
        """One program's plan; `time_limit_s` is the time of every solve it makes together (chunk counts included),
        counted on the solvers' clock (work in deterministic mode) from one account."""
        self._time = _PlanningTime()
        try:
            with clock.deterministic(self.settings.deterministic_planning):
                return self._solve_graph_timed(gm, jg, name, usage)
        finally:
            self._reach = None  # it holds the graph

    def _solve_graph_timed(self, gm: fx.GraphModule, jg: JointGraph, name: str, usage: OutputUsage | None,
                           ) -> tuple[Plan, list]:
        t = self.target
        chunking, when_needed = self.settings.chunking, self.settings.chunk_when_needed
        asked = jg.is_training and (when_needed or self.settings.chunk_counts != (1,))  # "auto", True, a count > 1
        chains, skipped = find_chains(gm) if asked else ([], [])  # chunking off: looked for only if nothing fits
        self._refuse_below_floor(gm, jg, usage, chains, skipped, asked)  # before any op is timed
        # "auto": the captured graph's own share is provably out of reach only where no chunk count reaches it either
        self._reach = (lambda own: min(self._chunk_floors(gm, jg, usage, CHUNK_COUNTS[1:], own).values())
                       ) if chains and when_needed else None
        costs = self.costs(gm, jg)
        built = build_problem(
            jg, t.profile, name=name, measured=costs,
            offload=t.offload, host_budget_bytes=t.host_budget_bytes, usage=usage, device=t.device,
            grads_at_start=self.grads_at_start, unread_state=self.unread_state,
        )
        if chains and not when_needed:
            plan, items = self._solve_chunked(gm, jg, built, costs, usage, chains)
        else:
            try:
                # "auto" with a chain: the graph as captured gets AUTO_FIRST_SHARE, the chunk counts the rest
                self._time.share = AUTO_FIRST_SHARE if chains else 1.0
                self._hold_if_fits = self._droppable_outputs(jg, usage, built.problem)
                try:
                    plan, items = self._plan_fused(jg, built, len(gm.graph.nodes))
                finally:
                    self._hold_if_fits = (frozenset(), ())
            except BudgetInfeasibleError as e:
                if chains:  # "auto": chunks where the budget cannot be met without them
                    plan, items = self._solve_chunked(gm, jg, built, costs, usage, chains, captured=e)
                else:
                    if jg.is_training and not asked:
                        chains, skipped = find_chains(gm)
                    reach = self._reach_of_chunking(gm, jg, usage, e.budget_bytes) if chains and not asked else None
                    _say_why_not_chunked(e, gm, chains, skipped, chunking, asked, reach)
                    raise
            if asked and not chains:
                plan.stats.notes.append(f"chunking: no LM head + cross-entropy chain found: {why_no_chain(gm, skipped)}")
        if chains and skipped:
            plan.stats.notes.append("chunking: left alone: " + "; ".join(skipped))
        if costs is not None and not costs.scratch_measured:
            note = ("planned while another profiler was running: kernel scratch space was not measured "
                    "(counted as 0) and no op but a gradient sum writes into a dying input")
            plan.stats.notes.append(note)
            warnings.warn(f"optsched: {note}, so a step can peak above its prediction by its kernels' scratch space; "
                          "plan outside the profiling session (one step before it) for measured scratch",
                          ScratchNotMeasuredWarning, stacklevel=2)
        if costs is not None and costs.unmeasured:
            first = next(iter(costs.unmeasured.items()))
            plan.stats.notes.append(f"{len(costs.unmeasured)} op(s) could not run alone on made-up inputs and are timed "
                                    f"by the roofline, e.g. {first[0]}: {first[1]}")
        if costs is not None and costs.estimated:
            plan.stats.notes.append(f"{len(costs.estimated)} op(s) timed by the roofline: op timing reached its share "
                                    f"of the time limit ({OP_TIMING_SHARE:g} of time_limit_s) first")
        return plan, items

    def _solve_chunked(
        self, gm: fx.GraphModule, jg: JointGraph, built: Built, costs: NodeCosts | None, usage: OutputUsage | None,
        chains: list[Chain], captured: BudgetInfeasibleError | None = None,
    ) -> tuple[Plan, list]:
        """The chunk count of the LM head + cross-entropy as a decision (passes/chunking.py): the graph as
        captured (1 chunk) and the graph with the chain in 2, 4, ... chunks, each planned for the same budget
        (the captured graph's); the fastest plan that fits wins, more chunks only when faster by more than
        CHUNK_TIE. The chunked op is timed and its scratch space (one chunk's logits) measured like any op.
        Counts go up until one's plan recomputes nothing and is no faster than the best so far: more chunks
        then only add time. The winner's graph replaces `gm`'s and `jg` is rebuilt for it, so the caller
        lowers the graph that was planned.

        `captured`: chunking="auto", where the graph as captured was planned first and did not fit (this
        error): the counts above 1 are tried for the budget it failed, and a plan that fits says that its
        gradients equal eager's to rounding. When no count fits, the error covers every count
        tried: its bound is the lowest of theirs (one graph's bound does not hold for another's plans)."""
        t = self.target
        if captured is not None:
            counts = tuple(k for k in CHUNK_COUNTS if k > 1)
            budget_bytes = captured.budget_bytes
        else:
            counts = self.settings.chunk_counts
            budget_bytes = None
        baseline = simulate(built.problem, default_schedule(built.problem))
        reference = reference_peak(built.problem, list(built.nodes), baseline)  # the user's checkpointing, if any
        own = self.resolution.bytes_for(reference)  # a training program's own share (or the budget's bytes)
        if budget_bytes is None:  # below every count's floor, a smaller shape takes the bytes given to a larger one
            budget_bytes = self._lend_larger(own, reference, True, lambda: min(
                self._chunk_floors(gm, jg, usage, counts, own).values()))
        tried: list[tuple[int, Plan | None, list, fx.GraphModule | None, JointGraph | None]] = []
        failures: list[tuple[int, BudgetInfeasibleError]] = []
        if captured is not None:
            tried.append((1, None, [], None, jg))
            failures.append((1, captured))
        best = None
        untried: list[int] = []
        for i, k in enumerate(counts):
            if i > 0 and self._time.left() < COUNT_MIN_SHARE * self._time.limit:
                untried = list(counts[i:])  # the time limit is spent: a count's search would overrun it
                break
            self._time.share = 1.0 / min(2, len(counts) - i)  # half of what is left; the last count all of it
            g, jgk, built_k = None, jg, built
            if k > 1:
                g = copy_graph(gm)
                chunk(g, k)
                jgk = build_joint_graph(g, jg.num_fwd_outputs)
                built_k = build_problem(jgk, t.profile, name=built.problem.name, measured=self._chunked_costs(g, jgk, costs),
                                        offload=t.offload, host_budget_bytes=t.host_budget_bytes, usage=usage,
                                        device=t.device, grads_at_start=self.grads_at_start,
                                        unread_state=self.unread_state)
            try:
                plan_k, items_k = self._plan_fused(jgk, built_k, len((g or gm).graph.nodes), budget_bytes)
            except BudgetInfeasibleError as e:
                tried.append((k, None, [], g, jgk))
                failures.append((k, e))
                continue
            tried.append(cand := (k, plan_k, items_k, g, jgk))
            if best is not None and plan_k.sim.time_s >= best[1].sim.time_s * (1 - CHUNK_TIE):
                if not plan_k.sim.recomputed_ops and not plan_k.sim.offloads:
                    break
                continue
            best = cand
        names = [c.name for c in chains]
        if best is None:
            e = _chunked_infeasible(budget_bytes, failures, names, self.settings.chunking, self._time.limit, untried)
            how = self._lent_note or self.resolution.explain(reference)  # a training program's
            below = self.resolution.explain_below_bound(own, e.lower_bound_bytes) if e.proven and not self._lent else None
            if how is not None and below is not None:
                how = f"{how}; {below}"
            if how is not None:
                e.args = (f"{e.args[0]}; {how}",)
            e.args = (e.args[0] + _start_from_note(e),)
            raise e
        k, plan, items, g, jgk = best
        plan.chunks = dict.fromkeys(names, k)
        plan.baseline = baseline  # the captured program's, unplanned: what budgets and ratios refer to
        mib = 2**20
        plan.stats.notes.append("chunks of " + ", ".join(names) + ": " + "; ".join(
            f"{c[0]}: " + (f"{c[1].sim.peak_bytes / mib:.2f} MiB, {c[1].sim.time_s * 1e3:.2f} ms, "
                           f"{len(c[1].sim.recomputed_ops)} recomputed" if c[1] else "does not fit")
            for c in tried) + f"; chose {k}" + (
            f"; not tried (time limit spent): {', '.join(map(str, untried))}" if untried else ""))
        if captured is not None:
            why = (f"lowest peak found {captured.lowest_peak_bytes / mib:.2f} MiB" if captured.searched else
                   f"every plan of it needs {captured.lower_bound_bytes / mib:.2f} MiB")
            plan.stats.notes.append(
                f"chunking='auto': the graph as captured does not fit {budget_bytes / mib:.2f} MiB ({why}), so "
                f"{', '.join(names)} runs in {k} token chunks: "
                "its gradients equal eager's to rounding, not bitwise (the weight's gradient is summed chunk by chunk)")
        plan.chunk_trials = [
            {"chunks": c[0], "fits": c[1] is not None, "predicted_peak_bytes": c[1].sim.peak_bytes if c[1] else None,
             "estimated_time_s": c[1].sim.time_s if c[1] else None,
             "n_recomputed": len(c[1].sim.recomputed_ops) if c[1] else None,
             "recomputed": sorted(c[1].problem.ops[i].name for i in c[1].sim.recomputed_ops) if c[1] else None}
            for c in tried
        ]
        if g is not None:  # the caller lowers gm with jg: make them the chunked graph's
            gm.graph = g.graph
            jgk.gm = gm
            vars(jg).update(vars(jgk))
        return plan, items

    def _chunked_costs(self, g: fx.GraphModule, jg: JointGraph, costs: NodeCosts | None) -> NodeCosts | None:
        """Op times of a chunked graph: the captured graph's, plus the new nodes' (the chunked op, the
        backward's scaling) timed and measured on their own inputs, when the target measures."""
        if costs is None:
            return None
        if self.costs != self.measured_costs:
            return self.costs(g, jg)
        new = [n for n in g.graph.nodes if n.op == "call_function" and n.name not in costs.times]
        sub = _subgraph(g, new)
        reuse = {k: v for k, v in reuse_candidates(jg).items() if k in {n.name for n in new}}
        by_name = {n.name: n for n in sub.graph.nodes}
        reuse = {k: by_name[v.name] for k, v in reuse.items() if not isinstance(v, list) and v.name in by_name}
        measured = profile_nodes(sub, self.target.device, reuse, repeat=2)
        return NodeCosts({**costs.times, **measured.times}, {**costs.workspace, **measured.workspace},
                         {**costs.reuse_ok, **measured.reuse_ok}, costs.scratch_measured and measured.scratch_measured)

    def _plan_fused(self, jg: JointGraph, built: Built, graph_nodes: int, budget_bytes: int | None = None,
                    ) -> tuple[Plan, list]:
        """Plan with the executor's vertical groups merged into ops and its horizontal candidates offered
        as fusion options, decided in one solve (`solvers.solve`'s fusion-options move: formed where the simulator says
        the plan gets better; fusing independent ops makes their outputs live together, which is how
        memory-blind fusion inflates peaks). The formed ones are merged too, for lowering."""
        fusible = [self.target.executor.can_fuse(n) and not _reads_tangent(jg, n) for n in built.nodes]
        groups = find_groups(built.problem, fusible)
        compiled: dict = {}
        groups, slower = self._faster_groups(jg, built, groups, compiled)
        problem, items = self.fuse(jg, built, groups, compiled)
        taken = {o for c in groups for o in c}
        cands = horizontal_candidates(built.problem, built.nodes, fusible, taken)
        offered, options, notes = self._fusion_options(jg, built, problem, items, cands, compiled)
        plan = self._solve(offered, graph_nodes, items, budget_bytes)
        plan.stats.notes += slower + notes
        if not options:
            return plan, items
        formed = [options[i] for i in plan.schedule.formed]
        return self._merge_formed(jg, built, groups + formed, plan, items, compiled)

    def _faster_groups(self, jg: JointGraph, built: Built, groups: list[list[int]], compiled: dict,
                       ) -> tuple[list[list[int]], list[str]]:
        """With the default executor (chosen for the device, not by the user), the groups whose fused kernel
        runs faster than their ops one by one, when the target measures (a kernel that is slower, as a small
        group's can be, stays unfused: its ops run as eager runs them); and a note on those left out. An
        executor the user named, or roofline times, keep every group."""
        t = self.target
        if self.settings.executor is not None or not t.measure or not groups:
            return groups, []
        kept, slower = [], []
        for members in groups:
            group = build_group(jg, built.problem, members, built.nodes)
            compile_groups([group], t.executor, t.device, True, compiled)
            one_by_one = sum(built.problem.ops[o].time_s for o in members)
            (kept if group.time_s < one_by_one else slower).append(members)
        if not slower:
            return kept, []
        return kept, [f"{len(slower)} fusion group(s) left unfused: their {t.executor.name} kernel measured no faster "
                      f"than their ops one by one (e.g. {', '.join(built.nodes[o].name for o in slower[0][:4])})"]

    def _fusion_options(
        self, jg: JointGraph, built: Built, problem: Problem, items: list, cands: list[list[int]], compiled: dict,
    ) -> tuple[Problem, list[list[int]], list[str]]:
        """`problem` offering each horizontal candidate (op ids of `built.problem`) as a fusion option, its
        kernel compiled and timed like a group's; the candidates offered, in option order; notes on those
        that cannot be offered."""
        t = self.target
        op_of = _op_ids(built, items)
        options, offered, notes = [], [], []
        for cand in cands:
            label = f"horizontal group of {len(cand)} {built.nodes[cand[0]].target}"
            members = sorted(op_of[o] for o in cand)
            if convexity_violation(problem, members) is not None:
                notes.append(f"{label}: rejected, not convex once the vertical groups are merged")
                continue
            group = build_group(jg, built.problem, cand, built.nodes)
            compile_groups([group], t.executor, t.device, t.measure, compiled)
            time_s = group.time_s if t.measure else roofline_time(group, t.profile)
            options.append(FusionOption(tuple(members), time_s, group.workspace_bytes, label))
            offered.append(cand)
        return dataclasses.replace(problem, fusion_options=tuple(options)), offered, notes

    def _merge_formed(self, jg: JointGraph, built: Built, groups: list[list[int]], plan: Plan, solved_items: list,
                      compiled: dict) -> tuple[Plan, list]:
        """The plan on the problem with its formed groups merged too (what is lowered and what plan files
        replay): the schedule mapped onto it, its simulated peak and time the solve's. `solved_items`: per
        op of the solved problem, its node or group."""
        problem, items = self.fuse(jg, built, groups, compiled)
        if (problem.outputs, problem.returned) != (plan.problem.outputs, plan.problem.returned):  # planned holding outputs
            problem = dataclasses.replace(problem, outputs=plan.problem.outputs, returned=plan.problem.returned)
        merged, schedule = merge_formed(plan.problem, plan.schedule)
        # merge_formed's ops are this problem's ops, maybe in another order: match them by their first node
        node_id = {n: i for i, n in enumerate(built.nodes)}
        final = {node_id[_first_node(it)]: k for k, it in enumerate(items)}
        to_final = [final[min(node_id[_first_node(solved_items[o])] for o in unit)] for unit in merged.members]
        schedule = Schedule([to_final[o] for o in schedule.fw_order], [to_final[o] for o in schedule.bw_order],
                            dict(schedule.offload))
        sim = simulate(problem, schedule)
        if sim.peak_bytes != plan.sim.peak_bytes or round(sim.time_s, 12) != round(plan.sim.time_s, 12):
            raise RuntimeError(
                f"internal error: the plan with its fusion groups merged simulates to {sim.peak_bytes} bytes and "
                f"{sim.time_s:.9f} s, the solve's to {plan.sim.peak_bytes} bytes and {plan.sim.time_s:.9f} s"
            )
        baseline = simulate(problem, default_schedule(problem))
        plan = dataclasses.replace(
            plan, problem=problem, schedule=schedule, sim=sim, baseline=baseline,
            fusion_groups=[[n.name for n in it.nodes] for it in items if isinstance(it, Group)],
        )
        return plan, items

    def _solve(self, problem: Problem, graph_nodes: int, items: list | None = None, budget_bytes: int | None = None) -> Plan:
        baseline = simulate(problem, default_schedule(problem))
        explained = budget_bytes is None  # the program's own budget (not a chunk trial's): say how it was reached
        reference = reference_peak(problem, items, baseline)
        own = None
        if budget_bytes is None:
            own = self.resolution.bytes_for(reference, training=problem.has_backward)

            def bound() -> int:  # "auto": below the chunked graphs' floors too, or chunking may meet the share
                lower = lower_bound_peak(problem)
                return lower if lower <= own or self._reach is None else min(lower, self._reach(own))

            # below its bound, a smaller shape takes the bytes already given to a larger one
            budget_bytes = self._lend_larger(own, reference, problem.has_backward, bound)
        limit = time_limit(self.settings.time_limit_s, len(problem.ops))
        progress = LiveLine() if self.settings.progress else False
        account = getattr(self, "_time", None) or _PlanningTime()
        limit, start = account.slice(limit), clock.now()
        hint = start_schedule(self.settings.start_from, problem)
        dropped = problem
        first = self._first_micro_batch(problem) if explained and self._lent is None else None
        hint = hint or (first[0] if first is not None else None)

        def solve_at(b: int | None) -> tuple[int | None, Solution]:
            # checkpointing already in the model caps the budget: never above the user's own plan
            return solve_within_user_checkpointing(
                problem, items, b, lambda b: solve(
                    problem, b, time_limit_s=limit, progress=progress, deterministic=self.settings.deterministic_planning,
                    hint=hint)
            )

        holding = self._holding(problem, budget_bytes) if explained else None
        try:
            if holding is not None:  # a plan that also fits a caller keeping its outputs: half the time for it
                problem, whole, limit = holding, limit, limit / 2
                try:
                    budget_bytes, sol = solve_at(budget_bytes)
                    self._held_outputs = self._hold_if_fits[1]
                except BudgetInfeasibleError:  # the dropped plan gets what the try left (at least half)
                    problem, holding, limit = dropped, None, max(whole / 2, whole - (clock.now() - start))
            if holding is None:
                try:
                    budget_bytes, sol = solve_at(budget_bytes)
                except BudgetInfeasibleError as e:
                    if first is None or budget_bytes is None or first[1].peak_bytes <= budget_bytes:
                        raise
                    budget_bytes, sol = solve_at(self._accumulate_as_first(first[1], own, e, reference))
        except BudgetInfeasibleError as e:
            how = (self._lent_note or self.resolution.explain(reference, training=problem.has_backward)) if explained else None
            below = self.resolution.explain_below_bound(own, e.lower_bound_bytes, problem.has_backward) \
                if explained and e.proven and self._lent is None else None
            if below is not None:
                how = f"{how}; {below}"
            if how is not None and reference != baseline.peak_bytes:
                how += (f" (the model's own activation checkpointing: its step peaks at {_mib(reference)}, the "
                        f"captured program with every activation saved at {_mib(baseline.peak_bytes)})")
            if how is not None:
                e.args = (f"{e.args[0]}; {how}",)
            e.args = (e.args[0] + _start_from_note(e),)
            raise
        finally:
            account.spent += clock.now() - start
        t = self.target
        return Plan(
            problem=problem,
            schedule=sol.schedule,
            sim=sol.sim,
            baseline=sol.baseline,
            stats=sol.stats,
            budget_bytes=budget_bytes,
            budget_spec=str(self.settings.budget),
            lower_bound_bytes=sol.lower_bound_bytes,
            profile=t.profile,
            timing="measured" if t.measure else "roofline",
            graph_nodes=graph_nodes,
            executor=t.executor.name,
            fusion_groups=[[n.name for n in it.nodes] for it in items or [] if isinstance(it, Group)],
            grads_at_start=self.grads_at_start and problem.has_backward,
        )

    def _carried_plan(self, fp: dict, name: str) -> PlanFile | None:
        return next((pf for pf in self.carried.get(fp["hash"], ()) if self._mismatch(pf, fp, name)[0] is None), None)

    def _mismatch(self, pf: PlanFile, fp: dict, name: str) -> tuple[str | None, bool]:
        """What makes `pf` not this program's plan (None: it is), and whether it was made with the bytes a larger
        training program lent (`BudgetResolution.lend_larger`). Such a plan is this program's while the loop
        lends the same bytes (then `_lent` is set, for `_record_budget`); otherwise the program is planned
        again, with no PlanMismatchError: what differs is the loop's history, not the settings."""
        wanted = self.made_for(name)
        if (executor := self._file_executor(pf)) is not None:
            wanted["executor"] = executor
        made = pf.data["made_for"]
        if made.get("budget_from") == FIRST_MICRO_BATCH and self.resolution.is_percentage:
            # an accumulation step's bytes came from the first micro-batch's plan (replayed from its own file)
            mismatch = pf.describe_mismatch(fp, **{**wanted, "budget_from": FIRST_MICRO_BATCH,
                                                   "budget_resolved_bytes": made.get("budget_resolved_bytes")})
            if mismatch is None:
                self._lent = dict(made.get("budget_reference") or {})
            return mismatch, True
        if made.get("budget_from") != LARGER_TRAINING_PROGRAM or not self.resolution.is_percentage:
            return pf.describe_mismatch(fp, **wanted), False
        largest = self.resolution.largest
        lent = {**wanted, "budget_from": LARGER_TRAINING_PROGRAM,
                "budget_resolved_bytes": largest["bytes"] if largest is not None else None}
        mismatch = pf.describe_mismatch(fp, **lent)
        if mismatch is None:
            self._lent = dict(made.get("budget_reference") or {})
        return mismatch, True

    def _file_executor(self, pf: PlanFile) -> str | None:
        """The executor `pf` was made with, where it may replace this target's: the caller named none (the default
        is this device's pick, not a setting: a plan made elsewhere, as plan_offline's "eager" for a GPU whose
        default is Inductor, is replayed, not refused) and it runs here. None otherwise: an executor the caller
        named, or one that cannot run here, is compared as it is (a mismatch)."""
        name, t = pf.data["made_for"].get("executor"), self.target
        if self.settings.executor is not None or name == t.executor.name or not runs_on(name, t.device):
            return None
        return name

    def _record_budget(self, plan: Plan, fp: dict, items: list | None) -> None:
        """How the budget was resolved, on the plan; a training program records a percentage's bytes for
        it (the percentage of its unplanned peak, not a cap the plan itself applied): the bytes the
        forward-only programs of its shapes take (BudgetResolution)."""
        peak = reference_peak(plan.problem, items, plan.baseline)
        training = plan.kind == "training"
        plan.budget_from = dict(self._lent) if self._lent else self.resolution.source(peak, fp["hash"], training=training)
        if self._lent_note is not None and self._lent_note not in plan.stats.notes:
            plan.stats.notes.append(self._lent_note)
        if training:
            self.resolution.record_training(self.resolution.bytes_for(peak), peak, fp["hash"])


def time_limit(asked: float | None, ops: int) -> float:
    """The planning time limit of a graph of `ops` ops: `asked`, or one that grows with the graph (planning
    stays a small share of compile time)."""
    if asked is not None:
        return asked
    return max(DEFAULT_TIME_LIMIT_S, min(DEFAULT_TIME_LIMIT_MAX_S, DEFAULT_S_PER_OP * ops))


AUTO_FIRST_SHARE = 0.5  # chunking="auto": the share of the time limit the graph as captured gets (the counts the rest)


class _PlanningTime:
    """The time limit of one program's planning, shared by its solves: each gets `share` of what is left."""

    def __init__(self) -> None:
        self.limit: float | None = None  # set by the first solve (it depends on the graph's size)
        self.spent = 0.0
        self.share = 1.0

    def slice(self, limit: float) -> float:
        if self.limit is None:
            self.limit = limit
        return self.left() * self.share

    def left(self) -> float:
        return max(0.0, (self.limit or 0.0) - self.spent)


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def _start_from_note(e: BudgetInfeasibleError) -> str:
    """How to get the lowest plan the error found: the search depends on the budget, so asking for its peak
    alone may not find it again (optimize's `start_from`)."""
    if e.proven or e.lowest_schedule is None:
        return ""
    return (f"; that plan is kept: optimize(..., mem_budget={e.lowest_peak_bytes}, start_from=<this error>) "
            f"starts from it")


def _chunked_infeasible(budget_bytes: int, failures: list[tuple[int, BudgetInfeasibleError]], names: list[str],
                        chunking, time_limit_s: float | None = None, untried: list[int] = (),
                        resident: int | None = None) -> BudgetInfeasibleError:
    """No chunk count tried fits: one error for all of them. Each count's bound holds for its own graph's plans
    only, so the bound of all is the lowest of theirs, and "none can" covers the counts tried, no others.
    `untried`: counts the spent time limit left out (then a larger limit may find a plan). `resident`: what
    every count keeps on the device all step (Floor.resident), named when the budget is below it."""
    low = min((e for _, e in failures), key=lambda e: e.lowest_peak_bytes)
    bound = min(e.lower_bound_bytes for _, e in failures)
    timed = [e for _, e in failures if isinstance(e, PlanningTimeLimitError)]
    searched = any(x.searched for _, x in failures)
    if (timed or untried) and budget_bytes >= bound:
        e = PlanningTimeLimitError(budget_bytes, low.lowest_peak_bytes, bound, low.lowest_schedule,
                                   elapsed_s=sum(x.elapsed_s or 0 for _, x in failures),
                                   time_limit_s=time_limit_s or failures[0][1].time_limit_s)
    else:
        e = BudgetInfeasibleError(budget_bytes, low.lowest_peak_bytes, bound, low.lowest_schedule, searched=searched)
    counts = [k for k, _ in failures]
    heads = ", ".join(names)
    if len(counts) == 1:
        scope = f"{heads} in {counts[0]} chunk{'s' if counts[0] > 1 else ''} (chunking={chunking!r}: no other count tried)"
    else:
        scope = f"{heads} in {', '.join(map(str, counts))} chunks (each count chunking chooses from)"
    per = "; ".join(f"{k}: {_mib(x.lowest_peak_bytes)}" if x.searched else f"{k}: none searched, below its bound "
                    f"{_mib(x.lower_bound_bytes)}" for k, x in failures)
    if e.proven and not searched:
        kept = "" if resident is None or budget_bytes >= resident else (
            f": the parameters, buffers, inputs and the step's outputs (gradients) alone take {_mib(resident)} "
            "whatever the chunk count")
        text = (f"no plan fits {_mib(budget_bytes)}, and none can with {scope}: every such plan needs at least "
                f"{_mib(bound)} (refused before any search{kept})")
    elif e.proven:
        text = (f"no plan fits {_mib(budget_bytes)}, and none can with {scope}: every such plan needs at least "
                f"{_mib(bound)} (lowest peak found per chunk count: {per})")
    elif isinstance(e, PlanningTimeLimitError):
        left_out = f"; counts {', '.join(map(str, untried))} not tried (the limit was spent)" if untried else ""
        text = (f"no plan fits {_mib(budget_bytes)} with {scope} within the time limit ({e.time_limit_s:g}s, shared by the counts): "
                f"lowest peak found per chunk count: {per}{left_out}; none can go below {_mib(bound)} "
                f"(gap {e.peak_gap:.1%}); a larger time_limit_s may find one")
    else:
        text = (f"no plan fits {_mib(budget_bytes)} with {scope}: none found; lowest peak found per chunk count: {per}, "
                f"and none can go below {_mib(bound)} (gap {e.peak_gap:.1%}); the search ended before its time limit")
    e.args = (text,)
    return e


def _say_why_not_chunked(e: BudgetInfeasibleError, gm: fx.GraphModule, chains: list[Chain], skipped: list[str],
                         chunking, asked: bool, reach: tuple[int, int] | None = None) -> None:
    """The error of a graph planned as captured says what chunking could have done: with chunking off (the
    default, False, or 1) and a chain, that its bound is the captured graph's only (chunked plans are not
    covered), unless chunking cannot reach the budget either (`reach`: the chunked graphs' lowest floor and
    the resident bytes, Planner._reach_of_chunking); with chunking asked for, or a cross-entropy refused, why
    no chain was found."""
    if chains and not asked and reach is not None and e.budget_bytes < reach[0]:
        lowest, resident = reach
        heads = ", ".join(c.name for c in chains)
        why = (f"the parameters, buffers, inputs and the step's outputs (gradients) alone take {_mib(resident)}, "
               "whatever the chunk count" if e.budget_bytes < resident else
               f"with {heads} in {', '.join(map(str, CHUNK_COUNTS[1:]))} token chunks every plan needs at least "
               f"{_mib(lowest)}")
        e.args = (f"{e.args[0]}; chunking cannot reach it either: {why}",)
    elif chains and not asked:
        text = e.args[0].replace(", and none can: every plan",
                                 ", and none can with the LM head + cross-entropy as captured: every such plan")
        heads = ", ".join(f"{c.name} ({c.shape[0]} tokens, vocabulary {c.shape[2]})" for c in chains)
        e.args = (f"{text}; chunking={chunking!r}: {heads} could run in token chunks, which that bound does not "
                  "cover (chunking='auto' chunks it where the budget needs it, True lets the planner choose)",)
    elif not chains and (skipped or asked):
        e.args = (f"{e.args[0]}; chunking found no LM head + cross-entropy chain to run in chunks "
                  f"({why_no_chain(gm, skipped)}), so this covers every plan",)


def _op_ids(built: Built, items: list) -> dict[int, int]:
    """Op id in `built.problem` -> id of the op (itself, or its group's) in the problem `items` describes."""
    node_id = {n: i for i, n in enumerate(built.nodes)}
    out = {}
    for k, it in enumerate(items):
        for n in it.nodes if isinstance(it, Group) else [it]:
            out[node_id[n]] = k
    return out


def _first_node(item: Group | fx.Node) -> fx.Node:
    """An op's node, or its group's first (groups' nodes are in program order)."""
    return item.nodes[0] if isinstance(item, Group) else item


def _subgraph(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.GraphModule:
    """`nodes` alone, names kept: what they read from outside as placeholders, every value an output."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inside = set(nodes)

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:
            env[a] = graph.placeholder(a.name)
            env[a].meta = dict(a.meta)
        return env[a]

    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                arg(a)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in nodes))
    return fx.GraphModule(gm, graph)


def _reads_tangent(jg: JointGraph, node: fx.Node) -> bool:
    """Whether `node` reads a tangent, directly or through views. A tangent no gradient flowed into arrives
    as a zero broadcast from one element (capture/output_usage.zeros_if_missing), a layout a group
    kernel compiled for the traced strides cannot take: such ops stay out of fusion groups."""
    tangents = set(jg.tangents)
    stack = list(node.all_input_nodes)
    while stack:
        a = stack.pop()
        if a in tangents:
            return True
        if jg.is_view(a):
            stack.extend(a.all_input_nodes)
    return False
