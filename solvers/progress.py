"""A one-line solver progress display: elapsed time, best estimate, bound, gap (rich, on stderr)."""

from __future__ import annotations

import time

from rich.console import Console


class ProgressLine:
    """Call `update(objective_s, bound_s)` from solution callbacks; `close()` at the end. Quiet unless enabled."""

    def __init__(self, label: str, enabled: bool = True):
        self.enabled = enabled
        self.label = label
        self.t0 = time.perf_counter()
        self.console = Console(stderr=True)
        self._status = self.console.status(self._text(None, None)) if enabled else None
        if self._status is not None:
            self._status.start()

    def _text(self, obj: float | None, bound: float | None) -> str:
        elapsed = time.perf_counter() - self.t0
        if obj is None:
            return f"{self.label}: {elapsed:5.1f}s  searching"
        gap = (obj - bound) / obj if obj > 0 else 0.0
        return f"{self.label}: {elapsed:5.1f}s  best {obj * 1e3:.3f} ms  bound {bound * 1e3:.3f} ms  gap {gap:.2%}"

    def update(self, objective_s: float, bound_s: float) -> None:
        if self._status is not None:
            self._status.update(self._text(objective_s, bound_s))

    def note(self, message: str) -> None:
        if self._status is not None:
            self._status.update(f"{self.label}: {time.perf_counter() - self.t0:5.1f}s  {message}")

    def close(self, final: str | None = None) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
            if final:
                self.console.print(f"{self.label}: {final}")
