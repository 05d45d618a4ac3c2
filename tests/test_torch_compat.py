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


def test_op_times_are_measured_on_cuda_by_default_and_a_named_profile_is_the_roofline(monkeypatch):
    """On an H200 the roofline put a Llama step at 0.56x of what ran: the default measures op times on a GPU
    as on the CPU (the timers wait for the kernels); naming a profile still plans with its roofline."""
    from optsched.budget import parse_budget
    from optsched.planning import Target
    from optsched.settings import PlanningSettings

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    default = Target.for_device(PlanningSettings(parse_budget(None), executor="eager"), cuda)
    assert default.measure and default.profile.name.lower() == "h200"
    named = Target.for_device(PlanningSettings(parse_budget(None), "h100", executor="eager"), cuda)
    assert not named.measure and named.profile.name.lower() == "h100"
    assert Target.for_device(PlanningSettings(parse_budget(None)), torch.device("cpu")).measure
