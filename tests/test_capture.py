"""Capturing what users write: logging never stops capture; graph breaks and data-dependent
sizes become a CaptureError naming the user's file and line, the construct and the fix."""

from __future__ import annotations

import inspect
import logging
import warnings

import pytest
import torch

import optsched
from optsched import CaptureError

log = logging.getLogger("tests.test_capture")
OPTS = dict(device_profile="cpu", time_limit_s=1.0)


def _line_of(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, line in enumerate(lines) if marker in line]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def _grads(module: torch.nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: max diff {(got[k] - want[k]).abs().max().item():.3g}"


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)


# ---------------------------------------------------------------------------------------------
# 1. logging never stops capture


def _hf_model(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_causal_lm_called_with_labels(kind):
    """`model(ids, labels=ids).loss`: GPT-2's loss property calls logger.warning_once (loss_type unset),
    which Dynamo refuses under fullgraph unless it is ignored."""
    model = _hf_model(kind)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    eager = _grads(model)
    model.zero_grad(set_to_none=True)
    before = set(torch._dynamo.config.ignore_logging_functions)

    opt = optsched.optimize(model, **OPTS)
    loss = opt(ids, labels=ids).loss
    loss.backward()
    _assert_same_grads(_grads(model), eager)
    assert opt.plan is not None
    # the config patch lasts only for the call, and a second call reuses the compiled step
    assert torch._dynamo.config.ignore_logging_functions == before
    first = opt.plan
    model.zero_grad(set_to_none=True)
    opt(ids, labels=ids).loss.backward()
    assert opt.plan is first
    _assert_same_grads(_grads(model), eager)


def test_gpt2_with_labels_needs_the_logging_patch():
    """The GPT-2 case above goes through transformers' logger.warning_once (its loss_type is unset):
    plain torch.compile(fullgraph=True) stops there (else that test would prove nothing)."""
    model = _hf_model("gpt2")
    ids = torch.randint(0, 64, (2, 16))
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="logging.Logger method"):
        compiled(ids, labels=ids)


def _logs_everywhere(x, w):
    log.warning("step %d", 3)
    log.info("info")
    logging.getLogger("tests.elsewhere").warning("a logger fetched in forward")
    logging.warning("root logger")
    if log.isEnabledFor(logging.DEBUG):
        log.debug("debug")
    warnings.warn("careful", UserWarning, stacklevel=2)
    log.warning_twice("attached by a library")  # a method a library attached to logging.Logger
    return torch.tanh(x @ w).sum()


def test_logging_and_warnings_in_forward_never_stop_capture(monkeypatch):
    monkeypatch.setattr(logging.Logger, "warning_twice", lambda self, *a, **k: self.warning(*a, **k), raising=False)
    x, w = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _logs_everywhere(x, w).backward()
    want = w.grad.clone()
    w.grad = None
    user_entry = print  # the user's own entries stay in the set, and nothing of ours stays after
    with torch._dynamo.config.patch(ignore_logging_functions={user_entry}):
        opt = optsched.optimize(_logs_everywhere, **OPTS)
        opt(x, w).backward()
        assert torch.equal(w.grad, want)
        assert torch._dynamo.config.ignore_logging_functions == {user_entry}
        assert not hasattr(logging.getLogger, "_dynamo_marked_constant")
        first = opt.plan
        w.grad = None
        opt(x, w).backward()  # no recompilation: Dynamo does not guard on the patched config
        assert opt.plan is first
        assert torch.equal(w.grad, want)


# ---------------------------------------------------------------------------------------------
# 2. graph breaks


def _prints(x, w):
    y = x @ w
    print("y", y.shape)  # marker: print
    return y.sum()


def _item_branch(x, w):
    y = x @ w
    if y.sum().item() > 0:  # marker: item
        y = y * 2
    return y.sum()


def _tensor_branch(x, w):
    y = x @ w
    if y.mean() > 0:  # marker: branch
        y = y * 2
    return y.sum()


def _to_list(x, w):
    y = x @ w
    return (y * y.sum().tolist()).sum()  # marker: tolist


def _explicit_break(x, w):
    y = x @ w
    torch._dynamo.graph_break()  # marker: break
    return y.sum()


def _helper_that_prints(y):
    print(y.sum())  # marker: nested
    return y


def _calls_a_helper(x, w):
    return _helper_that_prints(x @ w).sum()


def _capture_error(fn) -> CaptureError:
    x, w = _inputs()
    opt = optsched.optimize(fn, **OPTS)
    with pytest.raises(CaptureError) as info:
        opt(x, w)
    return info.value


def _assert_names_place(e: CaptureError, fn, marker: str) -> None:
    line = _line_of(fn, f"# marker: {marker}")
    assert (e.filename, e.lineno) == (__file__, line)
    assert f"{__file__}:{line}" in str(e)


@pytest.mark.parametrize(
    "fn, marker, construct, fix",
    [
        (_prints, "print", "print(...)", "remove the print, or move it outside forward"),
        (_item_branch, "item", "a Python decision on .item()", "torch.where(cond, a, b)"),
        (_tensor_branch, "branch", "a Python branch on a tensor's value", "move the branch out of forward"),
        (_to_list, "tolist", ".tolist()", "keep the values as a tensor"),
    ],
    ids=["print", "item-branch", "tensor-branch", "tolist"],
)
def test_graph_break_is_a_capture_error_naming_place_construct_and_fix(fn, marker, construct, fix):
    """torch 2.13 does not trace print under fullgraph (it is not a reorderable logging function by
    default): it is a graph break like the others."""
    e = _capture_error(fn)
    _assert_names_place(e, fn, marker)
    assert e.construct.startswith(construct) and construct in str(e)
    assert fix in e.fix and f"Fix: {e.fix}" in str(e)
    assert isinstance(e.__cause__, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError))
    assert e.reason and e.reason.splitlines()[0] in str(e)  # Dynamo's own text comes along


def test_unknown_graph_break_keeps_dynamos_reason_and_the_place():
    e = _capture_error(_explicit_break)
    _assert_names_place(e, _explicit_break, "break")
    assert isinstance(e.__cause__, torch._dynamo.exc.Unsupported)
    assert e.construct == e.__cause__.gb_type and "graph_break" in e.construct
    assert "Dynamo's reason: " + e.__cause__.gb_type in str(e)
    assert "Fix: move this out of forward, or rewrite it with torch operations" in str(e)


def test_graph_break_in_a_called_function_names_it_and_its_caller():
    e = _capture_error(_calls_a_helper)
    _assert_names_place(e, _helper_that_prints, "nested")
    assert e.construct == "print(...)"
    assert f"called from:\n    {__file__}:{_line_of(_calls_a_helper, '_helper_that_prints(x @ w)')}" in str(e)


def test_capture_error_is_a_runtime_error_exported_by_the_package():
    assert issubclass(CaptureError, RuntimeError)  # as the Dynamo exceptions it replaces
    assert "CaptureError" in optsched.__all__


# ---------------------------------------------------------------------------------------------
# 3. data-dependent sizes never reach planning code


def _mask_index(x, w):
    y = x @ w
    return y[y > 0].sum()  # marker: mask


def _nonzero(x, w):
    y = x @ w
    return (y.nonzero().float().sum() + y.sum())  # marker: nonzero


def _size_from_item(x, w):
    y = x @ w
    n = (y > 0).sum().item()  # marker: size
    return torch.zeros(n).sum() + y.sum()


@pytest.mark.parametrize(
    "fn, marker, construct, fix",
    [
        (_mask_index, "mask", "boolean-mask indexing x[mask]", "torch.where(mask, x, 0)"),
        (_nonzero, "nonzero", "torch.nonzero", "fixed-size op"),
        (_size_from_item, "size", "a size taken from .item()", "a size known before the call"),
    ],
    ids=["mask", "nonzero", "size-from-item"],
)
@pytest.mark.parametrize("user_config", [False, True], ids=["default", "capture_dynamic_output_shape_ops"])
def test_data_dependent_size_is_a_capture_error_before_planning(fn, marker, construct, fix, user_config):
    """These graphs reach the backend (torch 2.13 traces them with unbacked sizes, with or without
    the user's capture_dynamic_output_shape_ops); they used to crash in fingerprint.py."""
    config = {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True} if user_config else {}
    with torch._dynamo.config.patch(**config):
        e = _capture_error(fn)
    _assert_names_place(e, fn, marker)
    assert e.construct.startswith(construct) and construct in str(e)
    assert fix in e.fix and f"Fix: {e.fix}" in str(e)
    assert "tensor sizes depend on tensor values" in str(e)
    tb = e.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert not any(f.endswith("fingerprint.py") for f in frames)
