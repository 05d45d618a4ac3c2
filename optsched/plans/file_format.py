"""Plans as files: solve once, run many times, on other machines.

A plan file is JSON: a schema version, what the plan decided (order, fusion groups,
recomputations, offloads), what it was made for (graph fingerprint, budget, device
profile, executor, per-op costs), what it predicts (summary, timeline) and how the
solver did. A checksum over the content turns corruption and hand edits into a clear
error instead of a wrong program. Writes are atomic (a temporary file, then a rename); the
temporary file's name marks it as optsched's and says which process on which machine writes it
(`.NAME.optsched.PID@HOST.XXXXXXXX.tmp`), so the temporary files of writers that were killed are
removed at the next write of that file (`remove_stale_temps`: their process is gone, or they are
older than an hour), never a live one's, nor a file of someone else's named alike.
What optsched may remove is what it wrote: a plan file begins `{"schema": "optsched.plan"`
(`is_plan_file` reads the first bytes).

The contents are typed in `plans.schema`; `validate` checks every nested field against it.
Where plan files go (the plan cache, writability probes, saves that warn) is `plans.cache`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .schema import PlanData, SchemaError

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
            problems.append(node_difference(mine["nodes"], theirs["nodes"]))
        return "; ".join(problems) if problems else None


# made_for fields files written before them lack, as those files were made: a percentage budget was
# then always a share of the program's own unplanned peak
_MADE_FOR_BEFORE = {"budget_from": "this program", "grads_at_start": False, "optimizer": None}


def node_difference(planned: list, current: list) -> str:
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


STALE_TEMP_S = 3600.0  # a writer's temporary file this old is a killed writer's: a plan is written in well under a second


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32]


_PLAN_START = re.compile(rb'\s*\{\s*"schema"\s*:\s*' + re.escape(json.dumps(SCHEMA).encode()))
TEMP_MARK = "optsched."  # in the names of write_plan_file's temporary files: they may be empty, so the name says whose


def is_plan_file(path: str | os.PathLike) -> bool:
    """Whether `path` begins as every plan file begins (`seal` puts the schema first): the plan cache and the
    bound beside a plan=PATH remove only such files, never a user's file named like one. Reads 256 bytes."""
    try:
        with open(path, "rb") as f:
            return _PLAN_START.match(f.read(256)) is not None
    except OSError:
        return False


def _temp_prefix(name: str) -> str:
    """`.NAME.optsched.PID@HOST.`: mkstemp adds 8 random characters and `.tmp`. A name too long for that keeps
    `.NAME.optsched.` (its temporary files are then removed only once stale by age)."""
    tagged = f".{name}.{TEMP_MARK}{os.getpid()}@{_host()}."
    return tagged if len(tagged) <= 200 else f".{name}.{TEMP_MARK}"


def _temp_pattern(names: str) -> re.Pattern:
    """Temporary files of `write_plan_file` for the files whose names match the regular expression `names`;
    `mark` is None for a name without TEMP_MARK (an older optsched's, or someone else's)."""
    return re.compile(rf"\.(?:{names})\.(?P<mark>{re.escape(TEMP_MARK)})?"
                      rf"(?:(?P<pid>[0-9]+)@(?P<host>[A-Za-z0-9-]*)\.)?[a-z0-9_]{{8}}\.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def remove_stale_temps(folder: str | os.PathLike, name: str | re.Pattern, *, max_age_s: float = STALE_TEMP_S) -> int:
    """Remove the temporary files killed writers left in `folder` for the plan file `name` (or for every file
    whose name matches the pattern `name`): those whose writer (the pid in the temporary file's name, on this
    machine) is gone, and those older than `max_age_s`. Only ours: named with TEMP_MARK, or (an older
    optsched's name) beginning as a plan file; a user's `.NAME.xxxxxxxx.tmp` stays.
    A live writer's file is never removed. Returns how many were removed; errors are ignored (a
    folder we cannot list or a file we cannot remove costs nothing but disk)."""
    names = name.pattern if isinstance(name, re.Pattern) else re.escape(name)
    pattern, host, now, removed = _temp_pattern(names), _host(), time.time(), 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            age = now - entry.stat(follow_symlinks=False).st_mtime
            writer_gone = m["pid"] is not None and m["host"] == host and not _pid_alive(int(m["pid"]))
            if (writer_gone or age > max_age_s) and (m["mark"] or is_plan_file(entry.path)):
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue
    return removed


def write_plan_file(data: dict, path: str | os.PathLike) -> Path:
    """Write sealed plan data atomically: readers see the old file or the new one, never half of one.
    Temporary files that killed writers of this file left beside it are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, path.name)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a plan file is an ordinary file
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
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
        raw = path.read_bytes()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanFileError(
            f"{path} is not a plan file: not UTF-8 JSON (byte {e.start} is {raw[e.start]:#04x}); "
            "plan files are the JSON that Plan.save, optimize(plan=...) and `optsched plan` write"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}): corrupted or truncated") from None
    return PlanFile(path, validate(data, str(path)))


def validate(data: Any, where: str = "plan") -> dict:
    """`data` if it is a sealed plan file of this schema, whole (every nested field present and typed,
    see `plans.schema`); else PlanFileError saying what is wrong: not a plan, another schema version,
    a top-level field missing, edited after sealing (checksum), or the path of a nested field missing
    or of the wrong type (`decisions.fw_order[3]: expected int, got str`)."""
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
    try:
        PlanData.parse(data)
    except SchemaError as e:
        raise PlanFileError(f"{where}: {e}") from None
    return data


def downsample(values: list[int], points: int = TIMELINE_POINTS) -> tuple[list[int], int]:
    """Per-chunk maxima (peaks survive), and the chunk length."""
    if len(values) <= points:
        return list(values), 1
    chunk = -(-len(values) // points)
    return [max(values[i : i + chunk]) for i in range(0, len(values), chunk)], chunk
