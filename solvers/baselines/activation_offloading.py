"""Offload everything saved: torchtune's activation offloading (`OffloadActivations`, saved tensors
hooks that copy every saved activation to the host and back for the backward), a budget-blind policy.

The plan is `search.offload.offload_all`: program order, every offloadable saved activation copied out
as it is made and prefetched one copy time ahead of its first backward reader (within the host budget,
in the order they are made). With no host link (`problem.host_bw == 0`) nothing moves.
"""

from __future__ import annotations

from ..model.problem import Problem, Schedule
from ..search import offload


def offload_all(problem: Problem, budget_bytes: int | None = None) -> Schedule:
    """Every saved activation to the host; the budget is ignored."""
    return offload.offload_all(problem)
