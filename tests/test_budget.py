"""`parse_budget` and the argument checks `optimize` does before anything is compiled."""

from __future__ import annotations

import math

import pytest

import optsched
from optsched import parse_budget

# what every rejection message must mention, so a user can see the accepted forms
ACCEPTED_FORMS = ("bytes", "'12GB'", "'512MiB'", "'1.5 GiB'", "'60%'", "None")


@pytest.mark.parametrize(
    "spec, nbytes",
    [
        (1, 1),
        (2_000_000_000, 2_000_000_000),
        ("12GB", 12 * 10**9),
        ("12gb", 12 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("  64 KiB ", 64 * 1024),
        ("3kb", 3000),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("4096", 4096),
        ("100B", 100),
        ("0.5KiB", 512),
        (".5 MiB", 2**19),
        (2048.0, 2048),
        (1e9, 10**9),
    ],
)
def test_absolute_budgets(spec, nbytes):
    b = parse_budget(spec)
    assert b.nbytes == nbytes and isinstance(b.nbytes, int)
    assert b.fraction is None
    assert b.resolve(123_456_789) == nbytes  # absolute: the unplanned peak does not matter


def test_float_budget_is_exact_for_large_whole_numbers():
    assert parse_budget(float(2**40)).nbytes == 2**40


@pytest.mark.parametrize(
    "spec, fraction, resolved",
    [("60%", 0.6, 600), ("100%", 1.0, 1000), (" 12.5 % ", 0.125, 125), ("150%", 1.5, 1500), ("0.1%", 0.001, 1)],
)
def test_percentage_budgets(spec, fraction, resolved):
    b = parse_budget(spec)
    assert b.nbytes is None
    assert b.fraction == pytest.approx(fraction)
    assert b.resolve(1000) == resolved


def test_percentage_resolves_to_whole_bytes_rounding_down():
    assert parse_budget("60%").resolve(1001) == 600


def test_none_means_no_budget():
    b = parse_budget(None)
    assert b.nbytes is None and b.fraction is None
    assert b.resolve(10**9) is None
    assert str(b) == "none"


@pytest.mark.parametrize(
    "spec",
    [
        True,
        False,
        0,
        -1,
        -(2**40),
        0.0,
        -5.0,
        1.5,
        math.nan,
        math.inf,
        "12 parsecs",
        "abc",
        "",
        "   ",
        "-5%",
        "0%",
        "0.0%",
        "-12GB",
        "0GB",
        "0.1B",  # rounds to zero bytes
        "12 G B",
        "12GB!",
        "%",
        "60%%",
        [1],
        [],
        (12, "GB"),
        {"bytes": 12},
        b"12GB",
        object(),
    ],
)
def test_rejected_budgets_name_the_accepted_forms(spec):
    with pytest.raises(ValueError) as info:
        parse_budget(spec)
    msg = str(info.value)
    for form in ACCEPTED_FORMS:
        assert form in msg, (form, msg)


def test_unknown_unit_is_named_in_the_message():
    with pytest.raises(ValueError, match="parsecs"):
        parse_budget("12 parsecs")


class _Calls:
    """A function that counts its calls: `optimize` must reject bad arguments before running it."""

    def __init__(self):
        self.n = 0

    def __call__(self, x):
        self.n += 1
        return x * 2


@pytest.mark.parametrize("budget", ["nonsense", "-5%", True, 0, [1], "12 parsecs"])
def test_optimize_rejects_a_bad_budget_immediately(budget):
    f = _Calls()
    with pytest.raises(ValueError, match="12GB"):
        optsched.optimize(f, budget)
    assert f.n == 0


def test_optimize_rejects_a_bad_budget_even_with_example_inputs():
    f = _Calls()
    with pytest.raises(ValueError):
        optsched.optimize(f, "nonsense", example_inputs=(1.0,))
    assert f.n == 0


@pytest.mark.parametrize("limit", [0, -1, -0.5, math.nan, "5", "5s", [5]])
def test_optimize_rejects_a_bad_time_limit(limit):
    f = _Calls()
    with pytest.raises(ValueError, match="time_limit_s"):
        optsched.optimize(f, None, time_limit_s=limit)
    assert f.n == 0


def test_optimize_rejects_a_bool_time_limit():
    # parse_budget refuses bools on purpose; `time_limit_s=True` should not quietly mean 1 s
    with pytest.raises(ValueError, match="time_limit_s"):
        optsched.optimize(_Calls(), None, time_limit_s=True)


@pytest.mark.parametrize("limit", [0.5, 2, 10.0])
def test_optimize_accepts_positive_time_limits(limit):
    f = _Calls()
    opt = optsched.optimize(f, "60%", time_limit_s=limit)
    assert callable(opt) and opt.plan is None
    assert f.n == 0  # nothing runs until the first call


def test_optimize_rejects_non_callables():
    with pytest.raises(TypeError):
        optsched.optimize(42)


# --------------------------------------------------------------------------- mem_budget="auto"

MIB, GIB = 2**20, 2**30


def test_auto_is_accepted_by_optimize_only():
    from optsched.budget import parse_planning_options

    for spec in ("auto", "AUTO", " Auto "):
        b = parse_budget(spec, auto=True)
        assert b.auto and b.nbytes is None and b.fraction is None and str(b) == "auto"
    # plan_offline, host_budget, optimize_fsdp and the CLI plan without the device: "auto" is refused, saying so
    with pytest.raises(ValueError, match="only by optimize"):
        parse_budget("auto")
    with pytest.raises(ValueError, match="host_budget='auto'"):
        parse_planning_options("auto", "auto", None, None, None, auto=True)
    with pytest.raises(ValueError, match="only by optimize"):
        parse_planning_options("auto", None, None, None, None)  # plan_offline's call
    with pytest.raises(ValueError, match="'auto'"):
        parse_budget("12 parsecs", auto=True)  # the accepted forms name it where it is accepted


def test_auto_on_a_machine_without_cuda_is_refused_at_once_saying_what_to_pass(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    f = _Calls()
    with pytest.raises(ValueError) as info:
        optsched.optimize(f, "auto")
    msg = str(info.value)
    assert "CUDA" in msg and "'12GB'" in msg and "'60%'" in msg
    assert f.n == 0


def test_auto_with_the_step_on_the_cpu_is_refused_at_the_first_call(monkeypatch):
    """A CUDA machine, but the step's tensors are on the CPU: "auto" has no device memory to read."""
    import torch
    from tests.models import mlp

    model, (x,) = mlp()
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        opt = optsched.optimize(model, "auto")
    with pytest.raises(ValueError) as info:
        opt(x)
    msg = str(info.value)
    assert "CUDA" in msg and "cpu" in msg and "'12GB'" in msg and "'60%'" in msg
    assert opt.plan is None


def _memory(**kw):
    from optsched.budget import DeviceMemory

    base = dict(device="cuda:0", total=80 * GIB, free=50 * GIB, reserved=10 * GIB, allocated=6 * GIB, limit=None)
    return DeviceMemory(**{**base, **kw})


def test_auto_arithmetic():
    from optsched.budget import AUTO_GRANULE, auto_budget

    resident = 2 * GIB + 123
    d = auto_budget(_memory(), resident)
    headroom = int(0.05 * 80 * GIB)  # 5% of the device, above the 256 MiB floor
    assert d["headroom_bytes"] == headroom
    assert d["available_bytes"] == 50 * GIB + (10 - 6) * GIB  # free + cached (reserved - allocated)
    raw = resident + 54 * GIB - headroom
    assert d["bytes"] == raw // AUTO_GRANULE * AUTO_GRANULE and raw - AUTO_GRANULE < d["bytes"] <= raw

    # a small device: the headroom floor
    small = auto_budget(_memory(total=2 * GIB, free=GIB, reserved=0, allocated=0), 0)
    assert small["headroom_bytes"] == 256 * MIB and small["bytes"] == GIB - 256 * MIB

    # set_per_process_memory_fraction caps what the allocator may hold: min(free + reserved, limit) - allocated
    capped = auto_budget(_memory(limit=20 * GIB), resident)
    assert capped["available_bytes"] == 20 * GIB - 6 * GIB
    assert capped["bytes"] == (resident + 14 * GIB - headroom) // AUTO_GRANULE * AUTO_GRANULE

    # nothing left for the step beyond its inputs: a clear error, not a budget the planner cannot meet
    with pytest.raises(ValueError, match="nothing is left for the step"):
        auto_budget(_memory(free=GIB, reserved=6 * GIB), resident)


def test_auto_reads_the_device_through_mem_get_info(monkeypatch):
    import torch
    from optsched.budget import DeviceMemory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 9 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    assert DeviceMemory.of("cuda:0") == DeviceMemory("cuda:0", 80 * GIB, 30 * GIB, 12 * GIB, 9 * GIB, None)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.25)
    assert DeviceMemory.of("cuda:0").limit == 20 * GIB


def test_auto_resolves_once_at_the_first_call_and_is_recorded_in_the_plan(monkeypatch):
    """The whole path on this CPU with the device faked: the first call reads the (faked) CUDA memory,
    adds the step's inputs, fixes the bytes; the plan records them like any budget; copies keep them."""
    import copy

    import torch
    from optsched import budget as budget_mod
    from optsched.budget import AUTO_SOURCE, resident_bytes, step_tensors
    from tests.models import mlp

    monkeypatch.setattr(budget_mod, "AUTO_GRANULE", 256)  # this step is KiBs: the rounding would be all of it
    model, (x,) = mlp()
    unplanned = optsched.optimize(model)
    unplanned(x).backward()
    peak = unplanned.plan.baseline.peak_bytes
    model.zero_grad(set_to_none=True)

    total = 64 * GIB  # headroom: 3.2 GiB; "free" chosen so that auto means the unplanned peak
    resident = resident_bytes(step_tensors(model, (x,), {}), torch.device("cpu"))
    headroom = int(0.05 * total)
    free = peak - resident + headroom + 255
    reads = []

    def mem_get_info(device=None):
        reads.append(device)
        return free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    monkeypatch.setattr(budget_mod, "auto_device", lambda tensors: torch.device("cpu"))  # the faked device
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        opt = optsched.optimize(model, "auto", time_limit_s=2)
    assert not reads  # nothing read before the first call
    opt(x).backward()
    expected = (resident + free - headroom) // 256 * 256
    assert len(reads) == 1
    s = opt.plan.summary()
    assert s["budget_bytes"] == expected and opt.plan.budget_spec == "auto"
    assert s["budget_from"] == AUTO_SOURCE
    assert s["predicted_peak_bytes"] <= expected and peak <= expected < peak + 256
    ref = opt.plan.budget_from["auto"]
    assert ref["free_bytes"] == free and ref["resident_bytes"] == resident and ref["bytes"] == expected
    assert opt.plan.to_file_data()["made_for"]["budget_resolved_bytes"] == expected
    model.zero_grad(set_to_none=True)
    opt(x).backward()  # later calls do not read the device again
    assert len(reads) == 1
    model.zero_grad(set_to_none=True)
    twin = copy.copy(opt)  # a copy keeps the resolved bytes
    twin(x).backward()
    assert len(reads) == 1 and twin.plan.budget_bytes == expected


def test_auto_counts_the_steps_inputs_once():
    import torch
    from optsched.budget import resident_bytes, step_tensors

    lin = torch.nn.Linear(10, 10)  # 400 + 40 bytes
    x = torch.randn(4, 10)  # 160 bytes
    tensors = step_tensors(lin, (x, x[1:], {"again": lin}), {"also": x.t()})
    assert resident_bytes(tensors, torch.device("cpu")) == 440 + 160  # views and repeats counted once
    assert resident_bytes(tensors, torch.device("meta")) == 0  # only what is on the device read
    opt = torch.optim.Adam(lin.parameters())
    lin(x).sum().backward()
    opt.step()  # state that exists before the first call: counted by the plans, so added back like the inputs
    with_state = resident_bytes(step_tensors(lin, (x,), {}, opt), torch.device("cpu"))
    # exp_avg and exp_avg_sq of weight and bias, and their two float32 step counts (on the CPU)
    assert with_state - resident_bytes(step_tensors(lin, (x,), {}), torch.device("cpu")) == 2 * 440 + 2 * 4
    lin.weight.grad = lin.bias.grad = None
    lin.weight.grad = torch.zeros(10, 10)  # an accumulation step starts with its gradients (planned live)
    assert resident_bytes(step_tensors(lin, (x,), {}), torch.device("cpu")) == 440 + 160 + 400


# ---------------------------------------------------------------------------------------------
# what a percentage means for each program (BudgetResolution; issue 24)


def _resolution(spec="60%"):
    from optsched.budget import BudgetResolution

    return BudgetResolution(parse_budget(spec))


def test_a_percentage_is_a_share_of_each_training_programs_own_peak():
    """A loop whose shapes grow gets the share of each step's own peak: nothing is fixed by the first."""
    from optsched.budget import THIS_PROGRAM

    r = _resolution()
    for peak, shapes in [(1000, "a"), (5000, "b"), (2000, "c")]:
        view = r.for_shapes(shapes)
        assert view.bytes_for(peak) == int(0.6 * peak)
        assert view.made_for(training=True) == {"budget_from": THIS_PROGRAM}
        assert view.source(peak, "fp")["program"] == THIS_PROGRAM
        view.record_training(view.bytes_for(peak), peak, f"fp-{shapes}")
    assert r.fixed_bytes() is None  # bytes are fixed only when the user gives bytes
    assert r.for_shapes("a").bytes_for(10_000) == 6000


def test_a_forward_only_program_takes_its_training_programs_bytes():
    """The same shapes' training program when one was planned, else the largest, else its own peak."""
    from optsched.budget import LARGEST_TRAINING_PROGRAM, SAME_SHAPES, THIS_PROGRAM

    r = _resolution()
    assert r.for_shapes("a").bytes_for(700, training=False) == 420  # nothing trained yet: its own share
    assert r.for_shapes("a").made_for(training=False) == {"budget_from": THIS_PROGRAM}
    r.for_shapes("a").record_training(600, 1000, "fp-a")
    r.for_shapes("b").record_training(3000, 5000, "fp-b")
    r.for_shapes("c").record_training(1200, 2000, "fp-c")

    a = r.for_shapes("a")
    assert a.bytes_for(700, training=False) == 600
    assert a.source(700, "fp-eval", training=False) == {
        "program": SAME_SHAPES, "unplanned_peak_bytes": 1000, "fingerprint": "fp-a", "bytes": 600}
    assert a.made_for(training=False) == {"budget_resolved_bytes": 600}
    untrained = r.for_shapes("z")
    assert untrained.bytes_for(700, training=False) == 3000
    assert untrained.source(700, training=False)["program"] == LARGEST_TRAINING_PROGRAM
    assert untrained.made_for(training=False) == {"budget_resolved_bytes": 3000}
    assert r.bytes_for(700, training=False) == 3000  # no signature (plan_offline): the largest
    assert untrained.bytes_for(700, training=True) == 420  # a training program of those shapes: its own share

    r.for_shapes("a").record_training(900, 1500, "fp-a-accumulating")  # the same shapes, more bytes: kept
    r.for_shapes("a").record_training(300, 500, "fp-a-small")  # fewer: not
    assert r.for_shapes("a").bytes_for(1, training=False) == 900


def test_bytes_and_no_budget_need_no_resolving():
    from optsched.budget import BudgetResolution

    for spec, nbytes in [("12GB", 12 * 10**9), (None, None)]:
        r = BudgetResolution(parse_budget(spec)).for_shapes("a")
        r.record_training(5, 10, "fp")
        assert r.bytes_for(1000) == r.bytes_for(1000, training=False) == nbytes
        assert r.made_for() == r.made_for(training=False) == {}
        assert r.source(1000) is None and r.explain(1000) is None


def test_the_error_says_where_a_percentages_bytes_came_from():
    r = _resolution()
    assert "60% of each training program's own unplanned peak" in r.for_shapes("a").explain(2**20)
    assert "no training program was planned before it" in r.for_shapes("a").explain(2**20, training=False)
    r.for_shapes("a").record_training(600, 1000, "fp-a")
    assert "the bytes of the training program of the same shapes" in r.for_shapes("a").explain(2**20, training=False)
    assert "the bytes of the largest training program" in r.for_shapes("b").explain(2**20, training=False)


def test_copies_and_pickles_carry_the_training_bytes():
    import copy
    import pickle

    r = _resolution()
    r.for_shapes("a").record_training(600, 1000, "fp-a")
    for c in (r.copy(), r.for_shapes("b").copy(), pickle.loads(pickle.dumps(r)), copy.deepcopy(r)):
        assert c.for_shapes("a").bytes_for(1, training=False) == 600
        assert c.kind == r.kind  # its training programs, per shapes and the largest
    c = r.copy()
    c.for_shapes("b").record_training(3000, 5000, "fp-b")  # a copy's programs are its own
    assert "b" not in r.kind.trained and r.largest["bytes"] == 600


def test_a_resolution_pickled_before_issue_24_keeps_its_bytes_for_forward_only_programs():
    """Then the first training program fixed the bytes for every program (`nbytes`, `reference`): those are a
    training program's bytes, which forward-only programs take now; training programs take their own share."""
    import pickle

    from optsched.budget import LARGEST_TRAINING_PROGRAM, BudgetResolution

    old = object.__new__(BudgetResolution)
    old.__dict__.update(budget=parse_budget("60%"), nbytes=600, auto=None,
                        reference={"unplanned_peak_bytes": 1000, "fingerprint": "fp-first"})
    r = pickle.loads(pickle.dumps(old))
    assert set(vars(r)) == {"budget", "kind"}  # "nbytes" and "reference" became the kind's record
    assert r.for_shapes("a").bytes_for(5000) == 3000
    assert r.for_shapes("a").source(1, training=False) == {
        "program": LARGEST_TRAINING_PROGRAM, "unplanned_peak_bytes": 1000, "fingerprint": "fp-first", "bytes": 600}


def test_eval_and_training_of_the_same_shapes_share_a_key():
    """The Dispatcher's key for the budget: the arguments' shapes, not grad mode, train/eval or requires_grad."""
    import types

    import torch
    from optsched import api

    module = torch.nn.Linear(8, 8)
    dispatcher = types.SimpleNamespace(module=module, usage={}, extra_key=lambda args, kwargs: None)

    def key(*args, grad=True, training=True):
        module.train(training)
        with torch.set_grad_enabled(grad):
            base, _usage = api.Dispatcher.key(dispatcher, args, {})
        return api._shapes_key(base)

    x = torch.randn(4, 8)
    assert key(x) == key(x, grad=False, training=False) == key(x.requires_grad_(False), grad=False)
    assert key(torch.randn(4, 8, requires_grad=True)) == key(x)
    assert key(torch.randn(4, 9)) != key(x) and key(x, 2) != key(x, 3)
    assert key(x.double()) != key(x)
    assert api._shapes_key(None) is None
