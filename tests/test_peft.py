"""A PEFT LoRA model (issue 24): planned once, within its budget, as predicted, with eager's gradients.

LoRA freezes the base weights, so the first layer's key cache needs no gradient; autograd saves such
an output for the backward as the very tensor the caller got, so it is alive at the backward's start
whatever the caller did. The usage observer looks at it again after the backward (when only the caller
can hold it): the step is not planned a second time for a hold nobody makes."""

from __future__ import annotations

import warnings

import pytest
import torch

import optsched
from optsched.planning import op_costs, solving
from optsched.capture.output_usage import OutputUsageWarning
from optsched.measure import measure_training_step

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="peft is not installed (the dev extra has it)")

ROUNDING = 0.005  # predicted and measured peaks agree within this share


def _lora_llama(hidden: int = 64, layers: int = 2, batch: int = 4, seq: int = 64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * seq,
    )
    # init_lora_weights=False: B is random, not zeros, so both LoRA matrices get nonzero gradients
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)
    return model, torch.randint(0, 1000, (batch, seq))


def test_lora_llama_plans_once_within_budget(monkeypatch):
    # the size
    model, ids = _lora_llama(hidden=128, batch=8, seq=128)
    step = lambda m: (lambda i: m(input_ids=i, labels=i).loss)  # noqa: E731
    eager = measure_training_step(step(model), model, (ids,))
    assert eager.grads and all("lora_" in n for n in eager.grads)

    solves = []
    real_solve = solving.solve
    monkeypatch.setattr(solving, "solve", lambda *a, **k: solves.append(1) or real_solve(*a, **k))
    # the roofline's plan (deterministic: no measured times) saves the first layer's frozen key cache
    opt = optsched.optimize(model, "60%", device_profile="cpu")
    plans = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutputUsageWarning)
        for _ in range(3):
            opt(input_ids=ids, labels=ids).loss.backward()
            for p in model.parameters():
                p.grad = None
            plans.append(opt.plan)
        r = measure_training_step(step(opt), model, (ids,))
    assert len(solves) == 1, f"planned {len(solves)} times"
    assert all(p is plans[0] for p in plans) and opt.plan is plans[0]
    plan = opt.plan
    problem, sim = plan.problem, plan.sim
    saved_outputs = [problem.tensors[t].name for t in problem.returned if t in set(sim.saved)]
    assert saved_outputs, "the plan saves no output the caller drops: this test no longer sees the case it is for"
    # the loss gets a gradient; logits and the key/value caches get none, and the caller drops them
    assert plan.output_usage.count("g") == 1 and plan.output_usage.count("h") == 1
    assert r.peak_bytes <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - r.peak_bytes) <= ROUNDING * r.peak_bytes
    assert r.grads.keys() == eager.grads.keys()
    for name, g in eager.grads.items():
        torch.testing.assert_close(r.grads[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_no_budget_plans_once():
    """With no budget the frozen key cache is surely saved for the backward: still one plan, as predicted."""
    model, ids = _lora_llama()
    eager = measure_training_step(lambda i: model(input_ids=i, labels=i).loss, model, (ids,))
    opt = optsched.optimize(model, device_profile="cpu", time_limit_s=2.0)
    plans = []
    for _ in range(3):
        opt(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None
        plans.append(opt.plan)
    assert all(p is plans[0] for p in plans), [p.output_usage for p in plans]
    r = measure_training_step(lambda i: opt(input_ids=i, labels=i).loss, model, (ids,))
    assert r.peak_bytes <= eager.peak_bytes
    assert abs(opt.plan.predicted_peak_bytes - r.peak_bytes) <= ROUNDING * r.peak_bytes
    for name, g in eager.grads.items():
        torch.testing.assert_close(r.grads[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_held_output_saved_for_the_backward_is_seen_held(monkeypatch):
    """The same frozen key cache, held by the caller through the backward: observed held and planned for;
    the second plan (same graph, another usage) reuses the op costs the first one measured."""
    model, ids = _lora_llama()
    measured = []
    real_profile = op_costs.profile_nodes
    monkeypatch.setattr(op_costs, "profile_nodes", lambda *a, **k: measured.append(1) or real_profile(*a, **k))
    opt = optsched.optimize(model)
    plans = []
    for _ in range(3):
        out = opt(input_ids=ids, labels=ids)
        out.loss.backward()
        del out
        for p in model.parameters():
            p.grad = None
        plans.append(opt.plan)
    assert plans[0] is not plans[1] and plans[1] is plans[2]  # planned again once, for what was seen
    usage = plans[1].output_usage.split(",")
    assert all(u[1] == "h" for u in usage)  # everything the call returned was held: the loss, logits, caches
    assert len(measured) == 1  # op costs measured for the first plan only
