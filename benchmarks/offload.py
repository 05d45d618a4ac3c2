"""Save vs recompute vs offload on a GPU profile: GPT planned for an H100 from this CPU.

Estimated step times (roofline op times, copies at the profile's host bandwidth on
their own queues) for, at each budget: optsched with offload, optsched restricted to
recomputation, and, budget-blind, the unplanned step, "offload every saved tensor"
(as activation-offloading wrappers such as torchtune's do) and recomputation pushed
to the lowest peak it reaches (the greedy heuristic with a zero budget: recomputing
every op at once, without checkpoints, would not lower this model's peak at all).
All are replayed by the same simulator. Then one offloading plan is run for real on
this CPU (host = a separate pool) and measured. Writes benchmarks/results/offload.json.

    python -m benchmarks.offload
    python -m benchmarks.offload --width 512 --budgets 0.7,0.6
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

import optsched
from benchmarks import write_result
from benchmarks.models.gpt import GPTConfig, build, make_batch
from optsched.api import capture_problem
from optsched.measure import measure_ratio, measure_training_step
from optsched.solvers import BudgetInfeasibleError, SimResult, default_schedule, simulate, solve
from optsched.solvers.search.heuristics import greedy_recompute
from optsched.solvers.search.offload import offload_all

MIB = 2**20
RESULTS = Path(__file__).parent / "results"


def _policy(name: str, sim: SimResult, base: SimResult) -> dict:
    return {"policy": name, "peak_bytes": sim.peak_bytes, "time_ratio": sim.time_s / base.time_s,
            "offloaded_bytes": sim.offloaded_bytes, "n_recomputed": len(sim.recomputed_ops),
            "exposed_transfer_s": sim.exposed_transfer_s}


def _plan(problem, budget: int, base: SimResult, time_limit_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        sol = solve(problem, budget, time_limit_s=time_limit_s)
    except BudgetInfeasibleError as e:
        return {"infeasible": True, "lowest_peak_bytes": e.lowest_peak_bytes, "plan_s": time.perf_counter() - t0}
    row = _policy("", sol.sim, base)
    del row["policy"]
    row.update(status=sol.stats.status, gap=sol.stats.gap, bound_ratio=sol.stats.bound_s / base.time_s,
               method=sol.stats.method, plan_s=time.perf_counter() - t0, transfer_s=sol.sim.transfer_s)
    return row


def gpu_profile_rows(args) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, block_size=args.seq)
    model = build(cfg)
    inputs = make_batch(cfg, batch_size=args.batch, seq_len=args.seq)
    problem = capture_problem(model, inputs, device_profile=args.profile)
    recompute_only = dataclasses.replace(problem, host_bw=0.0)
    base = simulate(problem, default_schedule(problem))
    policies = [
        _policy("unplanned", base, base),
        _policy("offload every saved tensor", simulate(problem, offload_all(problem)), base),
        _policy("recompute to the lowest peak", simulate(problem, greedy_recompute(problem, 0)), base),
    ]
    rows = []
    for frac in [float(f) for f in args.budgets.split(",")]:
        budget = int(frac * base.peak_bytes)
        rows.append({
            "fraction": frac, "budget_bytes": budget,
            "mixed": _plan(problem, budget, base, args.time_limit),
            "recompute_only": _plan(recompute_only, budget, base, args.time_limit),
        })
    return {"n_ops": len(problem.ops), "unplanned_peak_bytes": base.peak_bytes, "unplanned_time_s": base.time_s,
            "host_bw": problem.host_bw, "policies": policies, "rows": rows}


def cpu_run(fraction: float, repeat: int) -> dict:
    """One offloading plan executed on this CPU: measured peak against predicted, time against eager."""
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = build(cfg)
    inputs = make_batch(cfg, batch_size=8)
    eager = measure_training_step(model, model, inputs)
    budget = int(fraction * eager.peak_bytes)
    opt = optsched.optimize(model, budget, example_inputs=inputs, offload=True)
    m = measure_training_step(opt, model, inputs)

    def step(call):
        def run():
            for p in model.parameters():
                p.grad = None
            call(*inputs).backward()
        return run

    t, t_eager = measure_ratio(step(opt), step(model), repeat=repeat)
    s = opt.plan.summary()
    same = all(torch.equal(m.grads[k], eager.grads[k]) for k in eager.grads) and m.grads.keys() == eager.grads.keys()
    return {"fraction": fraction, "budget_bytes": budget, "eager_peak_bytes": eager.peak_bytes,
            "predicted_peak_bytes": s["predicted_peak_bytes"], "measured_peak_bytes": m.peak_bytes,
            "n_offloaded": s["n_offloaded"], "offloaded_bytes": s["offloaded_bytes"], "n_recomputed": s["n_recomputed"],
            "time_ratio": t / t_eager, "grads_equal": same}


def _print(d: dict) -> None:
    g = d["gpu"]
    c = d["config"]
    print(f"\nGPT {c['layers']} layers, width {c['width']}, batch {c['batch']}, sequence {c['seq']}, fp32, "
          f"{c['profile']} profile: {g['n_ops']} ops, unplanned peak {g['unplanned_peak_bytes'] / MIB:.0f} MiB, "
          f"est. {g['unplanned_time_s'] * 1e3:.2f} ms, host link {g['host_bw'] / 1e9:.0f} GB/s")
    print(f"\n{'budget':>15} | {'recompute only':^41} | {'save/recompute/offload (optsched)':^59}")
    print(f"{'':>15} | {'peak':>8} {'time':>7} {'bound':>7} {'status':>9} {'gap':>6} | {'peak':>8} {'time':>7} "
          f"{'offloaded':>10} {'recomp':>6} {'exposed':>8} {'status':>9} {'gap':>6}")
    for r in g["rows"]:
        budget = f"{r['budget_bytes'] / MIB:.0f} MiB ({r['fraction']:.0%})"
        rc, mx = r["recompute_only"], r["mixed"]
        left = ("infeasible" if rc.get("infeasible") else
                f"{rc['peak_bytes'] / MIB:8.0f} {rc['time_ratio']:6.3f}x {rc['bound_ratio']:6.3f}x {rc['status']:>9} "
                f"{rc['gap']:6.1%}")
        right = ("infeasible" if mx.get("infeasible") else
                 f"{mx['peak_bytes'] / MIB:8.0f} {mx['time_ratio']:6.3f}x {mx['offloaded_bytes'] / MIB:7.0f} MiB "
                 f"{mx['n_recomputed']:6d} {mx['exposed_transfer_s'] * 1e6:6.0f}us {mx['status']:>9} {mx['gap']:6.1%}")
        print(f"{budget:>15} | {left:>41} | {right}")
    print("\nbudget-blind policies:")
    for p in g["policies"]:
        print(f"  {p['policy']:<28} peak {p['peak_bytes'] / MIB:8.0f} MiB, time {p['time_ratio']:.3f}x, "
              f"offloaded {p['offloaded_bytes'] / MIB:.0f} MiB, exposed {p['exposed_transfer_s'] * 1e6:.0f} us")
    print("\ntime = estimated step time / unplanned; bound = no recompute-only plan in that plan's op order is faster; "
          "exposed = time compute waits for copies")
    cpu = d.get("cpu")
    if cpu:
        print(f"\nrun on this CPU (small GPT, {cpu['fraction']:.0%} of eager's {cpu['eager_peak_bytes'] / MIB:.2f} MiB): "
              f"predicted {cpu['predicted_peak_bytes'] / MIB:.2f} MiB, measured {cpu['measured_peak_bytes'] / MIB:.2f} MiB, "
              f"{cpu['n_offloaded']} offloaded ({cpu['offloaded_bytes'] / MIB:.1f} MiB), {cpu['n_recomputed']} recomputed, "
              f"time {cpu['time_ratio']:.2f}x eager, gradients {'equal' if cpu['grads_equal'] else 'DIFFER'}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--budgets", default="0.7,0.6,0.5,0.45", help="fractions of the unplanned (simulated) peak")
    ap.add_argument("--time-limit", type=float, default=10.0, help="planning time limit per plan (work: about seconds when idle)")
    ap.add_argument("--cpu-fraction", type=float, default=0.55, help="budget of the CPU run; 0 skips it")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=RESULTS / "offload.json")
    args = ap.parse_args(argv)
    result = {
        "config": {"layers": args.layers, "width": args.width, "batch": args.batch, "seq": args.seq,
                   "profile": args.profile, "torch": torch.__version__},
        "gpu": gpu_profile_rows(args),
        "cpu": cpu_run(args.cpu_fraction, args.repeat) if args.cpu_fraction > 0 else None,
    }
    _print(result)
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
