"""Render benchmarks/results/*.json as markdown tables into README.md, docs/benchmarks.md and docs/distributed.md,
between marker comments (`<!-- bench:KEY -->` ... `<!-- /bench:KEY -->`, KEY one of TABLES).

    python -m benchmarks.report          # rewrite every table from the JSON
    python -m benchmarks.report --check  # exit 1, naming the table, when a file's table differs from its JSON,
                                         # a JSON lacks its commit, or a notebook was not run on its JSON

Every table opens with the commit it was measured at, from its JSON's `meta` (benchmarks/meta.py, written by
every benchmark). `make bench` runs every benchmark that feeds a table or notebook, then this, then the
notebooks; `--check` is in the test suite (tests/test_report.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks.meta import commit_line, describe
from benchmarks.scaling_llama import stage_seconds

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20


def gpt_table(d: dict) -> str:
    c = d["config"]
    e = d["eager"]
    lines = [
        f"{c.get('model', 'gpt')}: {c['layers']} layers, width {c['width']}, batch {c['batch']}, sequence {c['seq']}, "
        f"torch {c['torch']}, {c['threads']} CPU threads. Eager peak {e['measured_peak_bytes'] / MIB:.2f} MiB. "
        f"optsched executor: {c.get('executor', 'eager')}; min-cut via `{c.get('mincut_backend', 'aot_eager_decomp_partition')}`.",
        "",
        "| budget | optsched predicted | optsched measured | fits | time vs eager | grads vs eager | plan s | status | gap "
        "| min-cut (knob) | min-cut peak | min-cut time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["optsched"]:
        budget = f"{r['budget_bytes'] / MIB:.2f} MiB ({r['fraction']:.0%})"
        if "infeasible" in r:
            ours = f"infeasible (lowest {r['lowest_peak_bytes'] / MIB:.2f}) | | | | | | | "
        else:
            diff = "equal" if r["max_grad_diff"] == 0 else f"{r['max_grad_diff']:.1e}"
            ours = (f"{r['predicted_peak_bytes'] / MIB:.2f} MiB | {r['measured_peak_bytes'] / MIB:.2f} MiB | "
                    f"{'yes' if r['within_budget'] else 'NO'} | {r['time_ratio']:.2f}x | {diff} | {r['plan_s']:.1f} | "
                    f"{r['solver_status']} | {r['gap']:.1%}")
        mc = r.get("mincut")
        theirs = (f"{mc['activation_memory_budget']:.1f} | {mc['measured_peak_bytes'] / MIB:.2f} MiB | {mc['time_ratio']:.2f}x"
                  if mc else ("none fits | | " if d.get("mincut") else "not run | | "))
        lines.append(f"| {budget} | {ours} | {theirs} |")
    if d.get("mincut"):
        lo = min(d["mincut"], key=lambda r: r["measured_peak_bytes"])
        backend = c.get("mincut_backend", "aot_eager_decomp_partition")
        lines += ["", f"PyTorch's min-cut partitioner (`{backend}`, `activation_memory_budget` "
                      f"swept over {', '.join(str(r['activation_memory_budget']) for r in d['mincut'])}) reaches at "
                      f"best {lo['measured_peak_bytes'] / MIB:.2f} MiB; its fastest setting runs at "
                      f"{min(r['time_ratio'] for r in d['mincut']):.2f}x eager."]
    return "\n".join(lines)


def _rows_by_name(d: dict) -> list[tuple[str, dict]]:
    """The rows of a JSON keyed by name (seed_order.json, adam_step.json), its ``meta`` left out."""
    return [(k, v) for k, v in d.items() if k != "meta"]


def seed_table(d: dict) -> str:
    lines = [
        "| function | eager | torch.compile (Inductor, CPU) | Thunder (reported) | optsched measured | optsched predicted "
        "| status | optsched + Inductor groups |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, r in _rows_by_name(d):
        ind = f"{r['inductor_bytes'] / MIB:.2f}" if "inductor_bytes" in r else "not run"
        fused = f"{r['optsched_inductor_bytes'] / MIB:.2f}" if "optsched_inductor_bytes" in r else "not run"
        lines.append(f"| {name} | {r['eager_bytes'] / MIB:.2f} | {ind} | {r['thunder_reported_bytes'] / MIB:.2f} | "
                     f"{r['optsched_bytes'] / MIB:.2f} | {r['optsched_predicted_bytes'] / MIB:.2f} | {r['optsched_status']} "
                     f"| {fused} |")
        notes += [f"{name}: {n}" for n in r.get("optsched_inductor_notes", [])]
    lines += ["", "MiB above the inputs, at the allocator."]
    if notes:
        lines += ["", "Horizontal fusion, as Thunder does it, offered to the solver as fusion options, and what it decided:", ""]
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def scaling_table(d: dict) -> str:
    c = d["config"]
    lines = [
        f"Width {c['width']}, batch {c['batch']}, sequence {c['seq']}, budget {c['fraction']:.0%} of the unplanned peak, "
        f"{c['profile']} profile (roofline times), planned on this CPU.",
        "",
        "| layers | graph nodes | ops | plan s | s / layer | status | gap | unplanned peak | predicted peak | est. time vs unplanned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(f"| {r['layers']} | {r['graph_nodes']} | {r['ops']} | {r['plan_s']:.1f} | {r['plan_s'] / r['layers']:.2f} | "
                     f"{r['status']} | {r['gap']:.2%} | {r['unplanned_peak_bytes'] / MIB:.1f} MiB | "
                     f"{r['predicted_peak_bytes'] / MIB:.1f} MiB | {r['time_ratio']:.3f}x |")
    return "\n".join(lines)


def offload_table(d: dict) -> str:
    c, g = d["config"], d["gpu"]
    lines = [
        f"GPT {c['layers']} layers, width {c['width']}, batch {c['batch']}, sequence {c['seq']}, fp32, planned on this CPU "
        f"for the {c['profile']} profile ({g['n_ops']} ops, unplanned peak {g['unplanned_peak_bytes'] / MIB:.0f} MiB, "
        f"host link {g['host_bw'] / 1e9:.0f} GB/s). Times are estimates relative to the unplanned step.",
        "",
        "| budget | recompute only: peak | time | bound | save/recompute/offload: peak | time | offloaded | recomputed ops "
        "| exposed copies | status | gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in g["rows"]:
        rc, mx = r["recompute_only"], r["mixed"]
        left = ("infeasible | | " if rc.get("infeasible") else
                f"{rc['peak_bytes'] / MIB:.0f} MiB | {rc['time_ratio']:.3f}x | {rc['bound_ratio']:.3f}x")
        right = ("infeasible | | | | | | " if mx.get("infeasible") else
                 f"{mx['peak_bytes'] / MIB:.0f} MiB | {mx['time_ratio']:.3f}x | {mx['offloaded_bytes'] / MIB:.0f} MiB | "
                 f"{mx['n_recomputed']} | {mx['exposed_transfer_s'] * 1e6:.0f} us | {mx['status']} | {mx['gap']:.1%}")
        lines.append(f"| {r['budget_bytes'] / MIB:.0f} MiB ({r['fraction']:.0%}) | {left} | {right} |")
    lines += ["", "Budget-blind policies on the same step:", "",
              "| policy | peak | time | offloaded | exposed copies |", "|---|---|---|---|---|"]
    for p in g["policies"]:
        lines.append(f"| {p['policy']} | {p['peak_bytes'] / MIB:.0f} MiB | {p['time_ratio']:.3f}x | "
                     f"{p['offloaded_bytes'] / MIB:.0f} MiB | {p['exposed_transfer_s'] * 1e6:.0f} us |")
    cpu = d.get("cpu")
    if cpu:
        lines += ["", f"Run on this CPU (host = a separate pool, copies on worker threads), small GPT at "
                      f"{cpu['fraction']:.0%} of eager's {cpu['eager_peak_bytes'] / MIB:.2f} MiB: predicted "
                      f"{cpu['predicted_peak_bytes'] / MIB:.2f} MiB, measured {cpu['measured_peak_bytes'] / MIB:.2f} MiB, "
                      f"{cpu['n_offloaded']} activations offloaded ({cpu['offloaded_bytes'] / MIB:.1f} MiB), "
                      f"{cpu['n_recomputed']} recomputed, step time {cpu['time_ratio']:.2f}x eager, gradients "
                      f"{'bit-identical to eager' if cpu['grads_equal'] else 'DIFFERENT from eager'}."]
    return "\n".join(lines)


ADAM_VARIANTS = {"optsched": "optsched, eager executor", "optsched_inductor": "optsched, inductor executor",
                 "inductor": "torch.compile (Inductor)"}


def adam_table(d: dict) -> str:
    def same(c: dict) -> str:
        return "bitwise" if c["bitwise"] else f"{c['max_abs_diff']:.0e}"

    lines = [
        "| Adam | param tensors | run by | first call (planning) | step time vs eager | peak above start (predicted) "
        "| state vs traced program / eager | fused kernels | copy-backs folded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in _rows_by_name(d):
        lines.append(f"| {name} | {r['param_tensors']} | eager `opt.step()` | - | 1.00x | {r['eager_peak_bytes'] / 1024:.0f} KiB "
                     "| - | - | - |")
        for key, label in ADAM_VARIANTS.items():
            if f"{key}_first_call_s" not in r:
                continue
            ours = key.startswith("optsched")
            planning = f" ({r[f'{key}_plan_s']:.1f} s)" if ours else ""
            predicted = f" ({r[f'{key}_predicted_peak_bytes'] / 1024:.0f})" if ours else ""
            folded = f"{r[f'{key}_writes_folded']} of {r['copies_captured']}" if ours else "-"
            kernels = str(r[f"{key}_fusion_groups"]) if ours else "-"
            lines.append(
                f"| {name} | {r['param_tensors']} | {label} | {r[f'{key}_first_call_s']:.1f} s{planning} | "
                f"{r[f'{key}_time_ratio']:.2f}x | {r[f'{key}_peak_bytes'] / 1024:.0f} KiB{predicted} | "
                f"{same(r[f'{key}_vs_traced'])} / {same(r[f'{key}_vs_eager'])} | {kernels} | {folded} |"
            )
    return "\n".join(lines)


def offline_table(d: dict) -> str:
    gib = 2**30
    lines = [
        "| model | ops | params | capture | budget | predicted peak | est. time | status | gap | recomputed / offloaded "
        "| plan s | planner memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in d["models"]:
        head = (f"{m['model']} ({m['batch']}) | {m['n_ops']} | {m['param_bytes'] / gib:.2f} GiB | {m['capture_s']:.1f} s")
        mem = f"+{m['rss_growth_bytes'] / 2**20:.0f} MiB"
        for b in m["budgets"]:
            if b["feasible"]:
                row = (f"{b['budget']} ({b['budget_bytes'] / gib:.2f} GiB) | {b['predicted_peak_bytes'] / gib:.2f} GiB | "
                       f"{b['time_ratio']:.3f}x | {b['solver_status']} | {b['gap']:.1%} | "
                       f"{b['n_recomputed']} / {b['n_offloaded']} | {b['plan_s']:.1f}")
            else:
                row = (f"{b['budget']} ({b['budget_bytes'] / gib:.2f} GiB) | infeasible (lowest {b['lowest_peak_bytes'] / gib:.2f}"
                       f" GiB, bound {b['lower_bound_bytes'] / gib:.2f}) | | | | | {b['plan_s']:.1f}")
            lines.append(f"| {head} | {row} | {mem} |")
            head = " | | | "
    lines += ["", "Unplanned peaks: " + ", ".join(f"{m['model']} {m['unplanned_peak_bytes'] / gib:.2f} GiB" for m in d["models"])
              + ". Planner memory: growth of the planning process's peak RSS (the parameters are fake tensors)."]
    return "\n".join(lines)


# The zoo's contracts, shared by the table here, benchmarks.zoo's console output and tests/test_zoo.py.
ZOO_PREDICTION_TOLERANCE = 0.01  # predicted peak within 1% of measured
# With no budget, measured may exceed eager's measured peak by this much. The CPU allocator reports requested
# sizes (no rounding, see optsched.measure), so the slack only covers the 0-dim scalar temporaries ops wrap
# Python numbers in (8 bytes each); it is the size of the smallest per-token tensor of the zoo's configs
# (batch 4 x sequence 64 x 4 bytes = 1 KiB), so no activation can hide in it.
ZOO_NO_BUDGET_SLACK_BYTES = 1024


def _budget_label(fraction) -> str:
    return "none" if fraction is None else f"{fraction:.0%}"


def zoo_contract_failures(case: dict) -> list[str]:
    """What one zoo case breaks: errors, gradients, budget, prediction, no-budget peak above eager."""
    if "error" in case:
        e = case["error"]
        return [f"eager: {e['type']}: {e['message']}"]
    out = []
    eager_peak = case["eager"]["measured_peak_bytes"]
    for r in case["budgets"]:
        label = _budget_label(r["fraction"])
        if "error" in r:
            e = r["error"]
            out.append(f"{label}: {e['type']} at {e['stage']}: {e['message']}")
            continue
        if r.get("infeasible"):
            if r["fraction"] is None or r["lower_bound_bytes"] <= r["budget_bytes"]:
                out.append(f"{label}: not reached (BudgetInfeasibleError): lowest found {r['lowest_peak_bytes'] / MIB:.2f} MiB "
                           f"for a budget of {r['budget_bytes'] / MIB:.2f} MiB that the proven bound "
                           f"({r['lower_bound_bytes'] / MIB:.2f} MiB) does not rule out")
            continue
        if r["max_grad_diff"] is None:
            out.append(f"{label}: gradients missing for {', '.join(r.get('grads_missing', []))}")
        elif r["max_grad_diff"] != 0:
            out.append(f"{label}: gradients differ from eager by {r['max_grad_diff']:.1e}")
        if not r["within_budget"]:
            out.append(f"{label}: measured {r['measured_peak_bytes'] / MIB:.2f} MiB over the budget "
                       f"{r['budget_bytes'] / MIB:.2f} MiB")
        rel = r.get("predicted_vs_measured")
        if rel is None:
            out.append(f"{label}: no plan")
        elif abs(rel) > ZOO_PREDICTION_TOLERANCE:
            out.append(f"{label}: predicted {r['predicted_peak_bytes'] / MIB:.2f} MiB vs measured "
                       f"{r['measured_peak_bytes'] / MIB:.2f} MiB ({rel:+.1%})")
        if r["fraction"] is None and r["measured_peak_bytes"] > eager_peak + ZOO_NO_BUDGET_SLACK_BYTES:
            out.append(f"none: measured {r['measured_peak_bytes'] / MIB:.2f} MiB above eager's {eager_peak / MIB:.2f} MiB "
                       f"(+{(r['measured_peak_bytes'] - eager_peak) / 1024:.0f} KiB)")
    return out


def zoo_table(d: dict) -> str:
    c = d["config"]
    budgets = c["budgets"]
    head = "| model | call | eager peak |"
    rule = "|---|---|---|"
    for b in budgets:
        label = "no budget" if b is None else f"{b:.0%}"
        head += f" {label}: measured | predicted | time vs eager | first call s (solver s) |"
        rule += "---|---|---|---|"
    lines = [
        f"{len(d['cases'])} cases: {c['layers']} layers, width {c['width']}, vocabulary {c['vocab']}, batch {c['batch']}, "
        f"sequence {c['seq']} (ViT: 16 images of 32x32), random weights; torch {c['torch']}, transformers "
        f"{c['transformers']}, {c['threads']} CPU threads. Peaks in MiB at the allocator; budgets are fractions of "
        f"eager's measured peak, in bytes; first call s = wall seconds of the first call, which captures, times the ops, "
        f"plans and runs the step (`first_call_s` in the JSON); solver s = the solver's share (`plan_s`: both plans' when "
        f"the second step planned again for what the caller does with the outputs). The whole zoo took "
        f"{c['total_s'] / 60:.0f} min.",
        "",
        head,
        rule,
    ]
    for case in d["cases"]:
        row = f"| {case['model']} | {case['pattern']} |"
        if "error" in case:
            lines.append(row + f" eager fails: {case['error']['type']} |" + " | | | |" * len(budgets))
            continue
        row += f" {case['eager']['measured_peak_bytes'] / MIB:.2f} |"
        for r in case["budgets"]:
            if "error" in r:
                row += f" fails: {r['error']['type']} | | | |"
            elif r.get("infeasible"):
                gave_up = f"{r['first_call_s']:.1f} (no plan)" if "first_call_s" in r else ""
                row += (f" infeasible (lowest {r['lowest_peak_bytes'] / MIB:.2f}, bound {r['lower_bound_bytes'] / MIB:.2f}) "
                        f"| | | {gave_up} |")
            else:
                over = " (over)" if not r["within_budget"] else ""
                t = f"{r['time_ratio']:.2f}x" if "time_ratio" in r else ""
                row += (f" {r['measured_peak_bytes'] / MIB:.2f}{over} | {r['predicted_peak_bytes'] / MIB:.2f} | {t} | "
                        f"{r['first_call_s']:.1f} ({r['plan_s']:.1f}) |")
        lines.append(row)
    failures = [(case, f) for case in d["cases"] for f in zoo_contract_failures(case)]
    if failures:
        lines += ["", "Contracts broken (gradients equal to eager's, measured within the budget, predicted within "
                      f"{ZOO_PREDICTION_TOLERANCE:.0%} of measured, no budget not above eager's peak, errors):", ""]
        lines += [f"- {case['model']} [{case['pattern']}]: {f}" for case, f in failures]
    else:
        lines += ["", "Every case keeps every contract."]
    return "\n".join(lines)


# --------------------------------------------------------------------------- training loops (benchmarks/loops.py)

# The loops' contracts, shared by the table here and tests/test_loops.py; tolerances are the zoo's.
LOOP_CONTRACTS = ("steps", "gradients", "budget", "prediction", "replans")
# where torch.compile's own capture (aot_eager) is not bitwise eager's, gradients are compared to this tolerance
LOOP_GRAD_TOLERANCE = 1e-6


def loop_contract_failures(case: dict) -> dict[str, list[str]]:
    """What one loop breaks, per contract: `steps` (a step failed: an error, or a BudgetInfeasibleError whose
    budget the proven bound does not rule out), `gradients` (not eager's: bitwise, or within LOOP_GRAD_TOLERANCE
    where torch.compile(backend="aot_eager") alone differs from eager), `budget` (a call measured over the bytes its
    plan was given), `prediction` (predicted not within ZOO_PREDICTION_TOLERANCE of measured), `replans` (a program
    planned again where the model computes its loss, more than once where the caller does, or while measured)."""
    out: dict[str, list[str]] = {k: [] for k in LOOP_CONTRACTS}
    if "error" in case:
        e = case["error"]
        out["steps"].append(f"{e['stage']}: {e['type']}: {e['message']}")
        return out
    ref = case.get("reference_grad_diff")
    tol = LOOP_GRAD_TOLERANCE if ref else 0.0
    for s in case["steps"]:
        if s.get("outcome") != "fitted":
            e = s["error"]
            if s.get("outcome") == "infeasible" and s.get("proven"):
                continue  # no plan can fit: the error is the answer
            extra = ""
            if s.get("outcome") == "infeasible":
                extra = (f" (budget {s['budget_bytes'] / MIB:.2f} MiB, lowest found {s['lowest_peak_bytes'] / MIB:.2f}, "
                         f"proven bound {s['lower_bound_bytes'] / MIB:.2f})")
            out["steps"].append(f"{s['step']}: {e['type']} at {e['stage']}: {e['message'][:160]}{extra}")
            continue
        d = s.get("max_grad_diff")
        if d is None:
            out["gradients"].append(f"{s['step']}: gradients missing for {', '.join(s.get('grads_missing', []))}")
        elif d > tol:
            why = f" (torch.compile alone: {ref:.1e})" if ref else ""
            out["gradients"].append(f"{s['step']}: gradients differ from eager by {d:.1e}{why}")
        for j, c in enumerate(s["calls"]):
            call = f"{s['step']}" + (f", micro-batch {j}" if len(s["calls"]) > 1 else "")
            if c.get("planned_while_measured"):
                out["replans"].append(f"{call}: planned again in the measured pass (output usage {c.get('output_usage')})")
            if "measured_peak_bytes" not in c:
                out["budget"].append(f"{call}: not measured")
                continue
            peak = c["measured_peak_bytes"]
            if c.get("budget_bytes") is not None and peak > c["budget_bytes"]:
                out["budget"].append(f"{call}: measured {peak / MIB:.2f} MiB, {peak - c['budget_bytes']:,} B over the budget "
                                     f"{c['budget_bytes'] / MIB:.2f} MiB (predicted {c['predicted_peak_bytes'] / MIB:.2f} MiB)")
            if c.get("predicted_peak_bytes") is None:
                out["prediction"].append(f"{call}: no plan")
                continue
            rel = (c["predicted_peak_bytes"] - peak) / peak
            if abs(rel) > ZOO_PREDICTION_TOLERANCE:
                out["prediction"].append(f"{call}: predicted {c['predicted_peak_bytes'] / MIB:.2f} MiB, measured "
                                         f"{peak / MIB:.2f} MiB ({rel:+.1%})")
    per_program: dict[str, int] = {}
    for r in case.get("summary", {}).get("replans", []):
        per_program[r["program"]] = per_program.get(r["program"], 0) + 1
        if not case.get("replan_expected") or per_program[r["program"]] > 1:
            out["replans"].append(f"{r['step']}: planned again (output usage {r['output_usage_before']} -> "
                                  f"{r['output_usage_after']})")
    return out


def _loop_budget(case: dict) -> str:
    nbytes = case.get("budget_bytes_all") or []
    spec = "none" if case.get("budget") is None else str(case["budget"])
    if not nbytes:
        return spec
    lo, hi = f"{nbytes[0] / MIB:.2f}", f"{nbytes[-1] / MIB:.2f}"
    return f"{spec} ({lo} MiB)" if lo == hi else f"{spec} ({lo}-{hi} MiB)"


def _loop_steps(case: dict) -> str:
    m = case["summary"]
    failed = [s for s in case["steps"] if s.get("outcome") != "fitted"]
    text = f"{m['n_fitted']}/{m['n_steps']}"
    if failed:
        text += "; " + ", ".join(f"{s['step']}: {s['error']['type']}" for s in failed)
    return text


def loops_table(d: dict) -> str:
    c = d["config"]
    git = c.get("git") or {}
    core = [f for f in git.get("modified", []) if f.startswith(("optsched/", "solvers/"))]
    state = ("clean tree" if git.get("clean") else "tree state unknown" if git.get("clean") is None else
             f"tree not clean: {len(git.get('modified', []))} files modified, {len(core)} of them in optsched/ and solvers/")
    lines = [
        f"{len(d['cases'])} loops of {c['steps']} optimizer steps, {c['size']} size ({c['layers']} layers, width "
        f"{c['width']}, vocabulary {c['vocab']}, batch {c['batch']}, sequence {c['seq']}; lengths "
        f"{', '.join(map(str, c['lengths']))}; UNet {c['image']}x{c['image']}), random weights; torch {c['torch']}, "
        f"transformers {c['transformers']}, {c['threads']} CPU threads; commit {str(git.get('commit'))[:7]} ({state}), "
        f"{c.get('date', '')[:10]}. Peaks in MiB at the allocator, per forward+backward call (what was live at its start, "
        "gradients already accumulated included, plus its rise; the optimizer's state is outside the budget), each "
        "step's calls measured again after the loop on the plans the loop made (a plan made under the profiler "
        "would not know its kernels' scratch space); measured / budget: the largest measured peak, and in "
        "brackets the call closest to (or furthest over) the bytes its plan was given, as a share of them; "
        "predicted: the largest planned peak; time: the "
        "loop's steps against eager's, timed alternately; plan s: the seconds of the loop's calls that planned "
        "(capture, op timing, solving). "
        f"The loops took {c['total_s'] / 60:.0f} min.",
        "",
        "| loop | model | budget | steps fitted | measured / budget | predicted | time vs eager | grads vs eager | plan s "
        "| plans |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in d["cases"]:
        head = f"| {case['loop']} | {case['model']} |"
        if "error" in case:
            lines.append(f"{head} {case['budget']} | fails: {case['error']['type']} ({case['error']['stage']}) | | | | | | |")
            continue
        m = case["summary"]
        if m["measured_vs_budget"] is None:
            ratio = "-"
        else:
            over = " OVER" if m["measured_vs_budget"] > 1 else ""
            ratio = f"{m['measured_peak_bytes'] / MIB:.2f} ({m['measured_vs_budget']:.1%}){over}"
        pred = "-" if m["predicted_peak_bytes"] is None else f"{m['predicted_peak_bytes'] / MIB:.2f}"
        rel = m.get("worst_predicted_vs_measured")
        if rel is not None and abs(rel) > ZOO_PREDICTION_TOLERANCE:
            pred += f" ({rel:+.1%} vs measured)"
        t = f"{case['time_ratio']:.2f}x" if "time_ratio" in case else ""
        g = m["max_grad_diff"]
        grads = "-" if not m["n_fitted"] else "missing" if g is None else "equal" if g == 0 else f"{g:.1e}"
        if case.get("reference_grad_diff"):
            grads += f" (torch.compile alone: {case['reference_grad_diff']:.1e})"
        plans = f"{m['n_plans']}" + (f" ({len(m['replans'])} re-planned)" if m["replans"] else "")
        failed = f"; failed calls {m['failed_calls_s']:.1f}" if m.get("failed_calls_s") else ""
        lines.append(f"{head} {_loop_budget(case)} | {_loop_steps(case)} | {ratio} | {pred} | {t} | {grads} | "
                     f"{case['planning_s']:.1f} (solver {case['solve_s']:.1f}{failed}) | {plans} |")
    broken = [(case, k, f) for case in d["cases"] for k, fs in loop_contract_failures(case).items() for f in fs]
    if broken:
        lines += ["", "Contracts broken (every step fitted, gradients equal to eager's, every call within its budget, "
                      f"predicted within {ZOO_PREDICTION_TOLERANCE:.0%} of measured, no program planned again where the "
                      "model computes its loss):", ""]
        lines += [f"- {case['model']}, {case['loop']}: {k}: {f}" for case, k, f in broken]
    else:
        lines += ["", "Every loop keeps every contract."]
    notes = [f"- {case['model']}, {case['loop']}: {case['note']}" for case in d["cases"] if case.get("note")]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


# --------------------------------------------------------------------------- tight budgets (benchmarks/tight_budgets.py)

def _labels(runs: dict) -> list[str]:
    """'before' first, 'after' second, the others by date."""
    order = {"before": 0, "after": 1}
    return sorted(runs, key=lambda k: (order.get(k, 2), runs[k].get("date", ""), k))


def _tight_peak(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return f"fails: {r['error']['type']} ({r['error']['stage']})"
    if r.get("infeasible") and r.get("searched") is False:  # no search ran: the peak it carries is the unplanned one
        return f"infeasible (proven: bound {r['lower_bound_bytes'] / MIB:.2f})"
    if r.get("infeasible"):
        return f"infeasible (lowest {r['lowest_peak_bytes'] / MIB:.2f})"
    text = f"{r['predicted_peak_bytes'] / MIB:.2f}"
    if "measured_peak_bytes" in r:
        meas = r["measured_peak_bytes"]
        text += " = meas" if meas == r["predicted_peak_bytes"] else f" / meas {meas / MIB:.2f}"
        if not r["within_budget"]:
            text += " OVER"
    if r.get("infeasible_on_replan"):
        text += f"; replan infeasible (lowest {r['lowest_peak_bytes'] / MIB:.2f})"
    return text


def _tight_grads(r: dict | None) -> str:
    if r is None or "measured_peak_bytes" not in r:
        return ""
    d = r["max_grad_diff"]
    return "missing" if d is None else ("equal" if d == 0 else f"{d:.1e}")


def _tight_time(r: dict | None) -> str:
    return f"{r['time_ratio']:.2f}x" if r and "time_ratio" in r else ""


def _tight_status(r: dict | None) -> str:
    if r is None or "solver_status" not in r:
        return ""
    return f"{r['solver_status']} {r['gap']:.1%}"


def _tight_plan_s(r: dict | None) -> str:
    if r is None:
        return ""
    s = r.get("plan_s", r.get("first_call_s"))
    return "" if s is None else f"{s:.1f}"


def _lowest_cell(low: dict | None) -> str:
    if low is None:
        return "-"
    if low.get("none_found"):
        return f"none in {len(low['probes'])} probes"
    ratio = f", {low['peak_vs_bound']:.2f}x bound" if low.get("peak_vs_bound") else ""
    run = low.get("run") or {}
    meas = run.get("measured_peak_bytes")
    # the plan run may differ from the one the search found: planned again for the caller's use of the outputs
    ran = f" (ran: meas {meas / MIB:.2f})" if meas is not None and abs(meas - low["lowest_peak_bytes"]) > 0.005 * MIB else ""
    return f"{low['lowest_peak_bytes'] / MIB:.2f}{ran}{ratio}"


def tight_gpt_table(runs: dict, labels: list[str]) -> str:
    gpts = {k: runs[k]["gpt"] for k in labels if "gpt" in runs[k]}
    if not gpts:
        return ""
    labels = list(gpts)
    any_gpt = next(iter(gpts.values()))
    c = any_gpt["config"]
    eager = ", ".join(f"{k} {g['eager']['measured_peak_bytes'] / MIB:.2f} MiB" for k, g in gpts.items())
    lines = [f"GPT (benchmarks/models/gpt.py) {c['layers']} layers, width {c['width']}, batch {c['batch']}, sequence "
             f"{c['seq']}; parameters {any_gpt['eager']['param_bytes'] / MIB:.2f} MiB; eager peak: {eager}. Peaks in MiB "
             "(predicted = measured at the allocator, or both); bound = the proven lower bound reported; time = step time "
             "vs eager, timed alternately in one process; lowest feasible = the lowest peak of a plan found "
             "(benchmarks/tight_budgets.py's search), then run.", ""]
    head, rule = "| offload | budget |", "|---|---|"
    for k in labels:
        head += f" {k}: peak | bound | time | grads | plan s | status, gap |"
        rule += "---|---|---|---|---|---|"
    lines += [head, rule]
    for offload in (False, True):
        keys = sorted({r["fraction"] for g in gpts.values() for r in g["rows"] if r["offload"] == offload}, reverse=True)
        for frac in keys:
            row = f"| {'yes' if offload else 'no'} | {frac:.0%} |"
            for k in labels:
                r = next((r for r in gpts[k]["rows"] if r["offload"] == offload and r["fraction"] == frac), None)
                bound = f"{r['lower_bound_bytes'] / MIB:.2f}" if r and r.get("lower_bound_bytes") else ""
                row += (f" {_tight_peak(r)} | {bound} | {_tight_time(r)} | {_tight_grads(r)} | {_tight_plan_s(r)} | "
                        f"{_tight_status(r)} |")
            lines.append(row)
        row = f"| {'yes' if offload else 'no'} | lowest feasible |"
        for k in labels:
            low = next((x for x in gpts[k].get("lowest", []) if x["offload"] == offload), None)
            r = (low or {}).get("run")
            bound = f"{low['bound_bytes'] / MIB:.2f}" if low and low.get("bound_bytes") else ""
            search = f"{low['search_s']:.0f} ({len(low['probes'])} probes)" if low else ""
            row += (f" {_lowest_cell(low)} | {bound} | {_tight_time(r)} | {_tight_grads(r)} | {search} | "
                    f"{_tight_status(r)} |")
        lines.append(row)
    methods = []
    for k in labels:
        for r in gpts[k]["rows"]:
            if r.get("method"):
                methods.append(f"- {k}, offload {'yes' if r['offload'] else 'no'}, {r['fraction']:.0%}: {r['method']}")
        for low in gpts[k].get("lowest", []):
            if (low.get("run") or {}).get("method"):
                methods.append(f"- {k}, offload {'yes' if low['offload'] else 'no'}, lowest feasible "
                               f"({low['budget_bytes'] / MIB:.2f} MiB budget): {low['run']['method']}")
    if methods:
        lines += ["", "Solver methods:", "", *methods]
    return "\n".join(lines)


def tight_zoo_table(runs: dict, labels: list[str]) -> str:
    zoos = {k: runs[k]["zoo"] for k in labels if "zoo" in runs[k]}
    if not zoos:
        return ""
    labels = list(zoos)
    c = next(iter(zoos.values()))["config"]
    fracs = sorted({f for z in zoos.values() for f in z["config"]["budgets"]}, reverse=True)
    lines = [f"Zoo cases (benchmarks/zoo.py, {c['size']} size: {c['layers']} layers, width {c['width']}, batch {c['batch']}, "
             f"sequence {c['seq']}). Each cell: measured peak in MiB (or infeasible, with the lowest peak found), time vs "
             "eager, plan s. Lowest feasible: the lowest peak of a plan found and its ratio to the bound, time vs eager "
             "of that plan, seconds the search took. " + "; ".join(f"{k}: {z['config']['total_s'] / 60:.0f} min"
                                                                  for k, z in zoos.items()) + ".", ""]
    head, rule = "| model | call | eager |", "|---|---|---|"
    for k in labels:
        head += "".join(f" {k}: {f:.0%} |" for f in fracs) + f" {k}: lowest feasible | bound |"
        rule += "---|" * (len(fracs) + 2)
    lines += [head, rule]
    names = list(dict.fromkeys(case["case"] for z in zoos.values() for case in z["cases"]))
    for name in names:
        cases = {k: next((x for x in z["cases"] if x["case"] == name), None) for k, z in zoos.items()}
        some = next(x for x in cases.values() if x is not None)
        eager = next((f"{x['eager']['measured_peak_bytes'] / MIB:.2f}" for x in cases.values() if x and "eager" in x), "-")
        row = f"| {some['model']} | {some['pattern']} | {eager} |"
        for k in labels:
            case = cases[k]
            if case is None or "error" in case:
                row += (" fails |" if case else " - |") * (len(fracs) + 2)
                continue
            for f in fracs:
                r = next((r for r in case["rows"] if r["fraction"] == f), None)
                extra = ", ".join(x for x in (_tight_time(r), f"{_tight_plan_s(r)} s" if r else "") if x)
                cell = _tight_peak(r)
                if r and "measured_peak_bytes" in r:
                    cell = f"{r['measured_peak_bytes'] / MIB:.2f}" + (" OVER" if not r["within_budget"] else "")
                row += f" {cell}{', ' + extra if extra else ''} |"
            low = case.get("lowest")
            r = (low or {}).get("run")
            extra = ", ".join(x for x in (_tight_time(r), f"{low['search_s']:.0f} s" if low else "") if x)
            row += f" {_lowest_cell(low)}{', ' + extra if extra else ''} |"
            row += f" {low['bound_bytes'] / MIB:.2f} |" if low and low.get("bound_bytes") else " |"
        lines.append(row)
    return "\n".join(lines)


def tight_tables(d: dict) -> str:
    runs = d.get("runs", {})
    labels = _labels(runs)

    def commit(k: str) -> str:
        run = runs[k]
        by_part = {part: run[part]["git"] for part in ("gpt", "zoo") if run.get(part, {}).get("git")}
        if len({g.get("commit") for g in by_part.values()}) > 1:  # the parts ran on different commits
            return ", ".join(f"{part} on {_git_text(g)}" for part, g in by_part.items())
        return _git_text(run.get("meta") or next(iter(by_part.values()), run.get("git", {})))

    commits = "; ".join(f"{k}: {commit(k)}, {runs[k].get('date', '')[:10]}" for k in labels)
    parts = [f"Runs: {commits}.", tight_gpt_table(runs, labels), tight_zoo_table(runs, labels), _notes(runs, labels)]
    return "\n\n".join(p for p in parts if p)


README_RUNS = 3  # tight-budget runs the README's summary shows side by side


def tight_summary_table(d: dict) -> str:
    """README: the tight-budget benchmark, the runs side by side, one line per case: the lowest feasible peak
    (and its gap to the run's proven bound), then each budget's step time vs eager (or infeasible) and plan s."""
    runs = d.get("runs", {})
    labels = _labels(runs)
    if len(labels) < 1:
        return ""
    labels = labels[:1] + labels[1:][-README_RUNS + 1:]  # the first run and the latest: docs/benchmarks.md has them all
    cases: dict[str, dict[str, tuple]] = {}  # name -> label -> (rows, lowest)
    for k in labels:
        run = runs[k]
        for offload in (False, True):
            rows = [r for r in run.get("gpt", {}).get("rows", []) if r["offload"] == offload]
            low = next((x for x in run.get("gpt", {}).get("lowest", []) if x["offload"] == offload), None)
            if rows:
                cases.setdefault(f"GPT, offload {'on' if offload else 'off'}", {})[k] = (rows, low)
        for case in run.get("zoo", {}).get("cases", []):
            if "rows" in case:
                cases.setdefault(f"{case['model']}, {case['pattern']}", {})[k] = (case["rows"], case.get("lowest"))

    def lowest(low: dict | None) -> str:
        if not low or low.get("lowest_peak_bytes") is None:
            return "none found" if low else "-"
        peak, bound = low["lowest_peak_bytes"], low.get("bound_bytes")
        gap = f" ({(peak - bound) / peak:.0%} over bound {bound / MIB:.2f})" if bound else ""
        return f"{peak / MIB:.2f}{gap}"

    def budget(r: dict) -> str:
        if r.get("infeasible"):
            return f"infeasible, {_tight_plan_s(r)} s"
        if "error" in r:
            return "fails"
        return f"{_tight_time(r) or '?'}, {_tight_plan_s(r)} s"

    fracs = sorted({r["fraction"] for c in cases.values() for rows, _ in c.values() for r in rows}, reverse=True)
    head = "| case | " + " | ".join(f"lowest feasible MiB: {k}" for k in labels) + " | " + " | ".join(
        f"{f:.0%}: {k}" for f in fracs for k in labels) + " |"
    lines = [head, "|---|" + "---|" * (len(labels) * (1 + len(fracs)))]
    for name, by in cases.items():
        cells = [lowest(by[k][1]) if k in by else "-" for k in labels]
        for f in fracs:
            for k in labels:
                r = next((r for r in by[k][0] if r["fraction"] == f), None) if k in by else None
                cells.append(budget(r) if r else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    commits = "; ".join(f"{k}: {_git_text(runs[k].get('meta') or runs[k].get('git', {}))}" for k in labels)
    return (f"Runs: {commits}. Lowest feasible: the lowest predicted peak of a plan found (benchmarks/tight_budgets.py's "
            "probes) and how far it is above that run's proven lower bound; per budget (a share of eager's measured "
            "peak): step time vs eager and plan seconds. Every table of it: [docs/benchmarks.md](docs/benchmarks.md)."
            "\n\n" + "\n".join(lines))


def planning_time_table(d: dict) -> str:
    """benchmarks/planning_time.py: planning wall seconds against time_limit_s, what 4x the limit changed, and the
    clock's calibration fit."""
    t = d["time_limit_s"]
    if "worst_plan_over_limit" not in d:  # a run from before the planning account (solve seconds only)
        return _planning_time_solves(d)
    lines = [f"`time_limit_s` T = {t:g} s, deterministic, `executor=\"inductor\"` (fusion options), `chunking=True` "
             f"on the models with an LM head + cross-entropy; {d['threads']} threads. plan = wall seconds of each "
             "program's planning after capture (op timing, problem building, bounds, every solve, fusion compiles); "
             "first call = everything (capture, planning, lowering, the step). Infeasible budgets are solved again "
             "at 4T. llama-7b-80: plan_offline at the default limit (fake tensors, h100 profile).", "",
             "| model | budget | T | plan s | worst program / its limit | first call s | result | 4T changed the answer |",
             "|---|---|---|---|---|---|---|---|"]
    for case in d["cases"]:
        for r in case["rows"] + case["longer"]:
            lines.append(f"| {case['case']} | {r['budget']} | {r['time_limit_s']:g} | {r['plan_s']:.1f} | "
                         f"{r['plan_over_limit']:.2f} | {r['first_call_s']:.1f} | {_planning_result(r)} | "
                         f"{_changed(r)} |")
    worst = d.get("worst_plan_over_limit")
    lines += ["", f"Worst planning time / limit: {worst:.2f} (the issue's allowance: {d['slack']}); "
              + ("every run within it." if d.get("within_slack") else "**over it in some runs.**")]
    m = (d.get("meta") or {}).get("machine")
    if m:  # the clock counts seconds of the reference machine: wall seconds scale with the machine's speed
        lines += ["", f"Machine: {m.get('cpu')}, {m.get('cpus')} CPUs, CPU probe {m.get('probe_s')} s "
                      "(benchmarks/meta.py's `cpu_probe`: a fixed pure-Python loop, lower is faster)."]
    if any(p.get("stages") for c in d["cases"] for r in c["rows"] + c["longer"] for p in r.get("programs", [])):
        lines += ["", _stages_table(d)]
    if d.get("fit"):
        lines += ["", _calibration_table(d["fit"])]
    return "\n".join(lines)


STAGES = ("op timing", "problem building", "bound", "simulation", "cp-sat", "search", "fusion compiles")


def _stages_table(d: dict) -> str:
    """Where each run's planning wall seconds went, summed over its programs (optsched's `clock.stage`): each stage's
    own seconds, the rest (wall seconds in no stage: the planner's own Python) and the clock's count beside them."""
    lines = ["Where the planning's wall seconds went (each run's programs together; `clock.stage`: a stage's own "
             "seconds, those of the stages inside it left out; search = the portfolio's own work, building CP-SAT "
             "models included; rest = in no stage; clock = the seconds the clock counted, capture charges left out):",
             "", "| model | budget | T | wall s | " + " | ".join(STAGES) + " | rest | clock s |",
             "|---|---|---|---|" + "---|" * (len(STAGES) + 2)]
    for case in d["cases"]:
        for r in case["rows"] + case["longer"]:
            progs = r.get("programs", [])
            stages = stage_seconds(progs)
            lines.append(f"| {case['case']} | {r['budget']} | {r['time_limit_s']:g} | {sum(p['wall_s'] for p in progs):.2f} | "
                         + " | ".join(f"{stages.get(k, 0.0):.2f}" for k in STAGES)
                         + f" | {stages['rest']:.2f} | {sum(p['clock_s'] for p in progs):.2f} |")
    return "\n".join(lines)


def _planning_result(r: dict) -> str:
    if r.get("offline"):  # plan_offline on fake tensors: GiB, the estimated step time, capture beside planning
        got = (f"fits, {r['predicted_peak_bytes'] / 2**30:.2f} GiB, est. {r['time_ratio']:.3f}x" if r["fits"]
               else f"infeasible, lowest {r['lowest_peak_bytes'] / 2**30:.2f} GiB")
        charged = any("charged" in p for p in r.get("programs", []))  # plan_offline's limit covers its capture
        return (f"{got}; offline ({r['offline']} profile), capture {r['capture_s']:.1f} s in the first call"
                + (", in the limit" if charged else ""))
    if r["fits"]:
        return f"fits, {r['predicted_peak_bytes'] / MIB:.2f} MiB" + (f", chunks {r['chunks']}" if r.get("chunks") else "")
    return f"infeasible, lowest {r['lowest_peak_bytes'] / MIB:.2f} MiB" + (" (proven)" if r.get("proven") else "")


def _changed(r: dict) -> str:
    return "" if "lowest_changed" not in r else ("yes" if r["lowest_changed"] else "no")


def _calibration_table(fit: dict) -> str:
    """The clock's table (solvers/model/calibration.py) in use, its least-squares refit on these runs, and both
    residuals (clock seconds / wall seconds - 1 per program)."""
    def spread(rs: list[float]) -> str:
        return f"{min(rs):+.0%} to {max(rs):+.0%}" if rs else "-"

    at = fit.get("fitted_at") or {}
    lines = [f"The clock's calibration (solvers/model/calibration.py, fitted at {at.get('commit') or 'no commit'}: "
             f"{at.get('how', '')}) and its least-squares refit on these {fit['samples']} programs "
             "(benchmarks/calibration_fit.py; seconds per unit):", "",
             "| unit | table | refit |", "|---|---|---|"]
    for k in sorted(set(fit["table"]) | set(fit["seconds"])):
        lines.append(f"| {k} | {fit['table'].get(k, float('nan')):.3g} | {fit['seconds'].get(k, float('nan')):.3g} |")
    lines += ["", f"Residuals per program: table {spread(fit['table_residuals'])}, refit {spread(fit['residuals'])}."]
    return "\n".join(lines)


def _planning_time_solves(d: dict) -> str:
    t = d["time_limit_s"]
    lines = [f"`time_limit_s` T = {t:g} s; solve = wall seconds inside the planner's solves only.", "",
             "| model | budget | T | solve s | solve / T | first call s | result | 4T changed the answer |",
             "|---|---|---|---|---|---|---|---|"]
    for case in d["cases"]:
        for r in case["rows"] + case["longer"]:
            lines.append(f"| {case['case']} | {r['budget']} | {r['time_limit_s']:g} | {r['solve_s']:.1f} | "
                         f"{r['solve_over_limit']:.2f} | {r['first_call_s']:.1f} | {_planning_result(r)} | {_changed(r)} |")
    worst = d.get("worst_solve_over_limit")
    lines += ["", f"Worst solve time / T: {worst:.2f} (the issue's allowance: {d['slack']})."]
    return "\n".join(lines)


def two_processes_table(d: dict) -> str:
    """benchmarks/two_processes.py: the tight-budget GPT planned in two fresh processes sharing one op-time file."""
    shared = ("with optsched's defaults: both use the default op-time file, in a cache directory of their own, "
              "empty at the start" if d.get("op_times") == "default" else "both naming one `$OPTSCHED_OP_TIMES` file")
    lines = ["`benchmarks.tight_budgets --parts gpt` in two fresh processes, each with its own results file, "
             f"{shared} (the first measures and writes op times, the second reads them); "
             f"{d['probes']} lowest-feasible probes. Peak planned (or, infeasible, the lowest found), MiB:", "",
             "| budget | first process | second process | equal |", "|---|---|---|---|"]
    for r in d["rows"]:
        mib = lambda b: "-" if b is None else f"{b / MIB:.2f}"  # noqa: E731
        lines.append(f"| {r['case']} | {mib(r['first'])} | {mib(r['second'])} | {'yes' if r['equal'] else '**no**'} |")
    lines += ["", "Every outcome equal." if d["all_equal"] else "**Some outcomes differ.**"]
    return "\n".join(lines)


PEERS_IN_BACKWARD = ("PyTorch tutorial hooks", "torchtune-style, one optimizer")  # update every parameter in the backward


def _whole_step_row(m: dict, r: dict) -> str:
    """One row of whole_step_table: what fits, the peaks, what updates in the backward, time and weights vs eager."""
    budget = r["budget"] if r["budget"] in ("-", "none") else f"{r['budget']} ({r['budget_bytes'] / MIB:.2f} MiB)"
    if r.get("infeasible"):
        why = (f"no: lowest found {r['lowest_peak_bytes'] / MIB:.2f} MiB" if r["searched"]
               else f"no: below the proven bound {r['lower_bound_bytes'] / MIB:.2f} MiB")
        if r.get("no_plan_at_lowest"):
            why += ", and none planned at it"
        return f"| {m['model']} | {budget} | {r['method']} | {why} | | | | | |"
    over = r["measured_peak_bytes"] - (r.get("budget_bytes") or 0)
    fits = ("-" if r["budget"] in ("-", "none") else "yes" if r["fits"] else f"**no** (+{over / 1024:.1f} KiB)")
    peak = f"{r['measured_peak_bytes'] / MIB:.2f} ({r['measured_peak_bytes'] / m['eager_peak_bytes']:.0%})"
    predicted = f"{r['predicted_peak_bytes'] / MIB:.2f}" if "predicted_peak_bytes" in r else "-"
    n = m["param_tensors"]
    in_bwd = (f"{r['updates_in_backward']} of {n}" if "updates_in_backward" in r
              else f"{n} of {n}" if r["method"] in PEERS_IN_BACKWARD else f"0 of {n}")
    same = "-" if r.get("bitwise") is None else ("bitwise" if r["bitwise"] else "**differ**")
    replanned = " (replanned)" if r.get("replanned") else ""
    return (f"| {m['model']} | {budget} | {r['method']}{replanned} | {fits} | {peak} | {predicted} | {in_bwd} | "
            f"{r['time_ratio']:.2f}x | {same} |")


def whole_step_table(d: dict) -> str:
    """benchmarks/whole_step.py: the training step with AdamW's update, eager, two in-backward recipes and optsched
    (update after the backward, or "auto") at several budgets; measured and predicted peaks of the whole step."""
    c = d["config"]
    lines = [f"{c['optimizer']}, op costs measured on this CPU ({c['threads']} thread{'s' * (c['threads'] != 1)}, "
             f"torch {c['torch']}), "
             f"time_limit_s {c['time_limit_s']:g}. " + " ".join(
                 f"{m['model']}: {m['description']}; {m['param_tensors']} parameter tensors, "
                 f"{m['param_bytes'] / MIB:.2f} MiB; eager's peak {m['eager_peak_bytes'] / MIB:.2f} MiB."
                 for m in d["models"]),
             "", "| model | budget | method | fits | measured peak MiB (vs eager) | predicted MiB | updated in backward "
             "| time vs eager | weights after 3 steps vs eager |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [_whole_step_row(m, r) for m in d["models"] for r in m["rows"]]
    below = [line for m in d["models"] for line in _below_bound(m)]
    return "\n".join(lines + ([""] + below if below else []))


def _below_bound(m: dict) -> list[str]:
    """Issue 36's item 1, per offload setting: the step with updates inside the backward at 10% below the proven
    bound of the step with the update after it (the highest bound its refusals reported), and the lowest measured."""
    out = []
    for suffix, label in (("", "without offloading"), (", offload", "with offloading")):
        after = [r for r in m["rows"] if r["method"] == f"optsched, update after backward{suffix}"]
        bounds = [r["lower_bound_bytes"] for r in after if r.get("infeasible") and r.get("lower_bound_bytes")]
        auto = {r["budget"]: r for r in m["rows"] if r["method"] == f"optsched, auto{suffix}"}
        if not bounds:
            continue
        bound = max(bounds)
        text = f"{m['model']}, {label}: proven bound with the update after the backward {bound / MIB:.2f} MiB"
        below = auto.get("bound-10%")
        if below is not None:
            text += (f"; at 10% below it ({below['budget_bytes'] / MIB:.2f} MiB) updates inside the backward "
                     + (f"fit: measured {below['measured_peak_bytes'] / MIB:.2f} MiB, predicted "
                        f"{below['predicted_peak_bytes'] / MIB:.2f}" if not below.get("infeasible") and below["fits"]
                        else "do not fit" + (f" (lowest found {below['lowest_peak_bytes'] / MIB:.2f} MiB)"
                                             if below.get("infeasible") else "")))
        low = auto.get("lowest")
        if low is not None and not low.get("infeasible"):
            peak = low["measured_peak_bytes"]
            text += f"; the lowest probe measured {peak / MIB:.2f} MiB, {1 - peak / bound:.1%} below the bound"
        out.append(text + ".")
    return out


def _git_text(git: dict) -> str:
    """A run's commit: from its ``meta`` (benchmarks/meta.py: clean or dirty tree), or, for runs written before it,
    the git state they recorded (the commit and whether optsched/ and solvers/ differed from it)."""
    if "clean" in git:
        return f"{git.get('short') or str(git.get('commit'))[:7]} ({'clean' if git['clean'] else 'dirty'})"
    return git.get("short", "?") + (" + uncommitted core changes" if git.get("core_changes_uncommitted") else "")


def _notes(runs: dict, labels: list[str]) -> str:
    """A run's ``notes`` (a list of strings in its JSON, written by hand: what the table cannot say)."""
    return "\n".join(f"- {k}: {n}" for k in labels for n in runs[k].get("notes", []))


def scaling_llama_table(d: dict) -> str:
    runs = d.get("runs", {})
    gib = 2**30
    out = []
    for k in _labels(runs):
        run = runs[k]
        c = run["config"]
        row_commits = sorted({_git_text(r["git"]) for r in run["rows"] if r.get("git")})
        meta = run.get("meta")
        if meta and all(r.get("git", {}).get("commit") in (None, meta.get("commit")) for r in run["rows"]):
            commit = _git_text(meta)
        else:
            commit = ", ".join(row_commits) if row_commits else _git_text(run.get("git", {}))
        lines = [f"{k} ({commit}, {run.get('date', '')[:10]}): {c['describe']}; each plan "
                 f"in its own process, wall-clock limit {c['timeout_s']:.0f} s.", "",
                 "| layers | budget | ops | plan s | s / layer | capture s | capture + plan s | status | gap "
                 "| predicted / unplanned | unplanned peak | lower bound | est. time vs unplanned |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["rows"]:
            head = f"| {r['layers']} | {r['fraction']:.0%} |"
            capture = "" if r.get("capture_s") is None else f"{r['capture_s']:.1f}"
            if r.get("capture_s") is not None and r.get("plan_s") is not None:
                capture += f" | {r['capture_s'] + r['plan_s']:.1f}"
            else:
                capture += " |"
            if r.get("timed_out"):
                lines.append(f"{head} | over {r['timeout_s']:.0f} (stopped) | | | | timed out | | | | | |")
            elif r.get("skipped"):
                lines.append(f"{head} | not run ({r['skipped']}) | | | | | | | | | |")
            elif "error" in r:
                lines.append(f"{head} | | | | | fails: {r['error'][:80]} | | | | | |")
            elif r.get("infeasible"):
                lines.append(f"{head} | {r['plan_s']:.1f} | {r['plan_s'] / r['layers']:.2f} | {capture} | infeasible | | lowest "
                             f"{r['lowest_peak_bytes'] / r['unplanned_peak_bytes']:.1%} | {r['unplanned_peak_bytes'] / gib:.2f} GiB "
                             f"| {r['lower_bound_bytes'] / gib:.2f} GiB | |")
            else:
                lines.append(f"{head} {r['n_ops']} | {r['plan_s']:.1f} | {r['plan_s'] / r['layers']:.2f} | {capture} | "
                             f"{r['solver_status']} | "
                             f"{r['gap']:.2%} | {r['predicted_peak_bytes'] / r['unplanned_peak_bytes']:.1%} | "
                             f"{r['unplanned_peak_bytes'] / gib:.2f} GiB | {r['lower_bound_bytes'] / gib:.2f} GiB | "
                             f"{r['time_ratio']:.3f}x |")
        for budget, lin in run.get("linearity", {}).items():
            lines += ["", f"{budget}: plan s = {lin['intercept_s']:.1f} + {lin['slope_s_per_layer']:.2f} x layers "
                          f"(least squares over {', '.join(map(str, lin['layers']))} layers); seconds per layer grow "
                          f"{lin['s_per_layer_growth']:.2f}x from {lin['layers'][0]} to {lin['layers'][-1]} layers: "
                          + ("roughly linear." if lin["roughly_linear"] else "not linear.")]
        if any(r.get("stages") for r in run["rows"]):
            lines += ["", _per_op_stages(run["rows"])]
        if run.get("notes"):
            lines += ["", *(f"- {n}" for n in run["notes"])]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _per_op_stages(rows: list[dict]) -> str:
    """Microseconds per op of capture and of each planning stage (optsched's `clock.stage`), by depth: what grows
    faster than the graph shows as a column that grows down the table."""
    stages = ("problem building", "bound", "simulation", "cp-sat", "search", "rest")
    lines = ["Microseconds per op of capture and of each planning stage (`clock.stage`; search = the portfolio's own "
             "work; rest = planning in no stage):", "",
             "| layers | budget | ops | capture | " + " | ".join(stages) + " |", "|---|---|---|---|" + "---|" * len(stages)]
    for r in sorted((r for r in rows if r.get("stages") and r.get("n_ops")), key=lambda r: (-r["fraction"], r["layers"])):
        per_op = [1e6 * s / r["n_ops"] for s in [r["capture_s"] or 0.0, *(r["stages"].get(k, 0.0) for k in stages)]]
        lines.append(f"| {r['layers']} | {r['fraction']:.0%} | {r['n_ops']} | " + " | ".join(f"{v:.0f}" for v in per_op)
                     + " |")
    return "\n".join(lines)


def chunking_table(d: dict) -> str:
    """benchmarks/chunking.py: forced chunk counts, the planner's choice at three budgets, chunk or recompute."""
    mm = re.compile(r"^(mm|addmm|bmm|baddbmm|_scaled_dot_product)")
    mib = lambda b: "-" if b is None else f"{b / MIB:.1f}"  # noqa: E731
    c = d["config"]
    lines = [
        f"vocabulary {c['vocab_size']}, {c['n_layer']} layers, width {c['n_embd']}, batch {c['batch']} x {c['seq']} tokens, "
        f"{c['threads']} CPU threads; eager peak {mib(d['eager_peak_bytes'])} MiB.",
        "",
        "| chunks | budget MiB | predicted peak MiB | measured peak MiB | estimated ms | step ms | x eager | recomputed ops "
        "| max grad diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for part, rows in (("forced", d["forced"]), ("chosen", d["choice"])):
        for r in rows:
            if r.get("infeasible"):
                lines.append(f"| none fits | {mib(r['budget_bytes'])} | lowest found {mib(r['lowest_peak_bytes'])} | | | | | | |")
                continue
            budget = "none" if r["budget_bytes"] is None else f"{mib(r['budget_bytes'])} ({r['fraction']:.0%})"
            rec = f"{r['n_recomputed']}" + (f" ({len(r['recomputed_matmuls'])} matmuls)" if r["recomputed_matmuls"] else "")
            lines.append(
                f"| {r['chunks']} ({part}) | {budget if part == 'chosen' else '-'} | {mib(r['predicted_peak_bytes'])} | "
                f"{mib(r['measured_peak_bytes'])} | {r['estimated_time_s'] * 1e3:.0f} | {r['step_s'] * 1e3:.0f} | "
                f"{r['time_ratio']:.2f} | {rec} | {r['max_grad_diff']:.1e} |")
    lines += ["", "Chunk or recompute (chunking on; the 1-chunk candidate is the recompute-only plan, same op costs and "
                  "budget):", "",
              "| budget MiB | recompute only: estimated ms | recomputed (matmuls) | chosen chunks | estimated ms "
              "| recomputed |", "|---|---|---|---|---|---|"]
    for r in d["recompute_sweep"]:
        if r.get("infeasible"):
            lines.append(f"| {mib(r['budget_bytes'])} | no plan fits | | | | |")
            continue
        one = next(t for t in r["trials"] if t["chunks"] == 1)
        rec = (f"{one['estimated_time_s'] * 1e3:.0f} | {one['n_recomputed']} "
               f"({sum(bool(mm.match(n)) for n in one['recomputed'])})") if one["fits"] else "does not fit | -"
        lines.append(f"| {mib(r['budget_bytes'])} ({r['fraction']:.0%}) | {rec} | {r['chunks']} | "
                     f"{r['estimated_time_s'] * 1e3:.0f} | {r['n_recomputed']} |")
    at = (d.get("chunk_or_recompute") or {}).get("chosen")
    if at and "measured_peak_bytes" in at:
        lines += ["", f"The plan chosen at {mib(at['budget_bytes'])} MiB, measured: {at['chunks']} chunks, "
                      f"{mib(at['measured_peak_bytes'])} MiB (predicted {mib(at['predicted_peak_bytes'])}), "
                      f"{at['time_ratio']:.2f}x eager's step time, gradients within {at['max_grad_diff']:.1e} of eager's."]
    return "\n".join(lines)


def headline_table(d: dict) -> str:
    """README.md's one table, from gpt_budget.json: optsched against eager and PyTorch's min-cut partitioner."""
    c, e = d["config"], d["eager"]
    lines = [
        f"The bundled GPT ({c['layers']} layers, width {c['width']}, batch {c['batch']} x {c['seq']} tokens), one training "
        f"step on this CPU ({c['threads']} threads, torch {c['torch']}); eager's peak {e['measured_peak_bytes'] / MIB:.2f} MiB.",
        "",
        "| budget | optsched: predicted peak | measured peak | step time vs eager | gradients vs eager | status, gap "
        "| PyTorch min-cut within the budget: peak, time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["optsched"]:
        budget = f"{r['fraction']:.0%} ({r['budget_bytes'] / MIB:.2f} MiB)"
        if "infeasible" in r:
            ours = f"infeasible (lowest {r['lowest_peak_bytes'] / MIB:.2f} MiB) | | | | "
        else:
            diff = "equal" if r["max_grad_diff"] == 0 else f"{r['max_grad_diff']:.1e}"
            ours = (f"{r['predicted_peak_bytes'] / MIB:.2f} MiB | {r['measured_peak_bytes'] / MIB:.2f} MiB"
                    f"{'' if r['within_budget'] else ' (OVER)'} | {r['time_ratio']:.2f}x | {diff} | "
                    f"{r['solver_status']}, {r['gap']:.1%}")
        mc = r.get("mincut")
        theirs = (f"{mc['measured_peak_bytes'] / MIB:.2f} MiB, {mc['time_ratio']:.2f}x (knob {mc['activation_memory_budget']:.1f})"
                  if mc else ("no setting fits" if d.get("mincut") else "not run"))
        lines.append(f"| {budget} | {ours} | {theirs} |")
    return "\n".join(lines)


def _alloc_mode(env: dict) -> str:
    conf = env.get("alloc_conf")
    return f"PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else "its default mode"


def gpu_table(d: dict) -> str:
    """`make gpu-check`'s JSON: the device, the headline side by side, and what the other sections found."""
    env, secs = d.get("environment", {}), d.get("sections", {})
    model = (d.get("config") or {}).get("model") or {}
    head = secs.get("headline") or {}
    eager = next((r for r in head.get("cases", []) if r.get("name") == "eager" and r.get("status") == "ok"), {})
    lines = [
        f"{env.get('device')} ({(env.get('device_memory_bytes') or 0) / 2**30:.0f} GiB), torch {env.get('torch')}, "
        f"CUDA {env.get('cuda_runtime')}, cuDNN {env.get('cudnn')}, Triton {env.get('triton')}, transformers "
        f"{env.get('transformers')}. {model.get('describe', '')}, {model.get('params', 0) / 1e6:.0f}M parameters; "
        f"labels given. The caching allocator: {_alloc_mode(env)}. Rows run eager kernels unless they name Inductor. "
        f"Budgets are shares of eager's measured peak; "
        f"a predicted step is optsched's estimate, from op times measured on the GPU or the profile's roofline.",
        "",
        "| case | budget | predicted | measured | fits | step | predicted step | vs eager | grads (max rel. vs eager) "
        "| plan s | solver |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def gib(b):
        return "" if b is None else f"{b / 2**30:.2f} GiB"

    for r in head.get("cases", []):
        if r.get("status") != "ok":
            why = r.get("reason") or (r.get("error") or {}).get("message", "")
            lines.append(f"| {r.get('name')} | {gib(r.get('budget_bytes'))} | {r.get('status')}: "
                         f"{why.splitlines()[0][:200] if why else ''} | | | | | | | | |")
            continue
        fits = "" if r.get("within_budget") is None else ("yes" if r["within_budget"] else "**NO**")
        pred = r.get("predicted_peak_bytes")
        diff = "" if pred is None else f" ({(r['measured_peak_bytes'] - pred) / 2**20:+.1f} MiB)"
        plan_s = "" if r.get("plan_s") is None else f"{r['plan_s']:.1f}"
        est = "" if r.get("estimated_time_s") is None else f"{r['estimated_time_s'] * 1e3:.0f} ms ({r.get('timing')})"
        lines.append(
            f"| {r['name']} | {gib(r.get('budget_bytes'))} | {gib(pred)} | {gib(r['measured_peak_bytes'])}{diff} | {fits} "
            f"| {r['step_s'] * 1e3:.0f} ms | {est} | {r.get('time_vs_eager', 0):.2f}x | {r.get('grad_max_rel_err', 0):.1e} "
            f"| {plan_s} | {r.get('solver_status') or ''} |")
    if eager:
        lines += ["", f"Eager's own gradients, step to step, differ by {eager.get('grad_max_rel_err', 0):.1e} (bf16 "
                      "kernels with atomics): the scale every row's gradient difference is read against."]
    n = secs.get("does_not_fit") or {}
    if n.get("status") == "ok":
        e = n.get("eager") or {}
        lines += ["", f"**Does not fit**: the allocator capped at {n['limit_bytes'] / 2**30:.2f} GiB; eager "
                      + ("runs out of memory." if e.get("out_of_memory") else "fits (the cap did not bind).")]
        for r in n.get("cases", []):
            if r.get("status") == "ok":
                lines.append(f"`mem_budget={r['budget']!r}`: budget {gib(r['budget_bytes'])}, first call (planning "
                             f"included) peaks at {gib(r['first_call_peak_bytes'])}: within the cap "
                             f"{'yes' if r['first_call_within_limit'] else 'NO'}, within the budget "
                             f"{'yes' if r['first_call_within_budget'] else 'NO'}; step {r['step_s'] * 1e3:.0f} ms.")
            else:
                why = r.get("reason") or (r.get("error") or {}).get("message", "")
                lines.append(f"`mem_budget={r['budget']!r}`: {r.get('status')}: {why.splitlines()[0][:240] if why else ''}")
    o = secs.get("offload") or {}
    if o.get("status") == "ok":
        lines += ["", f"**Offload** at {o['share_of_eager']:.0%}: {o['n_offloaded']} tensors "
                      f"({o['offloaded_bytes'] / 2**20:,.0f} MiB) offloaded; step {o['measured_step_s']['offload'] * 1e3:.0f} "
                      f"ms against recompute-only's {o['measured_step_s']['recompute_only'] * 1e3:.0f} ms (predicted "
                      f"{o['predicted_step_s']['offload'] * 1e3:.0f} vs {o['predicted_step_s']['recompute_only'] * 1e3:.0f} "
                      f"ms); exposed copy time predicted {o['predicted_exposed_transfer_s'] * 1e3:.2f} ms, measured "
                      f"{(o.get('measured_exposed_transfer_estimate_s') or 0) * 1e3:.2f} ms (profiled idle time beyond "
                      "recompute-only's)."]
    t = secs.get("gpu_tests") or {}
    if "tests" in t:
        lines += ["", f"`pytest -m gpu`: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"
                      + (f" (failed: {', '.join(t.get('failed_names') or [])})" if t.get("failed") else "") + "."]
    return "\n".join(lines)


def fsdp_table(d: dict) -> str:
    """benchmarks/fsdp_offline.py: per-rank budgets of a Llama-3-8B-shaped model under FSDP2 over 8 H100s, planned offline."""
    gib = 2**30
    f, ac = d["fastest"], d["full_activation_checkpointing"]
    lines = [
        f"{d['model']}; per-rank batch {d['per_rank_batch'][0]} x {d['per_rank_batch'][1]} tokens, "
        f"{d['device_profile']} profile; step time is compute only (communication overlapped, not counted).",
        "",
        "| per-rank budget | predicted per rank | step (ms) | vs fastest | block plan | plan file loads on every rank |",
        "|---|---|---|---|---|---|",
        f"| none (fastest) | {f['predicted_peak_bytes'] / gib:.2f} GiB | {f['step_time_s'] * 1e3:.1f} | 1.000 | solver, no budget | |",
    ]
    for r in d["rows"]:
        if r.get("infeasible"):
            lines.append(f"| {r['budget_bytes'] / gib:.2f} GiB | infeasible | | | | |")
            continue
        how = "solver" if r["block_plan"] == "solve" else f"recompute ladder ({r['block_plan']})"
        what = f"{r['n_recomputed']} recomputed" + (f" + {r['n_offloaded']} offloaded" if r["n_offloaded"] else "")
        loads = {True: "yes", False: "NO"}.get(r.get("loadable_by_every_rank"), "")
        lines.append(f"| {r['budget_bytes'] / gib:.2f} GiB ({r['activation_share']:.0%}) | {r['predicted_peak_bytes'] / gib:.2f} GiB | "
                     f"{r['step_time_s'] * 1e3:.1f} | {r['time_ratio_vs_fastest']:.3f} | {how}, {what} | {loads} |")
    lines.append(f"| (full activation checkpointing) | {ac['predicted_peak_bytes'] / gib:.2f} GiB | {ac['step_time_s'] * 1e3:.1f} | "
                 f"{ac['step_time_s'] / f['step_time_s']:.3f} | every block recomputed whole | |")
    fixed = d["rows"][0]["fixed_bytes"] if d["rows"] else None
    lines += ["", "Budgets: the fixed per-rank terms" + (
        f" ({fixed / gib:.1f} GiB, {d['root']['activations_bytes'] / gib:.1f} GiB of them the root's activations)"
        if fixed is not None else "") + " plus the share in brackets of what the fastest plan's activations add to them."]
    return "\n".join(lines)


def durations_table(results: Path = RESULTS) -> str:
    """What each JSON says about the run that wrote it: `make bench`'s parts and how long each took."""
    lines = ["| JSON | written by | commit | wall time |", "|---|---|---|---|"]
    total, unknown = 0.0, []
    for name in sorted({fname for fname, _fn in TABLES.values() if fname}):
        path = results / name
        meta = (json.loads(path.read_text()).get("meta") or {}) if path.exists() else {}
        wall = meta.get("wall_s")
        if wall is None:
            unknown.append(name)
        else:
            total += wall
        command = f"`{meta['command']}`" if meta.get("command") else "not recorded"
        lines.append(f"| {name} | {command} | {commit_line(meta).removeprefix('measured at ')} | "
                     f"{'not recorded' if wall is None else f'{wall / 60:.1f} min'} |")
    lines += ["", f"Recorded wall time of the benchmarks: {total / 60:.0f} min"
              + (f" ({len(unknown)} JSONs without a recorded time)" if unknown else "") + ", the notebooks not included."]
    return "\n".join(lines)


# key: (JSON in benchmarks/results/, renderer). A file holds `<!-- bench:KEY -->`...`<!-- /bench:KEY -->` for each
# table it shows; `durations` reads every JSON.
TABLES = {
    "headline": ("gpt_budget.json", headline_table),
    "gpt": ("gpt_budget.json", gpt_table),
    "hf": ("hf_gpt2_budget.json", gpt_table),
    "gpt12": ("gpt12_budget.json", gpt_table),
    "gpt_inductor": ("gpt_inductor.json", gpt_table),
    "seed": ("seed_order.json", seed_table),
    "scaling": ("scaling.json", scaling_table),
    "offload": ("offload.json", offload_table),
    "adam": ("adam_step.json", adam_table),
    "offline": ("plan_offline.json", offline_table),
    "zoo": ("zoo.json", zoo_table),
    "loops": ("loops.json", loops_table),
    "tight": ("tight_budgets.json", tight_tables),
    "tight_summary": ("tight_budgets.json", tight_summary_table),
    "planning_time": ("planning_time.json", planning_time_table),
    "scaling_llama": ("scaling_llama.json", scaling_llama_table),
    "two_processes": ("two_processes.json", two_processes_table),
    "whole_step": ("whole_step.json", whole_step_table),
    "chunking": ("chunking.json", chunking_table),
    "fsdp": ("fsdp_offline.json", fsdp_table),
    "gpu": ("gpu_check.json", gpu_table),
    "gpu_rerun": ("gpu_check_rerun.json", gpu_table),
    "gpu_alloc_default": ("gpu_check_alloc_default.json", gpu_table),
    "gpu_alloc_expandable": ("gpu_check_alloc_expandable.json", gpu_table),
    "durations": (None, durations_table),
}
# the files the tables are rendered into
TARGETS = ("README.md", "docs/benchmarks.md", "docs/distributed.md")
# notebooks/ and the JSON each reads: its first cell prints `benchmarks.meta.describe(json)`, so an executed
# notebook says which run of its JSON it read; --check fails when that is not the JSON's current run
NOTEBOOK_JSONS = {
    "1_seed_functions.ipynb": ("seed_order.json",),
    "2_gpt.ipynb": ("gpt_budget.json",),
    "4_scaling.ipynb": ("scaling.json", "scaling_llama.json"),
}
MARKER = re.compile(r"(<!-- bench:([a-z0-9_]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def section(key: str, results: Path = RESULTS) -> str:
    """The text between KEY's markers: the commit line from its JSON's ``meta``, then the table."""
    fname, fn = TABLES[key]
    if fname is None:
        return fn(results)
    d = json.loads((results / fname).read_text())
    line = commit_line(d.get("meta"))
    return f"*{line[0].upper() + line[1:]} (`benchmarks/results/{fname}`).*\n\n{fn(d)}"


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every table between its markers rendered again (a table whose JSON is absent is left as it is)."""
    def sub(m: re.Match) -> str:
        key = m.group(2)
        if key not in TABLES or (TABLES[key][0] and not (results / TABLES[key][0]).exists()):
            return m.group(0)
        return m.group(1) + section(key, results) + "\n" + m.group(4)

    return MARKER.sub(sub, text)


def _missing_commits(d: dict) -> list[str]:
    """What in a results JSON lacks its commit: the JSON's ``meta``, or a run (tight_budgets, scaling_llama) shown."""
    out = []
    if not (d.get("meta") or {}).get("commit"):
        out.append("no meta.commit (written before benchmarks/meta.py: run its benchmark again)")
    elif (d.get("meta") or {}).get("clean") is None and not (d.get("meta") or {}).get("sent_commit"):
        out.append("meta.clean not recorded")  # (a device run names the commit sent; its copy's state is unknown)
    for label, run in (d.get("runs") or {}).items():
        if not (run.get("meta") or run.get("git") or {}).get("commit"):
            out.append(f"run {label!r} has no commit")
    return out


def check(root: Path = ROOT, results: Path | None = None) -> list[str]:
    """Every reason `--check` fails, each naming its file and table; empty when every table is current."""
    results = results or root / "benchmarks" / "results"
    problems = []
    checked: dict[str, list[str]] = {}
    for target in TARGETS:
        path = root / target
        if not path.exists():
            problems.append(f"{target}: missing")
            continue
        text = path.read_text()
        for m in MARKER.finditer(text):
            key = m.group(2)
            where = f"{target}, table {key!r}"
            if key not in TABLES:
                problems.append(f"{where}: unknown table (known: {', '.join(TABLES)})")
                continue
            fname = TABLES[key][0]
            if fname is not None:
                if not (results / fname).exists():
                    problems.append(f"{where}: benchmarks/results/{fname} does not exist")
                    continue
                if fname not in checked:
                    checked[fname] = _missing_commits(json.loads((results / fname).read_text()))
                problems += [f"{where}: benchmarks/results/{fname}: {p}" for p in checked[fname]]
            if m.group(3) != section(key, results) + "\n":
                problems.append(f"{where}: differs from benchmarks/results/{fname or '*.json'} "
                                "(run `python -m benchmarks.report`)")
    problems += check_notebooks(root, results)
    return problems


def check_notebooks(root: Path = ROOT, results: Path | None = None) -> list[str]:
    """A notebook whose outputs do not name the current run of each JSON it reads (see NOTEBOOK_JSONS)."""
    results = results or root / "benchmarks" / "results"
    problems = []
    for name, fnames in NOTEBOOK_JSONS.items():
        path = root / "notebooks" / name
        if not path.exists():
            problems.append(f"notebooks/{name}: missing")
            continue
        cells = json.loads(path.read_text()).get("cells", [])
        printed = "".join("".join(o.get("text", "")) for c in cells if c.get("cell_type") == "code" for o in c.get("outputs", []))
        for fname in fnames:
            if not (results / fname).exists():
                problems.append(f"notebooks/{name}: benchmarks/results/{fname} does not exist")
            elif describe(results / fname) not in printed:
                problems.append(f"notebooks/{name}: its outputs are not from the current {fname} "
                                f"(expected the line {describe(results / fname)!r}; run `make notebooks`)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 naming every stale or uncommitted table")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # a copy of the repository (the tests)
    args = ap.parse_args(argv)
    results = args.root / "benchmarks" / "results"
    if args.check:
        problems = check(args.root, results)
        for p in problems:
            print(p)
        if problems:
            print(f"{len(problems)} problem(s): `make bench` regenerates every JSON, table and notebook")
            return 1
        print(f"every table in {', '.join(TARGETS)} and every notebook is current, with its commit")
        return 0
    for target in TARGETS:
        path = args.root / target
        if path.exists():
            old = path.read_text()
            new = render(old, results)
            if new != old:
                path.write_text(new)
                print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
