"""Chunked LM head + cross-entropy (issue 16): a GPT with GPT-2's vocabulary (50,257) on this CPU.

Three parts, all measured in one process (peak at the allocator, step time alternated with eager's,
gradients against eager's):

1. forced: the step with the LM head in 1 (as captured), 8, 32 and 64 chunks.
2. choice: what the planner picks at three budgets (none, 50% and 25% of the unplanned peak).
3. chunk or recompute: budgets going down from the unplanned peak, planned with chunking on, until its
   1-chunk candidate (recomputation only, planned with the same op costs for the same budget) recomputes
   a matmul or no longer fits; both plans' estimated times side by side, and the chosen plan measured.

    python -m benchmarks.chunking            # writes benchmarks/results/chunking.json
    python -m benchmarks.chunking --quick    # a small vocabulary, for a smoke run
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

import optsched
from benchmarks import max_grad_diff, timed_step, write_result
from benchmarks.models.gpt import GPTConfig, build, make_batch
from optsched.measure import measure_ratio, measure_training_step

MIB = 2**20
RESULTS = Path(__file__).parent / "results"
MATMUL = re.compile(r"^(mm|addmm|bmm|baddbmm|_scaled_dot_product)")
FORCED = (1, 8, 32, 64)
CHOICE_FRACTIONS = (None, 0.5, 0.25)
RECOMPUTE_FRACTIONS = (0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.86, 0.84, 0.82, 0.8, 0.75, 0.7)


def _recomputed(plan) -> tuple[int, list[str]]:
    names = [plan.problem.ops[i].name for i in plan.sim.recomputed_ops]
    return len(names), sorted(n for n in names if MATMUL.match(n))


def _plan_row(plan, budget_bytes: int | None) -> dict:
    s = plan.summary()
    n_rec, mm_rec = _recomputed(plan)
    return {
        "budget_bytes": budget_bytes,
        "chunks": s["chunks"].get("lm_head", 1),
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "estimated_time_s": plan.estimated_time_s,
        "n_recomputed": n_rec,
        "recomputed_matmuls": mm_rec,
        "trials": plan.chunk_trials,
        "solver_status": s["solver_status"],
    }


def run_case(model, inputs, eager: dict, budget_bytes: int | None, chunking, time_limit_s: float, repeat: int,
             measure: bool = True, keep: list | None = None) -> dict:
    """Plan (and measure, when asked) one case; `keep` gets the optimized module, to measure later."""
    for p in model.parameters():  # timed steps before leave gradients: a step starting with them is another program
        p.grad = None
    t0 = time.perf_counter()
    try:
        opt = optsched.optimize(model, budget_bytes, example_inputs=inputs, time_limit_s=time_limit_s,
                                chunking=chunking)
    except optsched.BudgetInfeasibleError as e:
        return {"budget_bytes": budget_bytes, "infeasible": True, "lowest_peak_bytes": e.lowest_peak_bytes,
                "lower_bound_bytes": e.lower_bound_bytes, "plan_s": time.perf_counter() - t0}
    row = _plan_row(opt.plan, budget_bytes)
    row["plan_s"] = time.perf_counter() - t0
    if keep is not None:
        keep.append(opt)
    if measure:
        measure_row(row, opt, model, inputs, eager, repeat)
    return row


def measure_row(row: dict, opt, model, inputs, eager: dict, repeat: int) -> None:
    budget_bytes = row["budget_bytes"]
    m = measure_training_step(opt, model, inputs)
    t, t_eager = measure_ratio(timed_step(opt, model, inputs), timed_step(model, model, inputs),
                               warmup=1, repeat=repeat)
    row.update({
        "measured_peak_bytes": m.peak_bytes,
        "predicted_minus_measured_bytes": opt.plan.predicted_peak_bytes - m.peak_bytes,
        "within_budget": budget_bytes is None or m.peak_bytes <= budget_bytes,
        "step_s": t,
        "eager_step_s": t_eager,
        "time_ratio": t / t_eager,
        "max_grad_diff": max_grad_diff(m.grads, eager["grads"]),
    })


def _mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.1f}"


def _print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'budget MiB':>10} {'chunks':>6} {'pred MiB':>9} {'meas MiB':>9} {'est ms':>8} {'step ms':>8} "
          f"{'x eager':>7} {'recomp':>6} {'mm recomp':>9} {'grad diff':>9}")
    for r in rows:
        if r.get("infeasible"):
            print(f"{_mib(r['budget_bytes']):>10} {'no plan fits (lowest peak found ' + _mib(r['lowest_peak_bytes']) + ' MiB)'}")
            continue
        print(f"{_mib(r['budget_bytes']):>10} {r['chunks']:>6} {_mib(r['predicted_peak_bytes']):>9} "
              f"{_mib(r.get('measured_peak_bytes')):>9} {r['estimated_time_s'] * 1e3:>8.0f} "
              f"{r['step_s'] * 1e3 if 'step_s' in r else float('nan'):>8.0f} {r.get('time_ratio', float('nan')):>7.2f} "
              f"{r['n_recomputed']:>6} {len(r['recomputed_matmuls']):>9} {r.get('max_grad_diff', float('nan')):>9.1e}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="vocabulary 4096: a smoke run, not the result")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=5.0)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=4096 if args.quick else 50257, block_size=256, n_layer=2, n_head=4, n_embd=256)
    batch, seq = 4, 256
    model = build(cfg)
    inputs = make_batch(cfg, batch_size=batch, seq_len=seq)
    e = measure_training_step(model, model, inputs)
    eager = {"peak_bytes": e.peak_bytes, "grads": e.grads}
    print(f"GPT: vocabulary {cfg.vocab_size}, {cfg.n_layer} layers, width {cfg.n_embd}, batch {batch} x {seq} tokens; "
          f"logits {batch * seq * cfg.vocab_size * 4 / MIB:.1f} MiB; eager peak {_mib(e.peak_bytes)} MiB")

    forced = [run_case(model, inputs, eager, None, k, args.time_limit, args.repeat) for k in FORCED]
    _print_rows("1. forced chunk counts (no budget)", forced)

    unplanned = forced[0]["predicted_peak_bytes"]  # the graph as captured, unplanned: chunking=1, no budget
    choice = []
    for f in CHOICE_FRACTIONS:
        row = run_case(model, inputs, eager, None if f is None else int(f * unplanned), True, args.time_limit,
                       args.repeat)
        row["fraction"] = f
        choice.append(row)
    _print_rows("2. the planner's choice (chunking on) at three budgets", choice)

    # 3: the planner with chunking on at budgets going down; its 1-chunk trial is the recompute-only plan,
    # planned with the same op costs for the same budget
    sweep = []
    at = None
    for f in RECOMPUTE_FRACTIONS:
        kept: list = []
        row = run_case(model, inputs, eager, int(f * unplanned), True, args.time_limit, args.repeat, measure=False,
                       keep=kept)
        row["fraction"] = f
        sweep.append(row)
        if row.get("infeasible"):
            break
        one = next(t for t in row["trials"] if t["chunks"] == 1)
        if not one["fits"] or any(MATMUL.match(n) for n in one["recomputed"]):
            at = row
            measure_row(row, kept[0], model, inputs, eager, args.repeat)  # the plan compared, measured
            break
    print("\n3. chunk or recompute: the planner (chunking on) at budgets going down; 'recompute only' is its "
          "1-chunk candidate")
    print(f"{'budget MiB':>10} | {'recompute only: est ms':>22} {'recomp':>6} {'matmuls':>7} | {'chosen chunks':>13} "
          f"{'est ms':>7} {'recomp':>6} {'matmuls':>7}")
    for r in sweep:
        if r.get("infeasible"):
            print(f"{_mib(r['budget_bytes']):>10} | no plan fits")
            continue
        one = next(t for t in r["trials"] if t["chunks"] == 1)
        rec = f"{one['estimated_time_s'] * 1e3:>22.0f} {one['n_recomputed']:>6} " \
              f"{sum(bool(MATMUL.match(n)) for n in one['recomputed']):>7}" if one["fits"] else f"{'does not fit':>37}"
        print(f"{_mib(r['budget_bytes']):>10} | {rec} | {r['chunks']:>13} {r['estimated_time_s'] * 1e3:>7.0f} "
              f"{r['n_recomputed']:>6} {len(r['recomputed_matmuls']):>7}")
    compare = None
    if at is not None:
        compare = {"budget_bytes": at["budget_bytes"], "fraction": at["fraction"], "chosen": at,
                   "recompute_only": next(t for t in at["trials"] if t["chunks"] == 1)}
        _print_rows(f"3b. at {_mib(at['budget_bytes'])} MiB ({at['fraction']:.0%}): the chosen plan, measured", [at])
    result = {
        "config": {"vocab_size": cfg.vocab_size, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
                   "batch": batch, "seq": seq, "quick": args.quick, "time_limit_s": args.time_limit,
                   "threads": torch.get_num_threads()},
        "eager_peak_bytes": e.peak_bytes,
        "forced": forced,
        "choice": choice,
        "recompute_sweep": sweep,
        "chunk_or_recompute": compare,
    }
    if not args.quick:
        write_result(RESULTS / "chunking.json", result)
    return result


if __name__ == "__main__":
    main()
