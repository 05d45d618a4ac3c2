"""Planning time and quality against depth: GPT with 2..48 layers, budget 50% of the unplanned peak.

Plans for an H100 profile (roofline times), so op times are not measured and only
shapes matter; the model itself is built on this CPU (48 layers at width 256 fit in
a few GB). Writes benchmarks/results/scaling.json.

    python -m benchmarks.scaling                     # 2, 4, 8, 12, 24, 48 layers
    python -m benchmarks.scaling --depths 2,4,8      # a subset
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import optsched
from benchmarks import write_result
from benchmarks.models.gpt import GPTConfig, build, make_batch

MIB = 2**20
RESULTS = Path(__file__).parent / "results"


def plan_depth(layers: int, width: int, batch: int, seq: int, fraction: float, profile: str) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=layers, n_embd=width, block_size=seq)
    model = build(cfg)
    inputs = make_batch(cfg, batch_size=batch, seq_len=seq)
    t0 = time.perf_counter()
    opt = optsched.optimize(model, f"{fraction:.0%}", device_profile=profile, example_inputs=inputs)
    total_s = time.perf_counter() - t0
    s = opt.plan.summary()
    return {
        "layers": layers,
        "ops": s["n_ops"],
        "graph_nodes": opt.plan.graph_nodes,
        "plan_s": s["solve_time_s"],
        "capture_and_plan_s": total_s,
        "status": s["solver_status"],
        "gap": s["gap"],
        "method": s["method"],
        "unplanned_peak_bytes": s["unplanned_peak_bytes"],
        "budget_bytes": s["budget_bytes"],
        "predicted_peak_bytes": s["predicted_peak_bytes"],
        "time_ratio": s["time_ratio"],
        "n_recomputed": s["n_recomputed"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="2,4,8,12,24,48")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--json", type=Path, default=RESULTS / "scaling.json")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'layers':>6} {'nodes':>6} {'ops':>5} {'plan s':>7} {'s/layer':>7} {'status':>9} {'gap':>6} "
          f"{'unplanned':>10} {'budget':>9} {'predicted':>9} {'est. time':>9}")
    for layers in [int(d) for d in args.depths.split(",")]:
        r = plan_depth(layers, args.width, args.batch, args.seq, args.fraction, args.profile)
        rows.append(r)
        print(f"{layers:6d} {r['graph_nodes']:6d} {r['ops']:5d} {r['plan_s']:7.1f} {r['plan_s'] / layers:7.2f} "
              f"{r['status']:>9} {r['gap']:6.2%} {r['unplanned_peak_bytes'] / MIB:9.1f}M {r['budget_bytes'] / MIB:8.1f}M "
              f"{r['predicted_peak_bytes'] / MIB:8.1f}M {r['time_ratio']:8.3f}x", flush=True)
    result = {"config": {"width": args.width, "batch": args.batch, "seq": args.seq, "fraction": args.fraction,
                         "profile": args.profile, "torch": torch.__version__}, "rows": rows}
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
