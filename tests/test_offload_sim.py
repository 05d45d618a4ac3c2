"""The time-aware replay with offloaded activations (a building block for issue 4; no torch)."""

import pytest

from optsched.solvers import ScheduleError, simulate
from optsched.solvers.offload_sim import simulate_offload
from optsched.solvers.problem import default_schedule
from optsched.solvers.synthetic import chain_training_problem

MB = 1 << 20


def _setup(layers=6):
    p = chain_training_problem(layers, act_bytes=MB)
    sched = default_schedule(p)
    base = simulate(p, sched)
    return p, sched, base


def _first_bw_index(p, sched, t):
    return next(j for j, o in enumerate(sched.bw_order) if t in p.ops[o].inputs)


def test_nothing_offloaded_replays_like_the_simulator():
    p, sched, base = _setup()
    sim = simulate_offload(p, sched, {}, host_bw=1e9)
    assert sim.timeline == base.timeline and sim.time_s == base.time_s
    assert sim.transfer_s == sim.exposed_transfer_s == sim.offloaded_bytes == 0


def test_fast_offload_frees_device_memory_between_forward_and_backward_at_no_cost():
    p, sched, base = _setup()
    peak_tensors = [t for t in base.saved if p.tensors[t].bytes == MB]
    offload = {t: _first_bw_index(p, sched, t) - 1 for t in peak_tensors[:4]}
    sim = simulate_offload(p, sched, offload, host_bw=1e15)  # copies take femtoseconds
    assert sim.peak_bytes <= base.peak_bytes - 4 * MB + MB  # at most one prefetched copy overlaps the peak
    assert sim.exposed_transfer_s == pytest.approx(0.0, abs=1e-12)
    assert sim.time_s == pytest.approx(base.time_s)
    assert sim.offloaded_bytes == sim.host_peak_bytes == 4 * MB
    assert sim.transfer_s == pytest.approx(2 * 4 * MB / 1e15)


def test_a_late_prefetch_stalls_compute_by_exactly_its_lateness():
    p, sched, base = _setup()
    t = base.saved[0]
    j = _first_bw_index(p, sched, t)
    bw = MB / 1.0  # one second per copy: the prefetch issued right before its reader is a full second late
    sim = simulate_offload(p, sched, {t: j}, host_bw=bw)
    assert sim.exposed_transfer_s == pytest.approx(1.0)
    assert sim.time_s == pytest.approx(base.time_s + 1.0)


def test_a_slow_copy_to_the_host_keeps_the_device_copy_alive():
    p, sched, base = _setup()
    t = base.saved[0]
    j = _first_bw_index(p, sched, t)
    slow = simulate_offload(p, sched, {t: j}, host_bw=1.0)  # never finishes within the step
    assert slow.peak_bytes >= base.peak_bytes  # nothing freed, and the prefetched copy comes on top


def test_offload_rejects_what_it_cannot_do():
    p, sched, base = _setup()
    t = base.saved[0]
    j = _first_bw_index(p, sched, t)
    with pytest.raises(ScheduleError, match="after its first backward reader"):
        simulate_offload(p, sched, {t: j + 1}, host_bw=1e9)
    not_saved = next(x.id for x in p.tensors if x.kind.value == "activation" and x.id not in base.saved)
    with pytest.raises(ScheduleError, match="not a saved activation"):
        simulate_offload(p, sched, {not_saved: 0}, host_bw=1e9)
    with pytest.raises(ScheduleError, match="host bandwidth"):
        simulate_offload(p, sched, {t: j}, host_bw=0)
