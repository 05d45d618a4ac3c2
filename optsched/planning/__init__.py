"""Planning a captured program: `Planner` (planner.py) over one module per job: replay.py (plan files and carried
plans), variants.py (candidate graphs: as captured and per chunk count), floors.py (bounds proven before any op is
timed), fusion.py (fusion groups), solving.py (one solve at the program's budget, and the bytes other programs lend
it), op_costs.py (measured op costs), timing.py (the time limit and its account), errors.py (what the planner's
errors add), program.py (`ProgramKind`, `Target`, `Planned`)."""

from .planner import Planner
from .program import Planned, ProgramKind, Target

__all__ = ["Planned", "Planner", "ProgramKind", "Target"]
