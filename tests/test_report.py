"""benchmarks.report: every table in README.md, docs/benchmarks.md and docs/distributed.md is rendered from its
JSON with the commit it was measured at, and `python -m benchmarks.report --check` fails, naming the table,
when a table is not its JSON's, a JSON lacks its commit, or a notebook did not read the current JSON.

The check's behaviour is tested on a copy of the repository's documents and results with a made-up `meta` (a
temporary folder). The check of the repository itself is marked `stale_results`: the committed JSONs were
written before benchmarks/meta.py recorded commits, so it fails until `make bench` writes them again; the
default run deselects it (pyproject.toml), `pytest -m stale_results tests/test_report.py` runs it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from benchmarks import meta, report, write_result

ROOT = Path(__file__).resolve().parents[1]
FAKE_META = {"commit": "0123456789abcdef0123456789abcdef01234567", "short": "0123456", "clean": True, "dirty_files": [],
             "date": "2026-01-02T03:04:05", "torch": "2.13.0+cpu", "python": "3.11", "command": "python -m benchmarks.x",
             "wall_s": 60.0}


def _executed(path: Path, lines: list[str]) -> None:
    """Give the notebook at `path` a first-cell output holding `lines`, as an execution that printed them would."""
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="size full\n" + "".join(f"{x}\n" for x in lines))]
    nbformat.write(nb, path)


def _set_meta(results: Path, name: str, value: dict | None) -> None:
    path = results / name
    d = json.loads(path.read_text())
    d.pop("meta", None)
    if value is not None:
        d = {"meta": value, **d}
    path.write_text(json.dumps(d, indent=2))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the documents, notebooks and results, every JSON with a `meta`, tables rendered, notebooks 'run'."""
    for target in report.TARGETS:
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / target, tmp_path / target)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name in {f for f, _ in report.TABLES.values() if f}:
        shutil.copy(ROOT / "benchmarks" / "results" / name, results / name)
        _set_meta(results, name, FAKE_META)
    (tmp_path / "notebooks").mkdir()
    for nb, jsons in report.NOTEBOOK_JSONS.items():
        shutil.copy(ROOT / "notebooks" / nb, tmp_path / "notebooks" / nb)
        _executed(tmp_path / "notebooks" / nb, [meta.describe(results / j) for j in jsons])
    assert report.main(["--root", str(tmp_path)]) == 0
    return tmp_path


def test_every_table_names_its_commit_and_a_consistent_copy_passes(repo, capsys):
    assert report.check(repo) == []
    assert report.main(["--check", "--root", str(repo)]) == 0
    assert "every table" in capsys.readouterr().out
    docs = (repo / "docs" / "benchmarks.md").read_text()
    for key, (fname, _) in report.TABLES.items():
        if fname:  # every JSON-backed table opens with its commit line
            assert f"<!-- bench:{key} -->\n*Measured at commit 0123456 (clean), 2026-01-02 (`benchmarks/results/{fname}`)" in (
                docs + (repo / "README.md").read_text()), key
    assert "| gpt_budget.json | `python -m benchmarks.x` | commit 0123456 (clean), 2026-01-02 | 1.0 min |" in docs


def test_a_tampered_table_fails_naming_it(repo, capsys):
    path = repo / "docs" / "benchmarks.md"
    text = path.read_text()
    start = text.index("<!-- bench:zoo -->")
    row = text.index("| GPT-2 | labels |", start)
    path.write_text(text[:row] + text[row:].replace("| GPT-2 | labels |", "| GPT-2 | labels (typed by hand) |", 1))
    problems = report.check(repo)
    assert problems == ["docs/benchmarks.md, table 'zoo': differs from benchmarks/results/zoo.json (run `python -m benchmarks.report`)"]
    assert report.main(["--check", "--root", str(repo)]) == 1
    assert "table 'zoo'" in capsys.readouterr().out
    assert report.main(["--root", str(repo)]) == 0 and report.check(repo) == []  # rendering again repairs it


def test_a_json_without_its_commit_fails(repo):
    results = repo / "benchmarks" / "results"
    _set_meta(results, "offload.json", None)
    report.main(["--root", str(repo)])  # the table is its JSON's again (an unrecorded commit): only the commit is missing
    problems = report.check(repo)
    assert problems == ["docs/benchmarks.md, table 'offload': benchmarks/results/offload.json: no meta.commit "
                        "(written before benchmarks/meta.py: run its benchmark again)"]
    assert "*Measured at an unrecorded commit (`benchmarks/results/offload.json`).*" in (repo / "docs" / "benchmarks.md").read_text()
    _set_meta(results, "offload.json", {**FAKE_META, "clean": None})
    report.main(["--root", str(repo)])
    assert report.check(repo) == ["docs/benchmarks.md, table 'offload': benchmarks/results/offload.json: meta.clean not recorded"]


def test_a_headline_json_rewritten_fails_the_readme_and_the_notebook_until_both_are_regenerated(repo):
    results = repo / "benchmarks" / "results"
    _set_meta(results, "gpt_budget.json", {**FAKE_META, "commit": "f" * 40, "short": "fffffff", "clean": False,
                                           "dirty_files": ["optsched/api.py"]})
    problems = report.check(repo)
    assert {p.split(":")[0] for p in problems} == {"README.md, table 'headline'", "docs/benchmarks.md, table 'gpt'",
                                                   "docs/benchmarks.md, table 'durations'", "notebooks/2_gpt.ipynb"}
    report.main(["--root", str(repo)])
    assert "*Measured at commit fffffff (dirty: optsched/api.py), 2026-01-02" in (repo / "README.md").read_text()
    assert [p.split(":")[0] for p in report.check(repo)] == ["notebooks/2_gpt.ipynb"]
    _executed(repo / "notebooks" / "2_gpt.ipynb", [meta.describe(results / "gpt_budget.json")])
    assert report.check(repo) == []


def test_a_run_without_a_commit_and_an_unknown_table_fail(repo):
    results = repo / "benchmarks" / "results"
    d = json.loads((results / "tight_budgets.json").read_text())
    for run in d["runs"].values():
        run.pop("git", None)
        run.pop("meta", None)
        for part in ("gpt", "zoo"):
            run.get(part, {}).pop("git", None)
    (results / "tight_budgets.json").write_text(json.dumps(d))
    report.main(["--root", str(repo)])
    # both tables rendered from it: the full one in docs/benchmarks.md and the README's summary
    assert sorted(report.check(repo)) == sorted(f"{where}, table '{table}': benchmarks/results/tight_budgets.json: "
                                               f"run {k!r} has no commit" for k in d["runs"]
                                               for where, table in (("docs/benchmarks.md", "tight"),
                                                                    ("README.md", "tight_summary")))
    readme = repo / "README.md"
    readme.write_text(readme.read_text() + "\n<!-- bench:nonesuch -->\n<!-- /bench:nonesuch -->\n")
    assert any("table 'nonesuch': unknown table" in p for p in report.check(repo))


def test_write_result_records_the_run(tmp_path):
    path = tmp_path / "x.json"
    write_result(path, {"efficient": {"eager_bytes": 1}})
    d = json.loads(path.read_text())
    assert list(d) == ["meta", "efficient"]
    m = d["meta"]
    assert {"commit", "short", "clean", "dirty_files", "date", "torch", "python", "command", "wall_s"} <= m.keys()
    assert m["torch"] and m["wall_s"] >= 0
    assert report._rows_by_name(d) == [("efficient", {"eager_bytes": 1})]  # tables keyed by name skip it


def test_clean_ignores_what_make_bench_rewrites(tmp_path):
    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *a], check=True,
                       capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for f in ("README.md", "benchmarks/results/zoo.json", "code.py"):
        (tmp_path / f).write_text("1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    state = meta.git_tree(tmp_path)
    assert state["clean"] is True and len(state["commit"]) == 40 and state["short"] == state["commit"][:7]
    (tmp_path / "README.md").write_text("2\n")
    (tmp_path / "benchmarks" / "results" / "zoo.json").write_text("2\n")
    (tmp_path / "untracked.py").write_text("2\n")
    assert meta.git_tree(tmp_path)["clean"] is True
    (tmp_path / "code.py").write_text("2\n")
    assert meta.git_tree(tmp_path) | {"commit": None} == {"commit": None, "short": state["short"], "clean": False,
                                                          "dirty_files": ["code.py"]}
    assert meta.commit_line({**FAKE_META, "clean": False, "dirty_files": ["code.py"]}) == \
        "measured at commit 0123456 (dirty: code.py), 2026-01-02"
    assert meta.git_tree(tmp_path / "not-a-repo")["commit"] is None


def test_each_json_records_the_machine_and_the_planning_table_shows_it():
    m = meta.run_meta()["machine"]
    assert isinstance(m["cpu"], str) and m["cpu"] and m["cpus"] >= 1 and 0 < m["probe_s"] < 60
    d = json.loads((ROOT / "benchmarks" / "results" / "planning_time.json").read_text())
    d["meta"] = {**d["meta"], "machine": {"cpu": "Some CPU", "cpus": 2, "probe_s": 0.321}}
    assert "Machine: Some CPU, 2 CPUs, CPU probe 0.321 s" in report.planning_time_table(d)


def test_zoo_table_labels_first_call_and_solver_seconds():
    d = json.loads((ROOT / "benchmarks" / "results" / "zoo.json").read_text())
    table = report.zoo_table(d)
    assert "first call s (solver s)" in table and "| plan s |" not in table
    r = next(r for r in d["cases"][0]["budgets"] if "plan_s" in r)
    assert f"{r['first_call_s']:.1f} ({r['plan_s']:.1f})" in table


@pytest.mark.stale_results
def test_the_repository_tables_are_current_with_their_commits():
    """Fails until `make bench` has written every JSON with its `meta` (see the module docstring)."""
    problems = report.check()
    assert not problems, "\n".join(problems)
