"""optsched: fit a PyTorch training step into a device-memory budget at the least cost in time."""

from .api import optimize
from .budget import parse_budget
from .costs import PROFILES, DeviceProfile
from .plan import SUMMARY_KEYS, Plan
from .solvers import BudgetInfeasibleError

__version__ = "0.1.0"
__all__ = ["BudgetInfeasibleError", "DeviceProfile", "PROFILES", "Plan", "SUMMARY_KEYS", "optimize", "parse_budget"]
