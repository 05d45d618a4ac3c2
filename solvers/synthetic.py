"""Synthetic problems with no model at all: for tests, fuzzing and the notebooks."""

from __future__ import annotations

import random

from .model.problem import Op, Phase, Problem, Tensor, TensorKind


class _Builder:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.tensors: list[Tensor] = []

    def tensor(self, name: str, nbytes: int, kind: TensorKind = TensorKind.INPUT) -> int:
        self.tensors.append(Tensor(len(self.tensors), name, nbytes, kind))
        return len(self.tensors) - 1

    def op(self, name: str, phase: Phase, inputs: list[int], out_bytes: list[int], time_s: float, recomputable: bool = True) -> list[int]:
        oid = len(self.ops)
        outs = []
        for k, b in enumerate(out_bytes):
            self.tensors.append(Tensor(len(self.tensors), f"{name}.{k}", b, TensorKind.ACTIVATION, oid))
            outs.append(len(self.tensors) - 1)
        self.ops.append(Op(oid, name, phase, tuple(dict.fromkeys(inputs)), tuple(outs), time_s, recomputable))
        return outs


def chain_training_problem(
    n_layers: int = 8, act_bytes: int = 1 << 20, seed: int = 0, host_bw: float = 0.0, host_budget_bytes: int | None = None
) -> Problem:
    """A residual-free chain: layer i = matmul (slow) then pointwise (fast); backward mirrors it.

    `host_bw` > 0 allows offloading activations to the host at that many bytes/s."""
    rng = random.Random(seed)
    b = _Builder()
    x = b.tensor("x", act_bytes)
    weights = [b.tensor(f"w{i}", act_bytes // 4) for i in range(n_layers)]
    acts = [x]
    h = x
    for i in range(n_layers):
        (m,) = b.op(f"mm{i}", Phase.FW, [h, weights[i]], [act_bytes], 1e-3 * rng.uniform(0.8, 1.2))
        (h,) = b.op(f"act{i}", Phase.FW, [m], [act_bytes], 1e-4)
        acts.append(m)
        acts.append(h)
    (loss,) = b.op("loss", Phase.FW, [h], [4], 1e-5)
    seed_grad = b.tensor("tangent", 4, TensorKind.TANGENT)
    (g,) = b.op("loss_bw", Phase.BW, [seed_grad, h], [act_bytes], 1e-4)
    grads = []
    for i in reversed(range(n_layers)):
        m, h_in = acts[2 * i + 1], acts[2 * i]
        (gm,) = b.op(f"act{i}_bw", Phase.BW, [g, m], [act_bytes], 1e-4)
        (gw,) = b.op(f"mm{i}_bw_w", Phase.BW, [gm, h_in], [act_bytes // 4], 1e-3)
        (g,) = b.op(f"mm{i}_bw_x", Phase.BW, [gm, weights[i]], [act_bytes], 1e-3)
        grads.append(gw)
    return Problem(
        b.ops, b.tensors, outputs=frozenset([loss, *grads]), name=f"chain{n_layers}",
        host_bw=host_bw, host_budget_bytes=host_budget_bytes,
    )


def parallel_paths_problem(n_paths: int = 10, nbytes: int = 256 * 256 * 4) -> Problem:
    """The Thunder seed function as data: paths of relu, mm, relu, mm into an accumulator, forward only."""
    b = _Builder()
    t0s = [b.tensor(f"t0_{i}", nbytes) for i in range(n_paths)]
    a = b.tensor("a", nbytes)
    t1s = [b.op(f"relu1_{i}", Phase.FW, [t], [nbytes], 1e-5)[0] for i, t in enumerate(t0s)]
    t2s = [b.op(f"mm1_{i}", Phase.FW, [t, t], [nbytes], 1e-4)[0] for i, t in enumerate(t1s)]
    t3s = [b.op(f"relu2_{i}", Phase.FW, [t], [nbytes], 1e-5)[0] for i, t in enumerate(t2s)]
    for i, t in enumerate(t3s):
        (a,) = b.op(f"mm2_{i}", Phase.FW, [t, a], [nbytes], 1e-4)
    return Problem(b.ops, b.tensors, outputs=frozenset([a]), name=f"paths{n_paths}")
