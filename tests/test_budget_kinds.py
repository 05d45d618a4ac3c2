"""Budgets as kinds (issue 35): what `FixedBytes`, `AutoBytes` and `ShareOfPeak` answer for each program, the
`BudgetResolution` façade over them (dicts where the planner and plan files read records, old pickles), and
every bad option of optimize() refused at optimize(), before any call."""

from __future__ import annotations

import pickle

import pytest
import torch

import optsched
from optsched import parse_budget
from optsched.budget import (
    AUTO_SOURCE, LARGER_TRAINING_PROGRAM, LARGEST_TRAINING_PROGRAM, SAME_SHAPES, THIS_PROGRAM, AutoBytes,
    BudgetResolution, DeviceMemory, FixedBytes, PeakRecord, ShareOfPeak, auto_budget, budget_kind,
)
from optsched.settings import PlanningSettings

MIB, GIB = 2**20, 2**30


def test_each_form_of_budget_is_its_kind():
    assert budget_kind(parse_budget("12GB")) == FixedBytes(12 * 10**9)
    assert budget_kind(parse_budget(None)) == FixedBytes(None)
    assert budget_kind(parse_budget("auto", auto=True)) == AutoBytes()
    share = budget_kind(parse_budget("60%"))
    assert isinstance(share, ShareOfPeak) and share.trained == {} and share.largest is None
    assert BudgetResolution(parse_budget("60%")).is_percentage
    assert not BudgetResolution(parse_budget("12GB")).is_percentage


@pytest.mark.parametrize("nbytes", [12 * 10**9, None])
def test_fixed_bytes_are_every_programs_and_lend_nothing(nbytes):
    kind = FixedBytes(nbytes)
    for training, shapes in [(True, "a"), (False, "a"), (False, None)]:
        assert kind.bytes_for(5 * GIB, training, shapes) == kind.fixed_bytes(training, shapes) == nbytes
        assert kind.source(5 * GIB, "fp", training, shapes) is None
        assert kind.made_for(training, shapes) == {}  # the spec is the bytes
        assert kind.explain(5 * GIB, training, shapes) is None
        assert kind.lender(training, shapes) is None
    kind.record_training(PeakRecord(3 * GIB, 5 * GIB, "fp"), "a")  # nothing to remember
    assert kind.lend_larger(1, 2, True) is None and kind.explain_below_bound(1, 2, True) is None
    assert kind.largest is None and not kind.needs_device and kind.copy() == kind


def _auto() -> AutoBytes:
    memory = DeviceMemory("cuda:0", total=80 * GIB, free=50 * GIB, reserved=10 * GIB, allocated=6 * GIB)
    detail = auto_budget(memory, 2 * GIB)
    return AutoBytes(detail["bytes"], detail)


def test_auto_bytes_are_unknown_until_resolved_then_every_programs():
    unresolved = AutoBytes()
    assert unresolved.needs_device and unresolved.fixed_bytes(True, "a") is None
    with pytest.raises(RuntimeError, match="not resolved before planning"):
        unresolved.bytes_for(GIB, True, "a")

    kind = _auto()
    n = kind.nbytes
    assert not kind.needs_device and n == (2 * GIB + 54 * GIB - 4 * GIB) // (64 * MIB) * (64 * MIB)
    for training, shapes in [(True, "a"), (False, "b"), (True, None)]:
        assert kind.bytes_for(GIB, training, shapes) == kind.fixed_bytes(training, shapes) == n
        assert kind.made_for(training, shapes) == {"budget_resolved_bytes": n}
        assert kind.lender(training, shapes) is None
    source = kind.source(GIB, "fp", True, "a")
    assert (source["program"], source["bytes"], source["unplanned_peak_bytes"]) == (AUTO_SOURCE, n, GIB)
    assert source["auto"] == kind.detail and source["auto"] is not kind.detail  # the plan gets its own copy
    text = kind.explain(GIB, True, "a")
    assert "'auto' was resolved at the first call on cuda:0" in text and f"= {n / MIB:.0f} MiB" in text
    copied = kind.copy()
    copied.detail["bytes"] = 0  # a copy's figures are its own
    assert kind.detail["bytes"] == n and copied.nbytes == n


def test_a_share_of_peak_answers_per_program_and_lends_the_largest():
    kind = budget_kind(parse_budget("60%"))
    assert kind.bytes_for(1000, True, "a") == 600 and kind.fixed_bytes(True, "a") is None
    assert kind.bytes_for(700, False, "a") == 420  # forward-only, nothing trained yet: its own share
    assert kind.made_for(False, "a") == {"budget_from": THIS_PROGRAM}
    assert kind.source(1000, "fp", True, "a") == {
        "program": THIS_PROGRAM, "unplanned_peak_bytes": 1000, "fingerprint": "fp", "bytes": 600}
    assert "no training program was planned before it" in kind.explain(700, False, "a")

    small, large = PeakRecord(600, 1000, "fp-a"), PeakRecord(3000, 5000, "fp-b")
    kind.record_training(small, "a")
    kind.record_training(large, "b")
    kind.record_training(PeakRecord(300, 500, "fp-a-small"), "a")  # fewer bytes for the same shapes: not kept
    assert kind.trained == {"a": small, "b": large} and kind.largest == large
    assert kind.lender(False, "a") == (SAME_SHAPES, small) and kind.fixed_bytes(False, "a") == 600
    assert kind.lender(False, "z") == (LARGEST_TRAINING_PROGRAM, large) and kind.bytes_for(1, False, None) == 3000
    assert kind.made_for(False, "z") == {"budget_resolved_bytes": 3000}
    assert kind.source(1, "fp-eval", False, "a") == {"program": SAME_SHAPES, **small.as_dict()}
    assert kind.bytes_for(700, True, "z") == 420  # a training program: its own share, whatever was trained

    # a training program whose share (420) is below its bound takes the largest's bytes when they reach it
    assert kind.lend_larger(420, 2000, True) == large and kind.explain_below_bound(420, 2000, True) is not None
    assert LARGER_TRAINING_PROGRAM in kind.explain_lent(large, 420, 2000, 700)
    assert kind.lend_larger(420, 4000, True) is None  # the largest's are below the bound too
    assert "are below this bound too" in kind.explain_below_bound(420, 4000, True)
    assert kind.lend_larger(420, 400, True) is None and kind.lend_larger(420, 2000, False) is None
    fresh = budget_kind(parse_budget("60%"))
    assert "no larger training program" in fresh.explain_below_bound(420, 2000, True)

    copied = kind.copy()
    copied.record_training(PeakRecord(9000, 15000, "fp-c"), "c")  # a copy's programs are its own
    assert "c" not in kind.trained and kind.largest == large and copied.largest.nbytes == 9000


def test_the_facade_gives_the_planner_and_plan_files_dicts():
    r = BudgetResolution(parse_budget("60%"))
    r.for_shapes("b").record_training(3000, 5000, "fp-b")
    assert r.largest == {"bytes": 3000, "unplanned_peak_bytes": 5000, "fingerprint": "fp-b"}
    lent = r.lend_larger(420, 2000)
    assert lent == r.largest
    assert "the bytes 60% gave a larger training program" in r.explain_lent(lent, 420, 2000, 700)
    assert list(r.source(1, training=False)) == ["program", "unplanned_peak_bytes", "fingerprint", "bytes"]
    assert BudgetResolution(parse_budget("1GB")).largest is None


def test_a_resolution_pickled_before_kinds_loads_as_its_kind():
    """Pickles made between issue 24 and the kinds held the state in the resolution, records as dicts."""
    old = object.__new__(BudgetResolution)
    old.__dict__.update(budget=parse_budget("60%"), nbytes=None, auto=None,
                        trained={"a": {"bytes": 600, "unplanned_peak_bytes": 1000, "fingerprint": "fp-a"}},
                        largest={"bytes": 600, "unplanned_peak_bytes": 1000, "fingerprint": "fp-a"})
    r = pickle.loads(pickle.dumps(old))
    assert r.kind == ShareOfPeak(parse_budget("60%"), {"a": PeakRecord(600, 1000, "fp-a")}, PeakRecord(600, 1000, "fp-a"))
    auto = object.__new__(BudgetResolution)
    auto.__dict__.update(budget=parse_budget("auto", auto=True), nbytes=4 * GIB, auto={"bytes": 4 * GIB})
    assert pickle.loads(pickle.dumps(auto)).kind == AutoBytes(4 * GIB, {"bytes": 4 * GIB})
    assert pickle.loads(pickle.dumps(r)).kind == r.kind  # and today's pickles


# ---------------------------------------------------------------------------------------------
# every option checked at optimize(), not at the first call


from tests.test_budget import _Calls  # noqa: E402  (a step that counts its calls: refused before it runs)


BAD_OPTIONS = [
    ("chunking", "bad", "chunking must be"),
    ("chunking", 0, "chunking must be"),
    ("chunking", 2.5, "chunking must be"),
    ("device_profile", "tpu-v9", "unknown device profile 'tpu-v9'; known: a100"),
    ("progress", "yes", "progress must be True or False"),
    ("deterministic", 1, "deterministic must be"),
    ("on_mismatch", "ignore", "on_mismatch must be"),
    ("plan", 3, "plan must be a path"),
    ("executor", "triton", "unknown executor"),
    ("time_limit_s", 0, "time_limit_s must be"),
    ("offload", "yes", "offload must be"),
]


@pytest.mark.parametrize("name, value, message", BAD_OPTIONS)
def test_a_bad_option_is_refused_at_optimize_before_any_call(name, value, message):
    f = _Calls()
    with pytest.raises(ValueError, match=message):
        optsched.optimize(f, **{name: value})
    with pytest.raises(ValueError, match=message):
        optsched.optimize(torch.nn.Linear(2, 2), **{name: value})
    assert f.n == 0


@pytest.mark.parametrize("name, value, message", BAD_OPTIONS)
def test_settings_cannot_be_built_with_a_bad_option(name, value, message):
    with pytest.raises(ValueError, match=message):
        PlanningSettings(parse_budget(None), **{name: value})


@pytest.mark.parametrize("chunking", [None, False, True, "auto", 1, 4, 64])
def test_every_chunking_setting_is_accepted(chunking):
    settings = PlanningSettings(parse_budget(None), chunking=chunking)
    assert settings.chunk_when_needed == (chunking == "auto")
