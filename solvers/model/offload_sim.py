"""Offloaded activations in time: when copies to and from the host start, end, and stall compute.

The simulator calls this for a schedule with offloads. Each offloaded activation is
copied to the host on a device-to-host queue as soon as its producer ends. Its device
copy is dropped before the first forward step that starts after that copy is done
(and after its last forward reader); at the end of the forward every copy still in
flight is waited for, since nothing of the forward may outlive it but what the
backward receives. A prefetch issued before backward position j allocates the
device copy and fills it on a host-to-device queue; its first reader waits for it.
Both queues are serial and overlap compute, so only waiting costs time.

The runtime (optsched.offload_runtime) does exactly this, at these steps, so the
memory it measures is the memory simulated here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import Problem, ScheduleError, TensorKind


@dataclass(frozen=True)
class OffloadEvent:
    tensor: int
    produced: int  # step after which the copy to the host starts
    release: int  # step before which the device copy is dropped (n_forward_steps: at the end of the forward)
    prefetch: int  # step before which the copy back is issued and its device memory allocated
    first_read: int  # first backward step reading it: it waits there for the copy back


@dataclass
class OffloadReplay:
    events: dict[int, OffloadEvent]
    exposed_s: float  # time compute waited for copies
    transfer_s: float  # busy time of both copy queues
    offloaded_bytes: int
    host_bytes: int  # host memory the offloaded copies take (each has its own slot all step)


def check_offload(problem: Problem, n_fw: int, saved: set[int], reads: list, offload: dict[int, int]) -> dict[int, int]:
    """Reject offloads that cannot run; return each offloaded tensor's first backward reading step."""
    if offload and problem.host_bw <= 0:
        raise ScheduleError("this problem has no host bandwidth (host_bw = 0), so nothing can be offloaded")
    first_bw_read: dict[int, int] = {}
    for k in range(n_fw, len(reads)):
        for t, rc in reads[k]:
            if not rc:
                first_bw_read.setdefault(t, k)
    for t, j in offload.items():
        tensor = problem.tensors[t]
        if t not in saved or tensor.kind is not TensorKind.ACTIVATION or not tensor.offloadable:
            raise ScheduleError(f"{tensor.name!r} is not an offloadable saved activation")
        if j < 0 or n_fw + j > first_bw_read[t]:
            raise ScheduleError(f"the prefetch of {tensor.name!r} comes after its first backward reader")
    host = sum(problem.tensors[t].bytes for t in offload)
    if problem.host_budget_bytes is not None and host > problem.host_budget_bytes:
        raise ScheduleError(f"offloads take {host} bytes of host memory, over the host budget of {problem.host_budget_bytes}")
    return {t: first_bw_read[t] for t in offload}


def replay_offload(
    problem: Problem,
    steps: list[tuple[int, bool]],
    n_fw: int,
    spans: dict[tuple[int, bool], tuple[int, int]],
    reads: list[list[tuple[int, bool]]],
    saved: set[int],
    offload: dict[int, int],
    *,
    runs: list[tuple[int, int, float]] = (),
) -> OffloadReplay:
    """Time the transfers of `offload` (tensor -> backward position of its prefetch) along `steps`.
    `runs`: formed fusion groups' steps (first, last, kernel time), each one step in time: it reads all
    its members read, takes its time at its last step, its outputs go to the host after it, and a
    prefetch inside it is issued before it."""
    step_time = [problem.ops[o].time_s for o, _rc in steps]
    run_start = list(range(len(steps)))
    run_end = list(range(len(steps)))
    if runs:
        reads = list(reads)
        for first, last, time_s in runs:
            merged = list(dict.fromkeys(key for k in range(first, last + 1) for key in reads[k]))
            for k in range(first, last + 1):
                reads[k], step_time[k], run_start[k], run_end[k] = merged, 0.0, first, last
            step_time[last] = time_s
        offload = {t: run_start[n_fw + j] - n_fw if 0 <= n_fw + j < len(steps) else j for t, j in offload.items()}
    first_read = check_offload(problem, n_fw, saved, reads, offload)
    bw = problem.host_bw
    nbytes = {t: problem.tensors[t].bytes for t in offload}
    last_fw_read = {t: spans[(t, False)][0] for t in offload}
    for k in range(n_fw):
        for t, _rc in reads[k]:
            if t in last_fw_read:
                last_fw_read[t] = k
    made_at: dict[int, list[int]] = {}
    fetch_at: dict[int, list[int]] = {}
    for t, j in offload.items():
        made_at.setdefault(run_end[spans[(t, False)][0]], []).append(t)
        fetch_at.setdefault(n_fw + j, []).append(t)
    d2h_end: dict[int, float] = {}
    h2d_end: dict[int, float] = {}
    release: dict[int, int] = {}
    in_flight: list[int] = []  # copied out (or being copied), device copy not yet dropped
    d2h_free = h2d_free = now = exposed = 0.0
    for k in range(len(steps)):
        if k == n_fw and in_flight:  # the forward ends: wait for what is still being copied out
            wait = max(d2h_end[t] for t in in_flight) - now
            if wait > 0:
                exposed += wait
                now += wait
            release.update((t, n_fw) for t in in_flight)
            in_flight = []
        elif k < n_fw and in_flight:
            done = [t for t in in_flight if d2h_end[t] <= now and last_fw_read[t] < k]
            release.update((t, k) for t in done)
            in_flight = [t for t in in_flight if t not in release]
        for t in fetch_at.get(k, []):
            h2d_free = h2d_end[t] = max(now, h2d_free) + nbytes[t] / bw
        late = max((h2d_end[t] - now for t, rc in reads[k] if not rc and t in h2d_end), default=0.0)
        if late > 0:
            exposed += late
            now += late
        now += step_time[k]
        for t in made_at.get(k, []):
            d2h_free = d2h_end[t] = max(now, d2h_free) + nbytes[t] / bw
            in_flight.append(t)
    events = {
        t: OffloadEvent(t, spans[(t, False)][0], release[t], n_fw + offload[t], first_read[t]) for t in offload
    }
    total = sum(nbytes.values())
    return OffloadReplay(events, exposed, 2 * total / bw if offload else 0.0, total, total)
