"""Run foreach ops over lists of 0-dim tensors as one op on a stacked vector.

A compiled optimizer step keeps its per-parameter scalars as tensors (Adam's step counts
and bias corrections: Dynamo traces the `capturable` branch), so a foreach Adam step has
about ten foreach ops over 196 0-dim tensors. Each costs one kernel launch per tensor
(about 6 us on this CPU): more than the rest of the step's overhead. Stacked into one
vector, each becomes a single elementwise op; the few foreach ops that take the scalars as
per-tensor operands (`_foreach_div_(xs, scalars)`) get them back as views (`unbind`).

A for-loop step has the same scalars as separate ops, one chain per parameter:
`batch_scalar_ops` stacks the same op of every chain (same target and constants, at the
same depth of the graph, so none depends on another) into one.

The values are the same elementwise math, but a vectorized kernel may round differently
in the last bit than the one-element kernel (`pow` does on CPU).
"""

from __future__ import annotations

import heapq
import operator

import torch
from torch import fx

__all__ = ["batch_scalar_foreach", "batch_scalar_ops"]

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


MIN_GROUP = 4  # fewer same ops than this are not worth a stack and an unbind


def _levels(graph: fx.Graph) -> dict[fx.Node, int]:
    """Longest path from the graph's inputs: nodes at one level never depend on each other."""
    level: dict[fx.Node, int] = {}
    for n in graph.nodes:
        level[n] = 1 + max((level[a] for a in n.all_input_nodes), default=-1)
    return level


def _signature(node: fx.Node):
    """What must agree for ops to be stacked: target, constants, and per tensor operand its dtype;
    None when the node is not a deterministic elementwise op on 0-dim tensors."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target._schema.is_mutable or torch.Tag.pointwise not in target.tags:
        return None
    if torch.Tag.nondeterministic_seeded in target.tags or node.kwargs:
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        return None
    key = [target]
    for a in node.args:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor) or v.dim() != 0:
                return None
            key.append(("tensor", v.dtype, v.device))
        elif isinstance(a, (int, float, bool)) or a is None:
            key.append(("const", type(a), a))
        else:
            return None
    if not any(isinstance(a, fx.Node) for a in node.args):
        return None
    return tuple(key)


def batch_scalar_ops(gm: fx.GraphModule) -> int:
    """Stack the same elementwise op of independent 0-dim chains (at one graph depth) into one op on
    vectors; recompile `gm`. Returns how many ops were replaced."""
    mode = _fake_mode(gm)
    if mode is None:
        return 0
    graph = gm.graph
    level = _levels(graph)
    groups: dict[tuple, list[fx.Node]] = {}
    for n in graph.nodes:
        sig = _signature(n)
        if sig is not None:
            groups.setdefault((level[n], sig), []).append(n)
    vector_of: dict[tuple[fx.Node, ...], fx.Node] = {}
    (output,) = graph.find_nodes(op="output")
    replaced = 0
    for (_level, _sig), members in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len(members) < MIN_GROUP:
            continue
        first = members[0]
        # every chain's inputs come before the stacked op and every chain's readers after it: placed
        # at the end, then the graph is sorted (`_topological_sort`)
        with graph.inserting_before(output):
            new_args, fake_args = [], []
            for j, a in enumerate(first.args):
                if not isinstance(a, fx.Node):
                    new_args.append(a)
                    fake_args.append(a)
                    continue
                column = tuple(m.args[j] for m in members)
                vec = vector_of.get(column)
                if vec is None:
                    vec = graph.call_function(_STACK, (list(column),))
                    with mode:
                        vec.meta["val"] = torch.stack([x.meta["val"] for x in column])
                    vector_of[column] = vec
                new_args.append(vec)
                fake_args.append(vec.meta["val"])
            with mode:
                val = first.target(*fake_args)
            vec = graph.call_function(first.target, tuple(new_args))
            vec.meta["val"] = val
            unbind = graph.call_function(_UNBIND, (vec,))
            with mode:
                unbind.meta["val"] = torch.unbind(val)
            views = []
            for i, m in enumerate(members):
                view = graph.call_function(operator.getitem, (unbind, i))
                view.meta["val"] = unbind.meta["val"][i]
                m.replace_all_uses_with(view)
                views.append(view)
        vector_of[tuple(views)] = vec
        for m in members:
            graph.erase_node(m)
        replaced += len(members)
    if replaced:
        _topological_sort(graph)
        graph.lint()
        gm.recompile()
    return replaced


def _topological_sort(graph: fx.Graph) -> None:
    """Reorder the nodes so each comes after its inputs, otherwise keeping their order."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, index[u])
    assert len(order) == len(nodes), "the graph has a cycle"
    prev = order[0]
    if prev is not nodes[0]:
        nodes[0].prepend(prev)
    for n in order[1:]:
        prev.append(n)
        prev = n
