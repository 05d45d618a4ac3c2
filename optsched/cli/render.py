"""`optsched show` and `optsched diff`: a plan file's summary table, and what differs between two.

Both only read plan files (`load_plan`); rich is imported when a table is printed, torch never.
"""

from __future__ import annotations

import os

from ..plans.file_format import load_plan

MIB = 2**20

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
        if made_for.get("budget_from") == "the first training program":
            return f"{fmt_mib(nbytes)} ({spec} of the first training program's unplanned peak)"
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
    if s.get("updates_in_backward"):  # optimize(..., optimizer=): parameters the optimizer updates in the backward
        rows.append(("updated in backward", f"{len(s['updates_in_backward'])} parameters: {_names(s['updates_in_backward'])}"))
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
        ("objective / bound", f"{fmt_time(s['objective_s'])} / {fmt_time(s['bound_s'])}"
         + (f" (bound over {s['bound_valid_for']})" if s.get("bound_valid_for") else "")),
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
    from ..plans.file_format import node_difference

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
        "different graphs: " + node_difference(fa.get("nodes", []), fb.get("nodes", []))
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
