"""Planning and measuring print nothing on stderr that optsched does not mean to print.

Two sources used to: libkineto's `USDT:... profiler_start` / `profiler_stop` lines at every
profiler session (op timing while planning on CPU, peak measurement), and c10's "Memory block
of unknown size was allocated before the profiling started" when the profiled run freed the
previous run's outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from optsched.costs.measure import _kineto_markers_dropped

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import optsched
from optsched.measure import measure_training_step
from tests.models import mlp, conv

for build in (mlp, conv):
    model, inputs = build()
    opt = optsched.optimize(model, None, time_limit_s=1)  # CPU: op times measured under the profiler
    opt(*inputs).backward()
    m = measure_training_step(opt, model, inputs)
    assert opt.plan is not None and m.peak_bytes > 0
    measure_training_step(model, model, inputs)  # eager, as the benchmarks measure it
print("ok")
"""


def test_optimize_and_measure_print_nothing_on_stderr():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KINETO_", "TORCH_CPP_LOG"))}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**env, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
    assert out.stderr == "", out.stderr[-3000:]


def test_only_the_kineto_markers_are_dropped(capfd):
    marker = b"USDT:2026-01-01 10:00:00 123:123 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    with _kineto_markers_dropped():
        os.write(2, marker)
        os.write(2, b"[E something real went wrong\n")
        os.write(2, marker.replace(b"start", b"stop"))
        os.write(2, b"USDT: a line about profiler_start that is not the marker\n")
    err = capfd.readouterr().err
    assert err == "[E something real went wrong\nUSDT: a line about profiler_start that is not the marker\n"


def test_an_exception_inside_restores_stderr(capfd):
    try:
        with _kineto_markers_dropped():
            os.write(2, b"kept\n")
            raise KeyError("x")
    except KeyError:
        pass
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "kept\nafter\n"
