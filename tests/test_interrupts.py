"""Ctrl-C while planning: a KeyboardInterrupt, promptly, and no plan written.

CP-SAT catches SIGINT itself by default and ends its search as if time were up, which
turned a Ctrl-C into a cut-short plan (saved, then reused). Every solve goes through
`cpsat/common.run_solver`, which leaves SIGINT to Python and stops the search.

SIGINT is sent to this very process (os.kill from a thread) only while a solve is running:
the thread waits for the solver's worker thread (`SOLVER_THREAD`) and never fires after the
test has ended, so a slow machine makes a test fail, never the session.

"Promptly" is checked without a clock in the default run: the interrupted CP-SAT search ended neither
by finishing (a proof) nor by its deterministic limit of work, so StopSearch ended it, and the call
returned once it had; the wall-clock seconds from Ctrl-C to the error, which a loaded machine stretches,
only in the `slow` runs (`make test-all`).
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from optsched.solvers.cpsat import common as cpsat_common
from optsched.solvers.cpsat.common import SOLVER_THREAD
from optsched.solvers.cpsat.remat import solve_remat
from optsched.solvers.model import clock
from optsched.solvers.model.problem import default_schedule
from optsched.solvers.model.simulator import simulate
from optsched.solvers.synthetic import chain_training_problem

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Python's own SIGINT handler for each test, whatever the runner inherited: a test run started in
    the background of a non-interactive shell has SIGINT ignored, and Ctrl-C could not be tested."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _default_sigint() -> None:
    """In a child before exec: SIGINT at its default, so that Python installs its handler there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _solving() -> bool:
    return any(t.name == SOLVER_THREAD and t.is_alive() for t in threading.enumerate())


class _CtrlC:
    """Sends SIGINT to this process while a solve runs, `delay_s` after it is first seen.
    `sent_at`: perf_counter of the kill, None if it was never sent."""

    def __init__(self, delay_s: float, wait_s: float = 120.0):
        self.delay_s, self.wait_s = delay_s, wait_s
        self.sent_at: float | None = None
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            while not _solving():
                if self._cancel.wait(0.005) or time.monotonic() > deadline:
                    return
            if self._cancel.wait(self.delay_s):
                return
            if _solving():  # else that solve ended meanwhile: wait for the next one
                self.sent_at = time.perf_counter()
                os.kill(os.getpid(), signal.SIGINT)
                return

    def __enter__(self) -> _CtrlC:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._cancel.set()
        self._thread.join()


def _long_remat():
    """A solve CP-SAT does not finish in 30 s: 80 layers at 40% of the unplanned peak."""
    problem = chain_training_problem(n_layers=80)
    order = default_schedule(problem)
    budget = int(0.4 * simulate(problem, order).peak_bytes)
    return lambda: solve_remat(problem, order.fw_order, order.bw_order, budget, time_limit_s=30, workers=2)


@pytest.fixture
def stops(monkeypatch) -> list[tuple[str, float, float]]:
    """Each search `run_solver` stops on Ctrl-C: (how it ended, CP-SAT's deterministic time then, its limit)."""
    seen: list[tuple[str, float, float]] = []
    stop = cpsat_common._stop

    def recorded(solver, *args):
        stop(solver, *args)  # returns once the worker is done
        seen.append((solver.response_proto.status.name, solver.deterministic_time, solver.parameters.max_deterministic_time))

    monkeypatch.setattr(cpsat_common, "_stop", recorded)
    return seen


TIMED = [False, pytest.param(True, marks=pytest.mark.slow, id="wall-clock")]


@pytest.mark.parametrize("timed", TIMED)
def test_sigint_during_a_long_solve_raises_keyboard_interrupt_promptly(timed, stops):
    solve = _long_remat()
    with clock.deterministic(), _CtrlC(delay_s=0.5) as ctrl_c, pytest.raises(KeyboardInterrupt):
        solve()  # its limit is work (21 units); one worker proves it optimal after about 2 units (a minute here)
    stopped = time.perf_counter()
    assert ctrl_c.sent_at is not None
    # the search was stopped and waited for: it ended without a proof and short of its limit, so StopSearch ended it
    assert len(stops) == 1, stops
    ((status, work, limit),) = stops
    assert status != "OPTIMAL" and work < limit, f"the solve went on to {status} after {work:.2f} of {limit:.0f} units"
    assert not _solving(), "a solver thread outlived the interrupted call"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if timed:  # seconds: a loaded machine stretches them
        assert stopped - ctrl_c.sent_at < 1.0, f"the solve went on {stopped - ctrl_c.sent_at:.2f}s after Ctrl-C"


def test_a_solve_that_is_not_interrupted_returns_its_result():
    problem = chain_training_problem(n_layers=6)
    order = default_schedule(problem)
    budget = int(0.7 * simulate(problem, order).peak_bytes)
    res = solve_remat(problem, order.fw_order, order.bw_order, budget, time_limit_s=5, workers=2)
    assert res is not None and res.status == "OPTIMAL"
    assert not _solving()


def test_every_cp_sat_solve_goes_through_run_solver():
    """A direct `solver.Solve(...)` would let CP-SAT catch Ctrl-C again."""
    folder = Path(cpsat_common.__file__).parents[1]  # solvers/
    for path in sorted(folder.rglob("*.py")):
        if path == Path(cpsat_common.__file__):
            continue
        text = path.read_text()
        assert not re.search(r"\.(Solve|solve|SolveWithSolutionCallback|SearchForAllSolutions)\(\s*(model|m\b)", text), (
            f"{path.name} calls CP-SAT's Solve directly; use cpsat_common.run_solver"
        )


@pytest.mark.parametrize("timed", TIMED)
def test_optimize_interrupted_in_its_first_call_raises_and_writes_no_plan(timed, tmp_path):
    import optsched
    from benchmarks.models import gpt

    cfg = gpt.GPTConfig(n_layer=2)
    model = gpt.build(cfg)
    inputs = gpt.make_batch(cfg, batch_size=8)
    path = tmp_path / "p.json"
    opt = optsched.optimize(model, "50%", plan=path, time_limit_s=30, device_profile="h100", offload=False)
    with _CtrlC(delay_s=0.2) as ctrl_c, pytest.raises(KeyboardInterrupt):
        opt(*inputs)
    stopped = time.perf_counter()
    assert ctrl_c.sent_at is not None
    assert not path.exists() and list(tmp_path.iterdir()) == []  # no plan, no temporary file
    assert opt.plan is None
    assert not _solving()  # the interrupted search was stopped and waited for (how fast: the test above)
    if timed:  # seconds: a loaded machine stretches them
        assert stopped - ctrl_c.sent_at < 2.0, f"KeyboardInterrupt came {stopped - ctrl_c.sent_at:.2f}s after Ctrl-C"


def _read_until(proc: subprocess.Popen, words: tuple[bytes, ...], timeout: float) -> bytes:
    """Read proc's stderr until one of `words` appears (or it closes, or time runs out)."""
    got = b""
    deadline = time.monotonic() + timeout
    while not any(w in got for w in words):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stderr], [], [], left)[0]:
            break
        chunk = os.read(proc.stderr.fileno(), 65536)
        if not chunk:
            break
        got += chunk
    return got


@pytest.mark.parametrize("timed", TIMED)
def test_cli_plan_interrupted_while_solving_exits_130_with_one_line(timed, tmp_path):
    out = tmp_path / "out.json"
    # TTY_COMPATIBLE: rich draws the progress line into a pipe, so "planning N ops:" tells
    # that solving has started (a fixed sleep would race the capture on a busy machine)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120", "TTY_COMPATIBLE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "optsched.cli", "plan", "benchmarks.models.gpt:build", "--kwargs", '{"cfg": {"n_layer": 2}}',
         "--inputs", "8x128:int64,8x128:int64", "--budget", "50%", "--no-offload", "--profile", "cpu",
         "--time-limit", "60", "-o", str(out)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint,
    )
    try:
        err = _read_until(proc, (b" ops: ", b"Traceback", b"error:"), timeout=180)
        assert b" ops: " in err, err.decode(errors="replace")[-3000:]
        time.sleep(0.5)
        assert proc.poll() is None, "the plan finished before it could be interrupted"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        err += _read_until(proc, (b"interrupted",), timeout=30)
        said = time.monotonic() - sent
        rest_out, rest_err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = (err + rest_err).decode(errors="replace")
    assert proc.returncode == 130, text[-3000:]
    assert b"interrupted" in err, text[-3000:]  # said before the process ended (within _read_until's 30 s)
    if timed:  # seconds: a loaded machine stretches them
        assert said < 2.0, f"'interrupted' came {said:.2f}s after Ctrl-C"
    assert "Traceback" not in text
    assert text.count("optsched plan: interrupted") == 1
    assert not out.exists() and not any(p.name.startswith(".out.json") for p in tmp_path.iterdir())
    assert rest_out == b""  # no plan table: nothing was planned
