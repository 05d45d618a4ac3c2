"""Per-block options combined along the chain (issue 14): the chain model against brute force, the
search never worse than its start, and early blocks recomputing more than late ones where that pays."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from optsched.solvers import Op, Phase, Problem, Schedule, Tensor, TensorKind, default_schedule, simulate, solve
from optsched.solvers.cpsat.chain import BlockOption, ChainSegment, CopyLimits, choose_options
from optsched.solvers.model import clock
from optsched.solvers.search.blocks import find_blocks
from optsched.solvers.search.chain import improve_by_chain
from optsched.solvers.search.heuristics import place_recomputes
from optsched.solvers.search.segments import better, improve_by_segments
from optsched.solvers.synthetic import chain_training_problem
from tests.schedule_checker import assert_valid

KIB = 1024
NS = 1e-9


def expand_reduce_problem(n_blocks: int = 6, big: int = 256 * KIB, small: int = 64 * KIB, grad: int = 16 * KIB,
                          host_bw: float = 0.0) -> Problem:
    """A chain of blocks `h -> a = expand(h) (big, cheap) -> h' = reduce(a, w) (small, slow)`; the backward
    reads each block's `a` and `h`. Keeping a block's `a` raises every step from its forward to its
    backward, so a late block's costs least to keep."""
    ops: list[Op] = []
    tensors: list[Tensor] = []

    def tensor(name, nbytes, kind=TensorKind.INPUT, producer=None):
        tensors.append(Tensor(len(tensors), name, nbytes, kind, producer))
        return len(tensors) - 1

    def op(name, phase, inputs, out_bytes, time_s, recomputable=True):
        oid = len(ops)
        outs = [tensor(f"{name}.{k}", b, TensorKind.ACTIVATION, oid) for k, b in enumerate(out_bytes)]
        ops.append(Op(oid, name, phase, tuple(dict.fromkeys(inputs)), tuple(outs), time_s, recomputable))
        return outs

    h = tensor("x", small)
    weights = [tensor(f"w{i}", grad) for i in range(n_blocks)]
    saved = []
    for i in range(n_blocks):
        (a,) = op(f"expand{i}", Phase.FW, [h], [big], 1e-4)
        (h_next,) = op(f"reduce{i}", Phase.FW, [a, weights[i]], [small], 1e-3)
        saved.append((h, a))
        h = h_next
    (loss,) = op("loss", Phase.FW, [h], [4], 1e-5)
    (g,) = op("loss_bw", Phase.BW, [tensor("tangent", 4, TensorKind.TANGENT), h], [small], 1e-5, False)
    grads = []
    for i in reversed(range(n_blocks)):
        h_in, a = saved[i]
        (ga,) = op(f"reduce{i}_bw_x", Phase.BW, [g, weights[i]], [big], 1e-3, False)
        (gw,) = op(f"reduce{i}_bw_w", Phase.BW, [g, a], [grad], 1e-3, False)
        (g,) = op(f"expand{i}_bw", Phase.BW, [ga, h_in], [small], 1e-4, False)
        grads.append(gw)
    return Problem(ops, tensors, outputs=frozenset([loss, *grads]), name=f"expand_reduce{n_blocks}", host_bw=host_bw)


def _uniform(problem: Problem) -> Schedule:
    """Every block alike, as copying one block's answer to its siblings leaves it: every `expand` recomputed."""
    fw, bw = [o.id for o in problem.fw_ops], [o.id for o in problem.bw_ops]
    return place_recomputes(problem, fw, bw, [o.id for o in problem.fw_ops if o.name.startswith("expand")])


def _recompute_per_group(problem: Problem, schedule: Schedule) -> list[float]:
    groups = find_blocks(problem, schedule.fw_order)
    out = [0.0] * len(groups.members)
    for o in simulate(problem, schedule).recomputed_ops:
        out[groups.of_op[o]] += problem.ops[o].time_s
    return out


# --- the chain model against every combination


def _random_chain(rng: random.Random):
    n = rng.randint(2, 4)
    options = [[BlockOption(0.0, 0, 0, 0)] + [
        BlockOption(rng.randint(-50, 50) * 1e-6, rng.randint(-40, 40), rng.randint(-30, 30), rng.choice([0, 0, rng.randint(0, 20)]))
        for _ in range(rng.randint(0, 3))] for _ in range(n)]
    segments = [ChainSegment(rng.randint(300, 500), None, tuple(range(n)))]  # the head's: every block's kept bytes
    segments += [ChainSegment(rng.randint(300, 500), i, tuple(range(i)), rng.choice([0, rng.randint(0, 30)]))
                 for i in reversed(range(n))]
    segments.append(ChainSegment(rng.randint(200, 400), None, ()))  # the stem's, last
    copies = None
    if rng.random() < 0.5:  # copy queues: 1 byte per second, windows of a few tens of bytes
        copies = CopyLimits(1.0, tuple(rng.randint(0, 10) for _ in range(n)),
                            tuple(sorted((float(rng.randint(0, 30)) for _ in range(n)), reverse=True)),
                            tuple(sorted((float(rng.randint(0, 30)) for _ in range(n)), reverse=True)))
    return options, segments, rng.randint(300, 500), rng.randint(420, 560), copies


def _fits(options, segments, forward_peak, budget, choice, copies=None) -> bool:
    picked = [options[i][j] for i, j in enumerate(choice)]
    if copies is not None:
        for i in range(len(options)):
            now = sum(copies.now_bytes[i:])
            moved = now + sum(o.prefetch_bytes for o in picked[i:])
            if any(moved > max(int(copies.host_bw * w), now) for w in (copies.forward_after_s[i], copies.backward_before_s[i])):
                return False
    if forward_peak + sum(o.kept_bytes for o in picked) > budget:
        return False
    for k, seg in enumerate(segments):
        live = seg.peak_bytes + seg.margin_bytes + sum(picked[i].kept_bytes for i in seg.after_blocks)
        if seg.block is not None:
            live += picked[seg.block].segment_peak_bytes
        following = segments[k + 1].block if k + 1 < len(segments) else None
        if following is not None and following != seg.block:
            live += picked[following].prefetch_bytes
        if live > budget:
            return False
    return True


def _cost(options, choice) -> int:
    return sum(round(options[i][j].time_s / NS) for i, j in enumerate(choice))


@pytest.mark.parametrize("seed", range(40))
def test_chain_model_matches_brute_force(seed):
    rng = random.Random(seed)
    options, segments, forward_peak, budget, copies = _random_chain(rng)
    every = [c for c in itertools.product(*(range(len(row)) for row in options))
             if _fits(options, segments, forward_peak, budget, c, copies)]
    got = choose_options(options, segments, forward_peak, budget, time_limit_s=5.0, copies=copies)
    if not every:
        assert got is None
        return
    assert got is not None and _fits(options, segments, forward_peak, budget, got, copies)
    assert _cost(options, got) == min(_cost(options, c) for c in every)


# --- the search


@pytest.mark.parametrize("case", range(6))
def test_improve_by_chain_is_never_worse_than_its_start(case):
    rng = random.Random(case)
    host_bw = 2e9 if case % 3 == 2 else 0.0
    if case % 2:
        p = dataclasses.replace(chain_training_problem(n_layers=6, act_bytes=32 * KIB, seed=case), host_bw=host_bw)
    else:
        p = expand_reduce_problem(rng.randint(4, 7), host_bw=host_bw)
    base = simulate(p, default_schedule(p))
    for start in (default_schedule(p), _uniform(p) if case % 2 == 0 else default_schedule(p)):
        budget = int(rng.uniform(0.4, 0.9) * base.peak_bytes)
        with clock.deterministic(True):
            got = improve_by_chain(p, start, budget, deadline=clock.now() + 3.0, offload=host_bw > 0)
        assert_valid(p, got)
        assert not better(simulate(p, start), simulate(p, got), budget)


def test_early_blocks_recompute_more_than_late_ones():
    p = expand_reduce_problem(6)
    base = simulate(p, default_schedule(p))
    budget = int(0.6 * base.peak_bytes)
    uniform = _uniform(p)
    with clock.deterministic(True):
        got = improve_by_chain(p, uniform, budget, deadline=clock.now() + 5.0)
        searched, _cut = improve_by_segments(p, default_schedule(p), budget, deadline=clock.now() + 5.0, workers=1)
    assert_valid(p, got)
    sim = simulate(p, got)
    assert sim.peak_bytes <= budget
    assert sim.time_s < simulate(p, uniform).time_s  # faster than every block alike
    assert sim.time_s <= simulate(p, searched).time_s * (1 + 1e-9)  # and than the segment search's copies
    rc = _recompute_per_group(p, got)
    assert rc[0] > rc[-1] and sum(rc[:3]) > sum(rc[3:])


def test_solve_with_the_chain_is_deterministic_and_fits():
    p = expand_reduce_problem(8)
    budget = int(0.6 * simulate(p, default_schedule(p)).peak_bytes)
    a, b = (solve(p, budget, time_limit_s=2.0, deterministic=True) for _ in range(2))
    assert a.schedule.to_dict() == b.schedule.to_dict()
    assert a.sim.peak_bytes <= budget
    assert_valid(p, a.schedule)
