"""Where plan files go: the plan cache's folder and its file names, where a plan can be written
(probed before anything is planned), and saves that warn instead of failing the step.

A plan must never cost the step it was made for: where a plan cannot be written is found
before solving (`check_writable`, `check_plan_option`), and a save that fails anyway (disk
full, permissions changed meanwhile) is a warning (`save_or_warn`), never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import platformdirs

from .file_format import PlanCacheWarning, PlanFileError, PlanFileWarning


def plan_path(spec: str | None, fingerprint_hash: str, made_for: dict) -> Path | None:
    """The plan file for optimize()'s `plan` option: None (no file), a path, or "auto": a file in the
    plan cache named by the graph's fingerprint and a hash of everything the plan was made for."""
    if spec is None:
        return None
    if spec != "auto":
        return Path(spec)
    key = hashlib.sha256(json.dumps(made_for, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"{fingerprint_hash[:20]}-{key}.json"


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
            fd, probe = tempfile.mkstemp(prefix=".optsched-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".optsched-probe-", dir=ancestor))
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

    `cached`: the path is in the plan cache (a PlanCacheWarning, once per folder)."""
    try:
        return save(path)
    except OSError as e:
        reason = f"{type(e).__name__}: {e.strerror or e}"
        if cached:
            _warn_cache(path.parent, reason, 2)
        else:
            warnings.warn(PlanFileWarning(
                f"could not save the plan to {path} ({reason}); the step runs with it, but it is not kept"
            ), stacklevel=2)
        return None
