"""What the call that plans returns dies when the caller drops it (issue 24).

Dynamo leaves the frames of a compile in reference cycles, and they hold what the compiled call returned
until the garbage collector's next full pass. The first backward then saw outputs the caller had dropped
as held (BART's logits and encoder states, now and then), and the next call planned again for a hold
nobody made. The dispatcher collects those cycles after a call that planned."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import optsched

transformers = pytest.importorskip("transformers")


def test_outputs_of_the_planning_call_die_with_the_caller():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model, ids = transformers.LlamaForCausalLM(cfg), torch.randint(0, 1000, (4, 64))
    opt = optsched.optimize(model)
    gc.disable()  # no collection by chance between the call and the check
    try:
        out = opt(input_ids=ids, labels=ids)
        logits, loss = weakref.ref(out.logits), out.loss
        del out
        assert logits() is None
    finally:
        gc.enable()
    loss.backward()
    model.zero_grad(set_to_none=True)  # else the next call is an accumulation step: a program of its own
    plan = opt.plan
    opt(input_ids=ids, labels=ids).loss.backward()
    # the first backward saw the logits dropped, as the plan assumed: no second plan
    assert opt.plan is plan, (plan.output_usage, opt.plan.output_usage)
