"""sqrt(n) checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

The forward program is cut into about sqrt(n) segments of equal op counts, as
`torch.utils.checkpoint.checkpoint_sequential(functions, segments)` cuts a sequence; every segment
but the last (which checkpoint_sequential runs without checkpointing: its backward comes first) keeps
only the tensors crossing its boundary and recomputes the rest in the backward.
"""

from __future__ import annotations

import math

from ..model.problem import Problem, Schedule
from .graph import checkpointed


def sqrt_segments(problem: Problem, budget_bytes: int | None = None, n_segments: int | None = None) -> Schedule:
    """`n_segments` (default round(sqrt(forward ops))) segments in program order; the budget is ignored."""
    fw = [o.id for o in problem.fw_ops]
    n = len(fw)
    k = n_segments if n_segments is not None else max(1, round(math.sqrt(n)))
    if k < 1:
        raise ValueError(f"n_segments must be >= 1, got {k}")
    k = min(k, max(n, 1))
    bounds = [round(i * n / k) for i in range(k + 1)]
    segments = [fw[a:b] for a, b in zip(bounds, bounds[1:])]
    return checkpointed(problem, segments[:-1])
