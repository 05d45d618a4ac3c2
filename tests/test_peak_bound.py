"""The peak lower bound (`solvers/search/peak_bound.py`, through `heuristics.lower_bound_peak`): valid over every
plan the simulator accepts, checked against brute force, and stronger than the simple per-op bound.

- small random training problems (`tests/bruteforce.py`: reuse, `reuse_all`, scratch, a caller's loss, returned
  values, non-recomputable ops; with the seed held by the engine or freed at its last read): the bound is at most
  the least simulated peak over every save/recompute plan in many forward and backward orders (those plans are
  real plans, so any excess is a real violation);
- random problems with offloading (`tests/test_fuzz.py`'s generator, host bandwidth on or off): at most the
  simulated peak of every plan the heuristics make, offloads included;
- on a chain like a transformer's layers, strictly above the simple bound.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optsched.solvers import BudgetInfeasibleError, Phase, Problem, TensorKind, default_schedule, simulate, solve
from optsched.solvers.search.heuristics import greedy_recompute, lower_bound_peak, simple_peak_bound
from optsched.solvers.search.offload import add_offloads
from optsched.solvers.search.peak_bound import explain, step_bound
from optsched.solvers.search import joint_bound, peak_bound, region_bound
from optsched.solvers.synthetic import _Builder, chain_training_problem
from tests.test_fuzz import training_problems as offload_problems
from tests.bruteforce import describe, enumerate_plans, min_peak, topological_fw_orders, topological_orders, training_problems
from tests.hypothesis_profiles import examples

FIXED = settings(max_examples=examples(150), deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def _freed_seed(problem: Problem) -> Problem:
    tensors = [dataclasses.replace(t, kind=TensorKind.TANGENT_FREED) if t.kind is TensorKind.TANGENT else t
               for t in problem.tensors]
    return dataclasses.replace(problem, tensors=tensors)


@FIXED
@given(training_problems(max_fw=7), st.booleans())
def test_bound_below_brute_force_minimum(problem, freed):
    if freed:
        problem = _freed_seed(problem)
    bound = lower_bound_peak(problem)
    assert bound >= simple_peak_bound(problem)
    lowest = min(min_peak(enumerate_plans(problem, fo, bo, check=False))
                 for fo in topological_fw_orders(problem, limit=6) for bo in topological_orders(problem, [o.id for o in problem.bw_ops], 6))
    assert bound <= lowest, f"bound {bound} ({explain(problem)[1]}) above a plan's peak {lowest}:\n{describe(problem)}"


@settings(FIXED, max_examples=examples(60))
@given(offload_problems())
def test_bound_below_offloading_plans(problem):
    bound = lower_bound_peak(problem, joint=True)
    base = default_schedule(problem)
    peaks = [simulate(problem, base).peak_bytes]
    rc = greedy_recompute(problem, bound)
    peaks.append(simulate(problem, rc).peak_bytes)
    for sched in (base, rc):
        off = add_offloads(problem, sched, bound)
        if off is not None:
            peaks.append(simulate(problem, off).peak_bytes)
    assert bound <= min(peaks), (bound, peaks, explain(problem)[1], describe(problem))


def test_stronger_than_simple_bound_on_a_layer_chain():
    """Backward of a chain: the gradients made so far and the chain's running gradient are live together."""
    problem = chain_training_problem()
    assert step_bound(problem) > simple_peak_bound(problem)
    assert lower_bound_peak(problem) == step_bound(problem)
    # and still below the plans the heuristics find
    assert lower_bound_peak(problem) <= simulate(problem, greedy_recompute(problem, 0)).peak_bytes


def test_kept_on_the_problem_and_counted_once():
    """The same problem's bound is asked for several times in one planning (the budget's resolution, held outputs,
    the solve): computed once, its work counted on the clock then. A problem that differs in op times alone (a
    program's floor against its measured problem) takes the same bound, its work charged as if done (the plan may
    not depend on what was bounded before), with none done; one that differs in what the bound reads (a storage's
    size) computes it again."""
    from optsched.solvers.search import peak_bound as pb
    from optsched.solvers.model import clock

    problem = chain_training_problem(13)
    with clock.deterministic(True):
        first = lower_bound_peak(problem)
        counted = clock.units_counted()["bound_op"]
        assert lower_bound_peak(problem) == first and clock.units_counted()["bound_op"] == counted
        retimed = dataclasses.replace(problem, ops=[dataclasses.replace(o, time_s=2 * o.time_s + 1e-6)
                                                    for o in problem.ops])
        computed = []
        real = pb._Bound
        pb._Bound = lambda p: computed.append(p) or real(p)
        try:
            assert lower_bound_peak(retimed) == first and not computed
        finally:
            pb._Bound = real
        assert clock.units_counted()["bound_op"] == 2 * counted
        t = max((t for t in problem.tensors if t.kind is TensorKind.ACTIVATION), key=lambda t: t.bytes)
        grown = dataclasses.replace(problem, tensors=[dataclasses.replace(x, bytes=4 * x.bytes) if x is t else x
                                                      for x in problem.tensors])
        assert lower_bound_peak(grown) > first
        assert clock.units_counted()["bound_op"] == 3 * counted


def test_says_where_it_holds(monkeypatch):
    problem = chain_training_problem()
    value, where = explain(problem)
    assert value == step_bound(problem, joint=True) and where.startswith("over one save/recompute choice at ")
    monkeypatch.setattr(joint_bound, "MAX_OPS", 0)  # the point families alone: one of them holds at a backward op
    value, where = explain(problem)
    assert any(where == f"at {o.name}" for o in problem.ops if o.phase is Phase.BW)


def _attention_like(u: int = 64) -> Problem:
    """Embedding, norm, a 3x-wide projection (q, k, v) and attention, whose backward reads the projection; the
    projection's weight gradient reads the norm's output and the norm's backward its input, both after it. The op
    before the attention's backward has a large scratch space: the projection saved to there does not fit beside it."""
    b = _Builder()
    ids = b.tensor("ids", u)
    (x0,) = b.op("embed", Phase.FW, [ids], [4 * u], 1e-4)
    (ln,) = b.op("norm", Phase.FW, [x0], [4 * u], 1e-4)
    (qkv,) = b.op("qkv", Phase.FW, [ln], [12 * u], 1e-3)
    (att,) = b.op("attention", Phase.FW, [qkv], [4 * u], 1e-3)
    (h,) = b.op("proj", Phase.FW, [att], [4 * u], 1e-3)
    (loss,) = b.op("loss", Phase.FW, [h], [u], 1e-5)
    seed = b.tensor("tangent", u, TensorKind.TANGENT)
    (g,) = b.op("loss_bw", Phase.BW, [seed, h], [4 * u], 1e-4)
    b.op("proj_bw", Phase.BW, [g, att], [4 * u], 1e-3)
    ga = len(b.tensors) - 1
    (gq,) = b.op("attention_bw", Phase.BW, [ga, qkv, att], [12 * u], 1e-3)
    (gw,) = b.op("qkv_bw_w", Phase.BW, [gq, ln], [2 * u], 1e-3)
    (gl,) = b.op("qkv_bw_x", Phase.BW, [gq], [4 * u], 1e-3)
    (gx,) = b.op("norm_bw", Phase.BW, [gl, x0], [4 * u], 1e-4)
    (ge,) = b.op("embed_bw", Phase.BW, [gx], [2 * u], 1e-4)
    ops = [dataclasses.replace(o, workspace_bytes=20 * u) if o.name == "proj_bw" else o for o in b.ops]
    return Problem(ops, b.tensors, outputs=frozenset([loss, gw, ge]), name="attention")


def test_recomputing_an_operand_keeps_its_inputs_live_until_their_own_backward_reads():
    """The bundled GPT's tight budget (36.28 MiB found, bound 34.27): the attention's backward reads q, k, v; saved,
    they are live at the backward ops before it; recomputed (once, before it), the recomputation read the norm's
    output, which the projection's weight gradient reads after it, so that is live at the attention's backward
    (recomputed in turn, so is the norm's input). The bound weighs those choices: here it meets brute force's
    minimum, 4 units above the bound of the points taken one by one."""
    problem = _attention_like()
    old, peak_bound.CHAIN_POINTS = peak_bound.CHAIN_POINTS, 0
    old_regions, region_bound.REGION_WORK = region_bound.REGION_WORK, 0
    old_joint, joint_bound.MAX_OPS = joint_bound.MAX_OPS, 0
    try:
        alone = lower_bound_peak(dataclasses.replace(problem))  # a copy: the bound is kept on the problem
    finally:
        peak_bound.CHAIN_POINTS, region_bound.REGION_WORK, joint_bound.MAX_OPS = old, old_regions, old_joint
    lowest = min(min_peak(enumerate_plans(problem, fo, bo, check=False))
                 for fo in topological_fw_orders(problem, limit=6) for bo in topological_orders(problem, [o.id for o in problem.bw_ops], 6))
    assert lower_bound_peak(problem) == lowest == alone + 4 * 64
    assert explain(problem)[1] == "at attention_bw"


def _transformers_llama() -> Problem:
    """A transformers Llama (gated MLPs four times as wide as the model) called with labels, captured with roofline
    costs and no host memory to offload to."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from optsched.api import capture_problem

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (4, 64))
    problem = capture_problem(lambda ids: model(input_ids=ids, labels=ids).loss, (ids,), device_profile="h100")
    return dataclasses.replace(problem, host_bw=0.0)


def test_a_gated_mlps_backward_weighed_as_a_region_raises_the_bound_and_stays_below_real_plans():
    """The MLP's gate, up projection, activation and product are each made once (saved or recomputed once) and read
    by several backward ops in an order the plan picks: no single op shows that they are live together somewhere;
    the region's orders and save/recompute choices do (region_bound.py). The bound rises, and stays below the peak
    of every plan tried: the program's, greedy recomputation's and the lowest a search finds."""
    problem = _transformers_llama()
    old, region_bound.REGION_WORK = region_bound.REGION_WORK, 0
    old_joint, joint_bound.MAX_OPS = joint_bound.MAX_OPS, 0
    try:
        alone = lower_bound_peak(dataclasses.replace(problem))  # a copy: the bound is kept on the problem
    finally:
        region_bound.REGION_WORK, joint_bound.MAX_OPS = old, old_joint
    bound = lower_bound_peak(problem)
    assert bound > alone * 1.03
    assert "region" in explain(problem)[1]
    plans = [default_schedule(problem), greedy_recompute(problem, bound)]
    try:
        plans.append(solve(problem, bound, time_limit_s=2.0).schedule)
    except BudgetInfeasibleError as e:
        plans.append(e.lowest_schedule)
    peaks = [simulate(problem, plan).peak_bytes for plan in plans]
    assert bound <= min(peaks), (bound, peaks)
