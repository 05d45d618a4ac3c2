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

import logging
import operator

import torch
import networkx as nx
from torch import fx

from .._torch import OpOverload
from ..solvers.model.problem import reject, rejections_in
from .inplace import output_items

log = logging.getLogger(__name__)

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


def _elementwise(op: fx.Node, fake_args: list):
    """The ATen overload computing `op` elementwise on vectors (same name without `_foreach_`), and
    its output value, or None and the error of the last overload tried (None when none was tried).
    Overloads that do not take these arguments raise (TypeError, RuntimeError): the next one is tried."""
    name = op.target.overloadpacket.__name__.removeprefix("_foreach_")
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None, None
    error = None
    for overload_name in packet.overloads():
        overload = getattr(packet, overload_name)
        schema = overload._schema
        if schema.is_mutable or len(schema.returns) != 1 or torch.Tag.pointwise not in overload.tags:
            continue
        try:
            out = overload(*fake_args, **op.kwargs)
        except (TypeError, RuntimeError) as e:  # not this overload's arguments: try the next
            log.debug("%s does not take %s's arguments as vectors: %s: %s", overload, op.name, type(e).__name__, e)
            error = e
            continue
        if isinstance(out, torch.Tensor):
            return (overload, out), None
    return None, error


def _fake_mode(gm: fx.GraphModule):
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    return None


class _Vectors:
    """The vectors made so far in one graph: a list of scalar nodes already stacked, or unbound from
    a vector, is read from that vector instead of being stacked again."""

    def __init__(self, graph: fx.Graph, mode):
        self.graph, self.mode = graph, mode
        self.vector_of: dict[tuple[fx.Node, ...], fx.Node] = {}

    def of(self, column: tuple[fx.Node, ...]) -> fx.Node:
        vec = self.vector_of.get(column)
        if vec is None:
            vec = self.graph.call_function(_STACK, (list(column),))
            with self.mode:
                vec.meta["val"] = torch.stack([x.meta["val"] for x in column])
            self.vector_of[column] = vec
        return vec

    def replace(self, nodes: list[fx.Node], target, args: tuple, kwargs: dict, val: torch.Tensor) -> None:
        """`target(*args, **kwargs)` (of value `val`) computes `nodes` as one vector: each node's
        readers read its element (a view, through `unbind`), and the nodes go."""
        graph = self.graph
        vec = graph.call_function(target, args, kwargs)
        vec.meta["val"] = val
        unbind = graph.call_function(_UNBIND, (vec,))
        with self.mode:
            unbind.meta["val"] = torch.unbind(val)
        views = []
        for i, node in enumerate(nodes):
            view = graph.call_function(operator.getitem, (unbind, i))
            view.meta["val"] = unbind.meta["val"][i]
            node.replace_all_uses_with(view)
            views.append(view)
        self.vector_of[tuple(views)] = vec
        for node in nodes:
            graph.erase_node(node)

    def drop_unused_stacks(self) -> None:
        """Stacks made for an op that was then left as it is."""
        for vec in self.vector_of.values():
            if vec.target is _STACK and not vec.users:
                self.graph.erase_node(vec)


def _vector_args(vectors: _Vectors, args, columns: list[tuple[fx.Node, ...] | None]) -> tuple[list, list]:
    """`args` with each tensor operand replaced by the vector of its column (None: a constant), and
    their values."""
    new_args = [a if col is None else vectors.of(col) for a, col in zip(args, columns, strict=True)]
    return new_args, [a.meta["val"] if isinstance(a, fx.Node) else a for a in new_args]


def batch_scalar_foreach(gm: fx.GraphModule) -> int:
    """Replace functional foreach ops whose lists and outputs are all 0-dim tensors by one elementwise
    op on stacked vectors; recompile `gm`. Returns how many foreach ops were replaced."""
    mode = _fake_mode(gm)
    if mode is None:
        return 0
    graph = gm.graph
    vectors = _Vectors(graph, mode)
    n = 0
    for op in list(graph.nodes):
        if op.op != "call_function" or not isinstance(op.target, OpOverload):
            continue
        if not op.target.overloadpacket.__name__.startswith("_foreach_") or op.target._schema.is_mutable:
            continue
        items = output_items(op)
        if items is None or not _scalar_list(items):
            continue
        lists = [a for a in op.args if isinstance(a, (list, tuple))]
        if not lists or not all(_scalar_list(a, items[0].meta["val"].dtype) and len(a) == len(items) for a in lists):
            continue
        if any(isinstance(a, fx.Node) for a in op.args if not isinstance(a, (list, tuple))):
            continue  # a tensor operand shared by every element: left as it is
        with graph.inserting_before(op):
            columns = [tuple(a) if isinstance(a, (list, tuple)) else None for a in op.args]
            new_args, fake_args = _vector_args(vectors, op.args, columns)
            with mode:
                found, error = _elementwise(op, fake_args)
            if found is None:
                if error is not None:  # left as it is: one launch per scalar, said on the plan
                    reject(log, "foreach op(s) over scalars left unbatched, no elementwise overload took their arguments",
                           error, into=rejections_in(gm.meta))
                continue
            overload, val = found
            vectors.replace(items, overload, tuple(new_args), dict(op.kwargs), val)
        graph.erase_node(op)
        n += 1
    vectors.drop_unused_stacks()
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
    if node.op != "call_function" or not isinstance(target, OpOverload):
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
    vectors = _Vectors(graph, mode)
    (output,) = graph.find_nodes(op="output")
    replaced = 0
    for (_level, _sig), members in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len(members) < MIN_GROUP:
            continue
        first = members[0]
        # every chain's inputs come before the stacked op and every chain's readers after it: placed
        # at the end, then the graph is sorted (`_topological_sort`)
        with graph.inserting_before(output):
            columns = [tuple(m.args[j] for m in members) if isinstance(a, fx.Node) else None
                       for j, a in enumerate(first.args)]
            new_args, fake_args = _vector_args(vectors, first.args, columns)
            with mode:
                val = first.target(*fake_args)
            vectors.replace(members, first.target, tuple(new_args), {}, val)
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
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((a, n) for n in nodes for a in n.all_input_nodes)
    order = list(nx.lexicographical_topological_sort(dag, key=index.__getitem__))  # the earliest ready node first
    prev = order[0]
    if prev is not nodes[0]:
        nodes[0].prepend(prev)
    for n in order[1:]:
        prev.append(n)
        prev = n
