"""optsched: fit a PyTorch training step into a device-memory budget at the least cost in time.

The public names load on first use (PEP 562): `import optsched` is cheap, and only the names
that need torch (`optimize`, `plan_offline`, ...) import it. `optsched show PLAN.json` and the
other plan-file commands never do.
"""

import importlib as _importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .api import optimize
    from .budget import parse_budget
    from .capture_errors import CaptureError
    from .costs import PROFILES, DeviceProfile
    from .offline import plan_offline
    from .output_usage import OutputUsageWarning
    from .plan import SUMMARY_KEYS, Plan
    from .plan_file import PlanCacheWarning, PlanFile, PlanFileError, PlanFileWarning, PlanMismatchError, load_plan
    from .solvers import BudgetInfeasibleError

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {
    "optimize": "api",
    "plan_offline": "offline",
    "parse_budget": "budget",
    "CaptureError": "capture_errors",
    "PROFILES": "costs",
    "DeviceProfile": "costs",
    "SUMMARY_KEYS": "plan",
    "Plan": "plan",
    "PlanFile": "plan_file",
    "PlanFileError": "plan_file",
    "PlanMismatchError": "plan_file",
    "PlanFileWarning": "plan_file",
    "PlanCacheWarning": "plan_file",
    "load_plan": "plan_file",
    "OutputUsageWarning": "output_usage",
    "BudgetInfeasibleError": "solvers",
}

__all__ = [
    "PROFILES",
    "SUMMARY_KEYS",
    "BudgetInfeasibleError",
    "CaptureError",
    "DeviceProfile",
    "Plan",
    "PlanFile",
    "PlanFileError",
    "PlanMismatchError",
    "PlanFileWarning",
    "PlanCacheWarning",
    "OutputUsageWarning",
    "load_plan",
    "optimize",
    "parse_budget",
    "plan_offline",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
