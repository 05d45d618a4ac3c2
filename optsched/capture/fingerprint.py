"""A graph's identity for plan files: structure, op targets, shapes, dtypes.

Two captures of the same model with the same input shapes give the same fingerprint;
a wider layer, another dtype, a changed op or an extra node give another, and the node
list says which node differs first.

Devices are left out: a `torch.device` argument (`arange(..., device=cpu)`) and a device string
in a `device=` keyword hash as the same token whatever the device, so a graph captured from CPU
tensors (plan_offline) and the graph of the same step on CUDA (optimize on the GPU) agree when
their ops, shapes, strides and dtypes do. What a plan records is device-free too (node names come
from op names, costs and decisions from node and tensor names), so nothing in a replay depends on
the device the graph was captured on.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.fx as fx

from .._torch import OpOverload, tree_leaves


def _target(node: fx.Node) -> str:
    t = node.target
    return str(t) if isinstance(t, (str, OpOverload)) else getattr(t, "__qualname__", repr(t))


def _meta(node: fx.Node) -> tuple[str, str, str]:
    vals = [v for v in tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    shape = ";".join("x".join(str(int(s)) for s in v.shape) or "scalar" for v in vals)
    stride = ";".join(",".join(str(int(s)) for s in v.stride()) for v in vals)
    dtype = ";".join(str(v.dtype).removeprefix("torch.") for v in vals)
    return shape, stride, dtype


DEVICE = "<device>"  # every device's token: the hash does not say where the graph was captured


def _arg(a, index: dict[fx.Node, int]):
    if isinstance(a, fx.Node):
        return f"%{index[a]}"
    if isinstance(a, torch.device):
        return DEVICE
    if isinstance(a, (list, tuple)):
        return [_arg(x, index) for x in a]
    if isinstance(a, dict):
        return {str(k): DEVICE if k == "device" and isinstance(v, str) else _arg(v, index) for k, v in a.items()}
    return repr(a)


def _graph_rows(gm: fx.GraphModule) -> list[list]:
    """Per node: [op, target, arguments (nodes by position, devices as one token), shape, stride, dtype]."""
    index: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        rows.append([node.op, _target(node), _arg(node.args, index), _arg(node.kwargs, index), *_meta(node)])
    return rows


def fingerprint(gm: fx.GraphModule, extra: dict | None = None) -> dict:
    """{"hash": sha256 of every node's op, target, arguments (devices as one token), shapes, strides and
    dtypes (plus `extra`), "nodes": [[name, target, shape, dtype], ...] for naming the first difference}."""
    full = _graph_rows(gm)
    nodes = [[node.name, target, shape, dtype] for node, (_op, target, _a, _k, shape, _s, dtype) in zip(gm.graph.nodes, full)]
    body = json.dumps({"graph": full, "extra": extra or {}}, sort_keys=True)
    return {"hash": hashlib.sha256(body.encode()).hexdigest(), "nodes": nodes}


def structure_hash(gm: fx.GraphModule) -> str:
    """sha256 of every node's op, target, arguments and dtypes, without shapes and strides: graphs
    that differ only in their tensors' sizes (a shape-generic kernel's reuse) hash the same."""
    rows = [[op, target, args, kwargs, dtype] for op, target, args, kwargs, _shape, _stride, dtype in _graph_rows(gm)]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
