"""Planning time against depth for a Llama-7B-shaped model under fake tensors (issue 14, "What it must show" 3).

LitGPT-style LLaMA (benchmarks/models/llama.py) with Llama-7B's layer: width 4096, 32 heads, SwiGLU
11008, vocabulary 32000, bf16 parameters; batch 4 x sequence 4096 (16k tokens, so activations outweigh
parameters and gradients and a budget below the unplanned peak has room to act). Each depth is
captured and planned with ``optsched.compiler.offline.plan_offline`` for the h100 profile (roofline
times, offloads allowed as on a GPU) at 60% and 40% of its unplanned peak, nothing allocated. Per plan:
plan seconds, ops, status, gap, predicted peak / unplanned, the lower bound, or the
``BudgetInfeasibleError`` figures.

Every plan runs in a child process with a wall-clock limit (``--timeout``, default 300 s): a plan
over it is recorded as timed out, with the time, and that depth's other budgets are skipped. Then
the seconds per layer: planning time is "roughly linear in depth" when the seconds per layer at the
deepest depth are within 1.5x of those at the shallowest (and the least-squares fit is printed).

Results go to benchmarks/results/scaling_llama.json under ``runs[label]`` (``--label``, default the
git short hash), rows merged by (layers, budget), for ``python -m benchmarks.report``.

    python -m benchmarks.scaling_llama --label before                  # 8, 16, 32 layers
    python -m benchmarks.scaling_llama --label before --depths 80 --timeout 300
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.meta import run_meta

MIB, GIB = 2**20, 2**30
ROOT = Path(__file__).resolve().parent.parent
RESULTS_JSON = Path(__file__).parent / "results" / "scaling_llama.json"
MODEL = dict(name="llama-7b", block_size=4096, vocab_size=32000, padding_multiple=64, n_head=32, n_embd=4096,
             intermediate_size=11008, norm_eps=1e-5, bias=False, rope_condense_ratio=1)
LINEAR_TOLERANCE = 1.5  # s/layer at the deepest depth within this factor of the shallowest: "roughly linear"


def describe(batch: int, seq: int) -> str:
    return (f"Llama-7B layer (width 4096, 32 heads, SwiGLU 11008, vocab 32000, bf16), batch {batch} x sequence {seq}, "
            "fake tensors, h100 profile")


def plan_child(layers: int, fraction: float, batch: int, seq: int, time_limit_s: float | None) -> dict:
    """One plan, in this (child) process."""
    import torch

    import optsched
    from benchmarks.models import llama
    from benchmarks.planning_time import PlanningAccounts
    from optsched.compiler.offline import plan_offline

    cfg = llama.Config(**MODEL, n_layer=layers)
    timings: dict = {}
    row: dict = {"layers": layers, "fraction": fraction, "torch": torch.__version__}
    t0 = time.perf_counter()
    try:
        with PlanningAccounts() as accounts:
            plan = plan_offline(lambda: llama.LLaMA(cfg), lambda: llama.make_batch(cfg, batch, seq), f"{fraction:.0%}",
                                device_profile="h100", time_limit_s=time_limit_s, timings=timings)
    except optsched.BudgetInfeasibleError as e:
        row.update(infeasible=True, budget_bytes=e.budget_bytes, lowest_peak_bytes=e.lowest_peak_bytes,
                   lower_bound_bytes=e.lower_bound_bytes, unplanned_peak_bytes=round(e.budget_bytes / fraction))
    else:
        s = plan.summary()
        row.update({k: s[k] for k in ("n_ops", "graph_nodes", "solver_status", "gap", "method", "budget_bytes",
                                      "predicted_peak_bytes", "unplanned_peak_bytes", "lower_bound_bytes", "time_ratio",
                                      "n_recomputed", "n_offloaded", "offloaded_bytes", "solve_time_s")})
    row.update(capture_s=timings.get("capture_s"), plan_s=timings.get("plan_s"), wall_s=time.perf_counter() - t0)
    row["stages"] = stage_seconds(accounts.programs())
    return row


def stage_seconds(programs: list[dict]) -> dict[str, float]:
    """The wall seconds of each planning stage (optsched's `clock.stage`) over `programs` (PlanningAccounts'), and
    "rest": their wall seconds in no stage."""
    out: dict[str, float] = {}
    for p in programs:
        for k, v in p.get("stages", {}).items():
            out[k] = out.get(k, 0.0) + v
    out["rest"] = sum(p["wall_s"] for p in programs) - sum(out.values())
    return out


def run_one(layers: int, fraction: float, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.scaling_llama", "--child", f"{layers}:{fraction}", "--batch", str(args.batch),
           "--seq", str(args.seq)]
    if args.time_limit is not None:
        cmd += ["--time-limit", str(args.time_limit)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "fraction": fraction, "timed_out": True, "wall_s": time.perf_counter() - t0,
                "timeout_s": args.timeout}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"layers": layers, "fraction": fraction, "error": err[:300], "wall_s": time.perf_counter() - t0}
    return json.loads(lines[-1])


def linearity(rows: list[dict]) -> dict:
    """Seconds per layer of the plans that finished, per budget, and a least-squares line plan_s = a + b * layers."""
    out = {}
    for frac in sorted({r["fraction"] for r in rows}, reverse=True):
        done = sorted((r for r in rows if r["fraction"] == frac and r.get("plan_s") is not None), key=lambda r: r["layers"])
        if len(done) < 2:
            continue
        xs, ys = [r["layers"] for r in done], [r["plan_s"] for r in done]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        per_layer = [y / x for x, y in zip(xs, ys)]
        growth = per_layer[-1] / per_layer[0]
        out[f"{frac:.0%}"] = {"layers": xs, "plan_s": ys, "s_per_layer": per_layer, "slope_s_per_layer": b,
                              "intercept_s": my - b * mx, "s_per_layer_growth": growth,
                              "roughly_linear": growth <= LINEAR_TOLERANCE, "n": n}
    return out


def git_state() -> dict:
    """The commit benchmarked and the core files (optsched/, solvers/) that differ from it: work in progress.
    A symlink optsched/solvers -> ../solvers (how a snapshot checkout, e.g. a git worktree, is run
    without the editable install mapping optsched.solvers to another checkout) is not a change."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        # porcelain lines are "XY path"; git() strips the output, so the first line may have lost X's space
        dirty = [line[2:].strip() for line in git("status", "--porcelain", "--", "optsched", "solvers").splitlines()]
        alias = ROOT / "optsched" / "solvers"
        if alias.is_symlink():
            dirty = [f for f in dirty if f.rstrip("/") != "optsched/solvers"]
        return {"commit": git("rev-parse", "HEAD"), "short": git("rev-parse", "--short", "HEAD"),
                "core_changes_uncommitted": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {}


def row_text(r: dict) -> str:
    head = f"{r['layers']:>6} {r['fraction']:>5.0%}"
    if r.get("timed_out"):
        return f"{head}  timed out after {r['wall_s']:.0f} s (limit {r['timeout_s']:.0f} s)"
    if r.get("skipped"):
        return f"{head}  skipped: {r['skipped']}"
    if "error" in r:
        return f"{head}  FAILED: {r['error']}"
    if r.get("infeasible"):
        return (f"{head}  infeasible: lowest {r['lowest_peak_bytes'] / GIB:.2f} GiB, bound {r['lower_bound_bytes'] / GIB:.2f} "
                f"GiB, unplanned {r['unplanned_peak_bytes'] / GIB:.2f} GiB; plan {r['plan_s']:.1f} s "
                f"({r['plan_s'] / r['layers']:.2f} s/layer), capture {r['capture_s']:.1f} s")
    return (f"{head} {r['n_ops']:>6} {r['plan_s']:>7.1f} {r['plan_s'] / r['layers']:>7.2f} {r['solver_status']:>10} "
            f"{r['gap']:>7.2%} {r['predicted_peak_bytes'] / GIB:>7.2f} {r['unplanned_peak_bytes'] / GIB:>7.2f} "
            f"{r['predicted_peak_bytes'] / r['unplanned_peak_bytes']:>6.1%} {r['lower_bound_bytes'] / GIB:>7.2f} "
            f"{r['time_ratio']:>6.3f}x {r['capture_s']:>6.1f}  {r['method']}")


HEADER = (f"{'layers':>6} {'budget':>5} {'ops':>6} {'plan s':>7} {'s/layer':>7} {'status':>10} {'gap':>7} "
          f"{'pred GiB':>7} {'unpl GiB':>7} {'pred/u':>6} {'bound':>7} {'est.t':>7} {'capt s':>6}  method")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default=None, help="key of this run in the results (default: the git short hash)")
    ap.add_argument("--depths", default="8,16,32")
    ap.add_argument("--budgets", default="0.6,0.4", help="fractions of the unplanned peak")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=None, help="planning time limit (default: optsched's)")
    ap.add_argument("--timeout", type=float, default=300.0, help="wall-clock seconds per plan (child process)")
    ap.add_argument("--json", type=Path, default=RESULTS_JSON)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        layers, frac = args.child.split(":")
        print(json.dumps(plan_child(int(layers), float(frac), args.batch, args.seq, args.time_limit)), flush=True)
        return {}
    git = git_state()
    label = args.label or git.get("short") or "unlabelled"
    fractions = [float(f) for f in args.budgets.split(",") if f]
    print(describe(args.batch, args.seq))
    print(HEADER)
    rows = []
    for layers in [int(d) for d in args.depths.split(",") if d]:
        timed_out = None
        for frac in fractions:
            if timed_out is not None:
                r = {"layers": layers, "fraction": frac, "skipped": f"the {timed_out:.0%} plan timed out"}
            else:
                r = run_one(layers, frac, args)
                r["git"] = git_state()  # HEAD may move during a long run: each row says what it ran on
                if r.get("timed_out"):
                    timed_out = frac
            rows.append(r)
            print(row_text(r), flush=True)
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    run = data.setdefault("runs", {}).setdefault(label, {})
    meta = run_meta()
    if (run.get("meta") or run.get("git") or {}).get("commit") != meta["commit"]:
        run.pop("notes", None)  # written by hand for the run at another commit
    merged = {(r["layers"], r["fraction"]): r for r in run.get("rows", [])}
    merged.update({(r["layers"], r["fraction"]): r for r in rows})
    run.update({"label": label, "git": git, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "config": {"model": MODEL, "batch": args.batch, "seq": args.seq, "profile": "h100",
                           "time_limit_s": args.time_limit, "timeout_s": args.timeout, "describe": describe(args.batch, args.seq)},
                "rows": sorted(merged.values(), key=lambda r: (r["layers"], -r["fraction"]))})
    run["linearity"] = linearity(run["rows"])
    run["meta"] = meta
    data = {"meta": meta, **{k: v for k, v in data.items() if k != "meta"}}  # the latest run's, for report --check
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2))
    print(f"wrote {args.json} (label {label!r})")
    for budget, lin in run["linearity"].items():
        print(f"{budget}: s/layer " + ", ".join(f"{x}: {v:.2f}" for x, v in zip(lin["layers"], lin["s_per_layer"]))
              + f"; fit plan_s = {lin['intercept_s']:.1f} + {lin['slope_s_per_layer']:.2f} x layers; s/layer grows "
              f"{lin['s_per_layer_growth']:.2f}x from {lin['layers'][0]} to {lin['layers'][-1]} layers: "
              + ("roughly linear" if lin["roughly_linear"] else f"NOT linear (over {LINEAR_TOLERANCE}x)"))
    return run


if __name__ == "__main__":
    main()
