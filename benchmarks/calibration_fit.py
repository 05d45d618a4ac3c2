"""Least-squares fit of the solvers' clock (solvers/model/calibration.py) on measured planning runs.

Each sample is one stretch of planning: the units of work it counted (`clock.units_counted()`) and the wall
seconds it took on the reference machine. The fit finds seconds per unit, none negative, minimising the
relative error of each sample (a 0.1 s solve matters as much as a 30 s one: the time limit must hold for
both). Units no sample counted keep their table value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Fit:
    seconds: dict[str, float]  # per unit
    residuals: list[float]  # per sample: predicted / measured - 1
    samples: int

    def worst(self) -> float:
        return max((abs(r) for r in self.residuals), default=0.0)


def fit(samples: list[tuple[dict[str, float], float]], keep: dict[str, float] | None = None) -> Fit:
    """Seconds per unit from (units counted, wall seconds) samples; nonnegative (active-set: a unit whose
    coefficient comes out negative is dropped and the rest refitted)."""
    samples = [(u, w) for u, w in samples if w > 0]
    units = sorted({k for u, _ in samples for k, v in u.items() if v})
    active = list(units)
    coef: dict[str, float] = {}
    while active:
        a = torch.tensor([[u.get(k, 0.0) / w for k in active] for u, w in samples], dtype=torch.float64)
        b = torch.ones(len(samples), 1, dtype=torch.float64)
        x = torch.linalg.lstsq(a, b, driver="gelsd").solution.flatten().tolist()
        if min(x) >= 0:
            coef = dict(zip(active, x))
            break
        active.pop(min(range(len(x)), key=x.__getitem__))
    seconds = {**(keep or {}), **{k: coef.get(k, 0.0) for k in units}}
    residuals = [sum(seconds.get(k, 0.0) * v for k, v in u.items()) / w - 1 for u, w in samples]
    return Fit(seconds, residuals, len(samples))
