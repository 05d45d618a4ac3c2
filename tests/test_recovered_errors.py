"""Errors the planner expects and recovers from are said, never dropped (issue 26): each is logged (debug,
with the exception) and counted in the plan's notes (`solvers.model.problem.Rejections`), which
`optsched show` prints."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.flop_counter import flop_registry

import optsched
from optsched.cli import main
from optsched.costs.profiles import FLOP_FAILURE_NOTE
from optsched.solvers import Schedule, ScheduleError, default_schedule, simulate, solve
from optsched.solvers.model.problem import Rejections, collecting_rejections, reject
from optsched.solvers.search import segments
from optsched.solvers.synthetic import chain_training_problem
from tests.models import mlp

KIB = 1024
SEGMENT_NOTE = "candidate(s) rejected in the segment search (a replanned segment): ScheduleError: "


def test_rejections_count_per_kind_and_keep_the_first_message():
    log = logging.getLogger("test")
    with collecting_rejections() as outer:
        reject(log, "candidate(s) rejected in a search", ScheduleError("first"))
        with collecting_rejections() as inner:  # nested: counted once, in the innermost
            reject(log, "candidate(s) rejected in a search", ScheduleError("inner"))
        reject(log, "candidate(s) rejected in a search", ScheduleError("second"))
        reject(log, "candidate(s) rejected in a search", ValueError("another kind"))
        reject(log, "op(s) costed with nothing", TypeError("bad"), item="aten.mm.default")
        reject(log, "op(s) costed with nothing", TypeError("worse"), item="aten.mm.default")  # once per item
    reject(log, "candidate(s) rejected in a search", ScheduleError("none open: logged only"))
    assert inner.notes() == ["1 candidate(s) rejected in a search: ScheduleError: inner"]
    assert outer.notes() == [
        "2 candidate(s) rejected in a search: ScheduleError: first",
        "1 candidate(s) rejected in a search: ValueError: another kind",
        "1 op(s) costed with nothing: aten.mm.default: TypeError: bad",
    ]
    assert not Rejections() and outer


def test_a_schedule_error_in_a_search_move_is_in_the_notes_and_the_log(monkeypatch, caplog):
    """Every segment the segment search replans is spliced into a plan the simulator refuses: the search
    drops them all, and says so."""
    p = chain_training_problem(n_layers=6, act_bytes=64 * KIB, seed=2)
    budget = int(0.6 * simulate(p, default_schedule(p)).peak_bytes)
    splice = segments.splice
    calls = []

    def broken(problem, sim, a, b, steps, *args, **kwargs):
        calls.append(a)
        s = splice(problem, sim, a, b, steps, *args, **kwargs)
        return Schedule(s.fw_order, s.bw_order[:-1], s.offload, s.formed)  # the last backward op is missing

    monkeypatch.setattr(segments, "splice", broken)
    with caplog.at_level(logging.DEBUG, logger="optsched.solvers.search.segments"):
        sol = solve(p, budget, time_limit_s=2.0, deterministic=True)
    assert calls
    notes = [n for n in sol.stats.notes if SEGMENT_NOTE in n]
    assert notes == [f"{len(calls)} {SEGMENT_NOTE}backward order misses 1 backward ops"], sol.stats.notes
    logged = [r for r in caplog.records if r.name == "optsched.solvers.search.segments" and r.levelno == logging.DEBUG]
    assert len(logged) == len(calls)
    assert "backward order misses 1 backward ops" in logged[0].getMessage()
    assert isinstance(logged[0].exc_info[1], ScheduleError)
    # without the broken move: nothing rejected there
    monkeypatch.setattr(segments, "splice", splice)
    assert not any(SEGMENT_NOTE in n for n in solve(p, budget, time_limit_s=2.0, deterministic=True).stats.notes)


@pytest.fixture
def broken_mm_formula(monkeypatch):
    def broken(*_args, **_kwargs):
        raise TypeError("this formula takes no such arguments")

    for op in (torch.ops.aten.mm, torch.ops.aten.addmm):
        monkeypatch.setitem(flop_registry, op, broken)


def test_an_op_whose_flop_formula_raises_is_in_the_plan_notes_and_optsched_show(broken_mm_formula, tmp_path, capsys,
                                                                               monkeypatch):
    module, inputs = mlp(seed=0)
    path = tmp_path / "plan.json"
    opt = optsched.optimize(module, None, example_inputs=inputs, device_profile="cpu", time_limit_s=1.0, plan=path)
    opt(*inputs).backward()
    notes = [n for n in opt.plan.stats.notes if FLOP_FAILURE_NOTE in n]
    assert len(notes) == 1, opt.plan.stats.notes
    (note,) = notes
    assert note.startswith(f"2 {FLOP_FAILURE_NOTE}: ")
    assert "aten.mm.default: TypeError: this formula takes no such arguments" in note
    assert "aten.addmm.default: TypeError: this formula takes no such arguments" in note
    monkeypatch.setenv("COLUMNS", "1000")  # the table on one line per row
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "solver notes" in out and f"2 {FLOP_FAILURE_NOTE}: " in out, out
    assert "aten.mm.default: TypeError: this formula takes no such arguments" in out, out


def test_no_flop_note_when_every_formula_works(tmp_path):
    module, inputs = mlp(seed=0)
    opt = optsched.optimize(module, None, example_inputs=inputs, device_profile="cpu", time_limit_s=1.0)
    opt(*inputs).backward()
    assert not any(FLOP_FAILURE_NOTE in n for n in opt.plan.stats.notes), opt.plan.stats.notes


class _NoVectors:
    """An elementwise op whose every overload refuses the stacked vectors (as one that takes no such arguments)."""

    class _Overload:
        def __init__(self, real):
            self._schema, self.tags = real._schema, real.tags

        def __call__(self, *args, **kwargs):
            raise RuntimeError("no vectors today")

    def __init__(self, packet):
        self._packet = packet

    def overloads(self):
        return self._packet.overloads()

    def __getattr__(self, name):
        return self._Overload(getattr(self._packet, name))


def test_a_foreach_op_no_overload_takes_is_left_unbatched_and_noted_on_the_graph(monkeypatch, caplog):
    from optsched.passes.inplace import fold_copy_back
    from optsched.passes.scalar_batching import batch_scalar_foreach
    from optsched.solvers.model.problem import rejections_in
    from tests.test_adam_step import _scalar_update, capture

    args = [[torch.randn(3, 4) for _ in range(4)], [torch.tensor(float(i)) for i in range(4)]]
    gm = capture(_scalar_update, *args)
    fold_copy_back(gm, redirect_readers=True)
    monkeypatch.setattr(torch.ops.aten, "sqrt", _NoVectors(torch.ops.aten.sqrt))
    with caplog.at_level(logging.DEBUG, logger="optsched.passes.scalar_batching"):
        assert batch_scalar_foreach(gm) == 3  # pow, sub, neg; sqrt left as a foreach op
    assert "aten._foreach_sqrt.default" in {str(n.target) for n in gm.graph.nodes}
    assert rejections_in(gm.meta).notes() == [
        "1 foreach op(s) over scalars left unbatched, no elementwise overload took their arguments: "
        "RuntimeError: no vectors today"]
    assert any("no vectors today" in r.getMessage() for r in caplog.records)
