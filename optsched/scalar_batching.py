"""Run foreach ops over lists of 0-dim tensors as one op on a stacked vector.

A compiled optimizer step keeps its per-parameter scalars as tensors (Adam's step counts
and bias corrections: Dynamo traces the `capturable` branch), so a foreach Adam step has
about ten foreach ops over 196 0-dim tensors. Each costs one kernel launch per tensor
(about 6 us on this CPU): more than the rest of the step's overhead. Stacked into one
vector, each becomes a single elementwise op; the few foreach ops that take the scalars as
per-tensor operands (`_foreach_div_(xs, scalars)`) get them back as views (`unbind`).

The values are the same elementwise math, but a vectorized kernel may round differently
in the last bit than the one-element kernel (`pow` does on CPU).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["batch_scalar_foreach"]

_STACK = torch.ops.aten.stack.default
_UNBIND = torch.ops.aten.unbind.int


def _scalar_list(items, dtype=None) -> bool:
    """A list of nodes holding 0-dim tensors of one dtype (and `dtype`, if given)."""
    if not isinstance(items, (list, tuple)) or not items:
        return False
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in items]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in vals):
        return False
    dtypes = {v.dtype for v in vals} | ({dtype} if dtype is not None else set())
    return len(dtypes) == 1 and len({v.device for v in vals}) == 1


def _items(op: fx.Node) -> list[fx.Node] | None:
    vals = op.meta.get("val")
    if not isinstance(vals, (list, tuple)) or not vals:
        return None
    items: dict[int, fx.Node] = {}
    for u in op.users:
        if u.target is not operator.getitem or not isinstance(u.args[1], int):
            return None
        items[u.args[1]] = u
    return [items.get(i) for i in range(len(vals))]


def _elementwise(op: fx.Node, args: list, fake_args: list):
    """The ATen overload computing `op` elementwise on vectors (same name without `_foreach_`), and
    its output value, or None."""
    name = op.target.overloadpacket.__name__.removeprefix("_foreach_")
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    for overload_name in packet.overloads():
        overload = getattr(packet, overload_name)
        schema = overload._schema
        if schema.is_mutable or len(schema.returns) != 1 or torch.Tag.pointwise not in overload.tags:
            continue
        try:
            out = overload(*fake_args, **op.kwargs)
        except (TypeError, RuntimeError):
            continue
        if isinstance(out, torch.Tensor):
            return overload, out
    return None


def _fake_mode(gm: fx.GraphModule):
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def batch_scalar_foreach(gm: fx.GraphModule) -> int:
    """Replace functional foreach ops whose lists and outputs are all 0-dim tensors by one elementwise
    op on stacked vectors; recompile `gm`. Returns how many foreach ops were replaced."""
    mode = _fake_mode(gm)
    if mode is None:
        return 0
    graph = gm.graph
    vector_of: dict[tuple[fx.Node, ...], fx.Node] = {}  # a list of scalars -> the vector holding them
    n = 0
    for op in list(graph.nodes):
        if op.op != "call_function" or not isinstance(op.target, torch._ops.OpOverload):
            continue
        if not op.target.overloadpacket.__name__.startswith("_foreach_") or op.target._schema.is_mutable:
            continue
        items = _items(op)
        if items is None or any(i is None for i in items) or not _scalar_list(items):
            continue
        lists = [a for a in op.args if isinstance(a, (list, tuple))]
        if not lists or not all(_scalar_list(a, items[0].meta["val"].dtype) and len(a) == len(items) for a in lists):
            continue
        if any(isinstance(a, fx.Node) for a in op.args if not isinstance(a, (list, tuple))):
            continue  # a tensor operand shared by every element: left as it is
        new_args, fake_args = [], []
        with graph.inserting_before(op):
            for a in op.args:
                if isinstance(a, (list, tuple)):
                    vec = vector_of.get(tuple(a))
                    if vec is None:
                        vec = graph.call_function(_STACK, (list(a),))
                        with mode:
                            vec.meta["val"] = torch.stack([x.meta["val"] for x in a])
                        vector_of[tuple(a)] = vec
                    new_args.append(vec)
                    fake_args.append(vec.meta["val"])
                else:
                    new_args.append(a)
                    fake_args.append(a)
            with mode:
                found = _elementwise(op, new_args, fake_args)
            if found is None:
                continue
            overload, val = found
            vec = graph.call_function(overload, tuple(new_args), dict(op.kwargs))
            vec.meta["val"] = val
            unbind = graph.call_function(_UNBIND, (vec,))
            with mode:
                unbind.meta["val"] = torch.unbind(val)
            views = []
            for i, item in enumerate(items):
                view = graph.call_function(operator.getitem, (unbind, i))
                view.meta["val"] = unbind.meta["val"][i]
                item.replace_all_uses_with(view)
                views.append(view)
        vector_of[tuple(views)] = vec
        for item in items:
            graph.erase_node(item)
        graph.erase_node(op)
        n += 1
    for vec in vector_of.values():  # stacks made for an op that was then left as it is
        if vec.target is _STACK and not vec.users:
            graph.erase_node(vec)
    if n:
        graph.lint()
        gm.recompile()
    return n
