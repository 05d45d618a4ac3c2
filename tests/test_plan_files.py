"""Plan files: solve once, load in another process, same program and peak; anything that does not
match, or was corrupted or edited, is refused with a message that says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import optsched
from benchmarks.models import gpt
from optsched.plans.file_format import seal, write_plan_file

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, sys, torch, optsched
from benchmarks.models import gpt
from optsched.measure import measure_training_step
width, path = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
cfg = gpt.GPTConfig(n_layer=2, n_embd=width)
model = gpt.build(cfg)
inputs = gpt.make_batch(cfg, batch_size=4)
opt = optsched.optimize(model, "75%", example_inputs=inputs, time_limit_s=3, plan=path)
m = measure_training_step(opt, model, inputs)
p = opt.plan
print(json.dumps({"peak": m.peak_bytes, "predicted": p.predicted_peak_bytes, "fw": p.schedule.fw_order,
                  "bw": p.schedule.bw_order, "notes": p.stats.notes, "loss": m.loss.item()}))
"""


def _run(width: int, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(width), str(path)], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
    )
    if out.returncode != 0:
        raise AssertionError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "gpt.json"
    first = _run(256, path)
    return path, first


def test_a_plan_loaded_in_a_new_process_runs_the_same_program_at_the_same_peak(saved_plan):
    path, first = saved_plan
    assert path.exists()
    second = _run(256, path)
    assert any(n.startswith("loaded from") for n in second["notes"])
    assert not any(n.startswith("loaded from") for n in first["notes"])
    assert (second["fw"], second["bw"]) == (first["fw"], first["bw"])
    assert second["predicted"] == first["predicted"]
    assert second["peak"] == first["peak"] == first["predicted"]
    assert second["loss"] == first["loss"]


def test_a_wider_model_is_refused_naming_the_difference(saved_plan):
    path, _first = saved_plan
    with pytest.raises(AssertionError, match=r"PlanMismatchError.*1000x256.*1000x320"):
        _run(320, path)


def _gpt(width=128):
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(n_layer=1, n_embd=width)
    return gpt.build(cfg), gpt.make_batch(cfg, batch_size=2)


def test_a_different_budget_is_a_mismatch_and_replan_overwrites(tmp_path):
    path = tmp_path / "p.json"
    model, inputs = _gpt()
    optsched.optimize(model, "90%", example_inputs=inputs, time_limit_s=2, plan=path)
    with pytest.raises(optsched.PlanMismatchError, match=r"budget: the plan has '90%', this run wants '80%'"):
        optsched.optimize(model, "80%", example_inputs=inputs, time_limit_s=2, plan=path)
    opt = optsched.optimize(model, "80%", example_inputs=inputs, time_limit_s=2, plan=path, on_mismatch="replan")
    assert optsched.load_plan(path).data["made_for"]["budget"] == "80%"
    assert opt.plan.budget_spec == "80%"


def test_corrupted_or_edited_files_are_refused(tmp_path):
    path = tmp_path / "p.json"
    model, inputs = _gpt()
    optsched.optimize(model, None, example_inputs=inputs, time_limit_s=2, plan=path)
    text = path.read_text()

    path.write_text(text[: len(text) // 2])
    with pytest.raises(optsched.PlanFileError, match="not valid JSON"):
        optsched.optimize(model, None, example_inputs=inputs, plan=path)

    data = json.loads(text)
    data["decisions"]["fw_order"] = list(reversed(data["decisions"]["fw_order"]))
    path.write_text(json.dumps(data))
    with pytest.raises(optsched.PlanFileError, match="checksum"):
        optsched.optimize(model, None, example_inputs=inputs, plan=path)

    # a writer bug (sealed, but the schedule cannot run) is caught by replaying it
    write_plan_file(seal({k: v for k, v in data.items() if k not in ("schema", "schema_version", "checksum")}), path)
    with pytest.raises(optsched.PlanFileError, match="does not run"):
        optsched.optimize(model, None, example_inputs=inputs, plan=path)

    data = json.loads(text)
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(optsched.PlanFileError, match="schema version 99"):
        optsched.load_plan(path)
    with pytest.raises(optsched.PlanFileError, match="cannot read"):
        optsched.load_plan(tmp_path / "missing.json")


def test_writes_are_atomic_and_leave_an_ordinary_file(tmp_path):
    model, inputs = _gpt()
    opt = optsched.optimize(model, None, example_inputs=inputs, time_limit_s=2)
    path = opt.plan.save(tmp_path / "sub" / "p.json")
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]  # no temporary left behind
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    pf = optsched.load_plan(path)
    assert pf.summary == json.loads(json.dumps(opt.plan.summary()))
    assert pf.fingerprint["hash"] == opt.plan.fingerprint["hash"]
    for key in ("fw_order", "bw_order", "offload", "fusion_groups", "recomputed", "offloaded", "ops"):
        assert key in pf.data["decisions"]


def test_the_plan_cache_keys_plans_by_graph_budget_and_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTSCHED_CACHE_DIR", str(tmp_path))
    model, inputs = _gpt()
    optsched.optimize(model, "95%", example_inputs=inputs, time_limit_s=2, plan="auto")
    optsched.optimize(model, "90%", example_inputs=inputs, time_limit_s=2, plan="auto")
    assert len(list(tmp_path.glob("*.json"))) == 2
    again = optsched.optimize(model, "95%", example_inputs=inputs, time_limit_s=2, plan="auto")
    assert any(n.startswith("loaded from") for n in again.plan.stats.notes)
    assert len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.parametrize("bad", [dict(on_mismatch="ignore"), dict(plan=3)])
def test_bad_plan_arguments_are_value_errors(bad):
    with pytest.raises(ValueError):
        optsched.optimize(torch.nn.Linear(2, 2), None, **bad)


# ----------------------------------------------------------------------------- unwritable places
# We may run as root, where a read-only mode stops nothing: a folder under a regular *file*
# (it cannot be created) and /proc are unwritable for root too. chmod is tried as well, and
# used only where it actually stops a write.


def _unwritable_folders(tmp_path: Path) -> list[Path]:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    folders = [blocker / "plans", blocker / "deeper" / "plans"]
    if Path("/proc/self").is_dir():
        folders.append(Path("/proc/optsched-test"))
    locked = tmp_path / "read_only"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        (locked / "probe").write_text("")
    except OSError:
        folders.append(locked)  # not root: chmod protects it
    else:
        (locked / "probe").unlink()
    return folders


def _mlp():
    from tests.models import mlp

    return mlp()


def test_check_writable_probes_the_file_system_and_creates_nothing(tmp_path):
    from optsched.plans.cache import check_writable

    assert check_writable(tmp_path / "p.json") is None
    assert check_writable(tmp_path / "new" / "deeper" / "p.json") is None
    assert not (tmp_path / "new").exists()
    assert check_writable(tmp_path) == f"{tmp_path} is a folder"
    folders = _unwritable_folders(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    for folder in folders:
        reason = check_writable(folder / "p.json")
        assert reason is not None and str(folder.parent if "a_file" in str(folder) else folder) in reason, (folder, reason)
    assert "a_file is a file" in check_writable(folders[0] / "p.json")
    assert sorted(tmp_path.rglob("*")) == before  # no probe left behind


def test_an_unwritable_plan_path_is_a_plan_file_error_before_anything_is_planned(tmp_path):
    model, _inputs = _mlp()
    for folder in _unwritable_folders(tmp_path):
        with pytest.raises(optsched.PlanFileError, match=r"cannot write plan file .*p\.json: "):
            optsched.optimize(model, None, plan=folder / "p.json")
    with pytest.raises(optsched.PlanFileError, match="is a folder"):
        optsched.optimize(model, None, plan=tmp_path)


def test_an_unwritable_plan_cache_warns_once_and_the_step_runs(tmp_path, monkeypatch):
    import warnings

    from optsched.plans import cache as plan_file

    monkeypatch.setattr(plan_file, "_reported_caches", set())
    cache = tmp_path / "a_file" / "cache"
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("OPTSCHED_CACHE_DIR", str(cache))
    model, inputs = _mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = optsched.optimize(model, None, plan="auto", time_limit_s=2)
        opt(*inputs).backward()
        again = optsched.optimize(model, None, plan="auto", example_inputs=inputs, time_limit_s=2)  # no second warning
    ours = [w for w in caught if issubclass(w.category, optsched.PlanFileWarning)]
    assert len(ours) == 1 and issubclass(ours[0].category, optsched.PlanCacheWarning), [str(w.message) for w in caught]
    text = str(ours[0].message)
    assert str(cache) in text and "OPTSCHED_CACHE_DIR" in text and "a_file is a file" in text
    assert ours[0].filename == __file__  # points at the optimize() call
    assert opt.plan is not None and again.plan is not None
    assert all(p.grad is not None for p in model.parameters())


def test_a_save_that_fails_after_planning_warns_and_the_step_runs(tmp_path, monkeypatch):
    import errno

    import optsched.plans.plan

    def disk_full(data, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(optsched.plans.plan, "write_plan_file", disk_full)
    model, inputs = _mlp()
    path = tmp_path / "p.json"
    opt = optsched.optimize(model, None, plan=path, time_limit_s=2)
    with pytest.warns(optsched.PlanFileWarning, match=r"could not save the plan to .*p\.json .*No space left"):
        loss = opt(*inputs)
    loss.backward()
    assert opt.plan is not None and not path.exists()
    assert all(p.grad is not None for p in model.parameters())


def test_the_plan_cache_folder_is_the_environment_variable_else_the_platform_cache(tmp_path, monkeypatch):
    from optsched.plans.cache import cache_dir

    monkeypatch.setenv("OPTSCHED_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("OPTSCHED_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert cache_dir() == tmp_path / "xdg" / "optsched" / "plans"
    assert cache_dir().name == "plans" and "optsched" in cache_dir().parts
