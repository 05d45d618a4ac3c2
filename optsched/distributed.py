"""One plan for every rank: optsched under torch.distributed (DDP and FSDP2).

- `optimize(model, mem_budget, example_inputs=...)`: `optsched.optimize` for data parallelism (wrap the result
  in DistributedDataParallel). One rank (`src`, default 0) plans; its plans (plan-file JSON, with the op costs it
  measured) are broadcast and every other rank replays them without solving, so every rank runs the same program
  (`plan_digest` equal). A failure on any rank is raised on every rank, with the same type and message.
- `optimize_fsdp(model, mem_budget, example_inputs=...)`: FSDP2 as torchtitan applies it (`fully_shard` per
  block, then the root), with `mem_budget` per rank. The blocks are planned unsharded on `src` and sharded
  afterwards: each block's forward runs as one planned program between FSDP2's hooks (its all-gather before,
  its reduce-scatter after), which stay eager. The per-rank budget counts this rank's parameter and gradient
  shards, the all-gathered parameters of the running block and the one prefetched, the all-gather and
  reduce-scatter buffers, the root's activations and every block's saved activations (`FSDPMemory`); the block
  plan is the fastest that fits it, the solver's or a whole-block schedule (`choose_block_plan`). With
  `optimizer=` (a factory, called on the sharded parameters) the whole step: the optimizer's state over this
  rank's shards all along, and its update after the backward (`model.optimizer.step()`).

All ranks must call these functions together (they are collectives). See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import api
from ._torch import tree_leaves
from .optim import SUPPORTED, check_supported, describe as describe_optimizer, state_bytes
from .budget import parse_budget
from .costs.measure import measure_peak
from .plans.plan import Plan
from .plans.file_format import seal
from .solvers import BudgetInfeasibleError, TensorKind, simulate
from .solvers.search.sweep import schedule_for, sweep

__all__ = ["FSDPMemory", "FSDPPlan", "optimize", "optimize_fsdp", "plan_digest"]

MiB = 2**20


# ---------------------------------------------------------------------------------------------
# one outcome for every rank


def plan_digest(plan: Plan) -> str:
    """A plan's identity across ranks: its graph's fingerprint and its decisions (orders, recomputations,
    offloads, fusion groups). Equal digests: the same program runs."""
    d = plan.to_file_data()
    text = json.dumps([d["fingerprint"]["hash"], d["decisions"]], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _portable(e: BaseException) -> tuple:
    """An exception as it can cross to other ranks: its class, args and attributes (BudgetInfeasibleError's
    constructor does not take its message back, so pickle's default would fail), or its text."""
    try:
        blob = pickle.dumps((type(e), e.args, dict(e.__dict__)))
        pickle.loads(blob)
        return ("exact", blob)
    except Exception:  # noqa: BLE001 - anything that does not survive pickling goes as text
        return ("text", f"{type(e).__name__}: {e}")


def _rebuilt(portable: tuple, rank: int) -> BaseException:
    kind, value = portable
    if kind == "exact":
        cls, args, attrs = pickle.loads(value)
        e = cls.__new__(cls)
        e.args = args
        e.__dict__.update(attrs)
    else:
        e = RuntimeError(value)
    e.rank = rank  # type: ignore[attr-defined]
    return e


def _raise_as_everywhere(local: BaseException | None, portable: tuple, rank: int):
    """Raise what every rank raises for rank `rank`'s failure: the exception itself where it happened when it
    crosses ranks exactly, else (and on every other rank) its rebuilt form."""
    if local is not None and portable[0] == "exact":
        local.rank = rank  # type: ignore[attr-defined]
        raise local
    raise _rebuilt(portable, rank) from local


def _group_rank(group) -> int:
    return dist.get_rank(group)


def _one_outcome(group, src: int, planned: Callable[[], Any], replayed: Callable[[Any], Any],
                 digest: Callable[[Any], str]) -> Any:
    """Rank `src` runs `planned()` -> (result, payload); the payload (or its failure) is broadcast; every other
    rank runs `replayed(payload)`. Every rank then learns every rank's failure and digest: a failure anywhere
    is raised everywhere (the lowest failing rank's, same type and message), and so are differing digests.
    Two collectives on every path: no rank waits for one that has given up."""
    rank = _group_rank(group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    result, local_error, box = None, None, [None]
    if rank == src:
        try:
            result, payload = planned()
            box[0] = ("ok", payload)
        except Exception as e:  # noqa: BLE001 - every failure goes to every rank
            local_error, box[0] = e, ("error", _portable(e))
    dist.broadcast_object_list(box, src=global_src, group=group)
    kind, value = box[0]
    if kind == "error":
        _raise_as_everywhere(local_error, value, src)
    if rank != src:
        try:
            result = replayed(value)
        except Exception as e:  # noqa: BLE001
            local_error = e
    mine = (None, digest(result)) if local_error is None else (_portable(local_error), None)
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, mine, group=group)
    for r, (err, _d) in enumerate(seen):
        if err is not None:
            _raise_as_everywhere(local_error if r == rank else None, err, r)
    digests = [d for _e, d in seen]
    if len(set(digests)) > 1:
        raise RuntimeError(f"ranks planned different programs (plan digests by rank: {digests}); the graphs differ "
                           "between ranks (different shapes or code), so no one plan fits them all")
    return result


def _without_plan_file(spec):
    """A spec for the ranks other than src: no plan file (src alone reads and writes it; the plans come carried)."""
    return dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, plan=None))


def _check_options(options: dict) -> None:
    if "plan" in options and options["plan"] == "auto":
        raise ValueError("plan='auto' is per machine; under torch.distributed pass a path (rank src reads or writes it) or None")
    if options.get("updates_in_backward", "auto") is not False and options.get("optimizer") is not None:
        raise NotImplementedError(
            "updates inside the backward are not supported under torch.distributed yet (they would take each gradient "
            "before DDP's all-reduce): pass updates_in_backward=False with optimizer= (the update after the backward)")


# ---------------------------------------------------------------------------------------------
# data parallelism


def optimize(fn_or_module, mem_budget=None, *, example_inputs: tuple | list, group=None, src: int = 0, **options):
    """`optsched.optimize` with one plan for every rank of `group` (default: the world), for DDP.

    Rank `src` plans on `example_inputs` (measuring op costs there, or from `device_profile`; with `plan=PATH`
    it reads or writes that plan file); every other rank receives its plans and replays them without solving.
    Collective: every rank calls it with the same arguments (its own `example_inputs` of the same shapes).
    A failure (BudgetInfeasibleError, CaptureError, ...) on any rank is raised on every rank with the same
    type and message, and `.rank` the rank it came from. Programs with other input signatures planned later
    (at their first call) are planned on each rank by itself: plan them here too, or give a `device_profile`
    so that every rank's costs, and so its plans, are the same.

    With `optimizer=` (each rank its own, over its own parameters), `updates_in_backward=False`: the step's update
    after the backward, the optimizer's state counted; the other ranks replay rank src's plans with theirs.

    Returns what `optsched.optimize` returns; `plan_digest(result.plan)` is equal on every rank."""
    _check_options(options)
    example_inputs = tuple(example_inputs)

    optimizer = options.get("optimizer")

    def planned():
        target = api.optimize(fn_or_module, mem_budget, example_inputs=example_inputs, **options)
        return target, api.optimized_spec(target, replayed_with_optimizer=optimizer is not None)

    def replayed(spec):
        spec = _without_plan_file(spec)
        if optimizer is not None:  # rank src's plans, with this rank's own optimizer (its state and update)
            spec = dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, optimizer=optimizer,
                                                                          updates_in_backward=False))
        return api.optimize_like(fn_or_module, spec, example_inputs)

    return _one_outcome(group, src, planned, replayed, lambda t: plan_digest(t.plan))


# ---------------------------------------------------------------------------------------------
# FSDP2


def _shard_bytes(p: torch.Tensor, world: int) -> int:
    """Bytes of one rank's FSDP2 shard of `p`: dim 0 split in `world` chunks, padded to equal size."""
    if p.dim() == 0:
        return p.element_size()
    rows = math.ceil(p.shape[0] / world)
    return rows * (p.numel() // max(p.shape[0], 1)) * p.element_size()


@dataclass
class FSDPMemory:
    """What optimize_fsdp counts on one rank at its peak (bytes). An upper bound: terms that never coincide
    (the all-gather buffer and the reduce-scatter buffers) are added all the same.

    `total` = the fixed terms + (n_blocks - 1) blocks' saved activations + the running block's planned peak
    (its all-gathered parameters, its input, its activations and its unsharded gradients)."""

    world: int
    n_blocks: int
    sharded_params: int  # this rank's shard of every parameter (dim 0 padded, as FSDP2 shards)
    sharded_grads: int  # the same size: reduce-scatter outputs, held to the end of the step
    root_params: int  # the root's own parameters, all-gathered for the whole step (FSDP2 keeps the root's)
    root_grads: int  # the root's unsharded gradients: its reduce-scatter runs after the whole backward
    gather_buffer: int  # one block's flat all-gather output, while it is copied into the parameters
    prefetch: int  # the next block's all-gathered parameters (FSDP2 prefetches one block in the backward)
    reduce_scatter: int  # one block's flat reduce-scatter input (full size) and output (a shard)
    root_activations: int  # the root's own activations (embedding, head, loss), measured with stub blocks
    saved_per_block: int = 0  # a block's activations kept from its forward to its backward (its plan's)
    block_peak: int = 0  # the running block's planned peak
    optimizer_state: int = 0  # the optimizer's state over this rank's shards: live the whole step from step 1 on
    update_scratch: int = 0  # the temporaries of the optimizer's update (its step() after the backward)
    optimizer: str = ""  # the optimizer counted (optsched.optim.describe); "" when none is

    @property
    def fixed(self) -> int:
        return (self.sharded_params + self.sharded_grads + self.root_params + self.root_grads + self.gather_buffer
                + self.prefetch + self.reduce_scatter + self.root_activations + self.optimizer_state)

    @property
    def backward(self) -> int:
        """The peak from the forward through the backward: the fixed terms (the optimizer's state among them), the
        other blocks' saved activations and the running block's peak."""
        return self.fixed + (self.n_blocks - 1) * self.saved_per_block + self.block_peak

    @property
    def update(self) -> int:
        """The peak of the optimizer's update after the backward (0 without an optimizer), when every activation
        and buffer of the backward is gone: the parameter and gradient shards, the root's parameters and gradients
        (counted unsharded, an upper bound), the state and the update's temporaries."""
        if not self.optimizer:
            return 0
        return (self.sharded_params + self.sharded_grads + self.root_params + self.root_grads + self.optimizer_state
                + self.update_scratch)

    @property
    def total(self) -> int:
        return max(self.backward, self.update)

    def with_block(self, block_peak: int, saved: int) -> FSDPMemory:
        return dataclasses.replace(self, block_peak=block_peak, saved_per_block=saved)

    def describe(self) -> str:
        parts = [f"{k} {getattr(self, k) / MiB:.2f}" for k in (
            "sharded_params", "sharded_grads", "root_params", "root_grads", "gather_buffer", "prefetch",
            "reduce_scatter", "root_activations", "optimizer_state")]
        text = (f"per rank (MiB): {', '.join(parts)}, {self.n_blocks - 1} x saved_per_block "
                f"{self.saved_per_block / MiB:.2f}, block_peak {self.block_peak / MiB:.2f}")
        if not self.optimizer:
            return f"{text}: total {self.total / MiB:.2f}"
        return (f"{text}: backward {self.backward / MiB:.2f}; the update after it ({self.optimizer}): shards, root "
                f"parameters and gradients, optimizer_state and update_scratch {self.update_scratch / MiB:.2f}: "
                f"{self.update / MiB:.2f}; total {self.total / MiB:.2f}")


def fsdp_memory(params_by_block: list[list[torch.Tensor]], root_params: list[torch.Tensor], world: int,
                root_activations: int) -> FSDPMemory:
    """The fixed per-rank terms for blocks with these parameters (each list one block's) and the root's own."""
    def full(ps):
        return sum(p.numel() * p.element_size() for p in ps)

    def shard(ps):
        return sum(_shard_bytes(p, world) for p in ps)

    everything = [p for ps in params_by_block for p in ps] + list(root_params)
    block_full = max((world * shard(ps) for ps in params_by_block), default=0)  # flat, padded
    block_shard = max((shard(ps) for ps in params_by_block), default=0)
    return FSDPMemory(
        world=world, n_blocks=len(params_by_block), sharded_params=shard(everything), sharded_grads=shard(everything),
        root_params=full(root_params), root_grads=full(root_params), gather_buffer=block_full,
        prefetch=max((full(ps) for ps in params_by_block), default=0), reduce_scatter=block_full + block_shard,
        root_activations=root_activations,
    )


def _shard_stand_in(p: torch.Tensor, world: int) -> torch.Tensor:
    """A tensor shaped like one rank's FSDP2 shard of `p` (dim 0 padded, as `_shard_bytes`), on `p`'s device and
    with its dtype and requires_grad, that holds one element (a broadcast view): what the optimizer's accounting
    reads of a parameter (its size, its device) without allocating the shard."""
    shape = p.shape if p.dim() == 0 else (math.ceil(p.shape[0] / world), *p.shape[1:])
    return torch.empty((), dtype=p.dtype, device=p.device).expand(shape).requires_grad_(p.requires_grad)


def optimizer_terms(probe: torch.optim.Optimizer, world: int) -> tuple[int, int]:
    """(state, update temporaries): the bytes per rank of the state `probe` (an optimizer over the unsharded
    parameters, as the factory builds it) will hold over this rank's shards once it has stepped, and of the
    temporaries one `step()` over those shards allocates beyond the shards, their gradients and the state.

    The state is `optsched.optim.state_bytes` of an optimizer of the same type and groups over stand-ins shaped
    like the padded shards (`_shard_stand_in`): each state tensor the shard's bytes, and Adam's `step` a scalar
    on the CPU unless capturable or fused, as torch makes it. The temporaries are measured once, on CPU replicas
    of those shards (optsched.planning.optimizer_step.update_scratch_bytes, cached per optimizer type, group
    options and shard shapes), with `foreach` as torch picks it for the
    parameters' device (None: a for-loop on the CPU, the foreach kernels on a GPU, where DTensor shards take them).
    Measured with torch 2.13 on this CPU (gloo, 2 ranks, the tests' GPT: largest shard 8 KiB, all shards 85 KiB),
    one step over FSDP2's DTensor shards allocated beyond parameters, gradients and state: for-loop AdamW and Adam
    2 x the largest shard (Adam with weight decay 3 x, amsgrad 2 x), SGD with momentum and weight decay 1 x, with
    nesterov 2 x; foreach 1 x all shards for each of them; fused a few bytes. The replicas (plain tensors) gave
    the same bytes in every case. Conservative: the shards are padded ones (the largest any rank holds), and the
    replicas' per-tensor constants are scaled up with them."""
    from .planning.optimizer_step import update_scratch_bytes

    groups = []
    for g in probe.param_groups:
        foreach = g.get("foreach")
        if (foreach is None and not g.get("fused") and not g.get("differentiable")
                and any(p.device.type != "cpu" for p in g["params"])):
            foreach = True  # off the CPU torch's default for DTensor shards: the foreach kernels (more temporaries)
        groups.append({**g, "params": [_shard_stand_in(p, world) for p in g["params"]], "foreach": foreach})
    shards = type(probe)(groups)
    scratch = update_scratch_bytes(shards)
    return state_bytes(shards), scratch


def _probe_optimizer(factory, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer `factory` builds over the unsharded `params`, to read its type and groups (it has no state
    before its first step; discarded once counted). TypeError for an optimizer passed instead of a factory."""
    if isinstance(factory, torch.optim.Optimizer) or not callable(factory):
        what = "an optimizer" if isinstance(factory, torch.optim.Optimizer) else f"a {type(factory).__name__}"
        raise TypeError(
            f"optimize_fsdp(optimizer=) takes a factory, not {what}: fully_shard replaces the model's parameters with "
            "sharded DTensor parameters, so an optimizer built before it holds the unsharded ones and would never update "
            "the model. Pass a callable that builds it from the parameters it is given, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3); optimize_fsdp calls it on the sharded "
            "parameters and returns the optimizer as model.optimizer")
    probe = factory(list(params))
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(f"optimize_fsdp(optimizer=): the factory returned a {type(probe).__name__}, not a "
                        "torch.optim.Optimizer")
    check_supported(probe, "optimize_fsdp(optimizer=)")
    given = {id(p) for p in params}
    if any(id(p) not in given for g in probe.param_groups for p in g["params"]):
        raise ValueError("optimize_fsdp(optimizer=): the factory's optimizer holds tensors other than the parameters "
                         "it was given; build it from those (they are the sharded model's when it is called for real)")
    return probe


def saved_bytes(problem, sim, argument_bytes: int = 0) -> int:
    """Device bytes a block's plan keeps from its forward to its backward: its saved activations (offloaded ones
    are on the host) and its tensor arguments (`argument_bytes`: the block's input, alive while it is saved)."""
    kept = sum(problem.tensors[t].bytes for t in sim.saved
               if problem.tensors[t].kind != TensorKind.INPUT and t not in sim.offloads)
    return kept + argument_bytes


def activation_peak(problem, sim) -> int:
    """The largest device bytes of a plan's activations alone at one step: its timeline without the program's
    inputs (parameters) and outputs (gradients, loss), which FSDPMemory counts apart."""
    apart = problem.outputs | {t.id for t in problem.tensors if t.kind == TensorKind.INPUT}
    delta = [0] * (len(sim.timeline) + 1)
    for life in sim.lifetimes:
        if life.tensor not in apart:
            delta[life.start] += problem.tensors[life.tensor].bytes
            delta[life.end + 1] -= problem.tensors[life.tensor].bytes
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def _tensor_bytes(args: tuple, kwargs: dict) -> int:
    return sum(a.numel() * a.element_size() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))


@dataclass
class FSDPPlan:
    """optimize_fsdp's outcome on this rank: the per-rank accounting, the block budget it chose, the block plan
    (every block runs it) and its digest (equal on every rank). Set as `model.plan`."""

    budget_bytes: int | None
    block_budget_bytes: int | None
    memory: FSDPMemory
    block_plan: Plan | None
    digest: str
    notes: list[str] = field(default_factory=list)
    how: str = "solve"  # the solver's plan for block_budget, or the other schedule chosen (BlockChoice.describe())

    @property
    def predicted_peak_bytes(self) -> int:
        return self.memory.total

    def __repr__(self) -> str:
        b = "none" if self.budget_bytes is None else f"{self.budget_bytes / MiB:.2f} MiB"
        return (f"FSDPPlan(per rank: predicted {self.memory.total / MiB:.2f} MiB, budget {b}; "
                f"{self.memory.n_blocks} blocks, " + (
                    f"block budget {'none' if self.block_budget_bytes is None else f'{self.block_budget_bytes / MiB:.2f} MiB'}"
                    if self.how == "solve" else self.how) + ", "
                f"block plan {self.block_plan})")


class _Recorded(Exception):
    pass


def _record_block_inputs(model: torch.nn.Module, block: torch.nn.Module, example_inputs: tuple) -> tuple[tuple, dict]:
    """The first block's arguments on `example_inputs` (a forward stopped there): detached copies that keep
    requires_grad, so the block is planned for what it is called with."""
    seen: dict = {}

    def hook(_m, args, kwargs):
        def keep(x):
            return x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        seen["args"] = tuple(keep(a) for a in args)
        seen["kwargs"] = {k: keep(v) for k, v in kwargs.items()}
        raise _Recorded

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.random.fork_rng():
            model(*example_inputs)
    except _Recorded:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise ValueError("optimize_fsdp: the model's forward on example_inputs never called the first block")
    return seen["args"], seen["kwargs"]


class _PassThrough(torch.autograd.Function):
    """A block stood in for: its output as computed without gradients, and the output's gradient handed to its
    input in the backward (memory like the root's own computation around blocks that save nothing)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.x_shape = x.shape
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return (g if g.shape == ctx.x_shape else g.new_zeros(ctx.x_shape)), None


def _loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().sum()
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return sum(t.float().sum() for t in leaves)


def measure_root_activations(model, blocks, example_inputs: tuple, root_params: list[torch.Tensor]) -> int:
    """Peak bytes of the root's own computation in one forward+backward with every block stood in for by
    `_PassThrough` (so the blocks save nothing and their parameters get no gradients), less the root's
    gradients (counted apart). A non-scalar output is summed, as a stand-in for the caller's loss."""
    originals = []
    for b in blocks:
        fwd = b.forward

        def stub(*args, _fwd=fwd, **kwargs):
            with torch.no_grad():
                y = _fwd(*args, **kwargs)
            x = args[0]
            if isinstance(y, torch.Tensor) and isinstance(x, torch.Tensor) and x.requires_grad:
                return _PassThrough.apply(x, y)
            return y

        originals.append(b.__dict__.get("forward"))
        b.forward = stub
    grads = [p.grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.grad = None

        def step():
            _loss_of(model(*example_inputs)).backward()

        with torch.random.fork_rng():
            peak = measure_peak(step).peak_bytes
    finally:
        for b, o in zip(blocks, originals):
            if o is None:
                del b.forward
            else:
                b.forward = o
        for p, g in zip(model.parameters(), grads):
            p.grad = g
    return max(0, peak - sum(p.numel() * p.element_size() for p in root_params))


def _default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ModuleList holding the most parameters (a transformer's layers)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError("optimize_fsdp: no nn.ModuleList of blocks in the model; pass blocks=[...]")
    return list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters())))


def _block_signature(block: torch.nn.Module) -> tuple:
    return (type(block).__qualname__, tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))


@dataclass
class BlockChoice:
    """How the block is planned: `how` "solve" (the solver, for `block_budget`; None: no budget), "recompute"
    (the forward ops named in `recompute` recomputed, in program order) or a name of the sweep's HEURISTICS; the per-rank
    memory and the block's estimated time with it (on the search problem)."""

    how: str
    block_budget: int | None
    memory: FSDPMemory
    time_s: float
    recompute: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"recompute {len(self.recompute)} ops" if self.how == "recompute" else self.how


def block_schedule(choice: BlockChoice, problem):
    """The schedule a non-solver choice gives `problem` (the block's problem, as captured where it is made)."""
    return schedule_for(choice.how, choice.recompute, problem)


def choose_block_plan(problem, memory: FSDPMemory, budget: int | None, arg_bytes: int, time_limit_s: float,
                      tolerance: float = 0.02) -> list[BlockChoice]:
    """The block plans whose per-rank total fits `budget`, fastest first, from the solvers' sweep (solvers/search/
    sweep.py) with the per-rank total as its measure: the solver's plans for block budgets (a bisection over the
    block's peak, to `tolerance`, for the largest that fits), the HEURISTICS' schedules and the recompute_ladder's
    (which weigh saved bytes, that n_blocks multiply, rather than the block's peak). A budget below the fixed
    terms, the other blocks' inputs and the block's proven lower bound fails at once; one no candidate meets
    raises BudgetInfeasibleError with the lowest total found."""
    def per_rank(sim) -> FSDPMemory:
        return memory.with_block(sim.peak_bytes, saved_bytes(problem, sim, arg_bytes))

    if budget is not None and memory.update > budget:  # no block plan changes the update after the backward
        e = BudgetInfeasibleError(budget, memory.update, memory.update)
        e.args = (f"no plan fits the per-rank budget {budget / MiB:.2f} MiB under FSDP2: the optimizer's update after the "
                  f"backward alone holds {memory.update / MiB:.2f} MiB (shards, root parameters and gradients, "
                  f"optimizer_state {memory.optimizer_state / MiB:.2f}, update_scratch {memory.update_scratch / MiB:.2f})",)
        raise e

    found = sweep(problem, lambda sim: per_rank(sim).total, budget, floor=memory.fixed + (memory.n_blocks - 1) * arg_bytes,
                  time_limit_s=time_limit_s, tolerance=tolerance)
    fits = found.fitting(budget)
    if not fits:
        lowest = per_rank(min(found.tried, key=lambda c: c.total).sim)
        e = BudgetInfeasibleError(budget, lowest.total, found.bound)
        e.args = (f"no plan fits the per-rank budget {budget / MiB:.2f} MiB under FSDP2: the lowest found is "
                  f"{lowest.total / MiB:.2f} MiB ({lowest.describe()}); no plan can go below {found.bound / MiB:.2f} MiB "
                  f"(the fixed terms alone are {memory.fixed / MiB:.2f} MiB"
                  + (f", the optimizer's state {memory.optimizer_state / MiB:.2f} MiB among them" if memory.optimizer else "")
                  + ")",)
        raise e
    return [BlockChoice(c.how, c.peak_budget, per_rank(c.sim), c.sim.time_s, c.recompute) for c in fits]


def with_schedule(plan: Plan, schedule, note: str) -> Plan:
    """`plan` with another schedule for its problem (simulated; its stats say so): what every rank replays."""
    from .solvers.search.certify import merged
    from .solvers.search.incumbent import gap

    sim = simulate(plan.problem, schedule)
    # the plan's bound was certified for its own order: for another, only each op once holds
    bound = sum(o.time_s for o in merged(plan.problem, schedule)[0].ops)
    notes = [n for n in plan.stats.notes if not n.startswith("bound:")] + ["bound: every plan (each op once)", note]
    stats = dataclasses.replace(plan.stats, status="HEURISTIC", objective_s=sim.time_s, bound_s=bound,
                                gap=gap(sim.time_s, bound), notes=notes)
    return dataclasses.replace(plan, schedule=schedule, sim=sim, stats=stats)


def optimize_fsdp(model: torch.nn.Module, mem_budget=None, *, example_inputs: tuple | list, blocks=None, mesh=None,
                  reshard_after_forward: bool = True, group=None, src: int = 0, **options) -> torch.nn.Module:
    """Plan `model`'s blocks for a per-rank budget and shard it with FSDP2, as torchtitan does: `fully_shard` on
    every block, then on the root. Returns `model` (sharded in place); `model.plan` is an FSDPPlan.

    mem_budget: peak bytes per rank (an int or a size string such as "40GB"; not a percentage), counting this
    rank's parameter and gradient shards, the all-gathered parameters of the running block and of the one
    prefetched, the all-gather and reduce-scatter buffers, the root's activations and every block's saved
    activations (see FSDPMemory). None: the fastest block plan.
    example_inputs: the model's inputs (this rank's batch). Rank `src` runs the model on them: up to the first
    block (to record its inputs) and once with the blocks stood in for (to measure the root's activations).
    blocks: the modules to shard and plan (default: the nn.ModuleList holding the most parameters); they must
    be alike (same class and parameter shapes), as a transformer's layers are.
    mesh, reshard_after_forward: passed to fully_shard. group: the process group the plan is shared in (default:
    the mesh's, else the world).
    optimizer: the whole step, with the optimizer's update after the backward. A factory, not an optimizer: a
    callable `params -> torch.optim.Optimizer` (SGD, Adam or AdamW, exact types), e.g.
    `lambda params: torch.optim.AdamW(params, lr=1e-3)`; it gets the list of the model's parameters (split it to
    make groups, e.g. by `p.dim()`: shards keep their parameters' shapes). optimize_fsdp calls it once on the
    unsharded parameters to read the optimizer's type and groups (that optimizer is discarded: it has no state
    before its first step) and once on the sharded ones after fully_shard: that optimizer is `model.optimizer`
    (an optimizer built before fully_shard would hold the parameters it replaces: TypeError). The per-rank total
    then counts its state over this rank's shards from the first forward on (torch makes it at the first
    `step()`), and is the larger of the backward's peak and the update's (`model.optimizer.step()` after the
    backward: shards, gradients, state and the update's temporaries; FSDPMemory.update). The update is never
    inside the backward under FSDP2: `updates_in_backward` may be left out ("auto" means after the backward
    here) or False; True raises NotImplementedError. Your loop: `loss.backward(); model.optimizer.step();
    model.optimizer.zero_grad()`.
    Other options are optsched.optimize's, but `plan` (no plan files yet).

    Collective: every rank calls it. Rank `src` plans the first block (unsharded): the fastest plan that keeps
    the per-rank total within mem_budget (the solver's for a block budget, or a whole-block schedule such as
    full recomputation: see choose_block_plan), and broadcasts it; every rank's blocks replay it."""
    from torch.distributed.fsdp import fully_shard

    factory = _fsdp_optimizer_option(options)
    _check_options(options)
    # every rank builds the probe (an error is then raised alike everywhere, before any collective); src counts it
    probe = None if factory is None else _probe_optimizer(factory, list(model.parameters()))
    if options.get("plan") is not None:
        raise ValueError("optimize_fsdp does not read or write plan files yet (plan=...): its block plans are chosen "
                         "with the per-rank terms and carried to every rank")
    budget = parse_budget(mem_budget, of="a rank's memory")
    if budget.fraction is not None:
        raise ValueError("optimize_fsdp takes mem_budget per rank in bytes or with a unit ('40GB'), not a percentage")
    blocks = list(blocks) if blocks is not None else _default_blocks(model)
    if len({_block_signature(b) for b in blocks}) > 1:
        raise ValueError("optimize_fsdp plans one block for all: the blocks must have one class and parameter shapes")
    if group is None and mesh is not None:
        group = mesh.get_group()
    world = dist.get_world_size(group)
    example_inputs = tuple(example_inputs)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root_params = [p for p in model.parameters() if id(p) not in in_blocks]
    limit = options.get("time_limit_s") or 5.0

    def planned():
        args, kwargs = _record_block_inputs(model, blocks[0], example_inputs)
        root_act = measure_root_activations(model, blocks, example_inputs, root_params)
        memory = fsdp_memory([list(b.parameters()) for b in blocks], root_params, world, root_act)
        if probe is not None:
            state, scratch = optimizer_terms(probe, world)
            memory = dataclasses.replace(memory, optimizer_state=state, update_scratch=scratch,
                                         optimizer=describe_optimizer(probe))
        fwd = _bound_forward(blocks[0])
        arg_bytes = _tensor_bytes(args, kwargs)
        problem = api.capture_problem(_with_kwargs(fwd, kwargs), args, device_profile=options.get("device_profile"))
        if not _offloads(options, args):  # the block's programs will not offload: neither may the search
            problem = dataclasses.replace(problem, host_bw=0.0)
        notes: list[str] = []
        for choice in choose_block_plan(problem, memory, budget.nbytes, arg_bytes, limit)[:4]:
            # planned again where it runs (costs measured again, fusion): the total is checked on that plan
            opt = api.optimize(fwd, choice.block_budget, **options)
            try:
                plan = _plan_as_used(opt, blocks[0], args, kwargs)
            except BudgetInfeasibleError as e:
                notes.append(f"{choice.describe()} (block budget {choice.block_budget}): infeasible when planned: {e}")
                continue
            spec = api.optimized_spec(opt)
            if choice.how != "solve":
                plan = with_schedule(plan, block_schedule(choice, plan.problem),
                                     f"optimize_fsdp: {choice.describe()}, the fastest block plan within the per-rank budget")
                spec = dataclasses.replace(spec, carried=(json.dumps(seal(plan.to_file_data()), separators=(",", ":")),))
            memory = memory.with_block(plan.predicted_peak_bytes, saved_bytes(plan.problem, plan.sim, arg_bytes))
            if budget.nbytes is None or memory.total <= budget.nbytes:
                break
            notes.append(f"{choice.describe()} (block budget {choice.block_budget}): {memory.total / MiB:.2f} MiB per "
                         "rank when planned, over the budget")
        else:
            e = BudgetInfeasibleError(budget.nbytes, memory.total, memory.fixed)
            e.args = (f"no block plan fits the per-rank budget {budget.nbytes / MiB:.2f} MiB: " + "; ".join(notes),)
            raise e
        block_budget = choice.block_budget
        info = FSDPPlan(budget.nbytes, block_budget, memory, plan, plan_digest(plan), notes, choice.describe())
        return (info, spec), (spec, memory, block_budget, notes, choice.describe())

    def replayed(payload):
        spec, memory, block_budget, notes, how = payload
        return FSDPPlan(budget.nbytes, block_budget, memory, None, "", list(notes), how), _without_plan_file(spec)

    # every rank gets the same payload, so the digests agree here; each block checks at its first call that it
    # replays the plan (_Replayed), and plan_digest(block.forward.plan) is then equal on every rank
    try:
        info, spec = _one_outcome(group, src, planned, replayed, lambda outcome: "")
    finally:
        expected = None if probe is None else describe_optimizer(probe)
        probe = None  # it holds the unsharded parameters, which fully_shard replaces: they must not stay alive
    info.notes.append(f"blocks planned on rank {src} and replayed on every rank")
    for b in blocks:
        fwd = _bound_forward(b)
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward)
        b.forward = _Replayed(api.optimize_like(fwd, spec), info)
    fully_shard(model, mesh=mesh)
    if factory is not None:
        model.optimizer = _sharded_optimizer(factory, model, expected, info)
    model.plan = info
    return model


def _fsdp_optimizer_option(options: dict):
    """Takes `optimizer` (a factory) and `updates_in_backward` out of optimize_fsdp's options: the update is
    always after the backward under FSDP2."""
    factory = options.pop("optimizer", None)
    if options.pop("updates_in_backward", "auto") not in (False, "auto"):
        raise NotImplementedError(
            "optimize_fsdp does not update inside the backward (updates_in_backward=True): FSDP2 reduce-scatters each "
            "gradient after the block's backward, and the update must take the reduced shard; the update runs after "
            "the backward (model.optimizer.step()): leave updates_in_backward out or pass False")
    return factory


def _sharded_optimizer(factory, model: torch.nn.Module, expected: str, info: FSDPPlan) -> torch.optim.Optimizer:
    """The factory's optimizer over the sharded parameters; it must be the one counted (`expected`, the probe's)."""
    optimizer = factory(list(model.parameters()))
    if type(optimizer) not in SUPPORTED or describe_optimizer(optimizer) != expected:
        got = describe_optimizer(optimizer) if type(optimizer) in SUPPORTED else f"a {type(optimizer).__name__}"
        raise ValueError(f"optimize_fsdp(optimizer=): the factory built {got} over the sharded parameters, but "
                         f"{expected} over the unsharded ones, whose state was counted: it must build the same "
                         "optimizer (type, groups and their options) from the parameters it is given")
    info.notes.append(f"optimizer {expected}: state {info.memory.optimizer_state / MiB:.2f} MiB per rank over its "
                      f"shards, counted from the first step; its update after the backward "
                      f"(model.optimizer.step(), temporaries {info.memory.update_scratch / MiB:.2f} MiB) peaks at "
                      f"{info.memory.update / MiB:.2f} MiB per rank")
    return optimizer


def _offloads(options: dict, args: tuple) -> bool:
    """Whether the block's programs may offload: optimize()'s option, by default on CUDA only."""
    if options.get("offload") is not None:
        return bool(options["offload"])
    devices = [a.device.type for a in args if isinstance(a, torch.Tensor)]
    return bool(devices) and devices[0] == "cuda"


def _plan_as_used(opt, block: torch.nn.Module, args: tuple, kwargs: dict) -> Plan:
    """Plan `opt` (a block's optimized forward) for the way FSDP2 uses a block's outputs: its post-forward hook
    hands on views of them (`view_as`) and drops the outputs themselves, and a gradient flows back into them.
    The first backward shows optsched that use (capture/output_usage: a gradient, not held), and the second
    call plans for it, so the plans carried to the ranks are the ones their steps replay. The gradients this
    leaves are dropped."""
    with torch.random.fork_rng():
        for _round in range(2):
            out = opt(*args, **kwargs)
            leaves = [t.view_as(t) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            del out
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
            del leaves
    for t in (*block.parameters(), *args, *kwargs.values()):
        if isinstance(t, torch.Tensor):
            t.grad = None
    return opt.plan


def _bound_forward(block: torch.nn.Module) -> Callable:
    """The block's forward as its class defines it, bound to the block (what FSDP2's hooks wrap)."""
    return type(block).forward.__get__(block)


def _with_kwargs(fwd: Callable, kwargs: dict) -> Callable:
    if not kwargs:
        return fwd

    def call(*args):
        return fwd(*args, **kwargs)

    return call


class _Replayed:
    """A block's planned forward under FSDP2: the carried plan replayed at its first call; a plan solved there
    instead (the sharded block captured a different graph) is an error, raised alike on every rank."""

    def __init__(self, optimized, info: FSDPPlan):
        self.optimized = optimized
        self.info = info

    @property
    def plan(self) -> Plan | None:
        return self.optimized.plan

    def __call__(self, *args, **kwargs):
        out = self.optimized(*args, **kwargs)
        plan = self.optimized.plan
        if plan is not None and self.info.block_plan is None:
            self.info.block_plan = plan
            self.info.digest = plan_digest(plan)
        if plan is not None and not any(n.startswith("loaded from") for n in plan.stats.notes):
            raise RuntimeError("optimize_fsdp: a sharded block captured another graph than the unsharded block planned "
                               "for (so it was planned again on this rank); please report it with the model")
        return out
