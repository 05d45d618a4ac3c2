"""Benchmarks: each prints a table and writes JSON under benchmarks/results/."""

import json
from pathlib import Path


def write_result(path: Path, data) -> None:
    """Write a benchmark's JSON (the source of the README's tables) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
