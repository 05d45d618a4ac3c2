"""`optsched timeline`: a plan's predicted device memory over one step, as a PNG (matplotlib, Agg; no
pyplot state; imported when a figure is drawn, so the command line starts without it).

`plot_timeline(load_plan("plan.json").data, "timeline.png")` draws, from the plan file's
`timeline` section (see `Plan.timeline_data`):

- the planned program's live bytes per step (a step curve, MiB), and the unplanned
  program's for comparison (dashed grey, on its own step index: it has no recompute steps);
- the forward and backward phases shaded, with a vertical line at the boundary;
- the budget (a horizontal line) and the peak (marked and labelled);
- steps that recompute a forward op (markers on the planned curve);
- in a band below (only when the plan offloads), one bar per offloaded tensor from the step
  its device copy is dropped to the step its copy back is issued, with thin lines for the
  copy out (from the producing step) and the copy back (to the first reader).

Timelines longer than 4,000 steps are stored as per-chunk maxima (`steps_per_point` steps
per point); points are drawn across the steps they cover, so step indices stay the x axis.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..plans.cache import check_writable
from ..plans.file_format import TIMELINE_POINTS, load_plan
from .args import CliError

MIB = 2**20

PLANNED = "#1f5fa8"
UNPLANNED = "#7f7f7f"
BUDGET = "#c0392b"
PEAK = "#c0392b"
RECOMPUTE = "#8e44ad"
OFFLOAD = "#16a085"
FORWARD_BG = "#e3eef9"
BACKWARD_BG = "#fbeee2"


def _edges(n_points: int, per_point: int, n_steps: int) -> list[float]:
    """Step-axis edges of `n_points` values each covering `per_point` steps (the last one the rest)."""
    edges = [float(min(i * per_point, n_steps)) for i in range(n_points)]
    edges.append(float(max(n_steps, edges[-1] + 1 if edges else 1)))
    return edges


def _unplanned_layout(tl: dict, s: dict, n_points: int) -> tuple[int, int, int]:
    """(steps, forward steps, steps per point) of the unplanned curve. The unplanned program is the
    same ops in their captured order with nothing recomputed: `n_ops` steps, `n_forward_ops` of them
    forward; downsampled by the planned curve's rule (chunks of ceil(steps / 4000))."""
    n = int(tl.get("unplanned_n_steps") or s.get("n_ops") or (tl["n_steps"] - len(tl.get("recompute_steps", []))))
    nf = int(tl.get("unplanned_n_forward_steps") or s.get("n_forward_ops") or tl.get("n_forward_steps", n))
    if n_points >= n or n <= TIMELINE_POINTS:
        return max(n, n_points), min(nf, max(n, n_points)), 1
    per = int(tl.get("unplanned_steps_per_point") or math.ceil(n / TIMELINE_POINTS))
    if math.ceil(n / per) != n_points:  # cannot reconstruct: spread the points over the steps
        per = max(1, n // n_points)
    return n, nf, per


def _stretch(nf_u: int, n_u: int, nf: int, n: int):
    """Unplanned step -> planned x: the forward as is (the same ops), the backward scaled so both
    programs' backward phases start and end together (the planned one has recompute steps too)."""
    if n_u <= nf_u or n <= nf or (nf_u == nf and n_u == n):
        return lambda u: float(u)
    scale_f = nf / nf_u if nf_u else 1.0
    scale_b = (n - nf) / (n_u - nf_u)
    return lambda u: u * scale_f if u <= nf_u else nf + (u - nf_u) * scale_b


def _fmt_mib(b) -> str:
    return f"{b / MIB:.2f} MiB"


def plot_timeline(plan_file_data: dict, path: str | os.PathLike, *, dpi: int = 120) -> Path:
    """Write the memory timeline of a plan file's data (`PlanFile.data`) to `path` (PNG). Returns the path."""
    t = _Timeline.read(plan_file_data)
    fig, ax, axo = _figure(len(t.offloads), dpi)
    n_u, nf_u, per_u = _unplanned_layout(t.tl, t.s, len(t.unplanned)) if t.unplanned else (0, 0, 1)
    to_x = _stretch(nf_u, n_u, t.nf, t.n)
    x_max = max(t.n, to_x(n_u) if t.unplanned else 0, 1)
    _draw_phases(ax, axo, t, x_max)
    _draw_curves(ax, t, to_x, n_u, per_u)
    _draw_marks(ax, t, to_x, n_u, per_u, x_max)
    tops = [v for v in (t.peak, t.unplanned_peak, t.budget, max(t.live, default=0)) if v]
    ax.set_xlim(0, x_max)
    ax.set_ylim(0, max(tops, default=MIB) / MIB * 1.14 or 1.0)
    ax.set_ylabel("live device memory (MiB)", fontsize=11)
    ax.grid(axis="y", color="#dddddd", lw=0.8, zorder=0)
    ax.set_axisbelow(True)
    handles, labels = _legend_entries(ax, t)
    _draw_offloads(ax, axo, t)
    _finish(fig, t, handles, labels)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    return path


@dataclass
class _Timeline:
    """A plan file's `timeline` section, with what the figure needs from its summary and made_for."""

    tl: dict
    s: dict
    mf: dict
    live: list[int]
    per: int
    n: int
    nf: int
    rc: list[int]
    offloads: list[dict]
    peak: int | None
    peak_step: int | None
    budget: int | None
    unplanned: list[int]
    unplanned_peak: int | None
    kind: str

    @classmethod
    def read(cls, data: dict) -> _Timeline:
        tl, s, mf = data["timeline"], data.get("summary", {}), data.get("made_for", {})
        live = [int(v) for v in tl.get("live_bytes", [])]
        per = max(1, int(tl.get("steps_per_point", 1)))
        n = int(tl.get("n_steps", len(live) * per))
        unplanned = [int(v) for v in tl.get("unplanned_live_bytes", [])]
        return cls(
            tl, s, mf, live, per, n,
            nf=int(tl.get("n_forward_steps", n)),
            rc=[int(k) for k in tl.get("recompute_steps", [])],
            offloads=sorted(tl.get("offloads", []), key=lambda o: (o["release"], o["prefetch"])),
            peak=tl.get("peak_bytes"),
            peak_step=tl.get("peak_step"),
            budget=tl.get("budget_bytes"),
            unplanned=unplanned,
            unplanned_peak=tl.get("unplanned_peak_bytes") or (max(unplanned) if unplanned else None),
            kind=data.get("kind") or mf.get("kind") or s.get("kind") or "training",
        )


def _figure(lanes: int, dpi: int):
    """The figure, its memory axes, and the offload band's axes below them when anything is offloaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if lanes:
        band = min(3.2, 0.9 + 0.16 * lanes)
        fig = Figure(figsize=(14, 6.2 + band), dpi=dpi)
        gs = fig.add_gridspec(2, 1, height_ratios=[6.2, band], hspace=0.08)
        ax = fig.add_subplot(gs[0])
        axo = fig.add_subplot(gs[1], sharex=ax)
    else:
        fig = Figure(figsize=(14, 7), dpi=dpi)
        ax = fig.add_subplot(1, 1, 1)
        axo = None
    FigureCanvasAgg(fig)
    return fig, ax, axo


def _draw_phases(ax, axo, t: _Timeline, x_max: float) -> None:
    from matplotlib.transforms import blended_transform_factory

    nf, n = t.nf, t.n
    for a in [a for a in (ax, axo) if a is not None]:
        a.axvspan(0, nf, color=FORWARD_BG, zorder=0, lw=0)
        if nf < x_max:
            a.axvspan(nf, x_max, color=BACKWARD_BG, zorder=0, lw=0)
            a.axvline(nf, color="#333333", lw=1.2, ls=(0, (5, 3)), zorder=1)
    top = blended_transform_factory(ax.transData, ax.transAxes)
    ax.text(nf / 2, 0.975, f"forward ({nf} steps)", transform=top, ha="center", va="top", fontsize=11,
            color="#2c4f73", weight="bold")
    if nf < n:
        ax.text((nf + x_max) / 2, 0.975, f"backward ({n - nf} steps)", transform=top, ha="center", va="top",
                fontsize=11, color="#8a4b16", weight="bold")


def _draw_curves(ax, t: _Timeline, to_x, n_u: int, per_u: int) -> None:
    """The unplanned and planned live bytes, and the budget line."""
    live, per, n, budget = t.live, t.per, t.n, t.budget
    if t.unplanned:
        stretched = to_x(n_u) != n_u
        edges_u = [to_x(e) for e in _edges(len(t.unplanned), per_u, n_u)]
        how = f"{n_u} steps, backward stretched to align" if stretched else f"{n_u} steps"
        ax.stairs([v / MIB for v in t.unplanned], edges_u, color=UNPLANNED, lw=1.4, ls=(0, (4, 2)), zorder=2,
                  baseline=None, label=f"unplanned: captured order, all saved ({how})")
    if live:
        edges = _edges(len(live), per, n)
        ax.stairs([v / MIB for v in live], edges, color=PLANNED, lw=2.0, zorder=3, fill=False, baseline=None,
                  label=f"planned ({n} steps)")
        ax.stairs([v / MIB for v in live], edges, color=PLANNED, alpha=0.12, fill=True, zorder=2)
    else:
        ax.text(0.5, 0.5, "this plan file has no timeline", transform=ax.transAxes, ha="center")
    if budget:
        spec = str(t.mf.get("budget", ""))
        ax.axhline(budget / MIB, color=BUDGET, lw=1.5, ls="--", zorder=4,
                   label=f"budget {_fmt_mib(budget)}" + (f" ({spec})" if spec.endswith("%") else ""))


def _draw_marks(ax, t: _Timeline, to_x, n_u: int, per_u: int, x_max: float) -> None:
    """Recompute steps (on the curve, at the step's centre), the predicted peak and the unplanned one."""
    live, per, rc, peak, peak_step, budget = t.live, t.per, t.rc, t.peak, t.peak_step, t.budget
    nf, unplanned, unplanned_peak = t.nf, t.unplanned, t.unplanned_peak
    if rc and live:
        ys = [live[min(k // per, len(live) - 1)] / MIB for k in rc]
        ax.plot([k + 0.5 for k in rc], ys, ls="none", marker="D", ms=5 if len(rc) <= 60 else 3, mfc=RECOMPUTE,
                mec="white", mew=0.6, zorder=6, label=f"recomputed forward op ({len(rc)} steps; ticks on the axis)")
        ax.plot([k + 0.5 for k in rc], [0] * len(rc), ls="none", marker="|", ms=9, color=RECOMPUTE, zorder=6,
                clip_on=False)

    # peak
    if peak is not None and peak_step is not None:
        px, py = peak_step + 0.5, peak / MIB
        ax.plot([px], [py], marker="v", ms=11, color=PEAK, mec="white", zorder=7, ls="none",
                label="predicted peak")
        phase = "forward" if peak_step < nf else "backward"
        pct = f", {peak / budget:.1%} of budget" if budget else ""
        right = px > 0.6 * x_max
        ax.annotate(f"peak {_fmt_mib(peak)}\nstep {peak_step} ({phase}{pct})", xy=(px, py),
                    xytext=(-14 if right else 14, 16), textcoords="offset points", ha="right" if right else "left",
                    va="bottom", fontsize=10, color=PEAK, weight="bold",
                    bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": PEAK, "lw": 0.8, "alpha": 0.9},
                    arrowprops={"arrowstyle": "-", "color": PEAK, "lw": 0.8}, zorder=8)
    if unplanned and unplanned_peak:
        ui = max(range(len(unplanned)), key=unplanned.__getitem__)
        ux = (to_x(min(ui * per_u, n_u)) + to_x(min((ui + 1) * per_u, n_u))) / 2
        ax.plot([ux], [unplanned_peak / MIB], marker="v", ms=8, color=UNPLANNED, mec="white", zorder=5, ls="none")
        ax.annotate(f"unplanned peak {_fmt_mib(unplanned_peak)}", xy=(ux, unplanned_peak / MIB),
                    xytext=(8, 4), textcoords="offset points", fontsize=9, color="#555555", zorder=8)


def _legend_entries(ax, t: _Timeline) -> tuple[list, list]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    s, offloads, lanes = t.s, t.offloads, len(t.offloads)
    handles, labels = ax.get_legend_handles_labels()
    if lanes:
        handles.append(Patch(fc=OFFLOAD, ec=OFFLOAD, alpha=0.55, hatch="///"))
        labels.append(f"offloaded: only in host memory ({lanes} tensors, "
                      f"{_fmt_mib(s.get('offloaded_bytes', sum(o['bytes'] for o in offloads)))})")
        handles.append(Line2D([], [], color=OFFLOAD, lw=1.2))
        labels.append("offload copy out / copy back in flight")
    return handles, labels


def _draw_offloads(ax, axo, t: _Timeline) -> None:
    """One lane per offloaded tensor below the memory axes (the x label goes to the lowest axes)."""
    offloads, lanes, per = t.offloads, len(t.offloads), t.per
    if axo is None:
        ax.set_xlabel(_xlabel(per), fontsize=11)
        return
    for j, o in enumerate(offloads):
        y = lanes - 1 - j
        rel, pre = o["release"], o["prefetch"]
        axo.barh(y, max(pre - rel, 0.5), left=rel, height=0.62, color=OFFLOAD, alpha=0.55, hatch="///",
                 edgecolor=OFFLOAD, lw=0.6, zorder=3)
        prod, first = o.get("produced", rel), o.get("first_read", pre)
        axo.plot([prod + 0.5, rel], [y, y], color=OFFLOAD, lw=1.2, zorder=3)
        axo.plot([pre, first + 0.5], [y, y], color=OFFLOAD, lw=1.2, zorder=3)
    if lanes <= 24:
        axo.set_yticks(range(lanes))
        axo.set_yticklabels([f"{o['tensor']} {o['bytes'] / MIB:.1f} MiB" for o in reversed(offloads)],
                            fontsize=8 if lanes > 10 else 9)
    else:
        axo.set_yticks([])
    axo.set_ylim(-0.6, lanes - 0.4)
    axo.set_ylabel(f"offloaded ({lanes})", fontsize=10)
    axo.grid(axis="x", color="#e5e5e5", lw=0.6)
    axo.set_xlabel(_xlabel(per), fontsize=11)
    for label in ax.get_xticklabels():
        label.set_visible(False)


def _finish(fig, t: _Timeline, handles: list, labels: list) -> None:
    """Title, subtitle, legend above the axes, and the margins they need."""
    s, mf, budget, lanes = t.s, t.mf, t.budget, len(t.offloads)
    height = fig.get_figheight()
    fig.suptitle(_title(t.kind, mf, s, budget), fontsize=13, weight="bold", x=0.01, ha="left", y=1 - 0.12 / height)
    fig.text(0.01, 1 - 0.42 / height, _subtitle(s, t.peak, budget, t.unplanned_peak), fontsize=10, color="#333333",
             ha="left", va="top")
    left = 0.12 if lanes else 0.06
    ncol = 2
    rows = -(-len(handles) // ncol)
    legend_top = 1 - 0.68 / height
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(left, legend_top), ncol=ncol, fontsize=9,
               frameon=False, handlelength=2.4, columnspacing=2.0)
    top = legend_top - (rows * 0.24 + 0.12) / height
    fig.subplots_adjust(left=left, right=0.975, top=top, bottom=0.6 / height)


def _xlabel(per: int) -> str:
    label = "step (one op of the planned program per step; recomputations are steps of their own)"
    if per > 1:
        label += f"; drawn at {per} steps per point (per-chunk maxima)"
    return label


def _title(kind: str, mf: dict, s: dict, budget) -> str:
    profile = mf.get("device_profile") or s.get("device_profile") or "?"
    timing = mf.get("timing") or s.get("timing")
    spec = str(mf.get("budget", ""))
    if budget:
        b = _fmt_mib(budget) + (f" ({spec} of unplanned)" if spec.endswith("%") else "")
    else:
        b = "none (fastest plan)"
    step = "training step (forward + backward)" if kind == "training" else "inference step (forward)"
    return f"Predicted device memory: {step}, {profile} profile{f' ({timing})' if timing else ''}, budget {b}"


def _subtitle(s: dict, peak, budget, unplanned_peak) -> str:
    parts = []
    if peak is not None:
        p = f"peak {_fmt_mib(peak)}"
        if unplanned_peak:
            p += f" vs {_fmt_mib(unplanned_peak)} unplanned ({peak / unplanned_peak:.0%})"
        parts.append(p)
    if "time_ratio" in s:
        parts.append(f"est. time x{s['time_ratio']:.3f} of unplanned")
    if "n_recomputed" in s:
        parts.append(f"{s['n_recomputed']} recomputed")
    if "n_offloaded" in s:
        parts.append(f"{s['n_offloaded']} offloaded ({_fmt_mib(s.get('offloaded_bytes', 0))})")
    if s.get("n_fusion_groups"):
        parts.append(f"{s['n_fusion_groups']} fusion groups ({s.get('n_fused_ops', 0)} ops)")
    if "executor" in s:
        parts.append(f"executor {s['executor']}")
    if "solver_status" in s:
        parts.append(f"{s['solver_status']}, gap {s.get('gap', 0):.2%}")
    return "  ·  ".join(parts)


def cmd_timeline(args, parser) -> int:
    pf = load_plan(args.plan)
    unwritable = check_writable(args.output)  # before drawing: a folder, a file in the way, no permission
    if unwritable is not None:
        raise CliError(f"cannot write the image to {args.output}: {unwritable}", 2)
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise CliError(f"the timeline needs matplotlib ({e}): pip install 'optsched[plot]'") from None
    try:
        out = plot_timeline(pf.data, args.output, dpi=args.dpi)
    except OSError as e:  # writable when checked, not now (disk full, permissions changed)
        raise CliError(f"cannot write the image to {args.output}: {e.strerror or e}", 1) from None
    print(f"wrote {out} (predicted memory of {args.plan} over the step)")
    return 0
