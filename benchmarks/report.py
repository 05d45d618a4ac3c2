"""Render benchmarks/results/*.json as markdown tables into README.md (between marker comments).

    python -m benchmarks.report          # rewrite README.md's tables from the JSON
    python -m benchmarks.report --check  # fail if README.md is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20


def gpt_table(d: dict) -> str:
    c = d["config"]
    e = d["eager"]
    lines = [
        f"{c.get('model', 'gpt')}: {c['layers']} layers, width {c['width']}, batch {c['batch']}, sequence {c['seq']}, "
        f"torch {c['torch']}, {c['threads']} CPU threads. Eager peak {e['measured_peak_bytes'] / MIB:.2f} MiB.",
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
        lines += ["", f"PyTorch's min-cut partitioner (`aot_eager_decomp_partition`, `activation_memory_budget` "
                      f"swept over {', '.join(str(r['activation_memory_budget']) for r in d['mincut'])}) reaches at "
                      f"best {lo['measured_peak_bytes'] / MIB:.2f} MiB; its fastest setting runs at "
                      f"{min(r['time_ratio'] for r in d['mincut']):.2f}x eager."]
    return "\n".join(lines)


def seed_table(d: dict) -> str:
    lines = [
        "| function | eager | torch.compile (Inductor, CPU) | Thunder (reported) | optsched measured | optsched predicted | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in d.items():
        ind = f"{r['inductor_bytes'] / MIB:.2f}" if "inductor_bytes" in r else "not run"
        lines.append(f"| {name} | {r['eager_bytes'] / MIB:.2f} | {ind} | {r['thunder_reported_bytes'] / MIB:.2f} | "
                     f"{r['optsched_bytes'] / MIB:.2f} | {r['optsched_predicted_bytes'] / MIB:.2f} | {r['optsched_status']} |")
    lines += ["", "MiB above the inputs, at the allocator."]
    return "\n".join(lines)


def scaling_table(d: dict) -> str:
    c = d["config"]
    lines = [
        f"Width {c['width']}, batch {c['batch']}, sequence {c['seq']}, budget {c['fraction']:.0%} of the unplanned peak, "
        f"{c['profile']} profile (roofline times), planned on 2 CPU cores.",
        "",
        "| layers | graph nodes | ops | plan s | s / layer | status | gap | unplanned peak | predicted peak | est. time vs unplanned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(f"| {r['layers']} | {r['graph_nodes']} | {r['ops']} | {r['plan_s']:.1f} | {r['plan_s'] / r['layers']:.2f} | "
                     f"{r['status']} | {r['gap']:.2%} | {r['unplanned_peak_bytes'] / MIB:.1f} MiB | "
                     f"{r['predicted_peak_bytes'] / MIB:.1f} MiB | {r['time_ratio']:.3f}x |")
    return "\n".join(lines)


TABLES = {
    "gpt": ("gpt_budget.json", gpt_table),
    "hf": ("hf_gpt2_budget.json", gpt_table),
    "gpt12": ("gpt12_budget.json", gpt_table),
    "seed": ("seed_order.json", seed_table),
    "scaling": ("scaling.json", scaling_table),
}


def render(readme: str) -> str:
    for key, (fname, fn) in TABLES.items():
        path = RESULTS / fname
        if not path.exists():
            continue
        table = fn(json.loads(path.read_text()))
        pattern = re.compile(rf"(<!-- bench:{key} -->\n).*?(<!-- /bench:{key} -->)", re.S)
        readme = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), readme)
    return readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    path = ROOT / "README.md"
    old = path.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md tables differ from benchmarks/results/*.json: run python -m benchmarks.report")
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
