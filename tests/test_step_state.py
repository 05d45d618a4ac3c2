"""What a step depends on beyond its inputs: the program variant Dynamo runs, the module's hooks, and the
state the planning forward of `example_inputs` writes (issue 33: each gave silently wrong results)."""

from __future__ import annotations

import pytest
import torch

import optsched
from optsched import CaptureError


class Flagged(torch.nn.Module):
    """One input signature, two programs: Dynamo recompiles when `flag` changes and goes back to the
    first program when it changes back."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)
        self.flag = True

    def forward(self, x):
        out = self.l(x)
        out = out * 2 if self.flag else out
        return out.pow(2).mean()


def _grads(call, module, *inputs) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    call(*inputs).backward()
    return [p.grad.clone() for p in module.parameters()]


def test_going_back_to_an_earlier_program_variant_gives_eager_gradients_and_its_plan():
    torch.manual_seed(0)
    m, x = Flagged(), torch.randn(4, 8)
    om = optsched.optimize(m, None, time_limit_s=1)
    plans = {}
    for flag in (True, False, True, False, True):
        m.flag = flag
        got, want = _grads(om, m, x), _grads(m, m, x)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"flag={flag}: gradients differ from eager's"
        plans.setdefault(flag, om.plan)
        assert om.plan is plans[flag], "om.plan must describe the variant that ran"
    assert plans[True].fingerprint != plans[False].fingerprint


def _loss(call, x):
    return call(x).pow(2).mean()


@pytest.mark.parametrize("where", ["top", "sub"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_hooks_added_or_removed_after_the_first_steps_run_as_in_eager(kind, where):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    om = optsched.optimize(m, None, time_limit_s=1)
    assert torch.equal(_loss(om, x), _loss(m, x))
    hooked = m if where == "top" else m[1]
    if kind == "forward":
        handle = hooked.register_forward_hook(lambda mod, args, out: out * 3)
    else:
        handle = hooked.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
    for _ in range(2):
        got, want = _grads(lambda x: _loss(om, x), m, x), _grads(lambda x: _loss(m, x), m, x)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert torch.equal(_loss(om, x), _loss(m, x))
    handle.remove()
    assert torch.equal(_loss(om, x), _loss(m, x))


def test_a_module_backward_hook_is_refused_at_the_call_naming_the_module():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    om = optsched.optimize(m, None, time_limit_s=1)
    _loss(om, x).backward()
    m[2].register_full_backward_hook(lambda mod, gi, go: None)
    with pytest.raises(CaptureError, match=r"backward hooks .* on 2 \(Linear\).*register_post_accumulate_grad_hook"):
        _loss(om, x)


class WritesState(torch.nn.Module):
    """State a forward writes that is not a buffer, as real code keeps it: an EMA codebook as a frozen
    Parameter (VQ-VAE), a plain tensor counter, a rebound number, nn.Embedding(max_norm=) renormalizing rows."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)
        self.code = torch.nn.Parameter(torch.randn(4, 8), requires_grad=False)
        self.count = torch.zeros(())
        self.calls = 0
        self.emb = torch.nn.Embedding(10, 8, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(20)

    def forward(self, x, idx):
        h = self.l(x) + self.emb(idx)
        with torch.no_grad():
            self.code.mul_(0.9).add_(0.1 * h[:4])
            self.count += 1
        return (h @ self.code.t()).pow(2).mean()


def test_planning_with_example_inputs_leaves_every_tensor_and_attribute_as_it_was():
    torch.manual_seed(0)
    m, x, idx = WritesState(), torch.randn(4, 8), torch.arange(4)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    count, x0 = m.count.clone(), x.clone()
    om = optsched.optimize(m, None, example_inputs=(x, idx), time_limit_s=1)
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} was written by the planning forward"
    assert torch.equal(m.count, count) and m.calls == 0 and torch.equal(x, x0)
    # and training from there is eager's training
    ref = WritesState()
    ref.load_state_dict(state)
    for _ in range(2):
        om(x, idx).backward()
        ref(x, idx).backward()
    for (k, v), w in zip(m.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.allclose(v, w, atol=1e-6), k
    assert torch.equal(m.count, ref.count)


class Scheduled(torch.nn.Module):
    """Python scalars that change every step: a scheduled temperature (float) and a step counter (int)
    that also enters the computation."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)
        self.temp, self.calls = 1.0, 0

    def forward(self, x):
        self.calls += 1
        h = torch.nn.functional.gelu(self.a(x)) * (1 + self.calls % 3)
        return (self.b(h) / self.temp).pow(2).mean()


def test_scalar_attributes_that_change_every_step_plan_at_most_twice_and_never_hit_the_recompile_limit():
    import copy

    from optsched.measure import measure_training_step

    torch.manual_seed(0)
    m, x = Scheduled(), torch.randn(32, 32)
    eager = copy.deepcopy(m)
    om = optsched.optimize(m, "90%", time_limit_s=1)
    plans = set()
    for step in range(12):  # Dynamo's recompile limit is 8 programs per code object
        m.temp = eager.temp = 1.0 + 0.1 * step
        got, want = _grads(om, m, x), _grads(eager, eager, x)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), f"step {step}"
        assert om.calls == eager.calls == step + 1
        plans.add(id(om.plan))
    assert len(plans) <= 2, "the first value is specialized; the second change makes the scalars inputs"
    measured = measure_training_step(om, m, (x,))
    assert measured.peak_bytes <= om.plan.budget_bytes
