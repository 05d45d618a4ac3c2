"""Planning time against ``time_limit_s`` (issue 25, "What it must show" 3), and what a 4x limit changes.

For each model (the bundled GPT and a subset of benchmarks/zoo.py at the bench size) and budget ("60%",
"40%"), ``optsched.optimize(..., time_limit_s=T, deterministic=True)`` with chunking on for the models
that have an LM head + cross-entropy (every chunk count planned) and ``executor="inductor"`` (fusion
options offered to the search), then its first call and backward, which plan. Measured per run, wall
seconds on this machine:

- ``plan_s``: each program's planning after capture, as its planning account (optsched.planning.timing) took it:
  op timing, problem building, bounds, every solve (chunk counts and fusion options included): what
  ``time_limit_s`` bounds; ``plan_over_limit`` the worst program's wall seconds over its limit;
- ``first_call_s``: the whole first call: capture, op timing, solving, fusion compilation, lowering, the step.

``llama-7b-80``: Llama-7B's layer x 80 (benchmarks/scaling_llama.py's model, batch 4 x 4096) planned by
``plan_offline`` for the h100 profile on fake tensors at the default time limit (``time_limit_s=None``: 30 s at
this size), its first call being capture + planning; plan_offline's limit covers both (its capture is charged to
the program's account before planning), so its ``plan_over_limit`` is capture + planning over the limit.
``plan_over_limit`` is the check (at most 1.2). Then every
run that raised ``BudgetInfeasibleError`` at T runs
again at 4T: does the lowest peak found change? Deterministic mode counts work, not seconds
(solvers/model/clock.py): each program's units of work and wall seconds are kept, and ``fit`` refits the clock's
table (solvers/model/calibration.py) on them by least squares (benchmarks/calibration_fit.py) beside the
residuals of the table in use. The wall seconds are the reference machine's only when it is idle: run it idle.

    python -m benchmarks.planning_time                       # T = 5 s, about 5 min
    python -m benchmarks.planning_time --limit 10 --cases gpt,vit
    python -m benchmarks.planning_time --refit                # the fit again, on the JSON's runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

import optsched
from benchmarks import calibration_fit
from benchmarks.meta import with_meta

MIB = 2**20
RESULTS_JSON = Path(__file__).parent / "results" / "planning_time.json"
DEFAULT_CASES = ("gpt", "gpt2-labels", "llama-labels", "llama-outside", "vit", "transformer-encoder", "checkpoint",
                 "llama-7b-80")
OFFLINE = {"llama-7b-80": 80}  # planned offline (fake tensors, h100 profile, default limit): case -> Llama-7B layers
CHUNKED = ("gpt", "gpt2-labels", "llama-labels")  # an LM head + cross-entropy inside the step: chunking=True
BUDGETS = ("60%", "40%")
SLACK = 1.2  # the allowance over T
PRIOR_WEIGHT = 0.05  # the refit's pull towards the table in use (calibration_fit.fit): units counted together stay apart


class PlanningAccounts:
    """Every program's planning account (optsched.planning.timing.PlanningTime) while inside: its limit, its wall
    seconds after capture (op timing, problem building, bounds, every solve), its clock seconds and the units of
    work the clock counted."""

    def __init__(self) -> None:
        from optsched.planning import planner

        self._module, self._cls, self.made = planner, planner.PlanningTime, []

    def __enter__(self) -> PlanningAccounts:
        made = self.made

        class Recorded(self._cls):
            def __init__(self) -> None:
                super().__init__()
                made.append(self)

        self._module.PlanningTime = Recorded
        return self

    def __exit__(self, *exc) -> None:
        self._module.PlanningTime = self._cls

    def programs(self) -> list[dict]:
        return [{"limit_s": t.limit_s, **t.taken} for t in self.made if t.taken is not None and t.limit]


def _step(name: str):
    from benchmarks import zoo

    if name == "gpt":
        from benchmarks.models.gpt import GPTConfig, build, make_batch

        cfg = GPTConfig()
        return zoo.ZooStep(build(cfg), make_batch(cfg, 8), lambda m, idx, targets: m(idx, targets))
    return zoo.CASES[name].build()


def plan_one(step, budget: str, limit: float, chunked: bool) -> dict:
    torch._dynamo.reset()
    row: dict = {"budget": budget, "time_limit_s": limit, "chunking": chunked}
    t0 = time.perf_counter()
    with PlanningAccounts() as accounts:
        try:
            opt = optsched.optimize(step.module, budget, time_limit_s=limit, deterministic=True, executor="inductor",
                                    chunking=True if chunked else None)
            step.call_with(opt)(*step.inputs).backward()
            s = opt.plan.summary()
            row.update(fits=True, predicted_peak_bytes=s["predicted_peak_bytes"], status=s["solver_status"],
                       method=s["method"], chunks=s["chunks"], n_fusion_groups=s["n_fusion_groups"])
            del opt
        except optsched.BudgetInfeasibleError as e:
            row.update(fits=False, lowest_peak_bytes=e.lowest_peak_bytes, lower_bound_bytes=e.lower_bound_bytes,
                       proven=e.proven, error=type(e).__name__)
    row["first_call_s"] = time.perf_counter() - t0
    row["programs"] = accounts.programs()
    row["plan_s"] = sum(p["wall_s"] for p in row["programs"])
    row["plan_over_limit"] = max((p["wall_s"] / p["limit_s"] for p in row["programs"]), default=0.0)
    for p in step.module.parameters():
        p.grad = None
    gc.collect()
    return row


def plan_offline_one(layers: int, budget: str) -> dict:
    """Llama-7B's layer x `layers` planned by plan_offline at the default limit: what scaling_llama.py runs."""
    from benchmarks.models import llama
    from benchmarks.scaling_llama import MODEL
    from optsched.compiler.offline import plan_offline

    cfg = llama.Config(**MODEL, n_layer=layers)
    row: dict = {"budget": budget, "time_limit_s": None, "chunking": False, "offline": "h100"}
    timings: dict = {}
    t0 = time.perf_counter()
    with PlanningAccounts() as accounts:
        try:
            plan = plan_offline(lambda: llama.LLaMA(cfg), lambda: llama.make_batch(cfg, 4, 4096), budget,
                                device_profile="h100", timings=timings)
            s = plan.summary()
            row.update(fits=True, predicted_peak_bytes=s["predicted_peak_bytes"], status=s["solver_status"],
                       method=s["method"], chunks={}, n_fusion_groups=0, time_ratio=s["time_ratio"])
        except optsched.BudgetInfeasibleError as e:
            row.update(fits=False, lowest_peak_bytes=e.lowest_peak_bytes, lower_bound_bytes=e.lower_bound_bytes,
                       proven=e.proven, error=type(e).__name__)
    row["first_call_s"] = time.perf_counter() - t0
    row["capture_s"] = timings.get("capture_s")
    row["programs"] = accounts.programs()
    row["time_limit_s"] = max((p["limit_s"] for p in row["programs"]), default=None)
    row["plan_s"] = sum(p["wall_s"] for p in row["programs"])
    # plan_offline's limit covers its capture (charged to the program's account before planning)
    row["plan_over_limit"] = max(((p.get("charged", {}).get("wall_s", 0.0) + p["wall_s"]) / p["limit_s"]
                                  for p in row["programs"]), default=0.0)
    gc.collect()
    return row


def _line(name: str, r: dict) -> str:
    got = (f"fits {r['predicted_peak_bytes'] / MIB:.2f} MiB" if r["fits"]
           else f"infeasible, lowest {r['lowest_peak_bytes'] / MIB:.2f} MiB")
    return (f"{name:20s} {r['budget']:>4s} T={r['time_limit_s']:<4g} plan {r['plan_s']:6.1f} s "
            f"(worst program {r['plan_over_limit']:.2f} T), first call {r['first_call_s']:6.1f} s: {got}")


def fit_calibration(rows: list[dict]) -> dict:
    """The clock's seconds per unit refitted on every program planned (calibration_fit), beside the table's."""
    from solvers.model import calibration

    programs = [p for r in rows for p in r.get("programs", [])]
    samples = [(p["units"], p["wall_s"]) for p in programs if p["units"]]
    samples += [(c["units"], c["wall_s"]) for p in programs if (c := p.get("charged"))]  # captures
    table = {k: u.seconds for k, u in calibration.UNITS.items()}
    f = calibration_fit.fit(samples, keep=table, prior_weight=PRIOR_WEIGHT)
    before = [sum(table.get(k, 0.0) * v for k, v in u.items()) / w - 1 for u, w in samples]
    return {"samples": f.samples, "seconds": f.seconds, "table": table, "residuals": f.residuals,
            "table_residuals": before, "fitted_at": calibration.FITTED_AT}


def print_fit(fit: dict) -> None:
    print(f"clock calibration on {fit['samples']} programs (clock seconds / wall seconds - 1):")
    worst = lambda rs: max((abs(x) for x in rs), default=0.0)  # noqa: E731
    print(f"  table in use: worst {worst(fit['table_residuals']):.0%}; refitted: worst {worst(fit['residuals']):.0%}")
    for k, v in fit["seconds"].items():
        print(f"  {k:28s} {fit['table'].get(k, float('nan')):10.3g} -> {v:10.3g}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, default=5.0, help="time_limit_s T (default 5)")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma-separated: gpt and benchmarks.zoo case names")
    ap.add_argument("--json", type=Path, default=RESULTS_JSON)
    ap.add_argument("--refit", action="store_true", help="refit the clock on the JSON's runs, plan nothing")
    args = ap.parse_args(argv)
    if args.refit:
        out = json.loads(args.json.read_text())
        out["fit"] = fit_calibration([r for c in out["cases"] for r in c["rows"] + c["longer"]])
        print_fit(out["fit"])
        args.json.write_text(json.dumps(out, indent=1))
        return out
    os.environ.setdefault("OPTSCHED_ZOO_SIZE", "bench")
    # first calls as on a fresh machine: no op times from the user's op-time file (costs/op_cache.py), which an
    # earlier run of this benchmark filled; the models' programs still share the times this process measures
    os.environ.setdefault("OPTSCHED_OP_TIMES", "off")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out: dict = {"time_limit_s": args.limit, "slack": SLACK, "threads": torch.get_num_threads(), "cases": []}
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        case = {"case": name, "rows": [], "longer": []}
        if name in OFFLINE:
            for budget in BUDGETS:
                case["rows"].append(plan_offline_one(OFFLINE[name], budget))
                print(_line(name, case["rows"][-1]), flush=True)
            out["cases"].append(case)
            continue
        step = _step(name)
        for budget in BUDGETS:
            r = plan_one(step, budget, args.limit, name in CHUNKED)
            print(_line(name, r), flush=True)
            case["rows"].append(r)
            if not r["fits"] and not r["proven"]:
                r4 = plan_one(step, budget, 4 * args.limit, name in CHUNKED)
                r4["lowest_changed"] = (r4["fits"] or r4["lowest_peak_bytes"] != r["lowest_peak_bytes"])
                print(_line(name, r4) + f"  (4T changed the answer: {r4['lowest_changed']})", flush=True)
                case["longer"].append(r4)
        out["cases"].append(case)
        del step
        gc.collect()
    rows = [r for c in out["cases"] for r in c["rows"] + c["longer"]]
    out["worst_plan_over_limit"] = max((r["plan_over_limit"] for r in rows), default=None)
    out["within_slack"] = all(r["plan_over_limit"] <= SLACK for r in rows)
    print(f"worst planning time / T: {out['worst_plan_over_limit']:.2f} (allowed {SLACK})", flush=True)
    out["fit"] = fit_calibration(rows)
    print_fit(out["fit"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(with_meta(out), indent=1))
    return out


if __name__ == "__main__":
    main()
