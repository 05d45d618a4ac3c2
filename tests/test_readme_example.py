"""README.md's first ```python block, run as a user pastes it after `make setup`: the repository's venv python, a
fresh interpreter in an empty folder, no PYTHONPATH, nothing defined beforehand (the first example once used a
model, x and y it never defined). It must exit 0 and print a training plan within its budget, then its summary."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"  # what `make setup` makes
PLAN_LINE = re.compile(r"Plan\(training, peak ([\d.]+) MiB \(unplanned ([\d.]+), budget ([\d.]+) MiB\), time x[\d.]+, "
                       r"(OPTIMAL|FEASIBLE|HEURISTIC), gap [\d.]+%\)")


def first_example(markdown: str) -> str:
    """The first fenced ```python block's code."""
    match = re.search(r"^```python\n(.*?)^```", markdown, re.S | re.M)
    assert match, "no ```python block"
    return match.group(1)


def run_pasted(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a new interpreter outside the repository, seeing only what the venv installed."""
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the timeout only stops a hang: the example takes seconds, longer on a loaded machine
    return subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def check_prints_a_plan(run: subprocess.CompletedProcess[str]) -> None:
    """Exit 0; the last two lines are a training plan whose peak is within its budget, below the unplanned peak,
    and its summary() with every key optsched.SUMMARY_KEYS names."""
    from optsched import SUMMARY_KEYS

    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) >= 2, run.stdout
    plan = PLAN_LINE.fullmatch(lines[-2])
    assert plan, lines[-2]
    peak, unplanned, budget = (float(g) for g in plan.groups()[:3])
    assert peak <= budget < unplanned
    try:
        summary = ast.literal_eval(lines[-1])
    except (ValueError, SyntaxError):
        raise AssertionError(f"not a summary dict: {lines[-1][:200]}") from None
    assert isinstance(summary, dict), lines[-1][:200]
    assert set(summary) == set(SUMMARY_KEYS)
    assert summary["predicted_peak_bytes"] <= summary["budget_bytes"]


def test_the_readmes_first_example_runs_as_pasted_and_prints_its_plan(tmp_path):
    check_prints_a_plan(run_pasted(first_example((ROOT / "README.md").read_text()), tmp_path))


@pytest.mark.parametrize("code", [
    "print(model.plan)\n",  # a name the example never defined
    "print('Plan(training, peak 1.00 MiB (unplanned 2.00, budget 0.50 MiB), time x1.000, OPTIMAL, gap 0.00%)')\n"
    "print({})\n",  # a plan over its budget, an empty summary
])
def test_the_check_fails_a_broken_example(tmp_path, code):
    with pytest.raises(AssertionError):
        check_prints_a_plan(run_pasted(code, tmp_path))
