"""Activation checkpointing of every k-th repeated block: what `torch.utils.checkpoint` around every
k-th transformer layer does (Hugging Face's gradient checkpointing is k = 1).

Blocks are `search.blocks.find_blocks`' repeated blocks (the stem and head are not checkpointed).
A checkpointed block keeps only the tensors leaving it and recomputes the rest in the backward.
When nothing repeats, find_blocks' fixed-size groups stand in for blocks, all but the last.
"""

from __future__ import annotations

from ..model.problem import Problem, Schedule
from ..search.blocks import find_blocks
from .graph import checkpointed


def checkpoint_blocks(problem: Problem, budget_bytes: int | None = None, k: int = 1) -> Schedule:
    """Checkpoint blocks 0, k, 2k, ... of the repeated blocks; the budget is ignored."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    groups = find_blocks(problem)
    blocks = groups.blocks or list(range(len(groups.members) - 1))
    return checkpointed(problem, [groups.members[b] for b in blocks[::k]])
