"""optsched: fit a PyTorch training step into a device-memory budget at the least cost in time."""

from .api import optimize
from .offline import plan_offline
from .budget import parse_budget
from .costs import PROFILES, DeviceProfile
from .plan import SUMMARY_KEYS, Plan
from .plan_file import PlanFile, PlanFileError, PlanMismatchError, load_plan
from .solvers import BudgetInfeasibleError

__version__ = "0.1.0"
__all__ = [
    "PROFILES",
    "SUMMARY_KEYS",
    "BudgetInfeasibleError",
    "DeviceProfile",
    "Plan",
    "PlanFile",
    "PlanFileError",
    "PlanMismatchError",
    "load_plan",
    "optimize",
    "parse_budget",
    "plan_offline",
]
