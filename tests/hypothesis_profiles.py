"""Hypothesis profiles, so that `make test` stays short and `make test-all` runs every property in full.

`quick` (the default): each property at most QUICK_EXAMPLES examples. `full` (`make test-all`): the count each
test declares. `long`: full, and tests/test_fuzz.py draws 10x its examples at random. Chosen by
HYPOTHESIS_PROFILE=NAME or `pytest --hypothesis-profile=NAME`; tests/conftest.py loads the default.
"""

from __future__ import annotations

from hypothesis import settings

QUICK = "quick"
QUICK_EXAMPLES = 25  # the count test_solvers.py and test_fuzz.py have always run by default: unchanged there

settings.register_profile(QUICK, max_examples=QUICK_EXAMPLES)
settings.register_profile("full")  # hypothesis' own defaults, and each test's declared count
settings.register_profile("long")


def examples(full: int) -> int:
    """A test's example count: `full` under the full profiles, at most QUICK_EXAMPLES under quick (read when the
    test module is imported, after pytest has loaded the profile)."""
    return min(full, QUICK_EXAMPLES) if settings.get_current_profile_name() == QUICK else full
