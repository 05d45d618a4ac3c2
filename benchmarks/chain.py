"""Per-block options combined along the chain (issue 14): the same solve with the chain step off and on.

Llama-style models (benchmarks/models/llama.py, the llama-7b shapes of scaling_llama.py, batch 4 x 4096,
h100 profile, captured under fake tensors with offloading allowed) and GPT (4 layers, width 256, batch 8,
cpu profile, recomputation only), each solved at fractions of its unplanned peak with
`solvers.search.moves.CHAIN` False then True, deterministic (as `optimize` plans), at the planner's
default time limit for the problem's size. Estimated step time against the unplanned step, peak, and the
seconds each plan took. Writes benchmarks/results/chain.json.

    python -m benchmarks.chain
    python -m benchmarks.chain --cases llama8 --fractions 0.4
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import time
from pathlib import Path

from benchmarks import write_result

RESULTS = Path(__file__).parent / "results"
CASES = {"llama8": (0.4, 0.5), "llama16": (0.4, 0.5), "gpt4": (0.4, 0.45)}
GIB = 2**30


def capture(case: str, cache: Path | None):
    """The planning problem of `case` (pickled in `cache` when given)."""
    if cache is not None and (cache / f"{case}.pkl").exists():
        return pickle.loads((cache / f"{case}.pkl").read_bytes())
    import torch

    from benchmarks.models import gpt, llama
    from benchmarks.scaling_llama import MODEL
    from optsched.api import capture_problem
    from optsched.compiler.offline import plan_offline

    if case.startswith("llama"):
        cfg = llama.Config(**MODEL, n_layer=int(case[len("llama"):]))
        problem = plan_offline(lambda: llama.LLaMA(cfg), lambda: llama.make_batch(cfg, 4, 4096), None,
                               device_profile="h100", offload=True).problem
    else:
        torch.manual_seed(0)
        cfg = gpt.GPTConfig(n_layer=int(case[len("gpt"):]), n_embd=256, n_head=4, block_size=128)
        problem = capture_problem(gpt.build(cfg), gpt.make_batch(cfg, batch_size=8, seq_len=128), device_profile="cpu")
        problem = dataclasses.replace(problem, host_bw=0.0)
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{case}.pkl").write_bytes(pickle.dumps(problem))
    return problem


def solve_row(problem, budget: int, chain: bool, time_limit_s: float) -> dict:
    from optsched.solvers import BudgetInfeasibleError, default_schedule, simulate
    from optsched.solvers.search import moves, strategy

    base = simulate(problem, default_schedule(problem))
    moves.CHAIN = chain
    t0 = time.perf_counter()
    try:
        sol = strategy.solve(problem, budget, time_limit_s=time_limit_s, deterministic=True)
    except BudgetInfeasibleError as e:
        return {"chain": chain, "infeasible": True, "lowest_peak_bytes": e.lowest_peak_bytes,
                "plan_s": time.perf_counter() - t0}
    finally:
        moves.CHAIN = True
    return {"chain": chain, "time_ratio": sol.sim.time_s / base.time_s, "peak_bytes": sol.sim.peak_bytes,
            "offloaded_bytes": sol.sim.offloaded_bytes, "recompute_s": sol.sim.recompute_s,
            "method": sol.stats.method, "plan_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    from optsched.planning.timing import DEFAULT_S_PER_OP, DEFAULT_TIME_LIMIT_MAX_S, DEFAULT_TIME_LIMIT_S
    from optsched.solvers import default_schedule, simulate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--fractions", default=None, help="comma-separated; default: each case's own")
    ap.add_argument("--cache", type=Path, default=None, help="folder to keep captured problems in")
    ap.add_argument("--out", type=Path, default=RESULTS / "chain.json")
    args = ap.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        problem = capture(case, args.cache)
        base = simulate(problem, default_schedule(problem))
        limit = max(DEFAULT_TIME_LIMIT_S, min(DEFAULT_TIME_LIMIT_MAX_S, DEFAULT_S_PER_OP * len(problem.ops)))
        fracs = [float(f) for f in args.fractions.split(",")] if args.fractions else CASES[case]
        for frac in fracs:
            budget = int(frac * base.peak_bytes)
            pair = [solve_row(problem, budget, chain, limit) for chain in (False, True)]
            row = {"case": case, "fraction": frac, "n_ops": len(problem.ops), "budget_bytes": budget,
                   "unplanned_peak_bytes": base.peak_bytes, "time_limit_s": limit, "off": pair[0], "on": pair[1]}
            rows.append(row)
            print(" | ".join([f"{case} {frac:.0%}"] + [
                "no plan" if r.get("infeasible") else
                f"chain {'on ' if r['chain'] else 'off'} {r['time_ratio']:.4f}x {r['peak_bytes'] / GIB:.3f} GiB {r['plan_s']:.1f}s"
                for r in pair]), flush=True)
    data = {"rows": rows}
    write_result(args.out, data)
    return data


if __name__ == "__main__":
    main()
