"""The model zoo (issue 12): optsched on models nobody on the team wrote, called the way users call them.

Every case is a tiny configuration (random weights from a config, no downloads) of a
public model and a call pattern: ``labels`` (the model computes its loss,
``model(input_ids=ids, labels=ids).loss``) or ``loss outside`` (the caller computes
``F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), targets.flatten())``).
For each case: eager's measured peak, then optsched at each budget (None and fractions
of eager's measured peak, resolved to bytes here): measured and predicted peak, whether
it fits, gradients against eager, step time against eager, first-call (planning)
seconds, solver status and gap, or the ``BudgetInfeasibleError`` figures. A case that
fails reports the error's type and first line and the zoo goes on.

    python -m benchmarks.zoo                                  # every case, budgets none,0.6,0.4
    python -m benchmarks.zoo --cases gpt2-labels,checkpoint --budgets none,0.6
    python -m benchmarks.zoo --list

Writes benchmarks/results/zoo.json (docs/benchmarks.md's zoo table, through benchmarks.report).
"""

from __future__ import annotations

import argparse
import os
import sys
import copy
import functools
import gc
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import optsched
from benchmarks import timed_step, write_result
from optsched.measure import measure_ratio, measure_training_step

MIB = 2**20
RESULTS = Path(__file__).parent / "results"
DEFAULT_BUDGETS = (None, 0.6, 0.4)
# "test": seconds per case (the test suite's). "bench": activations well above parameters and logits, so that
# budgets below eager's peak have room to act (what `python -m benchmarks.zoo` runs). The sizes are fixed at
# import ($OPTSCHED_ZOO_SIZE; the command's --size runs itself again with it).
SIZES = {
    "test": dict(VOCAB=1000, WIDTH=64, LAYERS=2, HEADS=4, FFN=128, BATCH=4, SEQ=64),
    "bench": dict(VOCAB=512, WIDTH=128, LAYERS=3, HEADS=4, FFN=512, BATCH=8, SEQ=128),
}
SIZE = os.environ.get("OPTSCHED_ZOO_SIZE") or ("bench" if __name__ == "__main__" else "test")
VOCAB, WIDTH, LAYERS, HEADS, FFN, BATCH, SEQ = (SIZES[SIZE][k] for k in ("VOCAB", "WIDTH", "LAYERS", "HEADS", "FFN", "BATCH", "SEQ"))


# --------------------------------------------------------------------------- cases

@dataclass
class ZooStep:
    """One case, built: ``call(*inputs)`` is the scalar loss as users compute it with ``module``."""

    module: nn.Module
    inputs: tuple
    loss_fn: Callable  # loss_fn(module, *inputs) -> scalar loss
    caller_held: int = 0  # the last inputs this many: the loss's targets, outside the module (its plan's budget leaves them out)

    @property
    def uncounted(self) -> tuple:
        """The inputs a plan's budget does not cover, left out of measured peaks (measure_training_step)."""
        return self.inputs[len(self.inputs) - self.caller_held:] if self.caller_held else ()

    @property
    def call(self) -> Callable:
        return functools.partial(self.loss_fn, self.module)

    def call_with(self, module: nn.Module) -> Callable:
        """The same call pattern with another module (the optimized one)."""
        return functools.partial(self.loss_fn, module)

    def __iter__(self):  # module, inputs, call = case.build()
        return iter((self.module, self.inputs, self.call))


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # what the README's table calls the model
    pattern: str  # "labels", "loss outside", "loss inside"
    builder: Callable[[], ZooStep]
    random: bool = False  # dropout active in training mode: the step draws random numbers
    note: str = ""

    def build(self) -> ZooStep:
        torch.manual_seed(0)
        step = self.builder()
        step.module.train()
        return step


def _ids(batch: int = BATCH, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def labels_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def outside_loss(model, ids, targets):
    return F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), targets.flatten())


def _hf_lm(config_cls: str, model_cls: str, pattern: str, **cfg) -> Callable[[], ZooStep]:
    def build() -> ZooStep:
        import transformers

        config = getattr(transformers, config_cls)(**cfg)
        model = getattr(transformers, model_cls)(config)
        ids = _ids()
        if pattern == "labels":
            return ZooStep(model, (ids,), labels_loss)
        return ZooStep(model, (ids, _ids(seed=2)), outside_loss, caller_held=1)

    return build


_DECODER = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=SEQ * 2)
HF_LMS = {
    "gpt2": ("GPT-2", "GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ * 2,
                  bos_token_id=0, eos_token_id=0)),
    "llama": ("Llama", "LlamaConfig", "LlamaForCausalLM", dict(_DECODER, num_key_value_heads=2)),
    "mistral": ("Mistral", "MistralConfig", "MistralForCausalLM", dict(_DECODER, num_key_value_heads=2)),
    "qwen2": ("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(_DECODER, num_key_value_heads=2)),
    "gemma": ("Gemma", "GemmaConfig", "GemmaForCausalLM", dict(_DECODER, num_key_value_heads=2, head_dim=16)),
    "gemma2": ("Gemma2", "Gemma2Config", "Gemma2ForCausalLM",
               dict(_DECODER, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16)),
    "phi": ("Phi", "PhiConfig", "PhiForCausalLM", dict(_DECODER)),
    "opt": ("OPT", "OPTConfig", "OPTForCausalLM",
            dict(vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 max_position_embeddings=SEQ * 2, word_embed_proj_dim=WIDTH)),
    "gpt-neox": ("GPT-NeoX", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_DECODER)),
    "mixtral": ("Mixtral", "MixtralConfig", "MixtralForCausalLM",
                dict(_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
}
# dropout left at the configs' defaults (users do): GPT-2 (resid/embd/attn 0.1) and OPT (0.1) draw random numbers
RANDOM_HF = {"gpt2", "opt"}


def _bert() -> ZooStep:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     intermediate_size=FFN, max_position_embeddings=SEQ * 2)
    ids = _ids()
    g = torch.Generator().manual_seed(3)
    masked = torch.rand(ids.shape, generator=g) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, 3), ids)  # token 3 plays [MASK]

    def loss(model, input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    return ZooStep(BertForMaskedLM(cfg), (inputs, labels), loss)


def _t5() -> ZooStep:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=WIDTH, d_ff=FFN, d_kv=16, num_layers=LAYERS, num_decoder_layers=LAYERS,
                   num_heads=HEADS, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)

    def loss(model, input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    return ZooStep(T5ForConditionalGeneration(cfg), (_ids(), _ids(seq=SEQ // 2, seed=2)), loss)


def _vit() -> ZooStep:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                    num_attention_heads=HEADS, intermediate_size=FFN, num_labels=10)
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(16, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (16,), generator=g)

    def loss(model, pixel_values, labels):
        return model(pixel_values=pixel_values, labels=labels).loss

    return ZooStep(ViTForImageClassification(cfg), (pixels, labels), loss)


class EncoderLM(nn.Module):
    """nn.TransformerEncoder between an embedding and a vocabulary head; returns logits."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(self.encoder(self.emb(ids)))


def _encoder() -> ZooStep:
    def loss(model, ids, targets):
        return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())

    return ZooStep(EncoderLM(), (_ids(), _ids(seed=2)), loss, caller_held=1)


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(dropout))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A small pre-norm transformer LM that computes its own loss; optionally checkpoints every block
    with torch.utils.checkpoint (use_reentrant=False), optionally with dropout."""

    def __init__(self, checkpointed: bool = False, dropout: float = 0.0):
        super().__init__()
        self.checkpointed = checkpointed
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, targets):
        x = self.drop(self.emb(ids))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def _tiny(checkpointed: bool, dropout: float) -> Callable[[], ZooStep]:
    def build() -> ZooStep:
        return ZooStep(TinyLM(checkpointed, dropout), (_ids(), _ids(seed=2)), lambda model, ids, t: model(ids, t))

    return build


def _hf_gradient_checkpointing() -> ZooStep:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**_DECODER, num_key_value_heads=2))
    model.gradient_checkpointing_enable()
    return ZooStep(model, (_ids(),), labels_loss)


def _cases() -> dict[str, Case]:
    cases = {}
    for key, (label, cfg_cls, model_cls, cfg) in HF_LMS.items():
        for pattern, suffix in (("labels", "labels"), ("loss outside", "outside")):
            cases[f"{key}-{suffix}"] = Case(f"{key}-{suffix}", label, pattern, _hf_lm(cfg_cls, model_cls, pattern, **cfg),
                                            random=key in RANDOM_HF)
    cases["bert-mlm"] = Case("bert-mlm", "BERT (masked LM)", "labels", _bert, random=True)
    cases["t5"] = Case("t5", "T5 (seq2seq)", "labels", _t5, random=True)
    cases["vit"] = Case("vit", "ViT (image classification)", "labels", _vit)
    cases["transformer-encoder"] = Case("transformer-encoder", "nn.TransformerEncoder", "loss outside", _encoder)
    cases["checkpoint"] = Case("checkpoint", "TinyLM, checkpoint() per block", "loss inside", _tiny(True, 0.0),
                               note="torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)")
    cases["hf-gradient-checkpointing"] = Case("hf-gradient-checkpointing", "Llama, gradient_checkpointing_enable()",
                                              "labels", _hf_gradient_checkpointing)
    cases["dropout"] = Case("dropout", "TinyLM, dropout 0.1", "loss inside", _tiny(False, 0.1), random=True)
    return cases


CASES: dict[str, Case] = _cases()


# --------------------------------------------------------------------------- measurement

def _error(e: BaseException) -> dict:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return {"type": type(e).__name__, "message": lines[0][:300] if lines else ""}


def _max_grad_diff(a: dict, b: dict) -> float | None:
    if a.keys() != b.keys():
        return None  # some parameter got no gradient on one side
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)


def _measure(call, step: ZooStep, seed: int):
    """One step of `call` on the case's inputs; the loss's targets outside the module are not counted (its plan's
    budget does not cover them)."""
    torch.manual_seed(seed)
    return measure_training_step(call, step.module, step.inputs, uncounted=step.uncounted)


def fresh_process_logging() -> None:
    """Forget transformers' ``warning_once``/``info_once`` history, as in a process whose first call is optsched's.

    Eager runs first here and would use up those one-time warnings, so the optimized call would never
    meet them during capture, where a user calling the optimized model first does."""
    import logging

    for name in ("warning_once", "info_once"):
        fn = getattr(logging.Logger, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def run_budget(case: Case, step: ZooStep, eager: dict, eager_grads: dict, fraction: float | None,
               time_limit_s: float | None, repeat: int, seed: int = 0) -> dict:
    """optsched at one budget on a fresh optimize() of the case's module."""
    budget = None if fraction is None else int(fraction * eager["measured_peak_bytes"])
    row: dict = {"fraction": fraction, "budget_bytes": budget}
    stage = "optimize"
    t0 = time.perf_counter()
    try:
        opt = optsched.optimize(step.module, budget, time_limit_s=time_limit_s)
        call = step.call_with(opt)
        stage = "first call"
        fresh_process_logging()
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        loss = call(*step.inputs)  # plans
        row["first_call_s"] = time.perf_counter() - t0
        stage = "first backward"
        loss.backward()
        del loss
        for p in step.module.parameters():
            p.grad = None
        # the first backward shows what the caller does with the outputs; if the first plan guessed otherwise,
        # the second call plans again for it (optsched/output_usage.py)
        first_plan = opt.plan
        stage = "second step"
        t1 = time.perf_counter()
        for _ in range(2):  # a use that varies (outputs garbage collected late) settles on the union of what was seen
            torch.manual_seed(seed)
            call(*step.inputs).backward()
            for p in step.module.parameters():
                p.grad = None
        row["second_call_s"] = time.perf_counter() - t1
        row["replanned"] = opt.plan is not first_plan
        plan = opt.plan
        stage = "measure"
        m = _measure(call, step, seed)
        s = plan.summary() if plan is not None else {}
        row.update({
            "predicted_peak_bytes": plan.predicted_peak_bytes if plan is not None else None,
            "measured_peak_bytes": m.peak_bytes,
            "within_budget": budget is None or m.peak_bytes <= budget,
            "loss_diff": abs(m.loss.item() - eager["loss"]),
            "max_grad_diff": _max_grad_diff(m.grads, eager_grads),
            "grads_missing": sorted(eager_grads.keys() ^ m.grads.keys())[:5],
            "plan_s": (s.get("solve_time_s") or 0.0) + (first_plan.solve_time_s if row["replanned"] and first_plan else 0.0),
            "solver_status": s.get("solver_status"),
            "gap": s.get("gap"),
            "n_recomputed": s.get("n_recomputed"),
        })
        if row["predicted_peak_bytes"] is not None:
            row["predicted_vs_measured"] = (row["predicted_peak_bytes"] - m.peak_bytes) / m.peak_bytes
        if repeat > 0:
            stage = "timing"
            t, t_eager = measure_ratio(timed_step(call, step.module, step.inputs), timed_step(step.call, step.module, step.inputs),
                                       warmup=1, repeat=repeat)
            row["time_ratio"] = t / t_eager
    except optsched.BudgetInfeasibleError as e:
        row.update({"infeasible": True, "lowest_peak_bytes": e.lowest_peak_bytes, "lower_bound_bytes": e.lower_bound_bytes,
                    "first_call_s": time.perf_counter() - t0})  # how long planning took to give up
    except Exception as e:  # noqa: BLE001 - the zoo reports every failure and goes on
        row["error"] = dict(_error(e), stage=stage)
        row["traceback"] = traceback.format_exc(limit=-3)
    finally:
        for p in step.module.parameters():
            p.grad = None
        gc.collect()
    return row


def run_case(case: Case, budgets=DEFAULT_BUDGETS, time_limit_s: float | None = None, repeat: int = 3,
             seed: int = 0) -> dict:
    """Eager, then optsched at each budget; every failure is recorded in the result, never raised."""
    torch._dynamo.reset()
    res: dict = {"case": case.name, "model": case.model, "pattern": case.pattern, "random": case.random,
                 "note": case.note, "budgets": []}
    try:
        step = case.build()
        res["params"] = sum(p.numel() for p in step.module.parameters())
        t0 = time.perf_counter()
        m = _measure(step.call, step, seed)
        res["eager_step_s"] = time.perf_counter() - t0
        # a second eager run with the same seed: is eager itself reproducible (dropout, nondeterministic kernels)?
        m2 = _measure(step.call, step, seed)
        res["eager"] = {"measured_peak_bytes": m.peak_bytes, "loss": m.loss.item(),
                        "repeat_grad_diff": _max_grad_diff(m.grads, m2.grads)}
        eager_grads = m.grads
        del m2
    except Exception as e:  # noqa: BLE001
        res["error"] = dict(_error(e), stage="eager")
        res["traceback"] = traceback.format_exc(limit=-3)
        return res
    for frac in budgets:
        res["budgets"].append(run_budget(case, step, res["eager"], eager_grads, frac, time_limit_s, repeat, seed))
    return res


def model_copy(module: nn.Module) -> nn.Module:
    """A deep copy (own parameters), for callers who want eager and optsched on separate weights."""
    return copy.deepcopy(module)


# --------------------------------------------------------------------------- table

def _mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.2f}"


def budget_cell(r: dict) -> str:
    """One budget's result in one line (console and README)."""
    if "error" in r:
        return f"FAIL {r['error']['type']} ({r['error']['stage']}): {r['error']['message'][:90]}"
    if r.get("infeasible"):
        return f"infeasible: lowest {_mib(r['lowest_peak_bytes'])}, bound {_mib(r['lower_bound_bytes'])} MiB"
    diff = r["max_grad_diff"]
    grads = "grads missing" if diff is None else ("grads equal" if diff == 0 else f"grads {diff:.1e}")
    fits = "" if r["within_budget"] else " OVER BUDGET"
    t = f", {r['time_ratio']:.2f}x" if "time_ratio" in r else ""
    status = f", {r['solver_status']} {r['gap']:.1%}" if r.get("solver_status") else ""
    return (f"{_mib(r['measured_peak_bytes'])} meas / {_mib(r['predicted_peak_bytes'])} pred{fits}{t}, "
            f"plan {r['first_call_s']:.1f}s{status}, {grads}")


def print_table(results: list[dict]) -> None:
    for res in results:
        head = f"{res['case']:<26} {res['model']} [{res['pattern']}]"
        if "error" in res:
            print(f"{head}\n    eager FAILED {res['error']['type']}: {res['error']['message']}")
            continue
        print(f"{head}  eager {_mib(res['eager']['measured_peak_bytes'])} MiB"
              + ("  (random: dropout)" if res["random"] else ""))
        for r in res["budgets"]:
            label = "none" if r["fraction"] is None else f"{r['fraction']:.0%} ({_mib(r['budget_bytes'])})"
            print(f"    {label:<16} {budget_cell(r)}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all; see --list)")
    ap.add_argument("--budgets", default="none,0.6,0.4", help="'none' and/or fractions of eager's measured peak")
    ap.add_argument("--time-limit", type=float, default=None, help="planning time limit (default: optimize()'s)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions for time vs eager (0: skip timing)")
    ap.add_argument("--json", type=Path, default=RESULTS / "zoo.json")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help=f"model and input sizes (now: {SIZE})")
    args = ap.parse_args(argv)
    if args.size is not None and args.size != SIZE:  # sizes are fixed at import: run again with them
        os.environ["OPTSCHED_ZOO_SIZE"] = args.size
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.zoo", *(sys.argv[1:] if argv is None else argv)])
    if args.list:
        for c in CASES.values():
            print(f"{c.name:<28} {c.model} [{c.pattern}]{' random' if c.random else ''}")
        return {}
    names = list(CASES) if args.cases is None else [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; see --list")
    budgets = [None if b.strip().lower() == "none" else float(b) for b in args.budgets.split(",")]

    git = _git_state()
    t0 = time.perf_counter()
    results = []
    for name in names:
        tc = time.perf_counter()
        res = run_case(CASES[name], budgets, args.time_limit, args.repeat)
        res["case_s"] = time.perf_counter() - tc
        results.append(res)
        print_table([res])
    out = {
        "config": {"size": SIZE, "vocab": VOCAB, "width": WIDTH, "layers": LAYERS, "heads": HEADS, "batch": BATCH,
                   "seq": SEQ, "ffn": FFN,
                   "budgets": budgets, "repeat": args.repeat, "time_limit_s": args.time_limit,
                   "torch": torch.__version__, "transformers": _transformers_version(),
                   "threads": torch.get_num_threads(), "total_s": time.perf_counter() - t0, "git": git},
        "cases": results,
    }
    print(f"\nzoo: {len(results)} cases in {out['config']['total_s']:.0f} s")
    write_result(args.json, out)
    return out


def _git_state() -> dict:
    """The commit the zoo ran on and the core files that differed from it (other work in progress)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "optsched", "solvers"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "core_changes_uncommitted": [line[3:] for line in dirty]}


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


if __name__ == "__main__":
    main()
