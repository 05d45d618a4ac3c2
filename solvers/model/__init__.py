"""The planning model and its judges: `Problem` and `Schedule` (plain data), the simulator, its
offload clock, and what a fixed order implies (liveness)."""
