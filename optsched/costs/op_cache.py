"""Op times measured in this process, shared by every graph planned in it (issue 34): a model's programs, the same
model optimized again, another model with the same layers time each op once, and plan on the same time for it.

Keyed by what an op's time depends on (`profiling.shared_key`: its target, argument layouts and values, and
`place`), as text, so `save` and `load` can carry the times to another process: measured times differ from one
process to the next by more than any rounding hides (a few of a graph's ops land on the other side of a grid
line), so two processes plan on the same costs only when they share the measurements. Holds rounded seconds
only, never a tensor: it keeps no memory a budget would count.
"""

from __future__ import annotations

import json
import os

import torch

MAX_ENTRIES = 100_000  # the oldest go first beyond this (a process planning ever new shapes)

_times: dict[str, float] = {}
ENV = "OPTSCHED_OP_TIMES"  # a JSON file of op times shared by the processes that name it (see `shared_file`)
_loaded_from: set[str] = set()


def place(device: torch.device) -> tuple:
    """Where an op ran, as far as its time depends on it: torch's version, the device, and on the CPU the
    intra-op thread count (`torch.set_num_threads` changes every op's time), on CUDA the GPU's name."""
    if device.type == "cpu":
        return (torch.__version__, "cpu", torch.get_num_threads())
    if device.type == "cuda":
        return (torch.__version__, str(device), torch.cuda.get_device_name(device))
    return (torch.__version__, str(device))


def get(key: str) -> float | None:
    return _times.get(key)


def put(key: str, seconds: float) -> None:
    _times[key] = seconds
    while len(_times) > MAX_ENTRIES:
        del _times[next(iter(_times))]


def clear() -> None:
    """Forget every time measured (the next graph times its ops again)."""
    _times.clear()


def save(path: str | os.PathLike) -> None:
    """Write the times measured so far to `path` (JSON), for `load` in another process on this machine."""
    with open(path, "w") as f:
        json.dump(_times, f)


def load(path: str | os.PathLike) -> int:
    """Take the times `save` wrote (they replace any of the same key measured here): ops timed there are not
    timed again, and plan on the same costs. Returns how many were read."""
    with open(path) as f:
        loaded = json.load(f)
    for key, seconds in loaded.items():
        put(key, float(seconds))
    return len(loaded)


def shared_file() -> str | None:
    """$OPTSCHED_OP_TIMES: a file of op times every process naming it reads before timing (once) and writes after:
    processes on one machine then plan on the same measurements, so on the same costs (the tight-budget benchmark's
    fresh processes give the same plans). Unset (the default): times stay in the process."""
    return os.environ.get(ENV) or None


def load_shared() -> None:
    path = shared_file()
    if path is None or path in _loaded_from:
        return
    _loaded_from.add(path)
    if os.path.exists(path):
        load(path)


def save_shared() -> None:
    """Write this process's times to the shared file (atomically: a reader never sees half a file)."""
    path = shared_file()
    if path is None:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    save(tmp)
    os.replace(tmp, path)
