"""The joint save/recompute bound (`solvers/search/joint_bound.py`): below every plan tried, with every backward op in
its model (its strongest claims); above the point families where one recomputed set must serve every step; the same
bound on every run; on torch.nn's TransformerEncoder, where the point families left 16% between the bound and the
plans found, within a few percent of the lowest plan found."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optsched.solvers import BudgetInfeasibleError, Op, Phase, Problem, Tensor, TensorKind, solve
from optsched.solvers.search import joint_bound
from optsched.solvers.search.heuristics import lower_bound_peak
from optsched.solvers.search.peak_bound import _Bound, _SAME_SHAPE, explain, step_bound
from optsched.solvers.synthetic import chain_training_problem
from tests.bruteforce import (describe, enumerate_plans, min_peak, sampled_placements, topological_fw_orders,
                              topological_orders, training_problems)
from tests.hypothesis_profiles import examples

FIXED = settings(max_examples=examples(150), deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def _without_joint(problem, monkeypatch) -> int:
    with monkeypatch.context() as m:
        m.setattr(joint_bound, "MAX_OPS", 0)
        return step_bound(dataclasses.replace(problem), joint=True)


def _with_joint(problem) -> int:
    b = _Bound(problem)
    b.value()
    return b.joint()


def _lowest_found(problem, bound: int) -> int:
    try:
        return solve(problem, bound, time_limit_s=3.0).sim.peak_bytes
    except BudgetInfeasibleError as e:
        return e.lowest_peak_bytes


@FIXED
@given(training_problems(max_fw=8), st.booleans(), st.integers(0, 2**31))
def test_below_every_plan_tried_with_every_backward_op_in(problem, freed, seed):
    """Every backward op in the model (the most it ever claims); plans: every recomputed set in several orders, and
    random placements of the recomputations (earlier than their first reader too)."""
    if freed:
        problem = dataclasses.replace(problem, tensors=[
            dataclasses.replace(t, kind=TensorKind.TANGENT_FREED) if t.kind is TensorKind.TANGENT else t
            for t in problem.tensors])
    old = joint_bound.START_POINTS
    joint_bound.START_POINTS = len(problem.ops)
    try:
        bound = _with_joint(problem)
    finally:
        joint_bound.START_POINTS = old
    fw_orders = topological_fw_orders(problem, limit=6)
    peaks = [min_peak(enumerate_plans(problem, fo, bo, check=False))
             for fo in fw_orders for bo in topological_orders(problem, [o.id for o in problem.bw_ops], 6)]
    peaks += sampled_placements(problem, fw_orders[0], random.Random(seed), 40)
    assert bound <= min(peaks), f"bound {bound} ({explain(problem)[1]}) above a plan's peak {min(peaks)}:\n{describe(problem)}"


def test_one_choice_for_every_step_raises_a_layer_chains_bound(monkeypatch):
    """A chain of layers: the point families let the caller's loss assume every activation recomputed and each
    backward op assume what it reads saved; one recomputed set for all says more, and no plan found goes below it."""
    problem = chain_training_problem()
    alone = _without_joint(problem, monkeypatch)
    bound = step_bound(problem, joint=True)
    assert bound > 1.1 * alone and step_bound(problem) == alone  # the joint family only where asked for
    assert explain(problem)[1].startswith("over one save/recompute choice at ")
    assert bound <= _lowest_found(problem, bound)


def _dropout_under_a_recomputable_add() -> Problem:
    """x -> dropout -> add(., x) -> heavy -> loss (with scratch space); the heavy op's backward reads the add's output.
    At the loss either the add's output is kept, or the dropout's (not recomputable) for the add's recomputation."""
    fw, bw, act = Phase.FW, Phase.BW, TensorKind.ACTIVATION
    tensors = [Tensor(0, "x", 64, TensorKind.INPUT), Tensor(1, "d", 1000, act, 0), Tensor(2, "y", 1000, act, 1),
               Tensor(3, "h", 2000, act, 2), Tensor(4, "loss", 4, act, 3), Tensor(5, "tangent", 4, TensorKind.TANGENT),
               Tensor(6, "g_h", 2000, act, 4), Tensor(7, "g_y", 1000, act, 5), Tensor(8, "g_d", 1000, act, 6),
               Tensor(9, "g_x", 64, act, 7)]
    ops = [Op(0, "dropout", fw, (0,), (1,), 1e-6, recomputable=False), Op(1, "add", fw, (1, 0), (2,), 1e-6),
           Op(2, "heavy", fw, (2,), (3,), 1e-6), Op(3, "loss", fw, (3,), (4,), 1e-6, workspace_bytes=1500),
           Op(4, "loss_bw", bw, (5,), (6,), 1e-6), Op(5, "heavy_bw", bw, (6, 2), (7,), 1e-6),
           Op(6, "add_bw", bw, (7,), (8,), 1e-6), Op(7, "dropout_bw", bw, (8,), (9,), 1e-6)]
    return Problem(ops, tensors, outputs=frozenset({4, 9}), name="dropout")


def test_a_value_only_recomputations_read_counts_while_the_forward_holds_it():
    """The dropout's output is read by no backward op, only by the add's recomputation: when the add is recomputed
    it is held from the forward to the backward, as the add's output would be when saved. The bound is the least
    peak over every plan (at the loss: the input, the heavy op's output, the loss, its scratch and one of the two)."""
    problem = _dropout_under_a_recomputable_add()
    bound = _with_joint(problem)
    fw_orders = topological_fw_orders(problem, limit=6)
    best = min(min_peak(enumerate_plans(problem, fo, bo)) for fo in fw_orders
               for bo in topological_orders(problem, [o.id for o in problem.bw_ops], 6))
    assert bound == best == 64 + 2000 + 4 + 1500 + 1000, (bound, best)
    assert step_bound(problem) < bound


def test_the_same_bound_on_every_run():
    """One worker, CP-SAT's deterministic time: a copy of the problem (nothing kept) gets the same bound."""
    problem = chain_training_problem()
    first = _with_joint(dataclasses.replace(problem))
    assert all(_with_joint(dataclasses.replace(problem)) == first for _ in range(2))


def test_left_out_above_its_op_limit(monkeypatch):
    problem = chain_training_problem()
    monkeypatch.setattr(joint_bound, "MAX_OPS", len(problem.ops) - 1)
    assert not explain(problem)[1].startswith("over one save/recompute choice")


def test_torch_transformer_encoder_within_a_few_percent_of_its_lowest_plan(monkeypatch):
    """torch.nn.TransformerEncoder (post-norm layers, a vocabulary head, the loss outside the module) at a budget no
    plan meets: the plans keep layer-norm outputs across the caller's loss that the point families let it drop."""
    torch = pytest.importorskip("torch")
    from optsched.api import capture_problem

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    embed, head = torch.nn.Embedding(128, 64), torch.nn.Linear(64, 128)
    ids = torch.randint(0, 128, (4, 64))

    def step(ids):
        return head(encoder(embed(ids)))

    logits_problem = capture_problem(step, (ids,), device_profile="h100")
    problem = dataclasses.replace(logits_problem, host_bw=0.0)
    alone = _without_joint(problem, monkeypatch)
    bound = lower_bound_peak(problem, joint=True)
    lowest = _lowest_found(problem, bound)
    assert lowest > 1.03 * alone, (lowest, alone)  # the point families alone: more than 3% below the lowest plan
    assert bound <= lowest <= 1.01 * bound, (lowest, bound, alone)


def test_a_problem_like_one_bounded_before_is_charged_the_joint_familys_solves_again():
    """Per structure (`_SAME_SHAPE`): a copy of a problem bounded before takes its bound without the work, and the clock
    is charged that work again, the joint family's CP-SAT solves included (the plan may not depend on what the process
    bounded before)."""
    from optsched.solvers.model import clock

    problem = chain_training_problem()
    _SAME_SHAPE.clear()
    with clock.deterministic(True):
        before = clock.units_counted()
        first = step_bound(dataclasses.replace(problem), joint=True)
        middle = clock.units_counted()
        again = step_bound(dataclasses.replace(problem), joint=True)
        after = clock.units_counted()
    spent = {u: middle[u] - before.get(u, 0) for u in middle}
    charged = {u: after[u] - middle.get(u, 0) for u in after}
    assert again == first
    assert spent["cpsat_dtime_joint"] > 0 and charged["cpsat_dtime_joint"] == pytest.approx(spent["cpsat_dtime_joint"])
    assert charged["joint_constraint"] == spent["joint_constraint"] > 0
