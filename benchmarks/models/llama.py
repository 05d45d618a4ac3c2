"""A LitGPT-style LLaMA decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Written to read like nanoGPT while following LitGPT's `model.py` op for op (the names match
LitGPT's: `transformer.wte`, `transformer.h[i].norm_1`, `attn.attn` for the fused q/k/v
projection, `mlp.fc_1` / `fc_2` / `proj`, `lm_head`), so that its captured training step has
the shapes and dtypes of the real thing. ``forward(idx, targets)`` returns the mean next-token
cross-entropy, so one call plus ``backward()`` is a whole training step. No data-dependent
Python control flow: it traces with AOTAutograd and ``torch.compile(fullgraph=True)``.

Configs (``CONFIGS``) follow LitGPT's ``config.py``; ``Config.from_name(name, **overrides)``
changes what a run needs (e.g. ``n_layer=2``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import GPT


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


@dataclass
class Config:
    name: str = ""
    block_size: int = 4096  # longest sequence the rotary cache covers
    vocab_size: int = 32000
    padding_multiple: int = 64
    padded_vocab_size: int | None = None  # default: vocab_size rounded up to padding_multiple
    n_layer: int = 16
    n_head: int = 32
    n_embd: int = 4096
    n_query_groups: int | None = None  # None: one key/value head per query head (multi-head attention)
    head_size: int | None = None  # default: n_embd // n_head
    intermediate_size: int | None = None  # LLaMAMLP width; default 4 * n_embd
    rotary_percentage: float = 1.0  # share of each head's dimensions that rotary embeddings turn
    rope_base: int = 10000
    rope_condense_ratio: int = 1  # positions are divided by this (position interpolation, e.g. LongChat)
    norm_eps: float = 1e-5
    bias: bool = False
    tie_embeddings: bool = False  # LLaMA has a separate lm_head; True shares wte's weight
    dtype: torch.dtype = torch.bfloat16  # parameters (the rotary cache stays float32, as in LitGPT)

    def __post_init__(self):
        if self.padded_vocab_size is None:
            self.padded_vocab_size = find_multiple(self.vocab_size, self.padding_multiple)
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        if self.head_size is None:
            assert self.n_embd % self.n_head == 0
            self.head_size = self.n_embd // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        assert self.n_head % self.n_query_groups == 0, "query heads come in whole groups per key/value head"

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)

    @classmethod
    def from_name(cls, name: str, **overrides) -> Config:
        return cls(**{**CONFIGS[name], **overrides})

    def n_params(self) -> int:
        """Parameter count, without building the model."""
        C, V, I, hs = self.n_embd, self.padded_vocab_size, self.intermediate_size, self.head_size  # noqa: E741
        qkv = (self.n_head + 2 * self.n_query_groups) * hs
        attn = C * qkv + hs * self.n_head * C + (qkv + C if self.bias else 0)
        mlp = 3 * C * I + (2 * I + C if self.bias else 0)
        per_layer = attn + mlp + 2 * C  # two RMSNorm weights
        head = 0 if self.tie_embeddings else C * V
        return V * C + self.n_layer * per_layer + C + head

    def param_bytes(self) -> int:
        return self.n_params() * torch.empty((), dtype=self.dtype).element_size()


CONFIGS: dict[str, dict] = {
    # lmsys/longchat-7b-16k: LLaMA-7B with rotary positions condensed 8x for a 16k context.
    "longchat-7b-16k": {
        "name": "longchat-7b-16k", "block_size": 16384, "vocab_size": 32000, "padding_multiple": 64, "n_layer": 32,
        "n_head": 32, "n_embd": 4096, "rotary_percentage": 1.0, "bias": False, "norm_eps": 1e-6,
        "intermediate_size": 11008, "rope_condense_ratio": 8,
    },
    # a small one for tests
    "tiny-llama": {
        "name": "tiny-llama", "block_size": 256, "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_query_groups": 2,
        "n_embd": 128, "intermediate_size": 344, "norm_eps": 1e-6,
    },
}


class RMSNorm(nn.Module):
    """Root-mean-square normalization, computed in float32 and cast back (as LitGPT does)."""

    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (x_normed * self.weight.float()).to(dtype=dtype)


def build_rope_cache(
    seq_len: int, n_elem: int, base: int = 10000, condense_ratio: int = 1, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, (seq_len, n_elem) float32 each."""
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=device).float() / n_elem))
    seq_idx = torch.arange(seq_len, device=device).float() / condense_ratio
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + d/2}) by each position's angles."""
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        qkv = (cfg.n_head + 2 * cfg.n_query_groups) * cfg.head_size
        self.attn = nn.Linear(cfg.n_embd, qkv, bias=cfg.bias, dtype=cfg.dtype)  # fused q, k, v
        self.proj = nn.Linear(cfg.head_size * cfg.n_head, cfg.n_embd, bias=cfg.bias, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q_per_kv = cfg.n_head // cfg.n_query_groups
        qkv = self.attn(x)
        # per key/value group: its q_per_kv query heads, then one key and one value head
        qkv = qkv.view(B, T, cfg.n_query_groups, q_per_kv + 2, cfg.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # (B, groups, q_per_kv + 2, T, hs)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        if q_per_kv > 1:  # grouped-query attention: each key/value head serves its group's queries
            k = k.expand(B, cfg.n_query_groups, q_per_kv, T, cfg.head_size)
            v = v.expand(B, cfg.n_query_groups, q_per_kv, T, cfg.head_size)
        q, k, v = (t.reshape(B, -1, T, cfg.head_size) for t in (q, k, v))  # (B, n_head, T, hs)

        n = cfg.rope_n_elem
        if n == cfg.head_size:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # rotary embeddings on the first n dimensions of each head only
            q = torch.cat((apply_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
            k = torch.cat((apply_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)

        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(cfg.head_size))
        y = y.transpose(1, 2).reshape(B, T, cfg.head_size * cfg.n_head)
        return self.proj(y)


class LLaMAMLP(nn.Module):
    """SwiGLU: proj(silu(fc_1(x)) * fc_2(x))."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.fc_1 = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=cfg.bias, dtype=cfg.dtype)
        self.fc_2 = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=cfg.bias, dtype=cfg.dtype)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=cfg.bias, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.norm_1 = RMSNorm(cfg.n_embd, eps=cfg.norm_eps, dtype=cfg.dtype)
        self.attn = CausalSelfAttention(cfg)
        self.norm_2 = RMSNorm(cfg.n_embd, eps=cfg.norm_eps, dtype=cfg.dtype)
        self.mlp = LLaMAMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class LLaMA(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(cfg.padded_vocab_size, cfg.n_embd, dtype=cfg.dtype),
            "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            "ln_f": RMSNorm(cfg.n_embd, eps=cfg.norm_eps, dtype=cfg.dtype),
        })
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False, dtype=cfg.dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        cos, sin = build_rope_cache(cfg.block_size, cfg.rope_n_elem, cfg.rope_base, cfg.rope_condense_ratio)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(GPT._init_weights)  # nanoGPT's initialization

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``idx`` (B, T) against ``targets`` (B, T)."""
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_batch(
    cfg: Config, batch_size: int = 1, seq_len: int | None = None, seed: int = 0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets, (batch_size, seq_len) int64 each."""
    T = cfg.block_size if seq_len is None else seq_len
    assert T <= cfg.block_size, "sequence longer than the rotary cache"
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (batch_size, T + 1), generator=gen)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return (idx, targets) if device is None else (idx.to(device), targets.to(device))


def build(cfg: Config | str | None = None, seed: int = 0, **overrides) -> LLaMA:
    """A freshly initialised model; ``seed`` makes the weights reproducible."""
    if cfg is None:
        cfg = Config.from_name("tiny-llama", **overrides)
    elif isinstance(cfg, str):
        cfg = Config.from_name(cfg, **overrides)
    elif overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    torch.manual_seed(seed)
    return LLaMA(cfg)
