"""Fusion options decided by the solver (issue 14): the contract, the simulator's semantics against merging
the group (`fuse_ops`) and against the independent checker, the segment model's decision, plan files, and
the planner end to end (horizontal candidates offered as options, solved once)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import optsched
from benchmarks.models.seed_functions import make_inputs, memory_peak_inefficient_func
from optsched.measure import live_bytes, measure_peak, measure_training_step
from optsched.solvers import Op, Phase, Problem, Schedule, ScheduleError, Tensor, TensorKind, default_schedule, simulate, solve
from optsched.solvers.cpsat.segment import free_ops, replan_segment
from optsched.solvers.model.problem import FusionOption, SolveStats, convexity_violation
from optsched.solvers.search.fusion_groups import merge_formed
from optsched.solvers.search.fusion_options import form_options, with_option
from optsched.solvers.search.segments import splice
from optsched.solvers.search.strategy import certify
from optsched.solvers.synthetic import chain_training_problem, parallel_paths_problem, random_layered_problem
from schedule_checker import fused_replay, violations
from tests.hypothesis_profiles import examples

MiB = 2**20


def _random_options(problem: Problem, rng: random.Random, n: int = 4) -> Problem:
    """Up to `n` disjoint convex groups of 2-4 ops of one phase, with random kernel times and scratch."""
    used: set[int] = set()
    options = []
    for _ in range(5 * n):
        if len(options) == n:
            break
        phase = rng.choice([Phase.FW, Phase.BW]) if problem.has_backward else Phase.FW
        free = [o.id for o in problem.ops if o.phase is phase and o.id not in used]
        if len(free) < 2:
            continue
        group = sorted(rng.sample(free, rng.randint(2, min(4, len(free)))))
        if convexity_violation(problem, group) is None:
            used.update(group)
            options.append(FusionOption(tuple(group), rng.uniform(0, 2e-3), rng.choice([0, MiB])))
    return dataclasses.replace(problem, fusion_options=tuple(options))


@st.composite
def problems_with_formed_groups(draw) -> tuple[Problem, Schedule]:
    seed = draw(st.integers(0, 10**6))
    rng = random.Random(seed)
    kind = draw(st.sampled_from(["layered", "chain", "chain_offload"]))
    if kind == "layered":
        base = random_layered_problem(rng.randint(3, 14), seed=seed)
    else:
        base = chain_training_problem(rng.randint(1, 4), seed=seed, host_bw=1e9 if kind == "chain_offload" else 0.0)
    problem = _random_options(base, rng)
    schedule = default_schedule(problem)
    for i in range(len(problem.fusion_options)):
        if draw(st.booleans()):
            cand = with_option(problem, schedule, i, at_last=draw(st.booleans()))
            try:
                simulate(problem, cand) if cand is not None else None
            except ScheduleError:  # two groups that cannot both be formed
                continue
            schedule = cand or schedule
    if kind == "chain_offload":
        sim = simulate(problem, schedule)
        for t in sim.saved:
            if draw(st.booleans()):
                schedule.offload[t] = draw(st.integers(0, 3))
    return problem, schedule


@settings(max_examples=examples(150), deadline=None, derandomize=True)
@given(problems_with_formed_groups())
def test_a_formed_group_simulates_as_its_merged_op_and_as_the_checker_replays_it(case):
    problem, schedule = case
    try:
        sim = simulate(problem, schedule)
    except ScheduleError:  # a random prefetch after its first reader
        assert schedule.offload
        return
    assert violations(problem, schedule) == []
    fused, on_fused = merge_formed(problem, schedule)
    merged = simulate(fused.problem, on_fused)
    assert merged.peak_bytes == sim.peak_bytes
    assert merged.time_s == pytest.approx(sim.time_s, rel=1e-12, abs=1e-15)
    if not schedule.offload:
        peak, time_s = fused_replay(problem, schedule)
        assert peak == sim.peak_bytes
        assert time_s == pytest.approx(sim.time_s, rel=1e-12, abs=1e-15)


def _paths(n: int = 3) -> tuple[Problem, list[int]]:
    p = parallel_paths_problem(n)
    relus = [o.id for o in p.ops if o.name.startswith("relu1_")]
    return dataclasses.replace(p, fusion_options=(FusionOption(tuple(relus), 1e-5, 0, "relus"),)), relus


def test_a_formed_group_whose_members_are_not_consecutive_is_rejected():
    p, _relus = _paths()
    ids = {o.name: o.id for o in p.ops}
    path_by_path = [ids[f"{name}_{i}"] for i in range(3) for name in ("relu1", "mm1", "relu2", "mm2")]
    schedule = Schedule(path_by_path, [], formed=(0,))  # relu1_0, mm1_0, ...: the relus are not consecutive
    with pytest.raises(ScheduleError, match=r"formed fusion option 0 \(relus\).*not run consecutively.*mm1_0"):
        simulate(p, schedule)
    assert any("not consecutive" in v for v in violations(p, schedule))
    with pytest.raises(ScheduleError, match="does not exist"):
        simulate(p, Schedule(path_by_path, [], formed=(3,)))
    together = with_option(p, Schedule(path_by_path, []), 0)
    assert together.fw_order[:3] == [ids["relu1_0"], ids["relu1_1"], ids["relu1_2"]]
    assert simulate(p, together).time_s < simulate(p, Schedule(path_by_path, [])).time_s


def test_a_forward_group_recomputed_in_part_is_rejected():
    p = chain_training_problem(2)
    ids = {o.name: o.id for o in p.ops}
    p = dataclasses.replace(p, fusion_options=(FusionOption((ids["mm1"], ids["act1"]), 1e-3),))
    fw = default_schedule(p).fw_order
    bw = default_schedule(p).bw_order
    at = bw.index(ids["loss_bw"])  # before every backward read of act1's output (there is no other copy of it)
    partial = Schedule(fw, bw[:at] + [ids["act1"]] + bw[at:], formed=(0,))
    with pytest.raises(ScheduleError, match="recomputed in part"):
        simulate(p, partial)
    whole = Schedule(fw, bw[:at] + [ids["mm1"], ids["act1"]] + bw[at:], formed=(0,))
    sim = simulate(p, whole)
    fused, on_fused = merge_formed(p, whole)
    assert simulate(fused.problem, on_fused).peak_bytes == sim.peak_bytes
    assert violations(p, whole) == []


def test_bad_options_are_rejected_naming_the_option_and_op():
    p = chain_training_problem(2)
    ids = {o.name: o.id for o in p.ops}

    def offer(*options: FusionOption) -> None:
        dataclasses.replace(p, fusion_options=options)

    with pytest.raises(ValueError, match=r"fusion option 0 \(mm0\+mm1\) is not convex.*'act0'"):
        offer(FusionOption((ids["mm0"], ids["mm1"]), 1e-3))
    with pytest.raises(ValueError, match="mixes forward and backward"):
        offer(FusionOption((ids["act1"], ids["act1_bw"]), 1e-3))
    with pytest.raises(ValueError, match="'act1' is in fusion options 0 and 1"):
        offer(FusionOption((ids["mm1"], ids["act1"]), 1e-3), FusionOption((ids["act1"], ids["loss"]), 1e-3))
    with pytest.raises(ValueError, match="not in program order"):
        offer(FusionOption((ids["act1"], ids["mm1"]), 1e-3))
    with pytest.raises(ValueError, match="names op 99"):
        offer(FusionOption((1, 99), 1e-3))


def test_schedules_round_trip_with_formed_groups_and_old_ones_still_load():
    s = Schedule([0, 1], [2], {1: 0}, formed=(1, 0))
    assert s.formed == (0, 1)
    assert Schedule.from_dict(s.to_dict()) == s
    assert Schedule.from_dict({"fw_order": [0], "bw_order": []}).formed == ()
    assert "formed" not in Schedule([0], []).to_dict()  # plans without options write what they wrote before


def _backward_group_problem(n: int = 3) -> Problem:
    """Forward: n activations of 1 MiB from the input; backward: per activation, g_i makes 2 MiB that r_i
    reduces to a 4-byte gradient. The g_i are one option: formed, their three 2 MiB outputs (and the
    activations they read) live together: 10 MiB against 6 MiB."""
    tensors = [Tensor(0, "x", MiB, TensorKind.INPUT)]
    ops: list[Op] = []

    def op(name: str, phase: Phase, ins: list[int], nbytes: int, time_s: float) -> int:
        tensors.append(Tensor(len(tensors), f"{name}.out", nbytes, TensorKind.ACTIVATION, len(ops)))
        ops.append(Op(len(ops), name, phase, tuple(ins), (len(tensors) - 1,), time_s))
        return len(tensors) - 1

    acts = [op(f"f{i}", Phase.FW, [0], MiB, 1e-4) for i in range(n)]
    loss = op("loss", Phase.FW, acts, 4, 1e-5)
    tensors.append(Tensor(len(tensors), "tangent", 4, TensorKind.TANGENT))
    tangent = len(tensors) - 1
    g_ops, grads = [], []
    for i in range(n):
        h = op(f"g{i}", Phase.BW, [tangent, acts[i]], 2 * MiB, 1e-4)
        g_ops.append(len(ops) - 1)
        grads.append(op(f"r{i}", Phase.BW, [h], 4, 1e-5))
    return Problem(ops, tensors, outputs=frozenset([loss, *grads]),
                   fusion_options=(FusionOption(tuple(g_ops), 1.2e-4, 0, "g group"),))


@pytest.mark.parametrize("budget_mib,formed", [(11, True), (7, False)])
def test_the_segment_model_forms_a_backward_group_only_when_the_budget_allows(budget_mib, formed):
    p = _backward_group_problem()
    sim = simulate(p, default_schedule(p))
    a, b = sim.n_forward_steps, len(sim.steps)
    budget = budget_mib * MiB
    free = free_ops(p, sim, a, b, [o.id for o in p.fw_ops])
    res = replan_segment(p, sim, a, b, free, budget, time_limit_s=5, decide_fusion=True)
    assert res is not None and res.fusion == {0: formed}
    kept = replan_segment(p, sim, a, b, free, budget, time_limit_s=5)  # not asked to decide: left as it is
    assert kept is not None and kept.fusion == {0: False}
    schedule = splice(p, sim, a, b, res.steps, fusion=res.fusion)
    assert schedule.formed == ((0,) if formed else ())
    assert violations(p, schedule) == []
    peak, time_s = fused_replay(p, schedule)
    new = simulate(p, schedule)
    assert (new.peak_bytes, new.time_s) == (peak, pytest.approx(time_s))
    assert peak <= budget
    assert (time_s < sim.time_s) == formed
    # the whole solver agrees
    sol = solve(p, budget, time_limit_s=3)
    assert sol.schedule.formed == schedule.formed and sol.sim.peak_bytes <= budget
    assert violations(p, sol.schedule) == []


@pytest.mark.parametrize("budget_mib", [11, 20])
def test_the_bound_of_a_plan_with_a_formed_group_is_for_that_grouping(budget_mib):
    """A formed group saves time: a bound computed without it (each op's own time) sat above the plan and
    was reported as OPTIMAL, gap 0. The bound is now the relaxation's on the problem with the group merged,
    below the plan, and by the checker's replay no plan in this order with this group beats it."""
    p = _backward_group_problem()
    sim = simulate(p, default_schedule(p))
    a, b = sim.n_forward_steps, len(sim.steps)
    budget = budget_mib * MiB
    res = replan_segment(p, sim, a, b, [], budget, time_limit_s=5, decide_fusion=True)
    schedule = splice(p, sim, a, b, res.steps, fusion=res.fusion)
    assert schedule.formed == (0,)
    plan = simulate(p, schedule)
    stats = SolveStats("HEURISTIC", plan.time_s, 0.0, 1.0, 0.0, "test")
    certify(p, schedule, budget, stats, 2.0, 1)
    merged, on_merged = merge_formed(p, schedule)
    each_op_once = sum(o.time_s for o in merged.problem.ops)
    assert stats.bound_s <= plan.time_s * (1 + 1e-9)
    assert stats.bound_s == pytest.approx(each_op_once)  # nothing to recompute here: the bound is tight
    assert stats.status == "OPTIMAL" and stats.notes[-1].startswith("bound: every save/recompute plan")
    assert fused_replay(p, schedule)[1] == pytest.approx(stats.bound_s)
    # and the whole solver, with the group formed after its solve, reports a bound below its plan
    sol = solve(p, budget, time_limit_s=3)
    assert sol.schedule.formed == (0,) and sol.stats.bound_s <= sol.sim.time_s * (1 + 1e-9)


def test_horizontal_options_that_raise_the_peak_are_not_formed_without_a_budget():
    """Thunder's horizontal fusion of the seed function's relus, as data: faster, higher peak."""
    p, _relus = _paths(10)
    ids = {o.name: o.id for o in p.ops}
    path_by_path = Schedule([ids[f"{name}_{i}"] for i in range(10) for name in ("relu1", "mm1", "relu2", "mm2")], [])
    decided = form_options(p, path_by_path, None)
    assert decided.schedule.formed == ()
    assert decided.notes[0].startswith("relus: rejected") and "(higher peak)" in decided.notes[0]
    roomy = form_options(p, path_by_path, 100 * MiB)  # a budget with room for them: formed
    assert roomy.schedule.formed == (0,) and roomy.sim.time_s < decided.sim.time_s
    assert roomy.notes[0].startswith("relus: kept")


# ---------------------------------------------------------------------------------------------
# the planner: horizontal candidates offered as options, solved once, formed ones merged for lowering


def test_seed_function_relu_groups_are_offered_and_rejected():
    t0s, a = make_inputs()
    with torch.no_grad():
        # roofline times (the cpu profile): measured ones on a busy machine may call the kernel slower
        opt = optsched.optimize(memory_peak_inefficient_func, None, executor="inductor", device_profile="cpu")
        opt(list(t0s), a)
        res = measure_peak(lambda: opt(list(t0s), a))
    plan = opt.plan
    notes = [n for n in plan.stats.notes if n.startswith("horizontal group")]
    assert len(notes) == 2 and all("rejected" in n and "(higher peak)" in n for n in notes), plan.stats.notes
    assert plan.fusion_groups == []
    assert res.peak_bytes == pytest.approx(0.75 * MiB, abs=4096)
    assert plan.predicted_peak_bytes - live_bytes(t0s, a) == res.peak_bytes


def test_a_kept_horizontal_group_is_lowered_and_its_plan_file_replays(tmp_path):
    def fn(x, y):
        return torch.relu(x), torch.relu(y)

    x, y = torch.randn(128, 128), torch.randn(128, 128)
    path = tmp_path / "plan.json"
    with torch.no_grad():
        opt = optsched.optimize(fn, None, executor="inductor", device_profile="cpu", plan=path)
        out = opt(x, y)
    plan = opt.plan
    assert plan.fusion_groups == [["relu", "relu_1"]]
    assert any(n.startswith("horizontal group of 2 aten.relu.default: kept") for n in plan.stats.notes)
    assert len(plan.problem.ops) == 1 and plan.problem.fusion_options == ()  # merged for lowering
    torch.testing.assert_close(out, fn(x, y), rtol=0, atol=0)
    with torch.no_grad():
        again = optsched.optimize(fn, None, executor="inductor", device_profile="cpu", plan=path)
        torch.testing.assert_close(again(x, y), fn(x, y), rtol=0, atol=0)
    assert again.plan.stats.notes[-1].startswith("loaded from")
    assert again.plan.fusion_groups == plan.fusion_groups
    assert again.plan.predicted_peak_bytes == plan.predicted_peak_bytes


class _Branches(torch.nn.Module):
    """Parallel tanh branches (a forward horizontal candidate) whose backward sums form another."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        return (torch.tanh(self.a(x)) * torch.sigmoid(self.b(x)) + torch.tanh(self.c(x))).sum()


def test_a_training_step_with_inductor_decides_its_horizontal_groups_in_one_solve():
    torch.manual_seed(0)
    model, inputs = _Branches(), (torch.randn(32, 64),)
    eager = measure_training_step(model, model, inputs)
    expected = _grads(model, model, inputs)
    opt = optsched.optimize(model, None, example_inputs=inputs, executor="inductor", device_profile="cpu")
    measured = measure_training_step(opt, model, inputs)
    got = _grads(opt, model, inputs)
    plan = opt.plan
    notes = [n for n in plan.stats.notes if n.startswith("horizontal group")]
    assert notes and all(": kept" in n or ": rejected" in n for n in notes), plan.stats.notes
    kept = [n for n in notes if ": kept" in n]
    horizontal = [g for g in plan.fusion_groups if all(m.startswith("tanh") for m in g)]
    assert bool(kept) == bool(horizontal)
    assert measured.peak_bytes <= eager.peak_bytes
    assert simulate(plan.problem, plan.schedule).peak_bytes == plan.predicted_peak_bytes
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-5)


def _grads(call, model: torch.nn.Module, inputs: tuple) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    call(*inputs).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out
