"""The module's state the captured program does not read (an unused submodule, a buffer kept for
checkpoints) is on the device for the whole step: every plan counts it, so the measured peak is the
predicted one and stays within the budget."""

from __future__ import annotations

import torch

import optsched
from optsched.costs.measure import measure_training_step, unread_state


class WithUnusedState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())])
        self.unused = torch.nn.Linear(1024, 1024)  # 4 MiB, never called
        self.register_buffer("kept_for_checkpoints", torch.zeros(1024, 256))  # 1 MiB, never read

    def forward(self, x):
        return self.net(x).square().sum()


def test_unused_parameters_and_buffers_count_toward_the_peak():
    torch.manual_seed(0)
    model, x = WithUnusedState(), torch.randn(512, 256)
    eager = measure_training_step(lambda x: model(x), model, (x,))
    budget = int(0.9 * eager.peak_bytes)
    opt = optsched.optimize(model, budget, example_inputs=(x,))
    got = measure_training_step(opt, model, (x,))
    assert got.peak_bytes == opt.plan.predicted_peak_bytes <= budget
    assert got.grads.keys() == eager.grads.keys()
    for name, g in eager.grads.items():
        torch.testing.assert_close(got.grads[name], g, rtol=0, atol=0)
    unread = [t.name for t in opt.plan.problem.tensors if "does not read" in t.name]
    assert sorted(unread) == sorted(["unused.weight (module state the program does not read)",
                                     "unused.bias (module state the program does not read)",
                                     "kept_for_checkpoints (module state the program does not read)"])


def test_unread_state_counts_each_storage_once_and_only_what_the_program_does_not_read():
    w = torch.zeros(10, 10)
    read = torch.zeros(4)
    state = [("w", w), ("w_tied", w), ("w_view", w[0]), ("read", read), ("read_view", read[1:]),
             ("meta", torch.zeros(8, device="meta"))]
    assert unread_state(state, [read[:2], 3], torch.device("cpu")) == [("w", 400)]
    assert unread_state(state, [], torch.device("meta")) == [("meta", 32)]
