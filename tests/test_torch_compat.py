"""What differs between the torch optsched is tested with here (2.13, CPU) and the one GPU images ship (2.11):
each difference found by running the suite on 2.11, checked here by its mechanism so it cannot come back."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from optsched.capture import errors
from optsched.costs import measure
from optsched.executors import inductor


def test_out_variants_are_found_without_the_out_tag(monkeypatch):
    """torch 2.11 has no `torch.Tag.out`: the Inductor executor crashed on every in-place op. The schema says
    which overloads write an `out=` argument in every version."""
    aten = torch.ops.aten
    cases = {aten.mul.out: True, aten.add.out: True, aten.mul.Tensor: False, aten.add_.Tensor: False, aten.mm.out: False}
    assert {op: inductor.is_pointwise_write(op) for op in cases} == cases
    without_out_tag = SimpleNamespace(pointwise=torch.Tag.pointwise)  # the 2.11 enum, as far as this code reads it
    monkeypatch.setattr(inductor, "torch", SimpleNamespace(Tag=without_out_tag, _ops=torch._ops))
    assert {op: inductor.is_pointwise_write(op) for op in cases} == cases


def test_torch_2_11_metrics_logging_error_is_dropped_and_nothing_else():
    """torch 2.11 logs a traceback on every compile (it sorts Dynamo's config sets, and the logging functions
    optsched adds do not sort); under pytest's log capture that record kept the model's outputs alive."""
    log = logging.getLogger("torch._dynamo.metrics_context")
    assert errors._unsortable_config_error in log.filters

    def record(exc: BaseException) -> logging.LogRecord:
        return log.makeRecord(log.name, logging.ERROR, __file__, 1, "Unexpected exception logging compilation metrics",
                              (), (type(exc), exc, None))

    try:
        sorted({print, len, measure.device_sync})
    except TypeError as e:
        unsortable = e
    assert not log.filter(record(unsortable))
    assert log.filter(record(TypeError("unsupported operand")))
    assert log.filter(record(RuntimeError("'<' not supported between instances of")))
    assert log.filter(log.makeRecord(log.name, logging.ERROR, __file__, 1, "no exception", (), None))


def test_timers_wait_for_cuda_kernels_only_where_cuda_runs(monkeypatch):
    """A CUDA kernel runs after its launch returns: op timing and fusion-group timing timed launches on a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert measure.device_sync() is not torch.cuda.synchronize
    measure.device_sync()()  # a no-op here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert measure.device_sync() is torch.cuda.synchronize
