"""The `optsched` command: plan a model offline, and read plan files.

    optsched plan MODULE:FACTORY --inputs 8x128:int64,8x128:int64 --budget 60% -o plan.json
    optsched show plan.json
    optsched diff a.json b.json
    optsched timeline plan.json -o timeline.png

`plan` builds the model and its inputs as fake tensors (`optsched.compiler.offline.plan_offline`), so
it plans for a device this machine does not have without allocating the model. The other
commands only read plan files (`optsched.load_plan`); an unreadable, corrupted or edited file
is one line on stderr and exit code 2.

This module holds the argument parser and `main` (the console script's entry point); each
command lives in a module of its own:

    args      argument types (`--inputs`, `--budget`, ...) and `CliError`
    render    `show` and `diff`: the summary table and the comparison of two plan files
    timeline  `timeline`: the memory-over-the-step PNG (`plot_timeline`)
    plan      `plan`: import the factory, plan offline, write the plan file

Only `plan` imports torch, and only when it runs: `--help`, `show`, `diff` and `timeline`
start in a fraction of a second. Keep it that way (tests/test_cli.py checks it): import
torch, `optsched.api`, `optsched.compiler.offline` and the like inside the functions that need them.
"""

from __future__ import annotations

import argparse
import os
import sys

from .args import (
    BUDGET_FORMS,
    DPI_RANGE,
    DTYPES,
    CliError,
    budget_arg,
    dpi,
    factory_target,
    input_specs,
    json_object,
    positive_int,
    seconds,
    values_first,
)
from .plan import bind_kwargs, cmd_plan, load_factory, make_inputs
from .render import (
    cmd_diff,
    cmd_show,
    diff_report,
    print_diff,
    print_show,
    show_rows,
)
from .timeline import cmd_timeline
from ..costs.profiles import PROFILES
from ..executors import NAMES as EXECUTORS
from ..plans.file_format import PlanFileError

__all__ = [
    "BUDGET_FORMS", "DTYPES", "CliError", "bind_kwargs", "budget_arg", "build_parser", "cmd_diff", "cmd_plan",
    "cmd_show", "cmd_timeline", "diff_report", "factory_target", "input_specs", "json_object", "load_factory",
    "main", "make_inputs", "positive_int", "print_diff", "print_show", "seconds", "show_rows",
]


class _Parser(argparse.ArgumentParser):
    """`--budget -5%` reads -5% as the budget (then refused: budgets are positive), not as an option; so does
    `--inputs -4x32` (refused: dimensions are positive)."""

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(values_first(list(sys.argv[1:] if args is None else args)), namespace)


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
lower bound are printed), the model failed while being planned, or the plan could not be
written after all; 2 bad arguments (including a budget that is not positive, a module that
does not import, or whose own imports fail, a factory it does not have, or an output file
that cannot be written: checked before planning); 130 interrupted (Ctrl-C; nothing is written).
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
    parser = _Parser(
        prog="optsched",
        formatter_class=_Formatter,
        description="Plan a PyTorch training step's memory (order, save/recompute/offload, fusion) "
                    "and read the plan files.",
        epilog="""\
`optsched COMMAND --help` describes each. Errors reading a plan file (missing, not UTF-8
JSON, checksum mismatch) print one line and exit with status 2.

examples:
  optsched plan benchmarks.models.gpt:build --kwargs '{"cfg": {"n_layer": 2}}' \\
      --inputs 8x128:int64,8x128:int64 --budget 60% -o plan.json
  optsched show plan.json
  optsched diff plan_70.json plan_50.json
  optsched timeline plan.json -o timeline.png
""",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, title="commands")

    _add_plan(sub)
    _add_show(sub)
    _add_diff(sub)
    _add_timeline(sub)
    return parser


def _add_plan(sub) -> None:
    """`optsched plan`: the model, its inputs, the budget and the planning options."""
    p = sub.add_parser("plan", help="plan a model offline (fake tensors, a device profile's roofline); write a plan file",
                       description=PLAN_DESCRIPTION,
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
                   help="time limit in seconds for capture and planning together (default: 0.02 s per op, at least 5 s and "
                        "at most 30 s), e.g. 30")
    p.add_argument("-o", "--output", default="plan.json", metavar="FILE",
                   help="plan file to write (JSON, written atomically; default: plan.json)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show the live solver line (elapsed, best estimate, bound, gap) on stderr (default: on)")
    p.add_argument("--traceback", action="store_true",
                   help="when the model's module fails to import or the model fails while being planned, "
                        "show the full Python traceback instead of one line")
    p.set_defaults(func=cmd_plan)


def _add_show(sub) -> None:
    """`optsched show PLAN.json`."""
    p = sub.add_parser("show", help="a plan file's summary: peak vs budget and unplanned, time, decisions, solver status",
                       description=SHOW_DESCRIPTION,
                       epilog="example:\n  optsched show plan.json\n\nexit status: 0 shown; 2 the file is "
                              "missing, not UTF-8 JSON, or fails its checksum.",
                       formatter_class=_Formatter)
    p.add_argument("plan", metavar="PLAN.json", help="a plan file (from `optsched plan`, Plan.save or optimize(plan=...))")
    p.set_defaults(func=cmd_show)


def _add_diff(sub) -> None:
    """`optsched diff A.json B.json`."""
    p = sub.add_parser("diff", help="what differs between two plan files: settings, graph, figures, decisions",
                       description=DIFF_DESCRIPTION,
                       epilog="example:\n  optsched diff plan_70.json plan_50.json\n\nexit status: 0 compared "
                              "(whether or not they differ); 2 a file is missing, not UTF-8 JSON, or fails its checksum.",
                       formatter_class=_Formatter)
    p.add_argument("a", metavar="A.json", help="the first plan file (column A)")
    p.add_argument("b", metavar="B.json", help="the second plan file (column B; deltas are B - A)")
    p.set_defaults(func=cmd_diff)


def _add_timeline(sub) -> None:
    """`optsched timeline PLAN.json -o FILE.png`."""
    p = sub.add_parser("timeline", help="a PNG of the predicted device memory over the step",
                       description=TIMELINE_DESCRIPTION,
                       epilog="example:\n  optsched timeline plan.json -o timeline.png\n\nexit status: 0 written; "
                              "1 the image could not be written after all; 2 bad arguments: the plan file is "
                              "missing, not UTF-8 JSON, or fails its checksum, the output is a folder or cannot "
                              "be written (missing folders are created), or --dpi is out of range.",
                       formatter_class=_Formatter)
    p.add_argument("plan", metavar="PLAN.json", help="a plan file")
    p.add_argument("-o", "--output", default="timeline.png", metavar="FILE.png",
                   help="image to write (PNG; default: timeline.png; missing folders are created)")
    p.add_argument("--dpi", type=dpi, default=120, metavar="N",
                   help=f"resolution in dots per inch, {DPI_RANGE[0]} to {DPI_RANGE[1]} "
                        "(default: 120, about 1700x1000 pixels)")
    p.set_defaults(func=cmd_timeline)


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

