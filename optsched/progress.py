"""The live solver progress line on stderr (rich), for `optimize(progress=True)` and `optsched plan`.

The solvers report progress through a `solvers.progress.Display` and never import a terminal UI;
this is the one optsched hands them."""

from __future__ import annotations


class LiveLine:
    """A `solvers.progress.Display`: one rich status line while a solve runs, its final text printed."""

    def __init__(self):
        self._console = None
        self._status = None

    def show(self, text: str) -> None:
        if self._status is None:
            from rich.console import Console

            self._console = Console(stderr=True)
            self._status = self._console.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def done(self, text: str | None) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
            if text:
                self._console.print(text)
