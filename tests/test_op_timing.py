"""Op timing (costs/profiling.py) is bounded and repeatable (issue 34): identical ops are timed once, inputs
are cheap to make, times are rounded to a grid two runs agree on, and a time limit leaves the rest of the ops
to the roofline."""

from __future__ import annotations

import math

import torch
from torch import fx

import optsched
import optsched.planner
from optsched.costs import profiling
from optsched.costs.profiles import random_like
from optsched.costs.profiling import TIME_STEP, identical_ops, profile_nodes, stable_time
from optsched.measure import measure_training_step

aten = torch.ops.aten


def _graph(f, *shapes) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = fx.symbolic_trace(f)
    with FakeTensorMode() as mode:
        vals = [mode.from_tensor(torch.empty(s)) for s in shapes]
    for p, v in zip(gm.graph.find_nodes(op="placeholder"), vals):
        p.meta["val"] = v
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)
    return gm


def _layers(x, w):
    """Four identical layers, then `mul(h, h)` and `mul(h, x)`: the same op, shapes and dtypes, other inputs."""
    h = x
    for _ in range(4):
        h = aten.relu.default(aten.mm.default(h, w))
    return (aten.mul.Tensor(h, h), aten.mul.Tensor(h, x))


def test_identical_ops_are_timed_once(monkeypatch):
    gm = _graph(_layers, (64, 64), (64, 64))
    timed = []
    time_op = profiling._time_op
    monkeypatch.setattr(profiling, "_time_op", lambda n, *a: timed.append(n.name) or time_op(n, *a))
    costs = profile_nodes(gm, torch.device("cpu"), {})
    # mm, relu (x4 each) and the two muls: 4 distinct ops of 10
    assert sorted(timed) == ["mm_default", "mul_tensor", "mul_tensor_1", "relu_default"]
    assert costs.distinct == 4 and len(costs.times) == 10
    assert len({costs.times[f"mm_default{s}"] for s in ("", "_1", "_2", "_3")}) == 1
    assert len({costs.workspace[f"relu_default{s}"] for s in ("", "_1", "_2", "_3")}) == 1
    assert [len(g) for g in identical_ops(gm)] == [4, 4, 1, 1]


def test_a_repeated_block_is_timed_as_one(monkeypatch):
    """End to end: a model of 4 identical blocks times as many distinct ops as one of 2 blocks."""
    distinct = {}
    profile = optsched.planner.profile_nodes

    def counting(gm, *a, **k):
        costs = profile(gm, *a, **k)
        distinct[blocks] = (costs.distinct, len(costs.times))
        return costs

    monkeypatch.setattr(optsched.planner, "profile_nodes", counting)
    for blocks in (2, 4):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(blocks) for m in (torch.nn.Linear(32, 32), torch.nn.GELU())])
        x = torch.randn(16, 32)
        optsched.optimize(model, time_limit_s=1)(x).sum().backward()
    assert distinct[4][0] == distinct[2][0] and distinct[4][1] > distinct[2][1]


def test_made_up_inputs_are_the_same_every_time_and_leave_the_random_stream_alone():
    state = torch.get_rng_state()
    a = random_like(torch.empty(3, 5000, device="meta"), torch.device("cpu"))
    b = random_like(torch.empty(3, 5000, device="meta"), torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and a.std() > 0.5 and not torch.equal(a[0], a[1])  # rows differ
    assert random_like(torch.empty(4, dtype=torch.int64, device="meta"), "cpu").eq(0).all()  # valid indices
    assert random_like(torch.empty(2, 3, dtype=torch.bfloat16, device="meta"), "cpu").dtype == torch.bfloat16


def test_times_are_rounded_to_a_grid_two_runs_agree_on():
    for t in (3e-6, 5.2e-6, 1.7e-4, 0.02):
        g = stable_time(t)
        assert stable_time(g) == g and abs(math.log(g / t)) <= math.log(TIME_STEP) / 2 + 1e-12
        near = stable_time(g * 1.02), stable_time(g / 1.02)  # within the noise of one op timed twice
        assert near == (g, g)
    assert stable_time(1e-9) == stable_time(0.0) > 0  # below what the timer resolves: one floor
    gm = _graph(_layers, (64, 64), (64, 64))
    assert all(stable_time(t) == t for t in profile_nodes(gm, torch.device("cpu"), {}).times.values())


def test_two_profiles_of_one_graph_plan_on_equal_costs(monkeypatch):
    """Two runs whose op timings differ by the noise of two processes (up to 3% here) give equal costs."""
    true = {name: 1e-9 * TIME_STEP ** k for name, k in
            [("mm_default", 57), ("relu_default", 47), ("mul_tensor", 48), ("mul_tensor_1", 49)]}
    jitter = iter(torch.empty(100).uniform_(0.97, 1.03, generator=torch.Generator().manual_seed(0)).tolist())
    monkeypatch.setattr(profiling, "_time_op", lambda n, *a: true[n.name] * next(jitter))
    gm = _graph(_layers, (64, 64), (64, 64))
    first, second = (profile_nodes(gm, torch.device("cpu"), {}) for _ in range(2))
    assert first.times == second.times and len(first.times) == 10


def test_op_timing_stops_at_its_time_limit_and_leaves_the_rest_to_the_roofline():
    gm = _graph(_layers, (64, 64), (64, 64))
    costs = profile_nodes(gm, torch.device("cpu"), {}, time_limit_s=0.0)
    assert costs.times == {} and sorted(costs.estimated) == sorted(n.name for n in gm.graph.nodes if n.op == "call_function")
    assert set(costs.estimated) <= set(costs.workspace)  # their scratch space is still measured: plans hold it


def test_a_plan_with_op_timing_cut_short_is_valid(monkeypatch):
    monkeypatch.setattr(optsched.planner, "OP_TIMING_SHARE", 0.0)  # no time for op timing at all
    counted = []
    profile = optsched.planner.profile_nodes
    monkeypatch.setattr(optsched.planner, "profile_nodes", lambda gm, *a, **k: counted.append(
        sum(n.op == "call_function" for n in gm.graph.nodes)) or profile(gm, *a, **k))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())])
    x = torch.randn(1024, 64)
    eager = measure_training_step(lambda: model(x).sum(), model, ())
    budget = int(0.9 * eager.peak_bytes)
    opt = optsched.optimize(model, budget, time_limit_s=1)
    opt(x).sum().backward()  # plans (outside the profiler measure_training_step runs: scratch measured)
    model.zero_grad(set_to_none=True)
    planned = measure_training_step(lambda: opt(x).sum(), model, ())
    notes, (n_ops,) = opt.plan.stats.notes, counted
    assert any(n.startswith(f"{n_ops} op(s) timed by the roofline: op timing reached its share") for n in notes), notes
    assert not any("scratch space was not measured" in n for n in notes)
    assert planned.peak_bytes <= budget
    for k, g in eager.grads.items():
        torch.testing.assert_close(planned.grads[k], g, rtol=0, atol=0)
