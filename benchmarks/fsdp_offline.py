"""A Llama-3-8B-shaped model for 8 ranks of H100 under FSDP2, planned offline on this CPU (issue 17, "What it must
show" 3): per-rank predicted peak and time at 3 per-rank budgets, and the plan file every rank loads.

What is modelled, exactly (nothing runs FSDP2 here: 8 ranks of collectives under fake tensors are not possible
on one CPU process, and would not change the plan):

- The planned program is what `optsched.distributed.optimize_fsdp` plans and every rank runs: one transformer
  block's forward+backward (LitGPT-style LLaMA block, benchmarks/models/llama.py, with Llama-3-8B's shapes:
  width 4096, 32 query heads, 8 key/value groups, SwiGLU 14336, bf16 parameters) on this rank's batch (1 x
  8192 tokens), captured under fake tensors for the h100 profile (`plan_offline`: roofline times, cuDNN
  attention as an H100 picks it, offloading allowed). Its parameters are the all-gathered (unsharded) ones;
  its output's gradient arrives as a tangent. FSDP2 runs 32 of them per step, the same plan for each.
- The per-rank budget is split as `optsched.distributed.FSDPMemory` counts it: this rank's 1/8 shard of every
  parameter and gradient (dim 0 padded), the root's parameters (embedding, final norm, LM head: vocabulary
  128256) all-gathered for the whole step and their unsharded gradients, one block's flat all-gather buffer,
  the block prefetched in the backward, one block's reduce-scatter input and output, the root's activations
  (at their peak in the unplanned step of the model with 0 blocks, captured offline the same way: its
  timeline without parameters and gradients), 31 blocks' saved activations (each block's input included)
  and the running block's planned peak.
  An upper bound: transient buffers that never coincide are added.
- Budgets: the fixed terms (everything but the blocks' activations) + 75%, 50% and 30% of what the blocks'
  activations add to them with the fastest block plan.
- The block plan is the fastest whose total fits the per-rank budget (`choose_block_plan`): the solver's plan for
  the largest block budget that fits (bisection over the block's peak), or a whole-block schedule (full
  recomputation of the block, i.e. per-block activation checkpointing; block checkpoints; sqrt segments), or a
  recompute set from a ladder ordered by time per saved byte: these keep fewer activations per block, and 32
  blocks multiply them. Then the block is planned with
  `plan_offline` for that choice and the total checked.
- Time per step = 32 x the block plan's estimated time + the root's (roofline, h100). Communication (all-gathers,
  reduce-scatters over NVLink) is not modelled: FSDP2 overlaps it with compute on separate streams.
- Optimizer states (AdamW: 2 x the shards in fp32) live outside the step and are not counted; mixed precision
  (fp32 shards, bf16 all-gathers) is not modelled: parameters are bf16 throughout.

The plan file (one per budget) is checked loadable by every rank: a second process captures the block again,
as each of the 8 ranks does (same shapes on every rank), and every rank's check (fingerprint and what the plan
was made for) passes.

    python -m benchmarks.fsdp_offline              # writes benchmarks/results/fsdp_offline.json
    python -m benchmarks.fsdp_offline --seq 2048   # smaller, faster
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.meta import with_meta

MIB, GIB = 2**20, 2**30
ROOT = Path(__file__).resolve().parent.parent
RESULTS_JSON = Path(__file__).parent / "results" / "fsdp_offline.json"
WORLD = 8
MODEL = dict(name="llama-3-8b", block_size=8192, vocab_size=128256, padding_multiple=64, n_head=32, n_query_groups=8,
             n_embd=4096, intermediate_size=14336, norm_eps=1e-5, bias=False, rope_base=500000, n_layer=32)
FRACTIONS = (0.75, 0.5, 0.3)  # per-rank budgets: the fixed terms + this share of what the fastest plan adds to them


def _config(**overrides):
    from benchmarks.models import llama

    return llama.Config(**{**MODEL, **overrides})


class OneBlock(torch.nn.Module):
    """One LLaMA block as FSDP2 runs it: (x, cos, sin) -> x, its parameters all-gathered."""

    def __init__(self, cfg):
        super().__init__()
        from benchmarks.models import llama

        self.block = llama.Block(cfg)

    def forward(self, x, cos, sin):
        return self.block(x, cos, sin)


def block_inputs(cfg, batch: int, seq: int):
    from benchmarks.models import llama

    cos, sin = llama.build_rope_cache(cfg.block_size, cfg.rope_n_elem, cfg.rope_base, cfg.rope_condense_ratio)
    x = torch.randn(batch, seq, cfg.n_embd, dtype=cfg.dtype, requires_grad=True)
    return x, cos[:seq], sin[:seq]


def plan_block(cfg, batch, seq, budget, time_limit_s=None):
    from optsched.compiler.offline import plan_offline

    return plan_offline(lambda: OneBlock(cfg), lambda: block_inputs(cfg, batch, seq), budget, device_profile="h100",
                        time_limit_s=time_limit_s)


def recapture_child(cfg_json: str, batch: int, seq: int, paths: list[str]) -> dict:
    """Another rank: capture the block again and check every plan file against it, once per rank."""
    from optsched.plans.file_format import load_plan

    cfg = _config(**json.loads(cfg_json))
    fp = plan_block(cfg, batch, seq, None).fingerprint
    out = {}
    for path in paths:
        checks = []
        for _rank in range(1, WORLD):
            pf = load_plan(path)
            made = pf.data["made_for"]
            checks.append(pf.describe_mismatch(fp, kind="training", device_profile="h100", executor=made["executor"],
                                               offload=made["offload"]))
        out[path] = checks
    return {"fingerprint": fp["hash"], "checks": out}


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(module.parameters())


def run(args) -> dict:
    import optsched
    from benchmarks.models import llama
    from optsched.compiler.offline import plan_offline
    from optsched.solvers import default_schedule, simulate
    from optsched.distributed import (activation_peak, block_schedule, choose_block_plan, fsdp_memory, plan_digest,
                                      saved_bytes, with_schedule)
    from optsched.solvers.search.sweep import heuristic_schedule

    cfg = _config()
    batch, seq = args.batch, args.seq
    t0 = time.perf_counter()
    # the root alone (0 blocks): its activations at their peak in the unplanned step (parameters, gradients apart)
    root_cfg = _config(n_layer=0)
    root_plan = plan_offline(lambda: llama.LLaMA(root_cfg), lambda: llama.make_batch(root_cfg, batch, seq), None,
                             device_profile="h100")
    with torch.device("meta"):
        meta_root = llama.LLaMA(root_cfg)
        meta_block = llama.Block(cfg)
    root_params = params_of(meta_root)
    root_sim = simulate(root_plan.problem, default_schedule(root_plan.problem))  # the root runs unplanned
    root_act = activation_peak(root_plan.problem, root_sim)
    block_params = params_of(meta_block)
    memory = fsdp_memory([block_params] * cfg.n_layer, root_params, WORLD, root_act)
    x, cos, sin = block_inputs(cfg, batch, seq)
    arg_bytes = sum(t.numel() * t.element_size() for t in (x, cos, sin))
    t_root = time.perf_counter() - t0

    t1 = time.perf_counter()
    fastest = plan_block(cfg, batch, seq, None, args.time_limit)
    fastest_memory = memory.with_block(fastest.predicted_peak_bytes, saved_bytes(fastest.problem, fastest.sim, arg_bytes))
    print(f"root: {root_sim.peak_bytes / GIB:.2f} GiB unplanned, activations {root_act / GIB:.2f} GiB; "
          f"fastest block plan {fastest.predicted_peak_bytes / GIB:.2f} GiB ({time.perf_counter() - t1:.1f} s); "
          f"per rank {fastest_memory.total / GIB:.2f} GiB", flush=True)

    rows = []
    plan_dir = Path(tempfile.mkdtemp(prefix="fsdp_offline_"))
    limit = args.time_limit or 5.0  # each bisection step's solve
    for fraction in FRACTIONS:
        budget = int(memory.fixed + fraction * (fastest_memory.total - memory.fixed))
        row = {"activation_share": fraction, "budget_bytes": budget}
        t2 = time.perf_counter()
        try:
            m = fastest_memory
            for choice in choose_block_plan(fastest.problem, memory, budget, arg_bytes, limit)[:4]:
                try:
                    plan = plan_block(cfg, batch, seq, choice.block_budget, args.time_limit)
                except optsched.BudgetInfeasibleError:
                    continue
                if choice.how != "solve":
                    plan = with_schedule(plan, block_schedule(choice, plan.problem), f"fsdp_offline: {choice.describe()}")
                m = memory.with_block(plan.predicted_peak_bytes, saved_bytes(plan.problem, plan.sim, arg_bytes))
                if m.total <= budget:
                    break
            else:
                raise optsched.BudgetInfeasibleError(budget, m.total, memory.fixed)
            block_budget = choice.block_budget
        except optsched.BudgetInfeasibleError as e:
            row.update(infeasible=True, message=str(e), plan_s=time.perf_counter() - t2)
            rows.append(row)
            print(f"{fraction:.0%}: infeasible: {e}", flush=True)
            continue
        s = plan.summary()
        path = plan_dir / f"block_{int(fraction * 100)}.json"
        plan.save(path)
        step_s = cfg.n_layer * plan.sim.time_s + root_sim.time_s
        fastest_step_s = cfg.n_layer * fastest.sim.time_s + root_sim.time_s
        row.update(
            predicted_peak_bytes=m.total, block_budget_bytes=block_budget, block_peak_bytes=plan.predicted_peak_bytes,
            saved_per_block_bytes=m.saved_per_block, fixed_bytes=m.fixed, memory=m.describe(),
            step_time_s=step_s, time_ratio_vs_fastest=step_s / fastest_step_s, block_status=s["solver_status"],
            block_gap=s["gap"], n_recomputed=s["n_recomputed"], n_offloaded=s["n_offloaded"],
            offloaded_bytes=s["offloaded_bytes"], plan_s=time.perf_counter() - t2, plan_file=str(path), block_plan=choice.describe(),
            digest=plan_digest(plan), fingerprint=plan.fingerprint["hash"],
        )
        rows.append(row)
        print(f"{fraction:.0%}: {m.total / GIB:.2f} GiB <= {budget / GIB:.2f} GiB, step {step_s * 1e3:.1f} ms "
              f"(x{step_s / fastest_step_s:.3f}), {s['n_recomputed']} recomputed, {s['n_offloaded']} offloaded "
              f"({time.perf_counter() - t2:.1f} s)", flush=True)

    # the reference torchtitan compares against: full activation checkpointing of every block
    ac_sim = simulate(fastest.problem, heuristic_schedule("full_recompute", fastest.problem))
    full_ac = memory.with_block(ac_sim.peak_bytes, saved_bytes(fastest.problem, ac_sim, arg_bytes))
    full_ac_row = {"predicted_peak_bytes": full_ac.total, "memory": full_ac.describe(),
                   "step_time_s": cfg.n_layer * ac_sim.time_s + root_sim.time_s}
    print(f"full activation checkpointing: {full_ac.total / GIB:.2f} GiB, step {full_ac_row['step_time_s'] * 1e3:.1f} ms",
          flush=True)

    paths = [r["plan_file"] for r in rows if "plan_file" in r]
    cmd = [sys.executable, "-m", "benchmarks.fsdp_offline", "--child", json.dumps({}), "--batch", str(batch),
           "--seq", str(seq), "--paths", *paths]
    child = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    other = json.loads(lines[-1]) if lines else {"error": child.stderr[-2000:]}
    for r in rows:
        if "plan_file" in r:
            checks = other.get("checks", {}).get(r["plan_file"])
            r["loadable_by_every_rank"] = checks is not None and all(c is None for c in checks)
            r["rank_checks"] = checks
            r["fingerprint_other_process"] = other.get("fingerprint")
    return {
        "model": "Llama-3-8B shapes (LitGPT-style LLaMA, bf16), 32 blocks, FSDP2 over 8 H100 ranks, modelled",
        "per_rank_batch": [batch, seq], "world": WORLD, "device_profile": "h100",
        "fastest": {"predicted_peak_bytes": fastest_memory.total, "memory": fastest_memory.describe(),
                    "step_time_s": cfg.n_layer * fastest.sim.time_s + root_sim.time_s,
                    "block_peak_bytes": fastest.predicted_peak_bytes},
        "full_activation_checkpointing": full_ac_row,
        "root": {"unplanned_peak_bytes": root_sim.peak_bytes, "activations_bytes": root_act,
                 "time_s": root_sim.time_s, "plan_s": t_root},
        "rows": rows, "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "modelled": __doc__.split("What is modelled, exactly")[1].split("    python -m")[0].strip(),
    }


def table(result: dict) -> str:
    out = [f"{result['model']}; per rank batch {result['per_rank_batch'][0]} x {result['per_rank_batch'][1]}",
           f"fastest block plan: per rank {result['fastest']['predicted_peak_bytes'] / GIB:.2f} GiB, "
           f"step {result['fastest']['step_time_s'] * 1e3:.1f} ms; full activation checkpointing: per rank "
           f"{result['full_activation_checkpointing']['predicted_peak_bytes'] / GIB:.2f} GiB, "
           f"step {result['full_activation_checkpointing']['step_time_s'] * 1e3:.1f} ms",
           f"{'budget':>10} {'predicted':>10} {'step ms':>9} {'x fastest':>9} {'recomp':>6} {'offl':>5} "
           f"{'block plan':>15} {'plan s':>7} {'8 ranks load':>12}"]
    for r in result["rows"]:
        if r.get("infeasible"):
            out.append(f"{r['budget_bytes'] / GIB:>8.2f}Gi  infeasible")
            continue
        out.append(f"{r['budget_bytes'] / GIB:>8.2f}Gi {r['predicted_peak_bytes'] / GIB:>8.2f}Gi {r['step_time_s'] * 1e3:>9.1f} "
                   f"{r['time_ratio_vs_fastest']:>9.3f} {r['n_recomputed']:>6} {r['n_offloaded']:>5} {r['block_plan']:>15} "
                   f"{r['plan_s']:>7.1f} {str(r.get('loadable_by_every_rank')):>12}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--paths", nargs="*", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--json", default=str(RESULTS_JSON))
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(recapture_child(args.child, args.batch, args.seq, args.paths)))
        return
    result = run(args)
    print(table(result))
    Path(args.json).write_text(json.dumps(with_meta(result), indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
