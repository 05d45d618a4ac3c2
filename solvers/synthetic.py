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


def random_layered_problem(
    n_nodes: int = 100,
    n_layers: int | None = None,
    max_extra_inputs: int = 2,
    unit_bytes: int = 1 << 20,
    size_range: tuple[int, int] = (1, 10),
    time_range: tuple[float, float] = (1e-4, 1e-3),
    seed: int = 0,
) -> Problem:
    """A random layered DAG as a training step, as in the Moccasin paper's random-layered graphs.

    The forward DAG has `n_nodes` ops split evenly into `n_layers` layers (default: about sqrt(n_nodes)).
    Every op reads one random op of the previous layer (the first layer reads the input `x`) and up to
    `max_extra_inputs` more from random earlier layers; its output is `unit_bytes` times a random integer
    in `size_range`, its time uniform in `time_range`. A `loss` op reads every op nobody else reads.

    The backward mirrors the forward, one op per forward op in reverse, as autograd runs it: `bw_i` reads
    the gradient of op i's output and what the chain rule needs (op i's forward inputs and its output; a
    sink's gradient comes from `loss_bw`) and adds its contribution to the gradient of each activation it
    read. Gradients accumulate as autograd does: the first contribution to a tensor's gradient allocates it
    (the tensor's size), later ones write into it (`Op.reuse`, all pairs together), so one buffer per
    tensor is pending, not one per reader. Backward ops take twice their forward op's time. Every forward
    op is recomputable. `n_nodes + 1` forward ops (a `loss` reads every op nobody else reads) and
    `n_nodes + 1` backward ops; the step's output is the loss. Same arguments, same problem.
    """
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    rng = random.Random(seed)
    n_layers = max(1, min(n_nodes, n_layers if n_layers is not None else round(n_nodes**0.5)))
    layer_of = [min(n_layers - 1, i * n_layers // n_nodes) for i in range(n_nodes)]
    layers: list[list[int]] = [[] for _ in range(n_layers)]
    for i, lay in enumerate(layer_of):
        layers[lay].append(i)
    b = _Builder()
    x = b.tensor("x", unit_bytes * size_range[1])
    out: list[int] = []  # forward op i -> its output tensor
    fw_inputs: list[list[int]] = []  # forward op i -> forward ops whose outputs it reads
    for i in range(n_nodes):
        lay = layer_of[i]
        preds: list[int] = []
        if lay > 0:
            preds.append(rng.choice(layers[lay - 1]))
            earlier = [j for j in range(n_nodes) if layer_of[j] < lay]
            for _ in range(rng.randint(0, max_extra_inputs)):
                preds.append(rng.choice(earlier))
        preds = list(dict.fromkeys(preds))
        fw_inputs.append(preds)
        ins = [out[j] for j in preds] if preds else [x]
        (t,) = b.op(f"n{i}", Phase.FW, ins, [unit_bytes * rng.randint(*size_range)], rng.uniform(*time_range))
        out.append(t)
    readers: list[list[int]] = [[] for _ in range(n_nodes)]
    for i, preds in enumerate(fw_inputs):
        for j in preds:
            readers[j].append(i)
    sinks = [i for i in range(n_nodes) if not readers[i]]
    (loss,) = b.op("loss", Phase.FW, [out[i] for i in sinks], [4], time_range[0])
    tangent = b.tensor("tangent", 4, TensorKind.TANGENT)
    sink_grads = b.op("loss_bw", Phase.BW, [tangent] + [out[i] for i in sinks], [b.tensors[out[i]].bytes for i in sinks],
                      time_range[0], recomputable=False)
    grad: dict[int, int] = dict(zip(sinks, sink_grads))  # forward op -> the latest version of its output's gradient
    for i in reversed(range(n_nodes)):
        preds = fw_inputs[i]
        ins = [grad[i], out[i]] + [out[j] for j in preds]
        outs = b.op(f"n{i}_bw", Phase.BW, ins + [grad[j] for j in preds if j in grad],
                    [b.tensors[out[j]].bytes for j in preds], 2 * b.ops[i].time_s, recomputable=False)
        pairs = [(new, grad[j]) for new, j in zip(outs, preds) if j in grad]
        if pairs:
            op = b.ops[-1]
            b.ops[-1] = Op(op.id, op.name, op.phase, op.inputs, op.outputs, op.time_s, op.recomputable,
                           reuse=tuple(pairs), reuse_all=True)
        grad.update(zip(preds, outs))
    return Problem(b.ops, b.tensors, outputs=frozenset([loss]), name=f"layered{n_nodes}_s{seed}")
