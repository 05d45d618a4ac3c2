"""Optimizer steps: input mutations folded into the ops that compute them (`optsched.inplace`).

How an optimizer step is compiled (torch 2.13):

* `opt.step` graph-breaks on purpose (`torch._dynamo.graph_break()` in its `_use_grad`
  wrapper), so `optimize(lambda: opt.step())` (fullgraph) fails. The step compiles whole
  when the undecorated `Adam.step` is called under `torch.no_grad()` (`benchmarks.adam_step.step_fn`).
* Dynamo initializes missing optimizer state itself, so no eager step is needed first.
* Dynamo traces Adam's `capturable=True` branch whatever the group says (bias corrections
  as float32 tensor ops) and rewrites `addcmul_`/`addcdiv_` with a value into mul + fma
  (optsched puts them back: `optsched.restore_ops`). No compiled step, torch.compile's
  inductor included, is bitwise equal to eager `opt.step()` (about 4e-8 apart after 3
  steps); the bitwise reference is the same traced program run op by op
  (`torch.compile(..., backend="eager")` with `enable_dynamo_decompositions=False`).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch.multiprocessing.reductions import StorageWeakRef

import optsched
from optsched.compiler.backend import PlanningBackend
from optsched.passes.inplace import fold_copy_back
from optsched.passes.restore_ops import restore_fused_pointwise
from optsched.passes.scalar_batching import batch_scalar_foreach, batch_scalar_ops
from benchmarks.adam_step import step_fn
from optsched.measure import live_bytes, measure_peak

TIME_LIMIT_S = 1.0
INDUCTOR_TIME_LIMIT_S = 12.0  # six Inductor compiles and its first start (priced in an explicit limit) within half of it
COPY_ = torch.ops.aten.copy_.default


# ---------------------------------------------------------------------------------------------
# helpers


def capture(fn, *args, clone: bool = True) -> fx.GraphModule:
    """The inference graph AOTAutograd hands our backend for `fn(*args)` (input mutations kept).

    `clone=False` passes the arguments themselves (views of one base stay aliased)."""
    graphs = []

    def compiler(gm, _inputs):
        graphs.append(copy.deepcopy(gm))
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=compiler, inference_compiler=compiler, keep_inference_input_mutations=True)
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*[_clone(a) if clone else a for a in args])
    (gm,) = graphs
    return gm


def _clone(a):
    return [t.clone() for t in a] if isinstance(a, list) else a.clone()


def _random_inputs(gm: fx.GraphModule, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in gm.graph.find_nodes(op="placeholder"):
        v = p.meta["val"]
        out.append(torch.randn(v.shape, generator=g, dtype=v.dtype).as_strided(v.shape, v.stride()))
    return out


def assert_same_program(before: fx.GraphModule, after: fx.GraphModule) -> None:
    """Run both graphs in program order on the same inputs: same outputs, same inputs afterwards."""
    a, b = _random_inputs(before), _random_inputs(before)
    out_a, out_b = before(*a), after(*b)
    for x, y in zip(list(out_a) + a, list(out_b) + b, strict=True):
        assert torch.equal(x, y)


def writes(graph: fx.Graph, only=None) -> collections.Counter:
    """Per placeholder: how many nodes (of target `only`, if given) write its storage (copy_, out= forms, in-place ops)."""
    names = {}
    for p in graph.find_nodes(op="placeholder"):
        if isinstance(p.meta.get("val"), torch.Tensor):
            names.setdefault(StorageWeakRef(p.meta["val"].untyped_storage()), p.name)
    count: collections.Counter = collections.Counter()
    for n in graph.nodes:
        group = n.meta.get("fusion_group")
        if group is not None and only is None:  # a fused kernel stores into each input its members write once
            for dest in set(group.writes.values()):
                key = StorageWeakRef(dest.meta["val"].untyped_storage())
                if key in names:
                    count[names[key]] += 1
            continue
        target = n.target
        if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        if only is not None and target is not only:
            continue
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = n.kwargs.get(arg.name) if arg.kwarg_only or i >= len(n.args) else n.args[i]
            for x in value if isinstance(value, (list, tuple)) else [value]:
                key = StorageWeakRef(x.meta["val"].untyped_storage())
                if key in names:
                    count[names[key]] += 1
    return count


def fold(fn, *args, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    before = capture(fn, *args)
    after = copy.deepcopy(before)
    n = fold_copy_back(after, **kwargs)
    assert_same_program(before, after)
    # every mutated input is still written exactly once
    assert set(writes(after.graph)) == set(writes(before.graph))
    assert set(writes(after.graph).values()) <= {1}
    return before, after, n


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


X, G = torch.randn(8, 8), torch.randn(8, 8)


# ---------------------------------------------------------------------------------------------
# the pass on small functions


def test_pointwise_update_is_computed_into_the_input():
    def f(x, g):
        x.add_(g * 2)

    _, after, n = fold(f, X, G)
    assert n == 1
    assert COPY_ not in targets(after)
    (node,) = [n for n in after.graph.nodes if n.target is torch.ops.aten.add.out]
    (x,) = [p for p in after.graph.find_nodes(op="placeholder") if p is node.kwargs["out"]]
    assert node.meta["val"] is x.meta["val"]  # writes x's storage, allocates nothing


def test_op_may_read_the_input_it_writes_elementwise():
    def f(x):
        x.mul_(x.sum())  # the sum runs before the write in every order

    _, after, n = fold(f, X)
    assert n == 1 and torch.ops.aten.mul.out in targets(after)


def test_op_reading_another_view_of_the_input_it_writes_is_not_folded():
    def f(x):
        x.add_(x.t())  # would read elements it already overwrote

    _, after, n = fold(f, X)
    assert n == 0 and COPY_ in targets(after)


def test_new_value_read_by_a_later_op_is_not_folded():
    def f(x, g):
        x.mul_(2)
        return x + g  # reads the new value: the planner could not order it after the write

    _, after, n = fold(f, X, G)
    assert n == 0 and COPY_ in targets(after)
    # in program order the readers may read the input after the write instead
    _, after, n = fold(f, X, G, redirect_readers=True)
    assert n == 1 and COPY_ not in targets(after)


def test_returned_input_is_returned_from_the_folded_write():
    def f(x, g):
        x.mul_(g)
        return x  # AOTAutograd returns the copy_ (an alias of x); the folded write returns x too

    _, after, n = fold(f, X, G)
    assert n == 1
    (out,) = after.graph.find_nodes(op="output")
    assert out.args[0][0].target is torch.ops.aten.mul.out


def test_new_value_returned_is_not_computed_into_the_input():
    def f(x, g):
        y = x * g
        x.copy_(y)
        return y  # must not become an alias of x

    _, after, n = fold(f, X, G, redirect_readers=True)
    assert n == 1  # x is written from y directly, without the functional copy in between
    assert torch.ops.aten.mul.Tensor in targets(after) and torch.ops.aten.copy.default not in targets(after)


def test_old_value_read_after_the_op_is_not_folded():
    def f(x, g):
        new = torch.addcmul(x, g, g)
        s = (x.t() * 3).sum()  # reads the old x, through a view, after `new` is computed
        x.copy_(new)
        return s

    before, after, n = fold(f, X, G)
    assert torch.ops.aten.t.default in targets(before)
    assert n == 0 and COPY_ in targets(after)


def test_old_value_read_before_the_op_but_not_by_it_is_not_folded():
    def f(x, g):
        s = (x.t() * 3).sum()  # nothing orders this read before the write once they are independent
        x.add_(g)
        return s

    _, after, n = fold(f, X, G)
    assert n == 0 and COPY_ in targets(after)


def test_one_value_copied_into_two_inputs():
    def f(x, g):
        t = x + g
        x.copy_(t)
        g.copy_(t)

    before, after, n = fold(f, X, G)
    assert targets(before).count(torch.ops.aten.copy.default) == 2
    # the functional copies go; each input is written straight from t
    assert n == 2
    assert torch.ops.aten.copy.default not in targets(after)
    assert targets(after).count(COPY_) == 2
    # t computed into x, then copied from x into g
    _, after, n = fold(f, X, G, redirect_readers=True)
    assert n == 2 and targets(after).count(COPY_) == 1 and torch.ops.aten.add.out in targets(after)


def test_inputs_aliasing_one_storage():
    base = torch.randn(8)

    def f(a, b):
        a.mul_(2)
        b.add_(1)

    before = capture(f, base[:5], base[3:], clone=False)
    after = copy.deepcopy(before)
    fold_copy_back(after)
    assert_same_program(before, after)
    assert list(writes(after.graph).values()) == [1]  # AOTAutograd passes the base once

    ref = torch.randn(8)
    got = ref.clone()
    f(ref[:5], ref[3:])
    opt = optsched.optimize(f, time_limit_s=TIME_LIMIT_S)
    with torch.no_grad():
        opt(got[:5], got[3:])
    assert torch.equal(got, ref)


def test_foreach_update_becomes_the_in_place_foreach_op():
    xs, ys = [torch.randn(4, 4) for _ in range(3)], [torch.randn(4, 4) for _ in range(3)]

    def f(a, b, c, d, e, h):
        torch._foreach_addcmul_([a, b, c], [d, e, h], [d, e, h], value=0.5)

    _, after, n = fold(f, *xs, *ys)
    assert n == 3
    assert torch.ops.aten._foreach_addcmul_.Scalar in targets(after)
    assert COPY_ not in targets(after) and torch.ops.aten._foreach_addcmul.Scalar not in targets(after)


def test_foreach_outputs_read_later_are_not_folded():
    def f(a, b):
        torch._foreach_mul_([a, b], 2.0)
        return a.sum() + b.sum()

    _, after, n = fold(f, X, G)
    assert n == 0 and targets(after).count(COPY_) == 2


def test_foreach_reading_a_written_list_element_elsewhere_is_not_folded():
    def f(a, b):
        torch._foreach_add_([a, b], [b, a])  # each element also read at another position

    _, after, n = fold(f, X, G)
    assert n == 0 and targets(after).count(COPY_) == 2


def test_foreach_with_one_tensor_twice_is_not_folded():
    def f(a):
        torch._foreach_mul_([a, a], 2.0)

    _, _, n = fold(f, X)
    assert n == 0


# ---------------------------------------------------------------------------------------------
# ops Dynamo splits, put back (optsched.restore_ops)

FMA = "prims.fma.default"


def _run_eager(fn, args) -> list[torch.Tensor]:
    args = [_clone(a) for a in args]
    with torch.no_grad():
        fn(*args)
    return [t for a in args for t in (a if isinstance(a, list) else [a])]


def _run_graph(fn, args, transform=lambda gm: None) -> list[torch.Tensor]:
    """`fn(*args)` compiled, its inference graph changed by `transform` (Dynamo keeps the arguments' order)."""

    def compiler(gm, _inputs):
        transform(gm)
        return make_boxed_func(gm)

    args = [_clone(a) for a in args]
    backend = aot_autograd(fw_compiler=compiler, inference_compiler=compiler, keep_inference_input_mutations=True)
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    torch._dynamo.reset()
    return [t for a in args for t in (a if isinstance(a, list) else [a])]


def test_addcmul_and_addcdiv_with_a_value_are_put_back_bitwise_as_eager():
    def f(x, a, b):
        x.addcmul_(a, b, value=0.3)
        x.addcdiv_(a, b, value=-0.2)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(64, generator=g), torch.randn(64, generator=g), torch.rand(64, generator=g) + 0.5]
    gm = capture(f, *args)
    assert [str(t) for t in targets(gm)].count(FMA) == 2  # Dynamo's mul + fma and div + fma
    assert restore_fused_pointwise(gm) == 2
    assert FMA not in [str(t) for t in targets(gm)]
    assert torch.ops.aten.addcmul.default in targets(gm) and torch.ops.aten.addcdiv.default in targets(gm)
    traced, eager = _run_graph(f, args), _run_eager(f, args)
    restored = _run_graph(f, args, restore_fused_pointwise)
    assert all(torch.equal(x, y) for x, y in zip(restored, eager, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(traced, eager, strict=True))  # fma rounds differently


def test_product_read_elsewhere_is_not_put_back():
    def f(x, a, b):
        p = a * b
        x.addcmul_(a, b, value=0.3)
        return p.sum()

    gm = capture(f, torch.randn(8), torch.randn(8), torch.randn(8))
    before = [str(t) for t in targets(gm)].count(FMA)
    restore_fused_pointwise(gm)
    # Dynamo's own product has the fma as its only reader, so it goes; the user's stays
    assert [str(t) for t in targets(gm)].count(FMA) <= before


def test_foreach_lerp_is_put_back():
    """Adam's lerp weight (1 - beta1 < 0.5). A weight >= 0.5 traces to another formula, with a
    tensor constant, left as it is (test_optimize runs it)."""

    def f(xs, ends):
        torch._foreach_lerp_(xs, ends, 0.1)

    g = torch.Generator().manual_seed(0)
    args = [[torch.randn(n, generator=g) for n in (5, 7)], [torch.randn(n, generator=g) for n in (5, 7)]]
    gm = capture(f, *args)
    # the polyfill's temporaries (a difference and a full_like per tensor) are gone
    assert restore_fused_pointwise(gm) == 1 and torch.ops.aten._foreach_lerp.Scalar in targets(gm)
    assert torch.ops.aten.full_like.default not in targets(gm)
    restored, eager = _run_graph(f, args, restore_fused_pointwise), _run_eager(f, args)
    assert all(torch.equal(x, y) for x, y in zip(restored, eager, strict=True))


def test_chain_of_foreach_updates_runs_in_place():
    def f(xs, gs):
        torch._foreach_mul_(xs, 0.9)
        torch._foreach_addcmul_(xs, gs, gs, value=0.1)
        torch._foreach_add_(xs, 1.0)
        return torch._foreach_mul(xs, 2.0)  # reads the new values

    g = torch.Generator().manual_seed(0)
    args = [[torch.rand(n, generator=g) for n in (3, 4)], [torch.randn(n, generator=g) for n in (3, 4)]]
    before = capture(f, *args)
    after = copy.deepcopy(before)
    restore_fused_pointwise(after)
    assert fold_copy_back(after, redirect_readers=True) == 2
    assert COPY_ not in targets(after)
    inplace = [str(t) for t in targets(after) if str(t).startswith("aten._foreach_") and "_." in str(t)]
    assert inplace == ["aten._foreach_mul_.Scalar", "aten._foreach_addcmul_.Scalar", "aten._foreach_add_.Scalar"]
    assert_same_program(before, after)


def test_chain_whose_intermediate_is_read_elsewhere_is_not_folded():
    def f(xs, gs):
        ys = torch._foreach_mul(xs, 0.9)
        torch._foreach_add_(ys, 1.0)
        torch._foreach_copy_(xs, ys)
        return torch._foreach_mul(xs, 2.0)

    args = [[torch.rand(3), torch.rand(4)], [torch.randn(3), torch.randn(4)]]
    before = capture(f, *args)
    after = copy.deepcopy(before)
    fold_copy_back(after, redirect_readers=True)
    assert_same_program(before, after)


# ---------------------------------------------------------------------------------------------
# per-parameter scalars as one vector (optsched.scalar_batching)


def _scalar_update(xs, steps):
    torch._foreach_add_(steps, 1)
    bc = torch._foreach_pow(0.9, steps)  # 0-dim tensors, one per parameter
    torch._foreach_sub_(bc, 1)
    torch._foreach_neg_(bc)
    torch._foreach_sqrt_(bc)
    torch._foreach_div_(xs, bc)  # each tensor by its own scalar


def test_foreach_ops_over_scalars_run_as_one_vector_op():
    g = torch.Generator().manual_seed(0)
    n = 20
    args = [[torch.randn(3, 4, generator=g) for _ in range(n)], [torch.tensor(float(i)) for i in range(n)]]
    gm = capture(_scalar_update, *args)
    fold_copy_back(gm, redirect_readers=True)
    assert batch_scalar_foreach(gm) == 4  # pow, sub, neg, sqrt: on the stacked steps
    ops = [str(t) for t in targets(gm)]
    assert ops.count("aten.stack.default") == 1 and ops.count("aten.unbind.int") >= 1
    # left as foreach: the step write and the division of the big tensors (both folded in place)
    assert [o for o in ops if o.startswith("aten._foreach")] == ["aten._foreach_add_.Scalar", "aten._foreach_div_.List"]
    want = _run_eager(_scalar_update, args)

    def prepare(gm):
        fold_copy_back(gm, redirect_readers=True)
        batch_scalar_foreach(gm)

    got = _run_graph(_scalar_update, args, prepare)
    for x, y in zip(got, want, strict=True):  # a vectorized kernel may round pow differently
        torch.testing.assert_close(x, y, rtol=1e-6, atol=0)


def _scalar_loop(xs, steps):
    for x, step in zip(xs, steps):
        step.add_(1)
        bias_correction = 1 - 0.9**step  # 0-dim tensor ops, one chain per parameter
        x.div_(bias_correction.sqrt())


def test_same_scalar_op_of_every_parameter_runs_as_one_op():
    g = torch.Generator().manual_seed(0)
    n = 12
    args = [[torch.randn(3, 4, generator=g) for _ in range(n)], [torch.tensor(float(i)) for i in range(n)]]

    def prepare(gm):
        fold_copy_back(gm, redirect_readers=True)
        assert batch_scalar_ops(gm) == 3 * n  # pow, rsub, sqrt of every chain
        ops = [str(t) for t in targets(gm)]
        assert ops.count("aten.pow.Scalar") == 1 and ops.count("aten.sqrt.default") == 1
        assert ops.count("aten.div.out") == n  # the per-parameter writes stay

    got, want = _run_graph(_scalar_loop, args, prepare), _run_eager(_scalar_loop, args)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=0)


def test_scalar_ops_of_dependent_chains_are_not_stacked():
    def f(x, s):
        a = (s * 2).exp()
        b = (a * 2).exp()  # the same op again, but on the first one's result: a deeper level
        c = (b * 2).exp()
        d = (c * 2).exp()
        x.mul_(d)

    args = [torch.randn(4), torch.tensor(0.1)]
    gm = capture(f, *args)
    assert batch_scalar_ops(gm) == 0
    assert_same_program(capture(f, *args), gm)


def test_scalar_ops_sharing_a_tensor_operand_are_left_alone():
    def f(xs, scale):
        ys = torch._foreach_mul([x.sum() for x in xs], scale)  # a tensor shared by every element
        return torch.stack(ys).sum()

    gm = capture(f, [torch.randn(3) for _ in range(4)], torch.tensor(2.0))
    n_before = len(gm.graph.nodes)
    batch_scalar_foreach(gm)
    assert len(gm.graph.nodes) == n_before


# ---------------------------------------------------------------------------------------------
# Adam


def _model(foreach: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values()]


@pytest.mark.parametrize("executor", ["eager", "inductor"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_adam_step(foreach, executor, monkeypatch):
    """With the inductor executor each parameter's update (foreach ops split per tensor) is one
    fused kernel writing parameter and state in place: close to the traced program, not bitwise
    (Inductor's kernels round differently), and below eager's peak."""
    seen = {}
    inference = PlanningBackend.compile_inference

    def spy(self, gm, example_inputs):
        seen["captured"] = copy.deepcopy(gm)
        run = inference(self, gm, example_inputs)
        seen["lowered"] = run.graph_module
        return run

    monkeypatch.setattr(PlanningBackend, "compile_inference", spy)
    model, opt = _model(foreach)
    ref_model, ref_opt = _model(foreach)
    eager_model, eager_opt = _model(foreach)
    # Inductor's compiles draw on the time limit (they stop where they would overrun it): a limit that holds them
    limit = TIME_LIMIT_S if executor == "eager" else INDUCTOR_TIME_LIMIT_S
    step = optsched.optimize(step_fn(opt), None, time_limit_s=limit, executor=executor)
    ref = torch.compile(step_fn(ref_opt), backend="eager", fullgraph=True)
    for _ in range(3):
        step()
        # the traced program run op by op, with addcmul_/addcdiv_ whole: optsched puts back the
        # ops Dynamo splits into mul + fma (optsched/passes/restore_ops.py)
        with torch._dynamo.config.patch(enable_dynamo_decompositions=False):
            ref()
        eager_opt.step()

    # bitwise equal to the traced program run op by op; close to eager opt.step() (Dynamo traces
    # Adam's capturable branch, whose bias corrections are tensors)
    for got, want, eager in zip(
        list(model.parameters()) + _state(opt),
        list(ref_model.parameters()) + _state(ref_opt),
        list(eager_model.parameters()) + _state(eager_opt),
        strict=True,
    ):
        if executor == "eager":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)

    # every mutated tensor is written in the program that runs, with no copy-back left but the
    # step counters'; a tensor written more than once is updated in place by a chain of ops
    # (exp_avg_sq.mul_(beta2).addcmul_(g, g), as eager does), never through a copy
    captured, lowered = writes(seen["captured"].graph), writes(seen["lowered"].graph)
    copied = writes(seen["lowered"].graph, only=COPY_)
    n_params = len(list(model.parameters()))
    assert len(captured) == 4 * n_params  # parameter, exp_avg, exp_avg_sq, step
    assert set(captured.values()) == {1}
    assert lowered.keys() == captured.keys()
    assert all(copied[name] == 0 for name, n in lowered.items() if n > 1)
    assert set(lowered.values()) <= {1, 2} and sum(copied.values()) <= n_params
    if executor == "inductor":  # one kernel per parameter writes its parameter and both moments, once each
        groups = [n.meta["fusion_group"] for n in seen["lowered"].graph.nodes if "fusion_group" in n.meta]
        updates = [g for g in groups if len(set(g.writes.values())) == 3]
        assert len(updates) == n_params
        assert set(lowered.values()) == {1}

    # no higher than eager's: temporaries are written into dying lists as eager's in-place ops do
    # (the slack: the compiled step's bias corrections are 0-dim float32 tensors, two per parameter)
    eager_peak = measure_peak(eager_opt.step).peak_bytes
    assert measure_peak(step).peak_bytes <= eager_peak + 2 * 4 * n_params

    # the planner's peak is the allocator's
    plan = step.plan
    start = live_bytes(model, [p.grad for p in model.parameters()], _state(opt))
    measured = measure_peak(step)
    assert measured.end_bytes == 0
    assert measured.peak_bytes == plan.predicted_peak_bytes - start
    assert step.plan is plan
