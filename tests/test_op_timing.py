"""Op timing (costs/profiling.py) is bounded and repeatable (issue 34): identical ops are timed once, in a graph
and across the graphs of a process (costs/op_cache.py), inputs are cheap to make, times are rounded to a grid two
runs mostly agree on, a time limit on the solvers' clock leaves the rest of the ops to the roofline, and two fresh
processes plan alike on shared measurements."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

import optsched
from optsched.planning import op_costs
from optsched.costs import op_cache, profiling
from optsched.costs.profiles import random_like
from optsched.costs.profiling import TIME_FLOOR_S, TIME_STEP, identical_ops, profile_nodes, stable_time
from optsched.measure import measure_training_step

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _no_times_from_earlier_tests():
    """Each test times its ops itself: none comes from a graph an earlier test planned (costs/op_cache.py)."""
    op_cache.clear()
    yield
    op_cache.clear()


def _graph(f, *shapes) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = fx.symbolic_trace(f)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # a module's own tensors (`_AddConstant`) stay real
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
    profile = op_costs.profile_nodes

    def counting(gm, *a, **k):
        costs = profile(gm, *a, **k)
        distinct[blocks] = (costs.distinct, len(costs.times))
        return costs

    monkeypatch.setattr(op_costs, "profile_nodes", counting)
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
    for t in (1.3e-5, 5.2e-5, 1.7e-4, 0.02):
        g = stable_time(t)
        assert stable_time(g) == g and abs(math.log(g / t)) <= math.log(TIME_STEP) / 2 + 1e-12
        near = stable_time(g * 1.02), stable_time(g / 1.02)  # within the noise of one op timed twice
        assert near == (g, g)
    assert stable_time(1e-9) == stable_time(0.0) == stable_time(TIME_FLOOR_S) > 0  # below what the timer resolves: one floor
    gm = _graph(_layers, (64, 64), (64, 64))
    assert all(stable_time(t) == t for t in profile_nodes(gm, torch.device("cpu"), {}).times.values())


def test_two_profiles_of_one_graph_plan_on_equal_costs(monkeypatch):
    """Two runs whose op timings differ by the noise of two processes (up to 3% here) give equal costs."""
    true = {name: 1e-9 * TIME_STEP ** k for name, k in
            [("mm_default", 67), ("relu_default", 57), ("mul_tensor", 58), ("mul_tensor_1", 59)]}  # 20-50 µs
    jitter = iter(torch.empty(100).uniform_(0.97, 1.03, generator=torch.Generator().manual_seed(0)).tolist())
    monkeypatch.setattr(profiling, "_time_op", lambda n, *a: true[n.name] * next(jitter))
    gm = _graph(_layers, (64, 64), (64, 64))
    first = profile_nodes(gm, torch.device("cpu"), {})
    op_cache.clear()  # timed again, as in another process
    second = profile_nodes(gm, torch.device("cpu"), {})
    assert first.times == second.times and len(first.times) == 10


def _other_layers(x, w):
    """`_layers`' mm and relu on the same shapes, then an op `_layers` does not have."""
    return (aten.gelu.default(aten.relu.default(aten.mm.default(x, w))),)


def test_an_op_timed_for_one_graph_is_not_timed_again_for_another():
    first = profile_nodes(_graph(_layers, (64, 64), (64, 64)), torch.device("cpu"), {})
    second = profile_nodes(_graph(_other_layers, (64, 64), (64, 64)), torch.device("cpu"), {})
    assert (second.distinct, second.reused) == (3, 2)  # mm and relu: the first graph's times; gelu timed
    assert [second.times[n] for n in ("mm_default", "relu_default")] == [first.times[n] for n in ("mm_default", "relu_default")]


class _AddConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.ones(64, 64))

    def forward(self, x):
        return (aten.add.Tensor(x, self.c),)


def test_times_are_shared_only_where_they_were_measured():
    """Another intra-op thread count times every op again; an op reading its graph's own tensor is never shared."""
    gm = _graph(_layers, (64, 64), (64, 64))
    profile_nodes(gm, torch.device("cpu"), {})
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert profile_nodes(gm, torch.device("cpu"), {}).reused == 0
    finally:
        torch.set_num_threads(threads)
    assert profile_nodes(gm, torch.device("cpu"), {}).reused == 4
    const = _graph(_AddConstant(), (64, 64))
    assert [(c.distinct, c.reused) for c in (profile_nodes(const, torch.device("cpu"), {}) for _ in range(2))] == [(1, 0)] * 2


def test_in_deterministic_mode_op_timing_stops_after_the_same_ops_on_every_run():
    """The solvers' clock counts work there, not wall time: a limit of 1.5 ops' work times the two heaviest."""
    from optsched.solvers.model import calibration, clock

    gm = _graph(_layers, (64, 64), (64, 64))
    with clock.deterministic():
        costs = profile_nodes(gm, torch.device("cpu"), {}, time_limit_s=calibration.seconds("op_timed", 1.5))
    assert costs.distinct == 2 and sorted(costs.estimated) == ["mul_tensor", "mul_tensor_1"]


_PLAN = """
import json, sys, torch, optsched
from optsched.costs import op_cache
from optsched.measure import measure_training_step

torch.manual_seed(0)
widths = [256, 384, 512, 320, 256]  # layers of other shapes: ops of their own, most above the timer's floor
model = torch.nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (torch.nn.Linear(a, b), torch.nn.GELU())])
x = torch.randn(512, 256)
eager = measure_training_step(lambda: model(x).pow(2).mean(), model, ())
opt = optsched.optimize(model, int(0.75 * eager.peak_bytes), time_limit_s=2)
opt(x).pow(2).mean().backward()
plan = opt.plan
print(json.dumps({"times": {o.name: o.time_s for o in plan.problem.ops}, "schedule": plan.schedule.to_dict(),
                  "peak": plan.predicted_peak_bytes}))
"""


def _plan_in_a_fresh_process(op_times: Path | None, cache_home: Path | None = None) -> dict:
    """`op_times`: the file named by $OPTSCHED_OP_TIMES; None: the default file, under `cache_home`."""
    env = {k: v for k, v in os.environ.items() if k != op_cache.ENV}
    env.update({op_cache.ENV: str(op_times)} if op_times is not None else {"XDG_CACHE_HOME": str(cache_home)})
    out = subprocess.run([sys.executable, "-c", _PLAN], cwd=Path(__file__).parents[1], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_two_fresh_processes_plan_alike_on_shared_measurements(tmp_path):
    """Measured times differ between processes by more than rounding hides (12 fresh processes planning this model
    on a loaded 2-core machine: 12 different op-cost tables, 9 different schedules): processes naming one
    $OPTSCHED_OP_TIMES file share them, and the second plans on the first's."""
    first = _plan_in_a_fresh_process(tmp_path / "ops.json")
    assert (tmp_path / "ops.json").exists()
    second = _plan_in_a_fresh_process(tmp_path / "ops.json")
    assert len(first["times"]) > 10 and second["times"] == first["times"]
    assert second["schedule"] == first["schedule"] and second["peak"] == first["peak"]


def test_two_fresh_processes_plan_alike_by_default(tmp_path):
    """No setting needed: the op-time file is on by default, in the user's cache directory."""
    first = _plan_in_a_fresh_process(None, tmp_path)
    assert (tmp_path / "optsched" / "op_times.json").exists()
    second = _plan_in_a_fresh_process(None, tmp_path)
    assert len(first["times"]) > 10 and second["times"] == first["times"]
    assert second["schedule"] == first["schedule"] and second["peak"] == first["peak"]


def test_the_op_time_file_keeps_the_first_time_and_survives_a_bad_file(tmp_path, monkeypatch):
    """A time already in the file stays (the processes before planned on it), new ones are added; a file cut short
    (a crash mid-write elsewhere) is read as empty and rewritten, never an error; "off" shares nothing."""
    path = tmp_path / "ops.json"
    monkeypatch.setenv(op_cache.ENV, str(path))
    path.write_text('{"a": 1.0')  # cut short
    op_cache.put("a", 2.0)
    op_cache.put("b", 3.0)
    op_cache.save_shared()
    assert json.loads(path.read_text()) == {"a": 2.0, "b": 3.0}
    op_cache.clear()
    op_cache.put("a", 5.0)
    op_cache.put("c", 7.0)
    op_cache.save_shared()
    assert json.loads(path.read_text()) == {"a": 2.0, "b": 3.0, "c": 7.0}
    monkeypatch.setenv(op_cache.ENV, "off")
    assert op_cache.shared_file() is None
    monkeypatch.delenv(op_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert op_cache.shared_file() == str(tmp_path / "cache" / "optsched" / "op_times.json")


def test_op_timing_stops_at_its_time_limit_and_leaves_the_rest_to_the_roofline():
    gm = _graph(_layers, (64, 64), (64, 64))
    costs = profile_nodes(gm, torch.device("cpu"), {}, time_limit_s=0.0)
    assert costs.times == {} and sorted(costs.estimated) == sorted(n.name for n in gm.graph.nodes if n.op == "call_function")
    assert set(costs.estimated) <= set(costs.workspace)  # their scratch space is still measured: plans hold it


def test_a_plan_with_op_timing_cut_short_is_valid(monkeypatch):
    monkeypatch.setattr(op_costs, "OP_TIMING_SHARE", 0.0)  # no time for op timing at all
    counted = []
    profile = op_costs.profile_nodes
    monkeypatch.setattr(op_costs, "profile_nodes", lambda gm, *a, **k: counted.append(
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


def test_a_time_from_the_cache_costs_the_clock_what_timing_it_would():
    """In deterministic mode the plan must depend on the graph alone: an op whose time an earlier graph (or another
    process, through an op-time file) measured is charged as if timed here, so the search keeps the same share of
    the limit whether the cache was warm or cold."""
    from optsched.solvers.model import clock

    gm = _graph(_layers, (64, 64), (64, 64))
    charged = []
    for _ in range(2):  # cold, then every time from the cache
        with clock.deterministic(True):
            costs = profile_nodes(gm, torch.device("cpu"), {})
            charged.append((costs.reused, clock.units_counted().get("op_timed")))
    assert charged[0][0] == 0 and charged[1][0] == 4
    assert charged[0][1] == charged[1][1] > 0


def test_a_named_profile_times_by_its_roofline_but_plans_the_scratch_the_ops_allocate_here(tmp_path):
    """device_profile="cpu" on a CPU run: op times are the profile's roofline, but the program runs here, and its
    kernels allocate scratch a roofline cannot know (a layer norm backward's per-thread partial sums): measured all
    the same. Without it a plan whose peak step was a layer norm backward measured 2 KiB over its prediction. And
    CPU's mse_loss returns its 0-dim loss on an input-sized buffer, which the loss holds into the backward: planned
    as 4 bytes, the step measured an input's size (224 KiB here) over its prediction, measured costs or not."""
    from optsched.costs.measure import labelled_peaks, memory_profile

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the partial sums are per thread: two threads allocate some on any machine
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                                    torch.nn.Linear(128, 64))
        x, target = torch.randn(16, 56, 64), torch.randn(16, 56, 64)

        def step(x, target):
            return torch.nn.functional.mse_loss(model(x), target)

        eager = measure_training_step(step, model, (x, target))
        opt = optsched.optimize(step, "90%", device_profile="cpu", time_limit_s=1)
        opt(x, target).backward()
        model.zero_grad(set_to_none=True)
        planned = measure_training_step(opt, model, (x, target))
        plan = opt.plan
        assert plan.summary()["timing"] == "roofline"
        (ln_bw,) = [o for o in plan.problem.ops if o.name.startswith("native_layer_norm_backward")]
        g, h = torch.randn(16, 56, 128), torch.randn(16, 56, 128)
        mean, rstd = torch.randn(16, 56, 1), torch.rand(16, 56, 1)
        w, b = torch.randn(128), torch.randn(128)
        with torch.no_grad(), memory_profile() as prof:
            with torch.profiler.record_function("alone"):
                out = aten.native_layer_norm_backward(g, h, [128], mean, rstd, w, b, [True, True, True])
            del out
        peak, end = labelled_peaks(prof, "alone")["alone"]
        assert peak - end > 0 and ln_bw.workspace_bytes == peak - end
        (loss,) = [plan.problem.tensors[t] for o in plan.problem.ops if o.name == "mse_loss" for t in o.outputs]
        assert loss.bytes == torch.nn.functional.mse_loss(x, target).untyped_storage().nbytes()  # 224 KiB, torch 2.13
        assert abs(planned.peak_bytes - plan.sim.peak_bytes) <= 64  # the loss's scalar tangent, outside the program
        for k, grad in eager.grads.items():
            torch.testing.assert_close(planned.grads[k], grad, rtol=0, atol=0)
        # a plan file records the loss's storage: its replay, which measures nothing, sizes it alike
        plan.save(tmp_path / "plan.json")
        again = optsched.optimize(step, "90%", device_profile="cpu", plan=tmp_path / "plan.json")
        again(x, target).backward()
        assert any(n.startswith("loaded from") for n in again.plan.stats.notes)
        assert again.plan.allocated == plan.allocated == {loss.name: loss.bytes}
        assert again.plan.sim.peak_bytes == plan.sim.peak_bytes
    finally:
        torch.set_num_threads(threads)
