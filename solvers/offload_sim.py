"""Replay a schedule in which some saved activations live in host memory between forward and backward.

A first building block for CPU offload (issue 4): the simulator with time. It is not
yet used by the solvers or the lowering.

Each offloaded activation is copied to the host on a device-to-host queue as soon as
its producer ends, and its device copy is freed at the first step that starts after
that copy is done (and after its last forward reader). A prefetch issued just before
backward step j copies it back on a host-to-device queue; the device copy exists
from then to its last backward reader, and that reader waits for the copy if it is
late. The two queues are serial and overlap compute, so only waiting costs time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import Problem, Schedule, TensorKind
from .simulator import ScheduleError, simulate


@dataclass
class OffloadSim:
    peak_bytes: int
    timeline: list[int]
    time_s: float  # op time plus waiting for late prefetches
    transfer_s: float  # both directions, on their own queues
    exposed_transfer_s: float  # the part compute had to wait for
    offloaded_bytes: int
    host_peak_bytes: int


def simulate_offload(
    problem: Problem, schedule: Schedule, offload: dict[int, int], host_bw: float
) -> OffloadSim:
    """`offload` maps a saved activation to the backward position (index in `bw_order`)
    before which its prefetch is issued; `host_bw` is the host<->device bandwidth in bytes/s."""
    base = simulate(problem, schedule)
    n_fw = base.n_forward_steps
    if offload and host_bw <= 0:
        raise ScheduleError("offload needs a positive host bandwidth")
    saved = set(base.saved)
    first_bw_read: dict[int, int] = {}
    last_fw_read: dict[int, int] = {}
    for k, keys in enumerate(base.reads):
        for t, rc in keys:
            if rc:
                continue
            if k >= n_fw:
                first_bw_read.setdefault(t, k)
            else:
                last_fw_read[t] = k
    for t, j in offload.items():
        name = problem.tensors[t].name
        if t not in saved or problem.tensors[t].kind is not TensorKind.ACTIVATION:
            raise ScheduleError(f"{name!r} is not a saved activation, so it cannot be offloaded")
        if not 0 <= j or n_fw + j > first_bw_read.get(t, -1):
            raise ScheduleError(f"the prefetch of {name!r} comes after its first backward reader")

    spans = base.spans
    nbytes = {t: problem.tensors[t].bytes for t in offload}
    produced_at = {t: spans[(t, False)][0] for t in offload}
    prefetch_at: dict[int, list[int]] = {}
    for t, j in offload.items():
        prefetch_at.setdefault(n_fw + j, []).append(t)
    d2h_end: dict[int, float] = {}
    h2d_end: dict[int, float] = {}
    d2h_free = h2d_free = now = exposed = 0.0
    device_end: dict[int, int] = {}
    for k, (o, _rc) in enumerate(base.steps):
        for t in prefetch_at.get(k, []):
            begin = max(now, h2d_free)
            h2d_free = h2d_end[t] = begin + nbytes[t] / host_bw
        late = [h2d_end[t] - now for t, rc in base.reads[k] if not rc and t in h2d_end and h2d_end[t] > now]
        if late:
            exposed += max(late)
            now += max(late)
        for t in offload:  # device copies whose trip to the host finished before this step
            if t not in device_end and t in d2h_end and d2h_end[t] <= now and last_fw_read.get(t, -1) < k:
                device_end[t] = k - 1
        now += problem.ops[o].time_s
        for t in problem.ops[o].outputs:
            if t in offload and produced_at[t] == k:
                begin = max(now, d2h_free)
                d2h_free = d2h_end[t] = begin + nbytes[t] / host_bw
    last = len(base.steps) - 1
    lives = [(key[0], s, e) for key, (s, e) in spans.items() if not (key[0] in offload and not key[1])]
    for t in offload:
        start, end = spans[(t, False)]
        lives.append((t, start, max(device_end.get(t, last), last_fw_read.get(t, start))))  # the forward copy
        lives.append((t, n_fw + offload[t], end))  # the prefetched copy
    delta = [0] * (len(base.steps) + 2)
    for t, s, e in lives:
        delta[s] += problem.tensors[t].bytes
        delta[e + 1] -= problem.tensors[t].bytes
    timeline, live = [], 0
    for k, (o, _rc) in enumerate(base.steps):
        live += delta[k]
        timeline.append(live + problem.ops[o].workspace_bytes)
    return OffloadSim(
        peak_bytes=max(timeline) if timeline else base.peak_bytes,
        timeline=timeline,
        time_s=base.time_s + exposed,
        transfer_s=2 * sum(nbytes.values()) / host_bw if offload else 0.0,
        exposed_transfer_s=exposed,
        offloaded_bytes=sum(nbytes.values()),
        host_peak_bytes=sum(nbytes.values()),  # every host copy is kept until the step ends
    )
