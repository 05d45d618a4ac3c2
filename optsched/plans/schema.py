"""The plan file's contents as typed dataclasses, and the check that a loaded file has them.

`PlanData.parse(json_data)` walks the JSON against these classes' annotations and raises
`SchemaError` at the first field that is missing or of the wrong type, naming its path:
`decisions.fw_order[3]: expected int, got str`, `costs["addmm"][1]: expected int, got str`,
`timeline.offloads[0].prefetch: missing`. `plans.file_format.validate` turns it into a
`PlanFileError`. Readers keep using the JSON (`PlanFile.data`); nothing here changes what a
file holds or how it is written (`Plan.to_file_data`).

Rules: a field with a default may be missing (the fields written since schema version 1 first
appeared: files written before them are still version 1 and still load); `int` is a JSON
integer (not a boolean); `float` is any JSON number; `tuple[...]` is a JSON list of exactly
that many items; `dict[str, X]` is a JSON object with any keys; keys no class names are
ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Union


class SchemaError(ValueError):
    """A field of the plan file is missing or of the wrong type; `path` names it."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


# an op's recorded costs: time (s), scratch space (bytes), in-place writes as [output, input] tensor names
OpCosts = tuple[float, int, list[tuple[str, str]]]
# a fingerprint's node row: name, target, shape, dtype (see capture.fingerprint)
NodeRow = tuple[str, str, str, str]


@dataclass(frozen=True, kw_only=True)
class Fingerprint:
    hash: str
    nodes: list[NodeRow]


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A `costs.profiles.DeviceProfile` as `to_dict` writes it."""

    name: str
    device_type: str
    fp32_flops: float
    half_flops: float
    mem_bw: float
    launch_s: float
    host_bw: float
    memory_bytes: int | None


@dataclass(frozen=True, kw_only=True)
class BudgetReference:
    """`budget.BudgetResolution.source`: the program a percentage budget was taken of."""

    program: str
    unplanned_peak_bytes: int
    fingerprint: str | None
    bytes: int | None


@dataclass(frozen=True, kw_only=True)
class MadeFor:
    kind: str
    budget: str
    budget_bytes: int | None
    device_profile: str
    executor: str
    offload: bool
    host_budget_bytes: int | None
    profile: Profile
    timing: str
    # written since the budget's resolution and the output usage were recorded
    budget_from: str | None = None
    budget_resolved_bytes: int | None = None
    budget_reference: BudgetReference | None = None
    outputs: str | None = None
    grads_at_start: bool = False  # written since accumulation steps are planned apart
    optimizer: str | None = None  # written since plans count an optimizer's state and update (optim.describe)


@dataclass(frozen=True, kw_only=True)
class Decisions:
    ops: list[str]  # op names of the fused problem; orders index them
    fw_order: list[int]
    bw_order: list[int]
    offload: dict[str, int]  # offloaded tensor -> prefetch position
    fusion_groups: list[list[str]]  # member node names per group
    recomputed: list[str]
    offloaded: list[str]


@dataclass(frozen=True, kw_only=True)
class Summary:
    """`Plan.summary()`; the meanings are `plans.plan.SUMMARY_KEYS`."""

    kind: str
    predicted_peak_bytes: int
    unplanned_peak_bytes: int
    budget_bytes: int | None
    lower_bound_bytes: int
    estimated_time_s: float
    unplanned_time_s: float
    time_ratio: float
    solver_status: str
    objective_s: float
    bound_s: float
    gap: float
    solve_time_s: float
    method: str
    graph_nodes: int
    n_ops: int
    n_forward_ops: int
    n_backward_ops: int
    n_saved: int
    saved_bytes: int
    n_offloaded: int
    offloaded_bytes: int
    transfer_s: float
    exposed_transfer_s: float
    host_bytes: int
    host_budget_bytes: int | None
    n_recomputed: int
    recompute_s: float
    executor: str
    n_fusion_groups: int
    n_fused_ops: int
    device_profile: str
    timing: str
    # written since the budget's resolution and the output usage were recorded
    budget_from: str | None = None
    budget_reference_peak_bytes: int | None = None
    output_usage: str | None = None
    bound_valid_for: str | None = None  # written since issue 14
    chunks: dict[str, int] | None = None  # written since issue 16 (chunking)
    grads_at_start: bool = False  # written since accumulation steps are planned apart (issue 24)
    updates_in_backward: list[str] | None = None  # written since the optimizer's update is planned (issue 36)


@dataclass(frozen=True, kw_only=True)
class SolverReport:
    """`SolveStats.to_dict()`."""

    status: str
    objective_s: float
    bound_s: float
    gap: float
    wall_s: float
    method: str
    notes: list[str]


@dataclass(frozen=True, kw_only=True)
class OffloadSpan:
    tensor: str
    bytes: int
    produced: int
    release: int
    prefetch: int
    first_read: int


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """`Plan.timeline_data()`: live bytes per step (per-chunk maxima past 4,000 steps), for plots."""

    live_bytes: list[int]
    steps_per_point: int
    n_steps: int
    n_forward_steps: int
    recompute_steps: list[int]
    offloads: list[OffloadSpan]
    peak_bytes: int
    peak_step: int
    budget_bytes: int | None
    unplanned_live_bytes: list[int]
    unplanned_peak_bytes: int
    # written since the unplanned curve kept its own step counts
    unplanned_steps_per_point: int | None = None
    unplanned_n_steps: int | None = None
    unplanned_n_forward_steps: int | None = None


@dataclass(frozen=True, kw_only=True)
class PlanData:
    """A whole plan file (see `plans.file_format`)."""

    schema: str
    schema_version: int
    optsched_version: str
    torch_version: str
    kind: str
    fingerprint: Fingerprint
    made_for: MadeFor
    decisions: Decisions
    costs: dict[str, OpCosts]
    summary: Summary
    solver: SolverReport
    timeline: Timeline
    checksum: str
    created: str | None = None
    allocated: dict[str, int] | None = None  # written since storages were measured larger than their values

    @classmethod
    def parse(cls, data: Any) -> PlanData:
        """`data` (a plan file's JSON) as typed dataclasses; `SchemaError` naming the first bad field."""
        return _parse(data, cls, "")


def _parse(value: Any, tp: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _parse_object(value, tp, path)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # the schema has X | None only
        if value is None:
            raise SchemaError(path, f"expected {_name(inner)}, got null")
        return _parse(value, inner, path)
    if origin is list:
        _expect(isinstance(value, list), value, tp, path)
        return [_parse(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        _expect(isinstance(value, list), value, tp, path)
        if len(value) != len(args):
            raise SchemaError(path, f"expected a list of {len(args)} items, got {len(value)}")
        return tuple(_parse(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        _expect(isinstance(value, dict), value, tp, path)
        return {k: _parse(v, args[1], f'{path}["{k}"]') for k, v in value.items()}
    if tp is float:
        _expect(isinstance(value, (int, float)) and not isinstance(value, bool), value, tp, path)
    elif tp is int:
        _expect(isinstance(value, int) and not isinstance(value, bool), value, tp, path)
    else:
        _expect(isinstance(value, tp), value, tp, path)
    return value


def _parse_object(value: Any, cls: type, path: str) -> Any:
    _expect(isinstance(value, dict), value, cls, path)
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        where = f"{path}.{f.name}" if path else f.name
        if f.name not in value:
            if f.default is dataclasses.MISSING:
                raise SchemaError(where, "missing")
            continue
        kwargs[f.name] = _parse(value[f.name], hints[f.name], where)
    return cls(**kwargs)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _expect(ok: bool, value: Any, tp: Any, path: str) -> None:
    if not ok:
        raise SchemaError(path, f"expected {_name(tp)}, got {_json_type(value)}")


def _name(tp: Any) -> str:
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return "an object"
    if typing.get_origin(tp) in (list, tuple):
        return "a list"
    return tp.__name__


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


__all__ = ["PlanData", "SchemaError"]
