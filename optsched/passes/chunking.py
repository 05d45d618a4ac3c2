"""Chunking: the LM head + cross-entropy of a joint graph run in token chunks, one after another.

    hidden [N, h] ─mm(·, weight_t)─> logits [N, V] ─views─> _log_softmax ─> nll_loss_forward ─> loss
    backward: nll_loss_backward ─> _log_softmax_backward_data ─views─> mm(grad, weight) (grad of hidden)
                                                                   └─> mm(grad.t(), hidden) (grad of weight)

`find_chains` finds that chain in a joint graph (torch's decomposition of `F.linear` without bias +
`F.cross_entropy`, as nanoGPT-style models and transformers' `ForCausalLMLoss` produce it: views and
reshapes between the matmul and the log-softmax, labels from any path, `ignore_index`, mean or sum
reduction) and says why it leaves a candidate alone. `chunk(gm, k)` replaces each chain with one
`lower/chunked_ce.linear_cross_entropy` node, which computes the loss and both gradients run by run
(only one run's logits alive), and two `mul` nodes in the backward that scale the precomputed
gradients by the loss's incoming gradient. k = 1 is the same fused form with one run.

The planner (`Planner._solve_chunked`) tries each count of `CHUNK_COUNTS` on a copy of the graph
(`copy_graph`) and keeps the fastest plan that fits the budget.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..lower.chunked_ce import OP

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default}
_DETACH = {aten.detach.default, aten.alias.default}


@dataclass
class Chain:
    """One LM head + cross-entropy chain of a joint graph (its nodes)."""

    name: str
    matmul: fx.Node  # mm(hidden, weight_t)
    loss: fx.Node  # nll_loss_forward
    loss_backward: fx.Node  # nll_loss_backward
    grad_hidden: fx.Node | None  # mm(grad_logits, weight_t.t()) -> [N, h]
    grad_weight: fx.Node | None  # mm(grad_logits.t(), hidden) -> [V, h], or mm(hidden.t(), grad_logits) -> [h, V]
    removed: list[fx.Node]  # every node of the chain the chunked form replaces

    @property
    def hidden(self) -> fx.Node:
        return self.matmul.args[0]

    @property
    def weight_t(self) -> fx.Node:
        return self.matmul.args[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, hidden, vocabulary)."""
        rows, h = _val(self.hidden).shape
        return int(rows), int(h), int(_val(self.weight_t).shape[1])

    def describe(self) -> dict:
        rows, h, vocab = self.shape
        return {"rows": rows, "hidden": h, "vocab": vocab, "matmul": self.matmul.name, "loss": self.loss.name}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _users(node: fx.Node) -> list[fx.Node]:
    return list(node.users)


def _through_views(node: fx.Node, ops: set) -> tuple[fx.Node, list[fx.Node]]:
    """Walk from `node` back through single-user `ops` nodes: the first other node and the ones passed."""
    passed = []
    while node.op == "call_function" and node.target in ops and len(node.users) == 1:
        passed.append(node)
        node = node.args[0]
    return node, passed


def _rows_kept(views: list[fx.Node], rows: int, vocab: int) -> bool:
    """Every view keeps the last dimension (vocabulary) contiguous and whole, so row i of the end is row i
    of the matmul."""
    for v in views:
        val = _val(v)
        if not isinstance(val, torch.Tensor) or val.shape[-1] != vocab or val.numel() != rows * vocab or \
                not val.is_contiguous():
            return False
    return True


def _forward_views(node: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """The single-user view chain from `node` down to the first non-view, and that node."""
    views = []
    while len(node.users) == 1:
        (user,) = node.users
        if user.op == "call_function" and user.target in _VIEWS:
            views.append(user)
            node = user
        else:
            return views, user
    return views, None


def find_chains(gm: fx.GraphModule) -> tuple[list[Chain], list[str]]:
    """The chunkable LM head + cross-entropy chains of a joint graph, and why each other cross-entropy
    (an `nll_loss_forward`) is left alone."""
    chains: list[Chain] = []
    skipped: list[str] = []
    for loss in gm.graph.find_nodes(op="call_function", target=aten.nll_loss_forward.default):
        why, chain = _match(loss, f"lm_head{'_' + str(len(chains) + 1) if chains else ''}")
        if chain is not None:
            chains.append(chain)
        else:
            skipped.append(f"{loss.name}: {why}")
    return chains, skipped


def _match(loss: fx.Node, name: str) -> tuple[str, Chain | None]:
    lsm, target, weight, reduction, ignore_index = (list(loss.args) + [None, 1, -100])[:5]
    if weight is not None:
        return "class weights", None
    if reduction not in (1, 2):
        return "reduction 'none' (per-token losses)", None
    if not (isinstance(lsm, fx.Node) and lsm.target is aten._log_softmax.default):
        return "input is not a log_softmax", None
    x, dim, half_to_float = lsm.args
    xv = _val(x)
    if half_to_float or not isinstance(xv, torch.Tensor) or xv.dim() != 2 or dim not in (1, -1):
        return "log_softmax is not over the last dimension of a 2-d input", None
    mm, views = _through_views(x, _VIEWS)
    if mm.target is aten.addmm.default:
        return "the LM head has a bias", None
    if mm.target is not aten.mm.default or len(mm.users) != 1:
        return "the logits do not come from a matmul used only by the loss", None
    hidden, weight_t = mm.args
    rows, vocab = xv.shape
    if _val(hidden).dim() != 2 or _val(mm).shape != (rows, vocab) or not _rows_kept([mm, *views, x], rows, vocab):
        return "the logits' rows are not the matmul's rows", None
    if len(x.users) != 1:
        return "the logits have other readers", None
    # the log-softmax: read by the loss, its backward, and detached copies its backward reads
    loss_bw = [u for u in lsm.users if u.target is aten.nll_loss_backward.default]
    detached = []
    stack = [u for u in lsm.users if u.target in _DETACH]
    while stack:
        d = stack.pop()
        detached.append(d)
        stack += [u for u in d.users if u.target in _DETACH]
    if len(loss_bw) != 1:
        return "no single nll_loss_backward (no gradient flows into the loss)", None
    (loss_bw,) = loss_bw
    lsm_bw = _users(loss_bw)
    if len(lsm_bw) != 1 or lsm_bw[0].target is not aten._log_softmax_backward_data.default:
        return "the loss's backward is not followed by the log_softmax's", None
    (lsm_bw,) = lsm_bw
    allowed = {loss, loss_bw, *detached}
    if any(u not in allowed for u in lsm.users) or any(
            u not in allowed and u is not lsm_bw for d in detached for u in d.users):
        return "the log-probabilities have other readers", None
    if loss_bw.args[1] is not lsm or loss_bw.args[2] is not target or loss_bw.args[4:6] != (reduction, ignore_index):
        return "the loss's backward does not match its forward", None
    getitems = {u.args[1]: u for u in loss.users if u.target is operator.getitem}
    if set(getitems) - {0, 1} or len(getitems) != len(loss.users):
        return "the loss's outputs are read as a tuple", None
    if len(loss_bw.args) > 6 and loss_bw.args[6] is not getitems.get(1):
        return "the loss's backward does not read the loss's total weight", None
    grad_views, grad_end = _forward_views(lsm_bw)
    grad = grad_views[-1] if grad_views else lsm_bw
    if _val(grad).shape != (rows, vocab) or not _rows_kept([lsm_bw, *grad_views], rows, vocab):
        return "the logits' gradient is not viewed back as the matmul's rows", None
    grad_hidden = grad_weight = None
    extra = []
    for u in _users(grad):
        if u.target is aten.mm.default and u.args[0] is grad and _is_t_of(u.args[1], weight_t):
            grad_hidden = u
        elif u.target is aten.t.default and len(u.users) == 1:
            (mm2,) = u.users
            if mm2.target is aten.mm.default and mm2.args == (u, hidden):
                grad_weight, extra = mm2, [u]
            else:
                return "the logits' gradient has other readers", None
        elif u.target is aten.mm.default and u.args[1] is grad and u.args[0].target is aten.t.default and \
                u.args[0].args[0] is hidden:
            grad_weight = u
        else:
            return "the logits' gradient has other readers", None
    removed = [mm, *views, x, lsm, *detached, loss, loss_bw, lsm_bw, *grad_views, *extra]
    removed += [n for n in (grad_hidden, grad_weight) if n is not None]
    return "", Chain(name, mm, loss, loss_bw, grad_hidden, grad_weight, list(dict.fromkeys(removed)))


def _is_t_of(node, of: fx.Node) -> bool:
    return isinstance(node, fx.Node) and node.target is aten.t.default and node.args[0] is of


def _fake(target, *args, **kwargs):
    args, kwargs = fx.map_arg((args, kwargs), _val)
    mode = detect_fake_mode([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
    if mode is None:
        return target(*args, **kwargs)
    with mode:
        return target(*args, **kwargs)


def _call(graph: fx.Graph, target, args: tuple, like: fx.Node | None = None) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = _fake(target, *args)
    if like is not None and "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    return node


def chunk(gm: fx.GraphModule, chunks: int | dict[str, int]) -> list[Chain]:
    """Replace every chain (`find_chains`) with its chunked form in `chunks` runs (an int: every chain, 1
    included, as one fused run; a dict: per chain name, a chain with 1 or no entry left as captured, as
    plan files record them). Returns the chains it replaced (their nodes are gone from the graph)."""
    chains, _ = find_chains(gm)
    if isinstance(chunks, dict):
        chains = [c for c in chains if chunks.get(c.name, 1) > 1]
    graph = gm.graph
    for chain in chains:
        k = chunks[chain.name] if isinstance(chunks, dict) else chunks
        loss, loss_bw = chain.loss, chain.loss_backward
        _, target, _, reduction, ignore_index = (list(loss.args) + [None, 1, -100])[:5]
        with graph.inserting_before(loss):
            fused = _call(graph, OP, (chain.hidden, chain.weight_t, target, int(k), int(ignore_index), reduction == 1),
                          like=chain.matmul)
            fused.meta["chunking"] = {"chain": chain.name, "chunks": int(k)}
            items = []
            for i in range(4):
                g = graph.call_function(operator.getitem, (fused, i))
                g.meta["val"] = fused.meta["val"][i]
                items.append(g)
        for u in list(loss.users):
            u.replace_all_uses_with(items[u.args[1]])
        go = loss_bw.args[0]
        changed = set(items)
        with graph.inserting_before(loss_bw):
            if chain.grad_hidden is not None:
                gh = _call(graph, aten.mul.Tensor, (items[2], go), like=chain.grad_hidden)
                chain.grad_hidden.replace_all_uses_with(gh)
                changed.add(gh)
            if chain.grad_weight is not None:
                gw = _call(graph, aten.mul.Tensor, (items[3], go), like=chain.grad_weight)
                if _val(chain.grad_weight).shape != _val(gw).shape:  # mm(hidden.t(), grad): [h, V]
                    gw = _call(graph, aten.t.default, (gw,))
                chain.grad_weight.replace_all_uses_with(gw)
                changed.add(gw)
        left = list(reversed(chain.removed))
        while left:  # readers first; a node goes once nothing reads it (its tuple items included)
            for n in left:
                for u in list(n.users):
                    if u.op == "call_function" and u.target is operator.getitem and not u.users:
                        graph.erase_node(u)
            gone = [n for n in left if not n.users]
            if not gone:
                raise RuntimeError(f"chunking {chain.name}: {left[0].name} is still read by {list(left[0].users)}")
            for n in gone:
                graph.erase_node(n)
            left = [n for n in left if n not in gone]
        _drop_dead_views(graph)
        _refresh_views(graph, changed)
    graph.lint()
    gm.recompile()
    return chains


def _is_view_op(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None \
        and not schema.returns[0].alias_info.is_write


def _refresh_views(graph: fx.Graph, changed: set[fx.Node]) -> None:
    """Views of the new values get new fake values: memory is keyed by storage (capture/joint_graph.py), and a
    view's old value still points at the storage of the node it viewed before."""
    for n in graph.nodes:
        if n.op == "call_function" and _is_view_op(n.target) and any(a in changed for a in n.all_input_nodes):
            n.meta["val"] = _fake(n.target, *n.args, **n.kwargs)
            changed.add(n)


def _drop_dead_views(graph: fx.Graph) -> None:
    """Views and tuple items nobody reads any more (the weight's transposes the old backward read)."""
    cheap = _VIEWS | _DETACH | {aten.t.default, operator.getitem}
    for n in reversed(list(graph.nodes)):
        if n.op == "call_function" and not n.users and n.target in cheap:
            graph.erase_node(n)


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` with its own graph (node names kept) sharing node metadata values, so fake tensors
    and their storages stay the same objects (views are still found by storage)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    return fx.GraphModule(gm, graph)
