"""Small models for tests: each builder returns ``(module, example_inputs)``.

``module(*example_inputs)`` returns a scalar loss, so a training step is one call plus
``backward()``. Together they cover the graph features a scheduler must respect: plain
chains, convolutions, attention, random ops (dropout) and tied weights. Sizes are tiny so
tests stay fast on a 2-core CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Example = tuple[nn.Module, tuple[torch.Tensor, ...]]


class _SquareMeanLoss(nn.Module):
    """Wraps a network so its forward returns mean(out**2), a loss needing no targets."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def mlp(seed: int = 0) -> Example:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)
    )
    return _SquareMeanLoss(net), (torch.randn(32, 64),)


class _ConvNet(nn.Module):
    def __init__(self, n_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32, n_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.conv2(F.relu(self.conv1(x)))
        logits = self.fc(h.mean(dim=(2, 3)))  # global mean pooling
        return F.cross_entropy(logits, y)


def conv(seed: int = 0) -> Example:
    torch.manual_seed(seed)
    return _ConvNet(), (torch.randn(8, 3, 16, 16), torch.randint(10, (8,)))


class _AttentionBlock(nn.Module):
    """One pre-LN transformer block (causal attention + GELU MLP)."""

    def __init__(self, width: int = 64, n_head: int = 4):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        x = x + self.mlp(self.ln2(x))
        return x.pow(2).mean()


def attention_block(seed: int = 0) -> Example:
    torch.manual_seed(seed)
    return _AttentionBlock(), (torch.randn(4, 32, 64),)


def dropout_mlp(seed: int = 0) -> Example:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Dropout(p=0.5), nn.Linear(64, 64), nn.ReLU(),
        nn.Dropout(p=0.5), nn.Linear(64, 64),
    )
    return _SquareMeanLoss(net).train(), (torch.randn(32, 64),)


class _TiedLM(nn.Module):
    def __init__(self, vocab: int = 100, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter used twice

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.hidden(self.embed(idx)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def tied_lm(seed: int = 0) -> Example:
    torch.manual_seed(seed)
    model = _TiedLM()
    idx = torch.randint(100, (4, 16))
    return model, (idx, torch.randint(100, (4, 16)))


ALL: dict[str, Callable[..., Example]] = {
    "mlp": mlp,
    "conv": conv,
    "attention_block": attention_block,
    "dropout_mlp": dropout_mlp,
    "tied_lm": tied_lm,
}


def gpt_with_eager(batch_size: int = 8):
    """The bundled GPT, a batch, and eager's measured step on it: the reference the planned steps meet."""
    from benchmarks.models import gpt
    from optsched.measure import measure_training_step

    cfg = gpt.GPTConfig()
    model = gpt.build(cfg)
    inputs = gpt.make_batch(cfg, batch_size=batch_size)
    torch.manual_seed(0)
    return model, inputs, measure_training_step(model, model, inputs)
