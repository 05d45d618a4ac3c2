"""Execute the notebooks with nbclient, keeping their outputs and plots in the files.

    python notebooks/execute.py                      # every notebook, full size, written in place (`make notebooks`)
    python notebooks/execute.py 2_gpt.ipynb          # one of them
    python notebooks/execute.py --size small --out /tmp/nb   # small cases, copies written elsewhere (the tests)

The size reaches each notebook as the environment variable OPTSCHED_NOTEBOOK_SIZE, read in its first
cell. A cell that fails (an assertion against the benchmarks' JSON included) stops the run with the
notebook's error, and nothing is written for that notebook.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = ("small", "full")


def notebooks() -> list[Path]:
    return sorted(HERE.glob("[0-9]_*.ipynb"))


def execute(path: Path, size: str = "full", out: Path | None = None, timeout_s: int = 1800) -> Path:
    """Run `path` top to bottom in a fresh kernel (this interpreter's), in notebooks/, at `size`; write
    the executed notebook to `out` (default: in place). Returns where it was written."""
    import nbformat
    from nbclient import NotebookClient

    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    nb = nbformat.read(path, as_version=4)
    old = os.environ.get("OPTSCHED_NOTEBOOK_SIZE")
    os.environ["OPTSCHED_NOTEBOOK_SIZE"] = size  # the kernel inherits this process's environment
    try:
        client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(HERE)}})
        client.execute()
    finally:
        if old is None:
            os.environ.pop("OPTSCHED_NOTEBOOK_SIZE", None)
        else:
            os.environ["OPTSCHED_NOTEBOOK_SIZE"] = old
    dest = out if out is not None else path
    nbformat.write(nb, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="notebook file names (default: all)")
    ap.add_argument("--size", choices=SIZES, default="full")
    ap.add_argument("--out", type=Path, default=None, help="write executed copies to this folder instead of in place")
    args = ap.parse_args(argv)
    paths = [HERE / n for n in args.names] if args.names else notebooks()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    for p in paths:
        t0 = time.perf_counter()
        dest = execute(p, args.size, args.out / p.name if args.out is not None else None)
        print(f"{p.name}: executed at size {args.size} in {time.perf_counter() - t0:.0f} s -> {dest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
