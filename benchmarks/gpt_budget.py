"""GPT training step under memory budgets: optsched vs eager vs PyTorch's min-cut partitioner.

Everything is measured side by side in one process: the peak at the allocator, the
step time as a ratio to eager, and the gradients against eager's. Prints a table and
writes JSON (benchmarks/results/gpt_budget.json).

    python -m benchmarks.gpt_budget            # full table
    python -m benchmarks.gpt_budget --demo     # what `make demo` runs
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import optsched
from benchmarks import max_grad_diff, timed_step, write_result
from benchmarks.models.gpt import GPTConfig, build, make_batch
from optsched.measure import measure_ratio, measure_time, measure_training_step

MIB = 2**20
RESULTS = Path(__file__).parent / "results"
MINCUT_KNOBS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)


def run_optsched(
    model, inputs, eager, budget_bytes: int | None, time_limit_s: float, repeat: int, progress: bool = False,
    executor: str | None = None,
) -> dict:
    for p in model.parameters():  # eager's timed steps leave gradients: a step starting with them is another program
        p.grad = None
    t0 = time.perf_counter()
    opt = optsched.optimize(model, budget_bytes, example_inputs=inputs, time_limit_s=time_limit_s, progress=progress,
                            executor=executor)
    first_call_s = time.perf_counter() - t0
    m = measure_training_step(opt, model, inputs)
    plan = opt.plan  # the plan of the step just measured
    t, t_eager = measure_ratio(timed_step(opt, model, inputs), timed_step(model, model, inputs), repeat=repeat)
    s = plan.summary()
    return {
        "budget_bytes": budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": m.peak_bytes,
        "within_budget": budget_bytes is None or m.peak_bytes <= budget_bytes,
        "predicted_vs_measured": (plan.predicted_peak_bytes - m.peak_bytes) / m.peak_bytes,
        "step_s": t,
        "eager_step_s": t_eager,
        "time_ratio": t / t_eager,
        "max_grad_diff": max_grad_diff(m.grads, eager["grads"]),
        "plan_s": s["solve_time_s"],
        "first_call_s": first_call_s,
        "solver_status": s["solver_status"],
        "gap": s["gap"],
        "method": s["method"],
        "n_recomputed": s["n_recomputed"],
        "estimated_time_ratio": s["time_ratio"],
        "executor": s["executor"],
        "n_fusion_groups": s["n_fusion_groups"],
    }


def run_mincut(model, inputs, repeat: int, backend: str = "aot_eager_decomp_partition",
               eager_grads: dict | None = None) -> list[dict]:
    """PyTorch's own answer: the min-cut partitioner with activation_memory_budget, either without
    Inductor codegen (aot_eager_decomp_partition) or as torch.compile does it (inductor)."""
    out = []
    for knob in MINCUT_KNOBS:
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=knob):
            compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
            t0 = time.perf_counter()
            timed_step(compiled, model, inputs)()  # compile outside the measurements
            compile_s = time.perf_counter() - t0
            m = measure_training_step(compiled, model, inputs)
            t, t_eager = measure_ratio(timed_step(compiled, model, inputs), timed_step(model, model, inputs), repeat=repeat)
        out.append({"activation_memory_budget": knob, "measured_peak_bytes": m.peak_bytes, "step_s": t,
                    "eager_step_s": t_eager, "time_ratio": t / t_eager, "first_call_s": compile_s,
                    "max_grad_diff": max_grad_diff(m.grads, eager_grads) if eager_grads else None})
    torch._dynamo.reset()
    return out


def best_mincut_within(mincut: list[dict], budget: int) -> dict | None:
    fits = [r for r in mincut if r["measured_peak_bytes"] <= budget]
    return min(fits, key=lambda r: r["time_ratio"]) if fits else None


def build_model(kind: str, layers: int, width: int, batch: int, seq: int):
    torch.manual_seed(0)
    if kind == "hf-gpt2":
        from benchmarks.models import hf_gpt2

        return hf_gpt2.build(n_layer=layers, n_embd=width, n_positions=seq), hf_gpt2.make_batch(batch, seq)
    cfg = GPTConfig(n_layer=layers, n_embd=width, block_size=seq)
    return build(cfg), make_batch(cfg, batch_size=batch, seq_len=seq)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["gpt", "hf-gpt2"], default="gpt",
                    help="the bundled nanoGPT-style model, or transformers' GPT2LMHeadModel (random weights)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budgets", default="0.7,0.55,0.4", help="fractions of eager's measured peak")
    ap.add_argument("--time-limit", type=float, default=5.0, help="planning time limit per budget, seconds")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions per configuration")
    ap.add_argument("--no-mincut", action="store_true", help="skip PyTorch's min-cut comparison")
    ap.add_argument("--executor", choices=["eager", "inductor"], default=None,
                    help="optsched's fusion-group executor (default: optimize()'s default, eager on CPU)")
    ap.add_argument("--mincut-backend", default="aot_eager_decomp_partition",
                    help="torch.compile backend of the min-cut comparison: aot_eager_decomp_partition or inductor")
    ap.add_argument("--demo", action="store_true", help="short run for `make demo`")
    ap.add_argument("--json", type=Path, default=None, help="default: results/gpt_budget.json (results/demo.json with --demo)")
    args = ap.parse_args(argv)
    if args.demo:  # a short run that leaves the README's benchmark JSON alone
        args.repeat, args.no_mincut = 3, True
    if args.json is None:
        args.json = RESULTS / ("demo.json" if args.demo else "gpt_budget.json")

    model, inputs = build_model(args.model, args.layers, args.width, args.batch, args.seq)
    print(f"{args.model}: {args.layers} layers, width {args.width}, batch {args.batch}, sequence {args.seq}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")

    m = measure_training_step(model, model, inputs)
    eager = {"measured_peak_bytes": m.peak_bytes, "grads": m.grads,
             "step_s": measure_time(timed_step(model, model, inputs), repeat=args.repeat)}
    rows = []
    for frac in [float(f) for f in args.budgets.split(",")]:
        budget = int(frac * eager["measured_peak_bytes"])
        try:
            row = run_optsched(model, inputs, eager, budget, args.time_limit, args.repeat, progress=args.demo,
                               executor=args.executor)
        except optsched.BudgetInfeasibleError as e:
            row = {"budget_bytes": budget, "infeasible": str(e), "lowest_peak_bytes": e.lowest_peak_bytes,
                   "lower_bound_bytes": e.lower_bound_bytes}
        row["fraction"] = frac
        rows.append(row)
    mincut = [] if args.no_mincut else run_mincut(model, inputs, args.repeat, args.mincut_backend, eager["grads"])
    for row in rows:
        row["mincut"] = best_mincut_within(mincut, row["budget_bytes"]) if mincut else None

    _print_table(eager, rows, mincut)
    result = {
        "config": {"model": args.model, "layers": args.layers, "width": args.width, "batch": args.batch, "seq": args.seq,
                   "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "executor": args.executor or "eager", "mincut_backend": args.mincut_backend},
        "eager": {k: v for k, v in eager.items() if k != "grads"},
        "optsched": rows,
        "mincut": mincut,
    }
    write_result(args.json, result)
    return result


def _print_table(eager: dict, rows: list[dict], mincut: list[dict]) -> None:
    e_peak, e_t = eager["measured_peak_bytes"], eager["step_s"]
    print(f"\neager: peak {e_peak / MIB:.2f} MiB, step {e_t * 1e3:.1f} ms\n")
    head = (f"{'budget':>16} | {'predicted':>9} {'measured':>9} {'fits':>4} {'time':>6} {'grad diff':>9} "
            f"{'plan s':>6} {'status':>9} {'gap':>6} | {'min-cut knob':>12} {'peak':>8} {'time':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        budget = f"{r['budget_bytes'] / MIB:6.2f} MiB ({r['fraction']:.0%})"
        if "infeasible" in r:
            text = f"infeasible: lowest {r['lowest_peak_bytes'] / MIB:.2f} MiB, bound {r['lower_bound_bytes'] / MIB:.2f}"
            ours = f"{text:>66}"
        else:
            ours = (f"{r['predicted_peak_bytes'] / MIB:9.2f} {r['measured_peak_bytes'] / MIB:9.2f} "
                    f"{'yes' if r['within_budget'] else 'NO':>4} {r['time_ratio']:5.2f}x {r['max_grad_diff']:9.1e} "
                    f"{r['plan_s']:6.1f} {r['solver_status']:>9} {r['gap']:6.1%}")
        mc = r.get("mincut")
        theirs = (f"{mc['activation_memory_budget']:12.1f} {mc['measured_peak_bytes'] / MIB:8.2f} {mc['time_ratio']:5.2f}x"
                  if mc else f"{'none fits' if mincut else 'skipped':>29}")
        print(f"{budget:>16} | {ours} | {theirs}")
    print("\npeaks in MiB at the allocator; time = step time / eager step time, timed alternately; min-cut = the fastest "
          "activation_memory_budget setting whose measured peak fits the same budget")


if __name__ == "__main__":
    main()
