"""Repeated layers traced once and stamped: a joint graph of N identical blocks built from the trace of 4.

Tracing the joint graph costs about a millisecond a node (AOTAutograd under fake tensors): 21 s of the
30 s a user waits for 80 Llama-7B layers. The blocks of a ModuleList of one kind give the same nodes
block after block, so the graph of N blocks is the graph of 4 with block 2's forward and backward
repeated N - 3 times: each copy reads the previous copy where the template read block 1, the next
copy's backward where it read block 3's, and its own parameters. (Block 0 is left as traced: its
input may need no gradient, which changes its nodes.) Node names continue as the
trace numbers them (each base name advances by what one block uses of it), so a plan made on the
stamped graph names the nodes a full trace (optimize() on the GPU) gives.

Whether the blocks repeat is checked, not assumed: the caller traces 5 blocks too and keeps the stamp
only when stamping 4 into 5 gives that trace node for node (names, ops, arguments, shapes, strides,
dtypes, which values share storage); otherwise it traces all N. A block's nodes are told apart by
autograd's sequence numbers, recorded at the block's entry and exit (`BlockBounds`): forward nodes and
the backward nodes that differentiate them carry the number of the op they come from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .._torch import FakeTensor, tree_leaves, unset_fake_temporarily

MIN_BLOCKS = 12  # below this, tracing 4 + 5 blocks to stamp saves little
TEMPLATE_BLOCKS = 4  # blocks 0 (its input may need no gradient: it can differ), 1, the template (2), 3
TEMPLATE = TEMPLATE_BLOCKS - 2  # the block copied: the blocks before and after it are alike
CHECK_BLOCKS = 5  # the trace the stamp is checked against: copies reading copies on both sides


@dataclass
class RepeatedBlocks:
    """A ModuleList of blocks of one kind: `parent.<name>` holds `blocks`."""

    parent: torch.nn.Module
    name: str
    blocks: list[torch.nn.Module]

    def shortened(self, k: int):
        """Context: the list holds its first k blocks while inside."""
        return _Shortened(self, k)


class _Shortened:
    def __init__(self, rep: RepeatedBlocks, k: int):
        self.rep, self.k = rep, k

    def __enter__(self):
        setattr(self.rep.parent, self.rep.name, torch.nn.ModuleList(self.rep.blocks[: self.k]))

    def __exit__(self, *exc):
        setattr(self.rep.parent, self.rep.name, torch.nn.ModuleList(self.rep.blocks))


def _settings(module: torch.nn.Module) -> dict:
    """A block's non-tensor attributes, module by module: blocks alike in these run alike, unless their callers
    branch on the index (the traced check catches a period of up to 5 blocks)."""
    out = {}
    for name, sub in module.named_modules():
        out[(name, "class")] = type(sub).__qualname__
        for k, v in vars(sub).items():
            if not k.startswith("_") and not isinstance(v, (torch.Tensor, torch.nn.Module)):
                out[(name, k)] = v if type(v) in (int, float, bool, str, type(None)) else repr(v)
    return out


def _alike(first: dict, other: dict, index: int) -> bool:
    """Block `index`'s settings are block 0's, but for ints that are each block's index (transformers' layer_idx)."""
    return first.keys() == other.keys() and all(
        v == other[k] or (type(v) is int and v == 0 and other[k] == index) for k, v in first.items())


def _shapes(module: torch.nn.Module) -> list:
    return [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in [*module.named_parameters(), *module.named_buffers()]]


def find_repeated_blocks(module: torch.nn.Module) -> RepeatedBlocks | None:
    """The longest ModuleList (at least MIN_BLOCKS) whose blocks are one class with the same parameter
    shapes and settings and share no tensor with each other or the rest of the model; None if there is none."""
    best = None
    for parent in module.modules():
        for name, child in parent.named_children():
            if not isinstance(child, torch.nn.ModuleList) or len(child) < MIN_BLOCKS:
                continue
            blocks = list(child)
            first = blocks[0]
            if any(type(b) is not type(first) or _shapes(b) != _shapes(first) for b in blocks):
                continue
            settings = _settings(first)
            if not all(_alike(settings, _settings(b), i) for i, b in enumerate(blocks)):
                continue
            if best is None or len(blocks) > len(best.blocks):
                best = RepeatedBlocks(parent, name, blocks)
    if best is None or _shares_tensors(module, best.blocks):
        return None
    return best


def _shares_tensors(module: torch.nn.Module, blocks: list[torch.nn.Module]) -> bool:
    owners: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for t in [*b.parameters(), *b.buffers()]:
            if owners.setdefault(id(t), i) != i:
                return True
    inside = set(owners)
    outside = [t for _, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
               if id(t) in inside]
    return len(outside) != len(inside)  # a block's tensor also held outside the blocks (tied)


class BlockBounds:
    """Records autograd's sequence number at each block's entry and exit; the last run of the forward (the
    joint trace's) is the one kept. Use as a context around the trace."""

    def __init__(self, blocks: list[torch.nn.Module]):
        self.blocks = blocks
        self.bounds: dict[int, list[int]] = {}
        self._handles: list = []

    @staticmethod
    def available() -> bool:
        from .._torch import get_sequence_nr
        return get_sequence_nr is not None

    def __enter__(self):
        from .._torch import get_sequence_nr as seq
        for i, b in enumerate(self.blocks):
            self._handles.append(b.register_forward_pre_hook(lambda _m, _a, i=i: self.bounds.__setitem__(i, [seq(), seq()])))
            self._handles.append(b.register_forward_hook(lambda _m, _a, _o, i=i: self.bounds[i].__setitem__(1, seq())))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def block_of(self, node: fx.Node) -> int | None:
        s = node.meta.get("seq_nr")
        if s is None:
            return None
        for i, (lo, hi) in self.bounds.items():
            if lo <= s < hi:
                return i
        return None


class NotRepeating(Exception):  # noqa: N818 (an answer, not a failure: the caller traces all blocks)
    """The traced graph does not split into repeating blocks as stamping needs."""


@dataclass
class _Layout:
    """Index ranges of the 4-block trace's node list (half-open)."""

    nodes: list[fx.Node]
    fwd: list[tuple[int, int]]  # block j's forward
    bwd: list[tuple[int, int]]  # block j's backward
    params: list[list[fx.Node]]  # block j's parameter placeholders, in graph order

    def span(self, r: tuple[int, int]) -> list[fx.Node]:
        return self.nodes[r[0]:r[1]]


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _layout(gm: fx.GraphModule, bounds: BlockBounds) -> _Layout:
    nodes = list(gm.graph.nodes)
    k = TEMPLATE_BLOCKS
    fwd_idx: dict[int, list[int]] = {j: [] for j in range(k)}
    bwd_idx: dict[int, list[int]] = {j: [] for j in range(k)}
    for i, n in enumerate(nodes):
        j = bounds.block_of(n) if n.op == "call_function" else None
        if j is not None:
            (bwd_idx if _is_backward(n) else fwd_idx)[j].append(i)
    if any(not fwd_idx[j] or not bwd_idx[j] for j in range(k)):
        raise NotRepeating("a block has no forward or no backward nodes")
    # forward: block j runs from its first node to block j+1's first; backward (in reverse order of blocks)
    # from block j's first node to block j-1's first: nodes between (gradient sums) belong to the block before them
    fwd = [(fwd_idx[j][0], fwd_idx[j + 1][0]) for j in range(k - 1)] + [(fwd_idx[k - 1][0], fwd_idx[k - 1][-1] + 1)]
    bwd = [(bwd_idx[0][0], bwd_idx[0][-1] + 1)] + [(bwd_idx[j][0], bwd_idx[j - 1][0]) for j in range(1, k)]
    for j in range(k):
        for (lo, hi), idx in ((fwd[j], fwd_idx[j]), (bwd[j], bwd_idx[j])):
            if idx[-1] >= hi or any(bounds.block_of(n) not in (None, j) for n in nodes[lo:hi]):
                raise NotRepeating(f"block {j}'s nodes are not contiguous")
    spans = {j: set(nodes[fwd[j][0]:fwd[j][1]]) | set(nodes[bwd[j][0]:bwd[j][1]]) for j in range(k)}
    params: list[list[fx.Node]] = [[] for _ in range(k)]
    for n in nodes:
        if n.op != "placeholder" or not n.users:
            continue
        users = {u for u in n.users if u.op != "output"}
        owner = [j for j in range(k) if users and users <= spans[j]]
        if owner:
            params[owner[0]].append(n)
    layout = _Layout(nodes, fwd, bwd, params)
    _check_alike(layout)
    return layout


def _check_alike(lay: _Layout) -> None:
    def sig(ns):  # a graph attribute (a constant) by its name less the number
        return [(n.op, _split(n)[0] if n.op == "get_attr" else n.target) for n in ns]
    prev, t, nxt = TEMPLATE - 1, TEMPLATE, TEMPLATE + 1
    t_f, t_b = lay.span(lay.fwd[t]), lay.span(lay.bwd[t])
    if sig(lay.span(lay.fwd[prev])) != sig(t_f) or sig(lay.span(lay.fwd[nxt])) != sig(t_f):
        raise NotRepeating("the blocks' forwards differ")
    if sig(lay.span(lay.bwd[nxt])) != sig(t_b):
        raise NotRepeating("the blocks' backwards differ")
    if not (len(lay.params[prev]) == len(lay.params[t]) == len(lay.params[nxt]) > 0):
        raise NotRepeating("the blocks' parameters differ")


_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")


_ATTR = re.compile(r"^(.*?)(\d+)$")


def _split(x: fx.Node) -> tuple[str, int]:
    """A node's name as (base, counter): FX numbers names base, base_1, base_2...; graph attributes (AOTAutograd's
    lifted constants) _tensor_constant0, _tensor_constant1..."""
    if x.op == "get_attr" and (m := _ATTR.match(x.name)):
        return f"attr:{m.group(1)}", int(m.group(2))
    m = _NAME.match(x.name)
    return m.group(1), int(m.group(2) or 0)


def _join(base: str, num: int) -> str:
    if base.startswith("attr:"):
        return f"{base[5:]}{num}"
    return f"{base}_{num}" if num else base


def _advances(a: list[fx.Node], b: list[fx.Node]) -> dict[str, int]:
    """How far each base name's counter moves from one block to the next (a's node p -> b's node p)."""
    out: dict[str, int] = {}
    for x, y in zip(a, b):
        (bx, nx), (by, ny) = _split(x), _split(y)
        if bx != by or out.setdefault(bx, ny - nx) != ny - nx:
            raise NotRepeating(f"node names do not advance alike ({x.name} -> {y.name})")
    return out


@dataclass
class _Template:
    """Block TEMPLATE's nodes, and the blocks beside it mapped onto them position by position."""

    fwd: list[fx.Node]
    bwd: list[fx.Node]
    params: list[fx.Node]
    prev: dict[fx.Node, fx.Node]  # a node of the block before -> the template's node in its place
    next: dict[fx.Node, fx.Node]  # a node of the block after -> the template's node in its place
    d_fwd: dict[str, int]  # how far a base name's counter advances per block, forward ...
    d_bwd: dict[str, int]  # ... and backward


def _template(lay: _Layout) -> _Template:
    prev, t, nxt = TEMPLATE - 1, TEMPLATE, TEMPLATE + 1
    t_f, t_b, params = lay.span(lay.fwd[t]), lay.span(lay.bwd[t]), lay.params[t]
    before = {x: t_f[p] for p, x in enumerate(lay.span(lay.fwd[prev]))} | dict(zip(lay.params[prev], params))
    after = ({x: t_f[p] for p, x in enumerate(lay.span(lay.fwd[nxt]))}
             | {x: t_b[p] for p, x in enumerate(lay.span(lay.bwd[nxt]))} | dict(zip(lay.params[nxt], params)))
    return _Template(t_f, t_b, params, before, after,
                     _advances(t_f, lay.span(lay.fwd[nxt])), _advances(lay.span(lay.bwd[nxt]), t_b))


class _Stamper:
    """Builds the N-block graph from the 4-block one (see the module docstring). Copy c (TEMPLATE to N - 2) is
    block c; env maps (a node of the 4-block graph, its copy or None) to the new graph's node."""

    def __init__(self, gm: fx.GraphModule, lay: _Layout, n_blocks: int):
        self.gm, self.lay, self.n = gm, lay, n_blocks
        self.tp = _template(lay)
        self.own = set(self.tp.fwd) | set(self.tp.bwd) | set(self.tp.params)
        self.env: dict[tuple[fx.Node, int | None], fx.Node] = {}
        self.attrs: dict[str, object] = {}  # the new graph's attributes (constants) by name
        self.values = _Values(lay.nodes, self.resolve)
        self._primal = 0

    # which copy a node of the 4-block graph stands for, read from copy `c` (None: outside the template)
    def resolve(self, x: fx.Node, c: int | None, region: int) -> fx.Node:
        if x in self.own:
            return self.env[(x, c if c is not None else region)]
        if c is not None and x in self.tp.prev and c > TEMPLATE:
            return self.env[(self.tp.prev[x], c - 1)]
        if c is not None and x in self.tp.next and c < self.n - 2:
            return self.env[(self.tp.next[x], c + 1)]
        return self.env[(x, None)]

    def build(self) -> fx.GraphModule:
        lay, n, tp, t = self.lay, self.n, self.tp, TEMPLATE
        extra = n - TEMPLATE_BLOCKS
        (f_lo, f_hi), (b_lo, _b_hi) = lay.fwd[t], lay.bwd[t]
        g = fx.Graph()
        for i, x in enumerate(lay.nodes):
            base = _split(x)[0]
            if x is tp.params[0]:  # every copy's parameters where the template's are
                for c in range(t, n - 1):
                    for q in tp.params:
                        self._placeholder(g, q, c)
            elif x.op == "placeholder" and x not in self.own:
                self._placeholder(g, x, None)
            elif x is tp.fwd[0]:  # every copy's forward, in order
                for c in range(t, n - 1):
                    for y in tp.fwd:
                        self._copy(g, y, c, c, (c - t) * tp.d_fwd.get(_split(y)[0], 0))
            elif x is tp.bwd[0]:  # every copy's backward, the last block's first
                for c in range(n - 2, t - 1, -1):
                    for y in tp.bwd:
                        b = _split(y)[0]
                        self._copy(g, y, c, c, extra * tp.d_fwd.get(b, 0) + (n - 2 - c) * tp.d_bwd.get(b, 0))
            elif x in self.own:
                continue
            elif x.op == "output":
                self._output(g, x)
            elif i < f_lo:  # before the template: as traced
                self._copy(g, x, None, t, 0)
            elif f_hi <= i < b_lo:  # the last block's forward and backward, the loss's: reading the last copy
                self._copy(g, x, None, n - 2, extra * tp.d_fwd.get(base, 0))
            else:  # the first blocks' backward: reading the template
                self._copy(g, x, None, t, extra * (tp.d_fwd.get(base, 0) + tp.d_bwd.get(base, 0)))
        from .._torch import make_graph_module  # lazy: its code generated when first run, as the trace's modules
        return fx.GraphModule(self.attrs, g) if make_graph_module is None else make_graph_module(self.attrs, g)

    def _placeholder(self, g: fx.Graph, x: fx.Node, c: int | None) -> None:
        if x.name.startswith("primals_"):
            self._primal += 1
            name = f"primals_{self._primal}"
        else:
            name = x.name
        y = g.placeholder(name)
        if y.name != name:
            raise NotRepeating(f"stamped name {name} taken")
        y.meta = dict(x.meta)
        y.meta["val"] = self.values.of(x, c, TEMPLATE)
        self.env[(x, c)] = y

    def _copy(self, g: fx.Graph, x: fx.Node, c: int | None, region: int, shift: int) -> None:
        base, num = _split(x)
        name = _join(base, num + shift)
        target = x.target
        if x.op == "get_attr":  # each copy its own constant, as the trace lifts one per block
            if x.target != x.name:
                raise NotRepeating(f"graph attribute {x.target} named {x.name}")
            target = name
            self.attrs[name] = getattr(self.gm, x.target)
        y = g.create_node(x.op, target, fx.node.map_arg(x.args, lambda a: self.resolve(a, c, region)),
                          fx.node.map_arg(x.kwargs, lambda a: self.resolve(a, c, region)), name=name)
        if y.name != name:
            raise NotRepeating(f"stamped name {name} taken")
        y.meta = dict(x.meta)
        y.meta["val"] = self.values.of(x, c, region)
        self.env[(x, c)] = y

    def _output(self, g: fx.Graph, x: fx.Node) -> None:
        outs = list(x.args[0])
        primals = [p for p in self.lay.nodes if p.op == "placeholder" and p.name.startswith("primals_")]
        n_fwd = len(outs) - len(primals)
        if n_fwd < 0:
            raise NotRepeating("the joint graph's outputs are not its forward outputs and one gradient per input")
        grad_of = dict(zip(primals, outs[n_fwd:]))
        t = TEMPLATE
        new_outs = [fx.node.map_arg(o, lambda a: self.resolve(a, None, t)) for o in outs[:n_fwd]]
        params = self.tp.params
        for p in primals:
            if p in params and p is not params[0]:
                continue
            copies = [(q, c) for c in range(t, self.n - 1) for q in params] if p is params[0] else [(p, None)]
            for q, c in copies:
                gr = grad_of[q]
                new_outs.append(fx.node.map_arg(gr, lambda a, c=c: self.resolve(a, c, t)))
        y = g.output(new_outs)
        y.meta = dict(x.meta)


class _Values:
    """The stamped nodes' values (fake tensors): a copy's own storages new for copies after the template, storages
    of other nodes those of the nodes the copy reads (`resolve`), so that views alias as in a trace."""

    def __init__(self, nodes: list[fx.Node], resolve):
        self.resolve = resolve
        self.owner: dict[StorageWeakRef, tuple[fx.Node, int]] = {}  # a storage -> the first node (and leaf) holding it
        for x in nodes:
            for li, t in enumerate(_leaves(x)):
                self.owner.setdefault(StorageWeakRef(t.untyped_storage()), (x, li))

    def of(self, x: fx.Node, c: int | None, region: int):
        """x's value as copy c (None: outside the template, reading copy `region`) holds it."""
        leaves = iter([self._leaf(x, li, t, c, region) for li, t in enumerate(_leaves(x))])
        return _replace_leaves(x.meta.get("val"), leaves)

    def _leaf(self, x: fx.Node, li: int, t: torch.Tensor, c: int | None, region: int) -> torch.Tensor:
        o, oli = self.owner[StorageWeakRef(t.untyped_storage())]
        if o is x and li == oli:  # x made this storage
            return t if c is None or c == TEMPLATE else _fake_like(t, None)
        src = _leaves(self.resolve(o, c, region))[oli]
        if StorageWeakRef(src.untyped_storage()) == StorageWeakRef(t.untyped_storage()):
            return t
        return _fake_like(t, src)


def _fake_like(t: torch.Tensor, storage_of: torch.Tensor | None) -> torch.Tensor:
    """A fake tensor with t's geometry over `storage_of`'s storage (None: a new one). Built on the meta device
    and wrapped: through the fake mode's dispatch it took 0.5 ms a tensor (a third of a trace's cost)."""
    with unset_fake_temporarily():
        if storage_of is None:
            base = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device="meta")
        else:
            st = storage_of.untyped_storage()
            base = torch.empty(0, dtype=torch.uint8, device="meta").set_(st, 0, (st.nbytes(),), (1,))
        meta = base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    return FakeTensor(t.fake_mode, meta, t.device)


def _leaves(x: fx.Node) -> list[torch.Tensor]:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if isinstance(val, torch.Tensor):  # most nodes (the pytree walk took a third of the stamping)
        return [val]
    return [v for v in tree_leaves(val) if isinstance(v, torch.Tensor)]


def _replace_leaves(val, leaves):
    if isinstance(val, torch.Tensor):
        return next(leaves)
    if isinstance(val, (list, tuple)):
        return type(val)(_replace_leaves(v, leaves) for v in val)
    return val


def stamp(gm: fx.GraphModule, bounds: BlockBounds, n_blocks: int) -> fx.GraphModule:
    """The joint graph of `n_blocks` blocks from `gm`, the trace of TEMPLATE_BLOCKS (with their `bounds`).
    Raises NotRepeating where the trace does not split into alike blocks."""
    if n_blocks < TEMPLATE_BLOCKS:
        raise ValueError(f"stamping makes {TEMPLATE_BLOCKS} blocks or more, not {n_blocks}")
    return _Stamper(gm, _layout(gm, bounds), n_blocks).build()


def _geometry(x: fx.Node) -> list:
    return [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes()) for t in _leaves(x)]


def _sharing(gm: fx.GraphModule) -> list:
    """Per node and leaf: the first (node, leaf) holding its storage, by name."""
    first: dict[StorageWeakRef, tuple[str, int]] = {}
    out = []
    for x in gm.graph.nodes:
        for li, t in enumerate(_leaves(x)):
            out.append(first.setdefault(StorageWeakRef(t.untyped_storage()), (x.name, li)))
    return out


def first_difference(a: fx.GraphModule, b: fx.GraphModule) -> str | None:
    """Where two joint graphs differ (names, ops, targets, arguments, value geometry, storage sharing), or None."""
    xs, ys = list(a.graph.nodes), list(b.graph.nodes)
    if len(xs) != len(ys):
        return f"{len(xs)} nodes against {len(ys)}"

    def names(v):
        return repr(fx.node.map_arg(v, lambda n: f"%{n.name}"))
    for x, y in zip(xs, ys):
        if (x.name, x.op, x.target) != (y.name, y.op, y.target):
            return f"{x.name} ({x.op} {x.target}) against {y.name} ({y.op} {y.target})"
        if names(x.args) != names(y.args) or names(x.kwargs) != names(y.kwargs):
            return f"{x.name}'s arguments"
        if _geometry(x) != _geometry(y) or x.meta.get("partitioner_tag") != y.meta.get("partitioner_tag"):
            return f"{x.name}'s value"
    if _sharing(a) != _sharing(b):
        return "storage sharing"
    return None
