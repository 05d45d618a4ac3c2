"""Benchmarks: each prints a table and writes JSON under benchmarks/results/."""

import json
from pathlib import Path

from benchmarks import meta as _meta  # noqa: F401 - imported first: its clock is the run's wall_s


def write_result(path: Path, data) -> None:
    """Write a benchmark's JSON (the source of the tables in README.md and docs/benchmarks.md) and say where,
    with this run's ``meta`` (commit, clean tree, date, torch, command, wall seconds: benchmarks/meta.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_meta.with_meta(data), indent=2))
    print(f"wrote {path}")


def timed_step(call, model, inputs):
    """One training step of `call` (grads cleared first), for measure_ratio / measure_time."""
    def run():
        for p in model.parameters():
            p.grad = None
        call(*inputs).backward()

    return run


def max_grad_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two {name: gradient} dicts (inf when their names differ)."""
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k] - b[k]).abs().max().item() for k in a)
