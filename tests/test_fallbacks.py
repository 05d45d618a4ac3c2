"""Fallbacks that used to be silent are logged and counted: an op whose FLOP formula raises (costed by its
bytes alone), and an Inductor group compiled for its exact shapes when the symbolic compile fails."""

from __future__ import annotations

import logging
import types

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import flop_registry

from optsched.costs import profiles
from optsched.costs.profiles import node_flops
from optsched.executors.inductor import InductorExecutor


def test_a_flop_formula_that_raises_is_logged_once_and_counted(monkeypatch, caplog):
    def broken(*_args, **_kwargs):
        raise TypeError("unexpected argument")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, broken)
    monkeypatch.setattr(profiles, "FLOP_FORMULA_FAILURES", type(profiles.FLOP_FORMULA_FAILURES)())
    node = types.SimpleNamespace(target=torch.ops.aten.mm.default, args=(), kwargs={}, meta={})
    with caplog.at_level(logging.INFO, logger="optsched.costs.profiles"):
        assert node_flops(node) == 0
        assert node_flops(node) == 0
    assert profiles.FLOP_FORMULA_FAILURES["aten.mm.default"] == 2
    records = [r for r in caplog.records if "no FLOP count for aten.mm.default" in r.getMessage()]
    assert len(records) == 1 and "TypeError: unexpected argument" in records[0].getMessage()


def test_inductor_exact_shape_fallback_is_logged_and_counted(monkeypatch, caplog):
    compile_ = torch._inductor.compile

    def no_symbolic_sizes(gm, inputs):
        if any(isinstance(x, FakeTensor) for x in inputs):
            raise RuntimeError("no symbolic sizes today")
        return compile_(gm, inputs)

    monkeypatch.setattr(torch._inductor, "compile", no_symbolic_sizes)
    gm = make_fx(lambda x: (torch.relu(x) + 1,))(torch.randn(4, 8))
    executor = InductorExecutor()
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="optsched.executors.inductor"):
        run = executor.compile_group(gm, [x])
    assert executor.exact_shape_fallbacks == ["the symbolic compile failed: RuntimeError: no symbolic sizes today"]
    assert any("exact shapes only" in r.getMessage() for r in caplog.records)
    (out,) = run(x)
    assert torch.equal(out, torch.relu(x) + 1)
