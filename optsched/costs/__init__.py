"""Costs: device profiles and roofline times (`profiles`), op times measured on the device
(`profiling`), memory and time measurement (`measure`), and the torch-free problem the solvers see
(`problem_builder`). Importing this package imports no torch."""

from .profiles import PROFILES, DeviceProfile

__all__ = ["PROFILES", "DeviceProfile"]
