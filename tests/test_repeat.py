"""optimize() many times over: Dynamo caches per code object and gives up after 8 entries."""

import torch

import optsched


def _loss(x, w):
    return torch.relu(x @ w).sum()


def test_the_same_function_can_be_optimized_more_times_than_dynamos_cache_limit():
    x = torch.randn(16, 16)
    w = torch.randn(16, 16, requires_grad=True)
    for _ in range(10):
        opt = optsched.optimize(_loss, None, device_profile="cpu", time_limit_s=1)
        opt(x, w).backward()
        assert opt.plan is not None


def test_the_same_module_class_can_be_optimized_more_times_than_dynamos_cache_limit():
    x = torch.randn(8, 16)
    for seed in range(10):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = optsched.optimize(m, None, device_profile="cpu", time_limit_s=1)
        opt(x).sum().backward()
        assert opt.plan is not None and opt.plan.kind == "training"
