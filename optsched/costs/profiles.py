"""Roofline cost model: how long each op takes on a device profile.

time = max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth) + launch overhead.
The GPU profiles hold public spec-sheet numbers (dense, no sparsity); the CPU
profile is a modest 2-core machine. Planning only needs shapes, so a CPU-only
machine can plan for any of them.

Importing this module does not import torch: the profiles (`PROFILES`, `DeviceProfile`)
are plain data that the `optsched` command reads for its `--profile` choices; the cost
functions import torch when first called.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import fx


@dataclass
class NodeCosts:
    """What running the graph on the device taught us, per node name."""

    times: dict[str, float]  # seconds
    workspace: dict[str, int]  # bytes allocated and freed inside the op, beyond its outputs
    reuse_ok: dict[str, bool]  # its out= form writes into a dying input without a full-size temporary
    scratch_measured: bool = True  # False when another profiler was running (workspace and reuse_ok then empty)
    unmeasured: dict[str, str] = field(default_factory=dict)  # node name -> why it could not run alone (roofline time)
    estimated: list[str] = field(default_factory=list)  # not timed: op timing's time was up (roofline time, no scratch)
    distinct: int = 0  # distinct ops with a measured time (identical ops are timed once)
    reused: int = 0  # of those, the ones an earlier graph of the process timed (costs/op_cache.py): not run again
    # bytes the op's outputs held when it returned, as allocated: more than their values' size where a kernel returns
    # a view of a larger buffer (CPU's mse_loss, smooth_l1_loss: a 0-dim loss on an input-sized storage)
    held_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    device_type: str  # "cuda" or "cpu": where plans made for it can run
    fp32_flops: float  # FLOP/s for float32 matmul-like ops
    half_flops: float  # FLOP/s for bf16/fp16
    mem_bw: float  # bytes/s, device memory
    launch_s: float  # per kernel
    host_bw: float  # bytes/s, host <-> device copies
    memory_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in [
        DeviceProfile("cpu", "cpu", 100e9, 50e9, 12e9, 4e-6, 12e9),
        DeviceProfile("a100", "cuda", 19.5e12, 312e12, 2.039e12, 5e-6, 25e9, 80 * 10**9),
        DeviceProfile("h100", "cuda", 67e12, 989e12, 3.35e12, 4e-6, 55e9, 80 * 10**9),
        DeviceProfile("h200", "cuda", 67e12, 989e12, 4.8e12, 4e-6, 55e9, 141 * 10**9),
    ]
}


COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {"a100": (8, 0), "h100": (9, 0), "h200": (9, 0)}
"""The compute capability of the GPU each CUDA profile names: what SDPA's kernel choice
(costs/sdpa_prediction.py) and the cuBLAS workspace size (costs/cuda_allocator.py) depend on. A CUDA
profile missing here is treated as an sm80 part."""


MULTIPROCESSORS: dict[str, int] = {"a100": 108, "h100": 132, "h200": 132}
"""SMs of the GPU each CUDA profile names (the SXM parts): how far PyTorch's reduction kernel splits a reduction
across thread blocks, and so its staging memory (costs/cuda_reduce.py). A profile missing here counts 132."""


def multiprocessors(profile: DeviceProfile) -> int:
    """`MULTIPROCESSORS` of a CUDA profile, 132 for one it does not list."""
    return MULTIPROCESSORS.get(profile.name.lower(), 132)


def compute_capability(profile: DeviceProfile) -> tuple[int, int]:
    """`COMPUTE_CAPABILITY` of a CUDA profile, (8, 0) for one it does not list."""
    return COMPUTE_CAPABILITY.get(profile.name.lower(), (8, 0))


def get_profile(profile: str | DeviceProfile | None, device: torch.device | None = None) -> DeviceProfile:
    """Resolve a profile name (case-insensitive); None picks one for `device`."""
    if isinstance(profile, DeviceProfile):
        return profile
    if profile is None:
        if device is not None and device.type == "cuda":
            import torch

            name = torch.cuda.get_device_name(device).lower()
            profile = next((k for k in ("h200", "h100", "a100") if k in name), "h100")
        else:
            profile = "cpu"
    key = str(profile).lower()
    if key not in PROFILES:
        raise ValueError(f"unknown device profile {profile!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[key]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _val(a):
    from torch import fx

    return a.meta.get("val") if isinstance(a, fx.Node) else a


log = logging.getLogger(__name__)
FLOP_FORMULA_FAILURES: Counter[str] = Counter()
"""Per op overload, how often torch's FLOP formula raised (the op then costs its bytes only)."""
FLOP_FAILURE_NOTE = "op(s) costed with 0 FLOPs: their FLOP formula raised"
"""What a plan's note says of them (`solvers.model.problem.Rejections`: "N op(s) ...: op: error; ...")."""


def node_flops(node: fx.Node, *, quiet: bool = False) -> int:
    """FLOPs from PyTorch's own formula registry (0 for ops it has no formula for). A formula that raises
    counts 0 too: logged once per op, counted in `FLOP_FORMULA_FAILURES` and, while a `Rejections` collector
    is open (the planner's), noted per op there (`FLOP_FAILURE_NOTE`); `quiet`: none of these (a guess that
    no plan uses, such as the order op timing goes in)."""
    from .._torch import tree_map
    from torch.utils.flop_counter import flop_registry

    target = node.target
    packet = getattr(target, "overloadpacket", None)
    fn = flop_registry.get(packet) if packet is not None else None
    if fn is None:
        return 0
    args = tree_map(_val, node.args)
    kwargs = tree_map(_val, node.kwargs)
    try:
        return int(fn(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception as e:  # noqa: BLE001 - a formula that does not accept this overload's arguments: 0 FLOPs, said and counted
        if quiet:
            return 0
        name = str(target)
        if not FLOP_FORMULA_FAILURES[name]:
            log.info("no FLOP count for %s: torch's formula raised %s: %s; counted as 0 FLOPs (its bytes still count)",
                     name, type(e).__name__, e)
        FLOP_FORMULA_FAILURES[name] += 1
        from ..solvers.model.problem import open_rejections

        collecting = open_rejections()  # the planner's, around the planning of a graph: a note on its plan
        if collecting is not None:
            collecting.add_item(FLOP_FAILURE_NOTE, name, e)
        return 0


def node_bytes(node: fx.Node) -> int:
    """Bytes read plus bytes written, at tensor (not storage) granularity."""
    import torch
    from .._torch import tree_leaves, tree_map

    read = sum(_nbytes(v) for v in tree_leaves(tree_map(_val, (node.args, node.kwargs))) if isinstance(v, torch.Tensor))
    written = sum(_nbytes(v) for v in tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor))
    return read + written


def node_time(node: fx.Node, profile: DeviceProfile, *, quiet: bool = False) -> float:
    """Roofline estimate for one unfused op (`quiet`: see `node_flops`)."""
    import torch
    from .._torch import tree_leaves

    out = [v for v in tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    half = bool(out) and out[0].dtype in (torch.float16, torch.bfloat16)
    flops = node_flops(node, quiet=quiet)
    rate = profile.half_flops if half else profile.fp32_flops
    return max(flops / rate, node_bytes(node) / profile.mem_bw) + profile.launch_s


def random_like(v, device: torch.device):
    """A tensor of `v`'s shape and dtype on `device` for timing an op: floats a fixed random pattern
    (`_pattern`, repeated), integers and booleans zeros (a valid index for every op we have seen).
    Filling is a copy: `torch.randn` was most of op timing (the LSTM of issue 34: 9 of 12 samples), and
    the values, the same in every run, take nothing from the caller's random stream."""
    import torch

    if not isinstance(v, torch.Tensor):
        return v
    shape, dtype = tuple(v.shape), v.dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.zeros(shape, dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    flat, tile = out.view(-1), _pattern(dtype).to(device)
    rows = flat.numel() // len(tile)
    flat[: rows * len(tile)].view(rows, len(tile)).copy_(tile.expand(rows, len(tile)))
    flat[rows * len(tile):].copy_(tile[: flat.numel() - rows * len(tile)])
    return out


_PATTERN_LEN = 4099  # prime: rows of any width see shifted copies of the pattern, not one row repeated


@functools.cache
def _pattern(dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values, seeded, on the host (16-64 KiB a dtype; no device memory kept)."""
    import torch

    g = torch.Generator().manual_seed(0)
    real = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
    values = torch.randn(_PATTERN_LEN, generator=g, dtype=real)
    if dtype.is_complex:
        values = torch.complex(values, values.roll(1))
    return values.to(dtype)
