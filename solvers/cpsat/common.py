"""What the CP-SAT models share: integer units for time and memory, solver settings, and
`run_solver`, through which every solve goes so that Ctrl-C stops it."""

from __future__ import annotations

import math
import threading

from ortools.sat.python import cp_model

from ..model import calibration, clock
from ..model.problem import Problem

NS = 1e-9  # time unit: op costs are whole nanoseconds (at least 1)
RESOLUTION = 1 << 20  # memory units across all of a step's storages
DETERMINISTIC_WALL_FACTOR = 20.0  # a deterministic solve's wall-clock safety net, times its work limit


def memory_unit(problem: Problem, resolution: int = RESOLUTION) -> int:
    """Bytes per model unit: exact (the sizes' common divisor) when that keeps numbers
    small, else about a millionth of all storage, because CP-SAT's bounds degrade with
    huge coefficients. Models that must fit round demands up and budgets down; the
    relaxation rounds the other way; the simulator stays exact."""
    total = sum(t.bytes for t in problem.tensors)
    common = math.gcd(*(t.bytes for t in problem.tensors)) or 1
    if total // common <= resolution:
        return common
    return max(1, total // resolution)


def cost_ns(time_s: float) -> int:
    return max(1, round(time_s / NS))


KINDS = ("segment", "remat", "window", "bound", "order", "chain", "joint")  # the models: each its own clock unit


def work_unit(kind: str) -> str:
    """The clock's unit for a unit of CP-SAT's deterministic time in a `kind` model: the wall seconds behind one unit
    differ by model (cumulative and LP-heavy models take several times a window's), so each is priced apart."""
    if kind not in KINDS:
        raise ValueError(f"unknown CP-SAT model kind {kind!r}; one of {KINDS}")
    return f"cpsat_dtime_{kind}"


def make_solver(time_limit_s: float, workers: int, kind: str, linearization_level: int | None = None) -> cp_model.CpSolver:
    """In deterministic mode (solvers/model/clock.py) the same answer on every run and machine: the limit
    is CP-SAT's deterministic time (the seconds over what one unit of it costs in a `kind` model),
    DETERMINISTIC_WORKERS workers (interleaved in fixed batches rather than raced when more than one), the seed fixed;
    a wall-clock cap of DETERMINISTIC_WALL_FACTOR times the limit stays as a safety net. `run_solver` charges the
    solve to the same unit."""
    unit = work_unit(kind)
    solver = cp_model.CpSolver()
    solver.optsched_work_unit = unit  # type: ignore[attr-defined]  # read by _charge
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0
    if clock.is_deterministic():
        solver.parameters.num_workers = clock.DETERMINISTIC_WORKERS
        solver.parameters.max_deterministic_time = max(0.05, time_limit_s) / calibration.seconds(unit, 1)
        solver.parameters.max_time_in_seconds = DETERMINISTIC_WALL_FACTOR * max(0.05, time_limit_s)
        solver.parameters.interleave_search = clock.DETERMINISTIC_WORKERS > 1
    else:
        solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    if linearization_level is not None:
        solver.parameters.linearization_level = linearization_level
    return solver


SOLVER_THREAD = "optsched-cp-sat"  # the worker thread's name (tests wait for it)
POLL_S = 0.05  # how often the main thread wakes while a solve runs: Ctrl-C is seen within this


def run_solver(
    solver: cp_model.CpSolver, model: cp_model.CpModel, callback: cp_model.CpSolverSolutionCallback | None = None
) -> int:
    """`solver.Solve(model, callback)`, interruptible: Ctrl-C raises KeyboardInterrupt.

    CP-SAT catches SIGINT itself by default and ends the search as if its time were up, so
    a Ctrl-C would turn into a cut-short plan. Its catching is turned off here; in the main
    thread the solve runs in a worker thread while the main thread waits in short intervals,
    so Python's own handler raises KeyboardInterrupt there. Then the search is stopped, the
    worker waited for (CP-SAT stops within milliseconds; a second Ctrl-C meanwhile is
    absorbed) and the KeyboardInterrupt re-raised: no solve outlives the call. Off the main
    thread (where no KeyboardInterrupt arrives) the solve simply runs in the calling thread.
    """
    with clock.stage("cp-sat"):
        return _run_interruptibly(solver, model, callback)


def _run_interruptibly(solver: cp_model.CpSolver, model: cp_model.CpModel,
                       callback: cp_model.CpSolverSolutionCallback | None) -> int:
    solver.parameters.catch_sigint_signal = False
    if threading.current_thread() is not threading.main_thread():
        status = solver.Solve(model, callback)
        _charge(solver, model)
        return status
    outcome: dict[str, object] = {}
    done, cancelled = threading.Event(), threading.Event()

    def work() -> None:
        try:
            if not cancelled.is_set():
                outcome["status"] = solver.Solve(model, callback)
        except BaseException as e:  # handed to the caller's thread below
            outcome["error"] = e
        finally:
            done.set()

    # An Event, not Thread.join: in Python 3.11 a join interrupted by Ctrl-C can mark a
    # running thread as finished (the tstate-lock race of bpo-45274's fix).
    worker = threading.Thread(target=work, name=SOLVER_THREAD, daemon=True)
    try:
        worker.start()
        while not done.wait(POLL_S):
            pass
    except KeyboardInterrupt:
        _stop(solver, worker, done, cancelled)
        raise
    worker.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    _charge(solver, model)
    return outcome["status"]  # type: ignore[return-value]


def _charge(solver: cp_model.CpSolver, model: cp_model.CpModel) -> None:
    """The work of one solve on the solvers' clock (deterministic mode): its deterministic time in the clock's
    seconds, and the loading its deterministic time leaves out (solvers/model/clock.py)."""
    if clock.is_deterministic():
        clock.count(solver.optsched_work_unit, solver.deterministic_time)  # type: ignore[attr-defined]  # make_solver's
        # a model that prices its loading apart (the joint bound's: built anew, in Python, for each of its solves)
        clock.count(getattr(solver, "optsched_constraint_unit", "cpsat_constraint"), len(model.Proto().constraints))


def _stop(solver: cp_model.CpSolver, worker: threading.Thread, done: threading.Event, cancelled: threading.Event) -> None:
    """Stop the search and wait for the worker. A worker not started yet sees `cancelled`
    and never solves; StopSearch is a no-op until the solve has set itself up, so it is
    repeated until the worker is done."""
    cancelled.set()
    while worker.is_alive() and not done.is_set():
        try:
            solver.StopSearch()
            done.wait(POLL_S)
        except KeyboardInterrupt:
            continue
