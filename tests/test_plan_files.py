"""Plan files: solve once, load in another process, same program and peak; anything that does not
match, or was corrupted or edited, is refused with a message that says why."""

from __future__ import annotations

import json
import os
import re
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


# ----------------------------------------------------------------------------- the whole file typed

# fields written since plan schema version 1 appeared: a version-1 file written before them lacks them
MAY_BE_MISSING = {
    "created",
    "made_for.budget_from", "made_for.budget_resolved_bytes", "made_for.budget_reference", "made_for.outputs",
    "summary.budget_from", "summary.budget_reference_peak_bytes", "summary.output_usage", "summary.bound_valid_for",
    "summary.chunks",  # written since issue 16 (chunking)
    "timeline.unplanned_steps_per_point", "timeline.unplanned_n_steps", "timeline.unplanned_n_forward_steps",
}
NAME_KEYED = {"costs", "decisions.offload"}  # objects keyed by op or tensor names, not by field names
ROWS = r'fingerprint\.nodes\[0\]|costs\["[^"]*"\](\[2\]\[0\])?'  # lists with a meaning per item: every item checked


@pytest.fixture(scope="module")
def full_plan(tmp_path_factory):
    """A real plan file with every section filled: offloads and recomputations (an offline H100 plan),
    a percentage budget (its reference recorded)."""
    cfg = gpt.GPTConfig(n_layer=2, n_embd=128)
    plan = optsched.plan_offline(lambda: gpt.build(cfg), lambda: gpt.make_batch(cfg, batch_size=4), "60%",
                                 device_profile="h100", offload=True, time_limit_s=2)
    path = plan.save(tmp_path_factory.mktemp("typed") / "full.json")
    data = json.loads(path.read_text())
    assert data["decisions"]["offload"] and data["decisions"]["recomputed"] and data["timeline"]["offloads"]
    assert isinstance(data["made_for"]["budget_reference"], dict)
    return path, data


def _resealed(data: dict, path: Path) -> Path:
    """`data` written as a writer would (sealed): only the typed check can catch what is wrong in it."""
    return write_plan_file(seal({k: v for k, v in data.items() if k not in ("schema", "schema_version", "checksum")}),
                           path)


def _nested_fields(value, keys: tuple = (), path: str = ""):
    """(path, keys, is_named_field) for every field below the top level of a plan file's JSON: each field
    of an object, the first entry of an object keyed by names, the first item of each list (every item of
    a row: a fingerprint node, an op's costs)."""
    if isinstance(value, dict):
        named = path not in NAME_KEYED
        for k, v in list(value.items())[: None if named else 1]:
            p = (f"{path}.{k}" if path else k) if named else f'{path}["{k}"]'
            if keys:
                yield p, (*keys, k), named
            yield from _nested_fields(v, (*keys, k), p)
    elif isinstance(value, list) and value:
        for i, item in enumerate(value[: None if re.fullmatch(ROWS, path) else 1]):
            yield f"{path}[{i}]", (*keys, i), False
            yield from _nested_fields(item, (*keys, i), f"{path}[{i}]")


def _wrong(value):
    """A JSON value of another type than `value`'s (and than null, for a field that may be null)."""
    if isinstance(value, str):
        return 7
    if value is None or isinstance(value, dict):
        return []
    return "7"


def _with(data: dict, keys: tuple, value=None, delete: bool = False) -> dict:
    data = json.loads(json.dumps(data))
    parent = data
    for k in keys[:-1]:
        parent = parent[k]
    if delete:
        del parent[keys[-1]]
    else:
        parent[keys[-1]] = value
    return data


def test_a_plan_file_round_trips_unchanged_through_the_typed_check(full_plan, tmp_path):
    path, data = full_plan
    assert optsched.load_plan(path).data == data
    assert optsched.load_plan(_resealed(data, tmp_path / "again.json")).data == data


def test_every_nested_field_mistyped_is_a_plan_file_error_naming_its_path(full_plan, tmp_path):
    path, data = full_plan
    fields = list(_nested_fields(data))
    assert len(fields) > 100 and {"decisions.fw_order[0]", 'costs["arange"][0]', "timeline.offloads[0].prefetch",
                                  "made_for.profile.memory_bytes", "fingerprint.nodes[0][3]",
                                  'decisions.offload["' + next(iter(data["decisions"]["offload"])) + '"]',
                                  "made_for.budget_reference.bytes", "solver.notes[0]"} <= {p for p, _k, _n in fields}
    unnoticed = []
    for field_path, keys, _named in fields:
        bad = _with(data, keys, _wrong(_value_at(data, keys)))
        try:
            optsched.load_plan(_resealed(bad, tmp_path / "bad.json"))
        except optsched.PlanFileError as e:
            assert re.search(re.escape(f"bad.json: {field_path}: expected ") + r"\S.* got ", str(e)), str(e)
        else:
            unnoticed.append(field_path)
    assert not unnoticed


def test_every_missing_nested_field_is_a_plan_file_error_naming_its_path(full_plan, tmp_path):
    path, data = full_plan
    missing_ok = []
    for field_path, keys, named in _nested_fields(data):
        if not named:
            continue
        try:
            optsched.load_plan(_resealed(_with(data, keys, delete=True), tmp_path / "bad.json"))
        except optsched.PlanFileError as e:
            assert field_path not in MAY_BE_MISSING, f"{field_path}: {e}"
            assert str(e).endswith(f"bad.json: {field_path}: missing"), str(e)
        else:
            missing_ok.append(field_path)
    assert set(missing_ok) == MAY_BE_MISSING - {"created"}  # "created" is a top-level field
    no_date = {k: v for k, v in data.items() if k != "created"}
    assert optsched.load_plan(_resealed(no_date, tmp_path / "old.json")).data == seal(
        {k: v for k, v in no_date.items() if k not in ("schema", "schema_version", "checksum")})


def _value_at(data: dict, keys: tuple):
    for k in keys:
        data = data[k]
    return data


@pytest.mark.parametrize("keys, value, message", [
    (("decisions", "fw_order", 3), "3", "decisions.fw_order[3]: expected int, got str"),
    (("decisions", "offload"), [], "decisions.offload: expected an object, got a list"),
    (("decisions", "fusion_groups"), [["embedding", 1]], "decisions.fusion_groups[0][1]: expected str, got int"),
    (("made_for", "offload"), 1, "made_for.offload: expected bool, got int"),
    (("summary", "predicted_peak_bytes"), True, "summary.predicted_peak_bytes: expected int, got bool"),
    (("summary", "n_ops"), 4.0, "summary.n_ops: expected int, got float"),
    (("solver", "gap"), None, "solver.gap: expected float, got null"),
    (("costs", "arange"), [1e-6, 0], 'costs["arange"]: expected a list of 3 items, got 2'),
    (("costs", "arange", 2), [["a"]], 'costs["arange"][2][0]: expected a list of 2 items, got 1'),
    (("fingerprint", "nodes", 0), ["primals_1", "primals_1", "4x128"], "fingerprint.nodes[0]: expected a list of 4"),
    (("timeline", "offloads", 0), "addmm", "timeline.offloads[0]: expected an object, got str"),
    (("created",), 20260101, "created: expected str, got int"),
])
def test_a_mistyped_field_names_its_path_and_types(full_plan, tmp_path, keys, value, message):
    _path, data = full_plan
    with pytest.raises(optsched.PlanFileError, match=re.escape(message)):
        optsched.load_plan(_resealed(_with(data, keys, value), tmp_path / "bad.json"))
