"""`parse_budget` and the argument checks `optimize` does before anything is compiled."""

from __future__ import annotations

import math

import pytest

import optsched
from optsched import parse_budget

# what every rejection message must mention, so a user can see the accepted forms
ACCEPTED_FORMS = ("bytes", "'12GB'", "'512MiB'", "'1.5 GiB'", "'60%'", "None")


@pytest.mark.parametrize(
    "spec, nbytes",
    [
        (1, 1),
        (2_000_000_000, 2_000_000_000),
        ("12GB", 12 * 10**9),
        ("12gb", 12 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("  64 KiB ", 64 * 1024),
        ("3kb", 3000),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("4096", 4096),
        ("100B", 100),
        ("0.5KiB", 512),
        (".5 MiB", 2**19),
        (2048.0, 2048),
        (1e9, 10**9),
    ],
)
def test_absolute_budgets(spec, nbytes):
    b = parse_budget(spec)
    assert b.nbytes == nbytes and isinstance(b.nbytes, int)
    assert b.fraction is None
    assert b.resolve(123_456_789) == nbytes  # absolute: the unplanned peak does not matter


def test_float_budget_is_exact_for_large_whole_numbers():
    assert parse_budget(float(2**40)).nbytes == 2**40


@pytest.mark.parametrize(
    "spec, fraction, resolved",
    [("60%", 0.6, 600), ("100%", 1.0, 1000), (" 12.5 % ", 0.125, 125), ("150%", 1.5, 1500), ("0.1%", 0.001, 1)],
)
def test_percentage_budgets(spec, fraction, resolved):
    b = parse_budget(spec)
    assert b.nbytes is None
    assert b.fraction == pytest.approx(fraction)
    assert b.resolve(1000) == resolved


def test_percentage_resolves_to_whole_bytes_rounding_down():
    assert parse_budget("60%").resolve(1001) == 600


def test_none_means_no_budget():
    b = parse_budget(None)
    assert b.nbytes is None and b.fraction is None
    assert b.resolve(10**9) is None
    assert str(b) == "none"


@pytest.mark.parametrize(
    "spec",
    [
        True,
        False,
        0,
        -1,
        -(2**40),
        0.0,
        -5.0,
        1.5,
        math.nan,
        math.inf,
        "12 parsecs",
        "abc",
        "",
        "   ",
        "-5%",
        "0%",
        "0.0%",
        "-12GB",
        "0GB",
        "0.1B",  # rounds to zero bytes
        "12 G B",
        "12GB!",
        "%",
        "60%%",
        [1],
        [],
        (12, "GB"),
        {"bytes": 12},
        b"12GB",
        object(),
    ],
)
def test_rejected_budgets_name_the_accepted_forms(spec):
    with pytest.raises(ValueError) as info:
        parse_budget(spec)
    msg = str(info.value)
    for form in ACCEPTED_FORMS:
        assert form in msg, (form, msg)


def test_unknown_unit_is_named_in_the_message():
    with pytest.raises(ValueError, match="parsecs"):
        parse_budget("12 parsecs")


class _Calls:
    """A function that counts its calls: `optimize` must reject bad arguments before running it."""

    def __init__(self):
        self.n = 0

    def __call__(self, x):
        self.n += 1
        return x * 2


@pytest.mark.parametrize("budget", ["nonsense", "-5%", True, 0, [1], "12 parsecs"])
def test_optimize_rejects_a_bad_budget_immediately(budget):
    f = _Calls()
    with pytest.raises(ValueError, match="12GB"):
        optsched.optimize(f, budget)
    assert f.n == 0


def test_optimize_rejects_a_bad_budget_even_with_example_inputs():
    f = _Calls()
    with pytest.raises(ValueError):
        optsched.optimize(f, "nonsense", example_inputs=(1.0,))
    assert f.n == 0


@pytest.mark.parametrize("limit", [0, -1, -0.5, math.nan, "5", "5s", [5]])
def test_optimize_rejects_a_bad_time_limit(limit):
    f = _Calls()
    with pytest.raises(ValueError, match="time_limit_s"):
        optsched.optimize(f, None, time_limit_s=limit)
    assert f.n == 0


def test_optimize_rejects_a_bool_time_limit():
    # parse_budget refuses bools on purpose; `time_limit_s=True` should not quietly mean 1 s
    with pytest.raises(ValueError, match="time_limit_s"):
        optsched.optimize(_Calls(), None, time_limit_s=True)


@pytest.mark.parametrize("limit", [0.5, 2, 10.0])
def test_optimize_accepts_positive_time_limits(limit):
    f = _Calls()
    opt = optsched.optimize(f, "60%", time_limit_s=limit)
    assert callable(opt) and opt.plan is None
    assert f.n == 0  # nothing runs until the first call


def test_optimize_rejects_non_callables():
    with pytest.raises(TypeError):
        optsched.optimize(42)
