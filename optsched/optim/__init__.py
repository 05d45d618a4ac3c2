"""The optimizer's side of a training step: updates applied inside the backward, the state's bytes (issue 36)."""

from .in_graph import OverBudgetWarning
from .updates import SUPPORTED, InBackwardUpdates, check_supported, describe, in_backward, state_bytes, state_sizes

__all__ = ["SUPPORTED", "OverBudgetWarning", "InBackwardUpdates", "check_supported", "describe", "in_backward", "state_bytes",
           "state_sizes"]
