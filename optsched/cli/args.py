"""Argument types of the `optsched` command: each turns one command-line string into a value,
or raises `argparse.ArgumentTypeError` naming the bad part (argparse prints it with the usage
and exits with status 2). Also `CliError`, a failure `main` prints as one line.

Torch-free: `--help` and the plan-file commands parse their arguments without importing torch.
"""

from __future__ import annotations

import argparse
import json
import re

from ..budget import parse_budget

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
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text.strip()!r}: a budget must be positive; use {BUDGET_FORMS}")
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


DPI_RANGE = (10, 600)  # 600 dpi: about 8400x4200 pixels, 140 MB to render; beyond, the renderer runs out of memory


def dpi(text: str) -> int:
    """--dpi: a whole number in DPI_RANGE."""
    low, high = DPI_RANGE
    if not re.fullmatch(r"[0-9]+", text.strip()) or not low <= int(text) <= high:
        raise argparse.ArgumentTypeError(f"{text!r} is not a resolution from {low} to {high} dots per inch (e.g. 120)")
    return int(text)


# options whose values may begin with '-' ("--budget -5%", "--inputs -4x32:int64"): read as values (see values_first)
VALUE_OPTIONS = ("--budget", "--inputs")


def values_first(argv: list[str]) -> list[str]:
    """`--budget -5%` as `--budget=-5%`, `--inputs -4x32` as `--inputs=-4x32`: argparse takes a value that begins
    with '-' and is not a plain negative number for an option and says "expected one argument"; joined, the
    value reaches its type, which says what is wrong with it (a budget, a dimension is positive). Only a value
    that looks like a negative number is joined (`--budget --profile cpu` still lacks its value), and nothing
    after `--`. Abbreviations (`--bud`, `--in`) too."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        is_value_option = arg.startswith("--") and len(arg) > 2 and any(o.startswith(arg) for o in VALUE_OPTIONS)
        if is_value_option and i + 1 < len(argv) and re.match(r"-\s*[0-9.]", argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"n_layer\": 2}}', got {text!r}")
    return value

