"""The `optsched` command: plan a model offline, and read plan files.

    optsched plan MODULE:FACTORY --inputs 8x128:int64,8x128:int64 --budget 60% -o plan.json
    optsched show plan.json
    optsched diff a.json b.json
    optsched timeline plan.json -o timeline.png

`plan` builds the model and its inputs as fake tensors (`optsched.offline.plan_offline`), so
it plans for a device this machine does not have without allocating the model. The other
commands only read plan files (`optsched.load_plan`); an unreadable, corrupted or edited file
is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import re
import sys
import typing

from .budget import parse_budget
from .costs import PROFILES
from .executors import NAMES as EXECUTORS
from .plan_file import PlanFileError, load_plan

MIB = 2**20

# --inputs dtypes: name -> torch attribute
DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "f32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "double": "float64", "fp64": "float64", "f64": "float64",
    "int64": "int64", "long": "int64", "i64": "int64",
    "int32": "int32", "int": "int32", "i32": "int32",
    "int16": "int16", "short": "int16",
    "int8": "int8", "uint8": "uint8",
    "bool": "bool",
}


class CliError(Exception):
    """A failure to report as one line on stderr; `code` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- argument types


def input_specs(text: str) -> list[tuple[tuple[int, ...], str]]:
    """'8x128:int64,8x128:int64' -> [((8, 128), 'int64'), ((8, 128), 'int64')]."""
    specs = []
    items = text.split(",")
    for i, raw in enumerate(items, 1):
        item = raw.strip()
        where = f"input {i} of {len(items)} ({item!r})" if len(items) > 1 else repr(item)
        if not item:
            raise argparse.ArgumentTypeError(f"input {i} of {len(items)} is empty; expected e.g. 8x128:int64")
        shape_text, _, dtype = item.partition(":")
        dtype = dtype.strip().lower() or "float32"
        dtype = dtype.removeprefix("torch.")
        if dtype not in DTYPES:
            raise argparse.ArgumentTypeError(
                f"{where}: unknown dtype {dtype!r}; known: {', '.join(sorted(set(DTYPES.values())))}"
            )
        shape_text = shape_text.strip().lower()
        if shape_text in ("", "scalar", "()"):
            shape: tuple[int, ...] = ()
        else:
            dims = shape_text.split("x")
            if not all(re.fullmatch(r"[0-9]+", d.strip()) and int(d) > 0 for d in dims):
                raise argparse.ArgumentTypeError(
                    f"{where}: shape {shape_text!r} must be positive integers separated by 'x', e.g. 8x128"
                )
            shape = tuple(int(d) for d in dims)
        specs.append((shape, DTYPES[dtype]))
    return specs


BUDGET_FORMS = ("a percentage of the unplanned peak (60%), a size (12GB, 512MiB, 1.5GiB), "
                "a number of bytes (2000000000), or none")


def budget_arg(text: str):
    if text.strip().lower() in ("none", ""):
        return parse_budget(None)
    try:
        return parse_budget(text, name="--budget")
    except ValueError as e:
        what = str(e).split("; use ")[0]
        raise argparse.ArgumentTypeError(f"{what}; use {BUDGET_FORMS}") from None


def factory_target(text: str) -> str:
    module, sep, attr = text.partition(":")
    ident = r"[A-Za-z_][A-Za-z0-9_]*"
    if not sep or not re.fullmatch(rf"{ident}(\.{ident})*", module) or not re.fullmatch(rf"{ident}(\.{ident})*", attr):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not MODULE:FACTORY, an importable module and a callable in it "
            "(e.g. benchmarks.models.gpt:build)"
        )
    return text


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds (e.g. 10 or 2.5)")
    return value


def positive_int(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text.strip()) or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"n_layer\": 2}}', got {text!r}")
    return value


# ----------------------------------------------------------------------------- formatting


def fmt_mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.2f} MiB"


def fmt_time(s) -> str:
    if s is None:
        return "-"
    a = abs(s)
    if a >= 1:
        return f"{s:.3f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_pct(x) -> str:
    return "-" if x is None else f"{x:.2%}"


def fmt_size(b) -> str:
    """MiB below a GiB, GiB above (host memory sizes)."""
    if b is None:
        return "-"
    return f"{b / 2**30:.2f} GiB" if abs(b) >= 2**30 else fmt_mib(b)


def fmt_budget(made_for: dict) -> str:
    nbytes, spec = made_for.get("budget_bytes"), made_for.get("budget")
    if nbytes is None:
        return "none (the fastest plan)"
    spec = str(spec)
    if spec.endswith("%"):
        return f"{fmt_mib(nbytes)} ({spec} of the unplanned peak)"
    return f"{fmt_mib(nbytes)} (given as {spec})"


def _names(names: list[str], limit: int = 8) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _console():
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 120  # files and pipes: do not squeeze tables into 80 columns
    return console


# ----------------------------------------------------------------------------- show


def show_rows(data: dict) -> list[tuple[str, str]]:
    """The `show` table as (field, value) rows."""
    s, mf, solver, dec = data["summary"], data["made_for"], data["solver"], data["decisions"]
    budget = s.get("budget_bytes")
    peak, unplanned = s["predicted_peak_bytes"], s["unplanned_peak_bytes"]
    kind = s.get("kind", data.get("kind"))
    rows = [
        ("kind", f"{kind} ({'forward + backward' if kind == 'training' else 'forward only'})"),
        ("graph", (f"{s['graph_nodes']} fx nodes, {s['n_ops']} ops ({s['n_forward_ops']} forward, "
                   f"{s['n_backward_ops']} backward); fingerprint {data['fingerprint'].get('hash', '')[:12] or '-'}")),
        ("budget", fmt_budget(mf)),
    ]
    vs = []
    if budget:
        vs.append(f"{peak / budget:.1%} of the budget")
    if unplanned:
        vs.append(f"{peak / unplanned:.1%} of the unplanned peak")
    rows += [
        ("predicted peak", fmt_mib(peak) + (f" ({', '.join(vs)})" if vs else "")),
        ("unplanned peak", fmt_mib(unplanned)),
        ("lower bound", f"{fmt_mib(s.get('lower_bound_bytes'))} (no plan goes below)"),
        ("estimated time", (f"{fmt_time(s['estimated_time_s'])} vs {fmt_time(s['unplanned_time_s'])} unplanned: "
                            f"x{s['time_ratio']:.3f}")),
        ("saved", f"{s['n_saved']} tensors, {fmt_mib(s['saved_bytes'])}"),
        ("recomputed", f"{s['n_recomputed']} ops, {fmt_time(s['recompute_s'])}"
                       + (f": {_names(dec.get('recomputed', []))}" if s["n_recomputed"] else "")),
    ]
    off = f"{s['n_offloaded']} tensors, {fmt_mib(s['offloaded_bytes'])}"
    if s["n_offloaded"]:
        off += f" ({_names(dec.get('offloaded', []), 6)})"
        if s.get("host_bytes") not in (None, s["offloaded_bytes"]):
            off += f"; host memory {fmt_mib(s['host_bytes'])}"
        off += f"; copies busy {fmt_time(s['transfer_s'])}, compute waits {fmt_time(s['exposed_transfer_s'])}"
    rows.append(("offloaded", off))
    offload_setting = {True: "allowed", False: "off"}.get(mf.get("offload"), str(mf.get("offload")))
    if mf.get("offload") and s.get("host_budget_bytes") is not None:
        offload_setting += f", host budget {fmt_size(s['host_budget_bytes'])}"
    rows += [
        ("offload setting", offload_setting),
        ("fused", f"{s['n_fusion_groups']} groups, {s['n_fused_ops']} ops"),
        ("executor", str(s["executor"])),
        ("device profile", str(s["device_profile"])
         + (f" ({mf['profile'].get('device_type')})" if isinstance(mf.get("profile"), dict) else "")),
        ("timing", {"measured": "measured (op times measured on the planning device)",
                    "roofline": "roofline (the profile's cost model)"}.get(s["timing"], str(s["timing"]))),
        ("solver status", str(s["solver_status"])),
        ("gap", fmt_pct(s["gap"])),
        ("objective / bound", f"{fmt_time(s['objective_s'])} / {fmt_time(s['bound_s'])}"),
        ("solve time", f"{s['solve_time_s']:.2f} s"),
        ("method", str(s["method"])),
    ]
    notes = solver.get("notes") or []
    if notes:
        rows.append(("solver notes", "; ".join(str(n) for n in notes)))
    rows += [
        ("created", str(data.get("created", "-"))),
        ("versions", (f"optsched {data['optsched_version']}, torch {data['torch_version']}, "
                      f"plan schema {data['schema_version']}")),
    ]
    return rows


def print_show(data: dict, path) -> None:
    from rich.table import Table

    table = Table(title=f"optsched plan: {path}", show_header=False, title_justify="left")
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for k, v in show_rows(data):
        table.add_row(k, v)
    _console().print(table)


def cmd_show(args, parser) -> int:
    pf = load_plan(args.plan)
    print_show(pf.data, args.plan)
    return 0


# ----------------------------------------------------------------------------- diff

MADE_FOR_FIELDS = ("kind", "budget", "budget_bytes", "device_profile", "executor", "offload", "host_budget_bytes",
                   "timing")


def _order(data: dict) -> tuple[list[str], list[str]]:
    dec = data["decisions"]
    ops = dec["ops"]

    def name(i) -> str:
        return ops[i] if isinstance(i, int) and 0 <= i < len(ops) else str(i)

    return [name(i) for i in dec["fw_order"]], [name(i) for i in dec["bw_order"]]


def _ordered_difference(a: list[str], b: list[str]) -> list[str]:
    bs = set(b)
    seen: set[str] = set()
    out = []
    for x in a:
        if x not in bs and x not in seen:
            seen.add(x)
            out.append(x)
    return out


def diff_report(a: dict, b: dict) -> dict:
    """What differs between two plan files, as plain data (the `diff` command prints it)."""
    from .plan_file import _node_difference

    mfa, mfb = a["made_for"], b["made_for"]
    made_for = [(k, mfa.get(k), mfb.get(k)) for k in MADE_FOR_FIELDS]
    pa, pb = mfa.get("profile"), mfb.get("profile")
    if isinstance(pa, dict) and isinstance(pb, dict) and pa != pb and mfa.get("device_profile") == mfb.get("device_profile"):
        for k in sorted(set(pa) | set(pb)):
            if pa.get(k) != pb.get(k):
                made_for.append((f"profile.{k}", pa.get(k), pb.get(k)))

    fa, fb = a["fingerprint"], b["fingerprint"]
    same_graph = fa.get("hash") == fb.get("hash")
    graph = "same graph (fingerprint " + fa.get("hash", "")[:12] + ")" if same_graph else (
        "different graphs: " + _node_difference(fa.get("nodes", []), fb.get("nodes", []))
        .replace("the plan has", "A has").replace("the graph now has", "B has")
    )

    da, db = a["decisions"], b["decisions"]
    ga = [tuple(g) for g in da.get("fusion_groups", [])]
    gb = [tuple(g) for g in db.get("fusion_groups", [])]
    fwa, bwa = _order(a)
    fwb, bwb = _order(b)

    def positions(x: list[str], y: list[str]) -> int:
        return sum(1 for i in range(max(len(x), len(y))) if i >= len(x) or i >= len(y) or x[i] != y[i])

    # The backward order holds the backward ops and the recomputations (forward ops run again);
    # compare the backward ops' order on its own, and count the recomputation steps apart.
    fw_a, fw_b = set(fwa), set(fwb)
    bw_only_a = [o for o in bwa if o not in fw_a]
    bw_only_b = [o for o in bwb if o not in fw_b]
    order = {
        "same_ops": sorted(da["ops"]) == sorted(db["ops"]),
        "forward_positions": positions(fwa, fwb),
        "forward_steps": (len(fwa), len(fwb)),
        "backward_positions": positions(bw_only_a, bw_only_b),
        "backward_steps": (len(bw_only_a), len(bw_only_b)),
        "recompute_steps": (len(bwa) - len(bw_only_a), len(bwb) - len(bw_only_b)),
        "same_program": fwa == fwb and bwa == bwb,
    }
    return {
        "made_for": made_for,
        "same_graph": same_graph,
        "graph": graph,
        "recomputed": (_ordered_difference(da.get("recomputed", []), db.get("recomputed", [])),
                       _ordered_difference(db.get("recomputed", []), da.get("recomputed", []))),
        "offloaded": (_ordered_difference(da.get("offloaded", []), db.get("offloaded", [])),
                      _ordered_difference(db.get("offloaded", []), da.get("offloaded", []))),
        "fusion_groups": ([g for g in ga if g not in set(gb)], [g for g in gb if g not in set(ga)]),
        "order": order,
    }


# (label, summary key, formatter, delta formatter or None)
_FIGURES = [
    ("predicted peak", "predicted_peak_bytes", fmt_mib, lambda d: f"{d / MIB:+.2f} MiB"),
    ("unplanned peak", "unplanned_peak_bytes", fmt_mib, lambda d: f"{d / MIB:+.2f} MiB"),
    ("budget", "budget_bytes", fmt_mib, lambda d: f"{d / MIB:+.2f} MiB"),
    ("estimated time", "estimated_time_s", fmt_time, lambda d: ("+" if d >= 0 else "") + fmt_time(d)),
    ("time vs unplanned", "time_ratio", lambda x: f"x{x:.3f}", lambda d: f"{d:+.3f}"),
    ("saved", "n_saved", str, lambda d: f"{d:+d}"),
    ("saved bytes", "saved_bytes", fmt_mib, lambda d: f"{d / MIB:+.2f} MiB"),
    ("recomputed ops", "n_recomputed", str, lambda d: f"{d:+d}"),
    ("recompute time", "recompute_s", fmt_time, lambda d: ("+" if d >= 0 else "") + fmt_time(d)),
    ("offloaded", "n_offloaded", str, lambda d: f"{d:+d}"),
    ("offloaded bytes", "offloaded_bytes", fmt_mib, lambda d: f"{d / MIB:+.2f} MiB"),
    ("exposed copies", "exposed_transfer_s", fmt_time, lambda d: ("+" if d >= 0 else "") + fmt_time(d)),
    ("fusion groups", "n_fusion_groups", str, lambda d: f"{d:+d}"),
    ("fused ops", "n_fused_ops", str, lambda d: f"{d:+d}"),
    ("solver status", "solver_status", str, None),
    ("gap", "gap", fmt_pct, lambda d: f"{d * 100:+.2f} pt"),
    ("solve time", "solve_time_s", lambda x: f"{x:.2f} s", lambda d: f"{d:+.2f} s"),
    ("method", "method", str, None),
]


def _show_value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v.is_integer() and abs(v) > 1e3:
        return str(int(v))
    return str(v)


def print_diff(a: dict, b: dict, path_a, path_b) -> None:
    from rich.table import Table

    console = _console()
    report = diff_report(a, b)
    console.print(f"A: {path_a}\nB: {path_b}")

    t = Table(title="made for", title_justify="left")
    t.add_column("field", style="bold", no_wrap=True)
    t.add_column("A", overflow="fold")
    t.add_column("B", overflow="fold")
    t.add_column("", no_wrap=True)
    for k, va, vb in report["made_for"]:
        if k == "host_budget_bytes":
            fa, fb = fmt_size(va), fmt_size(vb)
        elif k.endswith("_bytes"):
            fa, fb = fmt_mib(va), fmt_mib(vb)
        else:
            fa, fb = _show_value(va), _show_value(vb)
        t.add_row(k, fa, fb, "same" if va == vb else "differs")
    console.print(t)
    console.print(f"graph: {report['graph']}")

    sa, sb = a["summary"], b["summary"]
    t = Table(title="figures", title_justify="left")
    t.add_column("figure", style="bold", no_wrap=True)
    t.add_column("A", overflow="fold")
    t.add_column("B", overflow="fold")
    t.add_column("B - A", no_wrap=True)
    for label, key, fmt, dfmt in _FIGURES:
        va, vb = sa.get(key), sb.get(key)
        fa = "-" if va is None else fmt(va)
        fb = "-" if vb is None else fmt(vb)
        if va == vb or fa == fb:
            delta = "same"
        elif dfmt is not None and isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            delta = dfmt(vb - va)
        else:
            delta = "differs"
        t.add_row(label, fa, fb, delta)
    console.print(t)

    lines = []
    for what, (only_a, only_b) in (("recomputed", report["recomputed"]), ("offloaded", report["offloaded"])):
        if not only_a and not only_b:
            lines.append(f"{what}: the same in both")
            continue
        if only_a:
            lines.append(f"{what} only in A ({len(only_a)}): {_names(only_a, 12)}")
        if only_b:
            lines.append(f"{what} only in B ({len(only_b)}): {_names(only_b, 12)}")
    removed, added = report["fusion_groups"]
    if not removed and not added:
        lines.append("fusion groups: the same in both")
    else:
        for label, groups in (("only in A (removed in B)", removed), ("only in B (added)", added)):
            if groups:
                lines.append(f"fusion groups {label}: {len(groups)}: "
                             + "; ".join("[" + ", ".join(g) + "]" for g in groups[:6])
                             + (f"; ... ({len(groups) - 6} more)" if len(groups) > 6 else ""))
    o = report["order"]
    parts = []
    for phase, what in (("forward", "forward order"), ("backward", "backward order (recomputations left out)")):
        n = o[f"{phase}_positions"]
        la, lb = o[f"{phase}_steps"]
        if n == 0:
            parts.append(f"{what}: the same ({la} ops)")
        else:
            steps = f"{la} ops" if la == lb else f"{la} vs {lb} ops"
            parts.append(f"{what}: {n} of {max(la, lb)} positions differ ({steps})")
    ra, rb = o["recompute_steps"]
    parts.append(f"recompute steps in the backward: {ra} vs {rb}")
    head = "op order: the same program" if o["same_program"] else "op order"
    lines.append(head + ("" if o["same_ops"] else " (the plans schedule different ops: other fusion groups)"))
    lines += ["  " + p for p in parts]
    console.print("decisions:")
    for line in lines:
        console.print("  " + line, soft_wrap=True)


def cmd_diff(args, parser) -> int:
    a = load_plan(args.a)
    b = load_plan(args.b)
    print_diff(a.data, b.data, args.a, args.b)
    return 0


# ----------------------------------------------------------------------------- timeline


def cmd_timeline(args, parser) -> int:
    pf = load_plan(args.plan)
    try:
        from .timeline import plot_timeline
    except ImportError as e:
        raise CliError(f"the timeline needs matplotlib ({e}): pip install matplotlib") from None
    out = plot_timeline(pf.data, args.output, dpi=args.dpi)
    print(f"wrote {out} (predicted memory of {args.plan} over the step)")
    return 0


# ----------------------------------------------------------------------------- plan


def _dataclass_in(annotation):
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return annotation
    for arg in typing.get_args(annotation):
        found = _dataclass_in(arg)
        if found is not None:
            return found
    return None


def bind_kwargs(factory, kwargs: dict) -> dict:
    """JSON kwargs for `factory`: an object given for a parameter annotated with a dataclass
    (e.g. `cfg: GPTConfig | None`) becomes that dataclass."""
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - unresolvable annotations: pass values as given
        hints = {}
    out = {}
    for key, value in kwargs.items():
        cls = _dataclass_in(hints.get(key)) if isinstance(value, dict) else None
        if cls is not None:
            try:
                value = cls(**value)
            except TypeError as e:
                raise CliError(f"--kwargs: {key}={json.dumps(value)} does not make a {cls.__name__}: {e}", 2) from None
        out[key] = value
    return out


def load_factory(target: str):
    """'package.module:factory' (or 'module:Class', 'module:obj.attr') -> the callable."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{target!r} is not MODULE:FACTORY (e.g. benchmarks.models.gpt:build)", 2)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does: modules of the current directory import
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise CliError(f"cannot import module {module_name!r} (from {target!r}): {e}; "
                           "run from the folder that contains it or set PYTHONPATH", 2) from None
        raise
    try:
        obj = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        callables = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise CliError(f"module {module_name!r} has no attribute {attr!r}"
                       + (f"; callables defined there: {', '.join(callables)}" if callables else ""), 2) from None
    if not callable(obj):
        raise CliError(f"{target!r} is a {type(obj).__name__}, not a callable that returns a module", 2)
    return obj


def _module_of(result):
    """A factory may return the module, or (module, example_inputs) as tests.models' builders do."""
    import torch

    if isinstance(result, tuple) and result and isinstance(result[0], torch.nn.Module):
        return result[0]
    return result


def make_inputs(specs) -> tuple:
    """Tensors of the given shapes: floats ~N(0, 1), integers in [0, 2) (valid token ids), bools False."""
    import torch

    out = []
    for shape, dtype_name in specs:
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            out.append(torch.randn(shape, dtype=dtype))
        elif dtype == torch.bool:
            out.append(torch.zeros(shape, dtype=dtype))
        else:
            out.append(torch.randint(0, 2, shape, dtype=dtype))
    return tuple(out)


def cmd_plan(args, parser) -> int:
    from .offline import plan_offline
    from .solvers import BudgetInfeasibleError

    factory = load_factory(args.target)
    kwargs = bind_kwargs(factory, args.kwargs or {})
    specs = args.inputs

    def model_factory():
        return _module_of(factory(**kwargs))

    def inputs_factory():
        return make_inputs(specs)

    shapes = ", ".join(f"{'x'.join(map(str, s)) or 'scalar'}:{d}" for s, d in specs)
    offload = PROFILES[args.profile].device_type == "cuda" if args.offload is None else args.offload
    print(f"planning {args.target}({', '.join(f'{k}={v!r}' for k, v in (args.kwargs or {}).items())}) on {shapes}; "
          f"budget {args.budget}, profile {args.profile}, executor {args.executor or 'eager'}, "
          f"offload {'on' if offload else 'off'}{' (default for this profile)' if args.offload is None else ''}",
          file=sys.stderr)
    try:
        plan = plan_offline(
            model_factory, inputs_factory, args.budget.spec,
            device_profile=args.profile, executor=args.executor, offload=args.offload,
            time_limit_s=args.time_limit, progress=args.progress,
        )
    except BudgetInfeasibleError as e:
        raise CliError(f"{e} (try a larger --budget{'' if offload else ', or --offload'})", 1) from None
    except Exception as e:  # the model, its factory or its inputs: one line unless asked
        if args.traceback:
            raise
        raise CliError(f"planning failed: {type(e).__name__}: {e} (--traceback shows where)", 1) from None
    out = plan.save(args.output)
    print(f"wrote {out}", file=sys.stderr)
    print_show(load_plan(out).data, out)
    return 0


# ----------------------------------------------------------------------------- parser


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=min(100, max(60, _terminal_width())))


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 100


PLAN_DESCRIPTION = """\
Plan one training step of a model for a device profile, without allocating the model.

The factory is called inside a FakeTensorMode: parameters and inputs are fake tensors
(shape and dtype, no data), so planning a model that would not fit on this machine takes
kilobytes. The forward must return the loss (a scalar); the plan covers the forward and
the backward of the loss. Op times come from the profile's roofline. A progress line shows
the solver's best estimate, bound and gap while it runs; the plan file is written (JSON,
checksummed, replayable with optimize(model, ..., plan=FILE) on the device it was made
for) and its summary is printed as `optsched show` prints it.
"""

PLAN_EPILOG = """\
examples:
  optsched plan benchmarks.models.gpt:build --kwargs '{"cfg": {"n_layer": 2}}' \\
      --inputs 8x128:int64,8x128:int64 --budget 60% -o gpt.json
  optsched plan mypkg.models:make_model --inputs 4x3x224x224,4:int64 --budget 20GiB \\
      --profile a100 --executor inductor --no-offload --time-limit 30

exit status: 0 written; 1 no plan meets the budget (the lowest peak found and a proven
lower bound are printed) or the model failed while being planned; 2 bad arguments
(including a module that does not import or a factory it does not have).
"""

SHOW_DESCRIPTION = """\
Print a plan file's summary as a table: kind and graph size; predicted peak against the
budget and the unplanned peak (MiB and %); estimated step time against the unplanned
program (ratio); what was saved, recomputed, offloaded (bytes) and fused (groups, ops);
executor, device profile and timing source; solver status, gap, objective and bound,
solve time and method; when it was made and by which versions.
"""

DIFF_DESCRIPTION = """\
Compare two plan files: what they were made for (budget, profile, executor, offload, ...),
whether they plan the same graph (if not, the first node that differs), their figures side
by side with B - A (peak, time ratio, counts, status, gap), and their decisions: ops
recomputed in one and not the other, tensors offloaded in one and not the other, fusion
groups added or removed, and how many positions of the op order differ.
"""

TIMELINE_DESCRIPTION = """\
Draw the predicted device memory over one step as a PNG: x = step (forward, then backward;
shaded, with a line at the boundary), y = live MiB. Shows the planned curve, the unplanned
program's curve, the budget, the peak (marked and labelled), the steps that recompute a
forward op (markers on the curve) and, in a band below, each offloaded tensor's time in
host memory (from the step its device copy is dropped to the step it is fetched back).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optsched",
        formatter_class=_Formatter,
        description="Plan a PyTorch training step's memory (order, save/recompute/offload, fusion) "
                    "and read the plan files.",
        epilog="""\
`optsched COMMAND --help` describes each. Errors reading a plan file (missing, not JSON,
checksum mismatch) print one line and exit with status 2.

examples:
  optsched plan benchmarks.models.gpt:build --kwargs '{"cfg": {"n_layer": 2}}' \\
      --inputs 8x128:int64,8x128:int64 --budget 60% -o plan.json
  optsched show plan.json
  optsched diff plan_70.json plan_50.json
  optsched timeline plan.json -o timeline.png
""",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, title="commands")

    p = sub.add_parser("plan", help="plan a model offline (fake tensors, a device profile's roofline); write a plan file", description=PLAN_DESCRIPTION,
                       epilog=PLAN_EPILOG, formatter_class=_Formatter)
    p.add_argument("target", metavar="MODULE:FACTORY", type=factory_target,
                   help="an importable module and a callable in it that builds the nn.Module "
                        "(a function, a class, or obj.attr), e.g. benchmarks.models.gpt:build; "
                        "the current directory is importable. A factory returning (module, inputs) "
                        "is accepted; its inputs are ignored")
    p.add_argument("--inputs", required=True, type=input_specs, metavar="SPEC",
                   help="the forward's positional tensors, comma-separated SHAPE[:DTYPE]: dims "
                        "separated by 'x' ('scalar' for 0-d), dtype float32 (default), float16, "
                        "bfloat16, float64, int64, int32, int16, int8, uint8, bool. Floats are "
                        "N(0, 1), integers in [0, 2) (valid token ids). E.g. 8x128:int64,8x128:int64")
    p.add_argument("--kwargs", type=json_object, metavar="JSON", default=None,
                   help="keyword arguments for the factory, as a JSON object; an object given for a "
                        "parameter annotated with a dataclass becomes that dataclass, e.g. "
                        "'{\"cfg\": {\"n_layer\": 2, \"n_embd\": 512}}' for gpt:build(cfg: GPTConfig)")
    p.add_argument("--budget", type=budget_arg, default=budget_arg("none"), metavar="BUDGET",
                   help="peak device bytes of the step (parameters, inputs, activations, gradients, "
                        "temporaries): a percentage of the unplanned peak (60%%), a size "
                        "(12GB = 12*10^9 bytes, 512MiB = 512*2^20 bytes, '1.5 GiB'), a number of "
                        "bytes, or none (the fastest plan; default)")
    p.add_argument("--profile", default="h100", choices=sorted(PROFILES), metavar="PROFILE",
                   help=f"device the plan is for, whose roofline times the ops: {', '.join(sorted(PROFILES))} "
                        "(default: h100)")
    p.add_argument("--executor", default=None, choices=EXECUTORS, metavar="EXECUTOR",
                   help="whose fusion rules form fusion groups (planned only, nothing is compiled): "
                        "eager (no fusion; default), inductor, nvfuser (CUDA profiles)")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="let saved activations wait in host memory between forward and backward where "
                        "that costs less time than recomputing them (default: on for GPU profiles, off for cpu)")
    p.add_argument("--time-limit", type=seconds, default=None, metavar="S", dest="time_limit",
                   help="solver time limit in seconds (default: the larger of 5 s and 0.02 s per op), e.g. 30")
    p.add_argument("-o", "--output", default="plan.json", metavar="FILE",
                   help="plan file to write (JSON, written atomically; default: plan.json)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show the live solver line (elapsed, best estimate, bound, gap) on stderr (default: on)")
    p.add_argument("--traceback", action="store_true",
                   help="when the model fails while being planned, show the full Python traceback "
                        "instead of one line")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("show", help="a plan file's summary: peak vs budget and unplanned, time, decisions, solver status", description=SHOW_DESCRIPTION,
                       epilog="example:\n  optsched show plan.json\n\nexit status: 0 shown; 2 the file is "
                              "missing, not JSON, or fails its checksum.",
                       formatter_class=_Formatter)
    p.add_argument("plan", metavar="PLAN.json", help="a plan file (from `optsched plan`, Plan.save or optimize(plan=...))")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("diff", help="what differs between two plan files: settings, graph, figures, decisions", description=DIFF_DESCRIPTION,
                       epilog="example:\n  optsched diff plan_70.json plan_50.json\n\nexit status: 0 compared "
                              "(whether or not they differ); 2 a file is missing, not JSON, or fails its checksum.",
                       formatter_class=_Formatter)
    p.add_argument("a", metavar="A.json", help="the first plan file (column A)")
    p.add_argument("b", metavar="B.json", help="the second plan file (column B; deltas are B - A)")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("timeline", help="a PNG of the predicted device memory over the step",
                       description=TIMELINE_DESCRIPTION,
                       epilog="example:\n  optsched timeline plan.json -o timeline.png\n\nexit status: 0 written; "
                              "2 the file is missing, not JSON, or fails its checksum.",
                       formatter_class=_Formatter)
    p.add_argument("plan", metavar="PLAN.json", help="a plan file")
    p.add_argument("-o", "--output", default="timeline.png", metavar="FILE.png",
                   help="image to write (PNG; default: timeline.png)")
    p.add_argument("--dpi", type=positive_int, default=120, metavar="N",
                   help="resolution in dots per inch (default: 120, about 1700x1000 pixels)")
    p.set_defaults(func=cmd_timeline)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"optsched {args.command}"
    try:
        return args.func(args, parser) or 0
    except PlanFileError as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except CliError as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
