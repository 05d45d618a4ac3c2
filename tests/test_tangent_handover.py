"""Output gradients handed to the compiled backward outside the autograd engine (capture/tangent_handover.py).

The engine holds a node's incoming gradients until the node returns, and the whole compiled backward is one
node: without the hand-over, the gradient of an output (a loss computed by the caller) lives through the
whole backward. With it, the backward frees it after its last reader, and the plan counts it so
(`TensorKind.TANGENT_FREED`): predicted = measured, lower than with the engine holding it.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

import optsched
import optsched.compiler.backend as backend_module
from optsched.capture.tangent_handover import TangentHandover
from optsched.costs.measure import measure_training_step
from optsched.solvers.model.problem import Op, Phase, Problem, Tensor, TensorKind, default_schedule
from optsched.solvers.model.simulator import simulate
from tests.bruteforce import replay
from tests.schedule_checker import fused_replay

MIB = 2**20
SCALARS = 64  # bytes: the caller's loss and its normalizer (0-dim), which the plan's estimate of the caller leaves out


def _seeded_problem(kind: TensorKind) -> Problem:
    """f: x -> a; backward b1 reads the seed and a, b2 reads b1's result: the seed (1 MiB) is read only by b1."""
    tensors = [
        Tensor(0, "x", 1024, TensorKind.INPUT),
        Tensor(1, "a", 4096, TensorKind.ACTIVATION, producer=0),
        Tensor(2, "seed", MIB, kind),
        Tensor(3, "g1", 2 * MIB, TensorKind.ACTIVATION, producer=1),
        Tensor(4, "g2", 4 * MIB, TensorKind.ACTIVATION, producer=2),
    ]
    ops = [
        Op(0, "f", Phase.FW, (0,), (1,), 1e-3),
        Op(1, "b1", Phase.BW, (2, 1), (3,), 1e-3),
        Op(2, "b2", Phase.BW, (3,), (4,), 1e-3),
    ]
    return Problem(ops, tensors, outputs=frozenset([1, 4]))


def test_a_freed_seed_dies_after_its_last_reader_in_the_simulator_and_both_independent_replays():
    held, freed = _seeded_problem(TensorKind.TANGENT), _seeded_problem(TensorKind.TANGENT_FREED)
    peaks = {}
    for name, p in (("held", held), ("freed", freed)):
        s = default_schedule(p)
        sim = simulate(p, s).peak_bytes
        assert sim == replay(p, s).peak_bytes == fused_replay(p, s)[0], name
        peaks[name] = sim
    # at b2: inputs, a (an output), g1 and g2, plus the seed only while the engine holds it
    assert peaks["held"] - peaks["freed"] == MIB


def test_a_freed_seed_is_live_at_the_backwards_first_step_even_unread():
    p = _seeded_problem(TensorKind.TANGENT_FREED)
    unread = dataclasses.replace(p.ops[1], inputs=(1,))
    p = Problem([p.ops[0], unread, p.ops[2]], p.tensors, outputs=p.outputs)
    s = default_schedule(p)
    sim = simulate(p, s)
    assert sim.peak_bytes == replay(p, s).peak_bytes == fused_replay(p, s)[0]
    assert sim.timeline[1] >= MIB  # counted at the backward's first step


class _Head(torch.nn.Module):
    """Wide parameters, a wide output: the backward's end (parameters and their gradients) is the peak, so a
    seed held through the whole backward shows there."""

    def __init__(self, d: int = 1024, vocab: int = 2048):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, d), torch.nn.GELU(), torch.nn.Linear(d, d), torch.nn.GELU())
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.body(x))


def _step(opt, x, y):
    return F.cross_entropy(opt(x), y)  # the caller's loss: it drops the logits after the loss is made


def _measured(monkeypatch, hand_over: bool):
    torch.manual_seed(0)
    model = _Head()
    x, y = torch.randn(128, 64), torch.randint(2048, (128,))
    if not hand_over:
        monkeypatch.setattr(backend_module, "can_hand_over", lambda *a: False)
    opt = optsched.optimize(model, None, time_limit_s=2, device_profile="cpu", deterministic=True)
    for _ in range(2):  # the second call plans for the usage the first one saw
        model.zero_grad(set_to_none=True)
        _step(opt, x, y).backward()
    m = measure_training_step(lambda inp: _step(opt, inp, y), model, (x,))  # y is the caller's: not a step input
    eager = measure_training_step(lambda inp: F.cross_entropy(model(inp), y), model, (x,))
    return opt.plan, m, eager


def test_the_backward_frees_the_callers_output_gradient_as_planned(monkeypatch):
    plan, m, eager = _measured(monkeypatch, hand_over=True)
    kinds = {t.kind for t in plan.problem.tensors}
    assert TensorKind.TANGENT_FREED in kinds and TensorKind.TANGENT not in kinds
    assert 0 <= m.peak_bytes - plan.predicted_peak_bytes <= SCALARS
    for k, g in eager.grads.items():
        torch.testing.assert_close(m.grads[k], g, rtol=0, atol=0)


def test_without_the_hand_over_the_engine_holds_the_gradient_all_backward(monkeypatch):
    """The same step with the engine holding the logits' gradient: predicted = measured there too, and higher
    than with the hand-over, by at most that gradient (128 x 2048 floats; the peaks fall at different steps)."""
    handed, m_handed, _ = _measured(monkeypatch, hand_over=True)
    held, m_held, _ = _measured(monkeypatch, hand_over=False)
    assert TensorKind.TANGENT in {t.kind for t in held.problem.tensors}
    assert 0 <= m_held.peak_bytes - held.predicted_peak_bytes <= SCALARS
    assert 0 < m_held.peak_bytes - m_handed.peak_bytes <= 128 * 2048 * 4


def test_an_unhooked_backward_warns_that_the_engine_held_its_gradients():
    handover = TangentHandover(1, [0])
    meta = torch.empty(8, 8)
    args = [torch.ones(8, 8)]
    with pytest.warns(RuntimeWarning, match="held this backward's output gradients"):
        handover.give(args, [(0, meta)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handover.give(args, [(0, meta)])  # said once


def test_taken_gradients_reach_the_backward_in_its_traced_layout():
    handover = TangentHandover(1, [0])
    meta = torch.empty(4, 6)
    g = torch.arange(24.0).reshape(6, 4).t()  # the right values, transposed strides
    with torch.no_grad():  # as the engine runs hooks without create_graph
        assert handover._take((g,)) == (None,)
    with torch.enable_grad():  # create_graph=True: the engine keeps them
        assert handover._take((g,)) is None
    args = [None]
    handover.give(args, [(0, meta)])
    assert args[0].stride() == meta.stride() and torch.equal(args[0], g)
    assert handover._local.taken is None  # no reference kept
