"""Baselines: the heuristics people use today, each a `Schedule` judged by `simulate` like any plan.

Every entry of `BASELINES` is `fn(problem, budget_bytes=None, **params) -> Schedule`. A baseline makes
no claim about the budget (most ignore it; `dtr_eviction` uses it to decide when to evict): callers
compare the simulated peak and time. Torch-free; PyTorch's own min-cut partition lives in optsched/.
"""

from __future__ import annotations

from collections.abc import Callable

from ..model.problem import Schedule
from .activation_offloading import offload_all
from .block_checkpoint import checkpoint_blocks
from .dtr import dtr_eviction
from .horizontal_order import thunder_horizontal
from .inductor_orders import order_bfs, order_dfs, order_inductor, order_lpmf
from .program_order import eager
from .sqrt_checkpoint import sqrt_segments

BASELINES: dict[str, Callable[..., Schedule]] = {
    "eager": eager,
    "checkpoint_blocks": checkpoint_blocks,
    "sqrt_segments": sqrt_segments,
    "order_lpmf": order_lpmf,
    "order_bfs": order_bfs,
    "order_dfs": order_dfs,
    "order_inductor": order_inductor,
    "thunder_horizontal": thunder_horizontal,
    "dtr_eviction": dtr_eviction,
    "offload_all": offload_all,
}

__all__ = [
    "BASELINES",
    "checkpoint_blocks",
    "dtr_eviction",
    "eager",
    "offload_all",
    "order_bfs",
    "order_dfs",
    "order_inductor",
    "order_lpmf",
    "sqrt_segments",
    "thunder_horizontal",
]
