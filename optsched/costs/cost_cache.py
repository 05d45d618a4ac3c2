"""Measured op costs by graph, kept for the planners of one optimized callable."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch
import torch.fx as fx

from ..capture.fingerprint import fingerprint
from .profiles import NodeCosts

COST_CACHE_SIZE = 8  # graphs whose measured op costs one optimized callable keeps (CostCache)


class CostCache:
    """Measured op costs by graph, the COST_CACHE_SIZE most recent: shared by the planners of one optimized
    callable, so a program planned again for the same graph (the caller used its outputs otherwise than the
    first plan assumed: capture/output_usage.py) reuses the op times, scratch space and in-place checks
    measured the first time instead of running every op again. Keyed by the graph's fingerprint hash, its
    node names (what the costs are keyed by) and the device."""

    def __init__(self, size: int = COST_CACHE_SIZE):
        self.size = size
        self.entries: OrderedDict[tuple[str, str, str], NodeCosts] = OrderedDict()

    @staticmethod
    def key(gm: fx.GraphModule, device: torch.device) -> tuple[str, str, str]:
        fp = fingerprint(gm)
        names = hashlib.sha256("\n".join(row[0] for row in fp["nodes"]).encode()).hexdigest()
        return fp["hash"], names, str(device)

    def get(self, key: tuple[str, str, str]) -> NodeCosts | None:
        costs = self.entries.get(key)
        if costs is not None:
            self.entries.move_to_end(key)
        return costs

    def put(self, key: tuple[str, str, str], costs: NodeCosts) -> None:
        self.entries[key] = costs
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
