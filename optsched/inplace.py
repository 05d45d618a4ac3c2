"""Fold copy-back writes of an inference graph into the ops that compute the new values.

With `keep_inference_input_mutations=True` AOTAutograd hands the inference compiler a
functional graph whose input mutations come back at its end as `aten.copy_(input, new)`,
the new value computed out of place. An optimizer step is made of little else (the
"copy-heavy" program of Thunder issue 1173): every update allocates a temporary the size
of the tensor and then copies it back. `fold_copy_back` computes the new value directly
into the input where that is safe:

    v = op(...); copy_(dst, v)                          ->  op.out(..., out=dst)
    outs = _foreach_op(xs, ...); copy_(xs[i], outs[i])  ->  _foreach_op_(xs, ...)

The folded node reads what `op` read and writes `dst`; its `meta["val"]` is the
placeholder's fake tensor, so the rest of optsched (which keys memory by storage) sees a
mutating compute node that allocates nothing.

**Ordering.** The planning problem orders ops only through the storages they allocate and
read: a write into an input storage orders nothing after it, and nothing before it except
the ops that produce what it reads. A fold is therefore made only when no order the planner
may choose can change a value:

* nothing reads the new value through the graph: `v`'s only user is the copy_ (for
  foreach ops: each output's only user is its copy_, which has no users). Readers of the
  new value could not be ordered after the write, and the planner may move them before it.
* every other node touching `dst`'s storage (through any view or alias) is an ancestor
  of `op` through storages the planner sees (so it runs before the write in every
  schedule); nodes after `op` in the program never are, so a later read of the old value
  blocks the fold.

`redirect_readers=True` also folds when other nodes read `v`, redirecting them to the
folded node (they run after `op` in program order, so the program as written stays
correct). The planner does not order them after the write today, so this is for programs
that run in their own order; the backend does not use it.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from .joint_graph import JointGraph, build_joint_graph
from .problem_builder import out_variant

__all__ = ["fold_copy_back", "inplace_foreach", "out_overload"]

_COPY_ = torch.ops.aten.copy_.default
_COPY = torch.ops.aten.copy.default  # functional copy and clone: their out= forms allocate a temporary
_CLONE = torch.ops.aten.clone.default


@functools.cache
def out_overload(target: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, str] | None:
    """The out= overload of `target` with the same arguments plus one kwarg-only out tensor, and its name.

    Pointwise ops go through `problem_builder.out_variant`; others (copy, mm, ...) are
    matched the same way: every argument but the out one has the functional op's name
    and type, and the overload returns one tensor.
    """
    if not isinstance(target, torch._ops.OpOverload):
        return None
    found = out_variant(target)
    if found is not None:
        return found
    want = [(a.name, str(a.type)) for a in target._schema.arguments]
    if len(target._schema.returns) != 1 or str(target._schema.returns[0].type) != "Tensor":
        return None
    packet = target.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        if cand is target:
            continue
        args = cand._schema.arguments
        outs = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
        if len(outs) != 1 or not outs[0].kwarg_only or len(cand._schema.returns) != 1:
            continue
        if [(a.name, str(a.type)) for a in args if a is not outs[0]] == want:
            return cand, outs[0].name
    return None


@functools.cache
def inplace_foreach(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten._foreach_<op>_.<overload>` for `aten._foreach_<op>.<overload>`: same arguments, first list written."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    packet = target.overloadpacket
    if not packet.__name__.startswith("_foreach_") or target._schema.is_mutable:
        return None
    inplace_packet = getattr(torch.ops.aten, packet.__name__ + "_", None)
    if inplace_packet is None or target._overloadname not in inplace_packet.overloads():
        return None
    cand = getattr(inplace_packet, target._overloadname)
    args, want = cand._schema.arguments, target._schema.arguments
    if len(args) != len(want) or cand._schema.returns:
        return None
    if str(args[0].type) != "List[Tensor]":
        return None
    for i, (a, w) in enumerate(zip(args, want)):
        if (a.name, str(a.type), a.kwarg_only) != (w.name, str(w.type), w.kwarg_only):
            return None
        if (a.alias_info is not None and a.alias_info.is_write) != (i == 0):
            return None  # exactly the first list is written
    return cand


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    )


class _Graph:
    """Storages, their producers and their readers, as the planner will see them."""

    def __init__(self, gm: fx.GraphModule):
        self.jg: JointGraph = build_joint_graph(gm, None)
        jg = self.jg
        self.producer: dict[int, fx.Node] = {s: n for n in jg.compute for s in jg.outputs_of[n]}
        # storage -> nodes that read or write it: compute nodes and getitems (views are
        # emitted where their readers need them, so their readers count instead)
        self.touchers: dict[int, list[fx.Node]] = {}
        for n in gm.graph.nodes:
            if n.op != "call_function" or jg.is_view(n):
                continue
            for s in jg.arg_storages(n):
                self.touchers.setdefault(s, []).append(n)
        self._ancestors: dict[fx.Node, set[fx.Node]] = {}

    def storage(self, node: fx.Node) -> int | None:
        return self.jg.storage_of.get(node)

    def ancestors(self, node: fx.Node) -> set[fx.Node]:
        """Compute nodes every schedule runs before `node`: producers of what it reads, transitively."""
        if node in self._ancestors:
            return self._ancestors[node]
        seen: set[fx.Node] = set()
        stack = [node]
        while stack:
            x = stack.pop()
            for s in self.jg.arg_storages(x):
                p = self.producer.get(s)
                if p is not None and p not in seen:
                    seen.add(p)
                    stack.append(p)
        self._ancestors[node] = seen
        return seen

    def only_earlier_touchers(self, storage: int, op: fx.Node, allowed: Iterable[fx.Node]) -> bool:
        """Every node touching `storage`, but `op` and `allowed`, runs before `op` in every schedule."""
        skip = set(allowed) | {op}
        others = [t for t in self.touchers.get(storage, []) if t not in skip]
        if not others:
            return True
        before = self.ancestors(op)
        return all(t in before for t in others)

    def fresh(self, node: fx.Node) -> bool:
        """`node` holds a storage it allocated itself (not a view or alias of anything earlier)."""
        s = self.storage(node)
        if s is None:
            return False
        owner = node.args[0] if node.target is operator.getitem else node
        return self.producer.get(s) is owner and self.jg.storages[s].node is node


def _native_kernel(overload: torch._ops.OpOverload, device: torch.device) -> bool:
    """`overload` has a kernel of its own for `device` (autogenerated out= forms are composite)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key)


def _copied_value(v: fx.Node) -> fx.Node | None:
    """For `aten.copy(like, src)` and `aten.clone(src)`: the node whose values `v` holds."""
    if v.target is _COPY:
        non_blocking = v.args[2] if len(v.args) > 2 else v.kwargs.get("non_blocking", False)
        src = v.args[1]
    elif v.target is _CLONE:
        non_blocking, src = False, v.args[0]
    else:
        return None
    return src if isinstance(src, fx.Node) and _val(src) is not None and not non_blocking else None


def _copy_args(c: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(dst, src) of a plain `copy_(dst, src)` (no non_blocking)."""
    if c.op != "call_function" or c.target is not _COPY_ or len(c.args) < 2:
        return None
    non_blocking = c.args[2] if len(c.args) > 2 else c.kwargs.get("non_blocking", False)
    dst, src = c.args[0], c.args[1]
    if non_blocking or not isinstance(dst, fx.Node) or not isinstance(src, fx.Node):
        return None
    return dst, src


def _single_fold(g: _Graph, c: fx.Node, redirect_readers: bool) -> tuple | None:
    """(copy node, op, dst, target, args, kwargs) when `copy_(dst, op(...))` can become one write at `op`:
    `op.out(..., out=dst)`, or for `copy_(dst, aten.copy(like, src))`, `copy_(dst, src)`."""
    dst, v = _copy_args(c)
    if dst.op != "placeholder" or v.op != "call_function" or v.target is operator.getitem:
        return None
    target = v.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return None
    if torch.Tag.nondeterministic_seeded in target.tags:
        return None  # keep random streams exactly as captured
    dv, vv = _val(dst), _val(v)
    if dv is None or vv is None or not _same_layout(dv, vv) or not g.fresh(v):
        return None
    others = [u for u in v.users if u is not c]
    if others and (not redirect_readers or any(u.op == "output" for u in others)):
        return None  # the new value is read elsewhere (an output must not turn into an alias of dst)
    s = g.storage(dst)
    if s is None:
        return None
    src = _copied_value(v)
    if src is not None:
        # copy(like, src) is src broadcast and cast to like's shape and dtype, which are
        # dst's (and clone(src) is src): copy src into dst at once. src must not overlap dst.
        if s in g.jg.node_storages(src):
            return None
        if not g.only_earlier_touchers(s, v, [c]):
            return None
        return c, v, dst, _COPY_, (dst, src), {}
    found = out_overload(target)
    if found is None or not _native_kernel(found[0], dv.device):
        return None  # an out= form made of the functional op and a copy saves nothing
    overload, out_name = found
    if out_name in v.kwargs:
        return None
    pointwise = torch.Tag.pointwise in target.tags
    for a in v.all_input_nodes:
        if s in g.jg.node_storages(a):
            # an elementwise op may read and write the same elements; nothing may read
            # other elements of the storage it writes, and other ops may not read it at all
            va = _val(a)
            if not pointwise or va is None or not _same_layout(va, dv):
                return None
    if not g.only_earlier_touchers(s, v, [c]):
        return None
    return c, v, dst, overload, v.args, {**v.kwargs, out_name: dst}


def _foreach_fold(g: _Graph, op: fx.Node) -> tuple | None:
    """(op, in-place overload, copies, getitems) when every output of a foreach op is copied back into its first list."""
    inplace = inplace_foreach(op.target)
    if inplace is None or not op.args or not isinstance(op.args[0], (list, tuple)):
        return None
    xs = list(op.args[0])
    vals = op.meta.get("val")
    if not xs or not isinstance(vals, (list, tuple)) or len(vals) != len(xs):
        return None
    items: dict[int, fx.Node] = {}
    for u in op.users:
        if u.target is not operator.getitem or not isinstance(u.args[1], int) or u.args[1] in items:
            return None
        items[u.args[1]] = u
    if sorted(items) != list(range(len(xs))):
        return None
    copies = []
    storages = []
    for i, x in enumerate(xs):
        item = items[i]
        if not isinstance(x, fx.Node) or x.op != "placeholder" or len(item.users) != 1:
            return None
        (c,) = item.users
        args = _copy_args(c)
        if args is None or args != (x, item) or c.users:
            return None
        dx, di = _val(x), _val(item)
        if dx is None or di is None or not _same_layout(dx, di) or not g.fresh(item):
            return None
        s = g.storage(x)
        if s is None or s in storages:
            return None  # two list elements share a storage
        storages.append(s)
        copies.append(c)
    # the other arguments must not read any written storage (an in-place foreach op may
    # process the lists in any order)
    others: set[int] = set()
    for a in tree_leaves((op.args[1:], op.kwargs)):
        if isinstance(a, fx.Node):
            others.update(g.jg.node_storages(a))
    if others & set(storages):
        return None
    allowed = set(copies) | set(items.values())
    if not all(g.only_earlier_touchers(s, op, allowed) for s in storages):
        return None
    return op, inplace, copies, [items[i] for i in range(len(xs))]


def fold_copy_back(gm: fx.GraphModule, *, redirect_readers: bool = False) -> int:
    """Fold `copy_(input, new)` writes into the ops computing `new`, where that is safe; recompile `gm`.

    Returns the number of mutated inputs whose write was folded (a foreach op counts one
    per list element). Every mutated input keeps exactly one write: the folded op, or
    its copy_ where folding is unsafe. See the module docstring for when a fold is made.
    A copy_ whose source is a functional `aten.copy` copies that copy's source instead,
    and the write may then fold further into the op computing it.
    """
    folded: set[fx.Node] = set()
    while True:
        done = _fold_round(gm, redirect_readers)
        if not done:
            break
        folded.update(done)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return len(folded)


def _fold_round(gm: fx.GraphModule, redirect_readers: bool) -> list[fx.Node]:
    """One pass over the graph's copy_ nodes; the inputs whose writes it folded."""
    graph = gm.graph
    copies = [n for n in graph.nodes if _copy_args(n) is not None]
    if not copies:
        return []
    g = _Graph(gm)
    singles = []
    foreach_ops: dict[fx.Node, None] = {}
    used: set[fx.Node] = set()  # ops and inputs folded this round: one fold each, the next round sees the rest
    for c in copies:
        _dst, src = _copy_args(c)
        if src.target is operator.getitem and isinstance(src.args[0], fx.Node):
            foreach_ops[src.args[0]] = None
            continue
        fold = _single_fold(g, c, redirect_readers)
        if fold is not None and not {fold[1], fold[2]} & used:
            singles.append(fold)
            used.update((fold[1], fold[2]))
    groups = [f for f in (_foreach_fold(g, op) for op in foreach_ops) if f is not None]

    done: list[fx.Node] = []
    for c, op, dst, target, args, kwargs in singles:
        with graph.inserting_before(op):
            new = graph.call_function(target, args, kwargs)
        new.meta = {k: v for k, v in op.meta.items() if k not in ("val", "tensor_meta")}
        new.meta["val"] = dst.meta["val"]
        if "tensor_meta" in dst.meta:
            new.meta["tensor_meta"] = dst.meta["tensor_meta"]
        c.replace_all_uses_with(new)
        graph.erase_node(c)
        op.replace_all_uses_with(new)  # only with redirect_readers: later readers of the new value
        graph.erase_node(op)
        done.append(dst)
    for op, inplace, cs, items in groups:
        with graph.inserting_before(op):
            new = graph.call_function(inplace, op.args, dict(op.kwargs))
        new.meta = {k: v for k, v in op.meta.items() if k not in ("val", "tensor_meta")}
        new.meta["val"] = None  # in-place foreach ops return nothing
        for c in cs:
            done.append(c.args[0])
            graph.erase_node(c)
        for item in items:
            graph.erase_node(item)
        graph.erase_node(op)
    return done
