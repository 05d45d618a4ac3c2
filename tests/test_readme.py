"""README.md is for users: short, its API line the real signature, its links present; docs/api.md is the full
reference, its argument headings the real parameters. Its benchmark tables and every other (docs/benchmarks.md) are
rendered from the benchmarks' JSON and checked by tests/test_report.py."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
API = (ROOT / "docs" / "api.md").read_text()


def test_readme_is_under_300_lines_with_the_headline_the_tight_budget_summary_and_the_first_gpu_run():
    """The headline, the tight-budget runs side by side (issue 25 asks for them in the README) and the first GPU
    run; every other table is in docs/benchmarks.md. Its first screen says what a GPU has and has not shown."""
    assert len(README.splitlines()) < 300
    assert re.findall(r"<!-- bench:(\w+) -->", README) == ["headline", "tight_summary", "gpu"]
    assert "gpu_rerun" in re.findall(r"<!-- bench:(\w+) -->", (ROOT / "docs" / "benchmarks.md").read_text())
    first_screen = "\n".join(README.splitlines()[:20])
    assert "On a GPU" in first_screen and "Not shown yet" in first_screen
    assert "docs/benchmarks.md" in README and "make demo" in README and "make test" in README


def test_the_api_line_is_optimizes_signature():
    import optsched

    line = next(ln for ln in README.splitlines() if ln.startswith("`optsched.optimize("))
    sig = inspect.signature(optsched.optimize)
    params = []
    for name, p in sig.parameters.items():
        if p.kind is p.KEYWORD_ONLY and "*" not in params:
            params.append("*")
        params.append(name if p.default is p.empty else f"{name}={p.default!r}".replace("'", '"'))
    assert line == f"`optsched.optimize({', '.join(params)})`"
    assert line in API


def _declared(p: inspect.Parameter) -> str:
    """A parameter as optsched/api.py declares it: `name: type = default` (the annotation is the source's text)."""
    text = f"{p.name}: {p.annotation}"
    return text if p.default is p.empty else f"{text} = {p.default!r}".replace("'", '"')


def test_api_md_has_a_heading_for_every_argument_as_declared():
    """docs/api.md's "Arguments" has one `### `name: type = default`` per parameter of optimize, in order, so a
    parameter added, renamed, retyped or given another default fails here until the reference says so."""
    import optsched

    assert "\n## Arguments\n" in API, "docs/api.md has no Arguments section"
    arguments = API.split("\n## Arguments\n", 1)[1].split("\n## ", 1)[0]
    headings = re.findall(r"^### `(.*)`$", arguments, re.M)
    assert headings == [_declared(p) for p in inspect.signature(optsched.optimize).parameters.values()]
    for key in optsched.SUMMARY_KEYS:  # the plan's summary() keys, each named
        assert f"`{key}`" in API, key


def test_the_links_and_names_it_gives_exist():
    import optsched

    for link in re.findall(r"\]\(([^)#]+)", README):
        assert (ROOT / link).exists(), link
    for name in ("BudgetInfeasibleError", "PlanningTimeLimitError", "CaptureError", "PlanMismatchError", "PlanFileError",
                 "SUMMARY_KEYS", "load_plan", "plan_offline"):
        assert f"optsched.{name}" in README or f"`{name}`" in README, name
        assert getattr(optsched, name) is not None
    import optsched.distributed

    assert callable(optsched.distributed.optimize_fsdp) and callable(optsched.distributed.plan_digest)


def test_the_first_example_runs_as_pasted(tmp_path):
    """The README's first code block, run as a user pastes it: a fresh interpreter, outside the repository, nothing
    defined beforehand (it once used a model, x and y it never defined). It trains three steps and prints the plan."""
    import subprocess
    import sys

    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    plan, summary = run.stdout.splitlines()[-2:]
    assert plan.startswith("Plan(training, peak ") and "predicted_peak_bytes" in summary
