"""Foreach ops split per tensor (`optsched.foreach_split`), replayed against the foreach op.

Every overload of every foreach op in SPLITTABLE, functional and in place, is built from its
schema, split, and run: the per-tensor program gives bitwise the foreach op's values (both run
the same ATen kernel per tensor on CPU).
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx

from optsched.passes.foreach_split import SPLITTABLE, single_op, split_foreach

aten = torch.ops.aten
SHAPES = [(4, 3), (5,), (2, 2, 2)]


def _overloads():
    for base in sorted(SPLITTABLE):
        for name in (f"_foreach_{base}", f"_foreach_{base}_"):
            packet = getattr(aten, name, None)
            if packet is None:
                continue
            for over in packet.overloads():
                yield getattr(packet, over)


def _value(arg, graph: fx.Graph, inputs: list, g: torch.Generator):
    """An argument for `arg` of a foreach schema: tensor lists become placeholders."""
    kind = str(arg.type)
    if kind == "List[Tensor]":
        nodes = []
        for shape in SHAPES:
            t = torch.rand(shape, generator=g) + 0.5  # positive: sqrt, log, pow, division
            ph = graph.placeholder(f"in{len(inputs)}")
            ph.meta["val"] = t
            inputs.append(t)
            nodes.append(ph)
        return nodes
    if kind == "Tensor":
        t = torch.tensor(0.75)
        ph = graph.placeholder(f"in{len(inputs)}")
        ph.meta["val"] = t
        inputs.append(t)
        return ph
    if kind in ("List[number]", "List[Scalar]"):
        return [0.3, 1.5, 0.7]
    if kind in ("number", "Scalar"):
        return 0.37
    if kind == "List[Tensor]?":
        return None
    raise NotImplementedError(kind)


def _program(target) -> tuple[fx.GraphModule, list[torch.Tensor]] | None:
    graph, inputs, args, kwargs = fx.Graph(), [], [], {}
    g = torch.Generator().manual_seed(0)
    for arg in target._schema.arguments:
        try:
            value = _value(arg, graph, inputs, g)
        except NotImplementedError:
            return None
        if arg.kwarg_only:
            kwargs[arg.name] = 2.0 if arg.name == "alpha" else value
        else:
            args.append(value)
    node = graph.call_function(target, tuple(args), kwargs)
    if target._schema.returns:
        items = []
        for i in range(len(SHAPES)):
            item = graph.call_function(operator.getitem, (node, i))
            items.append(item)
        graph.output(tuple(items))
    else:
        graph.output(())
    return fx.GraphModule(torch.nn.Module(), graph), inputs


CASES = list(_overloads())


@pytest.mark.parametrize("target", CASES, ids=str)
def test_split_replays_the_foreach_op_bitwise(target):
    built = _program(target)
    if built is None:
        pytest.skip(f"{target}: an argument type this test does not build")
    gm, inputs = built
    split = copy.deepcopy(gm)
    n = split_foreach(split)
    foreach_left = [x for x in split.graph.nodes if "_foreach_" in str(x.target)]
    if single_op(target) is None:
        assert n == 0 and foreach_left
        return
    assert n == 1 and not foreach_left
    a, b = [x.clone() for x in inputs], [x.clone() for x in inputs]
    out_a, out_b = gm(*a), split(*b)
    for x, y in zip(list(out_a) + a, list(out_b) + b, strict=True):
        assert torch.equal(x, y), target


def test_the_ops_an_optimizer_uses_are_split():
    for target in (aten._foreach_lerp_.Scalar, aten._foreach_mul_.Scalar, aten._foreach_addcmul_.Scalar,
                   aten._foreach_sqrt.default, aten._foreach_div.List, aten._foreach_add.Scalar,
                   aten._foreach_addcdiv_.Scalar, aten._foreach_addcdiv_.ScalarList, aten._foreach_add_.List):
        assert single_op(target) is not None, target


def _graph_of(fn, *args) -> fx.GraphModule:
    gm = fx.symbolic_trace(fn)
    for ph, a in zip(gm.graph.find_nodes(op="placeholder"), args, strict=True):
        ph.meta["val"] = a
    return gm


def test_lists_of_0_dim_tensors_stay_whole():
    """Step counts and bias corrections: scalar_batching makes them vector ops instead."""
    steps = [torch.tensor(1.0), torch.tensor(2.0)]

    def f(a, b):
        return torch.ops.aten._foreach_add.Scalar([a, b], 1.0)

    gm = _graph_of(f, *steps)
    assert split_foreach(gm) == 0


def test_a_list_result_used_whole_stays_whole():
    xs = [torch.randn(3), torch.randn(4)]

    def f(a, b):
        out = torch.ops.aten._foreach_neg.default([a, b])
        return out  # the list itself, not its items

    gm = _graph_of(f, *xs)
    assert split_foreach(gm) == 0


def test_unread_outputs_are_not_computed():
    xs = [torch.randn(3), torch.randn(4)]

    def f(a, b):
        return torch.ops.aten._foreach_exp.default([a, b])[1]

    gm = _graph_of(f, *xs)
    assert split_foreach(gm) == 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [aten.exp.default]
    assert torch.equal(gm(*xs), xs[1].exp())
