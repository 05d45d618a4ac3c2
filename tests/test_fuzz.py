"""Fuzzing (issue 17), with hypothesis.

- Random training-step problems (a generator here, and `solvers.synthetic.random_layered_problem`): every
  schedule any solver or heuristic returns (`solve`, every baseline of `BASELINES`, greedy recomputation, the
  offload planners) is valid by `tests/schedule_checker.py`, which shares no code with the simulator, and the
  simulator runs it; `solve`'s plans fit the budget it was given.
- Random small torch models (stacks of Linear, ReLU, GELU, LayerNorm and residual blocks): the optimized
  model's gradients equal eager's, with and without a budget.

Bounded by default (a few dozen problems, a few models). Longer:

    HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_fuzz.py

(10x the examples, drawn at random rather than from a fixed seed). OPTSCHED_FUZZ_EXAMPLES=N sets the problem count directly.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from optsched.solvers import BudgetInfeasibleError, Op, Phase, Problem, Schedule, Tensor, TensorKind, default_schedule, simulate, solve
from optsched.solvers.baselines import BASELINES
from optsched.solvers.search.heuristics import greedy_recompute, lower_bound_peak
from optsched.solvers.search.offload import add_offloads, mix_offload_and_recompute
from optsched.solvers.synthetic import random_layered_problem
from schedule_checker import assert_valid, violations

LONG = settings.get_current_profile_name() == "long"  # HYPOTHESIS_PROFILE=long or --hypothesis-profile=long
SCALE = 10 if LONG else 1
N_PROBLEMS = int(os.environ.get("OPTSCHED_FUZZ_EXAMPLES", 25 * SCALE))
N_MODELS = 5 * SCALE
SOLVE_S = 0.5
FUZZ = settings(max_examples=N_PROBLEMS, deadline=None, derandomize=not LONG, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MODELS = settings(max_examples=N_MODELS, deadline=None, derandomize=not LONG, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow])
UNIT = 1 << 16


# ---------------------------------------------------------------------------------------------
# random problems


@st.composite
def training_problems(draw) -> Problem:
    """A random forward DAG over an input and parameters, a loss over its sinks, and the backward autograd
    would run: per forward op in reverse, one op reading the gradients of its outputs and what it saved (its
    inputs, sometimes its output), making one gradient contribution per activation input and its parameter's
    gradient (a step output). Some ops are not recomputable, some activations not offloadable; host
    bandwidth is on or off."""
    tensors: list[Tensor] = []
    ops: list[Op] = []

    def tensor(name, nbytes, kind=TensorKind.ACTIVATION, producer=None, offloadable=True):
        tensors.append(Tensor(len(tensors), name, nbytes, kind, producer, offloadable))
        return tensors[-1].id

    x = tensor("x", UNIT * draw(st.integers(1, 4)), TensorKind.INPUT)
    n = draw(st.integers(2, 14))
    acts: list[int] = [x]
    reads_of: list[tuple[int, ...]] = []
    params: list[int | None] = []
    saves_output: list[bool] = []
    for i in range(n):
        first = draw(st.sampled_from(acts[-3:]))  # mostly chains, with skips
        extra = draw(st.lists(st.sampled_from(acts), max_size=2, unique=True))
        inputs = tuple(dict.fromkeys([first, *extra]))
        p = tensor(f"w{i}", UNIT * draw(st.integers(1, 3)), TensorKind.INPUT) if draw(st.booleans()) else None
        params.append(p)
        out = tensor(f"a{i}", UNIT * draw(st.integers(1, 8)), producer=i, offloadable=draw(st.integers(0, 9)) > 0)
        ops.append(Op(i, f"f{i}", Phase.FW, inputs + ((p,) if p is not None else ()), (out,),
                      time_s=draw(st.sampled_from([1e-5, 1e-4, 1e-3])), recomputable=draw(st.integers(0, 9)) > 1))
        reads_of.append(inputs)
        saves_output.append(draw(st.booleans()))
        acts.append(out)
    read = {t for r in reads_of for t in r}
    sinks = [a for a in acts[1:] if a not in read]
    loss = tensor("loss", 4, producer=n)
    ops.append(Op(n, "loss", Phase.FW, tuple(sinks), (loss,), time_s=1e-5))
    freed_seed = draw(st.booleans())  # taken over by the backward (capture/tangent_handover.py), or held by the engine
    seed = tensor("d_loss", draw(st.integers(1, 64)) * 1024 if freed_seed else 4,
                  TensorKind.TANGENT_FREED if freed_seed else TensorKind.TANGENT)

    grads: dict[int, list[int]] = {loss: [seed]}  # activation -> its gradient contributions
    outputs = {loss}
    fw_ops = list(ops)
    for op in reversed(fw_ops):
        k = len(ops)
        (out,) = op.outputs
        g_in = tuple(grads.get(out, []))
        if not g_in:
            continue
        is_loss = op.name == "loss"
        i = op.id
        saved = () if is_loss else tuple(t for t in op.inputs if tensors[t].kind == TensorKind.ACTIVATION or t == x)
        if not is_loss and saves_output[i]:
            saved += (out,)
        if not is_loss and params[i] is not None:
            saved += (params[i],)
        made = []
        for t in op.inputs:
            if tensors[t].kind == TensorKind.ACTIVATION:
                g = tensor(f"g{k}_{tensors[t].name}", tensors[t].bytes, producer=k)
                grads.setdefault(t, []).append(g)
                made.append(g)
        if not is_loss and params[i] is not None:
            g = tensor(f"d{tensors[params[i]].name}", tensors[params[i]].bytes, producer=k)
            outputs.add(g)
            made.append(g)
        if not made:  # an op on the input alone with no parameter: nothing to compute
            g = tensor(f"g{k}_x", tensors[x].bytes, producer=k)
            outputs.add(g)
            made.append(g)
        ops.append(Op(k, f"b_{op.name}", Phase.BW, tuple(dict.fromkeys(g_in + saved)), tuple(made),
                      time_s=2 * op.time_s))
    host_bw = draw(st.sampled_from([0.0, 1e8, 1e10]))
    problem = Problem(ops, tensors, outputs=frozenset(outputs), name="fuzz", host_bw=host_bw)
    problem.validate()
    return problem


@st.composite
def layered_problems(draw) -> Problem:
    """solvers.synthetic's random layered DAGs (Moccasin-style), small, with or without host bandwidth."""
    p = random_layered_problem(n_nodes=draw(st.integers(2, 24)), max_extra_inputs=draw(st.integers(0, 2)),
                               unit_bytes=UNIT, seed=draw(st.integers(0, 10**6)))
    return dataclasses.replace(p, host_bw=draw(st.sampled_from([0.0, 1e9])))


problems = st.one_of(training_problems(), layered_problems())


def _budget(problem: Problem, fraction: float) -> int:
    """A budget `fraction` of the way from a lower bound on every plan's peak to the unplanned peak (below 0:
    under the bound, infeasible)."""
    base = simulate(problem, default_schedule(problem)).peak_bytes
    low = lower_bound_peak(problem)
    return max(0, int(low + fraction * (base - low)))


def _check(problem: Problem, schedule: Schedule, where: str) -> None:
    assert_valid(problem, schedule, where)
    simulate(problem, schedule)  # and it runs in the program model the solvers use
    # what the examples exercised (pytest --hypothesis-show-statistics)
    event(f"{where.split(' #')[0]}: {'recomputes' if schedule.recomputed(problem) else 'no recompute'}, "
          f"{'offloads' if schedule.offload else 'no offload'}")


# ---------------------------------------------------------------------------------------------
# every schedule any solver or heuristic returns is valid


@FUZZ
@given(problems, st.one_of(st.floats(0.5, 1.0), st.floats(-0.1, 0.5)))
def test_solve_returns_valid_plans_within_budget(problem, fraction):
    budget = _budget(problem, fraction)
    try:
        sol = solve(problem, budget, time_limit_s=SOLVE_S, deterministic=True)
    except BudgetInfeasibleError as e:
        event("solve: infeasible")
        if e.lowest_schedule is not None:
            _check(problem, e.lowest_schedule, "solve (lowest schedule of an infeasible budget)")
        assert e.lowest_peak_bytes > budget
        return
    _check(problem, sol.schedule, "solve")
    assert simulate(problem, sol.schedule).peak_bytes <= budget


@FUZZ
@given(problems, st.one_of(st.floats(0.5, 1.0), st.floats(-0.1, 0.5)))
def test_baselines_and_heuristics_return_valid_schedules(problem, fraction):
    budget = _budget(problem, fraction)
    for name, baseline in BASELINES.items():
        if name == "offload_all" and problem.host_bw <= 0:
            continue  # offloading needs host bandwidth; the baseline says so by raising
        _check(problem, baseline(problem, budget), f"baseline {name}")
    greedy = greedy_recompute(problem, budget)
    _check(problem, greedy, "greedy_recompute")
    if problem.host_bw > 0:
        offloaded = add_offloads(problem, default_schedule(problem), budget)
        if offloaded is not None:
            _check(problem, offloaded, "add_offloads")
        bw = [o for o in greedy.bw_order if problem.ops[o].phase is Phase.BW]
        for k, mixed in enumerate(mix_offload_and_recompute(problem, list(greedy.fw_order), bw, budget)):
            _check(problem, mixed, f"mix_offload_and_recompute #{k}")


# the checker itself: it must catch broken schedules


def _chain() -> Problem:
    return random_layered_problem(n_nodes=4, n_layers=4, max_extra_inputs=0, unit_bytes=UNIT, seed=1)


def test_checker_accepts_the_program_order_and_rejects_broken_schedules():
    p = dataclasses.replace(_chain(), host_bw=1e9)
    s = default_schedule(p)
    assert violations(p, s) == []
    fw = list(s.fw_order)
    assert violations(p, Schedule(fw[::-1], list(s.bw_order)))  # not topological
    assert violations(p, Schedule(fw, list(s.bw_order)[:-1]))  # a backward op missing
    bw = list(s.bw_order)
    assert violations(p, Schedule(fw, bw[1:] + bw[:1]))  # a gradient read before it is made
    a0 = p.ops[fw[0]].outputs[0]
    readers = [j for j, o in enumerate(bw) if a0 in p.ops[o].inputs]
    assert violations(p, Schedule(fw, bw, {a0: readers[0] + 1}))  # comes back after its first use
    assert violations(p, Schedule(fw, bw, {a0: readers[0]})) == []
    assert violations(dataclasses.replace(p, host_bw=0.0), Schedule(fw, bw, {a0: readers[0]}))  # no host link
    assert violations(p, Schedule(fw, [fw[0], fw[0], *bw]))  # recomputed twice
    # a recomputation that reads a recomputed copy not made yet is fine only when the forward copy exists
    assert violations(p, Schedule(fw, [fw[1], *bw])) == []


# ---------------------------------------------------------------------------------------------
# random small torch models: optimized gradients equal eager's

LAYERS = ("linear", "relu", "gelu", "layernorm", "residual")


class _Residual(torch.nn.Module):
    def __init__(self, d: int, act: str):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.act = torch.nn.GELU() if act == "gelu" else torch.nn.ReLU()

    def forward(self, x):
        return x + self.act(self.fc(x))


def _model(spec: list[str], d: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for kind in spec:
        layers.append({
            "linear": lambda: torch.nn.Linear(d, d),
            "relu": torch.nn.ReLU,
            "gelu": torch.nn.GELU,
            "layernorm": lambda: torch.nn.LayerNorm(d),
            "residual": lambda: _Residual(d, "gelu" if seed % 2 else "relu"),
        }[kind]())
    return torch.nn.Sequential(*layers, torch.nn.Linear(d, 1))


def _grads(model: torch.nn.Module, x: torch.Tensor, call) -> dict[str, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    call(x).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@MODELS
@given(st.lists(st.sampled_from(LAYERS), min_size=1, max_size=6), st.sampled_from([8, 32]),
       st.sampled_from([None, "70%", "50%"]), st.integers(0, 1000))
def test_random_models_optimized_gradients_equal_eager(spec, d, budget, seed):
    import optsched

    torch._dynamo.reset()
    model = _model(spec, d, seed)
    x = torch.randn(128, d, generator=torch.Generator().manual_seed(seed))  # activations outweigh parameters
    want = _grads(model, x, model)
    try:
        opt = optsched.optimize(model, budget, time_limit_s=SOLVE_S)
        got = _grads(model, x, opt)
    except optsched.BudgetInfeasibleError:
        event("model: budget infeasible")
        return  # parameters and gradients alone above 70%: nothing to compare
    event(f"model: {'recomputes' if opt.plan.sim.recomputed_ops else 'no recompute'}")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{spec} {k}: max diff {(got[k] - want[k]).abs().max().item():.3g}"


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
