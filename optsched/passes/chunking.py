"""Chunking: the LM head + cross-entropy of a joint graph run in token chunks, one after another.

    hidden [N, h] ─mm(·, weight_t) / addmm(bias, ·, weight_t)─> logits [N, V] ─(rows kept)─> _log_softmax
        ─> nll_loss_forward ─> loss
    backward: nll_loss_backward ─> _log_softmax_backward_data ─(the same, backwards)─> mm(grad, weight) (grad
        of hidden), mm(grad.t(), hidden) (grad of weight), sum(grad, rows) (grad of bias)

Between the matmul and the log-softmax, `find_chains` follows what the LM heads people train put there
(each seen in captured graphs, torch 2.13, transformers 5.x):

- views and reshapes (`view`, `_unsafe_view`, `reshape`, `alias`): the logits' rows stay the matmul's;
- a bias: `addmm` (`nn.Linear` on 2-d rows, or 3-d ones flattened), or `mm` + `add` of a [V] vector
  (`x @ W.t() + b`); its gradient is a `sum` over the rows in the backward;
- the float32 upcast of half logits (`_to_copy`, transformers' `ForCausalLMLoss`: `logits.float()`),
  and the cast of their gradient back in the backward;
- a slice of rows (`logits[:, :-1]`, the shift of causal LMs written by hand or by older transformers;
  `slice` + `clone`/`_unsafe_view`, `slice_backward` in the backward): the rows the loss does not read
  take no loss and no gradient;
- the logits as a forward output too (HF models called with `labels=` return them with the loss): the
  chunked op writes them whole, and the backward adds what the logits' incoming gradient gives (the
  zeros of an output no gradient flowed into cost no matmul: `passes/chunked_ce.linear_cross_entropy_backward`).

Labels may come from any path (transformers' `pad` + `slice` shift; `ignore_index`); mean or sum
reduction. Tied embeddings need nothing: the head's weight gradient is one of the two terms the graph
already adds. `find_chains` says why it leaves a cross-entropy alone (`skipped`), and `why_no_chain`
what it saw when there is none. `chunk(gm, k)` replaces each chain with one
`passes/chunked_ce.linear_cross_entropy` node, which computes the loss and all gradients run by run (only
one run's logits alive), and the backward's scaling of those gradients by the loss's incoming gradient.
k = 1 is the same fused form with one run.

The planner (planning.variants) tries each count of `CHUNK_COUNTS` on a copy of the graph
(`copy_graph`) and keeps the fastest plan that fits the budget.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .._torch import detect_fake_mode
from .chunked_ce import BACKWARD_OP, OP

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default}
_DETACH = {aten.detach.default, aten.alias.default}
_MATMULS = {aten.mm.default, aten.addmm.default}
_HALF = (torch.float16, torch.bfloat16)


@dataclass
class Chain:
    """One LM head + cross-entropy chain of a joint graph (its nodes, and what the kernel must do)."""

    name: str
    matmul: fx.Node  # mm(hidden, weight_t) or addmm(bias, hidden, weight_t)
    loss: fx.Node  # nll_loss_forward
    loss_backward: fx.Node  # nll_loss_backward
    grad_hidden: fx.Node | None  # mm(grad_logits, weight_t.t()) -> [N, h]
    grad_weight: fx.Node | None  # mm(grad_logits.t(), hidden) -> [V, h], or mm(hidden.t(), grad_logits) -> [h, V]
    removed: list[fx.Node]  # every node of the chain the chunked form replaces
    hidden: fx.Node = None  # type: ignore[assignment]
    weight_t: fx.Node = None  # type: ignore[assignment]
    bias: fx.Node | None = None  # addmm's, or the [V] vector added to the matmul's output
    grad_bias: fx.Node | None = None  # sum(grad_logits, rows)
    upcast: bool = False  # half logits, float32 log-softmax
    row_slice: tuple[int, int, int, int] | None = None  # (length, start, stop, inner): see passes/chunked_ce
    exported: list[fx.Node] = field(default_factory=list)  # logits (or views of them) that are forward outputs
    tangent: fx.Node | None = None  # the incoming gradient of those logits, read by the backward

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, hidden, vocabulary)."""
        rows, h = _val(self.hidden).shape
        return int(rows), int(h), int(_val(self.weight_t).shape[1])

    def describe(self) -> dict:
        rows, h, vocab = self.shape
        return {"rows": rows, "hidden": h, "vocab": vocab, "matmul": self.matmul.name, "loss": self.loss.name,
                "bias": self.bias is not None, "upcast": self.upcast, "row_slice": self.row_slice,
                "logits_output": bool(self.exported)}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node) -> tuple[int, ...] | None:
    v = _val(node)
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _dtype(node):
    v = _val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _target_name(node: fx.Node) -> str:
    if node.op == "output":
        return "the step's output"
    t = node.target
    return str(getattr(t, "_overloadpacket", t)).replace("aten.", "").replace("<built-in function ", "").rstrip(">")


def _is_t_of(node, of: fx.Node) -> bool:
    return isinstance(node, fx.Node) and node.target is aten.t.default and node.args[0] is of


def _is_tangent(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "placeholder" and "tangents" in node.name


def _slice_bounds(shape: tuple[int, ...], dim: int, start, end) -> tuple[int, int, int]:
    """A slice's dim (from 0) and [start, stop) as Python's slicing clamps them."""
    dim = dim % len(shape)
    size = shape[dim]
    start, stop, _ = slice(0 if start is None else int(start), size if end is None else int(end)).indices(size)
    return dim, start, max(start, stop)


def _slice_args(node: fx.Node) -> list:
    """A `slice.Tensor` node's (dim, start, end), defaults filled in."""
    given = list(node.args[1:4])
    return given + [0, None, None][len(given):]


def _only_outputs(node: fx.Node) -> bool:
    """`node` is the step's output, or views whose readers are only outputs and views."""
    if node.op == "output":
        return True
    return node.op == "call_function" and node.target in _VIEWS and bool(node.users) and \
        all(_only_outputs(u) for u in node.users)


def find_chains(gm: fx.GraphModule) -> tuple[list[Chain], list[str]]:
    """The chunkable LM head + cross-entropy chains of a joint graph, and why each other cross-entropy
    (an `nll_loss_forward`) is left alone."""
    chains: list[Chain] = []
    skipped: list[str] = []
    for loss in gm.graph.find_nodes(op="call_function", target=aten.nll_loss_forward.default):
        why, chain = _match(gm, loss, f"lm_head{'_' + str(len(chains) + 1) if chains else ''}")
        if chain is not None:
            chains.append(chain)
        else:
            skipped.append(f"{loss.name}: {why}")
    return chains, skipped


def why_no_chain(gm: fx.GraphModule, skipped: list[str] | None = None) -> str:
    """Why `find_chains` finds nothing in `gm`, in words: its reasons for each cross-entropy, or, without
    one, what follows the forward's largest matmul (the likeliest LM head)."""
    if skipped is None:
        skipped = find_chains(gm)[1]
    if skipped:
        return "; ".join(skipped)
    from_tangents = set(gm.graph.find_nodes(op="placeholder"))
    from_tangents = {p for p in from_tangents if _is_tangent(p)}
    heads = []
    for n in gm.graph.nodes:
        if any(a in from_tangents for a in n.all_input_nodes):
            from_tangents.add(n)
        elif n.op == "call_function" and n.target in _MATMULS and _shape(n) is not None:
            heads.append(n)
    if not heads:
        return "no cross-entropy (nll_loss_forward) and no matmul in the step's forward"
    head = max(heads, key=lambda n: math.prod(_shape(n)))
    node, seen = head, 0
    while len(node.users) == 1 and seen < 32:
        (user,) = node.users
        if user.op != "call_function" or user.target not in _VIEWS | {aten._to_copy.default, aten.clone.default,
                                                                      aten.slice.Tensor}:
            break
        node, seen = user, seen + 1
    readers = sorted({_target_name(u) for u in node.users if u not in from_tangents and not (  # the forward's,
        u.op == "call_function" and _target_name(u).endswith("_like"))})  # not zeros_like and the like (shape only)
    what = f"the op after the head's matmul ({head.name}, {list(_shape(head))}) is {' and '.join(readers) or 'nothing'}"
    if readers == ["the step's output"]:
        return f"no cross-entropy (nll_loss_forward) in the step: {what}; compute the loss inside the optimized function"
    return f"no cross-entropy (nll_loss_forward) in the step: {what}, not _log_softmax"


@dataclass
class _Forward:
    """What lies between the head's matmul and the log-softmax's input."""

    path: list[fx.Node]  # from the matmul's reader to the log-softmax's input, in program order
    bias: fx.Node | None = None
    add: fx.Node | None = None  # mm + add: the add
    upcast: fx.Node | None = None
    slice: fx.Node | None = None


def _walk_forward(x: fx.Node, vocab: int) -> tuple[str, fx.Node | None, _Forward | None]:
    """From the log-softmax's input back to the head's matmul through the ops chunking covers."""
    path, node = [], x
    fw = _Forward([])
    while node.op == "call_function" and node.target not in _MATMULS:
        t = node.target
        shape = _shape(node)
        if shape is None or shape[-1] != vocab:
            return f"{node.name} ({_target_name(node)}) between the matmul and the log_softmax changes the vocabulary " \
                   "dimension", None, None
        if t in _VIEWS:
            nxt = node.args[0]
        elif t is aten.clone.default and node.kwargs.get("memory_format") in (None, torch.contiguous_format):
            nxt = node.args[0]
        elif t is aten._to_copy.default:
            src = node.args[0]
            if fw.upcast is not None or set(node.kwargs) - {"dtype", "layout", "device", "memory_format"} or \
                    _dtype(node) is not torch.float32 or _dtype(src) not in _HALF or \
                    _val(node).device != _val(src).device:
                return f"{node.name}: a copy between the matmul and the log_softmax other than one float32 upcast of " \
                       "half logits", None, None
            if fw.add is not None:
                return "the bias is added after the float32 upcast", None, None
            fw.upcast, nxt = node, src
        elif t is aten.slice.Tensor:
            if fw.slice is not None or len(node.args) > 4 and node.args[4] != 1:
                return f"{node.name}: more than one slice, or a strided one, of the logits", None, None
            if fw.add is not None:
                return "the bias is added after the logits are sliced", None, None
            fw.slice, nxt = node, node.args[0]
        elif t is aten.add.Tensor and not node.kwargs and fw.add is None:
            a, b = node.args[:2]
            vec = [v for v in (a, b) if isinstance(v, fx.Node) and _shape(v) == (vocab,)]
            if len(vec) != 1 or not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
                return f"{node.name}: an add between the matmul and the log_softmax that is not a [vocabulary] bias", \
                    None, None
            fw.bias = vec[0]
            fw.add, nxt = node, (b if vec[0] is a else a)
        else:
            return f"the op between the head's matmul and the log_softmax is {_target_name(node)} ({node.name}), " \
                   "which chunking does not cover", None, None
        path.append(node)
        if not isinstance(nxt, fx.Node):
            return "the log_softmax's input does not come from a matmul", None, None
        node = nxt
    if node.op != "call_function":
        return f"the log_softmax's input comes from {node.name}, not from a matmul", None, None
    fw.path = list(reversed(path))
    return "", node, fw


def _match(gm: fx.GraphModule, loss: fx.Node, name: str) -> tuple[str, Chain | None]:
    lsm, target, weight, reduction, ignore_index = (list(loss.args) + [None, 1, -100])[:5]
    if weight is not None:
        return "class weights", None
    if reduction not in (1, 2):
        return "reduction 'none' (per-token losses)", None
    if not (isinstance(lsm, fx.Node) and lsm.target is aten._log_softmax.default):
        return f"the loss's input is {_target_name(lsm) if isinstance(lsm, fx.Node) else lsm!r}, not a log_softmax", None
    x, dim, half_to_float = lsm.args
    xv = _val(x)
    if half_to_float or not isinstance(xv, torch.Tensor) or xv.dim() != 2 or dim not in (1, -1):
        return "log_softmax is not over the last dimension of a 2-d input", None
    rows_read, vocab = (int(s) for s in xv.shape)
    why, mm, fw = _walk_forward(x, vocab)
    if mm is None:
        return why, None
    if mm.kwargs:
        return f"{mm.name}: a scaled matmul (beta/alpha)", None
    if mm.target is aten.addmm.default:
        if fw.bias is not None:
            return "two biases", None
        bias, hidden, weight_t = mm.args
        if _shape(bias) != (vocab,):
            return f"{mm.name}: addmm's added input is not a [vocabulary] bias", None
    else:
        hidden, weight_t = mm.args
        bias = fw.bias
    hs, ws = _shape(hidden), _shape(weight_t)
    if hs is None or len(hs) != 2 or ws is None or len(ws) != 2 or ws != (hs[1], vocab) or _shape(mm) != (hs[0], vocab):
        return "the logits do not come from a [tokens, hidden] x [hidden, vocabulary] matmul", None
    rows = hs[0]
    dtype = _dtype(mm)
    # rows: the matmul's up to the slice, the loss's after it
    row_slice = None
    full_part = [mm, *fw.path]
    if fw.slice is not None:
        full_part = full_part[:full_part.index(fw.slice)]
        src_shape = _shape(fw.slice.args[0])
        sdim, start, stop = _slice_bounds(src_shape, *_slice_args(fw.slice))
        if sdim == len(src_shape) - 1:
            return "the logits are sliced along the vocabulary", None
        length, inner = src_shape[sdim], math.prod(src_shape[sdim + 1:-1])
        if math.prod(src_shape[:-1]) != rows or rows_read != math.prod(src_shape[:sdim]) * (stop - start) * inner:
            return "the sliced logits' rows are not the matmul's", None
        row_slice = (length, start, stop, inner)
    elif rows_read != rows:
        return "the logits' rows are not the matmul's", None
    if any(math.prod(_shape(n)) != rows * vocab for n in full_part):
        return "the logits' rows are not the matmul's", None
    if fw.upcast is None and dtype != _dtype(x):
        return "the logits change dtype before the log_softmax", None
    # readers: the chain's next node; the logits (full rows, model dtype, bias added) may also be outputs
    chain_next = {n: nxt for n, nxt in zip([mm, *fw.path], [*fw.path, lsm])}
    order = [mm, *fw.path]
    lo = order.index(fw.add) if fw.add is not None else 0
    hi = min([order.index(n) for n in (fw.upcast, fw.slice) if n is not None], default=len(order))
    stage = order[lo:hi]  # the logits as the kernel makes them: bias added, every row, the model's dtype
    exported = []
    for n, nxt in chain_next.items():
        others = [u for u in n.users if u is not nxt]
        if not others:
            continue
        if n in stage and all(_only_outputs(u) for u in others):
            exported.append(n)
            continue
        u = others[0]
        return f"the logits ({n.name}) have other readers: {u.name} ({_target_name(u)})", None
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
    lsm_bw = list(loss_bw.users)
    if len(lsm_bw) != 1 or lsm_bw[0].target is not aten._log_softmax_backward_data.default:
        return "the loss's backward is not followed by the log_softmax's (label smoothing, or another loss term)", None
    (lsm_bw,) = lsm_bw
    allowed = {loss, loss_bw, *detached}
    if any(u not in allowed for u in lsm.users) or any(
            u not in allowed and u is not lsm_bw for d in detached for u in d.users):
        return "the log-probabilities have other readers", None
    if loss_bw.args[1] is not lsm or loss_bw.args[2] is not target or tuple(loss_bw.args[4:6]) != (reduction, ignore_index):
        return "the loss's backward does not match its forward", None
    getitems = {u.args[1]: u for u in loss.users if u.target is operator.getitem}
    if set(getitems) - {0, 1} or len(getitems) != len(loss.users):
        return "the loss's outputs are read as a tuple", None
    if len(loss_bw.args) > 6 and loss_bw.args[6] is not getitems.get(1):
        return "the loss's backward does not read the loss's total weight", None
    why, bw = _walk_backward(gm, lsm_bw, fw, hidden, weight_t, bias, exported, rows, vocab, dtype)
    if bw is None:
        return why, None
    removed = [mm, *fw.path, lsm, *detached, loss, loss_bw, *bw["path"], *bw["extra"]]
    removed += [n for n in (bw["grad_hidden"], bw["grad_weight"], bw["grad_bias"]) if n is not None]
    chain = Chain(name, mm, loss, loss_bw, bw["grad_hidden"], bw["grad_weight"], list(dict.fromkeys(removed)),
                  hidden=hidden, weight_t=weight_t, bias=bias, grad_bias=bw["grad_bias"], upcast=fw.upcast is not None,
                  row_slice=row_slice, exported=exported, tangent=bw["tangent"])
    return "", chain


def _walk_backward(gm, lsm_bw, fw: _Forward, hidden, weight_t, bias, exported, rows, vocab, dtype):
    """From the log-softmax's backward to the gradient matmuls: the forward's steps undone (views, the cast
    back, `slice_backward`), the logits' own incoming gradient added, the bias's gradient summed."""
    path, extra = [lsm_bw], []
    down = slice_bw = t_add = grad_bias = None
    bias_sum_before_add = False
    grad_hidden = grad_weight = None
    cur = lsm_bw
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    while True:
        shape = _shape(cur)
        full = shape is not None and math.prod(shape) == rows * vocab and (fw.slice is None or slice_bw is not None)
        model_dtype = _dtype(cur) == dtype and (fw.upcast is None or down is not None)
        nxt = []
        for u in cur.users:
            t = u.target
            if t is aten.sum.dim_IntList and bias is not None and grad_bias is None and full and model_dtype and \
                    isinstance(u.args[1], (list, tuple)) and \
                    sorted(d % len(shape) for d in u.args[1]) == list(range(len(shape) - 1)):
                grad_bias, bias_sum_before_add = u, t_add is None
            elif t in _VIEWS or t is aten._to_copy.default or t is aten.slice_backward.default or \
                    t is aten.add.Tensor and any(_is_tangent(a) for a in u.args[:2]):
                nxt.append(u)
            elif t is aten.mm.default and u.args[0] is cur and _is_t_of(u.args[1], weight_t):
                grad_hidden = u
            elif t is aten.t.default and len(u.users) == 1 and \
                    next(iter(u.users)).target is aten.mm.default and next(iter(u.users)).args == (u, hidden):
                grad_weight, extra = next(iter(u.users)), [u]
            elif t is aten.mm.default and u.args[1] is cur and _is_t_of(u.args[0], hidden):
                grad_weight = u
            else:
                return f"the logits' gradient ({cur.name}) has other readers: {u.name} ({_target_name(u)})", None
        if not nxt:
            break
        if len(nxt) > 1 or grad_hidden is not None or grad_weight is not None:
            return f"the logits' gradient ({cur.name}) is read in more than one way", None
        (u,) = nxt
        us = _shape(u)
        if us is None or us[-1] != vocab:
            return f"{u.name} ({_target_name(u)}) changes the vocabulary dimension of the logits' gradient", None
        if u.target is aten._to_copy.default:
            if fw.upcast is None or down is not None or _dtype(u) != dtype or \
                    set(u.kwargs) - {"dtype", "layout", "device", "memory_format"}:
                return f"{u.name}: a cast of the logits' gradient that does not undo the forward's upcast", None
            down = u
        elif u.target is aten.slice_backward.default:
            src = fw.slice
            if src is None or slice_bw is not None:
                return f"{u.name}: a slice_backward the forward has no slice for", None
            _, sizes, sdim, start, end, step = u.args
            want = _slice_bounds(_shape(src.args[0]), *_slice_args(src))
            if tuple(sizes) != _shape(src.args[0]) or step != 1 or \
                    _slice_bounds(tuple(sizes), sdim, start, end) != want:
                return f"{u.name}: a slice_backward that does not undo the forward's slice", None
            slice_bw = u
        elif u.target is aten.add.Tensor:
            tangent = next(a for a in u.args[:2] if _is_tangent(a))
            other = u.args[1] if u.args[0] is tangent else u.args[0]
            if t_add is not None or u.kwargs or other is not cur or not full or not model_dtype or \
                    _shape(tangent) != us or not _tangent_of_exported(out_node, tangent, exported, gm):
                return f"{u.name}: a gradient added to the logits' that is not the incoming gradient of the logits " \
                       "the step returns", None
            t_add = u
        path.append(u)
        cur = u
    if fw.upcast is not None and down is None or fw.slice is not None and slice_bw is None:
        return "the logits' gradient is not cast back, or not un-sliced, as the forward did", None
    if _shape(cur) != (rows, vocab) or _dtype(cur) != dtype:
        return "the logits' gradient does not reach the matmuls as the matmul's [rows, vocabulary]", None
    if grad_bias is not None and bias_sum_before_add and t_add is not None:
        return "the bias's gradient is summed before the logits' incoming gradient is added", None
    return "", {"path": path, "extra": extra, "grad_hidden": grad_hidden, "grad_weight": grad_weight,
                "grad_bias": grad_bias, "tangent": t_add and next(a for a in t_add.args[:2] if _is_tangent(a))}


def _tangent_of_exported(out_node: fx.Node, tangent: fx.Node, exported: list[fx.Node], gm: fx.GraphModule) -> bool:
    """`tangent` is the incoming gradient of a forward output that is (a view of) the exported logits."""
    from ..capture.output_usage import tangent_outputs

    (idx,) = tangent_outputs(gm, [tangent])
    outs = out_node.args[0]
    if idx is None or not isinstance(outs, (list, tuple)) or idx >= len(outs) or not isinstance(outs[idx], fx.Node):
        return False
    node = outs[idx]
    while node not in exported and node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node in exported


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


def _items(graph: fx.Graph, node: fx.Node, n: int) -> list[fx.Node]:
    items = []
    for i in range(n):
        g = graph.call_function(operator.getitem, (node, i))
        g.meta["val"] = node.meta["val"][i]
        items.append(g)
    return items


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
        rows, _, vocab = chain.shape
        args = (chain.hidden, chain.weight_t, target, int(k), int(ignore_index), reduction == 1, chain.bias,
                chain.upcast, list(chain.row_slice) if chain.row_slice else None, bool(chain.exported))
        with graph.inserting_before(loss):
            fused = _call(graph, OP, args, like=chain.matmul)
            fused.meta["chunking"] = {"chain": chain.name, "chunks": int(k)}
            items = _items(graph, fused, 6)
        changed = set(items)
        for u in list(loss.users):
            u.replace_all_uses_with(items[u.args[1]])
        inside = set(chain.removed)
        for p in chain.exported:  # the step returns the logits: the op's, viewed as the output read them
            with graph.inserting_before(loss):
                shape = _shape(p)
                if shape == (rows, vocab):
                    new = items[5]
                else:
                    view = p.target if p.target in (aten.view.default, aten._unsafe_view.default) else \
                        aten._unsafe_view.default
                    new = _call(graph, view, (items[5], list(shape)), like=p)
                    changed.add(new)
            for u in list(p.users):
                if u not in inside:
                    u.replace_input_with(p, new)
        go = loss_bw.args[0]
        with graph.inserting_before(loss_bw):
            if chain.tangent is not None:  # the logits' own incoming gradient goes through the head too
                bw = _call(graph, BACKWARD_OP, (go, items[2], items[3], items[4], chain.tangent, chain.hidden,
                                                chain.weight_t), like=chain.loss_backward)
                gh, gw, gb = _items(graph, bw, 3)
                changed |= {gh, gw, gb}
            else:
                gh = _call(graph, aten.mul.Tensor, (items[2], go), like=chain.grad_hidden) \
                    if chain.grad_hidden is not None else None
                gw = _call(graph, aten.mul.Tensor, (items[3], go), like=chain.grad_weight) \
                    if chain.grad_weight is not None else None
                gb = _call(graph, aten.mul.Tensor, (items[4], go), like=chain.grad_bias) \
                    if chain.grad_bias is not None else None
                changed |= {n for n in (gh, gw, gb) if n is not None}
            if chain.grad_hidden is not None:
                chain.grad_hidden.replace_all_uses_with(gh)
            if chain.grad_weight is not None:
                if _shape(chain.grad_weight) != _shape(gw):  # mm(hidden.t(), grad): [h, V]
                    gw = _call(graph, aten.t.default, (gw,))
                    changed.add(gw)
                chain.grad_weight.replace_all_uses_with(gw)
            if chain.grad_bias is not None:
                if _shape(chain.grad_bias) != _shape(gb):  # sum(..., keepdim=True): [1, V]
                    gb = _call(graph, aten.view.default, (gb, list(_shape(chain.grad_bias))))
                    changed.add(gb)
                chain.grad_bias.replace_all_uses_with(gb)
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
