"""An independent validity check of a `Schedule` for a `Problem`, written from the program model (docs/
architecture.md, `Schedule`'s docstring), sharing no code with the simulator that solvers judge plans by.

A schedule runs `fw_order`, then `bw_order`; forward ops inside `bw_order` are recomputations, whose outputs
are read (instead of the forward's copies) by every later backward step; `offload[t] = j` copies activation
`t` to the host when it is made and back before backward position `j`. It is valid when:

- the forward order runs every forward op once and nothing else; the backward order runs every backward op
  once; a forward op in it is recomputable and recomputed at most once;
- topological: every value an op reads exists when it runs: an input (parameters, user inputs), a tangent
  or a caller's value in the backward only, an activation made earlier in the forward, a backward value made
  earlier in the backward, or the recomputed copy of an activation made earlier in the backward;
- every use has a live producer: a backward read of a forward activation uses its recomputed copy when its
  producer was recomputed before, else the forward copy, which the forward made (and which must not be on
  the host: see offloads); an activation the backward recomputes has no forward copy there (the lowered
  backward receives none), so no backward step reads it before its recomputation;
- recomputations have their inputs (the same rule: a recomputation reads what exists at its position);
- offloads: only offloadable activations made in the forward and read back in the backward (from their
  forward copy) are offloaded, to a problem with host bandwidth and within its host budget; each comes back
  at or before its first backward read of the forward copy (so no read sees a copy on the host); a prefetch
  at a position inside a formed group's run is issued before the group.

- formed fusion options (`schedule.formed`): each names an option of the problem, whose members run at
  consecutive positions of their phase's order; a forward group recomputed in the backward is recomputed
  whole, at consecutive positions.

`violations(problem, schedule)` lists what breaks (empty: valid); `assert_valid` raises with the list.
`fused_replay(problem, schedule)` gives peak and time with formed groups as one kernel each, computed by
collapsing each formed run into one unit first (not as the simulator does it), for schedules without offloads.
"""

from __future__ import annotations

from optsched.solvers import Phase, Problem, Schedule, TensorKind


def violations(problem: Problem, schedule: Schedule) -> list[str]:
    out: list[str] = []
    ops, tensors = problem.ops, problem.tensors
    fw = {o.id for o in ops if o.phase == Phase.FW}
    bw = {o.id for o in ops if o.phase == Phase.BW}

    # --- orders
    if sorted(schedule.fw_order) != sorted(fw):
        out.append(f"forward order is not every forward op once: {sorted(schedule.fw_order)} vs {sorted(fw)}")
    bw_seen = [o for o in schedule.bw_order if o in bw]
    if sorted(bw_seen) != sorted(bw):
        out.append("backward order does not run every backward op exactly once")
    unknown = [o for o in schedule.bw_order if o not in bw and o not in fw]
    if unknown:
        out.append(f"backward order names ops that do not exist: {unknown}")
    recomputed = [o for o in schedule.bw_order if o in fw]
    if len(recomputed) != len(set(recomputed)):
        out.append(f"an op is recomputed twice: {sorted(o for o in set(recomputed) if recomputed.count(o) > 1)}")
    for o in set(recomputed):
        if not ops[o].recomputable:
            out.append(f"{ops[o].name} is recomputed but is not recomputable")
    overwritten: set[int] = set()  # step inputs an op wrote in place (an optimizer update): nothing reads them after
    for o in schedule.bw_order:
        stale = overwritten & set(ops[o].inputs)
        if stale:
            out.append(f"{ops[o].name} reads {sorted(tensors[t].name for t in stale)} after they were overwritten")
        overwritten |= set(ops[o].writes)
    if out:
        return out

    out += _formed_violations(problem, schedule)
    if out:
        return out

    # --- the forward: inputs and earlier forward activations only
    made_fw: set[int] = set()
    for k, o in enumerate(schedule.fw_order):
        for t in ops[o].inputs:
            kind = tensors[t].kind
            if kind == TensorKind.INPUT:
                continue
            if kind != TensorKind.ACTIVATION:
                out.append(f"forward step {k} ({ops[o].name}) reads {tensors[t].name} ({kind.value}), not available in the forward")
            elif t not in made_fw:
                out.append(f"forward step {k} ({ops[o].name}) reads {tensors[t].name} before it is made")
        made_fw.update(ops[o].outputs)

    # --- the backward: which copy each read uses, and that it exists
    made_bw: set[int] = set()  # backward values
    recomputed_copy: set[int] = set()  # activations whose recomputed copy exists
    forward_copy_reads: dict[int, list[int]] = {}  # activation -> backward positions reading its forward copy
    for j, o in enumerate(schedule.bw_order):
        op = ops[o]
        for t in op.inputs:
            tensor = tensors[t]
            if tensor.kind in (TensorKind.INPUT, TensorKind.TANGENT, TensorKind.TANGENT_FREED, TensorKind.CALLER):
                continue
            producer = tensor.producer
            if producer is None:
                out.append(f"backward step {j} ({op.name}) reads {tensor.name}, which nothing produces")
            elif producer in bw:
                if t not in made_bw:
                    out.append(f"backward step {j} ({op.name}) reads {tensor.name} before its producer ran")
            elif t in recomputed_copy:
                pass  # the recomputed copy
            elif producer in recomputed:
                out.append(f"backward step {j} ({op.name}) reads {tensor.name} before its recomputation")
            elif t in made_fw:
                forward_copy_reads.setdefault(t, []).append(j)
            else:
                out.append(f"backward step {j} ({op.name}) reads {tensor.name}: no copy exists")
        if o in fw:
            recomputed_copy.update(op.outputs)
        else:
            made_bw.update(op.outputs)

    # --- offloads: come back before use
    if schedule.offload and problem.host_bw <= 0:
        out.append("offloads in a problem without host bandwidth")
    host = 0
    run_start = _backward_run_starts(problem, schedule)
    for t, j in schedule.offload.items():
        j = run_start.get(j, j)  # a prefetch inside a formed group's run is issued before the group
        if not 0 <= t < len(tensors):
            out.append(f"offloaded tensor {t} does not exist")
            continue
        tensor = tensors[t]
        host += tensor.bytes
        if tensor.kind != TensorKind.ACTIVATION or tensor.producer not in fw or not tensor.offloadable:
            out.append(f"{tensor.name} is offloaded but is not an offloadable forward activation")
            continue
        reads = forward_copy_reads.get(t, [])
        if not reads:
            out.append(f"{tensor.name} is offloaded but the backward never reads its forward copy")
        elif not 0 <= j <= min(reads):
            out.append(f"{tensor.name} comes back at backward position {j}, after its first read at {min(reads)}")
    if problem.host_budget_bytes is not None and host > problem.host_budget_bytes:
        out.append(f"offloads take {host} bytes of host memory, over the host budget {problem.host_budget_bytes}")
    return out


def _formed_violations(problem: Problem, schedule: Schedule) -> list[str]:
    out = []
    options = problem.fusion_options
    for i in schedule.formed:
        if not 0 <= i < len(options):
            out.append(f"formed fusion option {i} does not exist")
            continue
        members = set(options[i].members)
        for order, what in ((schedule.fw_order, "forward"), (schedule.bw_order, "backward")):
            at = [k for k, o in enumerate(order) if o in members]
            if not at:
                continue
            if len(at) != len(members):
                out.append(f"fusion option {i} is formed but only {len(at)} of its {len(members)} ops run in the {what} order")
            elif at != list(range(at[0], at[0] + len(at))):
                out.append(f"fusion option {i} is formed but its ops are not consecutive in the {what} order: {at}")
    return out


def _backward_run_starts(problem: Problem, schedule: Schedule) -> dict[int, int]:
    """Backward position inside a formed group's run -> the run's first position."""
    out = {}
    for i in schedule.formed:
        members = set(problem.fusion_options[i].members)
        at = [k for k, o in enumerate(schedule.bw_order) if o in members]
        out.update((k, at[0]) for k in at)
    return out


def fused_replay(problem: Problem, schedule: Schedule) -> tuple[int, float]:
    """(peak bytes, time) of a valid schedule without offloads: formed runs collapsed into one unit each
    (reads from outside it, outputs, internal values of 0 bytes, the option's time and scratch space),
    then live bytes per unit: a copy lives from the unit making it to the last unit reading it; inputs all
    program, tangents through the backward, outputs to the end, returned values to the forward's end;
    storage reuse by ops outside formed groups; the caller's loss boundary."""
    assert not schedule.offload, "fused_replay does not model offloads"
    ops, tensors = problem.ops, problem.tensors
    fw = {o.id for o in ops if o.phase == Phase.FW}
    # units: (ops, recomputation?, option index or None)
    formed_of = {o: i for i in schedule.formed for o in problem.fusion_options[i].members}
    units: list[tuple[list[int], bool, int | None]] = []
    for order, in_bw in ((schedule.fw_order, False), (schedule.bw_order, True)):
        for o in order:
            rc = in_bw and o in fw
            i = formed_of.get(o)
            if i is not None and units and units[-1][2] == i and units[-1][1] == rc:
                units[-1][0].append(o)
            else:
                units.append(([o], rc, i))
    n_fw = next((k for k, u in enumerate(units) if u[1] or ops[u[0][0]].phase == Phase.BW), len(units))
    readers: dict[int, set[int]] = {}
    for op in ops:
        for t in op.inputs:
            readers.setdefault(t, set()).add(op.id)
    hidden: set[int] = set()
    for i in schedule.formed:
        members = set(problem.fusion_options[i].members)
        for o in members:
            for t in ops[o].outputs:
                if t not in problem.outputs and t not in problem.returned and readers.get(t) and readers[t] <= members:
                    hidden.add(t)
    size = {t.id: 0 if t.id in hidden else t.bytes for t in tensors}
    last = len(units) - 1
    start: dict[tuple[int, bool], int] = {}
    end: dict[tuple[int, bool], int] = {}
    for t in tensors:
        if t.kind == TensorKind.INPUT:
            start[(t.id, False)], end[(t.id, False)] = 0, last
        elif t.kind == TensorKind.TANGENT:
            start[(t.id, False)], end[(t.id, False)] = n_fw, last
        elif t.kind == TensorKind.TANGENT_FREED:  # taken over by the backward: to its last reader
            start[(t.id, False)], end[(t.id, False)] = n_fw, n_fw
    rc_done: set[int] = set()
    read_key: list[dict[int, tuple[int, bool]]] = []
    time_s = 0.0
    for k, (members, rc, i) in enumerate(units):
        made_here = {t for o in members for t in ops[o].outputs}
        keys = {}
        for o in members:
            for t in ops[o].inputs:
                if t in made_here:
                    continue
                key = (t, k >= n_fw and tensors[t].producer in rc_done)
                end[key] = max(end[key], k)
                keys[t] = key
        read_key.append(keys)
        for t in made_here:
            start[(t, rc)] = end[(t, rc)] = k
        if rc:
            rc_done.update(members)
        time_s += problem.fusion_options[i].time_s if i is not None else sum(ops[o].time_s for o in members)
    for t in problem.outputs:
        if (t, False) in end:
            end[(t, False)] = last
    for t in problem.returned:
        if (t, False) in end:
            end[(t, False)] = max(end[(t, False)], n_fw - 1)
    visible = problem.outputs | problem.returned
    for k, (members, _rc, i) in enumerate(units):
        if i is not None:
            continue
        op = ops[members[0]]
        dying = [read_key[k][inp] for _out, inp in op.reuse
                 if tensors[inp].kind == TensorKind.ACTIVATION and inp not in visible
                 and end[read_key[k][inp]] == k and start[read_key[k][inp]] < k]
        dying = (dying if len(dying) == len(op.reuse) else []) if op.reuse_all else dying[:1]
        for key in dying:
            end[key] = k - 1
    peak = 0
    for k, (members, _rc, i) in enumerate(units):
        ws = problem.fusion_options[i].workspace_bytes if i is not None else ops[members[0]].workspace_bytes
        peak = max(peak, ws + sum(size[t] for (t, c), s in start.items() if s <= k <= end[(t, c)]))
    if not units:
        peak = sum(size[t] for (t, _c) in start)
    caller = sum(t.bytes for t in tensors if t.kind == TensorKind.CALLER)
    if caller and len(units) > n_fw:
        first = set(read_key[n_fw].values())  # a value the first backward step reads (and maybe writes into) crosses
        peak = max(peak, caller + sum(
            size[t] for (t, c), s in start.items()
            if s < n_fw <= end[(t, c)] or (s == n_fw and tensors[t].kind in (TensorKind.TANGENT, TensorKind.TANGENT_FREED))
            or (s < n_fw and (t, c) in first)))
    return peak, time_s


def assert_valid(problem: Problem, schedule: Schedule, where: str = "") -> None:
    bad = violations(problem, schedule)
    assert not bad, f"invalid schedule{' from ' + where if where else ''}:\n  " + "\n  ".join(bad)
