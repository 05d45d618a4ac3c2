"""Copies eager never makes: dropout with p=0 returns its input in eager but traces as a clone."""

from __future__ import annotations

import torch
import torch.nn as nn

import optsched
from optsched.measure import measure_training_step


class _ZeroDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(128, 512), nn.Linear(512, 128), nn.Dropout(0.0)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(x)))).pow(2).mean()


def test_dropout_p0_costs_no_copy_and_the_prediction_holds():
    torch.manual_seed(0)
    model, x = _ZeroDropout().train(), torch.randn(256, 128)
    eager = measure_training_step(model, model, (x,))
    opt = optsched.optimize(model)
    for _ in range(2):
        opt(x).backward()
        model.zero_grad(set_to_none=True)
    r = measure_training_step(opt, model, (x,))
    assert r.peak_bytes <= eager.peak_bytes + 64  # the copy (512 KiB here) would sit above eager's peak
    assert abs(opt.plan.predicted_peak_bytes - r.peak_bytes) <= 64
    assert all(torch.equal(eager.grads[k], r.grads[k]) for k in eager.grads)


def test_only_copies_that_keep_the_layout_of_an_intermediate_go():
    from torch.fx.experimental.proxy_tensor import make_fx

    from optsched.passes.identity_clones import drop_identity_clones

    def f(x):
        h = x.relu()
        same = h.clone()  # eager's dropout(p=0): the same values, the same layout
        moved = h.t().clone(memory_format=torch.contiguous_format)  # a real transposed copy
        return same * 2, moved + 1, x.clone()  # a copy of an input stays: the input is the caller's

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8))
    clones = lambda: len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default))  # noqa: E731
    before = clones()
    assert drop_identity_clones(gm) == 1
    assert clones() == before - 1
    x = torch.randn(4, 8)
    assert all(torch.equal(a, b) for a, b in zip(gm(x), f(x)))


def test_a_program_that_writes_keeps_only_the_copies_of_written_values():
    """BatchNorm's running-stat writes used to keep every copy (an in-place SiLU's saved input among them);
    now only a copy of a value some op writes into stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from optsched.passes.identity_clones import drop_identity_clones

    def f(x, buf):
        h, s = x.relu(), x.sin()
        kept, gone = h.clone(), s.clone()
        h.add_(1)  # h is written after its copy: the copy holds the old values
        buf.copy_(s)  # a write into the caller's buffer, as BatchNorm's running statistics
        return kept * 2, gone * 3, h

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.zeros(4, 8))
    assert drop_identity_clones(gm) == 1
    x = torch.randn(4, 8)
    assert all(torch.equal(a, b) for a, b in zip(gm(x, torch.zeros(4, 8)), f(x, torch.zeros(4, 8))))
