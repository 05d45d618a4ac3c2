"""benchmarks/gpu_check.py (`make gpu-check`): what runs without a GPU. The no-CUDA path (every CUDA section
skipped with its reason), the --cpu-smoke headline end to end on a tiny Llama with a case and a section made to
fail, the JSON schema, the table (CUDA sections included, from a made-up result) and the recording helpers.
The tests marked `gpu` run the CUDA helpers on a real device (`pytest -m gpu`, which the check itself runs)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import gpu_check as gc

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MIB = 2**20


@pytest.fixture
def no_cuda(monkeypatch):
    """The check as on a machine without CUDA, wherever the tests run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _load(path) -> dict:
    return json.loads(path.read_text())


def test_without_cuda_every_section_is_skipped_with_a_reason(tmp_path, no_cuda, capsys):
    out = tmp_path / "g.json"
    assert gc.main(["--out", str(out)]) == 0
    r = _load(out)
    assert r["cuda"] is False and r["schema"] == gc.SCHEMA and r["schema_problems"] == []
    assert set(r["sections"]) == set(gc.SECTIONS)
    for name, sec in r["sections"].items():
        assert sec["status"] == "skipped" and "CUDA is unavailable" in sec["reason"], name
    env = r["environment"]
    assert {"torch", "transformers", "triton", "python", "git", "device"} <= set(env)
    assert "commit" in env["git"] and "clean" in env["git"]
    text = capsys.readouterr().out
    assert "CUDA is unavailable" in text and "skipped" in text and str(out) in text


def test_a_section_that_raises_is_recorded_and_strict_says_so(tmp_path, no_cuda, monkeypatch):
    def boom(check):
        raise RuntimeError("the GPU caught fire")

    monkeypatch.setattr(gc, "section_gpu_tests", boom)
    out = tmp_path / "g.json"
    assert gc.main(["--out", str(out)]) == 0  # the JSON is written: exit 0 ...
    sec = _load(out)["sections"]["gpu_tests"]
    assert sec["status"] == "error" and sec["error"]["type"] == "RuntimeError"
    assert "caught fire" in sec["error"]["message"] and "boom" in sec["error"]["traceback"]
    assert _load(out)["sections"]["offload"]["status"] == "skipped"  # ... and the sections after it ran
    assert gc.main(["--out", str(out), "--strict"]) == 1  # ... unless --strict


def test_cpu_smoke_end_to_end(tmp_path, no_cuda, monkeypatch):
    """The headline on a tiny Llama on this CPU, with a failing case among the others and the does_not_fit
    section raising: every case has figures or its error, the JSON is written, nothing is lost."""
    real_cases = gc.headline_cases

    def with_a_failure(check):
        first, later = real_cases(check)
        first.insert(2, gc.Case("boom", "optsched", lambda check: 1 / 0, estimate_s=1))
        return first, later

    def raising(check):
        raise MemoryError("pretend")

    monkeypatch.setattr(gc, "headline_cases", with_a_failure)
    monkeypatch.setattr(gc, "section_does_not_fit", raising)
    out = tmp_path / "smoke.json"
    cases = ["optsched none", "optsched 60%", "optsched 50% offload", "optsched 50% recompute-only", "full checkpointing",
             "torch.compile amb=0.5", "optsched 60% inductor", "boom", "eager, mask as traced",
             "optsched at checkpointing's peak"]
    assert gc.main(["--cpu-smoke", "--out", str(out), "--cases", ",".join(cases)]) == 0
    r = _load(out)
    assert r["cuda"] is False and r["schema_problems"] == [] and gc.check_schema(r) == []
    secs = r["sections"]
    assert secs["does_not_fit"]["status"] == "error" and secs["does_not_fit"]["error"]["type"] == "MemoryError"
    assert secs["gpu_tests"]["status"] == "skipped" and secs["offload"]["status"] == "skipped"
    assert secs["headline"]["status"] == "ok"
    rows = {c["name"]: c for c in secs["headline"]["cases"]}
    assert list(rows) == ["eager", "eager, mask as traced", "boom", "full checkpointing", "torch.compile amb=0.5",
                          "optsched none", "optsched 60%", "optsched 50% offload", "optsched 50% recompute-only",
                          "optsched at checkpointing's peak", "optsched 60% inductor"]
    assert rows["boom"]["status"] == "error" and rows["boom"]["error"]["type"] == "ZeroDivisionError"
    assert rows["optsched 60% inductor"]["status"] == "skipped" and "Inductor" in rows["optsched 60% inductor"]["reason"]
    eager = rows["eager"]
    for name, row in rows.items():
        if row["status"] != "ok":
            continue
        assert row["measured_peak_bytes"] > 0 and row["step_s"] > 0 and row["first_call_s"] > 0, name
        assert row["grads_missing"] == [] and row["grad_max_rel_err"] < 1e-4, name  # float32: eager's to rounding
    for name in ("optsched none", "optsched 60%", "optsched 50% offload", "optsched 50% recompute-only"):
        row = rows[name]
        assert row["status"] == "ok", (name, row.get("error"))
        assert row["predicted_peak_bytes"] > 0 and row["solver_status"] in ("OPTIMAL", "FEASIBLE", "HEURISTIC")
        assert row["plan_s"] > 0 and row["gap"] is not None
        assert abs(row["predicted_vs_measured"]) < 0.05, name
    assert rows["optsched 60%"]["budget_bytes"] == int(0.6 * eager["measured_peak_bytes"])
    assert rows["optsched 60%"]["within_budget"] and rows["optsched 50% recompute-only"]["within_budget"]
    assert rows["optsched 50% offload"]["role"] == "offload" and rows["optsched 50% recompute-only"]["n_offloaded"] == 0
    assert rows["torch.compile amb=0.5"]["activation_memory_budget"] == 0.5
    assert rows["torch.compile amb=0.5"]["backend"] == "aot_eager_decomp_partition"
    # like for like: the traced step's attention takes the materialized mask; eager's own takes is_causal
    # (within a few bytes: the captured step can hold a loss scalar eager has freed, issue 33's note)
    assert rows["optsched none"]["measured_peak_bytes"] <= rows["eager, mask as traced"]["measured_peak_bytes"] + 64
    assert rows["eager, mask as traced"]["measured_peak_bytes"] > eager["measured_peak_bytes"]
    at_ckpt = rows["optsched at checkpointing's peak"]
    assert at_ckpt["share_of"] == "full checkpointing" and at_ckpt["within_budget"]
    assert at_ckpt["budget_bytes"] == rows["full checkpointing"]["measured_peak_bytes"]
    assert rows["optsched 60%"]["executor"] == "eager"
    text = gc.render_table(r)
    assert "ZeroDivisionError" in text and "optsched 60%" in text and "does not fit: error" in text


def _cuda_result() -> dict:
    """A made-up result as a CUDA run writes it, for the table's CUDA parts."""
    ok = dict(status="ok", measured_peak_bytes=40 * 2**30, step_s=0.5, first_call_s=30.0)
    return {
        "schema": gc.SCHEMA, "schema_version": gc.SCHEMA_VERSION, "cuda": True, "started": "2025-01-01T00:00:00+00:00",
        "elapsed_s": 401.0,
        "environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda_runtime": "13.0", "triton": "3.5.0",
                        "transformers": "5.0.0", "git": {"commit": "0123456789abcdef", "clean": True}},
        "config": {"model": {"describe": "Llama 8 layers", "params": 168_000_000}},
        "sections": {
            "preflight": {"status": "ok", "matmul_ok": True, "ortools_ok": True, "cc": "/usr/bin/cc", "python_h": True,
                          "inductor": "ok"},
            "gpu_tests": {"status": "failed", "tests": 9, "passed": 7, "failed": 1, "errors": 0, "skipped": 1},
            "headline": {"status": "ok", "cases": [
                dict(ok, name="eager", kind="eager", time_vs_eager=1.0, grad_max_rel_err=0.0),
                dict(ok, name="optsched 40% offload", kind="optsched", budget_bytes=16 * 2**30, predicted_peak_bytes=15 * 2**30,
                     within_budget=True, time_vs_eager=1.12, grad_max_rel_err=2e-3, plan_s=8.1, solver_status="FEASIBLE",
                     gap=0.04),
                {"name": "torch.compile amb=0", "kind": "mincut", "status": "error",
                 "error": {"type": "OutOfMemoryError", "message": "CUDA out of memory", "traceback": "..."}},
                {"name": "optsched 60% inductor", "kind": "optsched", "status": "skipped", "reason": "--max-seconds 450"},
            ]},
            "does_not_fit": {"status": "ok", "limit_bytes": 28 * 2**30, "fraction": 0.35, "eager": {"out_of_memory": True},
                             "cases": [{"budget": "auto", "status": "ok", "budget_bytes": 24 * 2**30,
                                        "first_call_peak_bytes": 23 * 2**30, "first_call_within_limit": True,
                                        "first_call_within_budget": True, "step_s": 0.6},
                                       {"budget": "bytes", "status": "skipped", "reason": "--max-seconds 450"}]},
            "offload": {"status": "ok", "share_of_eager": 0.4, "measured_step_s": {"offload": 0.55, "recompute_only": 0.6},
                        "measured_speedup": 0.6 / 0.55, "predicted_step_s": {"offload": 0.5, "recompute_only": 0.56},
                        "predicted_speedup": 1.12, "n_offloaded": 12, "offloaded_bytes": 3 * 2**30,
                        "predicted_exposed_transfer_s": 0.004, "measured_exposed_transfer_estimate_s": 0.009},
        },
    }


def test_table_renders_every_section():
    r = _cuda_result()
    assert gc.check_schema(r) == []
    text = gc.render_table(r)
    for part in ("NVIDIA H100", "2.11.0+cu130", "0123456789ab", "7 passed, 1 failed", "optsched 40% offload", "16,384",
                 "15,360", "yes", "1.12", "FEASIBLE", "4.0%", "OutOfMemoryError", "--max-seconds 450",
                 "eager ran out of memory", "preflight: matmul ok, OR-tools ok, C compiler /usr/bin/cc, Python.h yes, "
                 "Inductor ok", "auto: budget 24,576 MiB", "within cap: yes", "offload at 40%", "exposed copies "
                 "predicted 4.00 ms, measured estimate 9.00 ms", "401 s in all"):
        assert part in text, part
    assert "tree not clean" not in text
    r["environment"]["git"]["clean"] = False
    assert "tree not clean" in gc.render_table(r)


def test_schema_problems_are_named():
    r = _cuda_result()
    del r["sections"]["offload"]
    r["sections"]["gpu_tests"] = {"status": "skipped"}
    cases = r["sections"]["headline"]["cases"]
    del cases[1]["step_s"]
    cases[2]["error"] = {"type": "X"}
    r["cuda"] = "yes"
    problems = "\n".join(gc.check_schema(r))
    for part in ("cuda: missing or not bool", "sections.offload: missing", "sections.gpu_tests: skipped without a reason",
                 "(optsched 40% offload): ok without", "(torch.compile amb=0): error without"):
        assert part in problems, part


def _stub_check(tmp_path, max_seconds: float = 100.0):
    import argparse

    args = argparse.Namespace(max_seconds=max_seconds)
    return gc.Check(args, torch.device("cpu"), gc.TINY, tmp_path / "c.json", {"sections": {}})


def test_run_case_records_an_error_a_skip_and_figures(tmp_path):
    check = _stub_check(tmp_path)
    rows: list = []

    def fails(check):
        raise ValueError("no\nsecond line")

    gc.run_case(check, gc.Case("fails", "optsched", fails, 1), rows)
    gc.run_case(check, gc.Case("too long", "mincut", lambda c: {"x": 1}, estimate_s=1000), rows)
    gc.run_case(check, gc.Case("told to skip", "mincut", lambda c: {"x": 1}, skip_reason="because"), rows)
    gc.run_case(check, gc.Case("fine", "eager", lambda c: {"measured_peak_bytes": 5, "step_s": 0.1}, 1), rows)
    assert [r["status"] for r in rows] == ["error", "skipped", "skipped", "ok"]
    err = rows[0]["error"]
    assert err["type"] == "ValueError" and err["message"] == "no\nsecond line" and "fails" in err["traceback"]
    assert "--max-seconds 100" in rows[1]["reason"] and rows[2]["reason"] == "because"
    assert rows[3]["measured_peak_bytes"] == 5 and rows[3]["seconds"] >= 0
    assert json.loads((tmp_path / "c.json").read_text())["elapsed_s"] >= 0  # written after every case


def test_a_cuda_error_skips_what_follows_and_out_of_memory_does_not(tmp_path, monkeypatch):
    """After a CUDA error (an illegal access) every later kernel fails too: the cases after it are skipped with
    that reason, instead of each failing after its cost. Running out of memory is recoverable: nothing skipped.
    The synchronize between cases, where an earlier kernel's error surfaces, never loses the rows."""
    check = _stub_check(tmp_path)
    check.__class__ = _FakeCudaCheck
    check.result["sections"]["headline"] = {"cases": []}
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda d=None: None)
    rows: list = []

    def oom(check):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def illegal(check):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    fine = lambda c: {"measured_peak_bytes": 5, "step_s": 0.1}  # noqa: E731
    gc.run_case(check, gc.Case("oom", "optsched", oom, 1), rows)
    gc.run_case(check, gc.Case("after oom", "eager", fine, 1), rows)
    assert [r["status"] for r in rows] == ["error", "ok"] and check.poisoned is None
    gc.run_case(check, gc.Case("illegal", "optsched", illegal, 1), rows)
    gc.run_case(check, gc.Case("after", "eager", fine, 1), rows)
    assert rows[-1]["status"] == "skipped" and "illegal memory access" in rows[-1]["reason"]
    assert "illegal memory access" in json.loads((tmp_path / "c.json").read_text())["poisoned"]

    def sync_fails(d=None):
        raise RuntimeError("CUDA error: device-side assert triggered")

    check.poisoned = None
    monkeypatch.setattr(torch.cuda, "synchronize", sync_fails)
    gc.run_case(check, gc.Case("clean fails", "eager", fine, 1), rows)
    assert rows[-1]["status"] == "ok" and "device-side assert" in rows[-1]["clean_error"]["message"]
    assert check.poisoned and "device-side assert" in check.poisoned
    assert "what followed was skipped" in gc.render_table({**_cuda_result(), "poisoned": check.poisoned})


def test_a_section_that_fails_keeps_the_rows_it_recorded(tmp_path):
    check = _stub_check(tmp_path)
    check.result["sections"]["headline"] = {"status": "ok", "cases": [{"name": "eager", "status": "ok"}]}

    def later(check):
        check.result["sections"]["headline"]["cases"].append({"name": "second", "status": "ok"})
        raise RuntimeError("outside any case")

    sec = gc.run_section(check, "headline", later)
    assert sec["status"] == "error" and [r["name"] for r in sec["cases"]] == ["eager", "second"]
    assert [r["name"] for r in json.loads((tmp_path / "c.json").read_text())["sections"]["headline"]["cases"]] == [
        "eager", "second"]


def test_foreign_blocks_are_what_the_model_and_batch_do_not_hold(monkeypatch):
    """The allocator's blocks beside the model's parameters, gradients and the batch, by size: what a measured
    peak counts that no plan holds (on an H200 every optsched row measured 11.1 MiB above its prediction)."""
    model = torch.nn.Linear(4, 3)
    model.weight.grad = torch.zeros_like(model.weight)
    ids = torch.zeros(2, 5, dtype=torch.long)
    own = [model.weight, model.bias, model.weight.grad, ids]
    blocks = [{"address": t.untyped_storage().data_ptr(), "size": 512, "state": "active_allocated"} for t in own]
    blocks += [{"address": 1, "size": 2**25, "requested_size": 2**25, "state": "active_allocated"},
               {"address": 2, "size": 2**25, "requested_size": 2**25, "state": "active_allocated"},
               {"address": 3, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
               {"address": 4, "size": 2**20, "state": "inactive"}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"blocks": blocks}])
    f = gc.foreign_blocks(model, ids)
    assert f == {"total_bytes": 2 * 2**25 + 1000, "n_blocks": 3, "sizes": [[2**25, 2], [1000, 1]],
                 "own_block_bytes": 4 * 512, "own_requested_bytes": 4 * 512}

    def broken():
        raise RuntimeError("no snapshot")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", broken)
    assert gc.foreign_blocks(model, ids)["error"]["message"] == "no snapshot"


def test_write_json_has_no_nan_and_replaces_atomically(tmp_path):
    path = tmp_path / "sub" / "r.json"
    gc.write_json(path, {"a": math.nan, "b": [math.inf, 1.5, (2, 3)], "c": {"d": torch.device("cpu")}})
    assert _load(path) == {"a": None, "b": [None, 1.5, [2, 3]], "c": {"d": "cpu"}}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_grad_error():
    ref = {"w": torch.tensor([1.0, -4.0]), "b": torch.tensor([0.0])}
    e = gc.grad_error({"w": torch.tensor([1.5, -4.0]), "b": torch.tensor([0.0])}, ref)
    assert e == {"grad_max_abs_err": 0.5, "grad_max_rel_err": 0.125, "grads_missing": []}
    e = gc.grad_error({"w": torch.tensor([1.0, -4.0]), "extra": torch.zeros(1)}, ref)
    assert e["grads_missing"] == ["b", "extra"] and e["grad_max_abs_err"] == 0.0


def test_junit_counts_and_the_gpu_test_files(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="5" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.a" name="ok"/><testcase classname="tests.a" name="bad"><failure/></testcase>'
        '<testcase classname="tests.b" name="err"><error/></testcase></testsuite></testsuites>'
    )
    assert gc.junit_counts(xml) == {"tests": 5, "passed": 2, "failed": 1, "errors": 1, "skipped": 1,
                                    "failed_names": ["tests.a::bad", "tests.b::err"]}
    files = gc.gpu_test_files()
    assert "tests/test_gpu_check.py" in files and "tests/test_budget.py" not in files


def test_intervals_union():
    assert gc._intervals_union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


def test_options_and_model_configs():
    a = gc.parse_args(["--cpu-smoke"])
    assert a.time_limit == 2.5 and a.low_share == 0.5 and a.mincut_backend == "aot_eager_decomp_partition"
    a = gc.parse_args([])
    assert a.time_limit == 8.0 and a.low_share == 0.4 and a.mincut_backend == "aot_eager_decomp_partition"
    assert a.out == gc.DEFAULT_OUT and a.eager_share == 0.25 and a.max_seconds == 460
    assert gc.model_config(a, cuda=True) == gc.FULL and gc.FULL.batch is None  # chosen from the device
    assert gc.model_config(gc.parse_args(["--small", "--batch", "3"]), cuda=True).batch == 3
    assert gc.model_config(a, cuda=False) == gc.TINY
    assert (gc.FULL.layers, gc.FULL.hidden, gc.FULL.intermediate, gc.FULL.heads, gc.FULL.vocab, gc.FULL.seq, gc.FULL.dtype) == (
        8, 1024, 2816, 16, 8000, 2048, "bfloat16")
    assert gc.model_config(gc.parse_args(["--vocab", "32000"]), cuda=True).vocab == 32000


# --------------------------------------------------------------------------- on a CUDA device

@pytest.mark.gpu
@needs_cuda
def test_auto_budget_on_cuda_is_read_from_the_device_and_kept():
    import optsched
    from optsched.budget import AUTO_SOURCE
    from optsched.measure import measure_training_step
    from tests.models import mlp

    model, (x,) = mlp()
    model, x = model.cuda(), x.cuda()
    free, _total = torch.cuda.mem_get_info()
    opt = optsched.optimize(model, "auto", time_limit_s=2)
    m = measure_training_step(opt, model, (x,))
    plan = opt.plan
    auto = plan.budget_from["auto"]
    assert plan.budget_spec == "auto" and plan.summary()["budget_from"] == AUTO_SOURCE
    assert plan.budget_bytes == auto["bytes"] > 0 and auto["device"].startswith("cuda")
    assert auto["free_bytes"] <= free + 64 * MIB and auto["resident_bytes"] > 0  # the MLP's weights and batch
    assert m.peak_bytes <= plan.budget_bytes


@pytest.mark.gpu
@needs_cuda
def test_step_time_and_profile_on_cuda():
    a = torch.randn(512, 512, device="cuda")

    def run():
        b = a
        for _ in range(8):
            b = b @ a
        b.cpu()  # one device->host copy

    t = gc.step_time(run, torch.device("cuda"), warmup=1, repeat=3)
    assert t["n"] == 3 and 0 < t["min_s"] <= t["median_s"] <= t["max_s"]
    p = gc.profile_step(run, torch.device("cuda"))
    assert "error" not in p, p
    assert p["n_kernels"] >= 8 and p["n_copies"] >= 1 and 0 < p["kernel_busy_s"] <= p["gpu_span_s"]


class _FakeCudaCheck(gc.Check):
    """A check that takes this CPU for a CUDA device (the sections' own logic; the device calls are faked)."""

    @property
    def cuda(self) -> bool:
        return True


def test_the_cuda_sections_logic_on_a_faked_device(tmp_path, monkeypatch):
    """pytest -m gpu in its child process (every test skipped here), the low-budget pair with their offload
    comparison, and does_not_fit with "auto" and bytes, on this CPU with torch.cuda's memory calls faked: what
    the sections compute from the figures, short of the device itself."""
    from types import SimpleNamespace

    import optsched
    from optsched import budget as budget_mod
    from optsched.measure import live_bytes

    state = {"fraction": 1.0}
    total = 64 * 2**30
    cuda = torch.cuda
    real_optimize = optsched.optimize

    def optimize(*args, **kwargs):  # CUDA "available" to optimize()'s check of "auto" only: Dynamo would believe it too
        with monkeypatch.context() as m:
            m.setattr(cuda, "is_available", lambda: True)
            return real_optimize(*args, **kwargs)

    monkeypatch.setattr(optsched, "optimize", optimize)
    monkeypatch.setattr(cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=total, major=9, minor=0))
    monkeypatch.setattr(cuda, "set_per_process_memory_fraction", lambda f, d=None: state.update(fraction=f))
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d=None: state["fraction"])
    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(cuda, name, lambda d=None: None)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: 1234)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda d=None: 2345)
    monkeypatch.setattr(cuda, "memory_snapshot", lambda: [])
    monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (total // 2, total))
    monkeypatch.setattr(budget_mod, "auto_device", lambda tensors: torch.device("cpu"))
    monkeypatch.setattr(budget_mod, "AUTO_HEADROOM_SHARE", 0.0)  # the tiny step is KiBs: no headroom, fine rounding
    monkeypatch.setattr(budget_mod, "AUTO_HEADROOM_MIN", 0)
    monkeypatch.setattr(budget_mod, "AUTO_GRANULE", 256)

    args = gc.parse_args(["--cpu-smoke", "--cases", "optsched 50% offload,optsched 50% recompute-only",
                          "--pytest-timeout", "300"])
    check = _FakeCudaCheck(args, torch.device("cpu"), gc.TINY, tmp_path / "f.json", gc.new_result(args, True, gc.TINY))
    check.result["sections"]["gpu_tests"] = gc.run_section(check, "gpu_tests", gc.section_gpu_tests)
    gc.setup_model(check)
    resident = live_bytes(check.model, check.ids)
    monkeypatch.setattr(cuda, "memory_allocated", lambda d=None: resident)
    monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: resident)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as main() does without CUDA
    try:
        for name, fn in (("headline", gc.section_headline_first), ("does_not_fit", gc.section_does_not_fit),
                         ("offload", gc.section_offload)):
            gc.run_section(check, name, fn)
    finally:
        torch.set_num_threads(threads)
    r = _load(tmp_path / "f.json")

    t = r["sections"]["gpu_tests"]
    assert t["status"] == "ok", t
    assert t["returncode"] == 0 and t["tests"] >= 2 and t["failed"] == 0 and t["errors"] == 0  # all skipped on this CPU
    assert "tests/test_gpu_check.py" in t["files"]

    rows = {c["role"]: c for c in r["sections"]["headline"]["cases"] if c.get("role")}
    assert rows["offload"]["status"] == "ok" and rows["recompute_only"]["status"] == "ok"
    assert rows["offload"]["first_call_peak_bytes"] == 1234 and "error" in rows["offload"]["profile"]  # no CUDA profiler here

    o = r["sections"]["offload"]
    assert o["status"] == "ok", o
    assert o["measured_step_s"]["offload"] == rows["offload"]["step_s"] and o["share_of_eager"] == 0.5
    assert o["predicted_exposed_transfer_s"] == rows["offload"]["exposed_transfer_s"] and "profile_note" in o

    n = r["sections"]["does_not_fit"]
    assert n["status"] == "ok", n
    eager_peak = r["sections"]["headline"]["cases"][0]["measured_peak_bytes"]
    assert n["limit_bytes"] == int(0.7 * eager_peak) and n["resident_bytes"] == resident
    assert n["eager"]["out_of_memory"] is False  # the faked cap binds nothing
    cases = {c["budget"]: c for c in n["cases"]}
    assert cases["auto"]["status"] == "ok" and cases["bytes"]["status"] == "ok", n["cases"]
    auto = cases["auto"]["auto"]
    assert auto["limit_bytes"] == n["limit_bytes"] and auto["resident_bytes"] == resident
    assert cases["auto"]["budget_bytes"] == n["limit_bytes"] // 256 * 256  # resident + (limit - allocated), no headroom
    assert cases["bytes"]["budget_bytes"] == int(0.9 * n["limit_bytes"])
    assert cases["auto"]["first_call_within_limit"] and cases["auto"]["first_call_within_budget"]
    assert state["fraction"] == 1.0  # the cap is lifted afterwards
    assert "does not fit: cap" in gc.render_table(r)


def test_the_automatic_batch_fills_the_share_of_the_device(tmp_path, monkeypatch):
    """On CUDA the batch is chosen from eager's peak at batch 1 and 2 (linear in the batch), here on this CPU
    with the device's size faked."""
    import dataclasses
    from types import SimpleNamespace

    args = gc.parse_args(["--cpu-smoke"])
    cfg = dataclasses.replace(gc.TINY, batch=None)
    check = _FakeCudaCheck(args, torch.device("cpu"), cfg, tmp_path / "b.json", gc.new_result(args, True, cfg))
    model = gc.build_model(cfg, check.device)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=200 * MIB))
    batch, how = gc.choose_batch(check, model)
    per, fixed = how["per_sample_bytes"], how["eager_peak_batch1_bytes"] - how["per_sample_bytes"]
    assert how["chosen"] == "auto" and per > 0 and how["target_bytes"] == int(args.eager_share * 200 * MIB)
    assert batch == min(args.max_batch, (how["target_bytes"] - fixed) // per)
    assert how["predicted_eager_peak_bytes"] == fixed + batch * per
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=2**40))
    assert gc.choose_batch(check, model)[0] == args.max_batch  # a huge device: the ceiling


def test_live_at_peak_groups_the_step_allocations_live_at_its_peak():
    """The trace diagnostic: the allocations live when the step's own allocations peak, by where they were made."""
    f = lambda name, line: [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "inner"},  # noqa: E731
                            {"filename": f"/u/{name}.py", "line": line, "name": name}]
    ev = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": f("fwd", 10)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": f("fwd", 10)},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 300, "frames": f("bwd", 20)},  # peak: 50 + 300
        {"action": "free_completed", "addr": 3, "size": 300},
        {"action": "alloc", "addr": 4, "size": 200, "frames": f("bwd", 21)},
    ]
    r = gc.live_at_peak(ev)
    assert r["peak_rise_bytes"] == 350 and r["n_live"] == 2 and r["n_events"] == 7
    assert [(g["where"], g["bytes"]) for g in r["groups"]] == [("bwd.py:20 bwd", 300), ("fwd.py:10 fwd", 50)]


def test_the_commit_sent_with_the_tree_is_the_one_recorded(monkeypatch):
    """On the H200 the copy of .git was the session's first commit while the tree was a later one: the JSON named
    the wrong commit. OPTSCHED_COMMIT (set in the device command) wins, and the tree state is then unknown."""
    monkeypatch.setenv("OPTSCHED_COMMIT", "0123456789abcdef")
    git = gc.git_state()
    assert git["commit"] == "0123456789abcdef" and git["from"] == "OPTSCHED_COMMIT" and "copy_commit" in git
    meta = gc.result_meta({"git": git, "torch": "2.11", "python": "3.12"})
    assert meta["commit"] == "0123456789abcdef" and meta["short"] == "0123456" and meta["clean"] is None
    assert meta["dirty_files"] == []
    monkeypatch.delenv("OPTSCHED_COMMIT")
    assert gc.result_meta({"git": gc.git_state()})["commit"] == gc.git_state()["commit"] != "0123456789abcdef"


def test_alloc_conf_is_the_users_when_set():
    """gpu_check runs the allocator with expandable segments unless the environment chose its own settings."""
    from benchmarks.gpu_check import apply_alloc_conf

    env: dict = {}
    assert apply_alloc_conf("expandable_segments:True", env) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    assert apply_alloc_conf("expandable_segments:True", mine) == "max_split_size_mb:128"
    assert mine == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    env = {}
    assert apply_alloc_conf("", env) == "" and env == {}  # the default mode
