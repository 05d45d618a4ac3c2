"""`optsched timeline`: a PNG of a plan file's predicted device memory over the step
(`optsched.timeline.plot_timeline`; matplotlib, imported when the command runs)."""

from __future__ import annotations

from .cli_args import CliError
from .plan_file import load_plan


def cmd_timeline(args, parser) -> int:
    pf = load_plan(args.plan)
    try:
        from .timeline import plot_timeline
    except ImportError as e:
        raise CliError(f"the timeline needs matplotlib ({e}): pip install matplotlib") from None
    out = plot_timeline(pf.data, args.output, dpi=args.dpi)
    print(f"wrote {out} (predicted memory of {args.plan} over the step)")
    return 0
