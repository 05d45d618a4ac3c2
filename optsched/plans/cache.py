"""Where plan files go: the plan cache's folder and its file names, where a plan can be written
(probed before anything is planned), and saves that warn instead of failing the step.

A plan must never cost the step it was made for: where a plan cannot be written is found
before solving (`check_writable`, `check_plan_option`), and a save that fails anyway (disk
full, permissions changed meanwhile) is a warning (`save_or_warn`), never an error.

One plan file per shape: `plan=PATH` keeps the plan of the first graph planned for it at PATH and
the plans of the same step at other shapes (a smaller last batch, another sequence length: the same
ops, other sizes) beside it, named by the graph's fingerprint (`shape_path`: `gpt.json`,
`gpt.3f9a0c12d4e5.json`); `find_plan_file` picks the one made for the graph at hand. A graph with
other ops is not another shape: PATH's plan does not match it (the planner's PlanMismatchError names
the first node that differs). At most SHAPES_PER_PATH files are kept beside a path (`prune_shapes`).

The plan cache is bounded (`prune_cache`, after each save into it): at most CACHE_MAX_FILES files
and CACHE_MAX_BYTES bytes ($OPTSCHED_CACHE_MAX_FILES, $OPTSCHED_CACHE_MAX_BYTES), the least recently
used (written or replayed: a replay touches its file) removed first. Temporary files of killed
writers are removed there too (`file_format.remove_stale_temps`); a live writer's never.

Both bounds remove only what optsched wrote: a file named like a plan (`<20 hex>-<12 hex>.json` in the
cache, `gpt.<12 hex>.json` beside gpt.json) that does not begin as a plan file does (`is_plan_file`) is a
user's: it is never removed and does not count towards the bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import platformdirs

from .file_format import (
    STALE_TEMP_S,
    PlanCacheWarning,
    PlanFile,
    PlanFileError,
    PlanFileWarning,
    is_plan_file,
    load_plan,
    remove_stale_temps,
)

CACHE_MAX_FILES = 500  # plan files the plan cache keeps ($OPTSCHED_CACHE_MAX_FILES)
CACHE_MAX_BYTES = 2**30  # and bytes (1 GiB; $OPTSCHED_CACHE_MAX_BYTES: bytes, or a size such as 2GiB or 500MB)
SHAPES_PER_PATH = 64  # plan files for other shapes beside one plan=PATH (gpt.<fingerprint>.json)
PROBE_PREFIX = ".optsched-probe-"
_CACHE_NAME = re.compile(r"[0-9a-f]{20}-[0-9a-f]{12}\.json")  # plan_path's names for "auto"


def plan_path(spec: str | None, fingerprint_hash: str, made_for: dict) -> Path | None:
    """The plan file for optimize()'s `plan` option: None (no file), a path, or "auto": a file in the
    plan cache named by the graph's fingerprint and a hash of everything the plan was made for."""
    if spec is None:
        return None
    if spec != "auto":
        return Path(spec)
    key = hashlib.sha256(json.dumps(made_for, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"{fingerprint_hash[:20]}-{key}.json"


def shape_path(path: str | os.PathLike, fingerprint_hash: str) -> Path:
    """Where `plan=path` keeps the plan of a graph other than the one at `path`: beside it, with the
    graph's fingerprint (12 hex digits) before the suffix: gpt.json -> gpt.3f9a0c12d4e5.json."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{fingerprint_hash[:12]}{path.suffix}")


def accumulation_path(path: str | os.PathLike) -> Path:
    """Where `plan=path` keeps the plans of steps that start with gradients to accumulate into (the same
    graphs as at `path`, planned with a second set of gradients live): gpt.json -> gpt.accumulate.json, and
    its other shapes beside that (`shape_path`)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.accumulate{path.suffix}")


def _shape_pattern(path: Path) -> re.Pattern:
    return re.compile(rf"{re.escape(path.stem)}\.[0-9a-f]{{12}}{re.escape(path.suffix)}")


def find_plan_file(path: Path, fingerprint: dict, *, cached: bool = False) -> tuple[Path, PlanFile | None]:
    """The plan file for the graph with this fingerprint, and where its plan is (or is to be) written.

    `cached` (plan="auto": `path` is already named by the fingerprint and settings): `path`, loaded if it
    exists. Otherwise `path` when it holds this graph's plan or does not exist yet; else the file beside it
    for this graph (`shape_path`), loaded if it exists; else, when `path` holds the same step at other
    shapes (`same_structure`), that file beside it, to be written. A graph with other ops gets `path` and
    its file: the caller names the difference (PlanMismatchError), or replans over it. A file that cannot
    be read is a PlanFileError. A replayed file is touched: what was used last is pruned last."""
    if cached or not path.exists():
        pf = load_plan(path) if path.exists() else None
        if pf is not None and cached:
            _touch(path)
        return path, pf
    pf = load_plan(path)
    if pf.fingerprint["hash"] == fingerprint["hash"]:
        return path, pf
    beside = shape_path(path, fingerprint["hash"])
    if beside.exists():
        _touch(beside)
        return beside, load_plan(beside)
    if same_structure(pf.fingerprint["nodes"], fingerprint["nodes"]):
        return beside, None
    return path, pf


def same_structure(planned: list, current: list) -> bool:
    """Whether two fingerprints' node lists ([name, target, shape, dtype] each) are one step at other shapes:
    the same nodes, ops and dtypes in the same order, only shapes differing (a smaller batch, another
    sequence length; a wider layer too). Another op anywhere (another attention kernel, a layer more or
    less, forward-only against training) is another graph."""
    return len(planned) == len(current) and all(
        a[0] == b[0] and a[1] == b[1] and a[3] == b[3] for a, b in zip(planned, current)
    )


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only place: plans there are replayed, never pruned by us
        pass


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


_reported_limits: set[str] = set()


def cache_limits() -> tuple[int, int]:
    """(files, bytes) the plan cache keeps: $OPTSCHED_CACHE_MAX_FILES and $OPTSCHED_CACHE_MAX_BYTES, else
    CACHE_MAX_FILES and CACHE_MAX_BYTES. A value that is not a positive number warns once and the default holds."""
    out = []
    for var, default, parse, example in (("OPTSCHED_CACHE_MAX_FILES", CACHE_MAX_FILES, int, "500"),
                                         ("OPTSCHED_CACHE_MAX_BYTES", CACHE_MAX_BYTES, _parse_size, "2GiB")):
        text = os.environ.get(var, "").strip()
        value = default
        if text:
            try:
                value = parse(text)
                if value <= 0:
                    raise ValueError(text)
            except ValueError:
                value = default
                if var not in _reported_limits:
                    _reported_limits.add(var)
                    warnings.warn(PlanCacheWarning(
                        f"{var}={text!r} is not a positive number (e.g. {example}); the plan cache keeps its default"
                    ), stacklevel=3)
        out.append(value)
    return out[0], out[1]


def _prune(folder: Path, pattern: re.Pattern, max_files: int, max_bytes: int | None, keep: Path | None) -> list[Path]:
    """Remove the least recently used (oldest mtime) plan files of `folder` whose names match `pattern` until at
    most `max_files` of them, `max_bytes` in all, remain. `keep` (the file just written) stays. Only whole
    plan files are removed (a writer's temporary file has another name); a file named alike that is not a plan
    file (`is_plan_file`: a user's) is neither counted nor removed; what cannot be removed is left."""
    files = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        if not pattern.fullmatch(entry.name):
            continue
        try:
            if entry.is_file(follow_symlinks=False) and is_plan_file(entry.path):
                st = entry.stat(follow_symlinks=False)
                files.append((st.st_mtime, st.st_size, Path(entry.path)))
        except OSError:
            continue
    files.sort(key=lambda f: (f[2] != keep, -f[0]))  # the file just written first, then most recently used
    removed, count, total = [], 0, 0
    for _mtime, size, path in files:
        count, total = count + 1, total + size
        if path == keep or (count <= max_files and (max_bytes is None or total <= max_bytes)):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
        count, total = count - 1, total - size
    return removed


def prune_cache(folder: Path | None = None, keep: Path | None = None) -> list[Path]:
    """Bound the plan cache (see the module docstring): stale temporary files and probes of killed
    processes removed, then the least recently used plan files beyond the limits. Returns the plan files removed."""
    folder = cache_dir() if folder is None else Path(folder)
    remove_stale_temps(folder, _CACHE_NAME)
    _remove_stale_probes(folder)
    max_files, max_bytes = cache_limits()
    return _prune(folder, _CACHE_NAME, max_files, max_bytes, keep)


def prune_shapes(path: Path) -> list[Path]:
    """At most SHAPES_PER_PATH plan files beside `plan=PATH` (for its step's other shapes), the least recently used
    removed first; `path` may be PATH or one of them (just written: kept). Stale temporary files of their writers too."""
    main = _main_of(path)
    pattern = _shape_pattern(main)
    remove_stale_temps(path.parent, re.compile(f"{re.escape(main.name)}|{pattern.pattern}"))
    return _prune(path.parent, pattern, SHAPES_PER_PATH, None, path if pattern.fullmatch(path.name) else None)


def _main_of(path: Path) -> Path:
    """PATH for a file beside it (gpt.3f9a0c12d4e5.json -> gpt.json); else `path` itself."""
    m = re.fullmatch(r"(.*)\.[0-9a-f]{12}", path.stem)
    return path.with_name(m.group(1) + path.suffix) if m and m.group(1) else path


def _remove_stale_probes(folder: Path) -> None:
    """check_writable's probe files that a killed process left (older than an hour)."""
    now = time.time()
    try:
        entries = [e for e in os.scandir(folder) if e.name.startswith(PROBE_PREFIX)]
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
                os.unlink(entry.path)
        except OSError:
            continue


def cache_dir() -> Path:
    """Where optimize(plan="auto") keeps plans: $OPTSCHED_CACHE_DIR, else the user's cache folder as
    platformdirs names it (~/.cache/optsched/plans on Linux, $XDG_CACHE_HOME respected)."""
    if os.environ.get("OPTSCHED_CACHE_DIR"):
        return Path(os.environ["OPTSCHED_CACHE_DIR"])
    return Path(platformdirs.user_cache_dir("optsched", appauthor=False)) / "plans"


def check_writable(path: str | os.PathLike) -> str | None:
    """None if a plan file can be written at `path`, else why not (one line).

    Probes the file system rather than the permission bits (which say nothing for root or on
    a read-only mount): a temporary file in the folder when it exists, else a temporary
    folder in its nearest existing ancestor (what creating the missing folders needs). The
    probes are removed; nothing else is created.
    """
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder"
    folder = path.parent
    ancestor = folder
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        if ancestor == folder:
            return f"{folder} is a file, not a folder"
        return f"{ancestor} is a file, so the folder {folder} cannot be created"
    try:
        if ancestor == folder:
            fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=folder)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=ancestor))
    except OSError as e:
        what = f"the folder {folder}" if ancestor == folder else f"{ancestor} (to create {folder} in it)"
        return f"cannot write in {what}: {e.strerror or e}"
    return None


_reported_caches: set[str] = set()


def _warn_cache(folder: Path, reason: str, stacklevel: int) -> None:
    """One PlanCacheWarning per cache folder and process: a training script that optimizes many
    functions (or recompiles) hears about it once. `stacklevel` as for a warn() in the caller."""
    if str(folder) in _reported_caches:
        return
    _reported_caches.add(str(folder))
    warnings.warn(PlanCacheWarning(
        f"the plan cache {folder} cannot be written ({reason}): plans are solved but not cached. "
        "Set OPTSCHED_CACHE_DIR to a writable folder, or pass plan=None"
    ), stacklevel=stacklevel + 1)


def check_plan_option(plan: str | os.PathLike | None, stacklevel: int = 2) -> None:
    """optimize()'s `plan` argument, checked when optimize() is called (nothing planned yet).
    `stacklevel` (of the warning) as for a warn() in the caller.

    "auto" with a cache folder that cannot be written: a PlanCacheWarning, and planning goes on
    (plans already in the cache are still used). A path whose plan file does not exist and
    cannot be written there: PlanFileError. An existing file is left to be read (it may be
    replayed from a read-only place); should it need rewriting and that fail, saving warns.
    """
    if plan is None:
        return
    if plan == "auto":
        folder = cache_dir()
        reason = check_writable(folder / "probe.json")
        if reason is not None:
            _warn_cache(folder, reason, stacklevel)
        return
    path = Path(plan)
    if path.is_dir():
        raise PlanFileError(f"plan={str(plan)!r} is a folder; pass a file path such as {str(path / 'plan.json')!r}")
    if not path.exists():
        reason = check_writable(path)
        if reason is not None:
            raise PlanFileError(f"cannot write plan file {path}: {reason}")


def save_or_warn(save: Callable[[Path], Path], path: Path, *, cached: bool) -> Path | None:
    """`save(path)`, or a warning if the file system refuses it: the plan was made, the step runs.

    `cached`: the path is in the plan cache (a PlanCacheWarning, once per folder). After a save the cache
    is pruned to its bounds (`prune_cache`), or the files beside a plan=PATH to theirs (`prune_shapes`)."""
    try:
        saved = save(path)
        if cached:
            prune_cache(path.parent, keep=path)
        else:
            prune_shapes(path)
        return saved
    except OSError as e:
        reason = f"{type(e).__name__}: {e.strerror or e}"
        if cached:
            _warn_cache(path.parent, reason, 2)
        else:
            warnings.warn(PlanFileWarning(
                f"could not save the plan to {path} ({reason}); the step runs with it, but it is not kept"
            ), stacklevel=2)
        return None
