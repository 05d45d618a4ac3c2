"""Other forms of an ATen op: its out= overload, its in-place foreach twin.

The planner writes a value into a storage that is dying (an activation) or being
replaced (an optimizer's state); these lookups say which overload does that with the
same arguments, read from the op schemas.
"""

from __future__ import annotations

import functools

import torch

from .._torch import OpOverload

__all__ = ["inplace_foreach", "out_overload", "out_variant"]


@functools.cache
def out_variant(target: OpOverload) -> tuple[OpOverload, str] | None:
    """The out= overload of an elementwise op with the same inputs, and its out argument's name."""
    if not isinstance(target, OpOverload) or torch.Tag.pointwise not in target.tags:
        return None
    want = [(a.name, str(a.type)) for a in target._schema.arguments]
    packet = target.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        outs = [a for a in args if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only]
        if len(outs) != 1 or len(cand._schema.returns) != 1:
            continue
        if [(a.name, str(a.type)) for a in args if a is not outs[0]] == want:
            return cand, outs[0].name
    return None


@functools.cache
def out_overload(target: OpOverload) -> tuple[OpOverload, str] | None:
    """The out= overload of `target` with the same arguments plus one kwarg-only out tensor, and its name.

    Pointwise ops go through `out_variant`; others (copy, mm, ...) are
    matched the same way: every argument but the out one has the functional op's name
    and type, and the overload returns one tensor.
    """
    if not isinstance(target, OpOverload):
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
def inplace_foreach(target: OpOverload) -> OpOverload | None:
    """`aten._foreach_<op>_.<overload>` for `aten._foreach_<op>.<overload>`: same arguments, first list written."""
    if not isinstance(target, OpOverload):
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
