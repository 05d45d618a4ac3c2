"""Formed fusion options in the simulator: a group's members run as one kernel.

A formed option's members occupy consecutive steps (its recomputation too, when a forward
group is recomputed: whole and consecutive). The steps stay one per op, so positions in the
orders keep their meaning, but the run counts as one step: every copy the group reads lives to
its last step, every copy it makes from its first, values made and read only inside take no
memory, the run's scratch space is the kernel's, and its time is the option's. That is what
merging the group into one op (`search.fusion_groups.fuse_ops`) gives, step for step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import Problem, Schedule, ScheduleError


@dataclass(frozen=True)
class Run:
    option: int
    start: int  # first step
    end: int  # last step (inclusive)
    recomputed: bool


def internal_tensors(problem: Problem, group: list[int] | tuple[int, ...], readers: dict[int, list[int]] | None = None,
                     ) -> set[int]:
    """Tensors the group makes and only the group reads (and the step does not return)."""
    inside = set(group)
    readers = problem.consumers() if readers is None else readers
    made = {t for o in group for t in problem.ops[o].outputs}
    return {t for t in made if t not in problem.visible and readers[t] and all(r in inside for r in readers[t])}


def formed_runs(problem: Problem, schedule: Schedule, steps: list[tuple[int, bool]]) -> list[Run]:
    """The runs of the schedule's formed options; ScheduleError when members are not consecutive or a
    forward group is recomputed in part."""
    if not schedule.formed:
        return []
    at = {s: k for k, s in enumerate(steps)}
    runs = []
    for i in schedule.formed:
        if not 0 <= i < len(problem.fusion_options):
            raise ScheduleError(f"formed fusion option {i} does not exist (the problem has {len(problem.fusion_options)})")
        members = problem.fusion_options[i].members
        label = f"formed fusion option {i} ({problem.option_name(i)})"
        for rc in (False, True):
            ks = sorted(at[(o, rc)] for o in members if (o, rc) in at)
            if not ks:
                continue
            if len(ks) != len(members):
                missing = next(problem.ops[o].name for o in members if (o, rc) not in at)
                raise ScheduleError(f"{label} is recomputed in part: {missing!r} is not")
            if ks[-1] - ks[0] + 1 != len(ks):
                between = next(steps[k][0] for k in range(ks[0], ks[-1]) if k not in ks)
                raise ScheduleError(f"{label}: its members do not run consecutively ({problem.ops[between].name!r} "
                                    "runs between them)")
            runs.append(Run(i, ks[0], ks[-1], rc))
    return sorted(runs, key=lambda r: r.start)


def merge_runs(problem: Problem, runs: list[Run], steps: list[tuple[int, bool]], span: dict, reads: list,
               ) -> tuple[float, float]:
    """Spans of every copy a run reads or makes extended to its end, of every copy it makes started at its start;
    returns the time the runs save (members' times minus the kernel's), and the part in recomputations."""
    total = recomputed = 0.0
    for run in runs:
        saved = 0.0
        for k in range(run.start, run.end + 1):
            for key in reads[k]:
                span[key][1] = max(span[key][1], run.end)
            o, rc = steps[k]
            for t in problem.ops[o].outputs:
                span[(t, rc)][0] = run.start
                span[(t, rc)][1] = max(span[(t, rc)][1], run.end)
            saved += problem.ops[o].time_s
        saved -= problem.fusion_options[run.option].time_s
        total += saved
        recomputed += saved if run.recomputed else 0.0
    return total, recomputed


def hidden_bytes(problem: Problem, runs: list[Run]) -> list[int]:
    """Bytes per tensor with formed groups' internal values at 0."""
    nbytes = [t.bytes for t in problem.tensors]
    readers = problem.consumers()
    for i in {r.option for r in runs}:
        for t in internal_tensors(problem, problem.fusion_options[i].members, readers):
            nbytes[t] = 0
    return nbytes


def step_workspace(problem: Problem, steps: list[tuple[int, bool]], runs: list[Run]) -> list[int]:
    """Kernel scratch space per step: a run's steps all hold the fused kernel's."""
    ws = [problem.ops[o].workspace_bytes for o, _rc in steps]
    for run in runs:
        for k in range(run.start, run.end + 1):
            ws[k] = problem.fusion_options[run.option].workspace_bytes
    return ws
