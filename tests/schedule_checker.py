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
  the host: see offloads);
- recomputations have their inputs (the same rule: a recomputation reads what exists at its position);
- offloads: only offloadable activations made in the forward and read back in the backward (from their
  forward copy) are offloaded, to a problem with host bandwidth and within its host budget; each comes back
  at or before its first backward read of the forward copy (so no read sees a copy on the host).

`violations(problem, schedule)` lists what breaks (empty: valid); `assert_valid` raises with the list.
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
            if tensor.kind in (TensorKind.INPUT, TensorKind.TANGENT, TensorKind.CALLER):
                continue
            producer = tensor.producer
            if producer is None:
                out.append(f"backward step {j} ({op.name}) reads {tensor.name}, which nothing produces")
            elif producer in bw:
                if t not in made_bw:
                    out.append(f"backward step {j} ({op.name}) reads {tensor.name} before its producer ran")
            elif t in recomputed_copy:
                pass  # the recomputed copy
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
    for t, j in schedule.offload.items():
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


def assert_valid(problem: Problem, schedule: Schedule, where: str = "") -> None:
    bad = violations(problem, schedule)
    assert not bad, f"invalid schedule{' from ' + where if where else ''}:\n  " + "\n  ".join(bad)
