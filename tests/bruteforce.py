"""Ground truth for tests/test_bounds.py: small random training problems, an independent liveness
checker, and brute-force enumeration of every save/recompute plan for a fixed op order.

Nothing here imports the solvers' models (CP-SAT, relaxations): only the problem data types, the
simulator (which the liveness checker cross-examines) and `place_recomputes`, the placement every
solver uses, so that enumerated plans are the ones the solvers can return.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import strategies as st

from optsched.solvers import Op, Phase, Problem, Schedule, ScheduleError, Tensor, TensorKind, simulate
from optsched.solvers.search.heuristics import place_recomputes

# ---------------------------------------------------------------------------------------------
# an independent liveness checker


@dataclass
class Replay:
    peak_bytes: int
    time_s: float
    timeline: list[int]
    boundary_bytes: int


def replay(problem: Problem, schedule: Schedule) -> Replay:
    """Walk the schedule and count live bytes, written from the memory convention the simulator's
    docstring states, not from its code:

    - every op allocates its outputs at its step; a storage is live from the step that makes it to the
      last step reading it (inclusive), or only its own step if nobody reads it;
    - inputs live all program, tangents through the backward (a TANGENT_FREED one from the backward's
      start to its last reader), step outputs to the end, forward results
      the caller drops (`returned`) at least to the forward's end;
    - a backward step reads the recomputed copy of a tensor whose producer was recomputed before it,
      the original otherwise;
    - storage reuse: an op with (out, in) pairs writes its output into an activation input (not an
      output/returned value) whose storage dies at this step, so that input is gone at this step; only
      the first qualifying pair, or, for `reuse_all`, every pair or none;
    - an op's workspace counts during its step;
    - with `TensorKind.CALLER` tensors, the caller's loss between forward and backward holds what
      crosses the boundary, the tangents and its own tensors.

    The time is the sum of the run steps' costs (no offloading here).
    """
    tensors = problem.tensors
    steps = [(o, False) for o in schedule.fw_order] + [
        (o, problem.ops[o].phase is Phase.FW) for o in schedule.bw_order
    ]
    n_fw, n = len(schedule.fw_order), len(steps)
    last = n - 1
    start: dict[tuple[int, bool], int] = {}
    end: dict[tuple[int, bool], int] = {}
    for t in tensors:
        if t.kind is TensorKind.INPUT:
            start[(t.id, False)], end[(t.id, False)] = 0, last
        elif t.kind is TensorKind.TANGENT:
            start[(t.id, False)], end[(t.id, False)] = n_fw, last
        elif t.kind is TensorKind.TANGENT_FREED:  # the backward took it over: to its last reader
            start[(t.id, False)], end[(t.id, False)] = n_fw, n_fw
    rc_done: set[int] = set()  # forward ops recomputed at an earlier step
    read_key: list[dict[int, tuple[int, bool]]] = []
    time_s = 0.0
    for k, (o, is_rc) in enumerate(steps):
        op = problem.ops[o]
        keys = {}
        for t in op.inputs:
            copy = k >= n_fw and tensors[t].producer in rc_done
            key = (t, copy)
            assert key in start and start[key] <= k, f"step {k} reads {tensors[t].name} before it exists"
            end[key] = max(end[key], k)
            keys[t] = key
        read_key.append(keys)
        for t in op.outputs:
            assert (t, is_rc) not in start, f"{tensors[t].name} made twice"
            start[(t, is_rc)] = end[(t, is_rc)] = k
        if is_rc:
            rc_done.add(o)
        time_s += op.time_s
    for t in problem.outputs:
        if (t, False) in end:
            end[(t, False)] = last
    for t in problem.returned:
        if (t, False) in end:
            end[(t, False)] = max(end[(t, False)], n_fw - 1)
    visible = problem.outputs | problem.returned
    for k, (o, _rc) in enumerate(steps):
        op = problem.ops[o]
        dying = []
        for _out, inp in op.reuse:
            key = read_key[k][inp]
            if tensors[inp].kind is TensorKind.ACTIVATION and inp not in visible and end[key] == k and start[key] < k:
                dying.append(key)
        if op.reuse_all:
            dying = dying if len(dying) == len(op.reuse) else []
        else:
            dying = dying[:1]
        for key in dying:
            end[key] = k - 1
    timeline = []
    for k, (o, _rc) in enumerate(steps):
        live = sum(tensors[t].bytes for (t, c), s in start.items() if s <= k <= end[(t, c)])
        timeline.append(live + problem.ops[o].workspace_bytes)
    if not timeline:
        timeline = [sum(tensors[t].bytes for (t, _c) in start)]
    caller = sum(t.bytes for t in tensors if t.kind is TensorKind.CALLER)
    boundary = 0
    if caller and n > n_fw:
        first = set(read_key[n_fw].values())  # a value the first backward step reads (and maybe writes into) crosses
        crossing = sum(
            tensors[t].bytes
            for (t, c), s in start.items()
            if s < n_fw <= end[(t, c)] or (s == n_fw and tensors[t].kind in (TensorKind.TANGENT, TensorKind.TANGENT_FREED))
            or (s < n_fw and (t, c) in first)
        )
        boundary = crossing + caller
    return Replay(max(timeline + [boundary]), time_s, timeline, boundary)


# ---------------------------------------------------------------------------------------------
# brute force over one order


@dataclass(frozen=True)
class Plan:
    recompute: frozenset[int]  # the recompute set that was asked for (place_recomputes drops unneeded ones)
    schedule: Schedule
    peak_bytes: int
    time_s: float


def recomputable_fw_ops(problem: Problem) -> list[int]:
    return [o.id for o in problem.fw_ops if o.recomputable]


def enumerate_plans(
    problem: Problem, fw_order: list[int], bw_order: list[int], check: bool = True, ops: list[int] | None = None
) -> list[Plan]:
    """Every subset of `ops` (default: the recomputable forward ops), placed as the solvers place them,
    simulated; the independent replay must agree with the simulator on each (`check`). One plan per
    distinct schedule."""
    ops = recomputable_fw_ops(problem) if ops is None else list(ops)
    seen: dict[tuple[int, ...], Plan] = {}
    for r in range(len(ops) + 1):
        for subset in itertools.combinations(ops, r):
            sched = place_recomputes(problem, fw_order, bw_order, subset)
            key = tuple(sched.bw_order)
            if key in seen:
                continue
            sim = simulate(problem, sched)
            if check:
                mine = replay(problem, sched)
                assert mine.peak_bytes == sim.peak_bytes, (
                    f"simulator and replay disagree on the peak of {sched.to_dict()}: "
                    f"{sim.peak_bytes} vs {mine.peak_bytes} (timelines {sim.timeline} vs {mine.timeline}, "
                    f"boundary {sim.boundary_bytes} vs {mine.boundary_bytes})"
                )
                assert mine.timeline == sim.timeline, (sched.to_dict(), sim.timeline, mine.timeline)
                assert abs(mine.time_s - sim.time_s) <= 1e-12 * max(1.0, sim.time_s)
            seen[key] = Plan(frozenset(subset), sched, sim.peak_bytes, sim.time_s)
    return list(seen.values())


def sampled_placements(problem: Problem, fw_order: list[int], rng, count: int) -> list[int]:
    """Peaks of `count` random plans: a random recomputed set, its recomputations and the backward ops interleaved in
    a random order their data allows (not only just before their first reader, as `place_recomputes` puts them).
    Plans the simulator refuses are left out."""
    rec = recomputable_fw_ops(problem)
    peaks = []
    for _ in range(count):
        chosen = {o for o in rec if rng.random() < 0.5}
        steps = [(o.id, False) for o in problem.bw_ops] + [(o, True) for o in sorted(chosen)]
        needs = {}
        for o, again in steps:
            producers = {problem.tensors[t].producer for t in problem.ops[o].inputs} - {None}
            needs[(o, again)] = {(q, problem.ops[q].phase is Phase.FW) for q in producers
                                 if problem.ops[q].phase is Phase.BW or q in chosen}
        done: set[tuple[int, bool]] = set()
        order: list[int] = []
        while len(order) < len(steps):
            step = rng.choice([s for s in steps if s not in done and needs[s] <= done])
            done.add(step)
            order.append(step[0])
        try:
            peaks.append(simulate(problem, Schedule(fw_order=list(fw_order), bw_order=order)).peak_bytes)
        except ScheduleError:
            continue
    return peaks


def min_peak(plans: list[Plan]) -> int:
    return min(p.peak_bytes for p in plans)


def min_time_within(plans: list[Plan], budget: int | None) -> float:
    """The least step time of a plan within the budget (inf when none fits)."""
    return min((p.time_s for p in plans if budget is None or p.peak_bytes <= budget), default=float("inf"))


def least_time_within(
    problem: Problem, fw_order: list[int], bw_order: list[int], budget: int | None, ops: list[int] | None = None,
) -> Plan | None:
    """The plan `enumerate_plans` would find fastest within the budget (None when none fits), found without
    simulating every subset: subsets of `ops` (default: the recomputable forward ops) are visited in order of
    their ops' summed time and the first whose placed plan fits is the fastest.

    Why that is exact: `place_recomputes(S)` recomputes the ops of S some backward step needs (kept(S) <= S),
    and `place_recomputes(kept(S))` is the same schedule (the placement only ever looks at ops it reaches), so
    every plan's time is the base time plus the summed time of a subset that yields it. The fastest fitting
    plan's subset K comes no later than any subset of larger sum, and the first fitting subset F (sum(F) <=
    sum(K)) gives a plan no slower than base + sum(F) <= base + sum(K): the fastest. Each visited plan's time
    is checked to be at most base + sum(S), which the argument rests on.

    Subsets are simulated only when what their plan surely holds (`_surely_held`, lower bounds on its peak at
    the forward's end and at each backward step, checked against each simulated plan) fits the budget, and
    subsets that follow from one by recomputing ops that cannot free enough are not visited."""
    import heapq

    import numpy as np

    ops = sorted(recomputable_fw_ops(problem) if ops is None else list(ops), key=lambda o: problem.ops[o].time_s)
    cost = [problem.ops[o].time_s for o in ops]
    base = simulate(problem, place_recomputes(problem, fw_order, bw_order, [])).time_s
    held0, freed = _surely_held(problem, bw_order)
    gain = [freed.get(o, np.zeros_like(held0)) for o in ops]
    suffix = [sum(gain[i:], np.zeros_like(held0)) for i in range(len(ops) + 1)]  # the most ops[i:] can free

    def may_fit(prefix_freed, first_free: int) -> bool:
        """Whether some subset of (the prefix) + ops[first_free:] may fit, by what its plan surely holds."""
        return budget is None or int((held0 - prefix_freed - suffix[first_free]).max()) <= budget

    # subsets in nondecreasing summed time: from (.., i) go to (.., i, i+1) and (.., i+1) (each subset once)
    heap = [(0.0, (), np.zeros_like(held0))]  # (summed time, indices, what they free at each point)
    while heap:
        total, idx, gone = heapq.heappop(heap)
        last = idx[-1] if idx else -1
        subset = [ops[i] for i in idx]
        held = int((held0 - gone).max())
        if budget is None or held <= budget:
            sched = place_recomputes(problem, fw_order, bw_order, subset)
            # a subset with ops the placement drops gives the plan of the ops it keeps, visited already
            if len(sched.bw_order) - len(bw_order) == len(subset):
                sim = simulate(problem, sched)
                assert sim.time_s <= base + total + 1e-12 * max(1.0, sim.time_s), (idx, sim.time_s, base, total)
                at = [len(fw_order) - 1] + [len(fw_order) + sched.bw_order.index(b) for b in bw_order]
                surely = held0 - gone
                assert all(int(h) <= sim.timeline[j] for h, j in zip(surely, at) if j >= 0), (subset, surely, sim.timeline)
                if budget is None or sim.peak_bytes <= budget:
                    return Plan(frozenset(subset), sched, sim.peak_bytes, sim.time_s)
        nxt = last + 1
        if nxt < len(ops):
            if may_fit(gone, nxt):  # idx + (nxt,) and what follows from it
                heapq.heappush(heap, (total + cost[nxt], (*idx, nxt), gone + gain[nxt]))
            if idx and may_fit(gone - gain[last], nxt):  # idx with its last op replaced by nxt, and what follows
                heapq.heappush(heap, (total - cost[last] + cost[nxt], (*idx[:-1], nxt), gone - gain[last] + gain[nxt]))
    return None


def _surely_held(problem: Problem, bw_order: list[int]):
    """Lower bounds on a plan's live bytes at a few points, linear in the ops it recomputes (placed by
    `place_recomputes`, so a backward op reads the recomputed copy of a value whose producer is recomputed):
    (nothing recomputed, per point) and, per forward op, what recomputing it takes off at each point.

    Points: the forward's last step, holding the inputs, the forward's step outputs and returned values and
    every forward value a backward op reads from an op not recomputed; and each backward op's step, holding
    the inputs, tangents, step outputs made so far, every value a later backward op reads (made by the
    forward: from an op not recomputed) and, unless it writes into an input (storage reuse), the op's own
    inputs (the original or the recomputed copy), outputs and workspace. Nothing counted at a backward step
    dies there, so no storage reuse there can end it."""
    import numpy as np

    tensors = problem.tensors
    pos = {b: k for k, b in enumerate(bw_order)}

    def fw_made(t: int) -> bool:
        p = tensors[t].producer
        return p is not None and problem.ops[p].phase is Phase.FW

    last_read: dict[int, int] = {}
    for b in bw_order:
        for t in problem.ops[b].inputs:
            last_read[t] = max(last_read.get(t, -1), pos[b])
    fixed = {t.id for t in tensors if t.kind in (TensorKind.INPUT, TensorKind.TANGENT)}
    inputs = sum(t.bytes for t in tensors if t.kind is TensorKind.INPUT)
    outs = {t for t in problem.outputs if fw_made(t)}
    at_end = outs | {t for t in problem.returned if fw_made(t)}
    n = len(bw_order) + 1  # point 0: the forward's end; point k + 1: backward step k
    held = np.zeros(n, dtype=np.int64)
    held[0] = inputs + sum(tensors[t].bytes for t in at_end)
    freed: dict[int, np.ndarray] = {}
    for k, b in enumerate(bw_order):
        op = problem.ops[b]
        own = set() if op.reuse else (set(op.inputs) | set(op.outputs)) - fixed
        sure = fixed | outs | own
        for t in problem.outputs:  # the backward's step outputs made so far
            p = tensors[t].producer
            if p is not None and p in pos and pos[p] < k:
                sure.add(t)
        later = {t for t, j in last_read.items() if j > k and t not in sure}
        bw_later = {t for t in later if not fw_made(t) and tensors[t].producer in pos and pos[tensors[t].producer] < k}
        bw_later |= {t for t in later if tensors[t].kind is TensorKind.TANGENT_FREED}  # a seed a later op reads
        held[k + 1] = sum(tensors[t].bytes for t in sure | bw_later) + (0 if op.reuse else op.workspace_bytes)
        for t in later:
            if fw_made(t):
                held[k + 1] += tensors[t].bytes
                p = tensors[t].producer
                freed.setdefault(p, np.zeros(n, dtype=np.int64))[k + 1] += tensors[t].bytes
    for t in last_read:
        if fw_made(t) and t not in at_end:
            held[0] += tensors[t].bytes
            p = tensors[t].producer
            freed.setdefault(p, np.zeros(n, dtype=np.int64))[0] += tensors[t].bytes
    return held, freed


def topological_orders(problem: Problem, ids: list[int], limit: int, first: list[int] | None = None) -> list[list[int]]:
    """Up to `limit` orders of the ops `ids` that respect their dependencies among themselves; `first`
    (one of them, e.g. the program order) leads the list."""
    deps = {o: {problem.tensors[t].producer for t in problem.ops[o].inputs} & set(ids) for o in ids}
    out: list[list[int]] = [first] if first is not None else []

    def rec(order: list[int], left: set[int]) -> None:
        if len(out) >= limit:
            return
        if not left:
            if order != first:
                out.append(list(order))
            return
        for o in sorted(left):
            if deps[o] <= set(order):
                order.append(o)
                rec(order, left - {o})
                order.pop()
                if len(out) >= limit:
                    return

    rec([], set(ids))
    return out


def topological_fw_orders(problem: Problem, limit: int = 200) -> list[list[int]]:
    """Up to `limit` topological orders of the forward (program order first)."""
    fw = [o.id for o in problem.fw_ops]
    return topological_orders(problem, fw, limit, first=fw)


# ---------------------------------------------------------------------------------------------
# random training problems

SIZES = (1, 2, 3, 4, 6, 8)  # units of 64 bytes


@st.composite
def training_problems(
    draw,
    min_fw: int = 4,
    max_fw: int = 9,
    reuse: bool = True,
    reuse_all: bool = True,
    workspace: bool = True,
    caller: bool = True,
    returned: bool = True,
) -> Problem:
    """A forward of `min_fw`..`max_fw` ops (the last one a loss, a step output), a tangent and a
    backward that mirrors the forward in reverse, each backward op reading the running gradient, maybe
    an earlier gradient, and some inputs/outputs of its forward op (what autograd would save).

    Features the checker models and the generator may use: storage reuse (single pairs and, with
    `reuse_all`, all-or-nothing pairs), workspace, a caller's loss (`TensorKind.CALLER`), forward results the caller drops
    (`returned`), non-recomputable ops, ops with two outputs. Not used: offloading (`host_bw` stays 0:
    brute force over offload placements is out of scope, and the bounds' claims change with it).
    Op times are whole microseconds, so the solvers' rounding of costs to whole ns is exact.
    """
    unit = 64
    tensors: list[Tensor] = []
    ops: list[Op] = []

    def new_tensor(name: str, nbytes: int, kind: TensorKind, producer: int | None = None) -> int:
        tensors.append(Tensor(len(tensors), name, nbytes, kind, producer))
        return len(tensors) - 1

    def size() -> int:
        return unit * draw(st.sampled_from(SIZES))

    def add_op(name: str, phase: Phase, inputs: list[int], out_sizes: list[int], recomputable: bool = True,
               extra_reuse: bool = True) -> list[int]:
        oid = len(ops)
        inputs = list(dict.fromkeys(inputs))
        outs = [new_tensor(f"{name}.{k}", b, TensorKind.ACTIVATION, oid) for k, b in enumerate(out_sizes)]
        pairs: list[tuple[int, int]] = []
        together = False
        if reuse and extra_reuse and draw(st.integers(0, 2)) == 0:
            # the output may take over an input's storage: sizes must match, so resize the output
            same = [i for i in inputs if tensors[i].kind is not TensorKind.INPUT] or inputs
            if reuse_all and len(outs) >= 2 and len(same) >= 2 and draw(st.booleans()):
                together = True
                pairs = [(outs[0], same[0]), (outs[1], same[1])]
            else:
                pairs = [(outs[0], draw(st.sampled_from(same)))]
                if len(outs) >= 2 and len(inputs) >= 2 and draw(st.booleans()):
                    pairs.append((outs[1], draw(st.sampled_from([i for i in inputs if i != pairs[0][1]]))))
            for out, inp in pairs:
                t = tensors[out]
                tensors[out] = Tensor(t.id, t.name, tensors[inp].bytes, t.kind, t.producer)
        ws = unit * draw(st.sampled_from((0, 0, 0, 2, 5))) if workspace else 0
        t_s = draw(st.integers(1, 1000)) * 1e-6
        ops.append(Op(oid, name, phase, tuple(inputs), tuple(outs), t_s, recomputable, tuple(pairs), together, ws))
        return outs

    n_fw = draw(st.integers(min_fw, max_fw))
    n_inputs = draw(st.integers(1, 2))
    inputs = [new_tensor(f"in{i}", size(), TensorKind.INPUT) for i in range(n_inputs)]
    avail = list(inputs)  # forward values so far
    fw_reads: list[list[int]] = []
    fw_outs: list[list[int]] = []
    for i in range(n_fw - 1):
        # read one of the newest values and maybe one more (older values make long-lived activations,
        # and branches give the forward more than one order)
        ins = [avail[-1 - draw(st.integers(0, min(2, len(avail) - 1)))]]
        if len(avail) > 1 and draw(st.booleans()):
            ins.append(draw(st.sampled_from(avail[:-1])))
        n_out = 2 if draw(st.integers(0, 4)) == 0 else 1
        rec = draw(st.integers(0, 6)) != 0
        outs = add_op(f"f{i}", Phase.FW, ins, [size() for _ in range(n_out)], rec)
        fw_reads.append(list(dict.fromkeys(ins)))
        fw_outs.append(outs)
        avail.extend(outs)
    # the loss: a step output; reads the newest value
    (loss,) = add_op("loss", Phase.FW, [avail[-1]], [4], draw(st.booleans()), extra_reuse=False)
    fw_reads.append([avail[-1]])
    fw_outs.append([loss])
    acts = [t for outs in fw_outs[:-1] for t in outs]
    ret: set[int] = set()
    if returned and acts and draw(st.integers(0, 3)) == 0:
        ret.add(draw(st.sampled_from(acts)))
    # the seed: held by the engine all backward, or taken over by the backward (freed after its last reader)
    freed_seed = draw(st.booleans())
    tangent = new_tensor("tangent", size() if freed_seed else 4, TensorKind.TANGENT_FREED if freed_seed else TensorKind.TANGENT)
    if caller and draw(st.integers(0, 3)) == 0:
        new_tensor("caller_loss", size(), TensorKind.CALLER)
    outputs = {loss}
    grads = [tangent]
    for i in reversed(range(n_fw)):
        ins = [grads[-1]]
        if len(grads) > 1 and draw(st.integers(0, 3)) == 0:
            ins.append(draw(st.sampled_from(grads[:-1])))
        saved_from = [t for t in fw_reads[i] + fw_outs[i] if tensors[t].kind is not TensorKind.INPUT]
        if saved_from:
            ins.extend(draw(st.lists(st.sampled_from(saved_from), max_size=2, unique=True)))
        reads_param = any(tensors[t].kind is TensorKind.INPUT for t in fw_reads[i])
        out_sizes = [size()] + ([size()] if reads_param else [])
        outs = add_op(f"b{i}", Phase.BW, ins, out_sizes)
        grads.append(outs[0])
        if reads_param:
            outputs.add(outs[1])  # a parameter's gradient
    outputs.add(grads[-1])  # the input's gradient
    return Problem(ops, tensors, outputs=frozenset(outputs), returned=frozenset(ret), name="fuzz")


def describe(problem: Problem) -> str:
    """The problem as Python source, for reproductions in failure messages."""
    lines = ["Problem(", "    ops=["]
    for o in problem.ops:
        lines.append(f"        {o!r},")
    lines.append("    ],")
    lines.append("    tensors=[")
    for t in problem.tensors:
        lines.append(f"        {t!r},")
    lines.append("    ],")
    lines.append(f"    outputs=frozenset({sorted(problem.outputs)}), returned=frozenset({sorted(problem.returned)}),")
    lines.append(")")
    return "\n".join(lines)
