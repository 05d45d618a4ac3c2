"""A lower bound on the peak of every plan a `Problem` allows, stronger than one op's operands.

`step_bound(problem)` (used by `heuristics.lower_bound_peak`, which takes the max with its older
per-op bound) is valid over **every plan the simulator accepts for the problem**: every forward order and
backward order consistent with the dependencies, every save/recompute choice (each recomputable forward
op recomputed at most once, anywhere in the backward), every offload the problem permits (an
offloadable saved activation is off the device between its copy out and its prefetch), every subset of
the fusion options formed, with storage reuse (`Op.reuse`, `reuse_all`) taken wherever the simulator
could take it. It says nothing about other problems of the same program (another graph capture, other
fusion groups merged into ops, chunked loss heads, other measured costs).

Why it holds. Sizes first: a value made and read only inside a fusion option (`internal_tensors`) takes no
memory when the option is formed, so it counts 0 here (`fused_sizes`); an op in an option counts the smaller
of its own scratch space and the option's. Forming an option otherwise only lengthens lifetimes and
constrains the order, so the arguments below, made without it, stay lower bounds with it.

The simulator's step k holds every copy made at or before k and read at or after k (reuse ends an input's
copy one step before the reading step only when that step is its last reader). Three families of points:

* **Each backward op b** (it runs exactly once, after the whole forward). At b's step these are live in
  every plan: inputs (all step); tangents held by the engine (`TANGENT`, the whole backward); step outputs
  made in the forward (to the end); b's operands, less the inputs b may write its output into (the
  largest such pair, or every pair of a `reuse_all` op; a pair counts only where its input may die at b:
  an activation no descendant of b reads through the same copy); b's scratch. On top, a minimum cut
  (`_cut`) over what the plan decides around b:
    - which other backward ops run before b (a set closed under dependencies, containing b's ancestors,
      none of its descendants). A step output made by a backward op before b is live to the end; a value
      made by a backward op before b and read by one after b is live at b (backward values are never
      recomputed or offloaded); a gradient seed freed at its last read (`TANGENT_FREED`) is live at b
      while a reader runs after b;
    - for each forward value some backward op after b reads: a copy is live at b, or (recomputable
      producer) it is made again after b, which needs the producer's forward inputs after b in turn
      (the same choice, recursively). An offloadable activation (host bandwidth > 0) costs nothing
      (it may be on the host at b), nor does one of b's operands (counted already). Recomputing "at most
      once" is relaxed away, which only lowers the cut.
  Every plan gives one such choice, and the bytes it holds at b are at least the constant part plus the
  cut's value for that choice; the minimum over choices is therefore a lower bound at b.
* **Each forward op f**: inputs, its operands (less reuse as above), scratch, and the values made by f's
  ancestors that a descendant of f in the forward reads, or that are step outputs or returned values
  (live at least to the forward's end), or that a backward op reads when they can neither be recomputed
  nor offloaded (the backward then reads the original copy).
* **The caller's loss** (`TensorKind.CALLER`, when there is a backward): inputs, every gradient seed,
  the caller's tensors, the step outputs made in the forward, and the forward values the backward reads
  that can neither be recomputed nor offloaded nor written over at the backward's first step.

* **Each backward op b again, with its forward operands' save/recompute choices weighed** (`_choices`): in the
  simulator a forward value is saved (one copy, live from the forward to its last read) or its producer is
  recomputed once in the backward, before its first backward read, every later read taking that copy. An operand
  x of b that is saved is therefore live at every backward op that runs before b in every plan (b's ancestors);
  one recomputed was recomputed before b, which read its producer's inputs and made its other outputs then: each
  of those a descendant of b reads again has a copy spanning both reads, live at b, and is itself saved (live
  before b) or recomputed before b in turn. Each combination of choices gives the values live at b and those
  live at the ops before b; the bound is the least, over the combinations, of the largest of those points'
  bounds (each point's bound with its values counted). Values the host may hold make no claim. Tried at the
  CHAIN_POINTS backward ops with the highest bounds, against the CHAIN_BEFORE highest ops before each.

* **Regions** (`region_bound.py`): a few recomputable forward ops near a backward op, the backward ops that read
  them and their readers, every order and save/recompute choice of the region searched exactly (its docstring
  says why that is a bound).

* **One save/recompute choice for all steps** (`joint_bound.py`): the families above each assume their own choice; one
  recomputed set held at the caller's loss, every forward op and chosen backward ops at once (its docstring says why
  that is a bound).

The cuts are exact minimum cuts (a small Dinic max-flow); the backward ops are visited in the order of
an upper bound of theirs, so most need no flow at all; once the networks built reach `WORK_BUDGET` edges
the remaining ops keep their constant part (still a valid bound, and deterministic: no clock is read); the
choices above build at most CHAIN_WORK edges more.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from ..model import clock
from ..model.fusion_sim import internal_tensors
from ..model.problem import FusionOption, Op, Phase, Problem, Tensor, TensorKind
from . import joint_bound as joint_family, region_bound
from .flow import INF as _INF, FlowNet
from .joint_bound import joint_bound
from .region_bound import region_bounds

WORK_BUDGET = 200_000  # edges of the cut networks built per problem (then the rest keep their constant part)
CHAIN_WORK = 100_000  # edges of the cut networks the save/recompute choices below may build on top
CHAIN_POINTS = 3  # backward ops with the highest bounds where the operands' save/recompute choices are weighed
CHAIN_BEFORE = 3  # the backward ops before each (the highest upper bounds) where a saved operand is counted
CHAIN_CHOICES = 32  # save/recompute combinations weighed per point at most (more: that point is left as it is)
CHAIN_DEPTH = 3  # how far back recomputations' inputs are followed (beyond: no claim about them)


def step_bound(problem: Problem, joint: bool = False) -> int:
    """The largest of the families of bounds above (0 for an empty problem), its work counted on the solvers'
    clock (deterministic mode) wherever it is computed: every caller's wait includes it. `joint`: with the joint
    family too (`joint_bound.py`, up to a second at a few hundred ops): asked for by the solve for a budget it refuses
    (`strategy.peak_bound_for`, the floors too) and by its search when nothing fits (`strategy.JOINT_FLOOR`), not by
    the other checks before it (budgets, held outputs), whose time no limit holds. Kept on the problem: the
    same problem's bound is asked for again (the budget's resolution, held outputs, the solve) and costs nothing
    then. Kept per structure too (`_SAME_SHAPE`): a problem like one bounded before but for its op times takes
    that bound without the work, charged as if done (as an op time found in the op-time file is: the search's
    share of the limit, and so the plan, must not depend on what this process bounded before)."""
    key = _cache_key(problem)
    kept = problem.__dict__.setdefault("_step_bound", {})
    cached = kept.get(joint)
    if cached is not None and cached[0] == key:
        return cached[1]
    shape = _structure(problem), _limits(), joint
    same = next(((value, units, solved) for known, value, units, solved in _SAME_SHAPE if known == shape), None)
    if same is not None:  # a hit: the joint family's solves are charged as if run too
        value, units, solved = same
        charge = {**units, **solved}
    else:
        with clock.stage("bound"):
            b = _Bound(problem)
            value = b.value()
        units, solved = _point_units(b), {}
        if joint:
            value, arcs, solved = _with_joint(b)
            units = {**units, **arcs}
        _SAME_SHAPE.appendleft((shape, value, units, solved))
        charge = units  # the solves charged themselves as they ran
    for unit, n in charge.items():
        clock.count(unit, n)
    kept[joint] = (key, value)
    return value


def _point_units(b: _Bound) -> dict[str, float]:
    """The point families' work: per op, per tensor the per-op passes look at, per edge of the cut networks (not per
    op squared: that charged a 971-op Llama 4.9 s for 0.3 s of work), per state of the region searches."""
    return {"bound_op": len(b.p.ops), "bound_scan": b.scanned, "bound_edge": b.work, "bound_flow": b.flow_steps,
            "bound_state": b.region_states}


def _with_joint(b: _Bound) -> tuple[int, dict[str, float], dict[str, float]]:
    """(the bound with the joint family, its checks' work, its solves' work): the solves charge themselves as they run;
    kept for a problem of the same structure to be charged again."""
    arcs, before = b.joint_arcs, clock.units_counted()
    with clock.stage("bound"):
        value = b.joint()
    after = clock.units_counted()
    solved = {u: after[u] - before.get(u, 0) for u in after if after[u] != before.get(u, 0)}
    return value, {"joint_arc": b.joint_arcs - arcs}, solved


# (structure, bound, work, the joint family's solves' work) of the problems bounded last, with and without it: a
# program's floor (its problem before op timing) and its measured problem differ in op times alone where nothing
# measured changes a size, scratch or in-place write (a Llama's on the CPU: 0.8-1.5 s of wall time twice in a 5 s
# limit), and times do not enter the bound
_SAME_SHAPE: deque[tuple[tuple, int, dict[str, float], dict[str, float]]] = deque(maxlen=8)


def _structure(p: Problem) -> tuple:
    """Everything the bound may read: every field of the problem, its ops, storages and fusion options but names and
    times (derived from the dataclasses, so a field added later is part of the key)."""
    ops, tensors, options, scalars = (_fields_but(cls, "name", "time_s") for cls in (Op, Tensor, FusionOption, Problem))
    return (tuple(map(ops, p.ops)), tuple(map(tensors, p.tensors)), tuple(map(options, p.fusion_options)),
            scalars(p))


@functools.cache
def _fields_but(cls: type, *skip: str) -> Callable[[object], tuple]:
    """A getter of `cls`'s fields but `skip` (and, for a problem, its lists, keyed apart), as a tuple."""
    lists = ("ops", "tensors", "fusion_options") if cls is Problem else ()
    return attrgetter(*(f.name for f in dataclasses.fields(cls) if f.name not in skip + lists))


def _limits() -> tuple:
    """The searches' limits (this module's, region_bound's and joint_bound's constants), read now (a test lowers some): a bound
    found under other limits is another bound."""
    return tuple((m.__name__, k, v) for m in (sys.modules[__name__], region_bound, joint_family) for k, v in sorted(vars(m).items())
                 if k.isupper() and not k.startswith("_") and isinstance(v, (int, float)))


def _cache_key(p: Problem) -> tuple:
    """What the bound depends on, by identity where a list is large (a problem changed in place makes a new key)."""
    return (id(p.ops), len(p.ops), id(p.tensors), len(p.tensors), p.outputs, p.returned, p.host_bw,
            p.host_budget_bytes, p.fusion_options)


def explain(problem: Problem, joint: bool = True) -> tuple[int, str]:
    """(the bound, where it holds: "at <op>" or "while the caller computes its loss"); `joint`: with the joint family."""
    b = _Bound(problem)
    value = b.value()
    return (b.joint(), b.where) if joint else (value, b.where)


@dataclass
class _ForwardArrays:
    """Per forward-made tensor (`position`: tensor id -> its index, -1 for others): producer, whether it is live
    across every op its producer precedes (held by the caller, or read by the backward through its one copy),
    size; and its forward readers, flat (`readers`, each with its tensor's index in `reader_of`)."""

    producer: np.ndarray
    always: np.ndarray
    readers: np.ndarray
    reader_of: np.ndarray
    size: np.ndarray
    position: np.ndarray


class _Bound:
    def __init__(self, p: Problem):
        self.p = p
        self.size = fused_sizes(p)
        self.ws = fused_workspaces(p)
        self.readers = p.consumers()
        kinds = [t.kind for t in p.tensors]
        self.fw_made = [t.producer is not None and p.ops[t.producer].phase is Phase.FW for t in p.tensors]
        self.bw_made = [t.producer is not None and p.ops[t.producer].phase is Phase.BW for t in p.tensors]
        self.input_ids = {t.id for t in p.tensors if kinds[t.id] is TensorKind.INPUT}
        self.inputs = sum(self.size[t] for t in self.input_ids)
        self.visible = p.visible  # a property that builds a set: read once
        self.scanned, self.work = 0, 0  # tensors the per-op passes looked at, edges of the cut networks built
        self.flow_steps = 0  # edges the max flows scanned and advanced past (their work: phases x edges)
        self.region_states = 0  # states the region searches expanded (region_bound.py)
        self.joint_arcs = 0  # arcs of the joint bound's checks (joint_bound.py)
        self.held_tangents = sum(self.size[t.id] for t in p.tensors if kinds[t.id] is TensorKind.TANGENT)
        self.fw_outputs = {t for t in p.outputs if self.fw_made[t]}
        # live at every backward step of every plan: inputs, the seeds the engine holds, the forward's step outputs
        self.backward_const = self.inputs + self.held_tangents + sum(self.size[t] for t in self.fw_outputs)
        self.offloadable = [
            p.host_bw > 0 and t.offloadable and t.kind is TensorKind.ACTIVATION and t.id not in p.outputs
            and (p.host_budget_bytes is None or t.bytes <= p.host_budget_bytes)
            for t in p.tensors
        ]
        self.recomputable = [op.phase is Phase.FW and op.recomputable for op in p.ops]
        self.preds = [sorted({p.tensors[t].producer for t in op.inputs if p.tensors[t].producer is not None})
                      for op in p.ops]
        n = len(p.ops)
        self.anc = [0] * n  # bitsets over op ids
        for op in p.ops:  # program order is topological
            a = 0
            for q in self.preds[op.id]:
                a |= self.anc[q] | (1 << q)
            self.anc[op.id] = a
        succ: list[list[int]] = [[] for _ in range(n)]
        for o in range(n):
            for q in self.preds[o]:
                succ[q].append(o)
        self.succ = succ
        self.desc = [0] * n
        for o in reversed(range(n)):
            d = 0
            for s in succ[o]:
                d |= self.desc[s] | (1 << s)
            self.desc[o] = d
        self.where = ""
        self.has_backward = p.has_backward

    # ------------------------------------------------------------------ helpers

    def claimable(self, t: int) -> bool:
        """A forward value the plan decides about: made by the forward, held by nobody outside, on the device, taking
        memory (the chained, region and joint families claim only these)."""
        return self.fw_made[t] and t not in self.fw_outputs and self.size[t] > 0 and not self.offloadable[t]

    def _pinned(self, t: int) -> bool:
        """A forward value the backward can only read through its original copy, on the device."""
        prod = self.p.tensors[t].producer
        return self.fw_made[t] and not self.recomputable[prod] and not self.offloadable[t]

    def live_across_forward(self, t: int) -> bool:
        """A forward value live from its producer through the forward's end in every plan: held by the caller (on the
        device), or read by the backward through its one copy. `_forward` counts these at every op after the producer."""
        return ((t in self.visible and not self.offloadable[t])
                or (self._pinned(t) and any(self.p.ops[r].phase is Phase.BW for r in self.readers[t])))

    def _operands(self, op, skip: set[int]) -> tuple[int, set[int]]:
        """Bytes of the op's operands not in `skip`, less what storage reuse may save, plus its scratch."""
        ids = set(op.inputs) | set(op.outputs)
        own = ids - skip
        total = sum(self.size[t] for t in own)
        pairs = [self._may_reuse(op, inp) for _out, inp in op.reuse]
        if op.reuse_all:
            shared = sum(self.p.tensors[i].bytes for _o, i in op.reuse) if pairs and all(pairs) else 0
        else:
            shared = max((self.p.tensors[i].bytes for (_o, i), ok in zip(op.reuse, pairs) if ok), default=0)
        return max(0, total - shared) + self.ws[op.id], own

    def _may_reuse(self, op, inp: int) -> bool:
        """Whether `op` may write into `inp` in some plan: an activation nobody outside holds, whose copy op reads
        may die at op (no descendant of op reads that copy: values of the backward and values of forward ops
        that cannot be recomputed have one copy only)."""
        t = self.p.tensors[inp]
        if t.kind is not TensorKind.ACTIVATION or inp in self.visible:
            return False
        one_copy = self.bw_made[inp] or not self.recomputable[t.producer]
        return not (one_copy and any(self.desc[op.id] >> r & 1 for r in self.readers[inp] if r != op.id))

    # ------------------------------------------------------------------ families

    def value(self) -> int:
        p = self.p
        if not p.ops:
            return 0
        best, where = self._caller(), "while the caller computes its loss"
        self.fw_values = {}
        for op in p.fw_ops:
            v = self.fw_values[op.id] = self._forward(op)
            if v > best:
                best, where = v, f"at {op.name}"
        bw = p.bw_ops
        consts = {b.id: self._bw_const(b) for b in bw}
        if len(self._relevant()) * len(bw) <= WORK_BUDGET:  # an upper bound per op: visit the promising first
            order = sorted(((consts[b.id][0] + self._cut(b, consts[b.id][1], upper=True), b.id) for b in bw),
                           reverse=True)
        else:  # too large to bound each: the constant parts decide the order, with no early stop
            order = sorted(((_INF, b.id) for b in bw), key=lambda x: (-consts[x[1]][0], x[1]))
        found: dict[int, int] = {}
        for up, b in order:
            if up <= best:
                break
            const, skip = consts[b]
            v = const
            if self.work < WORK_BUDGET:
                v += self._cut(p.ops[b], skip)
            found[b] = v
            if v > best:
                best, where = v, f"at {p.ops[b].name}"
        upper = {b: up for up, b in order}
        self.chain_end = self.work + CHAIN_WORK
        for b in sorted(found, key=lambda b: (-found[b], b))[:CHAIN_POINTS]:
            if self.work >= self.chain_end:
                break
            v = self._chained(p.ops[b], consts, upper, found, best)
            if v > best:
                best, where = v, f"at {p.ops[b].name}"
        v, at = region_bounds(self, consts, upper, found, best)
        if v > best:
            best, where = v, at
        self.where, self.best, self.consts, self.upper = where, best, consts, upper
        return best

    def joint(self) -> int:
        """The bound with the joint family (`joint_bound.py`) too, after `value`."""
        if not self.p.ops:
            return 0
        v, at = joint_bound(self, self.consts, self.upper, self.best)
        if v > self.best:
            self.best, self.where = v, at
        return self.best

    def _caller(self, also: frozenset = frozenset()) -> int:
        """`also`: forward values the plan saves for the backward (their copies cross the caller's loss)."""
        base, held = self._caller_held
        if not held:
            return 0
        return base + sum(self.size[t] for t in also - held if self.p.tensors[t].kind is not TensorKind.INPUT)

    @functools.cached_property
    def _caller_held(self) -> tuple[int, frozenset[int]]:
        """The caller family's bound and what it holds (empty: no loss computed by the caller)."""
        p = self.p
        caller = [t.id for t in p.tensors if t.kind is TensorKind.CALLER]
        if not caller or not self.has_backward:
            return 0, frozenset()
        reused_in_bw = {i for op in p.bw_ops for _o, i in op.reuse}
        held = set(caller) | {t.id for t in p.tensors if t.kind in (TensorKind.TANGENT, TensorKind.TANGENT_FREED)}
        held |= self.fw_outputs
        held |= {t for t in range(len(p.tensors)) if self._pinned(t) and t not in reused_in_bw
                 and any(p.ops[r].phase is Phase.BW for r in self.readers[t])}
        return self.inputs + sum(self.size[t] for t in held if p.tensors[t].kind is not TensorKind.INPUT), frozenset(held)

    def _forward(self, f, also: frozenset = frozenset()) -> int:
        """The values made by ancestors of `f` that stay live across it (see the module docstring), in arrays:
        the same test as one Python loop over the tensors per op, which took most of the bound's time at
        thousands of ops (each bit test shifts a bitset as long as the program). `also`: forward values the plan
        saves for the backward (live from their producer to the forward's end)."""
        v, own = self._operands(f, self.input_ids)
        self.scanned += len(self.p.tensors)
        fa = self._forward_arrays
        hit = fa.always.copy()
        hit[fa.reader_of[self._bits(self.desc[f.id])[fa.readers]]] = True
        if also:
            hit[fa.position[list(also)]] = True
        live = hit & self._bits(self.anc[f.id])[fa.producer]
        mine = fa.position[list(own)] if own else fa.position[:0]
        live[mine[mine >= 0]] = False
        return self.inputs + v + int(fa.size[live].sum())

    def _bits(self, bitset: int) -> np.ndarray:
        """An op bitset as a boolean array over op ids."""
        n = len(self.p.ops)
        raw = np.frombuffer(bitset.to_bytes((n + 7) // 8, "little"), dtype=np.uint8)
        return np.unpackbits(raw, bitorder="little")[:n].astype(bool)

    @functools.cached_property
    def _forward_arrays(self) -> _ForwardArrays:
        p = self.p
        cand = [t.id for t in p.tensors if self.fw_made[t.id]]
        position = np.full(len(p.tensors), -1, dtype=np.int64)
        position[cand] = np.arange(len(cand))
        always, readers, reader_of = [], [], []
        for i, t in enumerate(cand):
            rs = self.readers[t]
            always.append(self.live_across_forward(t))
            fw_rs = [r for r in rs if p.ops[r].phase is Phase.FW]
            readers += fw_rs
            reader_of += [i] * len(fw_rs)
        return _ForwardArrays(
            np.array([p.tensors[t].producer for t in cand], dtype=np.int64),
            np.array(always, dtype=bool), np.array(readers, dtype=np.int64), np.array(reader_of, dtype=np.int64),
            np.array([self.size[t] for t in cand], dtype=np.int64), position)

    def _bw_const(self, b) -> tuple[int, set[int]]:
        p = self.p
        if not hasattr(self, "_fixed"):
            self._fixed = {t.id for t in p.tensors if t.kind in (TensorKind.INPUT, TensorKind.TANGENT)} | self.fw_outputs
        fixed = self._fixed
        v, own = self._operands(b, fixed)
        return self.backward_const + v, fixed | own

    # ------------------------------------------------------------------ the cut at a backward op

    def _relevant(self) -> list[int]:
        """Tensors a cut may count: values of the backward, freed seeds, forward values the backward reads."""
        if not hasattr(self, "_rel"):
            p = self.p
            self._rel = [
                t.id for t in p.tensors
                if self.size[t.id] and (self.bw_made[t.id] or t.kind is TensorKind.TANGENT_FREED
                                        or (self.fw_made[t.id] and t.id not in self.fw_outputs
                                            and any(p.ops[r].phase is Phase.BW for r in self.readers[t.id])))
            ]
        return self._rel

    def _cut(self, b, skip: set[int], upper: bool = False) -> int:
        """The least bytes the plan's choices around backward op `b` keep live there (see the module docstring),
        over tensors not in `skip`. `upper`: the value of one feasible choice instead (b's ancestors before it,
        every needed forward value kept), an upper bound on the minimum."""
        p = self.p
        anc, desc = self.anc[b.id], self.desc[b.id]
        if upper:
            up = 0
            self.scanned += len(self._relevant())
            for tid in self._relevant():
                if tid in skip:
                    continue
                others = [r for r in self.readers[tid] if r != b.id]
                if self.bw_made[tid]:
                    prod = p.tensors[tid].producer
                    if not anc >> prod & 1:
                        continue
                    if tid in p.outputs or any(not anc >> r & 1 for r in others):
                        up += self.size[tid]
                elif self.fw_made[tid] and self.offloadable[tid]:
                    continue
                elif any(not anc >> r & 1 for r in others if p.ops[r].phase is Phase.BW):
                    up += self.size[tid]
            return up
        net = FlowNet()
        SRC, SNK = net.node(), net.node()
        op_node: dict[int, int] = {}
        for o in p.bw_ops:
            if o.id != b.id:
                op_node[o.id] = k = net.node()
                if anc >> o.id & 1:
                    net.edge(SRC, k, _INF)
                elif desc >> o.id & 1:
                    net.edge(k, SNK, _INF)
        for o, k in op_node.items():  # source side (before b) is closed under dependencies
            for q in self.preds[o]:
                if q in op_node:
                    net.edge(k, op_node[q], _INF)
        fw_in: dict[int, int] = {}
        todo: list[int] = []

        def fwn(t: int) -> int:
            """The 'needed after b' node of a forward value (sink side = needed)."""
            if t not in fw_in:
                fw_in[t] = net.node()
                todo.append(t)
            return fw_in[t]

        for tid in self._relevant():
            if tid in skip:
                continue
            t = p.tensors[tid]
            others = [r for r in self.readers[tid] if r != b.id]
            if self.bw_made[tid]:
                prod = t.producer
                if prod == b.id or (desc >> prod & 1):
                    continue
                if tid in p.outputs:
                    net.edge(op_node[prod], SNK, self.size[tid])
                elif others:
                    y = net.node()
                    net.edge(op_node[prod], y, self.size[tid])
                    for r in others:
                        net.edge(y, op_node[r], _INF)
            elif t.kind is TensorKind.TANGENT_FREED:
                if others:
                    y = net.node()
                    net.edge(SRC, y, self.size[tid])
                    for r in others:
                        net.edge(y, op_node[r], _INF)
            else:
                for r in others:
                    if p.ops[r].phase is Phase.BW:
                        net.edge(fwn(tid), op_node[r], _INF)
        while todo:  # forward values: kept at b (their bytes), or made again after b from their inputs
            t = todo.pop()
            k = fw_in[t]
            free = t in skip or self.offloadable[t] or self.size[t] == 0
            prod = p.tensors[t].producer
            if free and not self.recomputable[prod]:
                continue
            out = net.node()
            if not free:
                net.edge(out, k, self.size[t])
            if not self.recomputable[prod]:
                net.edge(SRC, out, _INF)
                continue
            for u in p.ops[prod].inputs:
                if self.fw_made[u] and u not in self.fw_outputs:
                    net.edge(fwn(u), out, _INF)
        self.work += len(net.to) // 2
        flow = net.max_flow(SRC, SNK)
        self.flow_steps += net.steps
        return flow


    # ------------------------------------------------------------------ save or recompute b's operands

    def _chained(self, b, consts: dict, upper: dict, found: dict, best: int) -> int:
        """A bound at `b` over the plan's save/recompute choices for b's forward operands (see `_choices`): each
        choice keeps some values live at b and others at every backward op before b; the least over the choices
        of the largest of those points' bounds. 0 when there is nothing to choose, too much, or no work left.
        `upper`, `found`: per backward op, an upper bound and (filled in here) its bound."""
        p = self.p
        choices = self._choices(b)
        if choices is None or len(choices) < 2:
            return 0
        before = [q for q in upper if self.anc[b.id] >> q & 1]  # backward ops that run before b in every plan
        for q in sorted(before, key=lambda q: (-upper[q], q))[:CHAIN_BEFORE * 3]:
            if q not in found and self.work < self.chain_end:
                found[q] = consts[q][0] + self._cut(p.ops[q], consts[q][1])
        before = sorted((q for q in before if q in found), key=lambda q: (-found[q], q))[:CHAIN_BEFORE]
        least = _INF
        for at_b, at_before in choices:
            v = self._forced(b, *consts[b.id], at_b)
            for q in before:
                if v >= least or self.work >= self.chain_end:
                    break
                if at_before:
                    v = max(v, self._forced(p.ops[q], *consts[q], at_before))
            if self.work >= self.chain_end:
                return 0
            least = min(least, v)
            if least <= best:
                return least
        return least

    def _forced(self, op, const: int, skip: set[int], live: frozenset[int]) -> int:
        """The bound at `op` with `live` known to be live there."""
        return const + sum(self.size[t] for t in live - skip) + self._cut(op, skip | live)

    def _choices(self, b) -> list[tuple[frozenset[int], frozenset[int]]] | None:
        """Per plan, what its choice for b's forward operands keeps live: (at b, at every backward op before b).
        In the simulator a forward value is saved (its one copy live from the forward to its last read) or its
        producer recomputed once in the backward, before its first backward read, every later read taking that
        copy. So an operand x of b that is saved is live at every backward op before b; one recomputed was
        recomputed before b, which read the producer's inputs and made its other outputs there: each of those
        that a descendant of b reads again is then live at b (its copy spans both reads), and is itself saved or
        recomputed before b in turn. Values the host may hold (offloadable) make no claim. None: more than
        CHAIN_CHOICES combinations."""
        p = self.p
        desc = self.desc[b.id]
        claimable = self.claimable

        def read_after(t: int) -> bool:  # by a descendant of b, in every plan after b
            return any(desc >> r & 1 for r in self.readers[t] if p.ops[r].phase is Phase.BW)

        def combine(xs, ys):
            out = [(a | c, d | e) for a, d in xs for c, e in ys]
            if len(out) > CHAIN_CHOICES:
                raise _TooMany
            return out

        def options(t: int, at_b: frozenset[int], depth: int):
            saved = (at_b, frozenset({t}))
            prod = p.tensors[t].producer
            if not self.recomputable[prod]:
                return [saved]
            if depth >= CHAIN_DEPTH:  # recomputed, its inputs are not followed further: no claim about them
                return [saved, (at_b, frozenset())]
            made = frozenset(y for y in p.ops[prod].outputs if y != t and claimable(y) and read_after(y))
            recomputed = [(at_b | made, frozenset())]
            for u in dict.fromkeys(p.ops[prod].inputs):
                if claimable(u) and read_after(u):
                    recomputed = combine(recomputed, options(u, frozenset({u}), depth + 1))
            return [saved, *recomputed]

        choices = [(frozenset(), frozenset())]
        try:
            for x in dict.fromkeys(b.inputs):
                if claimable(x):
                    choices = combine(choices, options(x, frozenset(), 0))
        except _TooMany:
            return None
        return choices


class _TooMany(Exception):
    """More save/recompute combinations than `_choices` considers."""


def fused_sizes(p: Problem) -> list[int]:
    """Bytes per tensor, 0 for a value a fusion option may keep inside its kernel."""
    size = [t.bytes for t in p.tensors]
    if p.fusion_options:
        readers = p.consumers()
        for opt in p.fusion_options:
            for t in internal_tensors(p, opt.members, readers):
                size[t] = 0
    return size


def fused_workspaces(p: Problem) -> list[int]:
    """Scratch bytes per op, the smaller of its own and its fusion option's."""
    ws = [op.workspace_bytes for op in p.ops]
    for opt in p.fusion_options:
        for o in opt.members:
            ws[o] = min(ws[o], opt.workspace_bytes)
    return ws
