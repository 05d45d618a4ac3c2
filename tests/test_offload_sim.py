"""The simulator with offloaded activations: transfers in time, device copies dropped and brought back (no torch)."""

import dataclasses

import pytest

from optsched.solvers import Schedule, ScheduleError, simulate
from optsched.solvers.model.problem import default_schedule
from optsched.solvers.synthetic import chain_training_problem

MB = 1 << 20


def _setup(layers=6, host_bw=1e9, host_budget_bytes=None):
    p = chain_training_problem(layers, act_bytes=MB, host_bw=host_bw, host_budget_bytes=host_budget_bytes)
    sched = default_schedule(p)
    return p, sched, simulate(p, sched)


def _first_bw_index(p, sched, t):
    return next(j for j, o in enumerate(sched.bw_order) if t in p.ops[o].inputs)


def _with(sched, offload):
    return Schedule(sched.fw_order, sched.bw_order, offload)


def _with_bw(p, host_bw):
    return dataclasses.replace(p, host_bw=host_bw)


def test_nothing_offloaded_replays_like_before():
    p, sched, base = _setup()
    sim = simulate(p, _with(sched, {}))
    assert sim.timeline == base.timeline and sim.time_s == base.time_s
    assert sim.transfer_s == sim.exposed_transfer_s == sim.offloaded_bytes == sim.host_bytes == 0
    assert sim.offloads == {}


def test_fast_offload_frees_device_memory_between_forward_and_backward_at_no_cost():
    p, sched, base = _setup(host_bw=1e15)  # copies take femtoseconds
    peak_tensors = [t for t in base.saved if p.tensors[t].bytes == MB]
    offload = {t: _first_bw_index(p, sched, t) - 1 for t in peak_tensors[:4]}
    sim = simulate(p, _with(sched, offload))
    assert sim.peak_bytes <= base.peak_bytes - 4 * MB + MB  # at most one prefetched copy overlaps the peak
    assert sim.exposed_transfer_s == pytest.approx(0.0, abs=1e-12)
    assert sim.time_s == pytest.approx(base.time_s)
    assert sim.offloaded_bytes == sim.host_bytes == 4 * MB
    assert sim.transfer_s == pytest.approx(2 * 4 * MB / 1e15)
    for t, ev in sim.offloads.items():
        # the device copy goes right after its last forward reader and comes back at its prefetch
        assert ev.release == max(k for k in range(sim.n_forward_steps) if any(r == t for r, _ in sim.reads[k])) + 1
        assert ev.prefetch == sim.n_forward_steps + offload[t] <= ev.first_read
        copies = [lt for lt in sim.lifetimes if lt.tensor == t]
        assert [(lt.start, lt.end, lt.prefetched) for lt in copies] == [
            (ev.produced, ev.release - 1, False), (ev.prefetch, sim.spans[(t, False)][1], True)
        ]
        between = range(ev.release, ev.prefetch)
        assert all(not (lt.start <= k <= lt.end) for lt in copies for k in between)


def test_a_late_prefetch_stalls_compute_by_exactly_its_lateness():
    p, sched, base = _setup(host_bw=1e15)
    t = base.saved[0]
    j = _first_bw_index(p, sched, t)
    slow = _with_bw(p, MB / 1.0)  # one second per copy, each way
    # the copy out ends 1 s after its producer; the forward is shorter, so the forward's end waits for it
    sim = simulate(slow, _with(sched, {t: j}))
    fw_s = sum(p.ops[o].time_s for o in sched.fw_order)
    produced_end = sum(p.ops[o].time_s for o in sched.fw_order[: sim.offloads[t].produced + 1])
    wait_out = produced_end + 1.0 - fw_s
    assert sim.offloads[t].release == sim.n_forward_steps  # held to the end of the forward
    assert sim.exposed_transfer_s == pytest.approx(wait_out + 1.0)  # then the prefetch before its reader: 1 s late
    assert sim.time_s == pytest.approx(base.time_s + wait_out + 1.0)


def test_a_prefetch_issued_early_enough_hides_behind_compute():
    p, sched, base = _setup(host_bw=1e15)
    t = base.saved[0]
    first = _first_bw_index(p, sched, t)
    ahead = sum(p.ops[o].time_s for o in sched.bw_order[:first])
    slow = _with_bw(p, MB / (0.9 * ahead))  # the copy back takes 90% of the compute before its reader
    sim = simulate(slow, _with(sched, {t: 0}))
    out_wait = sim.exposed_transfer_s  # only the copy out may stall (at the forward's end)
    late = simulate(slow, _with(sched, {t: first}))
    assert late.exposed_transfer_s == pytest.approx(out_wait + 0.9 * ahead)


def test_offload_rejects_what_it_cannot_do():
    p, sched, base = _setup()
    t = base.saved[0]
    j = _first_bw_index(p, sched, t)
    with pytest.raises(ScheduleError, match="after its first backward reader"):
        simulate(p, _with(sched, {t: j + 1}))
    not_saved = next(x.id for x in p.tensors if x.kind.value == "activation" and x.id not in base.saved)
    with pytest.raises(ScheduleError, match="not an offloadable saved activation"):
        simulate(p, _with(sched, {not_saved: 0}))
    with pytest.raises(ScheduleError, match="host bandwidth"):
        simulate(_with_bw(p, 0.0), _with(sched, {t: j}))
    tight = dataclasses.replace(p, host_budget_bytes=MB - 1)
    with pytest.raises(ScheduleError, match="host budget"):
        simulate(tight, _with(sched, {t: j}))
    fixed = dataclasses.replace(p, tensors=[dataclasses.replace(x, offloadable=x.id != t) for x in p.tensors])
    with pytest.raises(ScheduleError, match="not an offloadable"):
        simulate(fixed, _with(sched, {t: j}))


def test_schedule_round_trips_its_offloads():
    s = Schedule([0, 1], [2, 3], {5: 1, 7: 0})
    assert Schedule.from_dict(s.to_dict()) == s
    assert Schedule.from_dict({"fw_order": [0], "bw_order": []}).offload == {}
