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
written input. They run after `op` in program order, and the planner keeps them after the
write: `problem_builder.order_writes` gives every write an order token that later readers
of the storage take. The backend folds with it.

**Chains.** `xs.mul_(a).addcmul_(b, c)` on a list is traced as two functional foreach ops
and a copy back; when each intermediate list is read only by the next op, every op of the
chain runs in place on `xs` (as eager runs it), with no temporary list and no copy.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch import fx

from .._torch import OpOverload, dispatch_has_kernel_for_dispatch_key, tree_leaves
from ..capture.joint_graph import JointGraph, build_joint_graph
from .op_variants import inplace_foreach, out_overload

__all__ = ["fold_copy_back"]

_COPY_ = torch.ops.aten.copy_.default
_COPY = torch.ops.aten.copy.default  # functional copy and clone: their out= forms allocate a temporary
_CLONE = torch.ops.aten.clone.default


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


def _native_kernel(overload: OpOverload, device: torch.device) -> bool:
    """`overload` has a kernel of its own for `device` (autogenerated out= forms are composite)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return key is not None and dispatch_has_kernel_for_dispatch_key(overload.name(), key)


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
    if not isinstance(target, OpOverload) or target._schema.is_mutable:
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
    # readers of the copy's result read the new value: after the write in program order, and kept
    # there by the planner's order tokens
    after_write = [c, *c.users] if redirect_readers else [c]
    src = _copied_value(v)
    if src is not None:
        # copy(like, src) is src broadcast and cast to like's shape and dtype, which are
        # dst's (and clone(src) is src): copy src into dst at once. src must not overlap dst.
        if s in g.jg.node_storages(src):
            return None
        if not g.only_earlier_touchers(s, v, after_write):
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
    if not g.only_earlier_touchers(s, v, after_write):
        return None
    return c, v, dst, overload, v.args, {**v.kwargs, out_name: dst}


def output_items(op: fx.Node) -> list[fx.Node] | None:
    """The getitem of each output of a foreach op, in order, when it has exactly one per output and no other user."""
    vals = op.meta.get("val")
    if not isinstance(vals, (list, tuple)) or not vals:
        return None
    items: dict[int, fx.Node] = {}
    for u in op.users:
        if u.target is not operator.getitem or not isinstance(u.args[1], int) or u.args[1] in items:
            return None
        items[u.args[1]] = u
    if sorted(items) != list(range(len(vals))):
        return None
    return [items[i] for i in range(len(vals))]


def _foreach_chain(g: _Graph, op: fx.Node, dsts: list[fx.Node]) -> list[fx.Node] | None:
    """Foreach ops F1, ..., Fk = `op`, each one's first list the outputs of the one before (read by
    nothing else), F1's first list `dsts`: `dsts.mul_(a).addcmul_(b, c)` traced functionally. Each can
    run in place on `dsts`."""
    chain = [op]
    cur = op
    while list(cur.args[0]) != dsts:
        first = list(cur.args[0])
        producers = {a.args[0] for a in first if isinstance(a, fx.Node) and a.target is operator.getitem}
        if len(producers) != 1 or len(chain) > 32:
            return None
        (prev,) = producers
        if inplace_foreach(prev.target) is None or not prev.args or not isinstance(prev.args[0], (list, tuple)):
            return None
        if output_items(prev) != first:
            return None
        leaves = tree_leaves((cur.args, cur.kwargs))
        for item, dst in zip(first, dsts, strict=True):
            if set(item.users) != {cur} or sum(a is item for a in leaves) != 1:
                return None  # read elsewhere, or twice by the next op
            if not g.fresh(item) or not _same_layout(_val(item), _val(dst)):
                return None
        chain.insert(0, prev)
        cur = prev
    return chain


def _foreach_fold(g: _Graph, op: fx.Node, redirect_readers: bool) -> tuple | None:
    """(chain, copies, getitems, dsts) when every output of a foreach op is copied back into the first
    list of the chain of foreach ops computing it (see `_foreach_chain`); the chain then runs in place.

    With `redirect_readers`, outputs may have other readers (not the graph's output): they
    read the written input instead."""
    if inplace_foreach(op.target) is None or not op.args or not isinstance(op.args[0], (list, tuple)):
        return None
    items = output_items(op)
    if items is None or len(items) != len(op.args[0]):
        return None
    copies, dsts, storages = [], [], []
    for item in items:
        copies_back = [u for u in item.users if (a := _copy_args(u)) is not None and a[1] is item]
        readers = [u for u in item.users if u not in copies_back]
        if len(copies_back) != 1 or (readers and (not redirect_readers or any(u.op == "output" for u in readers))):
            return None
        (c,) = copies_back
        x = c.args[0]
        if x.op != "placeholder" or (c.users and (not redirect_readers or any(u.op == "output" for u in c.users))):
            return None
        dx, di = _val(x), _val(item)
        if dx is None or di is None or not _same_layout(dx, di) or not g.fresh(item):
            return None
        s = g.storage(x)
        if s is None or s in storages:
            return None  # two list elements share a storage
        storages.append(s)
        copies.append(c)
        dsts.append(x)
    chain = _foreach_chain(g, op, dsts)
    if chain is None:
        return None
    # the other arguments must not read any written storage (an in-place foreach op may
    # process the lists in any order)
    others: set[int] = set()
    for f in chain:
        for a in tree_leaves((f.args[1:], f.kwargs)):
            if isinstance(a, fx.Node):
                others.update(g.jg.node_storages(a))
    if others & set(storages):
        return None
    allowed = set(copies) | set(items) | set(chain) | {i for f in chain[:-1] for i in output_items(f)}
    allowed |= {u for c in copies for u in c.users}  # readers of the copy's result: the new value
    if not all(g.only_earlier_touchers(s, chain[0], allowed) for s in storages):
        return None
    return chain, copies, items, dsts


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
    groups = [f for f in (_foreach_fold(g, op, redirect_readers) for op in foreach_ops) if f is not None]

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
    for chain, cs, items, dsts in groups:
        for c, dst in zip(cs, dsts, strict=True):
            c.replace_all_uses_with(dst)  # only with redirect_readers: readers of the copy's result
            graph.erase_node(c)
        for item, dst in zip(items, dsts, strict=True):
            item.replace_all_uses_with(dst)  # only with redirect_readers: later readers of the new values
        for f in chain:
            with graph.inserting_before(f):
                new = graph.call_function(inplace_foreach(f.target), (dsts, *f.args[1:]), dict(f.kwargs))
            new.meta = {k: v for k, v in f.meta.items() if k not in ("val", "tensor_meta")}
            new.meta["val"] = None  # in-place foreach ops return nothing
        for f in reversed(chain):
            for item in output_items(f):
                graph.erase_node(item)
            graph.erase_node(f)
        done += dsts
    return done
