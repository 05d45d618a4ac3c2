"""solvers/synthetic.random_layered_problem: the Moccasin-style random layered DAGs of notebook 3, as
training steps the simulator and the solver take."""

from __future__ import annotations

import pytest

from optsched.solvers import Phase, default_schedule, simulate, solve
from optsched.solvers.search.heuristics import lower_bound_peak
from optsched.solvers.synthetic import random_layered_problem


def layer_edges(p):
    """(reader, producer) pairs between forward ops named n<i>."""
    fw = {o.id: o for o in p.fw_ops if o.name != "loss"}
    return [(o.id, p.tensors[t].producer) for o in fw.values() for t in o.inputs if p.tensors[t].producer is not None]


def test_same_seed_same_problem_other_seed_other_problem():
    a, b, c = random_layered_problem(60, seed=1), random_layered_problem(60, seed=1), random_layered_problem(60, seed=2)
    assert a.ops == b.ops and a.tensors == b.tensors
    assert a.ops != c.ops


@pytest.mark.parametrize("n", [1, 2, 17, 100])
def test_shape_n_forward_ops_a_loss_and_a_mirrored_backward(n):
    p = random_layered_problem(n, seed=n)
    assert len(p.fw_ops) == n + 1 and len(p.bw_ops) == n + 1
    assert p.fw_ops[-1].name == "loss" and p.bw_ops[0].name == "loss_bw"
    assert all(o.recomputable for o in p.fw_ops)
    assert [o.name for o in p.bw_ops[1:]] == [f"n{i}_bw" for i in reversed(range(n))]
    assert all(p.tensors[t].producer < o.id for o, t in ((o, t) for o in p.ops for t in o.inputs)
               if p.tensors[t].producer is not None)


def test_layers_every_op_reads_the_previous_layer_and_only_earlier_ones():
    n, layers = 120, 10
    p = random_layered_problem(n, n_layers=layers, max_extra_inputs=3, seed=4)
    layer_of = [min(layers - 1, i * layers // n) for i in range(n)]
    preds: dict[int, list[int]] = {i: [] for i in range(n)}
    for reader, producer in layer_edges(p):
        assert layer_of[producer] < layer_of[reader]
        preds[reader].append(producer)
    for i in range(n):
        if layer_of[i] == 0:
            assert preds[i] == [] and p.ops[i].inputs == (0,)  # reads the input x
        else:
            assert any(layer_of[j] == layer_of[i] - 1 for j in preds[i])
            assert 1 <= len(preds[i]) <= 4
    assert any(layer_of[i] - min(layer_of[j] for j in preds[i]) > 1 for i in range(n) if preds[i])  # skips exist


def test_sizes_and_times_in_their_ranges():
    p = random_layered_problem(80, unit_bytes=1000, size_range=(2, 5), time_range=(1.0, 2.0), seed=3)
    fw = [o for o in p.fw_ops if o.name != "loss"]
    assert {p.tensors[o.outputs[0]].bytes for o in fw} <= {2000, 3000, 4000, 5000}
    assert len({p.tensors[o.outputs[0]].bytes for o in fw}) > 1
    assert all(1.0 <= o.time_s <= 2.0 for o in fw)
    assert all(o.time_s == 2 * p.ops[int(o.name[1:-3])].time_s for o in p.bw_ops[1:])


def test_gradients_accumulate_in_one_buffer_per_tensor():
    p = random_layered_problem(100, seed=0)
    sim = simulate(p, default_schedule(p))
    accumulating = [o for o in p.bw_ops if o.reuse]
    assert accumulating and all(o.reuse_all for o in accumulating)
    assert sim.reused  # the simulator writes the later contributions into the earlier buffer
    # the program's peak is bounded by: every forward output saved plus one gradient buffer per tensor
    acts = sum(p.tensors[t].bytes for o in p.fw_ops for t in o.outputs)
    inputs = sum(t.bytes for t in p.tensors if t.producer is None)
    largest_bw = max(sum(p.tensors[t].bytes for t in o.outputs) for o in p.bw_ops)
    assert sim.peak_bytes <= inputs + 2 * acts + largest_bw


def test_the_solver_meets_0_8_of_the_program_order_peak():
    p = random_layered_problem(40, seed=5)
    unplanned = simulate(p, default_schedule(p)).peak_bytes
    budget = int(0.8 * unplanned)
    assert lower_bound_peak(p) <= budget
    sol = solve(p, budget, time_limit_s=10)
    assert sol.sim.peak_bytes <= budget
    assert simulate(p, sol.schedule).peak_bytes == sol.sim.peak_bytes
    assert any(p.ops[o].phase is Phase.FW for o in sol.schedule.bw_order)  # by recomputing


def test_rejects_an_empty_graph():
    with pytest.raises(ValueError, match="n_nodes"):
        random_layered_problem(0)
