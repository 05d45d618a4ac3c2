"""A program to plan: its kind, its target (device, timing, profile, offloads, executor), and what planning it
hands back."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

import torch

from ..budget import Budget
from ..capture.joint_graph import JointGraph
from ..costs.profiles import DeviceProfile, get_profile
from ..executors import get_executor
from ..executors.base import Executor
from ..plans.plan import Plan
from ..settings import PlanningSettings

DEFAULT_HOST_SHARE = 0.5  # offloads may take this share of the machine's physical memory by default


class ProgramKind(Enum):
    """A compiled program: the training step (forward and backward, from the partition hook) or a forward-only
    program (the inference hook). The value names its problem."""

    TRAINING = "training step"
    FORWARD = "forward"

    @property
    def training(self) -> bool:
        return self is ProgramKind.TRAINING

    @property
    def label(self) -> str:
        """As plan files' `made_for.kind` and `Plan.kind` say it."""
        return "training" if self.training else "inference"


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_budget_bytes(host_budget: Budget | None) -> int:
    """The host memory offloads may take: the option's bytes, else DEFAULT_HOST_SHARE of physical memory."""
    physical = physical_memory_bytes()
    if host_budget is not None and host_budget.spec is not None:
        return host_budget.resolve(physical)
    return int(DEFAULT_HOST_SHARE * physical)


def default_offload(offload: bool | None, device_type: str) -> bool:
    """None: offload where host memory is really another memory (on CUDA, not on CPU)."""
    return device_type == "cuda" if offload is None else offload


@dataclass(frozen=True)
class Target:
    """What one program is planned for: its device, whether op times are measured there (else the
    profile's roofline), the profile, whether saved activations may wait in host memory and how much of
    it, and who runs fusion groups."""

    device: torch.device
    measure: bool
    profile: DeviceProfile
    offload: bool
    host_budget_bytes: int
    executor: Executor

    @property
    def measures_memory(self) -> bool:
        """Whether its ops' scratch space and out= forms are measured: where their times are, and wherever the program
        runs on this device (not plan_offline's "meta") though a named profile's roofline times them."""
        return self.measure or self.device.type in ("cpu", "cuda")

    @classmethod
    def for_device(cls, settings: PlanningSettings, device: torch.device) -> Target:
        """The target of a program captured on `device` (torch.compile)."""
        wants = settings.device_profile
        # default: measure op times on the device at hand (on an H200 the roofline put a Llama step at 0.56x of
        # what ran); a named profile means the roofline
        measure = wants == "measured" or (wants is None and device.type in ("cpu", "cuda"))
        profile = get_profile(None if wants == "measured" else wants, device)
        return cls(
            device, measure, profile, default_offload(settings.offload, device.type),
            host_budget_bytes(settings.host_budget), get_executor(settings.executor, device),
        )


@dataclass
class Planned:
    """What planning a program hands back: the plan, per op of its problem the node or fusion group it runs, and the
    joint graph planned (`graph.gm`, its GraphModule), which is what to lower: the graph given, or a chunked copy of
    it (the graph given is never changed)."""

    plan: Plan
    items: list
    graph: JointGraph
