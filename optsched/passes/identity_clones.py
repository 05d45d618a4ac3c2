"""Drop the copies eager never makes: `clone(x)` where eager returns `x` itself.

Dropout with p=0 in training mode (nn.TransformerEncoderLayer's default in many configs, HF models
with `*_dropout=0.0`) returns its input in eager, but traces as `aten.clone`: a full copy that the
backward then saves beside the original (+2 MiB a layer on a small encoder, all of it above eager's
peak). The same copy comes from an in-place activation whose backward reads its input (`nn.SiLU(inplace=True)`,
`Hardswish(inplace=True)`: autograd saves `self.clone()` before `silu_` overwrites it): eager writes the
activation into `x` and keeps the copy, two buffers; the functional graph makes a new activation and the
copy, three, the copy made at the backward's start beside the `x` it copies (EfficientNet's and
MobileNetV3's blocks: +4% over eager). In the functional joint graph nothing writes into either value
(the only writes, BatchNorm's running statistics copied back into its buffers, go to the caller's inputs),
so reading `x` wherever the clone was read computes the same numbers without the copy.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

_CLONE = torch.ops.aten.clone.default


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.storage_offset() == b.storage_offset()


def _written_storages(gm: fx.GraphModule) -> set | None:
    """The storages mutating ops write (their arguments the schema marks as written), or None when one
    writes something whose storage is not known (then no copy is dropped)."""
    out = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
            for a in value if isinstance(value, (list, tuple)) else [value]:
                v = a.meta.get("val") if isinstance(a, fx.Node) else None
                if not isinstance(v, torch.Tensor):
                    return None
                out.add(StorageWeakRef(v.untyped_storage()))
    return out


def drop_identity_clones(gm: fx.GraphModule) -> int:
    """Replace each clone of an intermediate value that keeps its layout, that no op writes into (nor into
    the clone) and that is not a graph output, by the value itself. Returns how many were dropped."""
    outputs = set(gm.graph.find_nodes(op="output")[0].all_input_nodes)
    written = _written_storages(gm)
    if written is None:
        return 0
    dropped = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=_CLONE)):
        src = node.args[0]
        a, b = node.meta.get("val"), getattr(src, "meta", {}).get("val")
        if (
            not isinstance(src, fx.Node)
            or src.op != "call_function"  # inputs and tangents: their storage belongs to the caller
            or node in outputs
            or not isinstance(a, torch.Tensor)
            or not isinstance(b, torch.Tensor)
            or not _same_layout(a, b)
            or b.untyped_storage().nbytes() != b.numel() * b.element_size()  # a view of more: reading it would keep all
            or {StorageWeakRef(a.untyped_storage()), StorageWeakRef(b.untyped_storage())} & written
        ):
            continue
        old_storage = a.untyped_storage()
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        _revalue_views(src, old_storage)
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def _revalue_views(src: fx.Node, old_storage) -> None:
    """Views that were views of the dropped copy are now views of `src`: recompute their fake values, whose
    storages are how the planner tells a view (no new memory) from a new tensor."""
    val = src.meta["val"]
    mode = getattr(val, "fake_mode", None)
    stack = list(src.users)
    while stack:
        user = stack.pop()
        uval = user.meta.get("val")
        if not isinstance(uval, torch.Tensor) or uval.untyped_storage() is not old_storage and (
            uval.untyped_storage()._cdata != old_storage._cdata
        ):
            continue
        args, kwargs = fx.node.map_arg((user.args, user.kwargs), lambda n: n.meta.get("val"))
        with mode if mode is not None else torch.no_grad():
            user.meta["val"] = user.target(*args, **kwargs)
        stack.extend(user.users)


__all__ = ["drop_identity_clones"]
