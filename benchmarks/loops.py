"""Training loops (issue 24): optsched inside the loops users run, not one clean step.

Each case is a loop of a few optimizer steps on a tiny configuration of a public model (random weights, no
downloads), the model passed through ``optsched.optimize(model, "60%")`` once before the loop:

* ``accumulation``: a plain loop (AdamW, ``clip_grad_norm_(1.0)``), 2 micro-batches per step, the loss divided
  by 2; the second micro-batch starts with the gradients of the first present (planned apart, see
  ``optsched.api.grads_at_start``);
* ``lengths-ascending`` / ``lengths-descending``: one step per sequence length, shortest first / longest first.
  Which bytes "60%" gives a later length depends on what a percentage means for shapes that change (resolved
  once, against the first training program, before issue 24): each length's outcome (fitted, or the error) and
  the bytes its plan was given are recorded;
* ``hf-trainer``: ``transformers.Trainer`` (``max_steps=3``, ``use_cpu=True``) given the optimized model;
* ``peft-lora``: PEFT LoRA (q_proj, v_proj) on a Llama, only the adapters trained;
* ``albert`` (shared layers, masked LM), ``bart`` (encoder-decoder with ``labels``), ``unet`` (diffusers
  ``UNet2DModel``, MSE loss computed by the caller): plain loops of 3 steps.

The same loop runs eagerly on a deep copy of the model (same weights, same batches, ``torch.manual_seed`` before
each micro-batch so dropout draws the same numbers), in lockstep: optsched's step first, then eager's. A step
optsched fails (``BudgetInfeasibleError`` or anything else) is recorded and skipped on both sides, and the loop
goes on. The loop runs as users run it, no profiler around it: a plan made while the allocation profiler runs
cannot measure its kernels' scratch space (``ScratchNotMeasuredWarning``) and would not be the plan users get.
After the loop, each step that ran is run again (its micro-batches in order, from no gradients, no optimizer
step) on the plans the loop made, and measured. Per forward+backward call (micro-batch) the JSON records:

* ``measured_peak_bytes``: what was live at the call's start (parameters, buffers, the batch, the gradients
  already accumulated) plus the allocator's rise during ``loss = call(...); loss.backward()``, as
  ``optsched.measure.measure_training_step`` counts it. The optimizer's state is outside (a budget bounds the
  forward+backward; see the README). A call's planning is not measured here (tests/test_first_call_budget.py
  measures first calls);
* ``predicted_peak_bytes`` and ``budget_bytes``: of the plan the call ran (``model.plan`` after it; a percentage
  may give other programs other bytes); ``planned``: whether the call made that plan in the loop;
* ``max_grad_diff`` (per step): the largest absolute difference between optsched's and eager's gradients after
  the step's last backward (before clipping); where it is not 0, ``reference_grad_diff`` says how far
  ``torch.compile(backend="aot_eager")`` alone (nothing planned) is from eager on the first micro-batch.

Per loop: the budget (spec and resolved bytes), the largest measured peak and the ratio of the call closest to its
budget, the largest predicted peak, the loop's step time against eager's (the loop's steps that ran, timed
alternately with ``optsched.measure.measure_ratio``), the seconds of the calls that planned (capture, op timing,
solving) and the solver's seconds, the plans made (and any made again for a program that had already run), and
the parameters' largest difference from eager's after the loop.

    python -m benchmarks.loops                          # every loop, bench size
    python -m benchmarks.loops --cases accumulation,unet --size test
    python -m benchmarks.loops --list

Writes benchmarks/results/loops.json (docs/benchmarks.md's "Training loops" table, through benchmarks.report).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import optsched
from benchmarks import write_result
from benchmarks.gpu_check import git_state
from benchmarks.zoo import fresh_process_logging
from optsched.measure import live_bytes, measure_peak, measure_ratio

MIB = 2**20
RESULTS = Path(__file__).parent / "results"
BUDGET = "60%"
# "test": seconds per loop (tests/test_loops.py). "bench": larger activations (python -m benchmarks.loops).
SIZES = {
    "test": dict(vocab=256, width=64, layers=2, heads=4, ffn=128, batch=4, seq=64, lengths=(32, 64, 96), image=16),
    "bench": dict(vocab=512, width=128, layers=3, heads=4, ffn=512, batch=8, seq=128, lengths=(64, 128, 192), image=32),
}
STEPS = 3  # optimizer steps per loop
LR = 1e-3
MAX_GRAD_NORM = 1.0


# --------------------------------------------------------------------------- what a loop is made of

@dataclass
class Built:
    """A model and its loop's data: ``steps[i]`` is step i's micro-batches, each a tuple of inputs of
    ``loss_fn(model, *inputs)`` (a scalar)."""

    model: nn.Module
    steps: list[list[tuple]]
    loss_fn: Callable
    label: Callable[[int], str] = field(default=lambda i: f"step {i}")  # what the JSON calls step i


@dataclass(frozen=True)
class Loop:
    name: str
    loop: str  # what the README's table calls the loop
    model: str  # ... and the model
    build: Callable[[dict], Built] | None = None  # plain loops (ours); None: run by `runner`
    runner: Callable | None = None  # a loop someone else runs (HF Trainer)
    # the caller computes the loss from an output: optsched's first plan guesses what the caller does with the
    # outputs and the next call may plan again for what the first backward showed (documented); where the model
    # computes its loss the guess is right and a program is planned once
    replan_expected: bool = False
    note: str = ""


def _ids(size: dict, batch: int | None = None, seq: int | None = None, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, size["vocab"], (batch or size["batch"], seq or size["seq"]), generator=g)


def labels_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _llama(size: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["width"], intermediate_size=size["ffn"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=2, max_position_embeddings=2 * max(size["lengths"])))


def _accumulation(size: dict) -> Built:
    steps = [[(_ids(size, seed=10 * s + j),) for j in range(2)] for s in range(STEPS)]
    return Built(_llama(size), steps, labels_loss)


def _lengths(order: str) -> Callable[[dict], Built]:
    def build(size: dict) -> Built:
        lengths = sorted(size["lengths"], reverse=order == "descending")
        steps = [[(_ids(size, seq=n, seed=s),)] for s, n in enumerate(lengths)]
        return Built(_llama(size), steps, labels_loss, label=lambda i: f"length {lengths[i]}")

    return build


def _peft_lora(size: dict) -> Built:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(size), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return Built(model, [[(_ids(size, seed=s),)] for s in range(STEPS)], labels_loss)


def _masked(size: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _ids(size, seed=seed)
    masked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed + 1000)) < 0.15
    return torch.where(masked, torch.full_like(ids, 3), ids), torch.where(masked, ids, torch.full_like(ids, -100))


def _albert(size: dict) -> Built:
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(vocab_size=size["vocab"], embedding_size=32, hidden_size=size["width"], num_hidden_layers=size["layers"],
                       num_hidden_groups=1, num_attention_heads=size["heads"], intermediate_size=size["ffn"],
                       max_position_embeddings=2 * size["seq"])

    def loss(model, input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    return Built(AlbertForMaskedLM(cfg), [[_masked(size, s)] for s in range(STEPS)], loss)


def _bart(size: dict) -> Built:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=size["vocab"], d_model=size["width"], encoder_layers=size["layers"], decoder_layers=size["layers"],
                     encoder_attention_heads=size["heads"], decoder_attention_heads=size["heads"], encoder_ffn_dim=size["ffn"],
                     decoder_ffn_dim=size["ffn"], max_position_embeddings=2 * size["seq"], pad_token_id=1, bos_token_id=0,
                     eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)

    def loss(model, input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    steps = [[(_ids(size, seed=s), _ids(size, seq=size["seq"] // 2, seed=s + 100))] for s in range(STEPS)]
    return Built(BartForConditionalGeneration(cfg), steps, loss)


def _unet(size: dict) -> Built:
    from diffusers import UNet2DModel

    model = UNet2DModel(sample_size=size["image"], in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(size["width"] // 4, size["width"] // 2), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"))

    def loss(model, noisy, timesteps, noise):  # the caller's loss, on the output's .sample
        return F.mse_loss(model(noisy, timesteps).sample, noise)

    def batch(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        shape = (size["batch"], 3, size["image"], size["image"])
        clean, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        timesteps = torch.randint(0, 1000, (size["batch"],), generator=g)
        alpha = (1 - timesteps.float() / 1000).view(-1, 1, 1, 1)
        return alpha.sqrt() * clean + (1 - alpha).sqrt() * noise, timesteps, noise

    return Built(model, [[batch(s)] for s in range(STEPS)], loss)


# --------------------------------------------------------------------------- measurement

def _error(e: BaseException, stage: str) -> dict:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return {"type": type(e).__name__, "message": lines[0][:300] if lines else "", "stage": stage}


def _grad_bytes(model: nn.Module) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _program(inputs, grads_at_start) -> str:
    """A call's program as the JSON names it: its tensors' shapes, and whether gradients were present."""
    leaves = inputs.values() if isinstance(inputs, dict) else inputs
    shapes = ",".join("x".join(map(str, t.shape)) for t in leaves if isinstance(t, torch.Tensor))
    return shapes + (" +grads" if grads_at_start else "")


def _max_diff(a: dict, b: dict) -> float | None:
    if a.keys() != b.keys():
        return None  # a parameter has a gradient on one side only
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)


def measured_call(fn: Callable[[], torch.Tensor], model: nn.Module, inputs) -> tuple[int, torch.Tensor]:
    """Peak bytes of ``fn()`` (forward and backward; returns the loss, detached), counted as
    ``measure_training_step`` counts a step, gradients already present included."""
    gc.collect()
    start = live_bytes(model, inputs) + _grad_bytes(model)
    res = measure_peak(fn)
    return start + res.peak_bytes, res.result


class PlanLog:
    """The plans an optimized model runs, call by call: which calls made a new one, and how long they took."""

    def __init__(self, opt: nn.Module):
        self.opt = opt
        self.seen: dict[int, object] = {}  # id -> plan (kept alive so ids are not reused)
        self.planning_s = 0.0
        self.solve_s = 0.0

    def after_call(self, seconds: float) -> dict:
        plan = self.opt.plan
        new = plan is not None and id(plan) not in self.seen
        out: dict = {"planned": new}
        if plan is None:
            return out
        if new:
            self.seen[id(plan)] = plan
            self.planning_s += seconds
            self.solve_s += plan.solve_time_s or 0.0
        s = plan.summary()
        out.update(predicted_peak_bytes=plan.predicted_peak_bytes, budget_bytes=plan.budget_bytes,
                   budget_from=s.get("budget_from"), plan_index=list(self.seen).index(id(plan)),
                   grads_at_start=s.get("grads_at_start"), solver_status=s.get("solver_status"), gap=s.get("gap"),
                   output_usage=s.get("output_usage"))
        return out

    def plans(self) -> list[dict]:
        keys = ("predicted_peak_bytes", "budget_bytes", "grads_at_start", "output_usage", "solver_status", "gap",
                "solve_time_s", "budget_from", "budget_reference_peak_bytes")
        return [{k: p.summary().get(k) for k in keys} for p in self.seen.values()]


def _budget_of(log: PlanLog) -> dict:
    """The bytes the loop's plans were given (a percentage may resolve to other bytes for other programs)."""
    nbytes = sorted({p.budget_bytes for p in log.seen.values() if p.budget_bytes is not None})
    return {"budget_bytes": nbytes[-1] if nbytes else None, "budget_bytes_all": nbytes}


def _infeasible(e: optsched.BudgetInfeasibleError) -> dict:
    return {"budget_bytes": e.budget_bytes, "lowest_peak_bytes": e.lowest_peak_bytes, "lower_bound_bytes": e.lower_bound_bytes,
            "proven": e.proven}


def reference_grad_diff(model: nn.Module, loss_fn: Callable, inputs: tuple, seed: int) -> float | None:
    """How far torch.compile's own capture (``backend="aot_eager"``: Dynamo and AOTAutograd, nothing planned) is from
    eager on one micro-batch, on a copy of ``model``: where it is not 0, optsched's gradients cannot be bitwise eager's."""
    m = copy.deepcopy(model)
    grads = []
    for call in (m, torch.compile(m, backend="aot_eager", fullgraph=True)):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss_fn(call, *inputs).backward()
        grads.append(_grads(m))
    torch._dynamo.reset()
    return _max_diff(*grads)


def measure_calls(res: dict, log: PlanLog, model: nn.Module, steps: dict[int, list[tuple[Callable, object]]]) -> None:
    """The measured pass: each step that ran, its calls again in order from no gradients (each micro-batch's
    ``fn`` runs forward and backward), on the plans the loop made, no optimizer step. A call that plans here is
    measured once more (the plan in use then) and flagged: the loop should have made every plan already."""
    for i, calls in steps.items():
        row = res["steps"][i]
        model.zero_grad(set_to_none=True)
        for call, (fn, inputs) in zip(row["calls"], calls):
            grads_before = {n: p.grad for n, p in model.named_parameters()}
            peak, _ = measured_call(fn, model, inputs)
            info = log.after_call(0.0)
            if info.get("planned"):  # planned under the profiler: measure the step again on that plan
                call["planned_while_measured"] = True
                for n, p in model.named_parameters():
                    p.grad = grads_before[n]
                peak, _ = measured_call(fn, model, inputs)
                info = log.after_call(0.0)
            call.update(measured_peak_bytes=peak, measured_plan_index=info.get("plan_index"),
                        predicted_peak_bytes=info.get("predicted_peak_bytes"), budget_bytes=info.get("budget_bytes"))
        model.zero_grad(set_to_none=True)


def run_plain(case: Loop, size: dict, budget, repeat: int, options: dict) -> dict:
    """Our own loop: AdamW, gradient clipping, ``len(step)`` micro-batches per step (losses divided by it)."""
    torch.manual_seed(0)
    built = case.build(size)
    model = built.model.train()
    eager = copy.deepcopy(model)
    opt = optsched.optimize(model, budget, **options)
    optims = {side: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
              for side, m in (("optsched", model), ("eager", eager))}
    log = PlanLog(opt)
    res: dict = {"steps": [], "params": sum(p.numel() for p in model.parameters()),
                 "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}

    def micro(call, inputs, n, seed):
        def fn():
            torch.manual_seed(seed)
            loss = built.loss_fn(call, *inputs)
            (loss / n if n > 1 else loss).backward()
            return loss.detach()
        return fn

    ran: list[int] = []
    fresh_process_logging()
    for i, batches in enumerate(built.steps):
        row: dict = {"step": built.label(i), "calls": []}
        res["steps"].append(row)
        n = len(batches)
        try:
            for j, inputs in enumerate(batches):
                stage = f"micro-batch {j}"
                t0 = time.perf_counter()
                loss = micro(opt, inputs, n, 100 * i + j)()  # as users run it: planning outside any profiler
                call = {"loss": loss.item(), **log.after_call(time.perf_counter() - t0)}
                call["program"] = _program(inputs, call.get("grads_at_start"))
                row["calls"].append(call)
                eager_peak, eager_loss = measured_call(micro(eager, inputs, n, 100 * i + j), eager, inputs)
                call.update(eager_peak_bytes=eager_peak, loss_diff=abs(loss.item() - eager_loss.item()))
        except optsched.BudgetInfeasibleError as e:
            row.update(outcome="infeasible", error=_error(e, stage), failed_call_s=time.perf_counter() - t0, **_infeasible(e))
        except Exception as e:  # noqa: BLE001 - the loop records every failure and goes on
            row.update(outcome="error", error=_error(e, stage), failed_call_s=time.perf_counter() - t0,
                       traceback=traceback.format_exc(limit=-4))
        if "outcome" in row:  # skipped on both sides
            for o in optims.values():
                o.zero_grad(set_to_none=True)
            continue
        row["outcome"] = "fitted"
        row["max_grad_diff"] = _max_diff(_grads(model), _grads(eager))
        if row["max_grad_diff"] is None:
            row["grads_missing"] = sorted(_grads(model).keys() ^ _grads(eager).keys())[:5]
        for m, o in ((model, optims["optsched"]), (eager, optims["eager"])):
            torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], MAX_GRAD_NORM)
            o.step()
            o.zero_grad(set_to_none=True)
        ran.append(i)
    res["param_diff_after"] = max((p.detach() - q.detach()).abs().max().item()
                                  for p, q in zip(model.parameters(), eager.parameters()))
    measure_calls(res, log, model, {i: [(micro(opt, inputs, len(built.steps[i]), 100 * i + j), inputs)
                                        for j, inputs in enumerate(built.steps[i])] for i in ran})
    res.update(_budget_of(log), plans=log.plans(), planning_s=log.planning_s, solve_s=log.solve_s)
    if any(res["steps"][i]["max_grad_diff"] != 0 for i in ran):
        first = built.steps[ran[0]][0]
        res["reference_grad_diff"] = reference_grad_diff(eager, built.loss_fn, first, 100 * ran[0])

    if repeat > 0 and ran:
        def loop(call, m, o):
            def run():
                for i in ran:
                    batches = built.steps[i]
                    for j, inputs in enumerate(batches):
                        micro(call, inputs, len(batches), 100 * i + j)()
                    torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], MAX_GRAD_NORM)
                    o.step()
                    o.zero_grad(set_to_none=True)
            return run

        try:
            t, t_eager = measure_ratio(loop(opt, model, optims["optsched"]), loop(eager, eager, optims["eager"]),
                                       warmup=1, repeat=repeat)
            res.update(time_s=t, eager_time_s=t_eager, time_ratio=t / t_eager)
        except Exception as e:  # noqa: BLE001
            res["timing_error"] = _error(e, "timing")
    return res


# --------------------------------------------------------------------------- transformers.Trainer

def run_trainer(case: Loop, size: dict, budget, repeat: int, options: dict) -> dict:
    """``transformers.Trainer.train()`` on the optimized model, and on an eager copy. A Trainer subclass records
    each ``training_step`` (its batch, the plan it ran, its gradients); the loop itself is Trainer's. Afterwards
    each recorded step is run again through ``trainer.training_step`` and measured."""
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset):
        def __len__(self):
            return 4 * size["batch"] * STEPS

        def __getitem__(self, i):
            ids = _ids(size, batch=1, seed=i)[0]
            return {"input_ids": ids, "labels": ids.clone()}

    class RecordingTrainer(Trainer):
        def __init__(self, *a, plan_log: PlanLog | None = None, **k):
            super().__init__(*a, **k)
            self.plan_log, self.calls, self.grads, self.batches, self.recording = plan_log, [], [], [], True

        def training_step(self, model, inputs, *a, **k):
            if not self.recording:
                return super().training_step(model, inputs, *a, **k)
            t0 = time.perf_counter()
            loss = super().training_step(model, inputs, *a, **k)
            call = {"loss": loss.item()}
            if self.plan_log is not None:
                call.update(self.plan_log.after_call(time.perf_counter() - t0))
                call["program"] = _program(inputs, call.get("grads_at_start"))
            self.calls.append(call)
            self.grads.append(_grads(self.model))
            self.batches.append((model, inputs, a, k))
            return loss

    torch.manual_seed(0)
    model = _llama(size).train()
    eager = copy.deepcopy(model)
    opt = optsched.optimize(model, budget, **options)
    log = PlanLog(opt)
    trainers = {}
    out_dir = tempfile.mkdtemp(prefix="optsched-loops-")
    for side, m in (("optsched", opt), ("eager", eager)):
        args = TrainingArguments(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=size["batch"],
                                 report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                 learning_rate=LR, max_grad_norm=MAX_GRAD_NORM, seed=0, disable_tqdm=True)
        trainers[side] = RecordingTrainer(model=m, args=args, train_dataset=Tokens(),
                                          plan_log=log if side == "optsched" else None)
    res: dict = {"steps": [], "params": sum(p.numel() for p in model.parameters()),
                 "trainer_model_is_optimized": trainers["optsched"].model is opt}
    fresh_process_logging()
    errors = {}
    for side, tr in trainers.items():
        try:
            tr.train()
        except Exception as e:  # noqa: BLE001
            errors[side] = (e, traceback.format_exc(limit=-4))
    ot, et = trainers["optsched"], trainers["eager"]
    for i, call in enumerate(ot.calls):  # the steps optsched's Trainer ran (a failure is the row after them)
        row: dict = {"step": f"step {i}", "calls": [dict(call)], "outcome": "fitted"}
        if i < len(et.calls):
            row["calls"][0]["loss_diff"] = abs(call["loss"] - et.calls[i]["loss"])
            row["max_grad_diff"] = _max_diff(ot.grads[i], et.grads[i])
        else:
            row["max_grad_diff"] = None
            row["grads_missing"] = ["(eager's Trainer did not reach this step)"]
        res["steps"].append(row)
    for side, (e, tb) in errors.items():
        stage = f"{side} Trainer.train()"
        row = {"step": f"step {len(ot.calls)}", "calls": [], "outcome": "error", "error": _error(e, stage), "traceback": tb}
        if isinstance(e, optsched.BudgetInfeasibleError):
            row.update(outcome="infeasible", **_infeasible(e))
            del row["traceback"]
        res["steps"].append(row)
    res["param_diff_after"] = max((p.detach() - q.detach()).abs().max().item()
                                  for p, q in zip(model.parameters(), eager.parameters()))
    for tr in trainers.values():
        tr.recording = False

    def replay(tr, i):
        m, inputs, a, k = tr.batches[i]
        return lambda: tr.training_step(m, inputs, *a, **k)

    measure_calls(res, log, model, {i: [(replay(ot, i), ot.batches[i][1])] for i in range(len(ot.calls))})
    for i in range(min(len(ot.calls), len(et.calls))):
        eager.zero_grad(set_to_none=True)
        res["steps"][i]["calls"][0]["eager_peak_bytes"], _ = measured_call(replay(et, i), eager, et.batches[i][1])
        eager.zero_grad(set_to_none=True)
    res.update(_budget_of(log), plans=log.plans(), planning_s=log.planning_s, solve_s=log.solve_s,
               use_cache=model.config.use_cache)
    if any(s.get("max_grad_diff") not in (0, None) for s in res["steps"]):
        ids = _ids(size, seed=0)
        n = torch.tensor(float(ids.numel() - ids.shape[0]))  # what Trainer passes: the tokens the loss counts

        def loss(m, ids):
            return m(input_ids=ids, labels=ids, num_items_in_batch=n).loss

        res["reference_grad_diff"] = reference_grad_diff(eager, loss, (ids,), 0)
    if repeat > 0 and not errors:
        try:
            t, t_eager = measure_ratio(ot.train, et.train, warmup=1, repeat=repeat)
            res.update(time_s=t, eager_time_s=t_eager, time_ratio=t / t_eager, timed="Trainer.train(), 3 steps")
        except Exception as e:  # noqa: BLE001
            res["timing_error"] = _error(e, "timing")
    return res


# --------------------------------------------------------------------------- the cases

CASES: dict[str, Loop] = {c.name: c for c in (
    Loop("accumulation", "gradient accumulation (2 micro-batches, AdamW, clipping)", "Llama", _accumulation),
    Loop("lengths-ascending", "sequence lengths ascending", "Llama", _lengths("ascending")),
    Loop("lengths-descending", "sequence lengths descending", "Llama", _lengths("descending")),
    Loop("hf-trainer", "transformers.Trainer, max_steps=3", "Llama", runner=run_trainer,
         note="optsched.optimize(model) handed to Trainer(model=...)"),
    Loop("peft-lora", "PEFT LoRA (q_proj, v_proj)", "Llama", _peft_lora),
    Loop("albert", "plain loop (AdamW, clipping)", "ALBERT (shared layers, masked LM)", _albert),
    Loop("bart", "plain loop (AdamW, clipping)", "BART (encoder-decoder, labels)", _bart),
    Loop("unet", "plain loop, MSE loss outside", "diffusers UNet2DModel", _unet, replan_expected=True),
)}


def replans(res: dict) -> list[dict]:
    """Calls that made a new plan for a program (input shapes, gradients present or not) that had already run."""
    seen: dict[str, str | None] = {}
    out = []
    for s in res["steps"]:
        for c in s["calls"]:
            key = c.get("program")
            if c.get("planned") and key in seen:
                out.append({"step": s["step"], "program": key, "output_usage_before": seen[key],
                            "output_usage_after": c.get("output_usage")})
            seen[key] = c.get("output_usage")
    return out


def summarize(res: dict) -> dict:
    """The loop's figures over all its calls: largest measured and predicted peak, worst gradient difference."""
    calls = [c for s in res["steps"] for c in s["calls"] if "measured_peak_bytes" in c]
    budgeted = [c for c in calls if c.get("budget_bytes")]
    predicted = [c for c in calls if c.get("predicted_peak_bytes") is not None]
    rel = [(c["predicted_peak_bytes"] - c["measured_peak_bytes"]) / c["measured_peak_bytes"] for c in predicted]
    diffs = [s.get("max_grad_diff") for s in res["steps"] if s.get("outcome") == "fitted"]
    worst = max(budgeted, key=lambda c: c["measured_peak_bytes"] / c["budget_bytes"], default=None)
    return {
        "measured_peak_bytes": max((c["measured_peak_bytes"] for c in calls), default=None),
        "predicted_peak_bytes": max((c["predicted_peak_bytes"] for c in predicted), default=None),
        # the call closest to (or furthest over) its budget
        "measured_vs_budget": None if worst is None else worst["measured_peak_bytes"] / worst["budget_bytes"],
        "planned_while_measured": sum(bool(c.get("planned_while_measured")) for c in calls),
        "within_budget": None if not budgeted else all(c["measured_peak_bytes"] <= c["budget_bytes"] for c in budgeted),
        "worst_predicted_vs_measured": max(rel, key=abs, default=None),
        "max_grad_diff": None if any(d is None for d in diffs) else max(diffs, default=None),
        "n_steps": len(res["steps"]),
        "n_fitted": sum(s.get("outcome") == "fitted" for s in res["steps"]),
        "outcomes": [f"{s['step']}: {s.get('outcome')}" for s in res["steps"]],
        "n_plans": len(res.get("plans", [])),
        "failed_calls_s": sum(s.get("failed_call_s", 0.0) for s in res["steps"]),
        "replans": replans(res),
    }


def run_case(name: str, size: str = "bench", budget=BUDGET, repeat: int = 3, time_limit_s: float | None = None,
             device_profile: str | None = None) -> dict:
    """One loop, eager beside it; every failure is recorded in the result, never raised. ``time_limit_s`` and
    ``device_profile`` go to ``optsched.optimize`` (None: its defaults, op times measured)."""
    case = CASES[name]
    torch._dynamo.reset()
    res: dict = {"case": name, "loop": case.loop, "model": case.model, "budget": budget, "note": case.note,
                 "replan_expected": case.replan_expected}
    t0 = time.perf_counter()
    try:
        run = case.runner or run_plain
        res.update(run(case, SIZES[size], budget, repeat, {"time_limit_s": time_limit_s, "device_profile": device_profile}))
        res["summary"] = summarize(res)
    except Exception as e:  # noqa: BLE001 - a case that cannot even start is recorded too
        res["error"] = _error(e, "setup")
        res["traceback"] = traceback.format_exc(limit=-4)
    finally:
        gc.collect()
    res["case_s"] = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------- console

def _mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.2f}"


def step_text(s: dict) -> str:
    if s.get("outcome") != "fitted":
        e = s["error"]
        extra = (f" (lowest {_mib(s['lowest_peak_bytes'])}, bound {_mib(s['lower_bound_bytes'])} MiB)"
                 if s.get("outcome") == "infeasible" else "")
        return f"{s['outcome']}: {e['type']} at {e['stage']}: {e['message'][:120]}{extra}"
    calls = ", ".join(f"{_mib(c['measured_peak_bytes'])} meas / {_mib(c.get('predicted_peak_bytes'))} pred"
                      + (" (planned)" if c.get("planned") else "") for c in s["calls"])
    d = s.get("max_grad_diff")
    return f"fitted: {calls}; grads {'missing' if d is None else 'equal' if d == 0 else f'{d:.1e}'}"


def print_case(res: dict) -> None:
    print(f"{res['case']:<20} {res['model']}: {res['loop']} [{res['budget']}]  ({res['case_s']:.0f} s)")
    if "error" in res:
        print(f"    FAILED {res['error']['type']}: {res['error']['message']}")
        return
    for s in res["steps"]:
        print(f"    {s['step']:<12} {step_text(s)}")
    m = res["summary"]
    t = f", time {res['time_ratio']:.2f}x eager" if "time_ratio" in res else ""
    print(f"    budget {_mib(res.get('budget_bytes'))} MiB, max measured {_mib(m['measured_peak_bytes'])} MiB"
          f"{t}, {m['n_plans']} plans in {res['planning_s']:.1f} s")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None, help="comma-separated loop names (default: all; see --list)")
    ap.add_argument("--size", choices=sorted(SIZES), default="bench")
    ap.add_argument("--budget", default=BUDGET, help="mem_budget for every loop (default 60%%)")
    ap.add_argument("--time-limit", type=float, default=None, help="planning time limit (default: optimize()'s)")
    ap.add_argument("--profile", default=None, help="optimize()'s device_profile (default: op times measured)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions of each loop (0: skip timing)")
    ap.add_argument("--json", type=Path, default=RESULTS / "loops.json")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for c in CASES.values():
            print(f"{c.name:<20} {c.model}: {c.loop}")
        return {}
    names = list(CASES) if args.cases is None else [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown loop(s) {unknown}; see --list")
    budget = None if args.budget.lower() == "none" else args.budget
    git = git_state()
    t0 = time.perf_counter()
    results = []
    for name in names:
        res = run_case(name, args.size, budget, args.repeat, args.time_limit, args.profile)
        results.append(res)
        print_case(res)
    import transformers

    out = {
        "config": {"size": args.size, **{k: list(v) if isinstance(v, tuple) else v for k, v in SIZES[args.size].items()},
                   "steps": STEPS, "budget": budget, "repeat": args.repeat, "time_limit_s": args.time_limit,
                   "device_profile": args.profile,
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "threads": torch.get_num_threads(), "total_s": time.perf_counter() - t0,
                   "date": datetime.datetime.now().isoformat(timespec="seconds"), "git": git},
        "cases": results,
    }
    print(f"\nloops: {len(results)} cases in {out['config']['total_s']:.0f} s")
    write_result(args.json, out)
    return out


if __name__ == "__main__":
    main()
