"""Op times measured on this machine, shared by every graph planned in this process and, through a file, by the
processes after it (issue 34): a model's programs, the same model optimized again or in a new process, another model
with the same layers time each op once, and plan on the same time for it.

Keyed by what an op's time depends on (`profiling.shared_key`: its target, argument layouts and values, and
`place`), as text, so a file can carry the times to another process: measured times differ from one
process to the next by more than any rounding hides (a few of a graph's ops land on the other side of a grid
line), so two processes plan on the same costs only when they share the measurements. By default they do: the
file is `op_times.json` in the user's cache directory (`shared_file`), read before a process first times an op
and merged into after (a time already in the file stays: the processes before planned on it). Holds rounded
seconds only, never a tensor: it keeps no memory a budget would count.
"""

from __future__ import annotations

import json
import os
import platform
from contextlib import contextmanager
from pathlib import Path

import platformdirs
import torch

MAX_ENTRIES = 100_000  # the oldest go first beyond this (a process planning ever new shapes)

_times: dict[str, float] = {}
ENV = "OPTSCHED_OP_TIMES"  # the file of op times processes share (see `shared_file`), or "off"
OFF = ("off", "0", "none", "false")
_loaded_from: set[str] = set()


def place(device: torch.device) -> tuple:
    """Where an op ran, as far as its time depends on it: torch's version, the device, and on the CPU the
    processor's model and the intra-op thread count (`torch.set_num_threads` changes every op's time), on CUDA the
    GPU's name."""
    if device.type == "cpu":
        return (torch.__version__, "cpu", _cpu_name(), torch.get_num_threads())
    if device.type == "cuda":
        return (torch.__version__, str(device), torch.cuda.get_device_name(device))
    return (torch.__version__, str(device))


def _cpu_name() -> str:
    """The processor's model (a cache directory on a shared home is read by other machines too)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def get(key: str) -> float | None:
    return _times.get(key)


def put(key: str, seconds: float) -> None:
    _times[key] = seconds
    while len(_times) > MAX_ENTRIES:
        del _times[next(iter(_times))]


def clear() -> None:
    """Forget every time measured (the next graph times its ops again)."""
    _times.clear()


def shared_file() -> str | None:
    """The file of op times processes on this machine share: every process reads it before it first times an op
    and merges its own times in after, so they plan on the same measurements, so on the same costs (the
    tight-budget benchmark's fresh processes give the same plans). `$OPTSCHED_OP_TIMES` names another file, or
    turns sharing off ("off": times stay in the process, each process measures its own); by default `op_times.json`
    in the user cache folder platformdirs names, beside the plan cache's (`~/.cache/optsched/` on Linux,
    `$XDG_CACHE_HOME` respected). Delete the file to measure afresh."""
    path = os.environ.get(ENV)
    if path is not None and path.strip().lower() in OFF + ("",):
        return None
    if path:
        return path
    return os.path.join(platformdirs.user_cache_dir("optsched", appauthor=False), "op_times.json")


def _read(path: str) -> dict[str, float]:
    """The times in `path`; nothing where it is missing or unreadable (a file cut short: it is rewritten)."""
    try:
        with open(path) as f:
            loaded = json.load(f)
        return {str(k): float(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def load_shared() -> None:
    path = shared_file()
    if path is None or path in _loaded_from:
        return
    _loaded_from.add(path)
    for key, seconds in _read(path).items():
        put(key, seconds)


@contextmanager
def _locked(path: str):
    """Held while a process merges into `path`, so two writing at once lose neither's times (POSIX only;
    elsewhere the atomic replace alone: a concurrent writer's new times may be lost, to be timed again)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def save_shared() -> None:
    """Merge this process's times into the shared file: a time already there stays (the processes before planned
    on it), the rest are added; written atomically (a reader never sees half a file). A file that cannot be
    written leaves the times in this process: planning goes on."""
    path = shared_file()
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            merged = _read(path)  # the file's times first: the oldest, the first to go beyond MAX_ENTRIES
            merged.update((k, v) for k, v in _times.items() if k not in merged)
            while len(merged) > MAX_ENTRIES:
                del merged[next(iter(merged))]
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, path)
    except OSError:
        return
