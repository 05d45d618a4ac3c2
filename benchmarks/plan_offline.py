"""Planning for a GPU this machine does not have, with none of the model's memory.

`optsched.compiler.offline.plan_offline` builds each model and its batch as fake tensors, captures the
training step with AOTAutograd (attention as the CUDA kernel an H100 is predicted to run) and
plans it for an H100 (roofline op times). For each model:
capture time, the unplanned step's peak, then plans at 80%, 60% and 40% of it (planning
time, predicted peak, solver status and gap; an infeasible budget reports the lowest peak
found), and this process's peak memory (ru_maxrss) against the model's parameter bytes.
Writes benchmarks/results/plan_offline.json.

    python -m benchmarks.plan_offline
    python -m benchmarks.plan_offline --plans-dir /tmp/plans      # also save each plan file
    python -m benchmarks.plan_offline --models gpt2-large --budgets 60
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch

import optsched
from benchmarks import write_result
from benchmarks.models import gpt, llama
from optsched.compiler.offline import default_dtype, plan_offline

MIB, GIB = 2**20, 2**30
RESULTS = Path(__file__).parent / "results"


def _rss_bytes() -> int:
    """This process's peak resident set so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def longchat(n_layer: int = 2, seq: int = 16384, batch: int = 1) -> dict:
    cfg = llama.Config.from_name("longchat-7b-16k", n_layer=n_layer)  # bf16 parameters
    return {
        "name": "longchat-7b-16k",
        "config": f"{n_layer} of 32 layers, n_embd 4096, 32 heads, SwiGLU 11008, vocab 32000, bf16",
        "batch": f"{batch} x {seq}",
        "model": lambda: llama.LLaMA(cfg),
        "inputs": lambda: llama.make_batch(cfg, batch, seq),
        "param_bytes": cfg.param_bytes(),
    }


def gpt2_large(n_layer: int = 36, seq: int = 1024, batch: int = 8) -> dict:
    # GPT-2 large: 36 layers, n_embd 1280, 20 heads, LayerNorm + GELU MLP with bias, tied head
    cfg = gpt.GPTConfig(vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=20, n_embd=1280, bias=True)

    def model():
        with default_dtype(torch.bfloat16):  # Module.to(dtype) does not work on fake parameters
            return gpt.GPT(cfg)

    n_params = (cfg.vocab_size + cfg.block_size) * cfg.n_embd + cfg.n_layer * (12 * cfg.n_embd**2 + 13 * cfg.n_embd) + 2 * cfg.n_embd
    return {
        "name": "gpt2-large",
        "config": f"{n_layer} layers, n_embd 1280, 20 heads, vocab 50257, tied head, bf16",
        "batch": f"{batch} x {seq}",
        "model": model,
        "inputs": lambda: gpt.make_batch(cfg, batch, seq),
        "param_bytes": 2 * n_params,
    }


MODELS = {"longchat-7b-16k": longchat, "gpt2-large": gpt2_large}


def run_model(spec: dict, budgets: list[int], time_limit_s: float | None, plans_dir: Path | None) -> dict:
    rss_start = _rss_bytes()
    timings: dict = {}
    t0 = time.perf_counter()
    unplanned = plan_offline(spec["model"], spec["inputs"], None, device_profile="h100", time_limit_s=time_limit_s,
                             timings=timings)
    s = unplanned.summary()
    row = {
        "model": spec["name"], "config": spec["config"], "batch": spec["batch"], "device_profile": "h100",
        "param_bytes": spec["param_bytes"], "capture_s": timings["capture_s"],
        "first_plan_s": timings["plan_s"], "first_call_s": time.perf_counter() - t0,
        "graph_nodes": s["graph_nodes"], "n_ops": s["n_ops"], "n_forward_ops": s["n_forward_ops"],
        "unplanned_peak_bytes": s["unplanned_peak_bytes"], "unplanned_time_s": s["unplanned_time_s"],
        "lower_bound_bytes": s["lower_bound_bytes"],
        # the attention kernels captured: the ones predicted for the H100 (optsched.costs.sdpa_prediction.predict_sdpa_backend)
        "attention_ops": sorted({sig[1] for sig in unplanned.fingerprint["nodes"] if "scaled_dot_product" in sig[1]}),
        "budgets": [],
    }
    if plans_dir is not None:
        unplanned.save(plans_dir / f"{spec['name']}-unplanned.json")
    for pct in budgets:
        timings = {}
        t0 = time.perf_counter()
        entry = {"budget": f"{pct}%", "budget_bytes": s["unplanned_peak_bytes"] * pct // 100}
        try:
            plan = plan_offline(spec["model"], spec["inputs"], f"{pct}%", device_profile="h100",
                                time_limit_s=time_limit_s, timings=timings)
        except optsched.BudgetInfeasibleError as e:
            entry.update(feasible=False, lowest_peak_bytes=e.lowest_peak_bytes, lower_bound_bytes=e.lower_bound_bytes,
                         budget_bytes=e.budget_bytes)
        else:
            p = plan.summary()
            entry.update(
                feasible=True, budget_bytes=p["budget_bytes"], predicted_peak_bytes=p["predicted_peak_bytes"],
                time_ratio=p["time_ratio"], solver_status=p["solver_status"], gap=p["gap"], method=p["method"],
                n_recomputed=p["n_recomputed"], n_offloaded=p["n_offloaded"], offloaded_bytes=p["offloaded_bytes"],
                exposed_transfer_s=p["exposed_transfer_s"], solve_time_s=p["solve_time_s"],
            )
            if plans_dir is not None:
                entry["plan_file"] = str(plan.save(plans_dir / f"{spec['name']}-{pct}pct.json"))
        entry.update(capture_s=timings.get("capture_s"), plan_s=timings.get("plan_s"),
                     wall_s=time.perf_counter() - t0)
        row["budgets"].append(entry)
    row["rss_start_bytes"] = rss_start
    row["rss_peak_bytes"] = _rss_bytes()
    row["rss_growth_bytes"] = row["rss_peak_bytes"] - rss_start
    row["rss_peak_vs_params"] = row["rss_peak_bytes"] / row["param_bytes"]
    return row


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"\n{r['model']} ({r['config']}; batch {r['batch']}; H100 roofline): {r['graph_nodes']} graph nodes, "
            f"{r['n_ops']} ops ({r['n_forward_ops']} forward); capture {r['capture_s']:.1f} s; unplanned peak "
            f"{r['unplanned_peak_bytes'] / GIB:.2f} GiB, step {r['unplanned_time_s'] * 1e3:.1f} ms; "
            f"no plan below {r['lower_bound_bytes'] / GIB:.2f} GiB; attention {', '.join(r['attention_ops']) or '-'}"
        )
        print(f"{'budget':>7} {'bytes':>10} {'peak':>10} {'time':>7} {'status':>10} {'gap':>7} {'recomp':>6} "
              f"{'offl':>5} {'capture':>8} {'plan':>7}")
        for b in r["budgets"]:
            head = f"{b['budget']:>7} {b['budget_bytes'] / GIB:>6.2f} GiB"
            tail = f"{b['capture_s']:>7.1f}s {b['plan_s']:>6.1f}s"
            if b["feasible"]:
                print(f"{head} {b['predicted_peak_bytes'] / GIB:>6.2f} GiB x{b['time_ratio']:>5.3f} "
                      f"{b['solver_status']:>10} {b['gap']:>7.2%} {b['n_recomputed']:>6} {b['n_offloaded']:>5} {tail}")
            else:
                print(f"{head} {'infeasible':>10}: lowest peak {b['lowest_peak_bytes'] / GIB:.2f} GiB "
                      f"(bound {b['lower_bound_bytes'] / GIB:.2f} GiB)    {tail}")
        print(
            f"process peak (ru_maxrss) {r['rss_peak_bytes'] / MIB:.0f} MiB (+{r['rss_growth_bytes'] / MIB:.0f} MiB while "
            f"planning this model) vs parameters {r['param_bytes'] / MIB:.0f} MiB "
            f"({r['rss_peak_vs_params']:.0%} of them for the whole process)"
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--budgets", default="80,60,40", help="percentages of the unplanned peak")
    ap.add_argument("--time-limit", type=float, default=None, help="solver seconds per plan (default: optsched's)")
    ap.add_argument("--plans-dir", type=Path, default=None, help="save each plan as DIR/<model>-<budget>.json")
    ap.add_argument("--out", type=Path, default=RESULTS / "plan_offline.json")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    rows = []
    t0 = time.perf_counter()
    for name in args.models.split(","):
        rows.append(run_model(MODELS[name](), budgets, args.time_limit, args.plans_dir))
        print_rows(rows[-1:])
    total = time.perf_counter() - t0
    print(f"\ntotal {total:.0f} s")
    write_result(args.out, {
        "what": "plan_offline: fake-tensor capture (AOTAutograd) planned for an H100 on this CPU machine",
        "torch": torch.__version__, "time_limit_s": args.time_limit, "total_s": total, "models": rows,
    })


if __name__ == "__main__":
    main()
