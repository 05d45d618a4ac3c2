"""Attention masks eager never makes: a mask that reads no input and is exactly causal becomes `is_causal=True`.

transformers' `create_causal_mask` passes SDPA no mask in eager (`is_causal=True` instead), but not while traced:
without a cache (`use_cache=False`, a training setup) it looks for packed sequences in `position_ids`, a check
that reads values and so is skipped under tracing, and the captured graph builds a [batch, 1, seq, seq] bool mask
from `arange` and `cumsum`. Each layer's SDPA turns it into a float mask (`where(mask, 0, -inf)`) that its backward
reads, so the step keeps batch x seq^2 x 4 bytes a layer from the forward to that layer's backward, all of them
live as the backward starts (a 4-layer Llama at batch 4 x 128: 1 MiB above eager's peak).

A mask computed from no input holds the same values every call: computed once here, where it equals the causal
mask the attention's `is_causal` applies, the attention runs as eager's does, causal and without the mask
(the CPU flash kernel gives bitwise the same results either way), and the mask is never made.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from .._torch import unset_fake_temporarily

_aten = torch.ops.aten
# forward and backward kernels: the position of is_causal among the arguments (attn_mask is keyword-only)
_IS_CAUSAL = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 7,
}
_DEFAULTS = {  # what a shorter call leaves out before is_causal: dropout_p
    _aten._scaled_dot_product_flash_attention_for_cpu.default: (0.0,),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (),
}
# computing a mask costs a few times its bytes on the host, once per capture; larger ones are left as they are
MAX_MASK_BYTES = 2**31


def causal_masks(gm: fx.GraphModule) -> int:
    """Run every CPU flash attention (forward and backward) whose mask reads no input and is causal as
    `is_causal=True` without the mask; drop the mask's computation. Returns how many calls changed."""
    verdicts: dict[tuple[fx.Node, tuple[int, int] | None], bool] = {}
    changed = 0
    masks = set()
    for node in [n for t in _IS_CAUSAL for n in gm.graph.find_nodes(op="call_function", target=t)]:
        mask = node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node) or _is_causal_arg(node):
            continue
        key = (mask, _query_key_lengths(node))
        if key not in verdicts:
            verdicts[key] = _is_causal_constant(*key)
        if verdicts[key]:
            _run_causal(node)
            masks.add(mask)
            changed += 1
    for mask in masks:
        _erase_unused(gm, mask)
    if changed:
        gm.recompile()
    return changed


def _is_causal_arg(node: fx.Node) -> bool:
    """Causal already, or called with its positional arguments by name (not as traced: left as it is)."""
    i = _IS_CAUSAL[node.target]
    return (len(node.args) > i and bool(node.args[i])) or bool({"dropout_p", "is_causal"} & set(node.kwargs))


def _query_key_lengths(node: fx.Node) -> tuple[int, int] | None:
    """(L, S) of the attention: the query's and key's sequence lengths (the backward's first operand is the
    output's gradient)."""
    first = 1 if node.target is _aten._scaled_dot_product_flash_attention_for_cpu_backward.default else 0
    q, k = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[first:first + 2])
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2 or k.dim() < 2:
        return None
    return int(q.shape[-2]), int(k.shape[-2])


def _run_causal(node: fx.Node) -> None:
    """The call with is_causal=True and no mask, its other arguments (the scale) kept."""
    i = _IS_CAUSAL[node.target]
    args = tuple(node.args)
    args = args + _DEFAULTS[node.target][: max(0, i - len(args))]
    node.args = args[:i] + (True,) + args[i + 1:]
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}


def _is_causal_constant(mask: fx.Node, lengths: tuple[int, int] | None) -> bool:
    """Whether `mask` is computed from no input by deterministic ops and its values are the causal mask
    (upper-left aligned, as `is_causal` applies it) of an L x S attention, for every batch and head."""
    val = mask.meta.get("val")
    if lengths is None or not isinstance(val, torch.Tensor) or val.dim() < 2 or tuple(val.shape[-2:]) != lengths:
        return False
    nodes = _constant_ancestry(mask)
    if nodes is None:
        return False
    with unset_fake_temporarily(), torch.no_grad():  # real tensors, while the graph's are fake
        value = _evaluate(nodes, mask)
        return value is not None and _equals_causal(value)


def _constant_ancestry(mask: fx.Node) -> list[fx.Node] | None:
    """`mask` and the nodes it is computed from, in graph order; None when one is an input (a placeholder, an
    attribute), random, mutating, or too large to compute here."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op != "call_function" or not _pure(node.target) or _nbytes(node) > MAX_MASK_BYTES:
            return None
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen]


def _pure(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ())


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _evaluate(nodes: list[fx.Node], mask: fx.Node) -> torch.Tensor | None:
    """The mask's values, computed on the host (the device may be one this machine lacks, the tensors fake);
    each intermediate freed after its last use. None when an op fails."""
    last_use = {a: n for n in nodes for a in n.all_input_nodes}
    env: dict[fx.Node, object] = {}
    cpu = torch.device("cpu")
    try:
        for node in nodes:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            if "device" in kwargs:
                kwargs = {**kwargs, "device": cpu}
            env[node] = node.target(*args, **kwargs)
            for a in node.all_input_nodes:
                if last_use.get(a) is node:
                    del env[a]
    except Exception:  # an op this path cannot run on the host: the mask stays
        return None
    value = env.get(mask)
    return value if isinstance(value, torch.Tensor) and value.device == cpu else None


def _equals_causal(value: torch.Tensor) -> bool:
    """Bool: True on and below the diagonal. Float: 0 there, -inf above. Compared per leading index (views:
    an expanded mask is not copied)."""
    rows, cols = value.shape[-2:]
    keep = torch.ones(rows, cols, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        expected = keep
    elif value.is_floating_point():
        expected = torch.zeros(rows, cols, dtype=value.dtype).masked_fill(~keep, float("-inf"))
    else:
        return False
    return all(torch.equal(value[idx], expected) for idx in itertools.product(*map(range, value.shape[:-2])))


def _erase_unused(gm: fx.GraphModule, mask: fx.Node) -> None:
    """Erase the mask and what computed it, as far as nothing else reads them (all pure: checked)."""
    erased: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in erased or node.users:
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)


__all__ = ["causal_masks"]
