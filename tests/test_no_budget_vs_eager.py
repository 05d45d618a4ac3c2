"""With no budget, an optimized step peaks no higher than eager's (issue 33).

A causal LM called with `labels` returns its logits and key/value caches besides the loss; no gradient
flows into them, and eager's autograd makes nothing for them. The captured backward reads a zero in
their place: it must not hold one from the backward's start, where the loss's backward peaks (it did: one
element per output, 20 bytes above eager here), only at the op that reads it.

Without a cache (`use_cache=False`) transformers' traced forward builds a causal mask that eager never makes
(eager passes `is_causal=True`): each layer's attention kept a float copy of it (passes/causal_mask.py).
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
    _assert_not_above_eager(model, _ids())


def test_no_budget_causal_mask_not_above_eager():
    """Without a cache (`use_cache=False`, as in training), transformers checks position_ids for packed
    sequences, which it cannot do while traced: the captured step builds a causal mask from arange, and each
    layer's attention saved a float copy of it (batch x seq^2 x 4 bytes a layer, 16 KiB here) where eager
    passes no mask (`is_causal=True`). The mask reads no input: the attention runs causal, without it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CONFIG, num_key_value_heads=1, use_cache=False))
    _assert_not_above_eager(model, _ids())


def _ids() -> torch.Tensor:
    return torch.randint(0, _CONFIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))


def _assert_not_above_eager(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """optsched at no budget: measured peak at most eager's, gradients bitwise eager's, peak as predicted."""
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


def _arange_causal(_given: torch.Tensor) -> torch.Tensor:
    i = torch.arange(8)
    return i[None, :] <= i[:, None]


def _arange_banded(_given: torch.Tensor) -> torch.Tensor:
    i = torch.arange(8)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)


@pytest.mark.parametrize("mask_of, dropped", [(_arange_causal, 1), (_arange_banded, 0), (lambda given: given, 0)],
                         ids=["causal-from-arange", "banded-from-arange", "causal-given"])
def test_causal_mask_pass_drops_only_constant_causal_masks(mask_of, dropped):
    """Only a mask read from no input whose values are the causal mask becomes is_causal: a banded one stays,
    and so does a causal mask the caller passes (its values may differ next call). Same values either way."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from optsched.passes.causal_mask import causal_masks

    def attention(q, k, v, given):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_of(given))

    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 2, 8, 4, generator=gen) for _ in range(3)] + [torch.ones(8, 8, dtype=torch.bool).tril()]
    gm = make_fx(attention, tracing_mode="fake")(*args)
    before = gm(*args)
    assert causal_masks(gm) == dropped
    assert torch.equal(gm(*args), before)
    assert any(n.target is torch.ops.aten.where.self for n in gm.graph.nodes) == (not dropped)
