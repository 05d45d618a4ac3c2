"""Training loops (issue 24, benchmarks/loops.py): optsched's contracts held over whole loops, not one step.

Each loop (gradient accumulation with AdamW and clipping; sequence lengths ascending and descending;
transformers.Trainer; PEFT LoRA; ALBERT; BART with labels; a diffusers UNet with the loss outside) runs once at
the test size, at "60%", beside the same loop run eagerly, and five contracts are checked on that run
(`benchmarks.report.loop_contract_failures`, which also writes the README's list):

* steps: every step ran (a `BudgetInfeasibleError` passes only when its proven bound is above the budget);
* gradients: equal to eager's after every step, bitwise, as in the zoo; only where torch.compile's own capture
  (`backend="aot_eager"`, nothing planned) is not bitwise eager's is the zoo's tolerance of 1e-6 used;
* budget: every forward+backward call measured within the bytes its plan was given (gradients already
  accumulated counted; calls measured after the loop on the plans the loop made);
* prediction: the predicted peak within 1% (the zoo's tolerance) of the measured one, call by call;
* replans: a program is planned once where the model computes its loss (the caller computing it from an
  output may see one more plan, after the first backward shows what it does).

Plans are made with the CPU roofline profile (`device_profile="cpu"`), so every run plans the same;
`OPTSCHED_LOOPS_PROFILE=measured` measures op times instead, as users' default does. A contract a loop breaks
today because of a known open problem is marked `xfail` naming it (strict, unless with measured op times whether
it breaks varies from run to run); the rest must hold. `make test` runs the
default subset (accumulation, Trainer); every loop runs with `pytest tests/test_loops.py -m 'zoo or not zoo'`
(or `make test-all`).
"""

from __future__ import annotations

import os

import pytest

from benchmarks import loops
from benchmarks.report import LOOP_CONTRACTS, loop_contract_failures

DEFAULT_SUBSET = ("accumulation", "hf-trainer")
# Op costs: the CPU roofline profile by default, so that every run plans the same (deterministic mode, fixed costs).
# With op times measured (OPTSCHED_LOOPS_PROFILE=measured; what users get by default, and what benchmarks/loops.py
# runs) whether a plan is found at 60% varies from run to run on this shared machine: the same loop fits in one
# run and ends its search without a plan in the next.
PROFILE = os.environ.get("OPTSCHED_LOOPS_PROFILE", "cpu")
_MSE_OUTPUT = ("F.mse_loss on CPU returns its 0-dim loss over a storage of its input's size, and the caller holds the "
               "loss through loss.backward(): an output-sized block (12,288 B at the test size, 98,304 at the bench size) "
               "lives through the whole backward, which the plan's estimate of the caller's loss (two output-sized values "
               "at the backward's start, exact for cross-entropy) leaves out; measured = predicted + that block + 4")
# (loop, contract) -> (the open problem that breaks it today, strict), per cost mode
KNOWN: dict[str, dict[tuple[str, str], tuple[str, bool]]] = {
    "cpu": {
        ("unet", "prediction"): ("diffusers UNet2DModel under device_profile='cpu': no op runs while planning, so the "
                                 "kernels' scratch space (the convolutions') is counted as 0: predicted 2.44 MiB, measured "
                                 "2.75 MiB (-11.2%; with no budget 4.09 vs 4.26 MiB, -4.1%, where measured op costs miss "
                                 "21 KB)", True),
        ("unet", "budget"): ("diffusers UNet2DModel under device_profile='cpu': measured 2.75 MiB, 310,427 B over its 60% "
                             "budget (2.45 MiB): the kernels' scratch is counted as 0, and " + _MSE_OUTPUT, True),
    },
    # measured op costs: outcomes that vary from run to run are non-strict
    "measured": {
        ("unet", "budget"): ("diffusers UNet2DModel with F.mse_loss outside: " + _MSE_OUTPUT + ", inside the 1% "
                             "prediction tolerance, but a plan at its budget measures over it", False),
        ("unet", "steps"): ("diffusers UNet2DModel at 60%: some runs find no plan (lowest found 2.59 MiB for a budget of "
                            "2.55 MiB, proven bound 1.49 MiB), others plan within it", False),
        ("peft-lora", "steps"): ("PEFT LoRA on Llama at 60%: some runs end the search without a plan (lowest found 1.76 "
                                 "MiB for a budget of 1.62 MiB, proven bound 1.17 MiB), others plan within it", False),
        ("lengths-descending", "steps"): ("Llama at 60%, length 32: some runs end the search before its time without a "
                                          "plan (lowest found 1.41 MiB for 1.17 MiB, proven bound 0.82), others plan "
                                          "within it", False),
        ("hf-trainer", "steps"): ("Llama under Trainer at 60%: some runs end the search before its time without a plan "
                                  "(lowest found 2.43 MiB for 2.25 MiB, proven bound 1.16), others plan within it", False),
    },
}
_results: dict[str, dict] = {}


def _run(name: str) -> dict:
    """The loop and its eager twin, once per session; no timing."""
    if name not in _results:
        _results[name] = loops.run_case(name, "test", repeat=0, device_profile=None if PROFILE == "measured" else PROFILE)
    return _results[name]


def _params():
    out = []
    for name in loops.CASES:
        for contract in LOOP_CONTRACTS:
            marks = [pytest.mark.xdist_group(f"loop-{name}")]  # one worker runs the loop (`_run`) for all its tests
            if name not in DEFAULT_SUBSET:
                marks.append(pytest.mark.zoo)
            if (name, contract) in KNOWN.get(PROFILE, {}):
                reason, strict = KNOWN[PROFILE][(name, contract)]
                marks.append(pytest.mark.xfail(strict=strict, reason=reason))
            out.append(pytest.param(name, contract, id=f"{name}-{contract}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "contract"), _params())
def test_loop_contract(name, contract):
    res = _run(name)
    failures = loop_contract_failures(res)[contract]
    assert not failures, f"{name}: {contract}:\n" + "\n".join(failures) + (
        f"\n{res.get('traceback', '')}" if "error" in res else "")


@pytest.mark.xdist_group("loop-accumulation")
def test_accumulation_plans_the_second_micro_batch_apart():
    res = _run("accumulation")
    fitted = [s for s in res["steps"] if s.get("outcome") == "fitted"]
    assert fitted, [s.get("error") for s in res["steps"]]
    for s in fitted:
        assert [c["grads_at_start"] for c in s["calls"]] == [False, True]
    assert len({c["plan_index"] for s in fitted for c in s["calls"]}) == 2  # two plans, each reused by later steps


@pytest.mark.xdist_group("loop-hf-trainer")
def test_trainer_runs_the_optimized_model():
    """Trainer(model=optsched.optimize(model, ...)) is how it is used: the module optimize returns is a module of
    the same class, and Trainer trains it (its plans are what ran)."""
    res = _run("hf-trainer")
    assert res.get("trainer_model_is_optimized") is True, res.get("error")
    assert res["summary"]["n_plans"] >= 1
    assert all(c.get("plan_index") is not None for s in res["steps"] for c in s["calls"])
