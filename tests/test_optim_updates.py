"""Optimizer updates inside the backward (optsched/optim, issue 36): the optimizer's own step() per parameter,
bitwise equal to eager `loss.backward(); opt.step(); opt.zero_grad()`, with the user's loop unchanged."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from optsched.measure import measure_peak
from optsched.optim import InBackwardUpdates, state_bytes, state_sizes

STEPS = 3


class MLP(nn.Module):
    """An nn.Sequential MLP, plus a parameter that never gets a gradient."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, 2 * width), nn.GELU(),
                                  nn.Linear(2 * width, 8))
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def mlp() -> MLP:
    torch.manual_seed(0)
    model = MLP()
    model.body[0].bias.requires_grad_(False)  # frozen
    return model


def two_groups(model: MLP, **opts) -> list[dict]:
    """Two parameter groups with their own learning rates and weight decay."""
    first = [*model.body[0].parameters(), *model.body[2].parameters()]
    return [{"params": first, "lr": 1e-2},
            {"params": [*model.body[4].parameters(), *model.unused.parameters()], "lr": 3e-3, "weight_decay": 0.05}]


def hook_updates(updates: InBackwardUpdates, params) -> list:
    """What the caller does: apply each parameter's update as soon as autograd accumulated its gradient."""
    return [p.register_post_accumulate_grad_hook(updates.apply) for p in params if p.requires_grad]


def batch(step: int, width: int = 16) -> torch.Tensor:
    return torch.randn(6, width, generator=torch.Generator().manual_seed(step))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def run(model: nn.Module, opt: torch.optim.Optimizer, scheduler=None, steps: int = STEPS) -> None:
    """The user's loop, unchanged whether or not updates run in the backward."""
    for step in range(steps):
        loss_of(model, batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def assert_bitwise(model: nn.Module, opt: torch.optim.Optimizer, ref_model: nn.Module, ref_opt: torch.optim.Optimizer) -> None:
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
        state, ref = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert state.keys() == ref.keys(), name
        for key in ref:
            assert torch.equal(state[key], ref[key]), f"{name}: state {key}"
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
           [{k: v for k, v in g.items() if k != "params"} for g in ref_opt.param_groups]


OPTIMIZERS: dict[str, Callable] = {
    "sgd-momentum-wd": lambda groups, foreach: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=foreach),
    "sgd-nesterov": lambda groups, foreach: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, foreach=foreach),
    "adam": lambda groups, foreach: torch.optim.Adam(groups, weight_decay=1e-2, foreach=foreach),
    "adamw": lambda groups, foreach: torch.optim.AdamW(groups, foreach=foreach),
    "adamw-amsgrad": lambda groups, foreach: torch.optim.AdamW(groups, amsgrad=True, foreach=foreach),
}


def pair(make: Callable, foreach: bool | None):
    """(model, optimizer, scheduler) twice: the eager reference and the one updated in the backward."""
    out = []
    for _ in range(2):
        model = mlp()
        opt = make(two_groups(model), foreach)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
        out.append((model, opt, scheduler))
    return out


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updates_in_backward_match_eager_bitwise(name, foreach):
    """Two groups with their own lr and weight decay, an LR scheduler stepping between steps, a frozen
    parameter and one without a gradient: parameters and state after 3 steps are eager's, bit for bit."""
    (ref, ref_opt, ref_sched), (model, opt, sched) = pair(OPTIMIZERS[name], foreach)
    run(ref, ref_opt, ref_sched)
    updates = InBackwardUpdates(opt, model.parameters())
    hook_updates(updates, model.parameters())
    run(model, opt, sched)
    assert opt.param_groups[0]["lr"] != opt.param_groups[0]["initial_lr"]  # the scheduler moved it
    assert all(p.grad is None for p in model.parameters())
    assert model.body[0].bias not in opt.state and model.unused.weight not in opt.state  # frozen, no gradient
    assert_bitwise(model, opt, ref, ref_opt)


def test_fused_adam_matches_eager_bitwise():
    make = lambda groups, foreach: torch.optim.AdamW(groups, fused=True)  # noqa: E731
    (ref, ref_opt, ref_sched), (model, opt, sched) = pair(make, None)
    run(ref, ref_opt, ref_sched)
    hook_updates(InBackwardUpdates(opt, model.parameters()), model.parameters())
    run(model, opt, sched)
    assert_bitwise(model, opt, ref, ref_opt)


def test_some_parameters_in_backward_the_rest_in_opt_step():
    """The planner's choice is per parameter: the others are updated by the user's opt.step(), whose hooks
    run once per step and never for an update in the backward."""
    (ref, ref_opt, _), (model, opt, _) = pair(OPTIMIZERS["adamw"], True)
    run(ref, ref_opt)
    early = [*model.body[2].parameters(), model.body[4].weight]
    updates = InBackwardUpdates(opt, early)
    hook_updates(updates, early)
    steps_seen = []
    opt.register_step_post_hook(lambda o, args, kwargs: steps_seen.append(model.body[2].weight.grad))
    run(model, opt)
    assert steps_seen == [None] * STEPS  # opt.step() ran once per step, after the backward's updates
    assert_bitwise(model, opt, ref, ref_opt)


def test_group_of_parameters_in_one_apply():
    """Several parameters (of both groups) updated by one apply: one optimizer step over a view of both."""
    (ref, ref_opt, _), (model, opt, _) = pair(OPTIMIZERS["adam"], True)
    run(ref, ref_opt)
    updates = InBackwardUpdates(opt, model.parameters())
    last = model.body[0].weight  # the last gradient autograd finalizes: update everything there at once
    last.register_post_accumulate_grad_hook(lambda p: updates.apply(model.parameters()))
    run(model, opt)
    assert_bitwise(model, opt, ref, ref_opt)


def test_llama_matches_eager_bitwise():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(ref)
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (ref, model))
    hook_updates(InBackwardUpdates(opt, model.parameters()), model.parameters())
    for m, o in ((ref, ref_opt), (model, opt)):
        for step in range(STEPS):
            ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(step))
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    assert_bitwise(model, opt, ref, ref_opt)


def test_state_dict_round_trips():
    """The state dict after steps with updates in the backward is eager's; loaded into a fresh optimizer
    that updates in the backward, the next step is still eager's."""
    (ref, ref_opt, _), (model, opt, _) = pair(OPTIMIZERS["adamw"], False)
    run(ref, ref_opt, steps=2)
    hook_updates(InBackwardUpdates(opt, model.parameters()), model.parameters())
    run(model, opt, steps=2)
    saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
    assert saved["param_groups"] == ref_saved["param_groups"]
    assert saved["state"].keys() == ref_saved["state"].keys()
    for i, state in ref_saved["state"].items():
        assert all(torch.equal(saved["state"][i][k], v) for k, v in state.items())

    model2, ref2 = copy.deepcopy(model), copy.deepcopy(ref)
    opt2, ref_opt2 = (torch.optim.AdamW(two_groups(m), foreach=False) for m in (model2, ref2))
    opt2.load_state_dict(saved)
    ref_opt2.load_state_dict(ref_saved)
    hook_updates(InBackwardUpdates(opt2, model2.parameters()), model2.parameters())
    run(model2, opt2, steps=1)
    run(ref2, ref_opt2, steps=1)
    assert_bitwise(model2, opt2, ref2, ref_opt2)


def test_gradient_accumulation_updates_on_the_micro_batch_that_steps():
    (ref, ref_opt, _), (model, opt, _) = pair(OPTIMIZERS["sgd-momentum-wd"], True)
    updates = InBackwardUpdates(opt, model.parameters())
    hook_updates(updates, model.parameters())
    for step in range(STEPS):
        for micro in range(4):
            x = batch(10 * step + micro)
            loss_of(ref, x).div(4).backward()
            updates.step_on_backward = micro == 3
            loss_of(model, x).div(4).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    assert_bitwise(model, opt, ref, ref_opt)


def test_unflagged_accumulation_is_refused():
    """Updating each micro-batch from its partial gradient would not be eager's step: the second update
    of a parameter before opt.step() raises."""
    _, (model, opt, _) = pair(OPTIMIZERS["adam"], False)
    hook_updates(InBackwardUpdates(opt, model.parameters()), model.parameters())
    loss_of(model, batch(0)).backward()
    with pytest.raises(RuntimeError, match="step_on_backward = False"):
        loss_of(model, batch(1)).backward()


def test_clipping_and_grad_scaler_are_refused():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="clip_grad_norm_"):
        InBackwardUpdates(opt, model.parameters(), clip_grad_norm=True)
    with pytest.raises(ValueError, match="GradScaler"):
        InBackwardUpdates(opt, model.parameters(), grad_scaler=torch.amp.GradScaler("cpu"))
    # nothing in the backward: nothing to refuse
    InBackwardUpdates(opt, [], clip_grad_norm=True, grad_scaler=torch.amp.GradScaler("cpu")).close()
    InBackwardUpdates(opt, model.parameters(), grad_scaler=torch.amp.GradScaler("cpu", enabled=False)).close()


def test_other_optimizers_and_foreign_parameters_are_refused():
    model = mlp()
    with pytest.raises(NotImplementedError, match="RMSprop"):
        InBackwardUpdates(torch.optim.RMSprop(model.parameters()), model.parameters())
    with pytest.raises(NotImplementedError, match="RMSprop"):
        state_bytes(torch.optim.RMSprop(model.parameters()))
    with pytest.raises(ValueError, match="not in the optimizer"):
        InBackwardUpdates(torch.optim.SGD(model.body.parameters()), model.parameters())


def test_close_leaves_the_optimizer_as_it_was():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with InBackwardUpdates(opt, model.parameters()):
        assert len(opt._optimizer_step_post_hooks) == 1
    assert len(opt._optimizer_step_post_hooks) == 0


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.Adam(ps),
    lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    lambda ps: torch.optim.AdamW(ps, fused=True),
], ids=["sgd-momentum", "sgd", "adam", "adamw-amsgrad", "adamw-fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_state_bytes_foresee_the_state_of_the_first_step(make, dtype):
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = mlp()
        opt = make(model.parameters())
        foreseen = state_bytes(opt)
        sizes = {p: state_sizes(opt, p) for p in model.parameters()}
        shared = model.body[2].weight
        counted_once = state_bytes(opt, [shared, shared])  # a weight shared by two modules
        loss_of(model, batch(0).to(dtype)).backward()
        model.unused.weight.grad = torch.ones_like(model.unused.weight)  # a parameter that gets a gradient some step
        model.unused.bias.grad = torch.ones_like(model.unused.bias)
        opt.step()
    finally:
        torch.set_default_dtype(default)
    real = {p: sorted(t.untyped_storage().nbytes() for t in opt.state.get(p, {}).values()
                      if torch.is_tensor(t) and t.device == p.device) for p in model.parameters()}
    assert {p: sorted(s) for p, s in sizes.items()} == real
    assert foreseen == sum(map(sum, real.values()))
    assert counted_once == sum(real[shared])


def _step_memory(in_backward: bool) -> tuple[int, int]:
    """(allocator peak of one whole training step, the most gradient bytes live at any gradient hook)."""
    torch.manual_seed(0)
    width = 256
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    live = []

    def count(p: torch.Tensor) -> None:
        live.append(sum(q.grad.numel() * q.grad.element_size() for q in model.parameters() if q.grad is not None))
    for p in model.parameters():  # registered before the updates' hooks: runs before them, p's gradient live
        p.register_post_accumulate_grad_hook(count)
    if in_backward:
        hook_updates(InBackwardUpdates(opt, model.parameters()), model.parameters())
    x = torch.randn(4, width)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    step()  # the state exists from here on
    live.clear()
    return measure_peak(step).peak_bytes, max(live)


def test_updates_in_backward_lower_the_step_peak():
    eager_peak, eager_live = _step_memory(False)
    peak, live = _step_memory(True)
    weight = 256 * 256 * 4
    assert eager_live >= 6 * weight  # every gradient at once
    assert live == weight  # the one gradient being updated
    assert peak <= eager_peak - 4 * weight
