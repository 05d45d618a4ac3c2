"""Plans as files: solve once, run many times, on other machines.

A plan file is JSON: a schema version, what the plan decided (order, fusion groups,
recomputations, offloads), what it was made for (graph fingerprint, budget, device
profile, executor, per-op costs), what it predicts (summary, timeline) and how the
solver did. A checksum over the content turns corruption and hand edits into a clear
error instead of a wrong program. Writes are atomic (a temporary file, then a rename).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "optsched.plan"
SCHEMA_VERSION = 1
TIMELINE_POINTS = 4000  # longer timelines are kept at their per-chunk maxima


class PlanFileError(ValueError):
    """A plan file that cannot be used: unreadable, corrupted, edited, or from another schema."""


class PlanMismatchError(ValueError):
    """A valid plan file made for another graph, budget, profile or executor."""


class PlanFileWarning(UserWarning):
    """A plan could not be saved: the step runs with it, but it is not kept for later runs."""


class PlanCacheWarning(PlanFileWarning):
    """The plan cache (optimize(plan="auto")) cannot be written: plans are not cached, planning goes on."""


@dataclass
class PlanFile:
    """A loaded plan file: `data` is the validated JSON."""

    path: Path | None
    data: dict[str, Any]

    @property
    def summary(self) -> dict:
        return self.data["summary"]

    @property
    def fingerprint(self) -> dict:
        return self.data["fingerprint"]

    def describe_mismatch(self, fingerprint: dict, **wanted: Any) -> str | None:
        """What differs between this plan and the graph (and settings) at hand, or None."""
        problems = []
        for key, value in wanted.items():
            have = self.data["made_for"].get(key, _MADE_FOR_BEFORE.get(key))
            if have != value:
                problems.append(f"{key}: the plan has {have!r}, this run wants {value!r}")
        mine, theirs = self.fingerprint, fingerprint
        if mine["hash"] != theirs["hash"]:
            problems.append(_node_difference(mine["nodes"], theirs["nodes"]))
        return "; ".join(problems) if problems else None


# made_for fields files written before them lack, as those files were made: a percentage budget was
# then always a share of the program's own unplanned peak
_MADE_FOR_BEFORE = {"budget_from": "this program"}


def _node_difference(planned: list, current: list) -> str:
    for i, (a, b) in enumerate(zip(planned, current)):
        if a != b:
            return f"graph node {i} differs: the plan has {_fmt(a)}, the graph now has {_fmt(b)}"
    if len(planned) != len(current):
        return f"the plan's graph has {len(planned)} nodes, the graph now has {len(current)}"
    return "the graph differs in a detail the node list does not show (argument structure)"


def _fmt(sig: list) -> str:
    name, target, shape, dtype = sig
    return f"{name} = {target} -> {shape} {dtype}"


def _checksum(data: dict) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(data: dict) -> dict:
    """Add schema fields and the checksum."""
    data = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **data}
    data["checksum"] = _checksum(data)
    return data


def write_plan_file(data: dict, path: str | os.PathLike) -> Path:
    """Write sealed plan data atomically: readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a plan file is an ordinary file
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


REQUIRED = {
    "schema": str, "schema_version": int, "optsched_version": str, "torch_version": str, "kind": str,
    "fingerprint": dict, "made_for": dict, "decisions": dict, "costs": dict, "summary": dict,
    "solver": dict, "timeline": dict, "checksum": str,
}


def load_plan(path: str | os.PathLike) -> PlanFile:
    """Read and validate a plan file. Raises PlanFileError saying what is wrong with it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}): corrupted or truncated") from None
    return PlanFile(path, validate(data, str(path)))


def validate(data: Any, where: str = "plan") -> dict:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise PlanFileError(f"{where} is not an optsched plan file (no 'schema': {SCHEMA!r})")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanFileError(
            f"{where} has plan schema version {version!r}; this optsched reads version {SCHEMA_VERSION}: plan again"
        )
    for key, kind in REQUIRED.items():
        if not isinstance(data.get(key), kind):
            raise PlanFileError(f"{where}: field {key!r} is missing or not a {kind.__name__}")
    if data["checksum"] != _checksum(data):
        raise PlanFileError(
            f"{where} was modified after it was written (checksum mismatch): a hand-edited or corrupted plan "
            "is never run; plan again"
        )
    decisions = data["decisions"]
    for key in ("fw_order", "bw_order", "offload", "fusion_groups", "ops"):
        if key not in decisions:
            raise PlanFileError(f"{where}: decisions lack {key!r}")
    return data


def cache_dir() -> Path:
    """Where optimize(plan="auto") keeps plans: $OPTSCHED_CACHE_DIR, else the user's cache folder."""
    if os.environ.get("OPTSCHED_CACHE_DIR"):
        return Path(os.environ["OPTSCHED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "optsched" / "plans"


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


def downsample(values: list[int], points: int = TIMELINE_POINTS) -> tuple[list[int], int]:
    """Per-chunk maxima (peaks survive), and the chunk length."""
    if len(values) <= points:
        return list(values), 1
    chunk = -(-len(values) // points)
    return [max(values[i : i + chunk]) for i in range(0, len(values), chunk)], chunk
