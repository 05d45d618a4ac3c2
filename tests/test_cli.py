"""The `optsched` command: plan (offline, end to end), show, diff, timeline, and its errors.

Plan files come from two real plans of a small GPT at different budgets (captured on this CPU,
h100 roofline times). Most commands run in this process through `optsched.cli.main` (each new
Python process spends seconds importing torch); a few run as real processes to check exit
codes, the console script and that no traceback leaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optsched.cli import build_parser, diff_report, input_specs, main
from optsched.plans.file_format import load_plan

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20

# module fixtures shared by most tests: one worker runs the file (see tests/conftest.py)
pytestmark = pytest.mark.xdist_group("cli")


def _mib(b: int) -> str:
    return f"{b / MIB:.2f} MiB"


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optsched.cli", *args], check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"},
    )


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plans of the same 2-layer GPT: 70% and 50% of the unplanned peak."""
    import optsched
    from benchmarks.models import gpt

    folder = tmp_path_factory.mktemp("cli_plans")
    cfg = gpt.GPTConfig(n_layer=2)
    model = gpt.build(cfg)
    inputs = gpt.make_batch(cfg, batch_size=8)
    paths = {}
    for name, budget in (("loose", "70%"), ("tight", "50%")):
        opt = optsched.optimize(model, budget, example_inputs=inputs, device_profile="h100", offload=False,
                                time_limit_s=3)
        paths[name] = opt.plan.save(folder / f"{name}.json")
    return paths


# ----------------------------------------------------------------------------- help


@pytest.mark.parametrize(
    "command, words",
    [
        ([], ["plan", "show", "diff", "timeline", "exit with status 2"]),
        (["plan"], ["MODULE:FACTORY", "--inputs", "--kwargs", "--budget", "--profile", "--executor", "--offload",
                    "--no-offload", "--time-limit", "--output", "--no-progress", "seconds", "60%", "MiB",
                    "8x128:int64", "h100", "example"]),
        (["show"], ["PLAN.json", "predicted peak", "budget", "gap", "example"]),
        (["diff"], ["A.json", "B.json", "recomputed", "offloaded", "fusion", "example"]),
        (["timeline"], ["PLAN.json", "--output", "--dpi", "PNG", "budget", "recompute", "example"]),
    ],
)
def test_help_of_every_command_exits_0_and_names_its_arguments(command, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for word in words:
        assert word in text, f"`optsched {' '.join(command)} --help` does not mention {word!r}"


# ----------------------------------------------------------------------------- show / diff / timeline


def test_show_prints_the_plan_figures(plans, capsys):
    data = load_plan(plans["tight"]).data
    s = data["summary"]
    assert main(["show", str(plans["tight"])]) == 0
    out = capsys.readouterr().out
    for expected in (
        _mib(s["predicted_peak_bytes"]), _mib(s["unplanned_peak_bytes"]), _mib(s["budget_bytes"]),
        f"{s['predicted_peak_bytes'] / s['budget_bytes']:.1%} of the budget",
        f"x{s['time_ratio']:.3f}", s["solver_status"], f"{s['gap']:.2%}", f"{s['n_recomputed']} ops",
        "h100", "roofline", "eager", "50% of the unplanned peak", data["torch_version"], s["method"],
    ):
        assert expected in out, f"{expected!r} missing from `optsched show`:\n{out}"


def test_diff_reports_the_budgets_figures_and_recompute_difference(plans, capsys):
    a, b = load_plan(plans["loose"]).data, load_plan(plans["tight"]).data
    only_tight = [n for n in b["decisions"]["recomputed"] if n not in a["decisions"]["recomputed"]]
    assert only_tight, "the 50% plan should recompute ops the 70% plan does not"
    assert main(["diff", str(plans["loose"]), str(plans["tight"])]) == 0
    out = capsys.readouterr().out
    assert "70%" in out and "50%" in out
    assert "same graph" in out
    peak_a, peak_b = a["summary"]["predicted_peak_bytes"], b["summary"]["predicted_peak_bytes"]
    assert _mib(peak_a) in out and _mib(peak_b) in out
    assert f"{(peak_b - peak_a) / MIB:+.2f} MiB" in out
    assert f"recomputed only in B ({len(only_tight)})" in out
    assert only_tight[0] in out
    n_rc = (a["summary"]["n_recomputed"], b["summary"]["n_recomputed"])
    assert f"{n_rc[1] - n_rc[0]:+d}" in out


def test_diff_of_different_graphs_names_the_first_differing_node(plans):
    a = load_plan(plans["loose"]).data
    b = json.loads(json.dumps(a))
    b["fingerprint"]["hash"] = "0" * 64
    b["fingerprint"]["nodes"][1][2] = "2000x256"
    report = diff_report(a, b)
    assert not report["same_graph"]
    assert "graph node 1 differs" in report["graph"] and "2000x256" in report["graph"]


def test_timeline_writes_a_readable_png(plans, tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert main(["timeline", str(plans["tight"]), "-o", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    raw = out.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(raw) > 10_000
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert width >= 1200 and height >= 600


def test_timeline_of_a_downsampled_plan_with_offloads(plans, tmp_path):
    """More than 4,000 steps: the file keeps per-chunk maxima; offload spans and recompute steps
    keep their step indices."""
    from optsched.plans.file_format import downsample
    from optsched.cli.timeline import plot_timeline

    data = load_plan(plans["tight"]).data
    n, nf = 9000, 4000
    live = [(20 + (k % 97) / 10) * MIB for k in range(n)]
    tl = data["timeline"]
    tl["live_bytes"], tl["steps_per_point"] = downsample([int(v) for v in live])
    assert tl["steps_per_point"] == 3
    tl.update(n_steps=n, n_forward_steps=nf, recompute_steps=list(range(5000, 5200)), peak_step=4500,
              peak_bytes=int(max(live)), unplanned_live_bytes=downsample([int(v * 1.6) for v in live[:8800]])[0],
              offloads=[{"tensor": f"t{i}", "bytes": MIB, "produced": 10 * i, "release": 10 * i + 5,
                         "prefetch": 8000 - 10 * i, "first_read": 8002 - 10 * i} for i in range(12)])
    data["summary"].update(n_ops=8800, n_forward_ops=nf, n_offloaded=12, offloaded_bytes=12 * MIB)
    out = plot_timeline(data, tmp_path / "big.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


# ----------------------------------------------------------------------------- startup

# Runs `main` in a fresh interpreter and reports its exit status and whether torch got imported.
_PROBE = """
import json, sys
from optsched.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def _probe(*args: str, cwd) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"},
    )
    return json.loads(out.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("command", [["--help"], ["plan", "--help"], ["show"], ["diff"], ["timeline"],
                                     ["show", "missing.json"]])
def test_help_and_the_plan_file_commands_do_not_import_torch(command, plans, tmp_path):
    """Importing torch takes seconds: only `optsched plan` may, when it runs."""
    args = {"show": [str(plans["tight"])], "diff": [str(plans["loose"]), str(plans["tight"])],
            "timeline": [str(plans["tight"]), "-o", str(tmp_path / "t.png")]}.get(command[-1], [])
    result = _probe(*command, *args, cwd=tmp_path)
    assert result["rc"] == (2 if "missing.json" in command else 0)
    assert not result["torch"], f"`optsched {' '.join(command)}` imported torch"


def test_import_optsched_is_lazy_and_keeps_its_public_names():
    code = """
import sys
import optsched
from optsched.costs import PROFILES
from optsched.executors import NAMES
assert "torch" not in sys.modules, "import optsched imported torch"
assert set(optsched.__all__) <= set(dir(optsched)), sorted(set(optsched.__all__) - set(dir(optsched)))
assert optsched.PROFILES is PROFILES and "h100" in PROFILES and NAMES == ("eager", "inductor", "nvfuser")
assert optsched.load_plan and optsched.parse_budget("60%").fraction == 0.6
assert "torch" not in sys.modules, "the torch-free names imported torch"
from optsched import optimize, plan_offline, BudgetInfeasibleError, Plan, SUMMARY_KEYS
assert "torch" in sys.modules and callable(optimize) and callable(plan_offline)
for name in optsched.__all__:
    getattr(optsched, name)
try:
    optsched.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("optsched.no_such_name did not raise AttributeError")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
                         timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ----------------------------------------------------------------------------- errors


def _truncated(plans, tmp_path) -> Path:
    path = tmp_path / "truncated.json"
    text = plans["tight"].read_text()
    path.write_text(text[: len(text) // 2])
    return path


def _flipped(plans, tmp_path) -> Path:
    """One character changed inside "decisions" (an op name), the JSON still valid."""
    text = plans["tight"].read_text()
    start = text.index('"decisions"')
    i = text.index('"addmm', start) + 2
    path = tmp_path / "flipped.json"
    path.write_text(text[:i] + ("b" if text[i] != "b" else "c") + text[i + 1:])
    json.loads(path.read_text())
    return path


def _not_utf8(tmp_path) -> Path:
    """Bytes that are not UTF-8 (a binary file, a UTF-16 export): not a plan file."""
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe{\x00\"\x00s\x00" + bytes(range(128, 256)))
    return path


@pytest.mark.parametrize("command", ["show", "diff", "timeline"])
def test_a_corrupted_plan_file_is_one_line_and_exit_2(command, plans, tmp_path, capsys):
    for bad, word in ((_truncated(plans, tmp_path), "JSON"), (_flipped(plans, tmp_path), "checksum"),
                      (tmp_path / "missing.json", "cannot read"), (_not_utf8(tmp_path), "not a plan file: not UTF-8")):
        args = {"show": [str(bad)], "diff": [str(plans["loose"]), str(bad)],
                "timeline": [str(bad), "-o", str(tmp_path / "t.png")]}[command]
        assert main([command, *args]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and word in lines[0] and lines[0].startswith(f"optsched {command}: error:"), captured.err
        assert not (tmp_path / "t.png").exists()


def test_a_truncated_plan_file_in_a_real_process_exits_2_without_a_traceback(plans, tmp_path):
    """Through the console script when it is installed (`pip install -e .`), else `python -m optsched.cli`."""
    script = Path(sys.executable).parent / "optsched"
    bad = str(_truncated(plans, tmp_path))
    if script.exists():
        out = subprocess.run([str(script), "show", bad], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    else:
        out = _run("show", bad)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "JSON" in lines[0] and "Traceback" not in out.stderr, out.stderr
    assert out.stdout == ""


def test_a_non_utf8_plan_file_in_a_real_process_exits_2_without_a_traceback(tmp_path):
    bad = _not_utf8(tmp_path)
    out = _run("show", str(bad))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [f"optsched show: error: {bad} is not a plan file: not UTF-8 JSON (byte 0 is 0xff); plan files "
                     "are the JSON that Plan.save, optimize(plan=...) and `optsched plan` write"], lines


def test_timeline_outputs_that_cannot_be_written_are_one_line_and_exit_2(plans, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out, why in ((tmp_path, "is a folder"), (blocker / "t.png", "a_file is a file, not a folder"),
                     (blocker / "sub" / "t.png", "a_file is a file")):
        assert main(["timeline", str(plans["tight"]), "-o", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"optsched timeline: error: cannot write the image to {out}: "), lines
        assert why in lines[0], lines
    # a missing folder is created, as `optsched plan -o` creates it
    out = tmp_path / "new" / "deeper" / "t.png"
    assert main(["timeline", str(plans["tight"]), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_timeline_that_cannot_be_saved_after_all_is_one_line_and_exit_1(plans, tmp_path, monkeypatch, capsys):
    import errno

    from optsched.cli import timeline

    def disk_full(data, path, dpi):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(timeline, "plot_timeline", disk_full)
    out = tmp_path / "t.png"
    assert main(["timeline", str(plans["tight"]), "-o", str(out)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"optsched timeline: error: cannot write the image to {out}: No space left on device"]


@pytest.mark.parametrize("value", ["100000", "601", "9", "0", "-5", "1.5", "x"])
def test_timeline_dpi_out_of_range_is_an_argparse_error(value, plans, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["timeline", str(plans["tight"]), "-o", str(tmp_path / "t.png"), "--dpi", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: optsched timeline" in err and f"argument --dpi: {value!r} is not a resolution from 10 to 600" in err, err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize(
    "args, bad",
    [
        (["--inputs", "8xa:int64"], "'8xa'"),
        (["--inputs", "8x128:int64,8x128:int65"], "'int65'"),
        (["--inputs", "8x128:int64,,8x128"], "input 2 of 3 is empty"),
        (["--inputs", "8x0"], "'8x0'"),
        (["--inputs", "8x128", "--budget", "12XB"], "'XB'"),
        (["--inputs", "8x128", "--budget=-5%"], "'-5%': a budget must be positive"),
        (["--inputs", "8x128", "--budget", "-5%"], "'-5%': a budget must be positive"),
        (["--inputs", "8x128", "--budget", "-1.5GiB"], "'-1.5GiB': a budget must be positive"),
        (["--budget", "-2000000", "--inputs", "8x128"], "'-2000000': a budget must be positive"),
        (["--inputs", "8x128", "--bud", "-5%"], "'-5%': a budget must be positive"),
        (["--inputs", "-4x32:int64,8x128"], "argument --inputs: input 1 of 2 ('-4x32:int64'): shape '-4x32' must be"),
        (["--in", "-4x32", "--budget", "60%"], "argument --inputs: '-4x32': shape '-4x32' must be positive"),
        (["--inputs=-4x32"], "argument --inputs: '-4x32': shape '-4x32' must be positive"),
        (["--inputs", "--budget", "60%"], "argument --inputs: expected one argument"),
        (["--inputs", "8x128", "--budget", "--profile", "cpu"], "argument --budget: expected one argument"),
        (["--inputs", "8x128", "--budget", "0%"], "'0%'"),
        (["--inputs", "8x128", "--time-limit", "0"], "'0'"),
        (["--inputs", "8x128", "--kwargs", "[1]"], "JSON object"),
        (["--inputs", "8x128", "--profile", "tpu"], "'tpu'"),
    ],
)
def test_bad_plan_arguments_are_argparse_errors_naming_the_bad_part(args, bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "benchmarks.models.gpt:build", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: optsched plan" in err and bad in err, err


def test_a_factory_that_is_not_there_is_one_line_listing_what_is(capsys):
    assert main(["plan", "benchmarks.models.gpt:nope", "--inputs", "8x128:int64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nope'" in err[0] and "build" in err[0]
    assert main(["plan", "no_such_module_here:f", "--inputs", "8x128"]) == 2
    assert "cannot import module 'no_such_module_here'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "source, message",
    [
        ("import no_such_dependency_of_theirs\n", "ModuleNotFoundError: No module named 'no_such_dependency_of_theirs'"),
        ("from os import no_such_name\n", "ImportError: cannot import name 'no_such_name' from 'os'"),
        ("def f(:\n", "SyntaxError: invalid syntax"),
        ("raise RuntimeError('the config file is missing')\n", "RuntimeError: the config file is missing"),
    ],
)
def test_a_module_that_fails_to_import_is_one_line_and_exit_2(source, message, tmp_path, monkeypatch, capsys):
    """The user's module is there but does not import (one of its own imports fails, or its code): a usage error."""
    name = f"users_model_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source + "def build():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["plan", f"{name}:build", "--inputs", "8x128", "-o", str(tmp_path / "p.json")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"optsched plan: error: cannot import module {name!r} (from '{name}:build'): "), lines
        assert f"{tmp_path / name}.py:1: " in lines[0] and message in lines[0], lines
        with pytest.raises(Exception) as raised:  # --traceback: the import error itself
            main(["plan", f"{name}:build", "--inputs", "8x128", "-o", str(tmp_path / "p.json"), "--traceback"])
        assert message.split(":")[0] == type(raised.value).__name__
    finally:
        sys.modules.pop(name, None)
    assert not (tmp_path / "p.json").exists()


def test_a_module_that_fails_to_import_in_a_real_process_exits_2_without_a_traceback(tmp_path):
    (tmp_path / "broken_model.py").write_text("import no_such_dependency_of_theirs\n")
    out = subprocess.run([sys.executable, "-m", "optsched.cli", "plan", "broken_model:build", "--inputs", "8x128",
                          "-o", str(tmp_path / "p.json")], check=False, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("optsched plan: error: cannot import module 'broken_model'")


def _unwritable_outputs(tmp_path) -> list[Path]:
    """Output paths no one can write, root included (chmod stops nothing for root): under a
    regular file, a folder, and /proc."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    return [blocker / "out.json", blocker / "sub" / "out.json", tmp_path, Path("/proc/optsched-test/out.json")]


def test_an_unwritable_output_is_exit_2_before_torch_is_imported(tmp_path):
    for out in _unwritable_outputs(tmp_path):
        result = _probe("plan", "benchmarks.models.gpt:build", "--inputs", "8x128:int64,8x128:int64", "-o", str(out),
                        cwd=tmp_path)
        assert result["rc"] == 2 and not result["torch"], (out, result)


def test_an_unwritable_output_is_one_line(tmp_path, capsys):
    for out, why in zip(_unwritable_outputs(tmp_path), ("a_file is a file", "a_file is a file", "is a folder", "/proc")):
        assert main(["plan", "benchmarks.models.gpt:build", "--inputs", "8x128:int64", "-o", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"optsched plan: error: cannot write the plan to {out}: "), lines
        assert why in lines[0], lines


def test_a_save_that_fails_after_planning_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    import errno

    import optsched.plans.plan

    def disk_full(data, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(optsched.plans.plan, "write_plan_file", disk_full)
    out = tmp_path / "out.json"
    assert main(["plan", "tests.models:mlp", "--inputs", "32x64", "--profile", "cpu", "--time-limit", "1",
                 "--no-progress", "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"optsched plan: error: planned, but cannot write the plan to {out}: No space left on device", err
    assert not out.exists()


def test_input_specs_parse_shapes_and_dtypes():
    assert input_specs("8x128:int64, 8x128:long") == [((8, 128), "int64"), ((8, 128), "int64")]
    assert input_specs("4x3x32x32,4:int64,scalar:bf16") == [((4, 3, 32, 32), "float32"), ((4,), "int64"),
                                                            ((), "bfloat16")]


def test_dataclass_kwargs_become_the_config():
    from benchmarks.models import gpt
    from optsched.cli import bind_kwargs

    kw = bind_kwargs(gpt.build, {"cfg": {"n_layer": 2}, "seed": 3})
    assert kw["cfg"] == gpt.GPTConfig(n_layer=2) and kw["seed"] == 3
    parser = build_parser()
    assert parser.parse_args(["plan", "m:f", "--inputs", "2x2"]).budget.spec is None  # default: no budget


# ----------------------------------------------------------------------------- plan, end to end


def test_plan_end_to_end_writes_a_plan_file_for_the_graph_optimize_captures(plans, tmp_path):
    import optsched.compiler.offline  # noqa: F401 - `optsched plan` needs it: a failure to import is a bug, and fails here

    out_path = tmp_path / "offline.json"
    out = _run("plan", "benchmarks.models.gpt:build", "--kwargs", '{"cfg": {"n_layer": 2}}',
               "--inputs", "8x128:int64,8x128:int64", "--budget", "50%", "--no-offload", "--time-limit", "3",
               "--profile", "cpu", "-o", str(out_path), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    pf = load_plan(out_path)
    s = pf.summary
    # the cpu profile: a CUDA profile captures the CUDA attention kernel, which this CPU capture cannot match
    assert pf.data["made_for"]["budget"] == "50%" and pf.data["made_for"]["device_profile"] == "cpu"
    assert pf.data["made_for"]["offload"] is False and s["n_offloaded"] == 0
    assert s["predicted_peak_bytes"] <= s["budget_bytes"] and s["n_recomputed"] > 0
    assert _mib(s["predicted_peak_bytes"]) in out.stdout  # the show table
    assert f"wrote {out_path}" in out.stderr
    # fake tensors, the same graph as a real capture: optimize(plan=...) can replay it
    assert pf.fingerprint["hash"] == load_plan(plans["tight"]).fingerprint["hash"]
