"""The model zoo (issue 12, benchmarks/zoo.py): optsched's contracts on models nobody on the team wrote.

Each case (tiny configs of transformers' GPT-2, Llama, Mistral, Qwen2, Gemma, Gemma2, Phi, OPT,
GPT-NeoX, Mixtral with the loss computed by the model (`labels`) and by the caller (`loss outside`);
BERT, T5, ViT; nn.TransformerEncoder; checkpointed and dropout models) runs once, eager then
optsched with no budget and at 60% of eager's measured peak, and four contracts are checked
on that run:

* gradients equal eager's, bitwise. Every case is deterministic here: models with dropout
  (GPT-2's and OPT's config defaults, BERT, T5, the `dropout` case) are seeded with
  `torch.manual_seed` right before each step, and the captured program must draw the same
  random numbers in the same order as eager (a plan that recomputed a random op would draw
  new ones). Only where eager itself does not repeat bitwise under the same seed (no case
  today) is a tolerance of 1e-6 used;
* measured peak within the budget at 60%. A `BudgetInfeasibleError` fails the case: its bound (the
  value under test) is first checked against what the run saw (no higher than the lowest peak the
  search found, the no-budget plan's predicted and measured peaks and eager's measured peak), and a
  case whose 60% is known to be out of reach is marked xfail(strict) with the reason
  (`OUT_OF_REACH_AT_60`), so that it reports XPASS, a failure, once a plan fits;
* predicted peak within 1% of the measured one;
* with no budget, the measured peak is not above eager's measured peak by more than
  `ZOO_NO_BUDGET_SLACK_BYTES` (1 KiB): the CPU allocator reports requested sizes, unrounded,
  so the slack only covers 0-dim scalar temporaries (8 bytes each), and is no bigger than the
  zoo's smallest per-token tensor, so no activation hides in it.

Most cases are marked `zoo` and run with `make test-zoo`; a representative subset (one HF
causal LM with `labels`, the same with the loss outside, the model that checkpoints its
own blocks) runs with `make test`.
"""

from __future__ import annotations

import pytest

from benchmarks import zoo
from benchmarks.report import MIB, ZOO_NO_BUDGET_SLACK_BYTES, ZOO_PREDICTION_TOLERANCE

DEFAULT_SUBSET = ("llama-labels", "llama-outside", "checkpoint")
BUDGETS = (None, 0.6)
_results: dict[str, dict] = {}

# cases whose 60% no plan reaches at the test size: (the planner's bound, 60% of eager's peak, the lowest peak the
# search found or None where the bound is above the budget and no search runs, eager's peak) in MiB, as measured
# (torch 2.13, CPU); the bound was checked against the run's plans (`_check_reported_bound`). All compute the loss
# outside the model, so the caller's logits and loss tensors cross the forward/backward boundary. The case's
# within-budget test is xfail(strict) for them. (Until the first guess left the key/value caches out of the
# gradients, the Hugging Face ones were planned with a gradient into each: bounds of 3.83-4.43 MiB.)
_OUT_OF_REACH = {
    "llama-outside": (3.70, 3.62, None, 6.04), "mistral-outside": (3.70, 3.62, None, 6.04),
    "qwen2-outside": (3.70, 3.62, None, 6.04), "gemma-outside": (3.46, 3.48, 3.60, 5.79),
    "phi-outside": (3.68, 3.57, None, 5.95), "opt-outside": (3.53, 3.06, None, 5.11),
    "gpt-neox-outside": (3.68, 3.19, None, 5.32), "transformer-encoder": (3.68, 3.00, None, 5.01),
}
OUT_OF_REACH_AT_60: dict[str, str] = {
    name: (f"the loss outside: every plan needs at least {bound} MiB (the planner's bound"
           + (f"; lowest found {low}, eager {eager} MiB" if low is not None else f", eager {eager} MiB") + f"), 60% is {budget} MiB")
    for name, (bound, budget, low, eager) in _OUT_OF_REACH.items()
}


def _case_params():
    """One per case; one worker runs a case (`_run`) for all its tests (see tests/conftest.py)."""
    return [pytest.param(name, id=name, marks=(pytest.mark.xdist_group(f"zoo-{name}"),
                                               *(() if name in DEFAULT_SUBSET else (pytest.mark.zoo,))))
            for name in zoo.CASES]


# cases whose 60% is below what the captured cross-entropy itself needs: its backward `_log_softmax_backward_data`
# reads two logits-sized tensors (the log-softmax and nll_loss_backward's gradient) and writes a third (not an
# elementwise op: no out= form, no scratch), so every plan holds the inputs plus three logits (256 x 1000 float32)
# at that step: (the bound, 60% of eager's peak) in MiB. Structural, not measured: the same in every run (it was a
# non-strict xfail while "met in other runs" was suspected; those runs cannot have run this graph: 2.38 MiB is
# below the three logits alone). Chunking the loss (optimize(chunking="auto")) is what goes below it.
_CE_OUT_OF_REACH = {"llama-labels": (3.70, 3.62), "checkpoint": (3.81, 2.44)}
OUT_OF_REACH_AT_60.update({
    name: (f"the cross-entropy's backward holds the inputs and three logits-sized tensors: every plan needs at "
           f"least {bound} MiB, 60% is {budget} MiB")
    for name, (bound, budget) in _CE_OUT_OF_REACH.items()
})


def _budget_case_params():
    def marks(name: str) -> tuple:
        if name in OUT_OF_REACH_AT_60:
            return (pytest.mark.xfail(strict=True, reason=OUT_OF_REACH_AT_60[name]),)
        return ()

    return [pytest.param(p.values[0], id=p.id, marks=(*p.marks, *marks(p.id))) for p in _case_params()]


def _run(name: str) -> dict:
    """The case's eager and optsched runs, once per session; no timing (repeat=0)."""
    if name not in _results:
        _results[name] = zoo.run_case(zoo.CASES[name], BUDGETS, repeat=0)
    res = _results[name]
    if "error" in res:
        pytest.fail(f"eager fails: {res['error']['type']}: {res['error']['message']}")
    return res


def _row(res: dict, fraction: float | None) -> dict:
    row = next(r for r in res["budgets"] if r["fraction"] == fraction)
    if "error" in row:
        e = row["error"]
        pytest.fail(f"budget {fraction}: {e['type']} at {e['stage']}: {e['message']}\n{row.get('traceback', '')}")
    return row


def _ran(res: dict, fraction: float | None) -> dict | None:
    row = _row(res, fraction)
    return None if row.get("infeasible") else row


@pytest.mark.parametrize("name", _case_params())
def test_gradients_equal_eager(name):
    res = _run(name)
    tol = 0.0 if res["eager"]["repeat_grad_diff"] == 0 else 1e-6
    for fraction in BUDGETS:
        row = _ran(res, fraction)
        if row is None:
            continue
        assert row["max_grad_diff"] is not None, f"budget {fraction}: no gradient for {row['grads_missing']}"
        assert row["max_grad_diff"] <= tol, f"budget {fraction}: gradients differ from eager by {row['max_grad_diff']:.2e}"


def _check_reported_bound(res: dict, row: dict) -> None:
    """The lower bound a `BudgetInfeasibleError` reports ("no plan goes below"), against the peaks this run saw
    of real plans of the same step: the lowest the search found at this budget, the plan made with no budget
    (predicted and measured: the prediction is within ZOO_PREDICTION_TOLERANCE of what runs) and eager's."""
    bound = row["lower_bound_bytes"]
    seen = {"the lowest peak found at this budget": row["lowest_peak_bytes"],
            "eager's measured peak": res["eager"]["measured_peak_bytes"] * (1 + ZOO_PREDICTION_TOLERANCE)}
    free = _row(res, None)
    if not free.get("infeasible"):
        seen["the no-budget plan's predicted peak"] = free["predicted_peak_bytes"]
        seen["the no-budget plan's measured peak"] = free["measured_peak_bytes"] * (1 + ZOO_PREDICTION_TOLERANCE)
    above = {k: v for k, v in seen.items() if bound > v}
    assert not above, f"the reported bound {bound / MIB:.3f} MiB is above " + ", ".join(
        f"{k} ({v / MIB:.3f} MiB)" for k, v in above.items())


@pytest.mark.parametrize("name", _budget_case_params())
def test_within_budget_at_60_percent(name):
    res = _run(name)
    row = _row(res, 0.6)
    if row.get("infeasible"):
        _check_reported_bound(res, row)
        proven = row["lower_bound_bytes"] > row["budget_bytes"]
        pytest.fail(f"BudgetInfeasibleError at {row['budget_bytes'] / MIB:.2f} MiB: lowest found "
                    f"{row['lowest_peak_bytes'] / MIB:.2f} MiB, bound {row['lower_bound_bytes'] / MIB:.2f} MiB"
                    + (" (no plan can fit: if that is right, list the case in OUT_OF_REACH_AT_60)" if proven else ""))
    assert row["within_budget"], f"measured {row['measured_peak_bytes']} B > budget {row['budget_bytes']} B"


@pytest.mark.parametrize("name", _case_params())
def test_predicted_peak_matches_measured(name):
    res = _run(name)
    for fraction in BUDGETS:
        row = _ran(res, fraction)
        if row is None:
            continue
        rel = row.get("predicted_vs_measured")
        assert rel is not None, f"budget {fraction}: no plan"
        assert abs(rel) <= ZOO_PREDICTION_TOLERANCE, (
            f"budget {fraction}: predicted {row['predicted_peak_bytes']} B, measured {row['measured_peak_bytes']} B ({rel:+.2%})")


@pytest.mark.parametrize("name", _case_params())
def test_no_budget_not_above_eager(name):
    res = _run(name)
    row = _row(res, None)
    eager = res["eager"]["measured_peak_bytes"]
    assert not row.get("infeasible"), "no budget cannot be infeasible"
    assert row["measured_peak_bytes"] <= eager + ZOO_NO_BUDGET_SLACK_BYTES, (
        f"measured {row['measured_peak_bytes']} B vs eager {eager} B (+{row['measured_peak_bytes'] - eager} B)")
