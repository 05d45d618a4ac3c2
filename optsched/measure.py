"""Peak memory and time of a step, as users measure it: `optsched.measure.measure_training_step(call,
module, inputs)`. The implementation is `optsched.costs.measure` (the planner measures with it too)."""

from .costs.measure import (
    PeakResult,
    StepMeasurement,
    live_bytes,
    measure_peak,
    measure_ratio,
    measure_time,
    measure_training_step,
    memory_profile,
)

__all__ = [
    "PeakResult",
    "StepMeasurement",
    "live_bytes",
    "measure_peak",
    "measure_ratio",
    "measure_time",
    "measure_training_step",
    "memory_profile",
]
