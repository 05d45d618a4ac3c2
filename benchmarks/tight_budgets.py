"""Tight budgets (issue 14, "What it must show" 1 and 2), runnable before and after a solver change.

Part ``gpt``: the bundled GPT (benchmarks/models/gpt.py, default GPTConfig: 4 layers, width 256,
sequence 128), batch 8. Eager's measured peak, then ``optsched.optimize`` at 45% and 40% of it,
with ``offload=False`` and ``offload=True`` (on this CPU: a separate host pool filled by worker
threads). Per run: fits, predicted vs measured peak, gradients against eager (max abs diff),
step time against eager (``measure_ratio``: both timed alternately in this process), plan
seconds, solver status, gap and method (``plan.summary()``); for ``optsched.BudgetInfeasibleError``
its ``lowest_peak_bytes`` and ``lower_bound_bytes``. Then the lowest feasible peak, with and
without offload (see "lowest feasible" below).

Part ``zoo``: cases of benchmarks/zoo.py (its builders, call patterns and measurement helpers) at
60% and 40% of eager's measured peak, and the lowest feasible peak: peak found vs the proven
bound, time vs eager, plan s.

Lowest feasible (``lowest_feasible``), plans only (no step run) until the end:
  1. the budgets above are the first probes: the lowest predicted peak of a plan that fits is the
     best so far; the highest budget declared infeasible is the floor; the proven bound (``case_bound``:
     the least any row reports, raised to the highest an infeasible row reports) caps how low a probe goes;
  2. if a ``BudgetInfeasibleError`` reported a lowest peak L below the best so far (and more than 0.2%
     of eager's peak above the floor), the next probe is a budget of exactly L, passing that error back
     (``optimize(..., start_from=error)``, as its message says): the plan it found is the start;
  3. otherwise bisection: the next budget is halfway between max(floor, bound) and the best so far
     (or eager's peak when nothing fit yet), starting from the best plan so far (``start_from=plan``, as
     a user lowering a budget would); a probe that fits lowers the best to its predicted
     peak, one that does not raises the floor (and its L, if lower than the best, is tried next);
  4. stop after ``--probes`` probes (default 4) or when best - max(floor, bound) < 1% of eager;
  (before 2-4, unless a budget was refused already: one probe a byte under the proven bound, which optimize()
  refuses before any search, reporting its strongest bound, the joint family's: no search takes it where little
  time is left, so without this probe the case's bound would depend on the search's time);
  5. then each lowest feasible peak another run (label) of the JSON recorded for the case, when below the best
     found: a budget of exactly that (does this code reach what the other did? the bisection's path may miss
     a plan: OPT at bench size fits 13.55 MiB with a 13.43 MiB plan but not 13.80);
  6. then, up to twice, the lowest peak L of a failed search's error when it is below the best: a budget of
     exactly L from that error (step 2's probe, which the probe count or the targets may have left out: the
     checkpointed TinyLM's errors found 12.33 MiB plans while its best probe stood at 12.82).
  The best plan found is then run: measured peak, gradients, time vs eager. Every probe is
  recorded (budget, fits or not, peak, bound, plan s).

Results go to benchmarks/results/tight_budgets.json under ``runs[label]`` (``--label``, default
the git short hash), merged with what is there (parts and zoo cases replace their own entries),
so the same command before and after a change gives a side-by-side table
(``python -m benchmarks.report``). A table is printed as it goes.

    python -m benchmarks.tight_budgets --label before                    # gpt, then the zoo subset
    python -m benchmarks.tight_budgets --label after --parts gpt
    python -m benchmarks.tight_budgets --label twice-1 --parts gpt --op-times /tmp/ops.json   # then twice-2: alike
    python -m benchmarks.tight_budgets --label after --parts zoo --cases llama-labels,vit --size bench
    python -m benchmarks.tight_budgets --show                             # print the stored table
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

import optsched
from benchmarks import timed_step
from benchmarks.meta import run_meta
from benchmarks.scaling_llama import git_state
from optsched.measure import measure_ratio

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent
RESULTS_JSON = Path(__file__).parent / "results" / "tight_budgets.json"
GPT_FRACTIONS = (0.45, 0.40)
ZOO_FRACTIONS = (0.6, 0.4)
# a representative subset of the zoo (about 1-2 min each at the bench size on 2 cores): HF causal LMs with the
# loss inside and outside, random (dropout) models, encoder-only, an image model, a plain torch encoder and a
# model that checkpoints its own blocks
DEFAULT_CASES = ("gpt2-labels", "llama-labels", "llama-outside", "opt-labels", "gpt-neox-outside", "vit",
                 "transformer-encoder", "checkpoint")
HINT_MARGIN = 0.002  # of eager's peak: an infeasible error's lowest peak this close to the floor is not tried
LOWEST_FOUND_PROBES = 2  # after the search: probes at failed searches' lowest peaks below the best plan
STOP_WITHIN = 0.01  # of eager's peak: bisection stops when the best is this close to the floor or bound


def _zoo():
    """benchmarks.zoo, imported at the size $OPTSCHED_ZOO_SIZE names (main sets it before the first import)."""
    from benchmarks import zoo

    return zoo


# --------------------------------------------------------------------------- planning and measuring

def _plan_fields(plan) -> dict:
    s = plan.summary()
    return {
        "predicted_peak_bytes": s["predicted_peak_bytes"],
        "lower_bound_bytes": s["lower_bound_bytes"],
        "unplanned_peak_bytes": s["unplanned_peak_bytes"],
        "plan_s": s["solve_time_s"],
        "solver_status": s["solver_status"],
        "gap": s["gap"],
        "method": s["method"],
        "estimated_time_ratio": s["time_ratio"],
        "n_recomputed": s["n_recomputed"],
        "n_offloaded": s["n_offloaded"],
        "offloaded_bytes": s["offloaded_bytes"],
        "n_ops": s["n_ops"],
    }


# the errors of this process's probes by (module, offload, lowest peak): a probe at an error's lowest peak passes
# the error back (optimize's start_from), as a user would; any other probe passes the best plan so far (the
# same argument); nothing else is carried between probes
_ERRORS: dict[tuple[int, bool, int], optsched.BudgetInfeasibleError] = {}
_PLANS: dict[tuple[int, bool, int], object] = {}  # the first plan made at each budget, by (module, offload, budget)


def plan_once(step, budget: int, offload: bool, time_limit_s: float | None, seed: int = 0, start_from=None):
    """optimize() and its first call (which plans), then that step's backward. Returns (opt, row); opt is None
    when no plan was made (``row['infeasible']`` or ``row['error']``). A budget that is an earlier error's
    lowest peak starts from that error's plan, else from `start_from` (an earlier plan) when given
    (``row['start_from']``: "error" or "plan")."""
    zoo = _zoo()
    row: dict = {"budget_bytes": budget, "offload": offload}
    error = _ERRORS.get((id(step.module), offload, budget))
    start_from = error if error is not None else start_from
    if start_from is not None:
        row["start_from"] = "error" if error is not None else "plan"
    stage = "optimize"
    t0 = time.perf_counter()
    try:
        opt = optsched.optimize(step.module, budget, offload=offload, time_limit_s=time_limit_s, start_from=start_from)
        call = step.call_with(opt)
        stage = "first call"
        zoo.fresh_process_logging()
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        loss = call(*step.inputs)
        row["first_call_s"] = time.perf_counter() - t0
        stage = "first backward"
        loss.backward()
        del loss
        row.update(_plan_fields(opt.plan))
        _PLANS[(id(step.module), offload, budget)] = opt.plan
        return opt, row
    except optsched.BudgetInfeasibleError as e:
        if e.lowest_schedule is not None:
            _ERRORS[(id(step.module), offload, e.lowest_peak_bytes)] = e
        row.update({"infeasible": True, "lowest_peak_bytes": e.lowest_peak_bytes, "lower_bound_bytes": e.lower_bound_bytes,
                    "searched": e.searched, "first_call_s": time.perf_counter() - t0, "message": str(e)})
    except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on
        row["error"] = dict(zoo._error(e), stage=stage)
        row["traceback"] = traceback.format_exc(limit=-3)
    finally:
        for p in step.module.parameters():
            p.grad = None
        gc.collect()
    return None, row


def measure_plan(opt, step, row: dict, eager: dict, eager_grads: dict, repeat: int, seed: int = 0) -> dict:
    """Run a planned step as users do (two more steps: the plan is made again if the caller's use of the
    outputs differs from the first guess), then the measured peak, gradients and time against eager."""
    zoo = _zoo()
    call = step.call_with(opt)
    budget = row["budget_bytes"]
    first_plan = opt.plan
    stage = "second step"
    try:
        for _ in range(2):
            torch.manual_seed(seed)
            call(*step.inputs).backward()
            for p in step.module.parameters():
                p.grad = None
        row["replanned"] = opt.plan is not first_plan
        if row["replanned"]:
            first_s = row["plan_s"]
            row.update(_plan_fields(opt.plan))
            row["plan_s"] += first_s
        stage = "measure"
        m = zoo._measure(call, step, seed)
        row.update({
            "measured_peak_bytes": m.peak_bytes,
            "within_budget": m.peak_bytes <= budget,
            "predicted_vs_measured": (row["predicted_peak_bytes"] - m.peak_bytes) / m.peak_bytes,
            "max_grad_diff": zoo._max_grad_diff(m.grads, eager_grads),
            "loss_diff": abs(m.loss.item() - eager["loss"]),
        })
        del m
        if repeat > 0:
            stage = "timing"
            t, t_eager = measure_ratio(timed_step(call, step.module, step.inputs),
                                       timed_step(step.call, step.module, step.inputs), warmup=1, repeat=repeat)
            row.update({"step_s": t, "eager_step_s": t_eager, "time_ratio": t / t_eager})
    except optsched.BudgetInfeasibleError as e:  # the second plan (for the observed output use) did not fit
        row.update({"infeasible_on_replan": True, "lowest_peak_bytes": e.lowest_peak_bytes,
                    "lower_bound_bytes": e.lower_bound_bytes})
    except Exception as e:  # noqa: BLE001
        row["error"] = dict(zoo._error(e), stage=stage)
        row["traceback"] = traceback.format_exc(limit=-3)
    finally:
        for p in step.module.parameters():
            p.grad = None
        gc.collect()
    return row


def run_budget(step, eager: dict, eager_grads: dict, budget: int, offload: bool, time_limit_s, repeat: int) -> dict:
    opt, row = plan_once(step, budget, offload, time_limit_s)
    if opt is not None:
        measure_plan(opt, step, row, eager, eager_grads, repeat)
    del opt
    gc.collect()
    return row


def _fits(row: dict) -> bool:
    return "predicted_peak_bytes" in row and not row.get("infeasible") and "error" not in row


def case_bound(rows: list[dict]) -> int:
    """The proven bound of one case's plans: the least any row reports (a plan's is about the problem it planned,
    perhaps one holding outputs for the caller), raised to the highest an infeasible row reports (an error's is about
    the program as captured, below every plan of the case: the joint family's where the search took it)."""
    bounds = [r["lower_bound_bytes"] for r in rows if r.get("lower_bound_bytes")]
    failed = [r["lower_bound_bytes"] for r in rows if r.get("infeasible") and r.get("lower_bound_bytes")]
    return max([min(bounds, default=0), *failed])


def lowest_feasible(step, eager: dict, eager_grads: dict, offload: bool, known: list[dict], time_limit_s, repeat: int,
                    probes: int, targets: list[int] = ()) -> dict:
    """The lowest budget at which a plan is found (method in the module docstring); ``known`` are the rows of
    the budgets already run with this offload setting; ``targets``: other runs' lowest feasible peaks of this
    case, each probed once more after the search when it is below the best found."""
    eager_peak = eager["measured_peak_bytes"]
    t_start = time.perf_counter()
    bound = case_bound(known)
    floor = max([r["budget_bytes"] for r in known if r.get("infeasible")], default=0)
    feasible = [r for r in known if _fits(r)]
    best_peak = min((r["predicted_peak_bytes"] for r in feasible), default=None)
    best_budget = min((r["budget_bytes"] for r in feasible if r["predicted_peak_bytes"] == best_peak), default=None)
    # an error's lowest peak is a hint when a search found it; a budget refused below the proven bound before any
    # search (its lowest is the unplanned program's) hints at the bound itself, where a search then starts
    hints = sorted(r["lowest_peak_bytes"] if r.get("searched", True) else r["lower_bound_bytes"]
                   for r in known if r.get("infeasible"))
    best_opt = None
    tried: set[int] = {r["budget_bytes"] for r in known}
    out_probes = []

    def probe(budget: int, why: str) -> dict:
        """Plan at `budget`, recorded; a plan that fits below the best so far becomes the best."""
        nonlocal best_peak, best_budget, best_opt
        tried.add(budget)
        start = _PLANS.get((id(step.module), offload, best_budget)) if best_budget is not None else None
        opt, row = plan_once(step, budget, offload, time_limit_s, start_from=start)
        row["why"] = why
        out_probes.append(row)
        print(f"      probe {budget / MIB:8.2f} MiB ({why}): {_short(row)}", flush=True)
        if opt is not None and row["predicted_peak_bytes"] <= budget and (best_peak is None or row["predicted_peak_bytes"] < best_peak):
            best_peak, best_budget, best_opt = row["predicted_peak_bytes"], budget, (opt, row)
        if row.get("infeasible"):
            hints.append(row["lowest_peak_bytes"] if row.get("searched", True) else row["lower_bound_bytes"])
            hints.sort()
        del opt
        gc.collect()
        return row

    if bound and not any(r.get("infeasible") and not r.get("searched", True) for r in known):
        # a budget under the bound is refused before any search, with the library's strongest bound (the joint
        # family's, which a search takes only when time is left): the case's proven bound, and a hint where to start
        row = probe(bound - 1, "under the proven bound")
        if row.get("infeasible"):
            floor = max(floor, bound - 1)
            bound = max(bound, row.get("lower_bound_bytes") or 0)
    for _ in range(probes):
        lo = max(floor, bound)
        top = best_peak if best_peak is not None else eager_peak
        if top - lo < STOP_WITHIN * eager_peak:
            break
        # a hint within HINT_MARGIN of the floor (an infeasible budget) is the same answer again (its bytes may differ a
        # little); one at the proven bound is worth a probe: a plan there is the lowest peak any plan reaches
        hint = next((h for h in hints if floor + HINT_MARGIN * eager_peak < h < top and h >= bound and h not in tried), None)
        why = "proven bound" if hint is not None and hint == bound else "infeasible error's lowest peak"
        budget, why = (hint, why) if hint is not None else ((lo + top) // 2, "bisection")
        if budget in tried:
            break
        row = probe(budget, why)
        if row.get("infeasible"):
            floor = max(floor, budget)
            bound = max(bound, row.get("lower_bound_bytes") or 0)
    for target in sorted(set(targets)):  # does this run reach what another did? (its search path may miss it)
        if (best_peak is None or target < best_peak) and target not in tried and target >= bound:
            probe(target, "another run's lowest feasible")
    # a search that failed its budget found a plan at its lowest peak (the error keeps it): below the best, that plan
    # is the lowest found, confirmed by planning at that peak from the error, as a user would, and measured
    for _ in range(LOWEST_FOUND_PROBES):
        below = [h for h in hints if (best_peak is None or h < best_peak) and h not in tried and h >= bound]
        if not below or (best_peak is not None and best_peak - below[0] < HINT_MARGIN * eager_peak):
            break
        probe(below[0], "infeasible error's lowest peak")
    res: dict = {"offload": offload, "probes": out_probes, "search_s": time.perf_counter() - t_start, "bound_bytes": bound,
                 "floor_budget_bytes": floor, "lowest_peak_bytes": best_peak, "budget_bytes": best_budget}
    if best_peak is None:
        res["none_found"] = True
        return res
    if best_opt is not None:  # the best came from a probe: run it
        opt, row = best_opt
        measure_plan(opt, step, row, eager, eager_grads, repeat)
        res["run"] = row
        del opt, best_opt
    else:  # the best is one of the budgets already run
        res["run"] = next(r for r in feasible if r["predicted_peak_bytes"] == best_peak)
    res["peak_vs_bound"] = best_peak / bound if bound else None
    gc.collect()
    return res


# --------------------------------------------------------------------------- parts

def eager_reference(step, seed: int = 0) -> tuple[dict, dict]:
    zoo = _zoo()
    m = zoo._measure(step.call, step, seed)
    m2 = zoo._measure(step.call, step, seed)
    eager = {"measured_peak_bytes": m.peak_bytes, "loss": m.loss.item(),
             "param_bytes": sum(p.numel() * p.element_size() for p in step.module.parameters()),
             "repeat_grad_diff": zoo._max_grad_diff(m.grads, m2.grads), "repeat_peak_bytes": m2.peak_bytes}
    return eager, m.grads


def run_gpt(args) -> dict:
    from benchmarks.models.gpt import GPTConfig, build, make_batch

    zoo = _zoo()
    cfg = GPTConfig()
    model = build(cfg)
    inputs = make_batch(cfg, args.gpt_batch)
    step = zoo.ZooStep(model, inputs, lambda m, idx, targets: m(idx, targets))
    step.module.train()
    eager, grads = eager_reference(step)
    print(f"gpt: {cfg.n_layer} layers, width {cfg.n_embd}, batch {args.gpt_batch}, sequence {cfg.block_size}: eager peak "
          f"{eager['measured_peak_bytes'] / MIB:.2f} MiB (parameters {eager['param_bytes'] / MIB:.2f} MiB)", flush=True)
    out = {"config": {"layers": cfg.n_layer, "width": cfg.n_embd, "heads": cfg.n_head, "batch": args.gpt_batch,
                      "seq": cfg.block_size, "vocab": cfg.vocab_size},
           "eager": eager, "rows": [], "lowest": []}
    for offload in (False, True):
        rows = run_fractions(step, eager, grads, args.gpt_fractions, offload, args, label=f"offload={offload!s:<5} ")
        out["rows"] += rows
        if args.probes > 0:
            print(f"  offload={offload}: lowest feasible", flush=True)
            low = lowest_feasible(step, eager, grads, offload, rows, args.time_limit, args.repeat, args.probes,
                                  _other_runs_lowest(args, "gpt", offload))
            print(f"  offload={offload!s:<5} lowest: {_lowest_short(low)}", flush=True)
            out["lowest"].append(low)
    return out


def run_fractions(step, eager: dict, grads, fractions, offload: bool, args, label: str = "") -> list[dict]:
    """One row per budget, a fraction of eager's measured peak each, printed as it comes."""
    rows = []
    for frac in fractions:
        budget = int(frac * eager["measured_peak_bytes"])
        row = run_budget(step, eager, grads, budget, offload, args.time_limit, args.repeat)
        row["fraction"] = frac
        print(f"  {label}{frac:.0%} ({budget / MIB:.2f} MiB): {_short(row)}", flush=True)
        rows.append(row)
    return rows


def _other_runs_lowest(args, case: str, offload: bool) -> list[int]:
    """The lowest feasible peaks other labels of the results JSON recorded for `case` ("gpt" or a zoo case)."""
    try:
        runs = json.loads(args.json.read_text()).get("runs", {})
    except (OSError, ValueError):
        return []
    out = []
    for label, run in runs.items():
        if label == args.label:
            continue
        if case == "gpt":
            lows = [x for x in run.get("gpt", {}).get("lowest", []) if x.get("offload") == offload]
        else:
            lows = [c.get("lowest") or {} for c in run.get("zoo", {}).get("cases", []) if c.get("case") == case]
        out += [x["lowest_peak_bytes"] for x in lows if x.get("lowest_peak_bytes")]
    return out


def run_zoo_case(name: str, args) -> dict:
    zoo = _zoo()
    case = zoo.CASES[name]
    torch._dynamo.reset()
    tc = time.perf_counter()
    res: dict = {"case": name, "model": case.model, "pattern": case.pattern, "random": case.random}
    try:
        step = case.build()
        eager, grads = eager_reference(step)
    except Exception as e:  # noqa: BLE001
        res["error"] = dict(zoo._error(e), stage="eager")
        return res
    res["eager"] = eager
    print(f"{name}: {case.model} [{case.pattern}], eager peak {eager['measured_peak_bytes'] / MIB:.2f} MiB", flush=True)
    rows = run_fractions(step, eager, grads, args.zoo_fractions, False, args)
    res["rows"] = rows
    if args.probes > 0:
        res["lowest"] = lowest_feasible(step, eager, grads, False, rows, args.time_limit, args.repeat, args.probes,
                                        _other_runs_lowest(args, name, False))
        print(f"  lowest: {_lowest_short(res['lowest'])}", flush=True)
    res["case_s"] = time.perf_counter() - tc
    return res


# --------------------------------------------------------------------------- output

def _mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.2f}"


def _short(r: dict) -> str:
    if "error" in r:
        return f"FAIL {r['error']['type']} ({r['error']['stage']}): {r['error']['message'][:100]}"
    if r.get("infeasible"):
        return (f"infeasible: lowest {_mib(r['lowest_peak_bytes'])}, bound {_mib(r['lower_bound_bytes'])} MiB "
                f"({r['first_call_s']:.1f} s)")
    text = (f"pred {_mib(r['predicted_peak_bytes'])} bound {_mib(r['lower_bound_bytes'])} MiB, plan {r['plan_s']:.1f} s, "
            f"{r['solver_status']} gap {r['gap']:.1%} [{r['method']}]")
    if r.get("infeasible_on_replan"):
        text += f"; replanned for the observed output use: infeasible (lowest {_mib(r['lowest_peak_bytes'])})"
    if "measured_peak_bytes" in r:
        diff = r["max_grad_diff"]
        grads = "grads missing" if diff is None else ("grads equal" if diff == 0 else f"grads {diff:.1e}")
        t = f", {r['time_ratio']:.2f}x eager" if "time_ratio" in r else ""
        text += (f"; measured {_mib(r['measured_peak_bytes'])}{'' if r['within_budget'] else ' OVER BUDGET'}{t}, {grads}"
                 + (", replanned" if r.get("replanned") else ""))
    return text


def _lowest_short(low: dict) -> str:
    if low.get("none_found"):
        return f"no plan found in {len(low['probes'])} probes ({low['search_s']:.0f} s)"
    r = low["run"]
    ratio = f" ({low['peak_vs_bound']:.2f}x bound)" if low.get("peak_vs_bound") else ""
    return (f"{_mib(low['lowest_peak_bytes'])} MiB vs bound {_mib(low['bound_bytes'])}{ratio}, "
            f"{len(low['probes'])} probes in {low['search_s']:.0f} s; {_short(r)}")


def print_table(run: dict) -> None:
    from benchmarks.report import tight_tables

    print()
    print(tight_tables({"runs": {run["label"]: run}}))


# --------------------------------------------------------------------------- results file

def merge_run(path: Path, label: str, run: dict) -> dict:
    """runs[label] updated with ``run``: parts replace their own entries, zoo cases are merged by name."""
    data = json.loads(path.read_text()) if path.exists() else {}
    runs = data.setdefault("runs", {})
    old = runs.get(label, {})
    meta = run_meta()
    if (old.get("meta") or old.get("git") or {}).get("commit") != meta["commit"]:
        old = {k: v for k, v in old.items() if k != "notes"}  # written by hand for the run at another commit
    new = {**old, **{k: v for k, v in run.items() if k != "zoo"}, "meta": meta}
    if "zoo" in run:
        cases = {c["case"]: c for c in old.get("zoo", {}).get("cases", [])}
        cases.update({c["case"]: c for c in run["zoo"]["cases"]})
        new["zoo"] = {**run["zoo"], "cases": list(cases.values())}
    runs[label] = new
    data = {"meta": meta, **{k: v for k, v in data.items() if k != "meta"}}  # the latest run's, for report --check
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path} (label {label!r})")
    return new


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default=None, help="key of this run in the results (default: the git short hash)")
    ap.add_argument("--parts", default="gpt,zoo", help="gpt and/or zoo")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="zoo cases (benchmarks.zoo --list)")
    ap.add_argument("--size", choices=("test", "bench"), default=None, help="zoo size (default: bench)")
    ap.add_argument("--gpt-batch", type=int, default=8)
    ap.add_argument("--gpt-budgets", default=",".join(str(f) for f in GPT_FRACTIONS), help="fractions of eager's peak")
    ap.add_argument("--zoo-budgets", default=",".join(str(f) for f in ZOO_FRACTIONS), help="fractions of eager's peak")
    ap.add_argument("--probes", type=int, default=4, help="lowest-feasible probes per search (0: no search)")
    ap.add_argument("--time-limit", type=float, default=None, help="planning time limit (default: optimize()'s)")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions for time vs eager (0: no timing)")
    ap.add_argument("--json", type=Path, default=RESULTS_JSON)
    ap.add_argument("--show", action="store_true", help="print the stored tables and exit")
    ap.add_argument("--op-times", type=Path, default=None,
                    help="a file of op times shared with other runs ($OPTSCHED_OP_TIMES; default: the user's "
                         "op-time file, costs/op_cache.py): runs sharing one file plan on the same measurements, "
                         "so two fresh runs give the same plans")
    args = ap.parse_args(argv)
    if args.op_times is not None:
        os.environ["OPTSCHED_OP_TIMES"] = str(args.op_times.resolve())
    if args.show:
        from benchmarks.report import tight_tables

        print(tight_tables(json.loads(args.json.read_text())))
        return {}
    size = args.size or os.environ.get("OPTSCHED_ZOO_SIZE") or "bench"
    zoo_mod = sys.modules.get("benchmarks.zoo")
    if zoo_mod is not None and zoo_mod.SIZE != size:  # zoo's sizes are fixed at import: run again with them
        os.environ["OPTSCHED_ZOO_SIZE"] = size
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.tight_budgets", *(sys.argv[1:] if argv is None else argv)])
    os.environ["OPTSCHED_ZOO_SIZE"] = size
    zoo = _zoo()
    args.gpt_fractions = [float(f) for f in args.gpt_budgets.split(",") if f]
    args.zoo_fractions = [float(f) for f in args.zoo_budgets.split(",") if f]
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in zoo.CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; see python -m benchmarks.zoo --list")
    git = git_state()
    label = args.label = args.label or git.get("short") or "unlabelled"
    run: dict = {"label": label, "git": git, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "torch": torch.__version__, "threads": torch.get_num_threads(), "time_limit_s": args.time_limit,
                 "repeat": args.repeat, "probes": args.probes}
    if "gpt" in parts:
        t0 = time.perf_counter()
        torch._dynamo.reset()
        run["gpt"] = run_gpt(args)
        run["gpt"]["total_s"] = time.perf_counter() - t0
        run["gpt"]["git"] = git  # a label's parts may run on different commits
        merge_run(args.json, label, run)
    if "zoo" in parts:
        t0 = time.perf_counter()
        cases = []
        for name in names:
            cases.append(run_zoo_case(name, args))
            run["zoo"] = {"config": {"size": zoo.SIZE, "vocab": zoo.VOCAB, "width": zoo.WIDTH, "layers": zoo.LAYERS,
                                     "batch": zoo.BATCH, "seq": zoo.SEQ, "budgets": args.zoo_fractions,
                                     "total_s": time.perf_counter() - t0},
                          "git": git, "cases": cases}
            merge_run(args.json, label, run)  # after every case: a run cut short keeps what it did
    print_table(run)
    return run


if __name__ == "__main__":
    main()
