"""The two functions from Lightning-AI/lightning-thunder issue 1337.

Both run ``n`` independent paths relu -> matmul(t1, t1) -> relu -> matmul(t3, a) over 256x256
float32 inputs. The efficient one finishes each path before starting the next and peaks at 3
live temporaries (0.75 MiB above its inputs); the inefficient one runs each stage across all
paths first and peaks at 11 (2.75 MiB). A memory-aware scheduler should turn the second into
the first. The ``del`` statements mirror the issue: they free each temporary as soon as it is
dead, so eager execution shows those peaks. Both trace with ``torch.compile(fullgraph=True)``.

Contrary to the issue's text they are not numerically equal. With ``si`` path i's t3, the
efficient one returns ``s9 @ ... @ s0 @ a``; in the inefficient one the two pop() reversals
cancel, then the last loop pops from the end, giving ``s0 @ ... @ s9 @ a``. Compare each
function only with itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def memory_peak_efficient_func(t0s: list[torch.Tensor], a: torch.Tensor) -> torch.Tensor:
    """Depth-first order: one path's temporaries die before the next path starts."""
    for t0 in t0s:
        t1 = F.relu(t0)
        del t0
        t2 = torch.matmul(t1, t1)
        del t1
        t3 = F.relu(t2)
        del t2
        a = torch.matmul(t3, a)
        del t3
    return a


def memory_peak_inefficient_func(t0s: list[torch.Tensor], a: torch.Tensor) -> torch.Tensor:
    """Breadth-first order: every path's stage output is held until the next stage."""
    t1s = []
    for t0 in t0s:
        t1s.append(F.relu(t0))
    del t0s

    t2s = []
    while t1s:
        t1 = t1s.pop()
        t2s.append(torch.matmul(t1, t1))
        del t1

    t3s = []
    while t2s:
        t2 = t2s.pop()
        t3s.append(F.relu(t2))
        del t2

    while t3s:
        t3 = t3s.pop()
        a = torch.matmul(t3, a)
        del t3
    return a


def make_inputs(
    n_paths: int = 10, size: int = 256, seed: int = 0, device: str | torch.device = "cpu"
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The issue's inputs: ``n_paths`` square float32 matrices plus the accumulator ``a``.

    The issue uses plain ``randn``, with which the 10-matmul chain overflows to inf, making
    numerical comparisons meaningless. The paths are scaled by 2.5/size so each step multiplies
    ``a`` by roughly one and the result stays finite and O(0.1) for any size or path count.
    Memory behaviour is unchanged: only values differ.
    """
    gen = torch.Generator().manual_seed(seed)
    scale = 2.5 / size
    t0s = [(torch.randn(size, size, generator=gen) * scale).to(device) for _ in range(n_paths)]
    a = torch.randn(size, size, generator=gen).to(device)
    return t0s, a
