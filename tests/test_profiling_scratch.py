"""Scratch space measured by op profiling is the op's own on the graph's layouts: the CPU flash attention backward
allocates ~1 MiB with a contiguous grad_out and ~64 KiB with a transposed one (a GPT's), so inputs made for it
must keep the graph's strides for its workspace to be what the real step allocates."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from optsched.costs.measure import measure_peak
from optsched.costs.profiling import profile_nodes

aten = torch.ops.aten
B, H, T, D = 2, 4, 128, 64


def _grad_out(g: torch.Tensor, transposed: bool) -> torch.Tensor:
    """(B, H, T, D) from `g`: as stored, or a (B, T, H, D) tensor transposed (a GPT's heads split off its width)."""
    return g.transpose(1, 2) if transposed else g


def _attention_backward(transposed: bool):
    def f(g, q, k, v):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            _grad_out(g, transposed), q, k, v, out, lse, 0.0, True)
    return f


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous_grad", "transposed_grad"])
def test_attention_backward_scratch_is_what_it_allocates_on_the_graphs_layout(transposed: bool):
    g = torch.randn((B, T, H, D) if transposed else (B, H, T, D))
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    gm = make_fx(_attention_backward(transposed), tracing_mode="fake")(g, q, k, v)
    (node,) = gm.graph.find_nodes(op="call_function",
                                  target=aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    workspace = profile_nodes(gm, torch.device("cpu"), {}, repeat=1).workspace[node.name]

    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
    grad = _grad_out(g, transposed)
    run = measure_peak(lambda: node.target(grad, q, k, v, out, lse, 0.0, True))
    assert run.peak_bytes - run.end_bytes > 0
    assert workspace == run.peak_bytes - run.end_bytes
