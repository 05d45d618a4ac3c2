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
    from .capture.errors import CaptureError
    from .costs.profiles import PROFILES, DeviceProfile
    from .compiler.offline import plan_offline
    from .capture.output_usage import OutputUsageWarning
    from .plans.plan import SUMMARY_KEYS, Plan
    from .plans.file_format import PlanCacheWarning, PlanFile, PlanFileError, PlanFileWarning, PlanMismatchError, load_plan
    from .solvers import BudgetInfeasibleError, PlanningTimeLimitError

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {
    "optimize": "api",
    "plan_offline": "compiler.offline",
    "parse_budget": "budget",
    "CaptureError": "capture.errors",
    "PROFILES": "costs.profiles",
    "DeviceProfile": "costs.profiles",
    "SUMMARY_KEYS": "plans.plan",
    "Plan": "plans.plan",
    "PlanFile": "plans.file_format",
    "PlanFileError": "plans.file_format",
    "PlanMismatchError": "plans.file_format",
    "PlanFileWarning": "plans.file_format",
    "PlanCacheWarning": "plans.file_format",
    "load_plan": "plans.file_format",
    "OutputUsageWarning": "capture.output_usage",
    "BudgetInfeasibleError": "solvers",
    "PlanningTimeLimitError": "solvers",
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
    "PlanningTimeLimitError",
    "OutputUsageWarning",
    "load_plan",
    "optimize",
    "parse_budget",
    "plan_offline",
]


def __getattr__(name: str):
    if name == "distributed":  # optsched.distributed: one plan for every rank (DDP, FSDP2)
        return _importlib.import_module(".distributed", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
