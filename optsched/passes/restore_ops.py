"""Put back the ATen ops Dynamo splits into a product and an fma.

Dynamo traces `x.addcmul_(t1, t2, value=v)` as `fma(mul(t1, t2), v, x)` and
`x.addcdiv_(t1, t2, value=v)` as `fma(div(t1, t2), v, x)` (`prims.fma`, Inductor's
primitive: one rounding, so Inductor can emit a fused multiply-add). Outside Inductor
that costs three things: `prims.fma` runs as a Python reference, the product allocates a
temporary the size of the tensor, and the result differs from eager in the last bit
(eager's kernel rounds `t1 * t2 * v + x` differently). Optimizer steps are made of these.

It also traces `torch._foreach_lerp_(xs, ends, w)` (a float weight below 0.5, as Adam's
`1 - beta1`) as `_foreach_addcmul_(xs, [full_like(d, w) for d in diffs], diffs)` with
`diffs = _foreach_sub(ends, xs)`: two temporaries the size of every tensor in `xs`, which
doubles an Adam step's peak.

`restore_fused_pointwise` rewrites these back into the ATen op eager runs, so the
program computes what eager computes, in one kernel, with an `out=` (or in-place foreach)
form that `fold_copy_back` can turn into the in-place update eager does.
"""

from __future__ import annotations

import numbers

import torch
from torch import fx

from .._torch import OpOverload

__all__ = ["restore_fused_pointwise"]

_RESTORE = {  # the product fma multiplies by a scalar -> the ATen op computing x + v * (t1 op t2)
    torch.ops.aten.mul.Tensor: torch.ops.aten.addcmul.default,
    torch.ops.aten.div.Tensor: torch.ops.aten.addcdiv.default,
}


def _is_fma(target) -> bool:
    # prims.fma is registered when torch._inductor.inductor_prims is imported (Dynamo does so to emit it)
    return isinstance(target, OpOverload) and target.namespace == "prims" and target.overloadpacket.__name__ == "fma"


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _restorable(fma: fx.Node) -> tuple | None:
    """(product node, ATen op, x, t1, t2, v) for `fma(t1 op t2, v, x)` that the ATen op computes exactly."""
    if len(fma.args) != 3 or fma.kwargs:
        return None
    product, v, x = fma.args
    if not isinstance(product, fx.Node) or product.target not in _RESTORE or len(product.users) != 1:
        return None
    if product.kwargs or len(product.args) != 2 or not all(isinstance(a, fx.Node) for a in product.args):
        return None
    if not isinstance(v, numbers.Number) or isinstance(v, bool) or not isinstance(x, fx.Node):
        return None
    vals = [_val(n) for n in (fma, product, x, *product.args)]
    if any(t is None for t in vals):
        return None
    out, prod, xv, t1, t2 = vals
    # addcmul/addcdiv broadcast x, t1 and t2 together and compute in the common dtype: the
    # rewrite is exact only when that gives fma's own output, of x's dtype and shape
    if not (out.dtype == prod.dtype == xv.dtype == t1.dtype == t2.dtype) or out.shape != xv.shape:
        return None
    if out.device != xv.device:
        return None
    return product, _RESTORE[product.target], x, product.args[0], product.args[1], v


_FOREACH_ADDCMUL = torch.ops.aten._foreach_addcmul.Scalar
_FOREACH_SUB = torch.ops.aten._foreach_sub.List
_FULL_LIKE = torch.ops.aten.full_like.default


def _restore_foreach_lerp(graph: fx.Graph, addcmul: fx.Node) -> bool:
    """`_foreach_addcmul(xs, [full_like(d, w), ...], ds)` with `ds` the items of `_foreach_sub(ends, xs)`
    and nothing else reading them -> `_foreach_lerp(xs, ends, w)`."""
    args = addcmul.args
    value = addcmul.kwargs.get("value", args[3] if len(args) > 3 else 1)
    if len(args) < 3 or value != 1 or set(addcmul.kwargs) - {"value"}:
        return False
    xs, ws, ds = (list(a) if isinstance(a, (list, tuple)) else None for a in args[:3])
    if xs is None or ws is None or ds is None or not ds or not len(xs) == len(ws) == len(ds):
        return False
    sub = ds[0].args[0] if isinstance(ds[0], fx.Node) and ds[0].args else None
    if not isinstance(sub, fx.Node) or sub.target is not _FOREACH_SUB or sub.kwargs or len(sub.args) != 2:
        return False
    ends, sub_xs = (list(a) for a in sub.args)
    if sub_xs != xs or len(sub.users) != len(ds) or any(d.args != (sub, i) for i, d in enumerate(ds)):
        return False
    weights = set()
    for w, d in zip(ws, ds, strict=True):
        if not isinstance(w, fx.Node) or w.target is not _FULL_LIKE or w.args[0] is not d or len(w.users) != 1:
            return False
        if set(w.kwargs) - {"pin_memory"} or len(w.args) != 2 or set(d.users) != {w, addcmul}:
            return False
        weights.add(w.args[1])
    if len(weights) != 1:
        return False
    (weight,) = weights
    if not isinstance(weight, float) or not abs(weight) < 0.5:
        return False  # the polyfill's formula for |w| >= 0.5 is another pattern
    with graph.inserting_before(addcmul):
        lerp = graph.call_function(torch.ops.aten._foreach_lerp.Scalar, (xs, ends, weight))
    lerp.meta = dict(addcmul.meta)
    addcmul.replace_all_uses_with(lerp)
    graph.erase_node(addcmul)
    for w in ws:
        graph.erase_node(w)
    for d in ds:
        graph.erase_node(d)
    graph.erase_node(sub)
    return True


def restore_fused_pointwise(gm: fx.GraphModule) -> int:
    """Rewrite `fma(mul(t1, t2), v, x)` into `addcmul(x, t1, t2, value=v)`, `fma(div(t1, t2), v, x)`
    into `addcdiv(x, t1, t2, value=v)` where the product has no other reader, and Dynamo's
    foreach lerp back into `_foreach_lerp`; recompile `gm`.

    Returns the number of rewrites."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.target is _FOREACH_ADDCMUL and _restore_foreach_lerp(gm.graph, node):
            n += 1
            continue
        if node.op != "call_function" or not _is_fma(node.target):
            continue
        found = _restorable(node)
        if found is None:
            continue
        product, target, x, t1, t2, v = found
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(target, (x, t1, t2), {"value": v})
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(product)
        n += 1
    if n:
        gm.graph.lint()
        gm.recompile()
    return n
