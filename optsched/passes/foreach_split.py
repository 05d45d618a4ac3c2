"""Foreach ops split into one op per tensor, for executors that fuse.

A foreach op (`_foreach_add`, `_foreach_addcdiv_`, ...) is horizontal fusion done by hand:
one call over every parameter, with every intermediate list live at once. An executor that
fuses pointwise ops does better vertically: split per tensor, an optimizer's update of one
parameter (its moments, denominator and new value) becomes one chain, fused into one kernel
that keeps the intermediates in registers. Only ops over tensors with at least one dimension
are split; lists of 0-d tensors (step counts, bias corrections) stay whole, where
`scalar_batching` turns them into vector ops.

Each element runs the same ATen kernel the foreach op runs per tensor on CPU, so a split
program computes the same values (tests replay every op in `SPLITTABLE` against its foreach
form). An in-place foreach op becomes out= writes into its first list's tensors.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from .._torch import OpOverload
from .op_variants import out_variant

aten = torch.ops.aten

SPLITTABLE = frozenset({
    "add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "pow", "maximum", "minimum",
    "clamp_min", "clamp_max", "sqrt", "neg", "exp", "log", "reciprocal", "abs", "sign", "sigmoid", "tanh",
})

# foreach overload -> per-tensor overload, where the rule below (List/Scalar/... -> Tensor) does not hold
_SINGLE = {
    "lerp": {"Scalar": "Scalar", "ScalarList": "Scalar", "List": "Tensor"},
    "pow": {"List": "Tensor_Tensor", "Scalar": "Tensor_Scalar", "ScalarList": "Tensor_Scalar"},
    "addcmul": {"Scalar": "default", "ScalarList": "default"},
    "addcdiv": {"Scalar": "default", "ScalarList": "default"},
    "clamp_min": {"Scalar": "default", "ScalarList": "default", "List": "Tensor"},
    "clamp_max": {"Scalar": "default", "ScalarList": "default", "List": "Tensor"},
    "maximum": {"List": "default"},
    "minimum": {"List": "default"},
}


def _base(target: OpOverload) -> tuple[str, bool] | None:
    name = target.overloadpacket.__name__
    if not name.startswith("_foreach_"):
        return None
    base = name.removeprefix("_foreach_")
    inplace = base.endswith("_")
    return base.removesuffix("_"), inplace


@functools.cache
def single_op(target: OpOverload) -> OpOverload | None:
    """The per-tensor functional overload `target` (a foreach overload) runs on each element."""
    found = _base(target)
    if found is None or found[0] not in SPLITTABLE:
        return None
    base, inplace = found
    args = target._schema.arguments
    if not args or str(args[0].type) != "List[Tensor]":
        return None  # pow.ScalarAndTensor: a scalar first
    written = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    if written != ([0] if inplace else []):
        return None  # the _out overloads write a list of their own
    over = target._overloadname
    name = _SINGLE.get(base, {}).get(over, "default" if over == "default" else "Tensor")
    packet = getattr(aten, base, None)
    if packet is None or name not in packet.overloads():
        return None
    single = getattr(packet, name)
    return single if torch.Tag.pointwise in single.tags else None


def _list_arg(schema_type: str) -> bool:
    return schema_type in ("List[Tensor]", "List[number]", "List[Scalar]")


def element_call(node: fx.Node, i: int) -> tuple[OpOverload, tuple, dict]:
    """(overload, args, kwargs) computing element `i` of foreach `node` out of place."""
    single = single_op(node.target)
    assert single is not None, node.target
    schema = node.target._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    values = list(node.args) + [node.kwargs.get(a.name, a.default_value) for a in positional[len(node.args):]]
    values = [v[i] if _list_arg(str(a.type)) else v for a, v in zip(positional, values)]
    single_args = single._schema.arguments
    if len(values) > len(single_args):
        raise ValueError(f"{node.target} has more arguments than {single}")
    args = tuple(v for a, v in zip(single_args, values) if not a.kwarg_only)
    kwargs = {a.name: v for a, v in zip(single_args, values) if a.kwarg_only}
    names = {a.name for a in single_args}
    for a in schema.arguments:
        if a.kwarg_only and a.name in node.kwargs:
            if a.name not in names:
                raise ValueError(f"{node.target}: keyword {a.name!r} has no place in {single}")
            kwargs[a.name] = node.kwargs[a.name]
    return single, args, kwargs


def _splittable(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    if single_op(node.target) is None:  # also None for the _out overloads
        return False
    first = node.args[0] if node.args else None
    if not isinstance(first, (list, tuple)) or not first:
        return False
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in first]
    return all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in vals)


def split_foreach(gm: fx.GraphModule) -> int:
    """Replace foreach ops over tensors of rank >= 1 by per-tensor ops; returns how many were split."""
    graph = gm.graph
    split = 0
    for node in list(graph.nodes):
        if not _splittable(node):
            continue
        _base_name, inplace = _base(node.target)
        getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if not inplace and len(getitems) != len(node.users):
            continue  # the list itself is used whole
        if inplace and (node.users or out_variant(single_op(node.target)) is None):
            continue
        with graph.inserting_before(node):
            for i, dest in enumerate(node.args[0]):
                single, args, kwargs = element_call(node, i)
                if inplace:
                    target, out_name = out_variant(single)
                    new = graph.call_function(target, args, {**kwargs, out_name: dest})
                    new.meta["val"] = dest.meta["val"]
                elif i in getitems:
                    new = graph.call_function(single, args, kwargs)
                    new.meta = dict(getitems[i].meta)
                    getitems[i].replace_all_uses_with(new)
                else:
                    continue  # an output nobody reads
        for g in getitems.values():
            graph.erase_node(g)
        graph.erase_node(node)
        split += 1
    if split:
        graph.lint()
        gm.recompile()
    return split
