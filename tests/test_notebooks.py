"""The notebooks (notebooks/*.ipynb) run clean at their small size, through the same runner `make notebooks` uses,
and the copies in the repository keep the outputs and plots of a full run. A notebook whose table disagrees
with the benchmarks' JSON fails its own assertion cell, and so this test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXPECTED = ["1_seed_functions.ipynb", "2_gpt.ipynb", "3_random_dags.ipynb", "4_scaling.ipynb"]


def runner():
    spec = importlib.util.spec_from_file_location("notebook_runner", NOTEBOOKS / "execute.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_four_notebooks_are_there_and_described():
    assert [p.name for p in runner().notebooks()] == EXPECTED
    readme = (NOTEBOOKS / "README.md").read_text()
    assert all(name in readme for name in EXPECTED)
    assert "make notebooks" in readme and "OPTSCHED_NOTEBOOK_SIZE" in readme


@pytest.mark.parametrize("name", EXPECTED)
def test_the_committed_notebook_keeps_a_full_run(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "OPTSCHED_NOTEBOOK_SIZE" in code[0].source  # the size is read in the first cell
    assert all(c.execution_count is not None for c in code), "a cell was never run"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot kept"
    first = "".join(o.get("text", "") for o in code[0].outputs)
    assert "full" in first, "the committed copy is not the full-size run"


@pytest.mark.parametrize("name", EXPECTED)
def test_runs_clean_at_small_size(name, tmp_path):
    out = runner().execute(NOTEBOOKS / name, size="small", out=tmp_path / name, timeout_s=600)
    nb = nbformat.read(out, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert "small" in "".join(o.get("text", "") for o in nb.cells[1].outputs)
