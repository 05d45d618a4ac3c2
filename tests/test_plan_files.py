"""Plan files: solve once, load in another process, same program and peak; anything that does not
match, or was corrupted or edited, is refused with a message that says why."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
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


@pytest.mark.xdist_group("plan-files-saved")
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


@pytest.mark.xdist_group("plan-files-saved")
def test_a_wider_model_gets_its_own_plan_file_beside_and_the_first_is_kept(saved_plan):
    """One plan file per shape: the same step at other shapes (here a wider layer: the same ops) is planned and
    saved beside PATH (named by its fingerprint), never over it, and replayed from there by the next run."""
    path, first = saved_plan
    before = path.read_bytes()
    wider = _run(320, path)
    assert not any(n.startswith("loaded from") for n in wider["notes"])
    assert path.read_bytes() == before
    beside = [p for p in path.parent.iterdir() if p != path]
    assert [p.name for p in beside] == [f"gpt.{optsched.load_plan(beside[0]).fingerprint['hash'][:12]}.json"]
    assert "1000x320" in json.dumps(optsched.load_plan(beside[0]).fingerprint["nodes"])
    again = _run(320, path)
    assert f"loaded from {beside[0]}" in again["notes"] and again["fw"] == wider["fw"]


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


def test_a_plan_file_that_is_not_utf8_is_a_plan_file_error_naming_it(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(b"\xff\xfe{\x00}\x00")
    message = rf"{re.escape(str(path))} is not a plan file: not UTF-8 JSON \(byte 0 is 0xff\)"
    with pytest.raises(optsched.PlanFileError, match=message):
        optsched.load_plan(path)
    model, inputs = _mlp()
    opt = optsched.optimize(model, None, plan=path, time_limit_s=2)
    with pytest.raises(optsched.PlanFileError, match=message):  # the first call reads it
        opt(*inputs)
    assert path.read_bytes() == b"\xff\xfe{\x00}\x00"  # not overwritten


def _count_solves(monkeypatch) -> list:
    from optsched.planning.variants import Variants

    solves = []
    solve = Variants.plan

    def counted(self):
        solves.append(self.kind)
        return solve(self)

    monkeypatch.setattr(Variants, "plan", counted)
    return solves


def test_a_plan_file_keeps_every_input_shape_and_replays_each(tmp_path, monkeypatch):
    """Two batch sizes alternating through plan=PATH (a smaller last batch): each shape is planned once, in its
    own file (PATH, and one beside it named by the graph's fingerprint); a fresh optimize() replays both."""
    solves = _count_solves(monkeypatch)
    path = tmp_path / "mlp.json"
    model, (x,) = _mlp()
    loaded = []
    for _ in range(2):
        opt = optsched.optimize(model, None, plan=path, time_limit_s=2)
        for step in range(4):
            model.zero_grad(set_to_none=True)  # a training loop: each step starts without gradients
            opt(x if step % 2 == 0 else x[:5]).backward()
            loaded.append(next((n for n in opt.plan.stats.notes if n.startswith("loaded from")), None))
    assert len(solves) == 2, solves
    files = sorted(tmp_path.iterdir())
    beside = [p for p in files if p != path]
    assert len(files) == 2 and len(beside) == 1, files
    fp_small = optsched.load_plan(beside[0]).fingerprint["hash"]
    assert beside[0].name == f"mlp.{fp_small[:12]}.json"
    assert optsched.load_plan(path).fingerprint["hash"] != fp_small
    assert loaded[:4] == [None] * 4  # the first optimize() planned both shapes (and kept each program)
    assert loaded[4:] == [f"loaded from {path}", f"loaded from {beside[0]}"] * 2

    # replan: a changed budget plans each shape again once, each overwriting only its own file
    solves.clear()
    for _ in range(2):
        opt = optsched.optimize(model, "1GB", plan=path, time_limit_s=2, on_mismatch="replan")
        for step in range(4):
            model.zero_grad(set_to_none=True)  # a training loop: each step starts without gradients
            opt(x if step % 2 == 0 else x[:5]).backward()
    assert len(solves) == 2, solves
    assert sorted(tmp_path.iterdir()) == files
    assert {optsched.load_plan(p).data["made_for"]["budget"] for p in files} == {"1GB"}
    model.zero_grad(set_to_none=True)  # the step the files hold (one with gradients to add to has files of its own)
    with pytest.raises(optsched.PlanMismatchError, match=r"budget: the plan has '1GB', this run wants 'none'"):
        optsched.optimize(model, None, plan=path)(x[:5])  # the error names the small shape's file
    with pytest.raises(optsched.PlanMismatchError, match=re.escape(f"plan file {beside[0]} does not match")):
        optsched.optimize(model, None, plan=path)(x[:5])


def test_a_graph_with_other_ops_is_a_mismatch_naming_the_node(tmp_path):
    """Not another shape: the file's plan cannot serve it, and nothing is written beside it."""
    path = tmp_path / "step.json"

    def relu_step(x, w):
        return (x @ w).relu().sum()

    def tanh_step(x, w):
        return (x @ w).tanh().sum()

    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    optsched.optimize(relu_step, None, plan=path, time_limit_s=2)(x, w).backward()
    w.grad = None  # the same start as the file's step (one that accumulates has files of its own)
    with pytest.raises(optsched.PlanMismatchError, match=r"graph node \d+ differs: the plan has relu .*the graph now has tanh"):
        optsched.optimize(tanh_step, None, plan=path, time_limit_s=2)(x, w)
    assert [p.name for p in tmp_path.iterdir()] == ["step.json"]
    optsched.optimize(tanh_step, None, plan=path, time_limit_s=2, on_mismatch="replan")(x, w).backward()
    assert [p.name for p in tmp_path.iterdir()] == ["step.json"]
    assert "tanh" in json.dumps(optsched.load_plan(path).fingerprint["nodes"])


def _plan_like(path: Path, size: int = 1000) -> Path:
    """A file of `size` bytes that begins as plan files do (what the bounds may remove)."""
    head = '{"schema": "optsched.plan", "pad": "'
    path.write_text(head + "x" * (size - len(head) - 2) + '"}')
    return path


def test_files_beside_a_plan_path_are_bounded_least_recently_used_first(tmp_path, monkeypatch):
    from optsched.plans import cache

    monkeypatch.setattr(cache, "SHAPES_PER_PATH", 3)
    main = _plan_like(tmp_path / "gpt.json")
    other = _plan_like(tmp_path / "other.0123456789ab.json")
    beside = [cache.shape_path(main, f"{i:012x}") for i in range(5)]
    for i, p in enumerate(beside):
        _plan_like(p)
        os.utime(p, (1000 + i, 1000 + i))
    os.utime(beside[0], (5000, 5000))  # replayed last: kept
    users = tmp_path / "gpt.0123456789ab.json"  # the user's, named like a plan beside gpt.json: not counted, kept
    users.write_text('{"lr": 0.1}')
    os.utime(users, (1, 1))
    removed = cache.prune_shapes(beside[1])  # just written: kept
    assert sorted(removed) == sorted([beside[2], beside[3]])
    assert main.exists() and other.exists() and all(p.exists() for p in (beside[0], beside[1], beside[4]))
    assert users.read_text() == '{"lr": 0.1}'


def test_the_bounds_never_remove_a_users_files_named_like_plans(tmp_path, monkeypatch):
    """Issue 33 item 4: a user's JSON named like a cache file, a stale-looking `.NAME.xxxxxxxx.tmp` of theirs and
    their mlp.0123456789ab.json beside mlp.json (not plans) survive pruning; real plan files are pruned."""
    from optsched.plans import cache

    monkeypatch.setenv("OPTSCHED_CACHE_MAX_FILES", "1")
    monkeypatch.setattr(cache, "SHAPES_PER_PATH", 1)
    long_ago = time.time() - 7200
    users = [tmp_path / "0123456789abcdef0123-0123456789ab.json", tmp_path / "mlp.0123456789ab.json",
             tmp_path / ".0123456789abcdef0123-0123456789ab.json.abcd1234.tmp"]
    for p in users:
        p.write_text('{"mine": true}')
        os.utime(p, (long_ago, long_ago))
    main = _plan_like(tmp_path / "mlp.json")
    plans = [_plan_like(tmp_path / f"{i:020x}-{i:012x}.json") for i in range(3)]
    plans += [_plan_like(cache.shape_path(main, f"{i:012x}")) for i in range(3)]
    for i, p in enumerate(plans):
        os.utime(p, (long_ago + i, long_ago + i))
    assert sorted(cache.prune_cache(tmp_path, keep=plans[2])) == sorted(plans[:2])
    assert sorted(cache.prune_shapes(plans[5])) == sorted(plans[3:5])
    assert all(p.read_text() == '{"mine": true}' for p in users)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in [*users, main, plans[2], plans[5]])

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


_KILLED_WRITER = """
import sys, time
import optsched.plans.file_format as ff
ff.os.fsync = lambda fd: (print("writing", flush=True), time.sleep(600))  # killed while writing
ff.write_plan_file(ff.seal({"pad": "x" * 100000}), sys.argv[1])
"""


def _killed_writers(path: Path, n: int) -> None:
    """`n` processes writing `path` at once, killed (SIGKILL) in the middle: each leaves its temporary file
    (one at a time, each writer would remove the one killed before it)."""
    import signal

    procs = []
    for _ in range(n):
        procs.append(subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE,
                                      text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}))
        assert procs[-1].stdout.readline().strip() == "writing"
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()


def test_temporary_files_of_killed_writers_are_removed_at_the_next_write(tmp_path):
    from optsched.plans.file_format import _host, remove_stale_temps

    path = tmp_path / "p.json"
    _killed_writers(path, 3)
    temps = sorted(tmp_path.glob(".p.json.*.tmp"))
    assert len(temps) == 3 and not path.exists()
    host = _host()
    assert all(re.fullmatch(rf"\.p\.json\.optsched\.[0-9]+@{host}\.[a-z0-9_]{{8}}\.tmp", t.name) for t in temps), temps
    live = tmp_path / f".p.json.optsched.{os.getpid()}@{host}.live1234.tmp"  # this process, writing now
    live.write_text("")
    long_ago = time.time() - 7200
    old = tmp_path / ".p.json.optsched.abcd1234.tmp"  # ours without a pid (a long name): stale after an hour
    old.write_text("")
    older = _plan_like(tmp_path / ".p.json.4242@elsewhere.abcd1234.tmp")  # an older optsched's name: ours by content
    users = tmp_path / ".p.json.abcd4321.tmp"  # named alike, but empty: maybe the user's, never removed
    users.write_text("")
    for p in (old, older, users):
        os.utime(p, (long_ago, long_ago))
    fresh = tmp_path / ".p.json.optsched.abcd5678.tmp"  # no pid and new: maybe a live writer's, kept
    fresh.write_text("")
    not_ours = tmp_path / ".q.json.optsched.abcd1234.tmp"  # another file's temporary file: not this write's business
    not_ours.write_text("")
    os.utime(not_ours, (long_ago, long_ago))
    write_plan_file(seal({"x": 1}), path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["p.json", live.name, fresh.name, not_ours.name, users.name]), left
    assert remove_stale_temps(tmp_path, "p.json", max_age_s=0) == 2  # by age alone, live ones go too
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["p.json", not_ours.name, users.name])


def _cache_files(folder: Path, n: int, size: int = 1000) -> list[Path]:
    files = []
    for i in range(n):
        p = _plan_like(folder / f"{i:020x}-{i:012x}.json", size)
        os.utime(p, (1000 + i, 1000 + i))  # older first
        files.append(p)
    return files


def test_the_plan_cache_is_bounded_least_recently_used_first(tmp_path, monkeypatch):
    from optsched.plans import cache
    from optsched.plans.file_format import _host

    monkeypatch.setenv("OPTSCHED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OPTSCHED_CACHE_MAX_FILES", "4")
    files = _cache_files(tmp_path, 6)
    os.utime(files[0], (9000, 9000))  # the oldest file was replayed last
    stranger = tmp_path / "notes.json"  # not a cache file: never removed
    stranger.write_text("{}")
    live = tmp_path / f".{files[1].name}.optsched.{os.getpid()}@{_host()}.abcd1234.tmp"  # this process, writing now
    live.write_text("")
    assert cache.cache_limits() == (4, cache.CACHE_MAX_BYTES)
    removed = cache.prune_cache(keep=files[2])  # just written: kept whatever its age
    assert sorted(removed) == sorted([files[1], files[3]])
    assert all(p.exists() for p in (files[0], files[2], files[4], files[5], stranger, live))

    monkeypatch.setenv("OPTSCHED_CACHE_MAX_FILES", "100")
    monkeypatch.setenv("OPTSCHED_CACHE_MAX_BYTES", "2.5kB")
    assert cache.cache_limits() == (100, 2500)
    assert sorted(cache.prune_cache()) == sorted([files[2], files[4]])  # the two most recently used fit
    assert sorted(p.name for p in tmp_path.glob("0*.json")) == sorted([files[0].name, files[5].name])


def test_a_bad_cache_limit_warns_once_and_the_default_holds(monkeypatch):
    from optsched.plans import cache

    monkeypatch.setattr(cache, "_reported_limits", set())
    monkeypatch.setenv("OPTSCHED_CACHE_MAX_FILES", "many")
    monkeypatch.setenv("OPTSCHED_CACHE_MAX_BYTES", "-1GiB")
    with pytest.warns(optsched.PlanCacheWarning) as caught:
        assert cache.cache_limits() == (cache.CACHE_MAX_FILES, cache.CACHE_MAX_BYTES)
        assert cache.cache_limits() == (cache.CACHE_MAX_FILES, cache.CACHE_MAX_BYTES)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2 and "OPTSCHED_CACHE_MAX_FILES='many'" in texts[0] and "'-1GiB'" in texts[1], texts


def test_saving_into_the_plan_cache_prunes_it_and_replays_touch_their_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTSCHED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OPTSCHED_CACHE_MAX_FILES", "3")
    old = _cache_files(tmp_path, 3)
    _killed_writers(tmp_path / old[0].name, 2)
    model, inputs = _mlp()
    opt = optsched.optimize(model, None, example_inputs=inputs, time_limit_s=2, plan="auto")
    ours = [p for p in tmp_path.glob("*.json") if p not in old]
    assert len(ours) == 1 and sorted(tmp_path.glob("*.json")) == sorted([ours[0], old[1], old[2]])
    assert not list(tmp_path.glob(".*.tmp"))  # the killed writers' temporary files are gone
    os.utime(ours[0], (1, 1))  # as if long unused ...
    again = optsched.optimize(model, None, example_inputs=inputs, time_limit_s=2, plan="auto")
    assert any(n.startswith("loaded from") for n in again.plan.stats.notes)
    assert ours[0].stat().st_mtime > time.time() - 600  # ... until replayed now
    assert opt.plan is not None


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
    "made_for.grads_at_start", "summary.grads_at_start",  # written since issue 24 (accumulation)
    "summary.updates_in_backward", "made_for.optimizer",  # written since issue 36 (the optimizer's update planned)
    "timeline.unplanned_steps_per_point", "timeline.unplanned_n_steps", "timeline.unplanned_n_forward_steps",
}
NAME_KEYED = {"costs", "decisions.offload"}  # objects keyed by op or tensor names, not by field names
ROWS = r'fingerprint\.nodes\[0\]|costs\["[^"]*"\](\[2\]\[0\])?'  # lists with a meaning per item: every item checked


@pytest.fixture(scope="module")
def full_plan(tmp_path_factory):
    """A real plan file with every section filled: offloads and recomputations (an offline H100 plan),
    a percentage budget (its reference recorded)."""
    # activations well above an H100 step's two 32 MiB cuBLAS workspaces, so that 60% is a budget
    cfg = gpt.GPTConfig(n_layer=4, n_embd=256)
    plan = optsched.plan_offline(lambda: gpt.build(cfg), lambda: gpt.make_batch(cfg, batch_size=16), "60%",
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


@pytest.mark.xdist_group("plan-files-full")
def test_a_plan_file_round_trips_unchanged_through_the_typed_check(full_plan, tmp_path):
    path, data = full_plan
    assert optsched.load_plan(path).data == data
    assert optsched.load_plan(_resealed(data, tmp_path / "again.json")).data == data


@pytest.mark.xdist_group("plan-files-full")
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


@pytest.mark.xdist_group("plan-files-full")
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


@pytest.mark.xdist_group("plan-files-full")
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


class _WithUnusedState(torch.nn.Module):
    """Two layers the program runs and one it never reads (a pooler or head left out of this task): its 1 MiB is on
    the device all step, and each plan counts it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256), torch.nn.Linear(512, 512)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_plan_counting_state_the_program_does_not_read_is_replayed_from_its_file(tmp_path):
    """The replay rebuilds the problem with the module's unread state, as the plan was made: the same peak, loaded
    from the file (without it the replay's peak was 1 MiB lower than the file's, and the file was refused)."""
    path = tmp_path / "plan.json"
    x = torch.randn(2048, 256)
    plans = []
    for _ in range(2):
        torch.manual_seed(0)
        om = optsched.optimize(_WithUnusedState(), "90%", plan=path, time_limit_s=1, device_profile="cpu")
        om(x).square().mean().backward()
        plans.append(om.plan)
    made, replayed = plans
    assert any("module state the program does not read" in t.name for t in made.problem.tensors)
    assert any(n.startswith("loaded from") for n in replayed.stats.notes)
    assert replayed.predicted_peak_bytes == made.predicted_peak_bytes
