"""The optimized module follows the plain attributes and the mode set on the module it was made from, and
back (optsched/attribute_sync.py): issue 26's `m.scale = 100` (eager 1080.58, optimized 0.108) and `m.eval()`."""

from __future__ import annotations

import torch

import optsched


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.scale = 1.0

    def forward(self, x):
        return self.drop(self.lin(x)).sum() * self.scale


def _pair():
    torch.manual_seed(0)
    m = Scaled()
    return m, optsched.optimize(m, None, time_limit_s=1, device_profile="cpu")


def test_an_attribute_set_on_the_original_after_optimize_is_used_by_the_optimized_module():
    m, om = _pair()
    x = torch.randn(4, 16)
    m.eval()
    om(x)
    m.scale = 100.0
    torch.testing.assert_close(om(x), m(x))
    assert om.scale == 100.0


def test_eval_on_the_original_puts_the_optimized_module_in_eval_mode_and_back():
    m, om = _pair()
    x = torch.randn(4, 16)
    om(x)
    m.eval()
    with torch.no_grad():
        out = om(x)
    assert om.training is False
    torch.testing.assert_close(out, m(x))  # no dropout: the same value as eager in eval mode
    m.train()
    om(x)
    assert om.training is True


def test_what_is_set_on_the_optimized_module_reaches_the_original():
    m, om = _pair()
    x = torch.randn(4, 16)
    om.scale = 3.0
    om.eval()
    with torch.no_grad():
        om(x)
    assert m.scale == 3.0 and m.training is False
    del om.scale
    with torch.no_grad():
        try:
            om(x)
        except AttributeError:
            pass  # forward reads it: gone on both
    assert not hasattr(m, "scale")
