"""Real code that crashed (issue 33): parametrizations, Embedding(max_norm) at a budget, a second backward through
one forward, BatchNorm with momentum=None. Each runs as eager runs it, or fails with an error that says what to do."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrizations

import optsched
from optsched.api import capture_problem
from optsched.capture.errors import CaptureError
from optsched.lower.programs import KeptGraphError


def _train_as_eager(model: nn.Module, optimized, inputs: list[tuple], loss=lambda out: out, lr: float = 0.1) -> None:
    """Steps of SGD on `optimized` and on an eager copy of `model` made now, `loss` of their outputs: gradients,
    parameters and buffers bitwise equal after each."""
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    for step, args in enumerate(inputs):
        loss(optimized(*args)).backward()
        loss(ref(*args)).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (step, name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b), (step, name)


class _OrthogonalInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = parametrizations.orthogonal(nn.Linear(8, 8))
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def test_an_orthogonal_linear_inside_the_model_trains_as_eager():
    # orthogonal's weight is matrix_exp(A - A.T), A = tril(original): `sub(tril, tril.t())` was written into
    # tril's storage, which its other operand reads transposed ("some elements of the input tensor and the
    # written-to tensor refer to a single memory location")
    torch.manual_seed(0)
    model = _OrthogonalInside()
    optimized = optsched.optimize(model, None, time_limit_s=1)
    _train_as_eager(model, optimized, [(torch.randn(4, 8),) for _ in range(2)])


@pytest.mark.parametrize("parametrize", [parametrizations.orthogonal, parametrizations.weight_norm])
def test_a_parametrized_module_itself_is_optimized(parametrize):
    torch.manual_seed(0)
    model = parametrize(nn.Linear(8, 8))
    optimized = optsched.optimize(model, None, time_limit_s=1)
    assert type(optimized) is type(model)
    assert [id(p) for p in optimized.parameters()] == [id(p) for p in model.parameters()]  # shared
    _train_as_eager(model, optimized, [(torch.randn(4, 8),) for _ in range(2)], loss=lambda y: y.square().sum())
    # copies of a parametrized module: torch's own refusal, as for the module before optimize()
    for copy_of in (copy.copy, pickle.dumps):
        with pytest.raises(RuntimeError, match="parametrized modules is only supported through state_dict"):
            copy_of(optimized)


class _RenormedTiedEmbedding(nn.Module):
    """Embedding(max_norm) whose renormalized weight is read again at the start: it is needed again at the very
    end of the backward, so a budget is met by recomputing it there rather than keeping it."""

    def __init__(self, vocab: int = 512, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, max_norm=1.0)
        self.first = nn.Linear(vocab, width)
        self.block = nn.Linear(width, width)

    def forward(self, idx):
        h = self.embed(idx) @ self.embed.weight.t()
        h = torch.tanh(self.first(h))
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        return h.pow(2).sum()


def test_embedding_max_norm_at_a_budget_trains_as_eager():
    # max_norm renormalizes the weight in place in every forward; AOTAutograd copies the new weight in after
    # the forward. The plan for the second step (the first backward showed the output usage) recomputed the
    # renormalization in the backward from the weight saved for it: autograd refused it ("modified by an
    # inplace operation"), and it would have read the new weight
    torch.manual_seed(0)
    model = _RenormedTiedEmbedding()
    # the roofline's op costs: the same plan on every machine (measured costs made it fail on a slower one)
    optimized = optsched.optimize(model, "95%", time_limit_s=2, device_profile="cpu")
    _train_as_eager(model, optimized, [(torch.randint(0, 512, (4, 8)),) for _ in range(3)])
    assert optimized.plan.summary()["n_recomputed"] > 0  # the budget needed recomputation


def test_ops_reading_an_input_the_step_mutates_are_not_recomputed():
    torch.manual_seed(0)
    model = _RenormedTiedEmbedding()
    problem = capture_problem(model, (torch.randint(0, 512, (4, 8)),))
    ops = {op.name: op for op in problem.ops}
    assert not ops["clone"].recomputable  # clone(weight), what embedding_renorm (functional) renormalizes
    assert ops["addmm"].recomputable


def _tanh_net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh())


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True", "ignore:optsched. the autograd engine held")
@pytest.mark.parametrize("keep", [dict(retain_graph=True), dict(create_graph=True)])
def test_a_backward_that_keeps_the_graph_is_refused_with_the_fix(keep):
    torch.manual_seed(0)
    model = _tanh_net()
    optimized = optsched.optimize(model, None, time_limit_s=1)
    loss = optimized(torch.randn(16, 32)).square().sum()
    with pytest.raises(KeptGraphError) as raised:
        loss.backward(**keep)
    message = str(raised.value)
    assert message.startswith("optsched: ") and "retain_graph=True or create_graph=True" in message
    assert "frees each saved activation at its last use" in message and "Fix: call backward() once per forward" in message
    optimized(torch.randn(16, 32)).square().sum().backward()  # the next step runs


class _CumulativeNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8, momentum=None)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.lin(x)
        return self.head(torch.relu(self.norm(h))).sum()


def test_batchnorm_with_momentum_none_names_the_layer_and_the_fix():
    torch.manual_seed(0)
    optimized = optsched.optimize(_CumulativeNorm(), None, time_limit_s=1)
    with pytest.raises(CaptureError) as raised:
        optimized(torch.randn(16, 8))
    error, message = raised.value, str(raised.value)
    assert "BatchNorm1d `norm` with momentum=None" in message
    assert error.filename == __file__ and "self.norm(h)" in message  # the user's call, not torch's batchnorm.py
    assert "model.norm.momentum = 0.1" in error.fix
    assert "model.norm.momentum = 1 / (model.norm.num_batches_tracked.item() + 1)" in error.fix
    assert "optsched/api.py" not in message  # optsched's own frames are not the user's


def test_the_exact_cumulative_average_the_fix_gives_equals_eagers():
    torch.manual_seed(0)
    model = _CumulativeNorm()
    optimized = optsched.optimize(model, None, time_limit_s=1)
    ref = copy.deepcopy(model)  # momentum=None, eager
    for _ in range(4):
        x = torch.randn(16, 8)
        model.norm.momentum = 1 / (model.norm.num_batches_tracked.item() + 1)
        optimized(x).backward()
        ref(x).backward()
        for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def test_an_optimized_parametrized_module_is_optimized_again():
    torch.manual_seed(0)
    model = parametrizations.orthogonal(nn.Linear(8, 8))
    first = optsched.optimize(model, None, time_limit_s=1)
    with pytest.warns(UserWarning, match="already returned"):
        again = optsched.optimize(first, None, time_limit_s=1)
    assert again.__dict__["_compiled_call_impl"] is not first.__dict__["_compiled_call_impl"]
    x = torch.randn(4, 8)
    assert torch.equal(again(x), model(x))


def test_a_backward_that_keeps_the_graph_after_plain_steps_is_refused_with_the_fix():
    # after plain backwards AOTAutograd's donated-buffer check ran first ("compiled with non-empty donated
    # buffers"), naming neither optsched nor a fix
    torch.manual_seed(0)
    model = _tanh_net()
    optimized = optsched.optimize(model, None, time_limit_s=1)
    for _ in range(3):
        optimized(torch.randn(16, 32)).square().sum().backward()
    with pytest.raises(KeptGraphError, match="^optsched: .*Fix: call backward\\(\\) once per forward"):
        optimized(torch.randn(16, 32)).square().sum().backward(retain_graph=True)


@pytest.mark.parametrize("parametrize", [parametrizations.orthogonal, parametrizations.weight_norm])
def test_a_deep_copy_of_an_optimized_parametrized_module_is_independent_and_optimized(parametrize):
    torch.manual_seed(0)
    model = parametrize(nn.Linear(8, 8))
    optimized = optsched.optimize(model, None, time_limit_s=1)
    optimized(torch.randn(4, 8)).square().sum().backward()
    twin = copy.deepcopy(optimized)
    assert isinstance(twin.__dict__.get("_compiled_call_impl"), optsched.api.Dispatcher)
    assert not any(p is q for p, q in zip(twin.parameters(), model.parameters()))
    for p, q in zip(twin.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    eager = copy.deepcopy(model)
    for p in (*twin.parameters(), *eager.parameters()):
        p.grad = None
    x = torch.randn(4, 8)
    twin(x).square().sum().backward()
    eager(x).square().sum().backward()
    for p, q in zip(twin.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
