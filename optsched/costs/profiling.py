"""Run a captured graph's ops on the device, one at a time: per-op time, kernel scratch space, and
in-place out= forms.

Planning a CPU step with spec-sheet numbers misjudges what recomputation costs
(attention and layer norm are far from the roofline there), and kernels allocate
scratch memory no graph shows (a convolution's workspace, a dropout backward's
temporaries). Running each op on random inputs of its shapes gives both.

Each op runs alone, with only its own inputs made for it and freed after it: users plan because
the unplanned step does not fit, so planning must never hold more than one op's inputs, outputs and
scratch beyond what the caller already holds (the parameters, passed in as `real_inputs` and read
in place, never copied). Any plan holds at least that much while the op runs, so planning stays
within every budget a plan can meet. Integer inputs are zeros, a valid index for every op we have
seen, floats a fixed pattern (`random_like`); an op that fails on made-up inputs keeps the roofline's time
(listed in `NodeCosts.unmeasured`).

Identical ops (same target, argument layouts and values: a transformer's layers, an unrolled RNN's steps)
run once and share the measurement, within a graph and across the graphs of the process (`op_cache`); a time is
the median of its runs rounded to a coarse grid (`stable_time`), so two planning runs of one graph mostly plan on
the same costs. A limit on the solvers' clock bounds the timing: the lightest ops are left to the roofline when it
is spent (issue 34: an LSTM's first call spent 290 s timing ops).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping

import torch
import torch.fx as fx
from torch.autograd.profiler import record_function

from . import op_cache
from .profiles import NodeCosts, get_profile, node_time, random_like
from .measure import device_sync, labelled_peaks, memory_profile
from ..solvers.model import clock
from ..passes.op_variants import inplace_foreach, out_variant
from ..optim.in_graph import is_update

_OP = "optsched::"
_OUT = "optsched_out::"


def profile_nodes(
    gm: fx.GraphModule, device: torch.device, reuse_inputs: dict[str, fx.Node | list[fx.Node]], repeat: int = 5,
    real_inputs: Mapping[str, torch.Tensor] | None = None, time_limit_s: float | None = None, time_ops: bool = True,
) -> NodeCosts:
    """Time every op (`_time_op`), each alone on inputs made for it, and in one more pass under the
    allocation profiler measure its scratch space; for each node in `reuse_inputs`, also run its out= form
    into a copy of that input (a foreach op: its in-place twin on a copy of its first list) and check it
    allocates no full-size temporary. `real_inputs`: the caller's tensors for placeholders (by name), read
    in place by ops that do not write them.

    Identical ops (`op_key`: a transformer's layers) run once, their measurements shared, the heaviest
    first; an op an earlier graph of the process timed is not timed again (`op_cache`). Once `time_limit_s`
    has passed on the solvers' clock (wall seconds, or in deterministic mode the work counted: "op_timed" per
    op, so the ops cut off are the same on every run), the ops not yet timed keep the roofline's time
    (`NodeCosts.estimated`); their scratch space is still measured (one run each): a plan must hold it.
    `time_ops=False`: the scratch space and out= forms alone, no times (a named profile's roofline times the ops,
    but the program runs on this device, whose kernels allocate what they allocate)."""
    from .._torch import profiler_enabled, unset_fake_temporarily

    groups = _heaviest_first(identical_ops(gm), device)
    times: dict[str, float] = {}
    unmeasured: dict[str, str] = {}
    op_cache.load_shared()
    with unset_fake_temporarily(), torch.no_grad():
        inputs = _OpInputs(gm, device, real_inputs or {})
        profiled = profiler_enabled()  # someone's profiling session: its overhead is in every run, not kept
        if time_ops:
            timed, left, reused = _time_ops(groups, inputs, repeat, time_limit_s, times, unmeasured, keep=not profiled)
        else:
            timed, left, reused = [], groups, 0
        if len(timed) > reused and not profiled:
            op_cache.save_shared()
        if profiled:
            # planning inside someone's profiling session (a measured first call): a profiler of our own would
            # end theirs. Scratch space stays unknown (0) and no op writes into its inputs, as with a roofline.
            return NodeCosts(times, {}, {}, scratch_measured=False, unmeasured=unmeasured,
                             estimated=[n.name for ops in left for n in ops] if time_ops else [], distinct=len(timed),
                             reused=reused)
        runs = [same for ops in timed + left for same in _same_out_form(ops, reuse_inputs)]
        clock.count("op_profiled", len(runs))  # every op's scratch, even the untimed ones' (memory_profile counts the pass)
        with memory_profile() as prof:
            for same in runs:
                try:
                    _profiled_run(same[0], inputs, reuse_inputs.get(same[0].name))
                except Exception as e:  # noqa: BLE001 - an op left untimed that rejects made-up inputs
                    if same[0].name in times:
                        raise
                    unmeasured.update(dict.fromkeys((n.name for n in same), _why(e)))
    workspace, reuse_ok, held = _scratch(prof, {same[0].name: reuse_inputs[same[0].name] for same in runs
                                                if same[0].name in reuse_inputs})
    for same in runs:  # each run's measurement for every op like it
        rep = same[0].name
        workspace.update({n.name: workspace[rep] for n in same if rep in workspace})
        reuse_ok.update({n.name: reuse_ok[rep] for n in same if rep in reuse_ok})
        held.update({n.name: held[rep] for n in same if rep in held})
    for name in unmeasured:
        workspace.pop(name, None)
        reuse_ok.pop(name, None)
        held.pop(name, None)
    estimated = [n.name for ops in left for n in ops if n.name not in unmeasured] if time_ops else []
    return NodeCosts(times, workspace, reuse_ok, unmeasured=unmeasured, estimated=estimated, distinct=len(timed),
                     reused=reused, held_bytes=held)


def _time_ops(groups: list[list[fx.Node]], inputs: _OpInputs, repeat: int, time_limit_s: float | None,
              times: dict[str, float], unmeasured: dict[str, str], keep: bool,
              ) -> tuple[list[list[fx.Node]], list[list[fx.Node]], int]:
    """Each group's time, `op_cache`'s or its first op's timed (kept there if `keep`), for all of them into
    `times` (or why not, into `unmeasured`), timing until `time_limit_s` has passed on the solvers' clock:
    the groups with a time, those left without, and how many times came from the cache."""
    deadline = None if time_limit_s is None else clock.now() + time_limit_s
    timed, left, reused = [], [], 0
    for ops in groups:
        key = shared_key(ops[0], inputs.device)
        t = None if key is None else op_cache.get(key)
        reused += t is not None
        if t is not None:
            # charged as if timed: the search's share of the limit, and so the plan, must not depend on what an
            # earlier graph or process timed (two processes sharing an op-time file planned a GPT at 45% to
            # 40.96 and 40.95 MiB: the second's op timing was free, and its search ran longer)
            clock.count("op_timed")
        if t is None and deadline is not None and clock.now() >= deadline:
            left.append(ops)
            continue
        if t is None:
            try:
                t = stable_time(_time_op(ops[0], inputs, repeat))
            except Exception as e:  # noqa: BLE001 - made-up inputs an op rejects: the roofline times it
                unmeasured.update(dict.fromkeys((n.name for n in ops), _why(e)))
                continue
            finally:
                clock.count("op_timed")
            if key is not None and keep:
                op_cache.put(key, t)
        times.update(dict.fromkeys((n.name for n in ops), t))
        timed.append(ops)
    return timed, left, reused


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def identical_ops(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The graph's ops grouped by `op_key`, each group in graph order, groups in order of first use."""
    groups: dict[tuple, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and not is_update(n):  # an optimizer update: its roofline (problem_builder)
            groups.setdefault(op_key(n), []).append(n)
    return list(groups.values())


def op_key(n: fx.Node) -> tuple:
    """What an op's time and scratch space depend on: its target, and per argument its layout (shape,
    strides, offset, storage size, dtype, device), which of the op's inputs it is (`mul(x, x)` is not
    `mul(x, y)`), or its value (a number, a dtype, a list of sizes)."""
    pos = {x: i for i, x in enumerate(n.all_input_nodes)}

    def key(a):
        if isinstance(a, fx.Node):
            return ("attr", pos[a], a.target) if a.op == "get_attr" else ("in", pos[a], _val_key(a.meta.get("val"), n))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(key(e) for e in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, key(v)) for k, v in a.items()))
        if isinstance(a, torch.Tensor):  # a constant in the graph: its own op
            return ("tensor", id(a))
        return (type(a).__name__, repr(a))

    return (n.target, key(n.args), key(n.kwargs))


def shared_key(n: fx.Node, device: torch.device) -> str | None:
    """`n`'s key in `op_cache` (`op_key` on `device`, as text); None when its time may depend on what only its
    own graph has (a module attribute, a constant tensor, a value without a layout): another graph's of that
    name may differ."""
    key = op_key(n)
    return None if _local(key) else repr((op_cache.place(device), key))


def _local(key) -> bool:
    return isinstance(key, tuple) and (key[:1] in (("attr",), ("tensor",), ("own",)) or any(map(_local, key)))


def _val_key(v, n: fx.Node):
    if isinstance(v, (list, tuple)):
        return tuple(_val_key(e, n) for e in v)
    if not isinstance(v, torch.Tensor):
        return (type(v).__name__, repr(v))
    try:
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.untyped_storage().nbytes(), v.dtype, str(v.device))
    except (RuntimeError, NotImplementedError):  # no strides or storage (sparse, nested): timed on its own
        return ("own", n.name)


def _heaviest_first(groups: list[list[fx.Node]], device: torch.device) -> list[list[fx.Node]]:
    """By the roofline's time of all a group's ops: a time limit leaves the roofline the lightest."""
    profile = get_profile(None, device)

    def weight(ops: list[fx.Node]) -> float:
        try:
            return node_time(ops[0], profile, quiet=True) * len(ops)
        except Exception:  # noqa: BLE001 - an order only: an op the roofline cannot weigh goes last
            return 0.0

    return sorted(groups, key=weight, reverse=True)


def _same_out_form(ops: list[fx.Node], reuse_inputs: dict[str, fx.Node | list[fx.Node]]) -> list[list[fx.Node]]:
    """`ops` (identical) split by which of its inputs, if any, its out= form would write into."""
    by: dict[object, list[fx.Node]] = {}
    for n in ops:
        into = reuse_inputs.get(n.name)
        pos = {x: i for i, x in enumerate(n.all_input_nodes)}
        where = None if into is None else ("into", tuple(pos.get(x) for x in into) if isinstance(into, list) else pos.get(into))
        by.setdefault(where, []).append(n)
    return list(by.values())


class _OpInputs:
    """The values one op reads, made when it runs and dropped after it."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, real: Mapping[str, torch.Tensor]):
        self.gm, self.device, self.real = gm, device, real

    def args(self, n: fx.Node) -> tuple[tuple, dict, dict[fx.Node, object]]:
        """`n`'s args and kwargs, and the value made for each input node."""
        writes = _writes_inputs(n)
        made = {x: self._value(x, writes) for x in n.all_input_nodes}
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda x: made[x])
        return args, kwargs, made

    def _value(self, x: fx.Node, writes: bool):
        if x.op == "get_attr":
            return _fetch_attr(self.gm, x.target)
        real = None if writes else self._real(x)
        return real if real is not None else _made(x.meta.get("val"), self.device)

    def _real(self, x: fx.Node):
        """The caller's tensor for a placeholder, or a view of one (a linear's `t(weight)`): no copy made."""
        if x.op == "placeholder":
            return self.real.get(x.name)
        if x.op != "call_function" or not _is_view(x):
            return None
        bases = {b: self._real(b) for b in x.all_input_nodes}
        if any(v is None for v in bases.values()):
            return None
        args, kwargs = fx.node.map_arg((x.args, x.kwargs), lambda b: bases[b])
        return x.target(*args, **kwargs)


def _made(v, device: torch.device):
    """A tensor like fake value `v` (its strides and storage offset kept: views read their base's layout)."""
    if isinstance(v, (list, tuple)):
        return type(v)(_made(e, device) for e in v)
    if not isinstance(v, torch.Tensor):
        return v
    if v.is_contiguous() and v.storage_offset() == 0:
        return random_like(v, device)
    base = random_like(torch.empty(v.untyped_storage().nbytes() // v.element_size(), dtype=v.dtype, device="meta"), device)
    return base.as_strided(v.shape, v.stride(), v.storage_offset())


def _is_view(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return (schema is not None and not schema.is_mutable and len(schema.returns) == 1
            and schema.returns[0].alias_info is not None)


def _writes_inputs(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is None or schema.is_mutable


def _fetch_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _time_op(n: fx.Node, inputs: _OpInputs, repeat: int) -> float:
    """Median of at least `repeat` runs after a warm-up; a fast op runs more often (up to `_MAX_RUNS`,
    within `_SHORT_S` in all), since one descheduled thread on a busy machine adds a whole time slice to a run.
    The median, not the fastest run: on a loaded machine the fastest is the rare run no thread waited in, the
    median what a run takes under that load, which another process sees again (an 8-op graph timed in 8
    processes at load 6 on 2 cores: 32% of ops equal on the TIME_STEP grid by median, 17% by fastest run)."""
    args, kwargs, _ = inputs.args(n)
    sync = device_sync()
    n.target(*args, **kwargs)  # warms caches and the allocator (the result is dropped at once)
    runs: list[float] = []
    while len(runs) < repeat or (sum(runs) < _SHORT_S and len(runs) < _MAX_RUNS):
        sync()
        t0 = time.perf_counter()
        out = n.target(*args, **kwargs)
        sync()
        runs.append(time.perf_counter() - t0)
        del out
    return statistics.median(runs)


_SHORT_S = 0.05
_MAX_RUNS = 20
TIME_STEP = 2 ** 0.25
"""Measured times are rounded to a power of TIME_STEP (times 1 ns), ±9%, and raised to TIME_FLOOR_S: on the idle
reference machine one op's fastest run in two processes differed by 2% (median) to 8% (9 in 10 ops), so most ops
get the same time in both. Not all, and on a loaded machine far fewer (the bundled GPT's 95 distinct ops timed in 4
processes at load 5-8 on 2 cores: 49% equal, pair by pair). A deterministic plan changes with any op's cost, so
two fresh processes plan alike only on shared measurements (`op_cache.shared_file`, on by default) or a plan
file."""
TIME_FLOOR_S = 1e-5
"""An op called from Python spends a few µs in dispatch, varying by as much: below 10 µs the timer measures the call,
not the op (GPT's ops under 10 µs in the runs above: equal in 66% of pairs on the grid alone, 99% floored)."""


def stable_time(seconds: float) -> float:
    """`seconds` on the TIME_STEP grid (at least TIME_FLOOR_S)."""
    steps = round(math.log(max(seconds, TIME_FLOOR_S) / 1e-9, TIME_STEP))
    return 1e-9 * TIME_STEP ** steps


def _profiled_run(n: fx.Node, inputs: _OpInputs, reuse: fx.Node | list[fx.Node] | None) -> None:
    """One labelled run for the scratch measurement; its inputs are made outside the label."""
    args, kwargs, made = inputs.args(n)
    with record_function(_OP + n.name):
        out = n.target(*args, **kwargs)
    del out
    if reuse is not None:
        _try_out_form(n, args, kwargs, made, reuse)


def _try_out_form(n: fx.Node, args: tuple, kwargs: dict, made: dict, into: fx.Node | list[fx.Node]) -> None:
    if isinstance(into, list):  # a foreach op: its in-place twin on copies of the first list
        dest = [t.clone() for t in args[0]]
        with record_function(_OUT + n.name):
            inplace_foreach(n.target)(dest, *args[1:], **kwargs)
    else:
        overload, out_name = out_variant(n.target)
        dest = made[into].clone()
        with record_function(_OUT + n.name):
            overload(*args, **{**kwargs, out_name: dest})
    del dest


def _scratch(prof, reuse_inputs: dict[str, fx.Node | list[fx.Node]],
             ) -> tuple[dict[str, int], dict[str, bool], dict[str, int]]:
    """Per op: its scratch (peak over what its outputs hold at its end), whether its out= form reuses its input, and
    what its outputs hold at its end."""
    workspace: dict[str, int] = {}
    held: dict[str, int] = {}
    out_peak: dict[str, int] = {}
    for name, (peak, end) in labelled_peaks(prof, _OP, _OUT).items():
        if name.startswith(_OP):
            workspace[name[len(_OP):]] = max(0, peak - max(end, 0))
            held[name[len(_OP):]] = max(end, 0)
        else:
            out_peak[name[len(_OUT):]] = peak
    reuse_ok = {}
    for node_name, src in reuse_inputs.items():
        vals = [x.meta.get("val") for x in (src if isinstance(src, list) else [src])]
        full = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
        got = out_peak.get(node_name)
        reuse_ok[node_name] = got is not None and got < full // 2
        if reuse_ok[node_name]:  # its own temporaries count when it runs in that form
            workspace[node_name] = max(workspace.get(node_name, 0), got)
    return workspace, reuse_ok, held


def real_placeholders(gm: fx.GraphModule, values: list) -> dict[str, torch.Tensor]:
    """The caller's tensors by placeholder name, where `values` line up with `gm`'s primals one to one
    (same count, shapes, strides and dtypes); else none, and every input is made up."""
    primals = [p for p in gm.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")]
    if len(primals) != len(values):
        return {}
    out = {}
    for p, v in zip(primals, values):
        fake = p.meta.get("val")
        if not (isinstance(v, torch.Tensor) and isinstance(fake, torch.Tensor)):
            continue
        if v.shape != fake.shape or v.stride() != fake.stride() or v.dtype != fake.dtype or v.device.type != fake.device.type:
            return {}
        out[p.name] = v
    return out

