"""Baselines that need torch: PyTorch's own min-cut partitioner read from PyTorch itself
(`pytorch_mincut`). The torch-free heuristics are in `optsched.solvers.baselines`."""

from .pytorch_mincut import CapturedStep, MinCutChoice, capture_training_step, mincut_choice, mincut_sweep, non_monotone

__all__ = ["CapturedStep", "MinCutChoice", "capture_training_step", "mincut_choice", "mincut_sweep", "non_monotone"]
