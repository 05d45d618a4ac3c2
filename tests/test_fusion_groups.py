"""Which ops form fusion groups (`solvers.fusion.find_groups`), without torch.

Vertical fusion joins ops through values only fusible ops read; it never fans out from one
value into independent groups (horizontal fusion makes all their outputs live at once, and
the planner tries it separately, keeping it only where the peak does not rise).
"""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from optsched.solvers import Phase
from optsched.solvers.search.fusion_groups import check_group, find_groups, fuse_ops, internal_tensors
from optsched.solvers.model.problem import Op, Problem, Tensor
from tests.hypothesis_profiles import examples

KB = 1024


class _Graph:
    """Ops named by their output; `op("c", ["a", "b"])` reads a and b, makes c."""

    def __init__(self, inputs: list[str]):
        self.tensors = [Tensor(i, name, KB) for i, name in enumerate(inputs)]
        self.ops: list[Op] = []
        self.id = {name: i for i, name in enumerate(inputs)}

    def op(self, out: str, reads: list[str], phase: Phase = Phase.FW, more: tuple[str, ...] = ()) -> None:
        """`more`: further outputs."""
        made = []
        for name in (out, *more):
            t = Tensor(len(self.tensors), name, KB, producer=len(self.ops))
            self.tensors.append(t)
            self.id[name] = t.id
            made.append(t.id)
        self.ops.append(Op(len(self.ops), out, phase, tuple(self.id[r] for r in reads), tuple(made), 1e-6))

    def problem(self, outputs: list[str]) -> Problem:
        return Problem(self.ops, self.tensors, frozenset(self.id[o] for o in outputs))


def names(p: Problem, groups: list[list[int]]) -> list[list[str]]:
    return [[p.ops[o].name for o in g] for g in groups]


def test_a_diamond_is_one_group():
    g = _Graph(["x"])
    g.op("a", ["x"])
    g.op("b", ["a"])
    g.op("c", ["a"])
    g.op("d", ["b", "c"])
    p = g.problem(["d"])
    groups = find_groups(p, [True] * 4)
    assert names(p, groups) == [["a", "b", "c", "d"]]
    assert internal_tensors(p, groups[0]) == {g.id["a"], g.id["b"], g.id["c"]}


def test_a_value_fanning_out_to_independent_ops_is_not_fused_with_them():
    """s is read by two chains that never meet: joining them would be horizontal fusion."""
    g = _Graph(["x", "y", "z"])
    g.op("s", ["x"])
    g.op("p1", ["s", "y"])
    g.op("q1", ["p1"])
    g.op("p2", ["s", "z"])
    g.op("q2", ["p2"])
    p = g.problem(["q1", "q2"])
    assert names(p, find_groups(p, [True] * 5)) == [["p1", "q1"], ["p2", "q2"]]


def test_values_read_by_an_unfusible_op_or_returned_end_a_group():
    g = _Graph(["x"])
    g.op("a", ["x"])
    g.op("b", ["a"])
    g.op("mm", ["b"])  # not fusible
    g.op("c", ["mm"])
    g.op("d", ["c"])
    g.op("e", ["d"])
    p = g.problem(["d", "e"])
    assert names(p, find_groups(p, [True, True, False, True, True, True])) == [["a", "b"], ["c", "d"]]


def test_forward_and_backward_ops_are_never_in_one_group():
    g = _Graph(["x"])
    g.op("a", ["x"])
    g.op("b", ["a"], Phase.BW)
    p = g.problem(["b"])
    assert find_groups(p, [True, True]) == []


def test_a_set_that_is_not_convex_falls_back_to_chains():
    """p makes t1 (read by q) and t2 (read by mm, not fusible); c reads q and mm. {p, q, c} is
    connected, but a group of them would wait for mm, which waits for it."""
    g = _Graph(["x"])
    g.op("p", ["x"], more=("t2",))
    g.op("q", ["p"])
    g.op("mm", ["t2"])
    g.op("c", ["q", "mm"])
    p = g.problem(["c"])
    groups = find_groups(p, [True, True, False, True])
    assert names(p, groups) == [["q", "c"]]
    check_group(p, groups[0])


@st.composite
def random_dags(draw):
    n = draw(st.integers(2, 14))
    g = _Graph(["x0", "x1"])
    made = ["x0", "x1"]
    for i in range(n):
        reads = draw(st.lists(st.sampled_from(made), min_size=1, max_size=3, unique=True))
        g.op(f"v{i}", reads, Phase.FW)
        made.append(f"v{i}")
    outputs = draw(st.lists(st.sampled_from(made[2:]), min_size=1, max_size=3, unique=True))
    fusible = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return g.problem(outputs), fusible


@settings(max_examples=examples(150), deadline=None)
@given(random_dags())
def test_groups_on_random_graphs_are_disjoint_convex_and_fusible(case):
    p, fusible = case
    groups = find_groups(p, fusible)
    seen: set[int] = set()
    for group in groups:
        assert len(group) >= 2 and all(fusible[o] for o in group)
        assert not seen & set(group)
        seen |= set(group)
        check_group(p, group)
    fuse_ops(p, groups, [1e-6] * len(groups))  # the planner accepts them


if __name__ == "__main__":
    sys.exit(__import__("pytest").main([__file__, "-q"]))


def test_kernel_scratch_is_measured_per_kernel_in_one_profiler_pass():
    """Every fusion kernel compiled for a graph gets its scratch from one labelled profiler pass (each pass is about
    0.15 s): the same bytes as profiling it alone (its peak less its outputs)."""
    from optsched.costs.measure import measure_peak
    import torch

    from optsched.executors.groups import _scratch_bytes

    def with_scratch(x):  # a temporary the size of x, then a small output
        t = x * 2
        return ((t + 1).sum(0),)

    def without(x):
        return (x.sum(0),)

    x = torch.randn(256, 256)
    got = _scratch_bytes({"a": (with_scratch, [x]), "b": (without, [x])})
    alone = {}
    for key, fn in (("a", with_scratch), ("b", without)):
        out_bytes = fn(x)[0].untyped_storage().nbytes()
        alone[key] = measure_peak(lambda fn=fn: fn(x), "cpu").peak_bytes - out_bytes
    assert got == alone
    assert got["a"] >= 2 * x.untyped_storage().nbytes() > got["b"]
