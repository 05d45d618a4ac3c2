"""Shared test setup.

The tests import `tests.models` and `benchmarks.models`, which live in the repository, not
in the installed package: put the repository root on sys.path so that `pytest` works from
any directory and through the `pytest` script as well as `python -m pytest`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# torch's structured-trace logger emits empty DEBUG records on every compilation, and pytest's
# log capture attaches to it: hundreds of blank lines under each failing test that compiles.
# They only matter when TORCH_TRACE asks for a trace, so drop them otherwise.
if not os.environ.get("TORCH_TRACE"):
    logging.getLogger("torch.__trace").addFilter(lambda record: False)
