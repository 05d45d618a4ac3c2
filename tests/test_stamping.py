"""plan_offline's stamped capture: a joint graph of N repeated blocks built from the traces of 4 and 5 is, node for
node, the graph a full trace gives, and where blocks differ the capture traces them all."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import optsched
from benchmarks.models import llama
from optsched._torch import FakeTensorMode, compiling
from optsched.capture import stamping
from optsched.compiler import offline
from optsched.compiler.offline import plan_offline
from optsched.measure import measure_training_step

TWELVE = llama.Config.from_name("tiny-llama", n_layer=12)  # n_embd 128, grouped-query attention, bf16


def _llama():
    return llama.LLaMA(TWELVE), llama.make_batch(TWELVE, 2, 32)


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16))
    return _Labels(model), (ids, ids.clone())


class _Labels(nn.Module):
    """transformers' way: the loss from `labels`, returned in the model's output."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


class _EncoderLoss(nn.Module):
    """torch.nn's TransformerEncoder (12 layers, deep-copied from one: under FakeTensorMode copies are fake tensors of
    another mode, which plan_offline makes its own), the loss outside it."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)

    def forward(self, x, y):
        return F.mse_loss(self.encoder(x), y)


def _encoder():
    return _EncoderLoss(), (torch.randn(2, 8, 32), torch.randn(2, 8, 32))


def test_a_deep_copied_torch_nn_encoder_plans_offline():
    plan = plan_offline(lambda: _encoder()[0], lambda: _encoder()[1], None, device_profile="cpu", time_limit_s=2)
    assert plan.kind == "training" and plan.summary()["n_ops"] > 12 * 10


def _joints(build):
    """(the stamped joint graph or None, the traced one) of build()'s training step, as plan_offline captures it."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        module, inputs = build()
        inputs = offline._fake_inputs(mode, inputs)
    offline._into_mode(module, mode)
    with mode, torch.enable_grad(), compiling():
        stamped = offline._stamped_joint(module, inputs)
        traced = offline._trace_joint(module, inputs).joint
    return stamped, traced


@pytest.mark.parametrize("build", [_llama, _hf_llama, _encoder], ids=["llama", "transformers-llama", "nn-encoder"])
def test_the_stamped_graph_is_the_traced_one(build):
    stamped, traced = _joints(build)
    assert stamped is not None, "the blocks were not stamped"
    joint, _outputs, units = stamped
    assert stamping.first_difference(joint, traced) is None
    assert units["graph_node_stamped"] > len(traced.graph.nodes)  # the N blocks and the 5-block check
    assert units["graph_node_captured"] < len(traced.graph.nodes)  # 4 + 5 blocks traced, not 12


def test_first_difference_names_what_differs():
    def traced(blocks: int, rows: int):
        return _joints(lambda: (_Stack([_Block(16) for _ in range(blocks)]), (torch.randn(rows, 16),)))[1]
    twelve = traced(12, 4)
    assert stamping.first_difference(twelve, traced(12, 4)) is None
    assert "nodes against" in stamping.first_difference(twelve, traced(11, 4))
    assert stamping.first_difference(twelve, traced(12, 8)).endswith("'s value")  # another batch


def test_a_stamped_plan_replays_in_optimize(tmp_path):
    """The stamped graph carries the names and fingerprint of optimize()'s own capture (through Dynamo, on real
    tensors): its plan file loads without solving, and the step's gradients are eager's, bitwise."""
    planned = plan_offline(lambda: llama.LLaMA(TWELVE), lambda: llama.make_batch(TWELVE, 4, 64), "90%", device_profile="cpu",
                           offload=False, time_limit_s=2)
    path = planned.save(tmp_path / "ten.json")
    torch.manual_seed(0)
    model = llama.LLaMA(TWELVE)
    inputs = llama.make_batch(TWELVE, 4, 64)
    opt = optsched.optimize(model, "90%", example_inputs=inputs, device_profile="cpu", plan=path)
    assert any("loaded from" in n for n in opt.plan.stats.notes)
    assert planned.summary()["n_recomputed"] > 0  # a plan that changes the step
    eager = measure_training_step(model, model, inputs)
    planned_step = measure_training_step(opt, model, inputs)
    assert planned_step.grads.keys() == eager.grads.keys()
    for n, g in eager.grads.items():
        assert torch.equal(planned_step.grads[n], g), n
    assert planned_step.peak_bytes == opt.plan.predicted_peak_bytes


class _Block(nn.Module):
    def __init__(self, width: int, scale: float = 1.0):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) * self.scale


class _Stack(nn.Module):
    """12 blocks; `every` > 0: each every-th block's output doubled by the stack's own loop (the blocks alike)."""

    def __init__(self, blocks, every: int = 0):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.every = every

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x)
            if self.every and i % self.every == self.every - 1:
                x = x * 2
        return x.pow(2).mean()


def _stack(every=0, scales=None, tie=False):
    def build():
        blocks = [_Block(16, s) for s in (scales or [1.0] * 12)]
        if tie:
            blocks[5].lin.weight = blocks[4].lin.weight
        return _Stack(blocks, every), (torch.randn(4, 16),)
    return build


@pytest.mark.parametrize("build, why", [
    (_stack(every=4), "the stack's loop treats every 4th block apart: stamping 4 blocks into 5 is not the trace of 5"),
    (_stack(scales=[1.0] * 11 + [0.5]), "one block's setting differs"),
    (_stack(tie=True), "two blocks share a weight"),
])
def test_blocks_that_differ_are_traced_whole(build, why):
    stamped, _ = _joints(build)
    assert stamped is None, why


def test_alike_blocks_of_a_plain_stack_are_stamped():
    stamped, traced = _joints(_stack())
    assert stamped is not None and stamping.first_difference(stamped[0], traced) is None


def test_the_capture_charges_what_it_traced_and_stamped():
    from benchmarks.planning_time import PlanningAccounts

    with PlanningAccounts() as recorded:
        plan_offline(lambda: _stack()()[0], lambda: (torch.randn(4, 16),), None, device_profile="h100", time_limit_s=2)
        assert set(recorded.made[-1].taken["charged"]["units"]) == {"graph_node_captured", "graph_node_stamped"}
        plan_offline(lambda: _stack(every=4)()[0], lambda: (torch.randn(4, 16),), None, device_profile="h100",
                     time_limit_s=2)
        assert set(recorded.made[-1].taken["charged"]["units"]) == {"graph_node_captured"}
