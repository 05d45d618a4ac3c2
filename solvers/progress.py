"""Solver progress: elapsed time, best estimate, bound, gap, reported through a `Display` callback.

No terminal UI here (the core imports neither torch nor rich): `solve(progress=...)` takes False
(quiet), True (plain lines on stderr, at most one a second, and the final one) or a `Display`
(optsched's live line, `optsched.progress.LiveLine`, is one)."""

from __future__ import annotations

import sys
import time
from typing import Protocol

from .search.incumbent import gap


class Display(Protocol):
    def show(self, text: str) -> None:
        """The progress line as it is now."""

    def done(self, text: str | None) -> None:
        """The solve ended: its final line (None when it failed or was interrupted)."""


class StderrLines:
    """Plain progress lines on stderr: at most one every `every_s` seconds, and the final one."""

    def __init__(self, every_s: float = 1.0):
        self.every_s = every_s
        self._last: float | None = None

    def show(self, text: str) -> None:
        now = time.perf_counter()
        if self._last is None or now - self._last >= self.every_s:
            print(text, file=sys.stderr, flush=True)
            self._last = now

    def done(self, text: str | None) -> None:
        if text:
            print(text, file=sys.stderr, flush=True)


class ProgressLine:
    """Call `update(objective_s, bound_s)` from solution callbacks; `close()` at the end. Quiet unless enabled."""

    def __init__(self, label: str, enabled: bool = True, display: Display | None = None):
        self.label = label
        self.t0 = time.perf_counter()
        self.display = (display if display is not None else StderrLines()) if enabled else None
        if self.display is not None:
            self.display.show(self._text(None, None))

    def _text(self, obj: float | None, bound: float | None) -> str:
        elapsed = time.perf_counter() - self.t0
        if obj is None:
            return f"{self.label}: {elapsed:5.1f}s  searching"
        return f"{self.label}: {elapsed:5.1f}s  best {obj * 1e3:.3f} ms  bound {bound * 1e3:.3f} ms  gap {gap(obj, bound):.2%}"

    def update(self, objective_s: float, bound_s: float) -> None:
        if self.display is not None:
            self.display.show(self._text(objective_s, bound_s))

    def note(self, message: str) -> None:
        if self.display is not None:
            self.display.show(f"{self.label}: {time.perf_counter() - self.t0:5.1f}s  {message}")

    def close(self, final: str | None = None) -> None:
        display, self.display = self.display, None
        if display is not None:
            display.done(f"{self.label}: {final}" if final else None)
