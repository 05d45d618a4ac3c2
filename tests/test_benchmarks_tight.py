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
    (row,) = case["rows"]
    assert row.get("infeasible") or "predicted_peak_bytes" in row, row
    assert "error" not in row, row
    low = case["lowest"]
    assert len(low["probes"]) <= 1
    if not low.get("none_found"):
        assert low["lowest_peak_bytes"] >= low["bound_bytes"]
        assert low["run"]["max_grad_diff"] == 0
    stored = json.loads(out.read_text())
    assert list(stored["runs"]) == ["t"]
    assert "nn.TransformerEncoder" in report.tight_tables(stored)
