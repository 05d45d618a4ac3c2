"""An HF-style GPT-2 (transformers' GPT2LMHeadModel) with random weights, no download."""

from __future__ import annotations

import torch
from torch import nn


class GPT2Loss(nn.Module):
    """Wraps GPT2LMHeadModel so the module returns its scalar language-modelling loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build(n_layer: int = 6, n_embd: int = 256, n_head: int = 4, vocab_size: int = 1000, n_positions: int = 128, seed: int = 0) -> GPT2Loss:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0,  # inside the small vocabulary
    )
    model = GPT2LMHeadModel(cfg)
    # named: transformers warns once on an unnamed loss, and torch.compile cannot trace that warning
    model.loss_type = "ForCausalLM"
    return GPT2Loss(model)


def make_batch(batch_size: int = 8, seq_len: int = 128, vocab_size: int = 1000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return ids, ids.clone()
