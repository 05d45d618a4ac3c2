"""benchmarks/tight_budgets.py end to end on the smallest zoo case (test size), written to a temporary file."""

from __future__ import annotations

import json

from benchmarks import report, tight_budgets


def test_tight_budgets_harness_on_smallest_case(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTSCHED_ZOO_SIZE", "test")
    out = tmp_path / "tight.json"
    run = tight_budgets.main(["--label", "t", "--parts", "zoo", "--cases", "transformer-encoder", "--size", "test",
                              "--zoo-budgets", "0.6", "--probes", "1", "--repeat", "0", "--json", str(out)])
    case = run["zoo"]["cases"][0]
    assert "error" not in case, case
    eager = case["eager"]["measured_peak_bytes"]
    (row,) = case["rows"]
    assert "error" not in row, row
    # at this size 60% is out of reach, provably (every plan needs about 3.68 MiB, 73% of eager's 5.01): the row
    # says so, with the lowest peak the search found between the bound and eager's peak
    assert row.get("infeasible") and "predicted_peak_bytes" not in row, row
    assert row["budget_bytes"] < row["lower_bound_bytes"] <= row["lowest_peak_bytes"] < eager, row
    # the one probe asks for exactly that lowest peak, and gets a plan there (the search finds it again by itself:
    # nothing is remembered between solves), run within it with eager's gradients
    low = case["lowest"]
    (probe,) = low["probes"]
    assert probe["budget_bytes"] == row["lowest_peak_bytes"] and probe["why"] == "infeasible error's lowest peak", probe
    assert not low.get("none_found"), low
    assert low["bound_bytes"] == row["lower_bound_bytes"]
    assert low["bound_bytes"] <= low["lowest_peak_bytes"] <= probe["budget_bytes"], low
    assert low["run"]["within_budget"] and low["run"]["measured_peak_bytes"] <= probe["budget_bytes"], low["run"]
    assert low["run"]["max_grad_diff"] == 0, low["run"]
    stored = json.loads(out.read_text())
    assert list(stored["runs"]) == ["t"]
    assert "nn.TransformerEncoder" in report.tight_tables(stored)
