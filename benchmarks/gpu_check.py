"""GPU reality check (issue 23): optsched's CUDA paths measured on the machine at hand, in one process.

Sections, in the order they run (each in its own try: a failure is recorded in the JSON and the rest goes on;
every case of the headline likewise; a CUDA error that poisons the process skips what follows, with its reason):

    preflight     seconds: a CUDA matmul, OR-tools, a C compiler and Python.h, Inductor compiling one kernel
    headline      a transformers Llama (LlamaConfig + LlamaForCausalLM, random weights, bf16, called with
                  labels; 8 layers, hidden 1024, vocabulary 8000: see ModelConfig) side by side, first with
                  eager kernels everywhere: eager (and eager with the causal mask materialized, as every traced
                  row has it); full activation checkpointing (transformers' own); torch.compile with
                  activation_memory_budget 1.0 / 0.5 / 0.0 (aot_eager_decomp_partition); optsched with no
                  budget, at 60% / 40% of eager's MEASURED peak (bytes), at 40% with offload on and off, and at
                  full checkpointing's measured peak. Last, in the time left: optsched's Inductor executor at
                  60% and torch.compile (Inductor) at 0.5. Per case: measured peak (allocator, model resident),
                  optsched's predicted peak, step time (CUDA events, median after warm-up), the allocator's
                  reserved peak, gradients against eager's, planning seconds, solver status and gap
    offload       at 40% (--low-share) and 60%: the offload plan's measured step time against the recompute-only
                  plan's, and its predicted exposed copy time against an estimate from a profiled step of each
                  (the first budget whose plan offloads anything)
    does_not_fit  the allocator capped (set_per_process_memory_fraction) below eager's peak: eager runs out
                  of memory, optsched with mem_budget="auto" (and bytes) plans and runs within the cap from
                  the first call; the first call's peak, planning included
    gpu_tests     `pytest -m gpu` in a child process (only the test files that have the marker): counts

The caching allocator runs with expandable segments (--alloc-conf; unless PYTORCH_ALLOC_CONF or
PYTORCH_CUDA_ALLOC_CONF is set): it then counts each block at its requested size rounded to 512 bytes, what a
plan predicts. In its default mode a block it does not split counts whole, history decides which, and measured
peaks ran 11-15 MiB above the requested bytes on the H200 (issue 32; docs/benchmarks.md, the allocator's modes).

Writes benchmarks/results/gpu_check.json (--out) after every case, and prints a table. Without CUDA it says so
and writes a JSON with "cuda": false and every section skipped with its reason; --cpu-smoke runs the headline on
a tiny Llama on the CPU (what tests/test_gpu_check.py runs). The whole check is sized for under 8 minutes on one
H100/H200 (--max-seconds: a case that would start past it is recorded as skipped, not run).

    make gpu-check PY=python3                                   # the machine's own python and torch
    python -m benchmarks.gpu_check --small                      # a smaller model, quicker
    python -m benchmarks.gpu_check --batch 16 --out /tmp/g.json
    python -m benchmarks.gpu_check --cpu-smoke                  # no GPU: the CPU-runnable parts, tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()  # before torch is imported: the check's seconds count its imports
MIB, GIB = 2**20, 2**30
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
SCHEMA, SCHEMA_VERSION = "optsched.gpu_check", 1
SECTIONS = ("preflight", "headline", "offload", "does_not_fit", "gpu_tests")  # the order they run in
CUDA_ONLY = ("preflight", "gpu_tests", "does_not_fit", "offload")  # the headline alone has a CPU form (--cpu-smoke)
NO_CUDA = "CUDA is unavailable (torch.cuda.is_available() is False)"
MINCUT_KNOBS = (1.0, 0.5, 0.0)


@dataclass(frozen=True)
class ModelConfig:
    """The Llama of the headline. batch None: chosen on CUDA so eager's peak is --eager-share of the device.

    The vocabulary is 8000, not Llama's 32000 (--vocab 32000 for that): at width 1024 the cross-entropy's
    float32 logits dominate the step, and one op of its backward (the log-softmax's, with its input, output
    and gradient live at once) needs 49% of the unplanned peak by plan_offline's proven lower bound (h100
    profile, any batch), so no plan reaches 40%; optsched's LM-head chunking does not match transformers'
    loss (logits sliced by logits_to_keep). At 8000 the bound is 22% and 40% is planned, offloads included."""

    layers: int = 8
    hidden: int = 1024
    intermediate: int = 2816
    heads: int = 16
    kv_heads: int = 16
    vocab: int = 8000
    seq: int = 2048
    batch: int | None = None
    dtype: str = "bfloat16"

    def describe(self) -> str:
        return (f"Llama {self.layers} layers, hidden {self.hidden}, intermediate {self.intermediate}, {self.heads} heads "
                f"({self.kv_heads} kv), vocab {self.vocab}, sequence {self.seq}, batch {self.batch}, {self.dtype}")


FULL = ModelConfig()
SMALL = ModelConfig(layers=4, hidden=512, intermediate=1408, heads=8, kv_heads=8, vocab=8000, seq=1024, batch=8)
# activations outweigh parameters, as in the real one, so budgets have room to act
TINY = ModelConfig(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, seq=128, batch=4, dtype="float32")


@dataclass
class Case:
    """One headline row: `run(check)` returns its figures; `estimate_s` is what it may take (for --max-seconds)."""

    name: str
    kind: str  # eager | optsched | checkpointing | mincut
    run: Callable[[Check], dict]
    estimate_s: float = 30.0
    skip_reason: str | None = None


@dataclass
class Check:
    """Everything the sections share: options, device, the model and its batch, eager's reference, the result."""

    args: argparse.Namespace
    device: Any  # torch.device
    cfg: ModelConfig
    out: Path
    result: dict
    started: float = field(default_factory=time.perf_counter)  # main(): STARTED, imports counted
    poisoned: str | None = None  # a CUDA error this process cannot recover from: later cases are skipped
    inductor_broken: str | None = None  # why the preflight could not compile a Triton kernel
    model: Any = None
    ids: Any = None
    eager: dict | None = None  # eager's row
    eager_grads: dict | None = None  # on the CPU, in the parameters' dtype

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def time_left(self) -> float:
        return self.args.max_seconds - self.elapsed()

    def save(self) -> None:
        self.result["elapsed_s"] = round(self.elapsed(), 3)
        write_json(self.out, self.result)


# --------------------------------------------------------------------------- JSON and records

def _finite(x: Any) -> Any:
    """JSON without NaN/Infinity: non-finite floats become None; tuples lists; other objects their str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader (or a check killed mid-write) sees the previous file or this one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_finite(data), f, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def error_record(e: BaseException, limit: int = 12) -> dict:
    """An exception as the JSON keeps it: type, message (first 2000 characters), the traceback's last lines."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip().splitlines()
    rec = {"type": type(e).__name__, "message": str(e)[:2000], "traceback": "\n".join(tb[-limit:])}
    for k in ("budget_bytes", "lowest_peak_bytes", "lower_bound_bytes"):  # BudgetInfeasibleError's figures
        if isinstance(getattr(e, k, None), int):
            rec[k] = getattr(e, k)
    return rec


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def run_section(check: Check, name: str, fn: Callable[[Check], dict]) -> dict:
    """`fn(check)`'s figures as the section's, status "ok" (or what fn set); an exception recorded, never raised."""
    t0 = time.perf_counter()
    try:
        sec = fn(check)
        sec.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
        sec = {"status": "error", "error": error_record(e)}
        note_poison(check, e)
        earlier = check.result["sections"].get(name) or {}
        if earlier.get("cases"):  # rows recorded before the failure stay
            sec["cases"] = earlier["cases"]
    sec["seconds"] = round(time.perf_counter() - t0, 3)
    check.result["sections"][name] = sec
    check.save()
    return sec


def run_case(check: Check, case: Case, rows: list) -> dict:
    """One headline case: its figures, skipped (its reason, or --max-seconds), or its exception recorded."""
    row: dict = {"name": case.name, "kind": case.kind}
    if case.skip_reason:
        row.update(skipped(case.skip_reason))
    elif check.poisoned:
        row.update(skipped(f"an earlier CUDA error left this process unusable: {check.poisoned}"))
    elif check.time_left() < case.estimate_s:
        row.update(skipped(f"--max-seconds {check.args.max_seconds:.0f}: {check.elapsed():.0f} s spent, this case may "
                           f"take {case.estimate_s:.0f} s"))
    else:
        t0 = time.perf_counter()
        try:
            row.update(case.run(check))
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - every case is recorded, whatever happened to the others
            row.update(status="error", error=error_record(e))
            note_poison(check, e)
        cleaned = _clean(check)
        if cleaned:
            row["clean_error"] = cleaned
        row["seconds"] = round(time.perf_counter() - t0, 3)
    rows.append(row)
    check.save()
    print(f"  {case.name}: {_row_line(row)}", flush=True)
    return row


def _clean(check: Check) -> dict | None:
    """Gradients dropped and the allocator's cache emptied between cases (a case that ran out of memory leaves
    nothing behind). Never raises: a CUDA error an earlier kernel left surfaces here at the synchronize, and is
    returned (and marks the process poisoned) instead of replacing the section's rows."""
    import torch

    if check.model is not None:
        for p in check.model.parameters():
            p.grad = None
    gc.collect()
    if check.cuda:
        try:
            torch.cuda.synchronize(check.device)
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            note_poison(check, e)
            return error_record(e, limit=4)
    return None


def is_cuda_error(e: BaseException) -> bool:
    """A CUDA error that leaves the context unusable (an illegal access, a device-side assert, a launch failure):
    every later kernel fails too. Running out of memory is not one: the allocator recovers once freed."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("CUDA error" in text or "cudaError" in text or "CUBLAS_STATUS" in text)


def note_poison(check: Check, e: BaseException) -> None:
    if check.cuda and check.poisoned is None and is_cuda_error(e):
        check.poisoned = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        check.result["poisoned"] = check.poisoned


# --------------------------------------------------------------------------- environment

def ensure_optsched_importable() -> str:
    """optsched imported from this source tree without being installed (PYTHONPATH=$PWD, as on a GPU machine
    whose python has only optsched's dependencies): its `optsched.solvers` package is the top-level solvers/
    directory (pyproject's package-dir), which only an install maps. Map it here, under its own name, so its
    modules are the ones optsched imports. Returns how optsched is found."""
    try:
        importlib.import_module("optsched.solvers")
        return "importable"
    except ModuleNotFoundError as e:
        if e.name != "optsched.solvers":
            raise
    import optsched

    pkg = ROOT / "solvers"
    spec = importlib.util.spec_from_file_location("optsched.solvers", pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["optsched.solvers"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["optsched.solvers"]
        raise
    optsched.solvers = module
    return f"source tree {ROOT} (optsched.solvers mapped to solvers/)"


# run in pytest's child process: the same mapping, then pytest
_PYTEST_BOOTSTRAP = ("import sys; from benchmarks.gpu_check import ensure_optsched_importable; ensure_optsched_importable(); "
                     "import pytest; sys.exit(pytest.main(sys.argv[1:]))")


def git_state(root: Path = ROOT) -> dict:
    """The commit and whether tracked files differ from it (untracked files counted apart)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=20, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain").splitlines()
    except (OSError, subprocess.SubprocessError) as e:  # a copy of the tree without .git: the commit it was sent at
        return {"commit": os.environ.get("OPTSCHED_COMMIT"), "clean": None, "from": "OPTSCHED_COMMIT",
                "error": f"{type(e).__name__}: {str(e)[:200]}"}
    modified = [ln[3:] for ln in status if not ln.startswith("??")]
    state = {"commit": commit, "clean": not modified, "modified": modified[:50],
             "untracked": sum(ln.startswith("??") for ln in status)}
    sent = os.environ.get("OPTSCHED_COMMIT")
    if sent:  # the device's copy of .git can lag the tree sent with it (seen: a session-start .git, today's tree)
        state = {**state, "copy_commit": commit, "commit": sent, "from": "OPTSCHED_COMMIT"}
    return state


def result_meta(env: dict) -> dict:
    """The JSON's `meta`, as every benchmark's (benchmarks/meta.py): the commit the tree was sent at where
    OPTSCHED_COMMIT says it (the device call sets it), else the checkout's."""
    git = env.get("git") or {}
    commit, sent = git.get("commit"), git.get("from") == "OPTSCHED_COMMIT"  # sent: the copy's tree state is unknown
    return {"commit": commit, "short": commit[:7] if commit else None, "clean": None if sent else git.get("clean"),
            "dirty_files": [] if sent else git.get("modified", []), "sent_commit": sent,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": env.get("torch"), "python": env.get("python"),
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu_check", *sys.argv[1:]])}


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception:  # noqa: BLE001 - absent or broken: say so
        return None


def environment(device) -> dict:
    import torch

    env = {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "triton": _version("triton"), "transformers": _version("transformers"),
        "ortools": _version("ortools"), "optsched": _version("optsched"), "cpu_threads": torch.get_num_threads(),
        "git": git_state(),
    }
    if device is not None and device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device=torch.cuda.get_device_name(device), device_memory_bytes=p.total_memory,
                   capability=f"{p.major}.{p.minor}", device_count=torch.cuda.device_count(),
                   cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


# --------------------------------------------------------------------------- model and measurement

def build_model(cfg: ModelConfig, device):
    """transformers' LlamaForCausalLM, random weights (seed 0), in training mode, no KV cache; on `device`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    lc = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                     num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                     max_position_embeddings=cfg.seq, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(lc)
    return model.to(getattr(torch, cfg.dtype)).train()


def make_ids(cfg: ModelConfig, batch: int, device):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g).to(device)


def loss_call(call: Callable) -> Callable:
    """A Llama called with labels: the loss."""
    return lambda ids: call(input_ids=ids, labels=ids).loss


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(call: Callable, model, ids) -> Callable[[], None]:
    """One step of `call` (a loss of ids): gradients cleared first, loss backward."""
    def run() -> None:
        for p in model.parameters():
            p.grad = None
        call(ids).backward()

    return run


def step_time(run: Callable[[], None], device, warmup: int, repeat: int) -> dict:
    """Median seconds of `run()` after `warmup` runs: CUDA events on CUDA (the GPU's timeline between two
    records, host stalls included), wall clock on the CPU."""
    import torch

    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


def grad_error(grads: dict, reference: dict | None) -> dict:
    """Gradients against eager's: the largest absolute difference, and relative (that over the largest |eager
    gradient| of the same parameter), over all parameters; parameters one side has and the other lacks."""
    if reference is None:
        return {"grad_max_abs_err": None, "grad_max_rel_err": None, "grads_missing": []}
    missing = sorted(grads.keys() ^ reference.keys())
    abs_err = rel_err = 0.0
    for name in grads.keys() & reference.keys():
        g = grads[name].float()
        r = reference[name].to(g.device).float()
        d = (g - r).abs().max().item()
        scale = r.abs().max().item()
        abs_err = max(abs_err, d)
        rel_err = max(rel_err, d / scale if scale > 0 else (0.0 if d == 0 else math.inf))
    return {"grad_max_abs_err": abs_err, "grad_max_rel_err": rel_err, "grads_missing": missing[:10]}


def _intervals_union(iv: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(iv):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_step(run: Callable[[], None], device) -> dict:
    """One step under torch.profiler (CUDA activity): the GPU's span from its first to its last event, the time
    kernels ran (union of their intervals, every stream), host<->device copies' busy time, and the idle time of
    the span (no kernel running: launch gaps, and waits for copies)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        _sync(device)
    kernels, copies = [], []
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        iv = (float(e.time_range.start), float(e.time_range.end))  # microseconds
        (copies if "memcpy" in e.name.lower() else kernels).append(iv)
    spans = kernels + copies
    if not spans:
        return {"error": "the profiler recorded no CUDA events"}
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    busy = _intervals_union(kernels)
    return {"gpu_span_s": span / 1e6, "kernel_busy_s": busy / 1e6, "copy_busy_s": _intervals_union(copies) / 1e6,
            "idle_s": (span - busy) / 1e6, "n_kernels": len(kernels), "n_copies": len(copies)}


PLAN_KEYS = ("budget_bytes", "predicted_peak_bytes", "unplanned_peak_bytes", "lower_bound_bytes", "estimated_time_s",
             "unplanned_time_s", "time_ratio", "solver_status", "gap", "solve_time_s", "method", "n_ops", "n_recomputed",
             "n_offloaded", "offloaded_bytes", "transfer_s", "exposed_transfer_s", "executor", "n_fusion_groups",
             "budget_from", "output_usage", "timing", "device_profile")


def measure_case(check: Check, call: Callable, *, opt=None, budget_bytes: int | None = None, profile: bool = False) -> dict:
    """A case's figures, the model's parameters resident: the first call (planning or compiling included: its
    seconds, and on CUDA its peak), `--warmup` steps (a plan redone for what the first backward showed the
    caller doing included), the peak of one step at the allocator (measure_training_step: the model and the
    batch + the rise), gradients against eager's, the median step time; with `opt`, its plan's figures."""
    import torch
    from optsched.measure import live_bytes, measure_training_step

    model, ids, dev, a = check.model, check.ids, check.device, check.args
    run = train_step(call, model, ids)
    row: dict = {"budget_bytes": budget_bytes}
    _sync(dev)
    if check.cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    run()
    _sync(dev)
    row["first_call_s"] = time.perf_counter() - t0
    if check.cuda:
        row["first_call_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
    first_plan = opt.plan if opt is not None else None
    for _ in range(a.warmup):
        run()
    if check.cuda:  # what the measured peak counts beside the step: the model, the batch, and the rest
        row.update(allocated_at_start_bytes=torch.cuda.memory_allocated(dev), resident_bytes=live_bytes(model, ids),
                   foreign_blocks=foreign_blocks(model, ids))
    m = measure_training_step(call, model, (ids,))
    row.update(measured_peak_bytes=m.peak_bytes, loss=float(m.loss.float().item()))
    if check.cuda:  # the step's peaks as the allocator counts blocks and as they were asked for (issue 32 item 2)
        st = torch.cuda.memory_stats(dev)
        row["allocator_peaks"] = {k: st.get(f"{k}_bytes.all.peak") for k in ("allocated", "requested", "active", "reserved")}
    row.update(grad_error(m.grads, check.eager_grads))
    del m
    if check.cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t = step_time(run, dev, warmup=0, repeat=a.repeat)
    row.update(step_s=t["median_s"], step_min_s=t["min_s"], step_max_s=t["max_s"], timed_steps=t["n"])
    if check.cuda:  # over the timed steps: what the caching allocator held from the device (fragmentation shows here)
        row.update(timed_peak_allocated_bytes=torch.cuda.max_memory_allocated(dev),
                   timed_peak_reserved_bytes=torch.cuda.max_memory_reserved(dev))
    if check.eager is not None and check.eager.get("step_s"):
        row["time_vs_eager"] = row["step_s"] / check.eager["step_s"]
        row["peak_vs_eager"] = row["measured_peak_bytes"] / check.eager["measured_peak_bytes"]
    if budget_bytes is not None:
        row["within_budget"] = row["measured_peak_bytes"] <= budget_bytes
    if opt is not None:
        plan = opt.plan
        s = plan.summary()
        row.update({k: s[k] for k in PLAN_KEYS})
        row["replanned"] = plan is not first_plan
        row["plan_s"] = s["solve_time_s"] + (first_plan.solve_time_s if row["replanned"] and first_plan is not None else 0.0)
        row["predicted_vs_measured"] = (s["predicted_peak_bytes"] - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
        if plan.budget_from and plan.budget_from.get("auto"):
            row["auto"] = plan.budget_from["auto"]
    if profile and check.cuda:
        try:
            row["profile"] = profile_step(run, dev)
        except Exception as e:  # noqa: BLE001 - the profiler is extra: its failure keeps the case's figures
            row["profile"] = {"error": error_record(e, limit=4)}
    return row


def foreign_blocks(model, ids, limit: int = 24) -> dict:
    """The caching allocator's allocated blocks that are not the model's parameters, buffers or gradients nor
    the batch: their sizes (largest first, with how many of each), and their total. What a measured peak
    counts that no plan of the step holds (cuBLAS workspaces, caches, leftovers of earlier cases)."""
    import torch

    try:
        snapshot = torch.cuda.memory_snapshot()
    except Exception as e:  # noqa: BLE001 - a diagnostic: its failure keeps the case's figures
        return {"error": error_record(e, limit=2)}
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), ids]}
    own |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    sizes: dict[int, int] = {}
    own_block = own_requested = 0
    for seg in snapshot:
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            if b.get("address") in own:  # what the allocator counts for them against what was asked
                own_block += int(b["size"])
                own_requested += int(b.get("requested_size") or b["size"])
                continue
            key = int(b.get("requested_size") or b["size"])
            sizes[key] = sizes.get(key, 0) + 1
    top = sorted(sizes.items(), key=lambda kv: -kv[0])[:limit]
    return {"total_bytes": sum(k * n for k, n in sizes.items()), "n_blocks": sum(sizes.values()),
            "sizes": [[k, n] for k, n in top], "own_block_bytes": own_block, "own_requested_bytes": own_requested}


def live_at_peak(events: list[dict], limit: int = 40) -> dict:
    """From the caching allocator's trace of one step (`torch.cuda.memory._snapshot()["device_traces"]`: alloc /
    free_completed events with addr, size and frames), the allocations live when the step's own allocations
    peaked, grouped by where they were made (the innermost frames outside torch's own files): what the
    plan's simulation is checked against when a measured peak is above its prediction."""
    live: dict[int, dict] = {}
    cur = peak = 0
    at = -1
    for i, e in enumerate(events):
        if e.get("action") == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e.get("action") == "free_completed":  # a block made before the trace lowers the level too
            cur -= live.pop(e["addr"])["size"] if e.get("addr") in live else int(e.get("size") or 0)
        if cur > peak:
            peak, at = cur, i
    live = {}
    for e in events[: at + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = e
        elif e.get("action") == "free_completed":
            live.pop(e.get("addr"), None)
    groups: dict[str, list[int]] = {}
    for e in live.values():
        groups.setdefault(_where(e.get("frames") or []), []).append(e["size"])
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:limit]
    return {"peak_rise_bytes": peak, "n_live": len(live), "n_events": len(events),
            "groups": [{"where": w, "bytes": sum(v), "n": len(v), "sizes": sorted(v, reverse=True)[:8]} for w, v in top]}


def _where(frames: list[dict], depth: int = 3) -> str:
    """The innermost `depth` frames that are not torch's own (the op a plan names is the graph line calling it)."""
    own = [f for f in frames if "/torch/" not in str(f.get("filename", "")) or "_dynamo" in str(f.get("filename", ""))]
    pick = (own or frames)[:depth]
    return " < ".join(f"{Path(str(f.get('filename', '?'))).name}:{f.get('line', '?')} {f.get('name', '?')}" for f in pick)


def trace_step(run: Callable[[], None], device, dump: Path | None = None, plan=None) -> dict:
    """One step of `run` with the allocator's history recorded (Python frames): `live_at_peak` of it. With
    `dump`, the raw material for checking a model of the caching allocator against this step is written there:
    the segments and blocks before the step, every alloc/free of the step (action, address, size, stream,
    innermost frame), and `plan`'s predicted steps and lifetimes."""
    import torch

    _sync(device)
    before = torch.cuda.memory_snapshot() if dump is not None else []
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        run()
        _sync(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces") or []
    index = device.index if device.index is not None else torch.cuda.current_device()
    events = traces[index] if index < len(traces) else []
    out = live_at_peak(events)
    if dump is not None:
        data = {"segments_before": [_segment_record(sg) for sg in before],
                "events": [[e.get("action"), e.get("addr"), e.get("size"), e.get("stream"),
                            _where(e.get("frames") or [], depth=1)] for e in events],
                "plan": plan_record(plan) if plan is not None else None}
        dump.parent.mkdir(parents=True, exist_ok=True)
        dump.write_text(json.dumps(data))
        out["dump"] = dump.name
    return out


def _segment_record(seg: dict) -> dict:
    return {"address": seg.get("address"), "total_size": seg.get("total_size"), "stream": seg.get("stream"),
            "segment_type": seg.get("segment_type"), "is_expandable": seg.get("is_expandable"),
            "blocks": [[b.get("address"), b.get("size"), b.get("requested_size"), b.get("state")]
                       for b in seg.get("blocks", [])]}


def plan_record(plan) -> dict:
    """A plan's predicted step as the simulator walks it: per step (op, recomputation?, workspace bytes), per
    tensor copy (name, bytes counted, first and last step), the persistent allocations."""
    sim, p = plan.sim, plan.problem
    return {"predicted_peak_bytes": plan.predicted_peak_bytes, "peak_step": sim.peak_step, "timeline": sim.timeline,
            "steps": [[p.ops[o].name, rc, p.ops[o].workspace_bytes] for o, rc in sim.steps],
            "lifetimes": [[p.tensors[lt.tensor].name, p.tensors[lt.tensor].bytes, lt.start, lt.end, lt.recomputed,
                           lt.prefetched, p.tensors[lt.tensor].kind.name] for lt in sim.lifetimes],
            "allocated": dict(plan.allocated)}


# --------------------------------------------------------------------------- headline cases

def _budget(check: Check, share: float | None, of: str = "eager") -> int | None:
    if share is None:
        return None
    if of == "eager":
        ref = check.eager
    else:
        rows = (check.result["sections"].get("headline") or {}).get("cases", [])
        ref = next((r for r in rows if r.get("name") == of and r.get("status") == "ok"), None)
    if ref is None:
        raise RuntimeError(f"{of}'s measured peak is unknown (its case failed or was skipped): no budget to take a "
                           "share of")
    return int(share * ref["measured_peak_bytes"])


def case_eager(check: Check) -> dict:
    """The reference: its peak and gradients (kept on the CPU) and step time; every ratio refers to it."""
    from optsched.measure import measure_training_step

    call = loss_call(check.model)
    m = measure_training_step(call, check.model, (check.ids,))
    check.eager_grads = {k: v.to("cpu") for k, v in m.grads.items()}
    del m
    row = measure_case(check, call)
    check.eager = row
    row["time_vs_eager"], row["peak_vs_eager"] = 1.0, 1.0
    return row


def case_eager_mask(check: Check) -> dict:
    """Eager with the causal mask materialized, as transformers builds it whenever Dynamo traces the model (its
    `is_tracing` check: optsched's capture and torch.compile alike), where plain eager passes `is_causal=True`
    and no mask. The like-for-like reference of the captured and compiled rows: SDPA picks its kernel by whether
    a mask is given."""
    import transformers.masking_utils as mu

    if not hasattr(mu, "_ignore_causal_mask_sdpa"):
        raise RuntimeError("transformers.masking_utils has no _ignore_causal_mask_sdpa: this transformers decides "
                           "the mask elsewhere")
    real = mu._ignore_causal_mask_sdpa
    mu._ignore_causal_mask_sdpa = lambda *a, **k: False
    try:
        return measure_case(check, loss_call(check.model))
    finally:
        mu._ignore_causal_mask_sdpa = real


def case_optsched(share: float | None, offload: bool | None = None, executor: str | None = "eager",
                  profile: bool = False, role: str | None = None, of: str = "eager",
                  roofline: bool = False, trace: bool = False) -> Callable[[Check], dict]:
    """optsched at `share` of the measured peak of case `of` (eager's by default). Executor "eager" (the same
    kernels as eager, so peak and time differ by the plan alone) unless another is asked for; None is optsched's
    default (Inductor on CUDA where Triton imports). `roofline`: op times from the device's profile (its
    roofline) instead of measured on the device (the default)."""
    def run(check: Check) -> dict:
        import optsched
        from optsched.costs.profiles import get_profile

        budget = _budget(check, share, of)
        prof = get_profile(None, check.device).name if roofline else None
        opt = optsched.optimize(check.model, budget, time_limit_s=check.args.time_limit, offload=offload, executor=executor,
                                device_profile=prof)
        row = measure_case(check, loss_call(opt), opt=opt, budget_bytes=budget, profile=profile)
        row.update(share_of_eager=share if of == "eager" else None, share_of=of, offload=offload,
                   executor_asked=executor, role=role)
        if trace and check.cuda:  # where a measured peak above the prediction comes from
            try:
                dump = check.out.parent / f"{check.out.stem}_alloc_{int(100 * share) if share else 'none'}.json"
                row["peak_trace"] = trace_step(train_step(loss_call(opt), check.model, check.ids), check.device,
                                               dump=dump, plan=opt.plan)
            except Exception as e:  # noqa: BLE001 - a diagnostic: its failure keeps the case's figures
                row["peak_trace"] = {"error": error_record(e, limit=4)}
        return row

    return run


def case_checkpointing(check: Check) -> dict:
    """transformers' own: every decoder layer recomputed in the backward (non-reentrant checkpoint).
    transformers 5.x names it activation_checkpointing_enable (gradient_checkpointing_enable before)."""
    model, kw = check.model, {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        disable, api = model.activation_checkpointing_disable, "activation_checkpointing_enable"
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        disable, api = model.gradient_checkpointing_disable, "gradient_checkpointing_enable"
    try:
        return {**measure_case(check, loss_call(model)), "api": api}
    finally:
        disable()


def case_mincut(knob: float, backend: str) -> Callable[[Check], dict]:
    """torch.compile with torch._functorch.config.activation_memory_budget = knob (its min-cut partitioner),
    compiled and measured inside the setting. Backend aot_eager_decomp_partition runs the partitioned graphs
    with eager kernels (like optsched's eager executor: the plans differ, not the kernels); inductor fuses."""
    def run(check: Check) -> dict:
        import torch

        torch._dynamo.reset()
        try:
            with torch._functorch.config.patch(activation_memory_budget=knob):
                compiled = torch.compile(check.model, backend=backend, dynamic=False)
                row = measure_case(check, loss_call(compiled))
        finally:
            torch._dynamo.reset()
        row.update(activation_memory_budget=knob, backend=backend)
        return row

    return run


def headline_cases(check: Check) -> tuple[list[Case], list[Case]]:
    """The headline's cases in two parts: the side-by-side comparison (eager, full checkpointing, torch.compile's
    budget knob with eager kernels, optsched with eager kernels at eager's shares and at checkpointing's peak),
    run first; the fused ones (optsched's Inductor executor, torch.compile with Inductor: the longest compiles),
    run after the does_not_fit section and the GPU tests, in what time is left."""
    tl = check.args.time_limit
    plan_s = 2 * tl + 30  # a plan, possibly redone once the first backward showed the outputs' use, + capture and steps
    smoke, low = check.args.cpu_smoke, check.args.low_share
    no_inductor = ("--cpu-smoke: Inductor compiles C++ for every fusion group on the CPU (minutes)" if smoke
                   else check.inductor_broken and f"the preflight found Inductor broken: {check.inductor_broken}")
    mb = check.args.mincut_backend
    first = [
        Case("eager", "eager", case_eager, 15),
        Case("eager, mask as traced", "eager", case_eager_mask, 15),
        Case("full checkpointing", "checkpointing", case_checkpointing, 15),
        *[Case(f"torch.compile amb={k:g}", "mincut", case_mincut(k, mb), 75 if mb == "inductor" else 25)
          for k in MINCUT_KNOBS],
        Case("optsched none", "optsched", case_optsched(None), plan_s),
        Case("optsched 60%", "optsched", case_optsched(0.6, trace=True, profile=True, role="offload_60"), plan_s + 5),
        Case(f"optsched {low:.0%} offload", "optsched", case_optsched(low, True, profile=True, role="offload"), plan_s + 5),
        Case(f"optsched {low:.0%} recompute-only", "optsched", case_optsched(low, False, profile=True, role="recompute_only"),
             plan_s + 5),
        Case("optsched 60% recompute-only", "optsched", case_optsched(0.6, False, profile=True, role="recompute_only_60"),
             plan_s + 5),
        Case("optsched at checkpointing's peak", "optsched", case_optsched(1.0, of="full checkpointing",
                                                                           role="at_checkpointing"), plan_s),
        Case("optsched 60% roofline", "optsched", case_optsched(0.6, roofline=True, role="roofline"), plan_s),
    ]
    ib = check.args.inductor_budget
    later = [Case(f"optsched {ib:.0%} inductor", "optsched", case_optsched(ib, executor="inductor"), plan_s + 60,
                  skip_reason=no_inductor or None)]
    if mb != "inductor":
        later.append(Case("torch.compile inductor amb=0.5", "mincut", case_mincut(0.5, "inductor"), 75,
                          skip_reason=no_inductor or None))
    if check.args.cases:
        wanted = {c.strip() for c in check.args.cases.split(",")}
        keep = lambda cs: [c for c in cs if c.name in wanted or c.kind in wanted or c.name == "eager"]  # noqa: E731
        first, later = keep(first), keep(later)
    return first, later


def _headline(check: Check, cases: list[Case]) -> dict:
    sec = check.result["sections"].get("headline")
    if not sec or "cases" not in sec:  # the placeholder ("not run yet")
        sec = check.result["sections"]["headline"] = {"status": "ok", "cases": []}
    rows = sec["cases"]
    if check.model is None:
        setup_model(check)
    for case in cases:
        run_case(check, case, rows)
    sec["counts"] = {s: sum(r.get("status") == s for r in rows) for s in ("ok", "error", "skipped")}
    return sec


def section_headline_first(check: Check) -> dict:
    if not (check.cuda or check.args.cpu_smoke):
        return skipped(NO_CUDA + "; --cpu-smoke runs it on a tiny Llama on the CPU")
    return _headline(check, headline_cases(check)[0])


def section_headline_later(check: Check) -> dict:
    sec = check.result["sections"].get("headline", {})
    if sec.get("status") == "skipped" or check.model is None:
        return sec or skipped("the headline did not run")
    return _headline(check, headline_cases(check)[1])


def choose_batch(check: Check, model) -> tuple[int, dict]:
    """--batch, or on CUDA the batch whose eager peak is about --eager-share of the device (at most --max-batch):
    eager's peak measured at batch 1 and 2, taken as linear in the batch."""
    import torch
    from optsched.measure import measure_training_step

    cfg, a = check.cfg, check.args
    if cfg.batch is not None:
        return cfg.batch, {"chosen": "given"}
    peaks = {}
    train_step(loss_call(model), model, make_ids(cfg, 1, check.device))()  # cuBLAS and friends set up outside the probe
    model.zero_grad(set_to_none=True)
    for b in (1, 2):
        ids = make_ids(cfg, b, check.device)
        peaks[b] = measure_training_step(loss_call(model), model, (ids,)).peak_bytes
        del ids
    per = max(peaks[2] - peaks[1], 1)
    fixed = peaks[1] - per
    total = torch.cuda.get_device_properties(check.device).total_memory
    batch = int(max(1, min(a.max_batch, (a.eager_share * total - fixed) // per)))
    return batch, {"chosen": "auto", "eager_peak_batch1_bytes": peaks[1], "eager_peak_batch2_bytes": peaks[2],
                   "per_sample_bytes": per, "target_bytes": int(a.eager_share * total), "max_batch": a.max_batch,
                   "predicted_eager_peak_bytes": fixed + batch * per}


def setup_model(check: Check) -> None:
    model = build_model(check.cfg, check.device)
    batch, how = choose_batch(check, model) if check.cuda else (check.cfg.batch or 2, {"chosen": "given"})
    check.cfg = dataclasses.replace(check.cfg, batch=batch)
    check.model, check.ids = model, make_ids(check.cfg, batch, check.device)
    check.result["config"]["model"] = {**dataclasses.asdict(check.cfg), "describe": check.cfg.describe(),
                                       "params": sum(p.numel() for p in model.parameters()), "batch_choice": how}
    print(f"model: {check.cfg.describe()}, {check.result['config']['model']['params'] / 1e6:.1f}M parameters", flush=True)
    check.save()


# --------------------------------------------------------------------------- the other sections

def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Test files that mark something `pytest.mark.gpu` (only they are collected: the others' imports may need
    dev extras this machine lacks)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped / tests from a JUnit XML report."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"tests": n["tests"], "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
            "failed": n["failures"], "errors": n["errors"], "skipped": n["skipped"], "failed_names": failed[:20]}


def section_preflight(check: Check) -> dict:
    """Seconds that find what would waste the expensive part: a CUDA matmul, OR-tools solving a one-variable
    model, a C compiler and Python.h (Triton builds its launcher with them at run time), and Inductor compiling one
    Triton kernel (its failure skips the Inductor rows with the reason, instead of failing each after its cost)."""
    import shutil
    import sysconfig

    import torch

    if not check.cuda:
        return skipped(NO_CUDA)
    dev, sec = check.device, {}
    t0 = time.perf_counter()
    x = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    sec["matmul_ok"] = bool(torch.isfinite((x @ x).float().sum()).item())
    sec["matmul_s"] = time.perf_counter() - t0
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    v = m.new_int_var(0, 3, "v")
    m.maximize(v)
    solver = cp_model.CpSolver()
    sec["ortools_ok"] = solver.solve(m) == cp_model.OPTIMAL and solver.value(v) == 3
    sec["cc"] = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    sec["python_h"] = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    t0 = time.perf_counter()
    try:
        torch._dynamo.reset()
        f = torch.compile(lambda t: torch.sin(t) * 2 + 1, backend="inductor", dynamic=False)
        ok = torch.allclose(f(x.float()), torch.sin(x.float()) * 2 + 1)
        _sync(dev)
        sec["inductor"] = "ok" if ok else "wrong result"
        if not ok:
            check.inductor_broken = "one compiled pointwise kernel gave a wrong result"
    except Exception as e:  # noqa: BLE001 - recorded; the Inductor rows are skipped with it
        sec["inductor"] = error_record(e, limit=6)
        check.inductor_broken = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        torch._dynamo.reset()
    sec["inductor_s"] = time.perf_counter() - t0
    print(f"  preflight: matmul {sec['matmul_ok']}, ortools {sec['ortools_ok']}, cc {sec['cc']}, Python.h "
          f"{sec['python_h']}, inductor {sec['inductor'] if isinstance(sec['inductor'], str) else 'FAILED'} "
          f"({sec['inductor_s']:.1f} s)", flush=True)
    return sec


def section_gpu_tests(check: Check) -> dict:
    if not check.cuda:
        return skipped(NO_CUDA)
    if check.args.no_tests:
        return skipped("--no-tests")
    if check.poisoned:
        return skipped(f"an earlier CUDA error left this process unusable: {check.poisoned}")
    limit = min(check.args.pytest_timeout, check.time_left() - 10)
    if limit < 30:
        return skipped(f"--max-seconds {check.args.max_seconds:.0f}: {check.elapsed():.0f} s spent")
    if importlib.util.find_spec("pytest") is None:
        return skipped("pytest is not installed for this python")
    files = gpu_test_files()
    if not files:
        return skipped("no test file marks a test pytest.mark.gpu")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        # a file whose imports fail here (a dev extra missing) is counted as an error; the others still run
        cmd = [sys.executable, "-c", _PYTEST_BOOTSTRAP, "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={report}", *files]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"")[-3000:]
            return {"status": "error", "files": files, "error": {"type": "TimeoutExpired",
                    "message": f"pytest -m gpu ran past its limit, {limit:.0f} s",
                    "traceback": out.decode(errors="replace") if isinstance(out, bytes) else out}}
        sec = {"files": files, "command": "pytest " + " ".join(cmd[3:]), "returncode": p.returncode,
               "output_tail": (p.stdout + p.stderr)[-3000:]}
        if report.exists():
            sec.update(junit_counts(report))
        if p.returncode not in (0, 5):  # 5: nothing collected (every test deselected)
            sec["status"] = "failed"
    return sec


def section_does_not_fit(check: Check) -> dict:
    """The allocator capped at --not-fit-share of eager's peak (plus whatever else this process holds): eager's
    step, expected to run out of memory, then optsched with mem_budget="auto" and with bytes, each planned and run
    from a fresh optimize(): the first call's peak (max_memory_allocated, planning included) against the cap and
    the budget, then the steady step."""
    import torch
    import optsched
    from optsched.measure import live_bytes

    if not check.cuda:
        return skipped(NO_CUDA + ": the cap is torch.cuda.set_per_process_memory_fraction")
    if check.poisoned:
        return skipped(f"an earlier CUDA error left this process unusable: {check.poisoned}")
    if check.eager is None:
        raise RuntimeError("eager's measured peak is unknown (the eager case failed or was skipped)")
    dev, model, ids = check.device, check.model, check.ids
    _clean(check)
    total = torch.cuda.get_device_properties(dev).total_memory
    resident = live_bytes(model, ids)
    other = torch.cuda.memory_allocated(dev) - resident  # held by this process beside the step's inputs
    limit = int(check.args.not_fit_share * check.eager["measured_peak_bytes"]) + max(other, 0)
    sec: dict = {"eager_peak_bytes": check.eager["measured_peak_bytes"], "limit_bytes": limit, "fraction": limit / total,
                 "resident_bytes": resident, "other_allocated_bytes": other, "cases": []}
    torch.cuda.set_per_process_memory_fraction(limit / total, dev)
    try:
        sec["eager"] = _eager_under_cap(check)
        _clean(check)
        for spec in ("auto", "bytes"):
            if check.time_left() < 2 * check.args.time_limit + 30:
                sec["cases"].append({"budget": spec, **skipped(f"--max-seconds {check.args.max_seconds:.0f}")})
                continue
            budget = "auto" if spec == "auto" else int(0.9 * (limit - max(other, 0)))
            row: dict = {"budget": spec}
            try:
                opt = optsched.optimize(model, budget, time_limit_s=check.args.time_limit)
                row.update(_first_call_within(check, opt, limit, other))
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001
                row.update(status="error", error=error_record(e))
            finally:
                opt = None
                _clean(check)
            sec["cases"].append(row)
            check.save()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        _clean(check)
    sec["ok"] = bool(sec["cases"]) and all(r.get("status") == "ok" and r.get("first_call_within_limit") for r in sec["cases"])
    return sec


def _eager_under_cap(check: Check) -> dict:
    import torch

    torch.cuda.reset_peak_memory_stats(check.device)
    try:
        train_step(loss_call(check.model), check.model, check.ids)()
        _sync(check.device)
    except torch.cuda.OutOfMemoryError as e:
        return {"out_of_memory": True, "message": str(e).splitlines()[0][:300] if str(e) else ""}
    return {"out_of_memory": False, "peak_bytes": torch.cuda.max_memory_allocated(check.device),
            "note": "eager's step fit under the cap: the cap did not bind"}


def _first_call_within(check: Check, opt, limit: int, other: int) -> dict:
    import torch

    dev = check.device
    run = train_step(loss_call(opt), check.model, check.ids)
    _sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    run()
    _sync(dev)
    row = {"first_call_s": time.perf_counter() - t0, "first_call_peak_bytes": torch.cuda.max_memory_allocated(dev)}
    plan = opt.plan
    s = plan.summary()
    row.update({k: s[k] for k in ("budget_bytes", "predicted_peak_bytes", "unplanned_peak_bytes", "solver_status", "gap",
                                  "solve_time_s", "n_recomputed", "n_offloaded", "estimated_time_s")})
    if plan.budget_from and plan.budget_from.get("auto"):
        row["auto"] = plan.budget_from["auto"]
    # the plan's budget counts the step (the model, the batch, what it allocates), not what else this process holds
    row["first_call_within_budget"] = row["first_call_peak_bytes"] - max(other, 0) <= s["budget_bytes"]
    row["first_call_within_limit"] = row["first_call_peak_bytes"] <= limit
    torch.cuda.reset_peak_memory_stats(dev)
    t = step_time(run, dev, warmup=1, repeat=max(2, check.args.repeat // 2))
    row.update(steady_peak_bytes=torch.cuda.max_memory_allocated(dev), step_s=t["median_s"], replanned=opt.plan is not plan)
    if check.eager and check.eager.get("step_s"):
        row["time_vs_eager"] = row["step_s"] / check.eager["step_s"]
    return row


def section_offload(check: Check) -> dict:
    """Offload plan against recompute-only plan at the same budget, from the headline's pairs of rows (their
    profiled steps too): at --low-share (40%) and at 60%. The section's figures are the first pair whose offload
    plan offloads something (a pair that copies nothing says nothing about copies); the other pairs beside."""
    if not check.cuda:
        return skipped(NO_CUDA + ": offloading copies to pinned host memory on CUDA streams")
    rows = {r.get("role"): r for r in check.result["sections"].get("headline", {}).get("cases", []) if r.get("role")}
    pairs = []
    for off_role, rec_role in (("offload", "recompute_only"), ("offload_60", "recompute_only_60")):
        off, rec = rows.get(off_role), rows.get(rec_role)
        if off is None and rec is None:
            continue
        for name, r in ((off_role, off), (rec_role, rec)):
            if r is None or r.get("status") != "ok":
                raise RuntimeError(f"the headline's {name} case did not run to completion: "
                                   + (r.get("reason") or r.get("error", {}).get("message", "") if r else "absent"))
        pairs.append(_offload_pair(off, rec))
    if not pairs:
        raise RuntimeError("no headline pair of offload and recompute-only rows ran")
    chosen = next((p for p in pairs if p["n_offloaded"]), pairs[0])
    return {**chosen, "other_pairs": [p for p in pairs if p is not chosen]}


def _offload_pair(off: dict, rec: dict) -> dict:
    sec = {
        "share_of_eager": off["share_of_eager"], "budget_bytes": off["budget_bytes"],
        "measured_step_s": {"offload": off["step_s"], "recompute_only": rec["step_s"]},
        "measured_speedup": rec["step_s"] / off["step_s"],
        "predicted_step_s": {"offload": off["estimated_time_s"], "recompute_only": rec["estimated_time_s"]},
        "predicted_speedup": rec["estimated_time_s"] / off["estimated_time_s"],
        "measured_peak_bytes": {"offload": off["measured_peak_bytes"], "recompute_only": rec["measured_peak_bytes"]},
        "n_offloaded": off["n_offloaded"], "offloaded_bytes": off["offloaded_bytes"],
        "n_recomputed": {"offload": off["n_recomputed"], "recompute_only": rec["n_recomputed"]},
        "predicted_transfer_s": off["transfer_s"], "predicted_exposed_transfer_s": off["exposed_transfer_s"],
    }
    po, pr = off.get("profile") or {}, rec.get("profile") or {}
    if "idle_s" in po and "idle_s" in pr:
        # the GPU idle in a step (no kernel running) beyond the recompute-only plan's: what waiting for copies added
        sec.update(measured_copy_busy_s=po["copy_busy_s"], measured_exposed_transfer_estimate_s=po["idle_s"] - pr["idle_s"],
                   idle_s={"offload": po["idle_s"], "recompute_only": pr["idle_s"]})
    else:
        sec["profile_note"] = f"no profiled step: {po.get('error') or pr.get('error') or 'absent'}"
    if not off["n_offloaded"]:
        sec["note"] = "the offload plan offloads nothing here: the comparison says nothing about copies"
    return sec


# --------------------------------------------------------------------------- schema and table

REQUIRED_TOP = {"schema": str, "schema_version": int, "cuda": bool, "started": str, "environment": dict, "config": dict,
                "sections": dict}
CASE_FIGURES = ("measured_peak_bytes", "step_s")


def check_schema(result: dict) -> list[str]:
    """What is wrong with a gpu_check JSON (empty: nothing): top-level keys and types, every section present with a
    status (skipped ones with a reason, errors with their record), every headline case with figures or a reason."""
    problems = [f"{k}: missing or not {t.__name__}" for k, t in REQUIRED_TOP.items() if not isinstance(result.get(k), t)]
    sections = result.get("sections") or {}
    for name in SECTIONS:
        sec = sections.get(name)
        if not isinstance(sec, dict) or sec.get("status") not in ("ok", "skipped", "error", "failed"):
            problems.append(f"sections.{name}: missing or without a status")
            continue
        if sec["status"] == "skipped" and not sec.get("reason"):
            problems.append(f"sections.{name}: skipped without a reason")
        if sec["status"] == "error" and not (sec.get("error") or {}).get("type"):
            problems.append(f"sections.{name}: error without its record")
    for i, row in enumerate((sections.get("headline") or {}).get("cases", [])):
        where = f"sections.headline.cases[{i}] ({row.get('name')})"
        st = row.get("status")
        if st == "ok" and not all(isinstance(row.get(k), (int, float)) for k in CASE_FIGURES):
            problems.append(f"{where}: ok without {', '.join(CASE_FIGURES)}")
        elif st == "error" and not {"type", "message", "traceback"} <= set(row.get("error") or {}):
            problems.append(f"{where}: error without type, message and traceback")
        elif st == "skipped" and not row.get("reason"):
            problems.append(f"{where}: skipped without a reason")
        elif st not in ("ok", "error", "skipped"):
            problems.append(f"{where}: status {st!r}")
    return problems


def _mib(b) -> str:
    return "-" if b is None else f"{b / MIB:,.0f}" if abs(b) >= 100 * MIB else f"{b / MIB:.2f}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _not_run(label: str, section: dict) -> str:
    """The table line of a section that was skipped or failed: its status and why."""
    why = section.get("reason") or (section.get("error") or {}).get("message")
    return f"{label}: {section.get('status')} ({why})"


def _row_line(r: dict) -> str:
    if r.get("status") == "skipped":
        return f"skipped: {r.get('reason')}"
    if r.get("status") == "error":
        e = r.get("error") or {}
        return f"ERROR {e.get('type')}: {(e.get('message') or '').splitlines()[0][:160] if e.get('message') else ''}"
    return (f"peak {_mib(r.get('measured_peak_bytes'))} MiB (predicted {_mib(r.get('predicted_peak_bytes'))}), "
            f"step {_num(r.get('step_s') and r['step_s'] * 1e3, '.1f')} ms")


def render_table(result: dict) -> str:
    """The check as plain text: environment, then per section its figures or why it did not run."""
    env, secs = result.get("environment", {}), result.get("sections", {})
    git = env.get("git") or {}
    lines = [
        f"gpu_check on {env.get('device')}: torch {env.get('torch')}, CUDA {env.get('cuda_runtime')}, triton "
        f"{env.get('triton')}, transformers {env.get('transformers')}; commit {str(git.get('commit'))[:12]}"
        f"{'' if git.get('clean') else ' (tree not clean)' if git.get('clean') is False else ''}",
    ]
    model = (result.get("config") or {}).get("model")
    if model and model.get("describe"):
        lines.append(f"model: {model.get('describe')}, {model.get('params', 0) / 1e6:.1f}M parameters")
    pf = secs.get("preflight", {})
    if pf.get("status") == "ok":
        ind = pf.get("inductor")
        lines.append(f"preflight: matmul {'ok' if pf.get('matmul_ok') else 'WRONG'}, OR-tools "
                     f"{'ok' if pf.get('ortools_ok') else 'WRONG'}, C compiler {pf.get('cc') or 'none'}, Python.h "
                     f"{'yes' if pf.get('python_h') else 'no'}, Inductor "
                     f"{ind if isinstance(ind, str) else 'FAILED: ' + str((ind or {}).get('message', ''))[:160]}")
    elif pf:
        lines.append(_not_run("preflight", pf))
    if result.get("poisoned"):
        lines.append(f"a CUDA error left the process unusable; what followed was skipped: {result['poisoned']}")
    t = secs.get("gpu_tests", {})
    if t.get("status") == "skipped":
        lines.append(f"\npytest -m gpu: skipped ({t.get('reason')})")
    elif "tests" in t:
        lines.append(f"\npytest -m gpu: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                     f"{t['skipped']} skipped ({t.get('status')})")
    else:
        lines.append(f"\npytest -m gpu: {t.get('status')} {(t.get('error') or {}).get('message', '')}")

    h = secs.get("headline", {})
    lines.append("")
    if h.get("status") == "skipped":
        lines.append(f"headline: skipped ({h.get('reason')})")
    elif h.get("status") == "error":
        lines.append(f"headline: ERROR {(h.get('error') or {}).get('type')}: {(h.get('error') or {}).get('message')}")
    if h.get("cases"):
        head = (f"{'case':<30} {'budget':>8} {'predicted':>9} {'measured':>9} {'fits':>4} {'step ms':>8} {'x eager':>7} "
                f"{'grad rel':>8} {'plan s':>6} {'status':>9} {'gap':>6}")
        lines += [head + "   (MiB)", "-" * len(head)]
        for r in h["cases"]:
            if r.get("status") != "ok":
                lines.append(f"{r.get('name', '?'):<30} {_row_line(r)}")
                continue
            fits = "-" if r.get("within_budget") is None else ("yes" if r["within_budget"] else "NO")
            lines.append(
                f"{r['name']:<30} {_mib(r.get('budget_bytes')):>8} {_mib(r.get('predicted_peak_bytes')):>9} "
                f"{_mib(r.get('measured_peak_bytes')):>9} {fits:>4} {_num(r.get('step_s') and r['step_s'] * 1e3, '8.1f'):>8} "
                f"{_num(r.get('time_vs_eager'), '7.2f'):>7} {_num(r.get('grad_max_rel_err'), '8.1e'):>8} "
                f"{_num(r.get('plan_s'), '6.1f'):>6} {str(r.get('solver_status') or '-'):>9} {_num(r.get('gap'), '6.1%'):>6}")

    n = secs.get("does_not_fit", {})
    lines.append("")
    if n.get("status") != "ok":
        lines.append(_not_run("does not fit", n))
    else:
        e = n.get("eager") or {}
        lines.append(f"does not fit: cap {_mib(n.get('limit_bytes'))} MiB = {n.get('fraction', 0):.1%} of the device, eager "
                     + ("ran out of memory" if e.get("out_of_memory") else f"fit ({_mib(e.get('peak_bytes'))} MiB)"))
        for r in n.get("cases", []):
            if r.get("status") != "ok":
                lines.append(f"  {r.get('budget')}: {_row_line(r)}")
                continue
            lines.append(f"  {r['budget']}: budget {_mib(r.get('budget_bytes'))} MiB, first call peak "
                         f"{_mib(r.get('first_call_peak_bytes'))} MiB (planning included; within cap: "
                         f"{'yes' if r.get('first_call_within_limit') else 'NO'}, within budget: "
                         f"{'yes' if r.get('first_call_within_budget') else 'NO'}), "
                         f"step {_num(r.get('step_s') and r['step_s'] * 1e3, '.1f')} ms")

    o = secs.get("offload", {})
    lines.append("")
    if o.get("status") != "ok":
        lines.append(_not_run("offload", o))
    else:
        ms, ps = o["measured_step_s"], o["predicted_step_s"]
        lines.append(f"offload at {o.get('share_of_eager', 0):.0%}: offload {ms['offload'] * 1e3:.1f} ms vs recompute-only "
                     f"{ms['recompute_only'] * 1e3:.1f} ms "
                     f"measured ({o['measured_speedup']:.2f}x), predicted {ps['offload'] * 1e3:.1f} vs "
                     f"{ps['recompute_only'] * 1e3:.1f} ms ({o['predicted_speedup']:.2f}x); {o['n_offloaded']} tensors "
                     f"{_mib(o['offloaded_bytes'])} MiB offloaded; exposed copies predicted "
                     f"{o['predicted_exposed_transfer_s'] * 1e3:.2f} ms, measured estimate "
                     f"{_num(o.get('measured_exposed_transfer_estimate_s') and o['measured_exposed_transfer_estimate_s'] * 1e3, '.2f')} ms")
    lines.append(f"\n{result.get('elapsed_s', 0):.0f} s in all")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON (default: benchmarks/results/gpu_check.json)")
    ap.add_argument("--small", action="store_true", help=f"a smaller Llama: {SMALL.describe()}")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help=f"without CUDA, run the headline's CPU-runnable cases on a tiny Llama ({TINY.describe()})")
    ap.add_argument("--batch", type=int, default=None,
                    help="default: on CUDA, the batch whose eager peak is --eager-share of the device (--small: 8)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --small 4)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; --small 1024)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8000: see ModelConfig; Llama's is 32000)")
    ap.add_argument("--eager-share", type=float, default=0.25, help="the automatic batch: eager's peak / device memory "
                    "(a quarter: steps, op timing and offload's pinned copies stay quick; every budget is a share)")
    ap.add_argument("--max-batch", type=int, default=64, help="the automatic batch's ceiling")
    ap.add_argument("--time-limit", type=float, default=None, help="optsched's planning limit per plan, s (default 8; "
                    "--cpu-smoke 2.5: planning counts work, about wall seconds of a 2-core machine)")
    ap.add_argument("--warmup", type=int, default=None, help="steps after the first call before measuring (default 2)")
    ap.add_argument("--repeat", type=int, default=None, help="timed steps per case, median (default 5; --cpu-smoke 2)")
    ap.add_argument("--low-share", type=float, default=None,
                    help="the low budget (offload on and off), share of eager's peak (default 0.4; --cpu-smoke 0.5: the "
                    "tiny model's plans at 40%% take longer to find than the smoke has)")
    ap.add_argument("--inductor-budget", type=float, default=0.6, help="the Inductor executor's budget, share of eager's peak")
    ap.add_argument("--mincut-backend", default="aot_eager_decomp_partition",
                    choices=["inductor", "aot_eager_decomp_partition"],
                    help="torch.compile backend of the three activation_memory_budget cases (default "
                    "aot_eager_decomp_partition: eager kernels, as optsched's rows; one inductor case at 0.5 runs later)")
    ap.add_argument("--not-fit-share", type=float, default=0.7, help="does_not_fit: the cap, as a share of eager's peak")
    ap.add_argument("--max-seconds", type=float, default=460.0,
                    help="a case that may not finish within this many seconds of the start (imports counted) is "
                    "skipped (default 460: the whole check within 8 minutes, and a case that outruns its estimate "
                    "within the device call's 540 s)")
    ap.add_argument("--pytest-timeout", type=float, default=120.0, help="pytest -m gpu's limit, s")
    ap.add_argument("--no-tests", action="store_true", help="skip pytest -m gpu")
    ap.add_argument("--alloc-conf", default="expandable_segments:True",
                    help="the caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF) unless the environment sets them; "
                         "'' for its default mode")
    ap.add_argument("--sections", default=None,
                    help="only these sections (comma-separated: preflight, headline, offload, does_not_fit, gpu_tests)")
    ap.add_argument("--cases", default=None, help="only these headline cases (names or kinds, comma-separated); eager always")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a section or case failed (default: 0 once the JSON is written)")
    a = ap.parse_args(argv)
    smoke = a.cpu_smoke
    a.time_limit = a.time_limit if a.time_limit is not None else (2.5 if smoke else 8.0)
    a.warmup = a.warmup if a.warmup is not None else (1 if smoke else 2)
    a.repeat = a.repeat if a.repeat is not None else (2 if smoke else 5)
    a.low_share = a.low_share if a.low_share is not None else (0.5 if smoke else 0.4)
    return a


def model_config(a: argparse.Namespace, cuda: bool) -> ModelConfig:
    cfg = SMALL if a.small else FULL
    if not cuda:
        cfg = TINY
    over = {k: v for k, v in (("batch", a.batch), ("layers", a.layers), ("seq", a.seq), ("vocab", a.vocab)) if v is not None}
    return dataclasses.replace(cfg, **over)


def new_result(a: argparse.Namespace, cuda: bool, cfg: ModelConfig) -> dict:
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "cuda": cuda,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu_check", *sys.argv[1:]]),
        "environment": {}, "config": {"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                                      "model": dataclasses.asdict(cfg)},
        "sections": {name: skipped("not run yet") for name in SECTIONS},
    }


def apply_alloc_conf(conf: str, environ: dict | None = None) -> str | None:
    """The caching allocator's settings for this process: `conf` unless the environment sets its own (read when
    CUDA first allocates, so before any CUDA call). Returns the settings in force ('' for the default mode)."""
    environ = os.environ if environ is None else environ
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if name in environ:
            return environ[name]
    if conf:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return conf


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    # before any CUDA allocation (is_available does not allocate); not on a CPU, where it means nothing and would
    # stay in the environment of a caller that runs this in-process (the tests)
    alloc_conf = apply_alloc_conf(a.alloc_conf) if cuda else None
    found = ensure_optsched_importable()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = model_config(a, cuda)
    # run as the script, its seconds count from before its imports; called in a process that imported it long before
    # (a test worker: 413 s before one test's call), from the call
    started = STARTED if __name__ == "__main__" else time.perf_counter()
    check = Check(a, device, cfg, a.out, new_result(a, cuda, cfg), started=started)
    threads = torch.get_num_threads()
    if not cuda:
        print(f"{NO_CUDA}: the CUDA sections are skipped" + ("; --cpu-smoke: the headline on a tiny Llama on the CPU"
                                                               if a.cpu_smoke else " (--cpu-smoke runs the headline on the CPU)"))
        # one intra-op thread: on a small shared machine two can be tens of times slower (optsched/costs/measure.py)
        torch.set_num_threads(1)
    try:
        check.result["environment"] = {**environment(device), "optsched_from": found, "alloc_conf": alloc_conf}
        check.result["meta"] = result_meta(check.result["environment"])
        check.save()
        steps = [("preflight", section_preflight), ("headline", section_headline_first), ("offload", section_offload),
                 ("does_not_fit", section_does_not_fit), ("gpu_tests", section_gpu_tests),
                 ("headline", section_headline_later)]
        wanted = None if a.sections is None else {x.strip() for x in a.sections.split(",")}
        for name, fn in steps:
            if wanted is not None and name not in wanted:
                check.result["sections"][name] = skipped("--sections")
                continue
            print(f"[{check.elapsed():5.0f} s] {name}", flush=True)
            run_section(check, name, fn)
    finally:
        torch.set_num_threads(threads)
    check.result["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    check.result["schema_problems"] = check_schema(check.result)
    check.save()
    print()
    print(render_table(check.result))
    print(f"wrote {a.out}")
    failed = [n for n, s in check.result["sections"].items() if s.get("status") in ("error", "failed")]
    failed += [r["name"] for r in check.result["sections"]["headline"].get("cases", []) if r.get("status") == "error"]
    if failed:
        print(f"failures: {', '.join(failed)}")
    return 1 if a.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
