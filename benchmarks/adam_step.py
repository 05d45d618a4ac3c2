"""Thunder issue 1173's copy-heavy program: a compiled torch.optim.Adam step.

A functionalized optimizer step computes every new parameter and state tensor out of
place and copies it back (`copy_(input, new)`). optsched folds those writes into the ops
computing them where no order the planner may pick can change a value
(`optsched/inplace.py`), then plans and runs the step. This benchmark compiles the step
of a GPT with about 200 parameter tensors, for-loop (`foreach=False`) and `foreach=True`:

* optsched with the default (eager) executor, and with the inductor executor, which splits
  foreach ops per tensor and fuses each parameter's update, writes into parameter and
  state included, into one shape-generic kernel (compiled once per structure and rank);
* compile time of the first call: optsched (its planning time too) and torch.compile
  (Inductor, C++ codegen on CPU; its on-disk caches are off so every compile is cold;
  optsched's shape-generic kernels never use Inductor's graph caches either);
* time per step against eager `opt.step()`, timed alternately (`measure_ratio`);
* peak allocator bytes above the start of a step (parameters, gradients and state held);
* whether parameters and state after the first steps equal eager's, bitwise, and equal
  the traced program run op by op (`torch.compile(backend="eager")` with addcmul_/addcdiv_
  kept whole, as optsched puts them back): Dynamo traces Adam's capturable branch (float32
  tensor bias corrections), so no compiled step is bitwise equal to eager `opt.step()`.

`opt.step` graph-breaks on purpose in its `_use_grad` wrapper; every compiled variant here
runs the undecorated `Adam.step` under `torch.no_grad()` as one graph.
Writes benchmarks/results/adam_step.json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import time
from pathlib import Path

import torch
from torch import nn

import optsched
from benchmarks import write_result
from benchmarks.report import adam_table
from benchmarks.models.gpt import GPTConfig, build, make_batch
from optsched.compiler.backend import PlanningBackend
from optsched.measure import live_bytes, measure_peak, measure_ratio

RESULTS = Path(__file__).parent / "results"
COPY_ = torch.ops.aten.copy_.default


def step_fn(opt: torch.optim.Optimizer):
    """`opt.step` without its decorators (one graph-breaks on purpose), under no_grad."""
    step = type(opt).step.__wrapped__.__wrapped__

    def run():
        with torch.no_grad():
            step(opt)

    return run


def _replica(model: nn.Module, grads: list[torch.Tensor], foreach: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = copy.deepcopy(model)
    for p, g in zip(m.parameters(), grads, strict=True):
        p.grad = g.clone()
    return m, torch.optim.Adam(m.parameters(), lr=1e-3, foreach=foreach)


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(model.parameters()) + [t for s in opt.state.values() for t in s.values()]


def _held(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    return live_bytes(model, [p.grad for p in model.parameters()], list(opt.state.values()))


def _compare(a, b) -> dict:
    ta, tb = [t.detach() for t in _tensors(*a)], [t.detach() for t in _tensors(*b)]
    return {
        "bitwise": all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True)),
        "max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(ta, tb, strict=True)),
    }


@contextlib.contextmanager
def _watch_inference(seen: dict):
    """Record the graph our inference compiler receives and the one it lowers to."""
    original = PlanningBackend.compile_inference

    def spy(self, gm, example_inputs):
        seen["copies_captured"] = sum(n.target is COPY_ for n in gm.graph.nodes)
        run = original(self, gm, example_inputs)
        lowered = run.graph_module.graph
        seen["lowered"] = lowered
        seen["copies_lowered"] = sum(n.target is COPY_ for n in lowered.nodes)
        seen["lowered_ops"] = collections.Counter(
            str(n.target) for n in lowered.nodes if n.op == "call_function" and "getitem" not in str(n.target)
        )
        return run

    PlanningBackend.compile_inference = spy
    try:
        yield
    finally:
        PlanningBackend.compile_inference = original


def _first_call(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


OPTSCHED_VARIANTS = {"optsched": "eager", "optsched_inductor": "inductor"}  # variant -> optsched executor


def _plan_row(prefix: str, opt_step, seen: dict) -> dict:
    plan = opt_step.plan
    lowered = seen["lowered"]
    groups = [n.meta["fusion_group"] for n in lowered.nodes if "fusion_group" in n.meta]
    return {
        f"{prefix}_plan_s": plan.solve_time_s,
        f"{prefix}_n_ops": len(plan.problem.ops),
        f"{prefix}_status": plan.solver_status,
        f"{prefix}_fusion_groups": len(groups),
        f"{prefix}_copies_lowered": seen["copies_lowered"],
        f"{prefix}_writes_folded": seen["copies_captured"] - seen["copies_lowered"],
        f"{prefix}_lowered_ops": dict(seen["lowered_ops"].most_common(12)),
    }


def run_one(model, grads, foreach: bool, steps: int, inductor: bool, repeat: int) -> dict:
    eager = _replica(model, grads, foreach)
    traced = _replica(model, grads, foreach)
    row: dict = {"foreach": foreach, "param_tensors": len(list(model.parameters()))}
    row["param_bytes"] = live_bytes(model)

    variants = {}
    for name, executor in OPTSCHED_VARIANTS.items():
        state = _replica(model, grads, foreach)
        seen: dict = {}
        with _watch_inference(seen):
            opt_step = optsched.optimize(step_fn(state[1]), None, executor=executor)
            row[f"{name}_first_call_s"] = _first_call(opt_step)
        row["copies_captured"] = seen["copies_captured"]
        row.update(_plan_row(name, opt_step, seen))
        variants[name] = (opt_step, state)

    # the reference program: the same Dynamo graph run op by op, with addcmul_/addcdiv_ kept whole
    # (optsched puts back the mul + fma Dynamo splits them into; optsched/passes/restore_ops.py)
    traced_compiled = torch.compile(step_fn(traced[1]), backend="eager", fullgraph=True)

    def traced_step():
        with torch._dynamo.config.patch(enable_dynamo_decompositions=False):
            traced_compiled()

    traced_step()
    eager[1].step()
    plans = {name: fn.plan for name, (fn, _) in variants.items()}
    if inductor:
        ind = _replica(model, grads, foreach)
        with torch._inductor.config.patch(force_disable_caches=True):
            ind_step = torch.compile(step_fn(ind[1]), fullgraph=True)
            row["inductor_first_call_s"] = _first_call(ind_step)
        variants["inductor"] = (ind_step, ind)
    for _ in range(steps - 1):
        eager[1].step()
        traced_step()
        for fn, _ in variants.values():
            fn()
    for name, (_, state) in variants.items():
        row[f"{name}_vs_eager"] = _compare(state, eager)
        row[f"{name}_vs_traced"] = _compare(state, traced)

    # peak above what the step starts with (parameters, gradients, state)
    row["eager_peak_bytes"] = measure_peak(eager[1].step).peak_bytes
    for name, (fn, _state) in variants.items():
        row[f"{name}_peak_bytes"] = measure_peak(fn).peak_bytes
    for name, plan in plans.items():
        fn, state = variants[name]
        row[f"{name}_predicted_peak_bytes"] = plan.predicted_peak_bytes - _held(*state)
        assert fn.plan is plan, f"{name} re-planned"

    for name, (fn, _) in variants.items():
        t, t_eager = measure_ratio(fn, eager[1].step, repeat=repeat)
        row[f"{name}_step_s"], row[f"{name}_eager_step_s"] = t, t_eager
        row[f"{name}_time_ratio"] = t / t_eager
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="GPT blocks (12 parameter tensors each, plus 4)")
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="steps before comparing with eager")
    ap.add_argument("--repeat", type=int, default=11, help="timed steps per variant")
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (needs a C++ compiler, slow)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument(
        "--no-dynamo-decompositions", action="store_true",
        help="keep addcmul_/addcdiv_ whole (torch._dynamo.config.enable_dynamo_decompositions = False)",
    )
    ap.add_argument("--foreach", choices=["both", "false", "true"], default="both")
    ap.add_argument("--json", type=Path, default=RESULTS / "adam_step.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_dynamo_decompositions:
        torch._dynamo.config.enable_dynamo_decompositions = False

    cfg = GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=4, vocab_size=1000, block_size=64)
    model = build(cfg, seed=0)
    model(*make_batch(cfg, batch_size=4)).backward()  # realistic gradients, shared by every replica
    grads = [p.grad.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None

    modes = {"both": [False, True], "false": [False], "true": [True]}[args.foreach]
    rows = {}
    for foreach in modes:
        torch._dynamo.reset()
        name = "foreach" if foreach else "for-loop"
        rows[name] = run_one(model, grads, foreach, args.steps, not args.no_inductor, args.repeat)
        rows[name]["dynamo_decompositions"] = torch._dynamo.config.enable_dynamo_decompositions
        rows[name]["threads"] = torch.get_num_threads()
        rows[name]["torch"] = torch.__version__
        print(f"{name}: done", flush=True)

    print(f"\nAdam step, GPT with {rows[next(iter(rows))]['param_tensors']} parameter tensors "
          f"({rows[next(iter(rows))]['param_bytes'] / 2**20:.1f} MiB), CPU, {torch.get_num_threads()} threads")
    print(adam_table(rows))
    print("traced program: the same Dynamo graph run op by op; bitwise, or the largest difference.")
    write_result(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
