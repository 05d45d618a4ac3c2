"""With no budget, an optimized step peaks no higher than eager's (issue 33).

A causal LM called with `labels` returns its logits and key/value caches besides the loss; no gradient
flows into them, and eager's autograd makes nothing for them. The captured backward reads a zero in
their place: it must not hold one from the backward's start, where the loss's backward peaks (it did: one
element per output, 20 bytes above eager here), only at the op that reads it.
"""

from __future__ import annotations

import functools

import pytest
import torch

import optsched
from optsched.measure import measure_training_step

_CONFIG = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               max_position_embeddings=64)
_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
}


def _labels_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_no_budget_peak_not_above_eager(name):
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, extra = _MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**_CONFIG, **extra))
    ids = torch.randint(0, _CONFIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    eager = measure_training_step(functools.partial(_labels_loss, model), model, (ids,))

    opt = optsched.optimize(model, None)
    for _ in range(2):  # the first call plans; the second runs the plan of the usage it saw
        _labels_loss(opt, ids).backward()
        model.zero_grad(set_to_none=True)
    planned = measure_training_step(functools.partial(_labels_loss, opt), model, (ids,))

    assert planned.peak_bytes <= eager.peak_bytes, (
        f"no budget: {planned.peak_bytes} B, eager {eager.peak_bytes} B (+{planned.peak_bytes - eager.peak_bytes} B)")
    assert planned.grads.keys() == eager.grads.keys()
    for k, g in eager.grads.items():
        torch.testing.assert_close(planned.grads[k], g, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert opt.plan.predicted_peak_bytes == planned.peak_bytes
