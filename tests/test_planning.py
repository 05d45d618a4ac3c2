"""The planner's contracts (optsched/planning/): what it is given stays as it was, the graph it planned comes back,
and its errors are built from fields, never edited."""

from __future__ import annotations

import pytest

import optsched
from benchmarks.models import gpt
from optsched.budget import parse_budget
from optsched.compiler.offline import OfflineBackend, capture_offline
from optsched.settings import PlanningSettings
from optsched.solvers import BudgetInfeasibleError, PlanningTimeLimitError, Schedule

CFG = gpt.GPTConfig(vocab_size=2048, block_size=64, n_layer=1, n_head=2, n_embd=32)


def test_a_chunked_plan_leaves_the_graph_given_unchanged_and_hands_back_the_one_planned():
    settings = PlanningSettings(parse_budget(None), "h100", time_limit_s=1, chunking=4)
    backend = OfflineBackend(settings, lambda plan: None)
    seen = {}
    plan = backend.planner.plan

    def recording(gm, jg, kind, usage=None, charged=None):  # what the planner is given, as it was, and what it hands back
        seen["given"] = (gm, gm.graph, [n.format_node() for n in gm.graph.nodes], jg, dict(vars(jg)))
        seen["planned"] = plan(gm, jg, kind, usage, charged)
        return seen["planned"]

    backend.planner.plan = recording
    capture_offline(lambda: gpt.build(CFG), lambda: gpt.make_batch(CFG, batch_size=4), backend)
    joint, graph, nodes, jg, fields = seen["given"]
    planned = seen["planned"]
    assert planned.plan.summary()["chunks"] == {"lm_head": 4}
    # the caller's module, graph, nodes and joint graph are as they were
    assert joint.graph is graph and [n.format_node() for n in joint.graph.nodes] == nodes
    assert all(getattr(jg, k) is v for k, v in fields.items())
    # the chunked copy is what was planned, and what its plan's ops name
    chunked = planned.graph
    assert chunked is not jg and chunked.gm is not joint
    assert any("linear_cross_entropy" in str(n.target) for n in chunked.gm.graph.nodes)
    assert not any("linear_cross_entropy" in str(n.target) for n in joint.graph.nodes)
    names = {n.name for n in chunked.gm.graph.nodes}
    assert all(n.name in names for it in planned.items for n in getattr(it, "nodes", [it]))


def test_an_error_is_a_new_one_built_from_its_fields():
    proven = BudgetInfeasibleError(1000, 3 * 2**20, 2 * 2**20)
    scoped = proven.explained("the budget is 1000 bytes", "", scope="with the head as captured")
    assert str(proven) == "no plan fits 0.00 MiB, and none can: every plan needs at least 2.00 MiB (the lowest peak found is 3.00 MiB)"
    assert str(scoped) == ("no plan fits 0.00 MiB, and none can with the head as captured: every such plan needs at least "
                           "2.00 MiB (the lowest peak found is 3.00 MiB); the budget is 1000 bytes")
    assert scoped is not proven and scoped.notes == ("the budget is 1000 bytes",) and proven.notes == ()
    timed = PlanningTimeLimitError(1000, 2000, 500, Schedule([0], []), elapsed_s=1.0, time_limit_s=2.0)
    again = timed.explained("one more", summary="several graphs tried")
    assert type(again) is PlanningTimeLimitError and again.lowest_schedule is timed.lowest_schedule
    assert str(again) == "several graphs tried; one more" and again.time_limit_s == 2.0 and not again.proven


def test_a_planning_error_says_what_chunking_could_do_in_its_fields():
    model, inputs = gpt.build(CFG), gpt.make_batch(CFG, batch_size=4)
    with pytest.raises(optsched.BudgetInfeasibleError) as info:
        optsched.optimize(model, "50%", example_inputs=inputs, device_profile="h100", time_limit_s=1, chunking=False)
    e = info.value
    assert e.proven and e.scope == "with the LM head + cross-entropy as captured"
    assert [n.split(":")[0] for n in e.notes] == ["the budget '50%' is 50% of each training program's own unplanned peak",
                                                  "chunking=False"]
    assert "lm_head (256 tokens, vocabulary 2048) could run in token chunks" in e.notes[-1]
    assert str(e).startswith("no plan fits") and str(e).endswith(e.notes[-1])


def test_the_solves_keep_half_the_limit_whatever_op_timing_took():
    """The planning account counts op timing and problem building against time_limit_s, but a search left with
    nothing finds no plan: the solves together keep MIN_SEARCH_SHARE of the limit."""
    from optsched.planning.timing import MIN_SEARCH_SHARE, PlanningTime
    from optsched.solvers.model import calibration, clock

    with clock.deterministic():
        account = PlanningTime()
        account.start()
        clock.count("op_timed", 10.0 / calibration.seconds("op_timed", 1))  # 10 s of op timing, a 4 s limit
        first = account.slice(4.0)
        assert account.spent > 4.0 and first == MIN_SEARCH_SHARE * 4.0
        clock.count("cpsat_dtime_segment", 1.0 / calibration.seconds("cpsat_dtime_segment", 1))  # the first solve took 1 s of it
        assert abs(account.left() - (MIN_SEARCH_SHARE * 4.0 - 1.0)) < 1e-9


def test_a_compile_goes_ahead_only_where_its_price_fits_the_share_outside_the_search():
    """Fusion compiles are priced before they start. Under a limit the user set, a process's one-time set-up
    (Inductor's first compile, about 3 s) counts like the compile itself, and does not fit a 5 s limit's 2.5 s; a
    default limit grows by the set-up it lets happen, so the first program of a process fuses at the default."""
    from optsched.planning.timing import MIN_SEARCH_SHARE, PlanningTime
    from optsched.solvers.model import clock

    outside = (1 - MIN_SEARCH_SHARE) * 5.0
    with clock.deterministic():
        asked = PlanningTime()
        asked.start()
        assert asked.outside_search_left(5.0, outside - 0.1) and not asked.outside_search_left(5.0, outside + 0.1)
        assert not asked.outside_search_left(5.0, 0.4 + 2.9)  # compile and set-up priced together: refused
        default = PlanningTime()
        default.start()
        assert default.outside_search_left(5.0, 0.4, setup_s=2.9)  # the compile fits; the limit grows by the set-up
        default.slice(5.0)
        assert default.limit == 5.0 and default.limit_s == pytest.approx(7.9)
        assert default.left() == pytest.approx(7.9)  # nothing spent yet on this clock: the set-up adds to the limit


def test_a_charge_before_planning_is_spent_from_the_limit():
    """plan_offline's capture is charged to its program's limit: counted in its unit on the deterministic clock,
    as its wall seconds otherwise; the search still keeps MIN_SEARCH_SHARE of the limit; the planning's own
    figures (what the clock's calibration fits) leave it out."""
    from optsched.planning.timing import MIN_SEARCH_SHARE, Charged, PlanningTime
    from optsched.solvers.model import calibration, clock

    charge = Charged({"graph_node_captured": 1000, "graph_node_stamped": 500}, wall_s=99.0)
    with clock.deterministic():
        t = PlanningTime()
        t.start(charge)
        counted = calibration.seconds("graph_node_captured", 1000) + calibration.seconds("graph_node_stamped", 500)
        assert t.spent == pytest.approx(counted)
        assert t.slice(10.0) == pytest.approx(10.0 - counted)
        t.finish()
    assert t.taken["clock_s"] == pytest.approx(0.0)
    assert t.taken["charged"] == {"units": {"graph_node_captured": 1000, "graph_node_stamped": 500}, "wall_s": 99.0,
                                  "clock_s": counted}
    assert "graph_node_captured" not in t.taken["units"]
    t = PlanningTime()  # the wall clock: the 99 s it took, more than the limit: the search keeps its share
    t.start(charge)
    assert t.spent >= 99.0
    assert t.slice(10.0) == pytest.approx(MIN_SEARCH_SHARE * 10.0, abs=0.01)


def test_a_stage_holds_its_own_wall_seconds_not_its_inner_stages():
    import time as _time

    from optsched.solvers.model import clock

    assert clock.stage_seconds() == {}
    with clock.stage("ignored"):  # outside deterministic mode nothing is timed
        pass
    with clock.deterministic():
        with clock.stage("outer"):
            _time.sleep(0.05)
            with clock.stage("inner"):
                _time.sleep(0.1)
            _time.sleep(0.05)
        spent = clock.stage_seconds()
    assert set(spent) == {"outer", "inner"}
    assert 0.1 <= spent["inner"] < 0.15, spent
    assert 0.1 <= spent["outer"] < 0.15, spent  # the inner stage's 0.1 s left out


def test_a_planning_account_keeps_the_wall_seconds_of_its_stages(monkeypatch):
    """Each program's account says where its wall time went (op timing, problem building, the bound, simulations,
    CP-SAT, the search's own work), within its wall seconds: what benchmarks/planning_time.py shows per stage."""
    from optsched.planning import planner

    made = []

    class Recorded(planner.PlanningTime):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(planner, "PlanningTime", Recorded)
    cfg = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
    model = gpt.build(cfg)
    idx, targets = gpt.make_batch(cfg, 2)
    opt = optsched.optimize(model, "70%", time_limit_s=1.0, deterministic=True)
    opt(idx, targets).backward()
    taken = [t.taken for t in made if t.taken is not None and t.limit]
    assert taken
    stages = taken[0]["stages"]
    assert {"op timing", "problem building", "bound", "simulation", "search"} <= set(stages), stages
    assert all(v > 0 for v in stages.values()), stages
    assert sum(stages.values()) <= taken[0]["wall_s"] * 1.001, (stages, taken[0]["wall_s"])
