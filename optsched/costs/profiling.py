"""Run a captured graph once on the device: per-op time, kernel scratch space, and in-place out= forms.

Planning a CPU step with spec-sheet numbers misjudges what recomputation costs
(attention and layer norm are far from the roofline there), and kernels allocate
scratch memory no graph shows (a convolution's workspace, a dropout backward's
temporaries). Running the graph on random inputs of its shapes costs about as much
as a training step and gives both. Integer inputs are zeros, a valid index for
every op we have seen.
"""

from __future__ import annotations

import time

import torch
import torch.fx as fx
from torch.autograd.profiler import record_function

from .profiles import NodeCosts, random_like
from .measure import memory_profile, walk_events
from ..passes.op_variants import inplace_foreach, out_variant

_OP = "optsched::"
_OUT = "optsched_out::"


def profile_nodes(
    gm: fx.GraphModule, device: torch.device, reuse_inputs: dict[str, fx.Node | list[fx.Node]], repeat: int = 2
) -> NodeCosts:
    """Time every node (best of `repeat` runs after a warm-up) and, in one more run under the
    allocation profiler, measure its scratch space; for each node in `reuse_inputs`, also run
    its out= form into a copy of that input (a foreach op: its in-place twin on a copy of its first
    list) and check it allocates no full-size temporary."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    times: dict[str, float] = {}
    labelled = {"on": False}

    class _Runner(fx.Interpreter):
        def run_node(self, n: fx.Node):
            if labelled["on"]:
                with record_function(_OP + n.name):
                    out = super().run_node(n)
                if n.name in reuse_inputs:
                    self._try_out_form(n)
                return out
            t0 = time.perf_counter()
            out = super().run_node(n)
            dt = time.perf_counter() - t0
            times[n.name] = min(times.get(n.name, dt), dt)
            return out

        def _try_out_form(self, n: fx.Node) -> None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            into = reuse_inputs[n.name]
            if isinstance(into, list):  # a foreach op: its in-place twin on copies of the first list
                dest = [self.env[x].clone() for x in into]
                with record_function(_OUT + n.name):
                    inplace_foreach(n.target)(dest, *args[1:], **kwargs)
            else:
                overload, out_name = out_variant(n.target)
                dest = self.env[into].clone()
                with record_function(_OUT + n.name):
                    overload(*args, **{**kwargs, out_name: dest})
            del dest

    with unset_fake_temporarily(), torch.no_grad():
        args = [random_like(p.meta.get("val"), device) for p in gm.graph.find_nodes(op="placeholder")]
        runner = _Runner(gm)
        for _ in range(repeat + 1):  # the first run warms caches and the allocator
            runner.run(*args)
        # the interpreter keeps a run's outputs in its env until the next run starts: freed inside
        # the profiled run, blocks the profiler never saw allocated (c10 warns "Memory block of
        # unknown size was allocated before the profiling started")
        runner.env.clear()
        if torch.autograd._profiler_enabled():
            # planning inside someone's profiling session (a measured first call): a profiler of our own would
            # end theirs. Scratch space stays unknown (0) and no op writes into its inputs, as with a roofline.
            return NodeCosts(times, {}, {}, scratch_measured=False)
        labelled["on"] = True
        with memory_profile() as prof:
            runner.run(*args)
    workspace, reuse_ok = _scratch(prof, reuse_inputs)
    return NodeCosts(times, workspace, reuse_ok)



def _scratch(prof, reuse_inputs: dict[str, fx.Node | list[fx.Node]]) -> tuple[dict[str, int], dict[str, bool]]:
    workspace: dict[str, int] = {}
    out_peak: dict[str, int] = {}
    for event in walk_events(prof.profiler.kineto_results.experimental_event_tree()):
        name = event.name
        if not (name.startswith(_OP) or name.startswith(_OUT)):
            continue
        allocs = sorted(
            (e.start_time_ns, e.extra_fields.alloc_size)
            for e in walk_events(event.children)
            if type(e.extra_fields).__name__ == "_ExtraFields_Allocation"
        )
        running = peak = 0
        for _, size in allocs:
            running += size
            peak = max(peak, running)
        if name.startswith(_OP):
            workspace[name[len(_OP):]] = max(0, peak - max(running, 0))
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
    return workspace, reuse_ok
