"""What a graph's ops cost when the target measures them: timed on the device (the caller's inputs read in place),
once per graph for one optimized callable (costs.cost_cache), and for a chunked graph only its new nodes."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
import torch.fx as fx

from ..capture.joint_graph import JointGraph
from ..costs.cost_cache import CostCache
from ..costs.problem_builder import reuse_candidates
from ..costs.profiles import NodeCosts
from ..costs.profiling import profile_nodes, real_placeholders
from ..solvers.model import clock
from .timing import OP_TIMING_SHARE, time_limit

CostsOf = Callable[[fx.GraphModule, JointGraph], "NodeCosts | None"]  # a graph's op costs (None: the roofline's)



class MeasuredCosts:
    """Op costs measured on `device`, times within OP_TIMING_SHARE of the planning time limit (`time_limit_s`: the
    option; None, the graph's default). Where the target does not measure times (a named profile: its roofline) but
    the program runs here, the ops' scratch space and out= forms are measured all the same (a layer norm backward's
    per-thread partial sums, an attention backward's buffers: memory a roofline cannot know, and once the plan's peak
    step, the measured peak ran over the prediction); on "meta" (plan_offline's fake tensors) nothing is (None)."""

    def __init__(self, device: torch.device, measure: bool, memory: bool, time_limit_s: float | None,
                 cache: CostCache | None):
        self.device = device
        self.measure = measure  # times
        self.memory = memory  # scratch and out= forms (Target.measures_memory)
        self.time_limit_s = time_limit_s
        self.cache = cache  # measured costs of graphs planned before (shared by one optimized callable's planners)
        self.inputs: list[Callable[[], object]] = []  # the compiled call's inputs, weakly (see hold)

    def hold(self, values: list) -> None:
        """The real values the program's inputs stand for, held weakly (a batch is not kept alive by its plan)."""
        self.inputs = [weakref.ref(v) if isinstance(v, torch.Tensor) else (lambda v=v: v) for v in values]

    def __call__(self, gm: fx.GraphModule, jg: JointGraph) -> NodeCosts | None:
        if not self.memory:
            return None
        key = CostCache.key(gm, self.device) if self.cache is not None else None
        if key is not None and (known := self.cache.get(key)) is not None:
            return known  # the same graph planned again (another use of its outputs): its ops timed once
        real = real_placeholders(gm, [ref() for ref in self.inputs])
        ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        limit = OP_TIMING_SHARE * time_limit(self.time_limit_s, ops)
        with clock.stage("op timing"):
            costs = profile_nodes(gm, self.device, reuse_candidates(jg), real_inputs=real, time_limit_s=limit,
                                  time_ops=self.measure)
        if key is not None and costs.scratch_measured:  # measured under another profiler: measure again next time
            self.cache.put(key, costs)
        return costs


def chunked_costs(costs_of: CostsOf, g: fx.GraphModule, jg: JointGraph, captured: NodeCosts | None) -> NodeCosts | None:
    """Op times of a chunked graph `g`: the captured graph's (`captured`), plus the new nodes' (the chunked op, the
    backward's scaling) timed and measured on their own inputs, when the costs are measured; otherwise `costs_of`'s."""
    if captured is None:
        return None
    if not isinstance(costs_of, MeasuredCosts):
        return costs_of(g, jg)
    known = captured.times.keys() | captured.workspace.keys() | captured.unmeasured.keys()
    new = [n for n in g.graph.nodes if n.op == "call_function" and n.name not in known]
    sub = subgraph(g, new)
    reuse = {k: v for k, v in reuse_candidates(jg).items() if k in {n.name for n in new}}
    by_name = {n.name: n for n in sub.graph.nodes}
    reuse = {k: by_name[v.name] for k, v in reuse.items() if not isinstance(v, list) and v.name in by_name}
    with clock.stage("op timing"):
        measured = profile_nodes(sub, costs_of.device, reuse, repeat=2, time_ops=costs_of.measure)
    return NodeCosts({**captured.times, **measured.times}, {**captured.workspace, **measured.workspace},
                     {**captured.reuse_ok, **measured.reuse_ok}, captured.scratch_measured and measured.scratch_measured,
                     held_bytes={**captured.held_bytes, **measured.held_bytes})


def subgraph(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.GraphModule:
    """`nodes` alone, names kept: what they read from outside as placeholders, every value an output."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inside = set(nodes)

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:
            env[a] = graph.placeholder(a.name)
            env[a].meta = dict(a.meta)
        return env[a]

    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                arg(a)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in nodes))
    return fx.GraphModule(gm, graph)


class ScratchNotMeasuredWarning(UserWarning):
    """A plan made while another profiler ran: kernel scratch space is unknown (counted as 0)."""


def cost_notes(costs: NodeCosts | None) -> list[str]:
    """What a plan's notes say of its op costs: scratch space not measured (warned too: the step can peak above its
    prediction), ops the roofline timed because they could not run alone or op timing ran out of its share."""
    if costs is None:
        return []
    notes = []
    if not costs.scratch_measured:
        note = ("planned while another profiler was running: kernel scratch space was not measured "
                "(counted as 0) and no op but a gradient sum writes into a dying input")
        notes.append(note)
        warnings.warn(f"optsched: {note}, so a step can peak above its prediction by its kernels' scratch space; "
                      "plan outside the profiling session (one step before it) for measured scratch",
                      ScratchNotMeasuredWarning, stacklevel=3)
    if costs.unmeasured:
        first = next(iter(costs.unmeasured.items()))
        notes.append(f"{len(costs.unmeasured)} op(s) could not run alone on made-up inputs and are timed "
                     f"by the roofline, e.g. {first[0]}: {first[1]}")
    if costs.estimated:
        notes.append(f"{len(costs.estimated)} op(s) timed by the roofline: op timing reached its share "
                     f"of the time limit ({OP_TIMING_SHARE:g} of time_limit_s) first")
    return notes
