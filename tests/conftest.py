"""Shared test setup.

The tests import `tests.models` and `benchmarks.models`, which live in the repository, not
in the installed package: put the repository root on sys.path so that `pytest` works from
any directory and through the `pytest` script as well as `python -m pytest`.

`make test` runs two workers (pytest-xdist, `--dist loadgroup`). Tests that share something made once per
process (a module fixture, a module's cache of runs) carry one `pytest.mark.xdist_group`, so that one worker
runs them all and makes it once; under plain `load` both workers made it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

# One intra-op thread per test process, set before torch is imported (subprocesses inherit it): `make test` runs two
# workers on two cores, and each worker's second OpenMP thread spins waiting for the core the other worker holds
# (tests/test_chunking.py: 59 s of CPU with two threads, 29 s with one; optsched/costs/measure.py says why).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Op times stay in each test process: the user's op-time file (costs/op_cache.py, on by default) would carry times
# from one run of the suite, or from the user's own planning, into the next. Tests of the file name their own.
os.environ.setdefault("OPTSCHED_OP_TIMES", "off")

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.hypothesis_profiles import QUICK  # noqa: E402  (registers the profiles)

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", QUICK))  # --hypothesis-profile=NAME overrides it

# torch's structured-trace logger emits empty DEBUG records on every compilation, and pytest's
# log capture attaches to it: hundreds of blank lines under each failing test that compiles.
# They only matter when TORCH_TRACE asks for a trace, so drop them otherwise.
if not os.environ.get("TORCH_TRACE"):
    logging.getLogger("torch.__trace").addFilter(lambda record: False)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """pytest-xdist (3.8) groups `--dist loadgroup` tests by a '@group' suffix it writes to `item._nodeid`, which
    pytest 9 no longer reads (a node's id lives in `item._id`): every group was ignored, and both workers made what
    a group shares (the accumulation loop ran twice, 15 s each). Written where pytest reads it; a no-op under
    pytest 8, where `_nodeid` is the id."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        suffixed = item.__dict__.get("_nodeid")
        if suffixed and item.nodeid != suffixed:
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(suffixed)
