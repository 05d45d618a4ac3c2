"""Thunder issue 1337's two functions: peak memory above the inputs, eager vs compilers vs optsched.

Ten parallel paths of relu, matmul, relu, matmul on 256x256 float32, no grad. The
efficient function frees as it goes (0.75 MiB in eager); the inefficient one runs
each stage across all paths first (2.75 MiB). A memory-blind order or horizontal
fusion turns the first into the second; optsched's order model finds 0.75 MiB for
both. Writes benchmarks/results/seed_order.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import optsched
from benchmarks import write_result
from benchmarks.models.seed_functions import make_inputs, memory_peak_efficient_func, memory_peak_inefficient_func
from optsched.measure import live_bytes, measure_peak

MIB = 2**20
RESULTS = Path(__file__).parent / "results"
THUNDER_REPORTED_MIB = 2.25  # from the issue thread (CUDA); Thunder is not installed here
FUNCS = {"efficient": memory_peak_efficient_func, "inefficient": memory_peak_inefficient_func}


def _peak_above_inputs(fn, t0s, a) -> tuple[int, torch.Tensor]:
    with torch.no_grad():
        fn(t0s, a)  # compile / warm up outside the measurement
        r = measure_peak(lambda: fn(t0s, a))
    return r.peak_bytes, r.result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (needs a C++ compiler, slow)")
    ap.add_argument("--json", type=Path, default=RESULTS / "seed_order.json")
    args = ap.parse_args(argv)

    t0s, a = make_inputs()
    rows = {}
    for name, fn in FUNCS.items():
        eager, ref = _peak_above_inputs(fn, t0s, a)
        opt = optsched.optimize(fn)
        ours, out = _peak_above_inputs(opt, t0s, a)
        inputs = live_bytes(t0s, a)
        row = {
            "eager_bytes": eager,
            "optsched_bytes": ours,
            "optsched_predicted_bytes": opt.plan.predicted_peak_bytes - inputs,
            "optsched_status": opt.plan.solver_status,
            "optsched_plan_s": opt.plan.solve_time_s,
            "optsched_matches_eager": bool(torch.equal(out, ref)),
            "thunder_reported_bytes": int(THUNDER_REPORTED_MIB * MIB),
        }
        if not args.no_inductor:
            torch._dynamo.reset()
            row["inductor_bytes"], _ = _peak_above_inputs(torch.compile(fn, fullgraph=True), t0s, a)
            fused = optsched.optimize(fn, executor="inductor")
            row["optsched_inductor_bytes"], out = _peak_above_inputs(fused, t0s, a)
            row["optsched_inductor_matches_eager"] = bool(torch.equal(out, ref))
            row["optsched_inductor_groups"] = len(fused.plan.fusion_groups)
            row["optsched_inductor_notes"] = [n for n in fused.plan.stats.notes if n.startswith("horizontal")]
        rows[name] = row

    print(f"{'function':>12} | {'eager':>6} {'torch.compile':>13} {'Thunder*':>8} | {'optsched':>8} {'predicted':>9} "
          f"{'status':>8} {'same out':>8} | {'+inductor':>9}")
    for name, r in rows.items():
        ind = f"{r['inductor_bytes'] / MIB:13.2f}" if "inductor_bytes" in r else f"{'skipped':>13}"
        fused = f"{r['optsched_inductor_bytes'] / MIB:9.2f}" if "optsched_inductor_bytes" in r else f"{'skipped':>9}"
        print(f"{name:>12} | {r['eager_bytes'] / MIB:6.2f} {ind} {r['thunder_reported_bytes'] / MIB:8.2f} | "
              f"{r['optsched_bytes'] / MIB:8.2f} {r['optsched_predicted_bytes'] / MIB:9.2f} {r['optsched_status']:>8} "
              f"{'yes' if r['optsched_matches_eager'] else 'NO':>8} | {fused}")
        for note in r.get("optsched_inductor_notes", []):
            print(f"{'':>12}   {note}")
    print("MiB above the inputs, at the allocator (CPU). *Thunder: as reported in the issue thread (CUDA), not measured here.\n"
          "+inductor: optsched with fusion groups run by Inductor; horizontal groups are fusion options the solver "
          "decides, kept only when the plan is faster with no higher peak.")
    write_result(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
