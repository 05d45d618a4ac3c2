"""Two fresh processes plan the tight-budget benchmark's GPT alike (issue 34, "What it must show" 4).

Runs ``benchmarks.tight_budgets --parts gpt`` twice, each in a fresh process with its own results file (so the
second cannot start from the first's plans), with optsched's default settings: ``$OPTSCHED_OP_TIMES`` unset, so both
use the default op-time file, in a cache directory of their own (``$XDG_CACHE_HOME``, empty at the start): the first
measures op times and writes them, the second reads them. Deterministic planning on equal costs must then give equal
plans: every budget's outcome (predicted peak, or the lowest peak an infeasible search found) and each lowest
feasible peak are compared. With the file off (``OPTSCHED_OP_TIMES=off``), measured times differ between processes
by more than rounding hides (costs/op_cache.py), and so may the plans.

    python -m benchmarks.two_processes          # about 15 min on the 2-core machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.meta import with_meta

RESULTS_JSON = Path(__file__).parent / "results" / "two_processes.json"


def outcomes(run: dict) -> dict[str, int | None]:
    """Per budget and offload setting, the peak that run planned (or the lowest an infeasible search found), and
    each lowest feasible peak."""
    gpt = run["gpt"]
    out: dict[str, int | None] = {}
    for r in gpt["rows"]:
        key = f"offload={'yes' if r['offload'] else 'no'} {r['fraction']:.0%}"
        out[key] = r.get("predicted_peak_bytes") or r.get("lowest_peak_bytes")
    for low in gpt["lowest"]:  # the search's own answer: a budget's plan counts too, not only its probes' (a
        # probe-only minimum read None where the 40% plan was the lowest and every probe below it missed)
        out[f"offload={'yes' if low['offload'] else 'no'} lowest feasible"] = low.get("lowest_peak_bytes")
    return out


def run_once(i: int, folder: Path, probes: int) -> dict:
    json_path = folder / f"run{i}.json"
    cmd = [sys.executable, "-m", "benchmarks.tight_budgets", "--label", f"process-{i}", "--parts", "gpt", "--repeat", "0",
           "--probes", str(probes), "--json", str(json_path)]
    env = {k: v for k, v in os.environ.items() if k != "OPTSCHED_OP_TIMES"}
    env["XDG_CACHE_HOME"] = str(folder / "cache")
    subprocess.run(cmd, check=True, cwd=Path(__file__).parents[1], env=env)
    return json.loads(json_path.read_text())["runs"][f"process-{i}"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--json", type=Path, default=RESULTS_JSON)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runs = [run_once(i, folder, args.probes) for i in (1, 2)]
        op_times = folder / "cache" / "optsched" / "op_times.json"
        assert op_times.exists(), f"the default op-time file was not written at {op_times}"
    first, second = outcomes(runs[0]), outcomes(runs[1])
    rows = [{"case": k, "first": first[k], "second": second.get(k), "equal": first[k] == second.get(k)} for k in first]
    out = {"op_times": "default", "rows": rows, "all_equal": all(r["equal"] for r in rows), "probes": args.probes,
           "plan_s": [run["gpt"].get("total_s") for run in runs]}
    for r in rows:
        print(f"{r['case']:32s} {r['first']} {r['second']} {'equal' if r['equal'] else 'DIFFERENT'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(with_meta(out), indent=1))
    return out


if __name__ == "__main__":
    main()
