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


def fit(samples: list[tuple[dict[str, float], float]], keep: dict[str, float] | None = None,
        prior_weight: float = 0.0) -> Fit:
    """Seconds per unit from (units counted, wall seconds) samples; nonnegative (active-set: a unit whose
    coefficient comes out negative is dropped and the rest refitted).

    `prior_weight` > 0 pulls each coefficient towards its value in `keep` (ridge regression on the relative change:
    a unit counted alongside others in every sample, such as a fusion group's compile and its profiler pass, is
    otherwise not identifiable, and a few runs would set it anywhere); a unit `keep` prices at 0 stays 0. 0 is
    plain least squares."""
    samples = [(u, w) for u, w in samples if w > 0]
    units = sorted({k for u, _ in samples for k, v in u.items() if v})
    prior = {k: (keep or {}).get(k, 0.0) for k in units}
    ridge = prior_weight > 0
    if ridge:  # a unit the table prices at 0 stays at 0 (its cost is in another's); the others are pulled
        units = [k for k in units if prior[k] > 0]
    scale = {k: prior[k] if ridge else 1.0 for k in units}
    active = list(units)
    coef: dict[str, float] = {}
    while active:
        rows = [[u.get(k, 0.0) * scale[k] / w for k in active] for u, w in samples]
        target = [1.0] * len(samples)
        if ridge:  # sqrt(weight) * (x_k - 1) = 0 for each unit, x_k its coefficient over its prior
            rows += [[prior_weight**0.5 * (j == i) for j in range(len(active))] for i in range(len(active))]
            target += [prior_weight**0.5] * len(active)
        a = torch.tensor(rows, dtype=torch.float64)
        b = torch.tensor(target, dtype=torch.float64).unsqueeze(1)
        x = torch.linalg.lstsq(a, b, driver="gelsd").solution.flatten().tolist()
        if min(x) >= 0:
            coef = {k: v * scale[k] for k, v in zip(active, x)}
            break
        active.pop(min(range(len(x)), key=x.__getitem__))
    seconds = {**(keep or {}), **{k: coef.get(k, 0.0) for k in units}}
    residuals = [sum(seconds.get(k, 0.0) * v for k, v in u.items()) / w - 1 for u, w in samples]
    return Fit(seconds, residuals, len(samples))
