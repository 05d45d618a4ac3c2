"""What every benchmark JSON records about the run that wrote it, under its top-level ``meta`` key.

    {"meta": {"commit": "<40 hex>", "short": "<7 hex>", "clean": true, "dirty_files": [],
              "date": "2026-11-26T07:49:50", "torch": "2.13.0+cpu", "python": "3.12.3",
              "command": "python -m benchmarks.zoo", "wall_s": 1531.4,
              "machine": {"cpu": "AMD EPYC", "cpus": 2, "probe_s": 0.372}}}

``clean`` is whether the tracked files (``git status --porcelain``, untracked files left out) matched the
commit, apart from what the benchmark pipeline itself rewrites (``OUTPUTS``: the results, the README, the
docs' tables and the notebooks), so that a run of ``make bench`` does not call its own later benchmarks
dirty. ``dirty_files`` lists the others. ``wall_s`` is the seconds from the import of ``benchmarks`` (the
start of ``python -m benchmarks.<name>``) to the write. ``machine``: the CPU's model name, its logical CPUs, and
``probe_s``, the best of three timings of one fixed pure-Python loop (`cpu_probe`): the deterministic clock's
units are seconds of the reference machine, so a plan's wall seconds scale with this (two runs' ratio).
``benchmarks.report`` prints the commit line of each table from it, and ``python -m benchmarks.report --check``
fails on a JSON without a commit.
"""

from __future__ import annotations

import datetime
import fnmatch
import functools
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what `make bench` rewrites: a change to these is the pipeline's own output, not a change to what is measured
OUTPUTS = ("benchmarks/results/*.json", "README.md", "docs/benchmarks.md", "docs/distributed.md", "notebooks/*.ipynb")
_STARTED = time.monotonic()


def mark_start() -> None:
    """Restart the clock ``wall_s`` counts from (``benchmarks`` sets it at import)."""
    global _STARTED
    _STARTED = time.monotonic()


def git_tree(root: Path = ROOT) -> dict:
    """``commit``, ``short``, ``clean`` and ``dirty_files`` of the checkout at ``root`` (None where git fails)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=30, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        return {"commit": None, "short": None, "clean": None, "dirty_files": [], "git_error": f"{type(e).__name__}: {e}"[:300]}
    # porcelain v1: "XY path" or "XY old -> new"
    changed = [line[3:].split(" -> ")[-1].strip().strip('"') for line in status if len(line) > 3]
    dirty = [f for f in changed if not any(fnmatch.fnmatchcase(f, pattern) for pattern in OUTPUTS)]
    return {"commit": commit, "short": commit[:7], "clean": not dirty, "dirty_files": dirty[:50]}


PROBE_N = 3_000_000  # the probe's loop length: about 0.2-0.4 s of one core


def cpu_probe() -> float:
    """Best of three timings of a fixed pure-Python loop, in seconds (lower: a faster core)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        sum(i * i for i in range(PROBE_N))
        best = min(best, time.perf_counter() - t0)
    return round(best, 3)


@functools.cache
def machine() -> dict:
    """The CPU model (from /proc/cpuinfo where there is one), logical CPUs and `cpu_probe`, once per process (a
    benchmark writes its JSON after every case)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "probe_s": cpu_probe()}


def run_meta() -> dict:
    """The ``meta`` of a JSON written now."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # a benchmark without torch (none yet)
        torch_version = None
    argv = sys.argv[:]
    if argv and argv[0].endswith(".py") and "benchmarks" in argv[0]:
        argv[0] = "python -m benchmarks." + Path(argv[0]).stem
    return {**git_tree(), "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch_version,
            "python": platform.python_version(), "command": " ".join(argv), "wall_s": round(time.monotonic() - _STARTED, 1),
            "machine": machine()}


def with_meta(data: dict) -> dict:
    """``data`` with ``meta`` (first key) set to this run's."""
    if not isinstance(data, dict):
        raise TypeError(f"a benchmark JSON is an object, got {type(data).__name__}")
    return {"meta": run_meta(), **{k: v for k, v in data.items() if k != "meta"}}


def commit_line(meta: dict | None) -> str:
    """'measured at commit abc1234 (clean), 2026-11-26' (what ``benchmarks.report`` prints above a table)."""
    if not meta or not meta.get("commit"):
        return "measured at an unrecorded commit"
    state = {True: "clean", False: "dirty"}.get(meta.get("clean"), "tree state not recorded")
    if meta.get("clean") is False and meta.get("dirty_files"):
        state += ": " + ", ".join(meta["dirty_files"][:5]) + (" ..." if len(meta["dirty_files"]) > 5 else "")
    date = (meta.get("date") or "")[:10]
    return f"measured at commit {meta.get('short') or meta['commit'][:7]} ({state})" + (f", {date}" if date else "")


def describe(path: Path | str) -> str:
    """'<file name>: measured at commit ...' for a results JSON (the line notebooks print for each JSON they read)."""
    import json

    path = Path(path)
    meta = json.loads(path.read_text()).get("meta")
    return f"{path.name}: {commit_line(meta)}"
