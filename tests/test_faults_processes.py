"""A process of a multi-process job dies: every survivor exits within a bounded
time with a headline naming the dead process (two processes on 127.0.0.1)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import script_path


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = script_path("peer_fault_job.py")
JOIN_TIMEOUT = 120
# heartbeat_timeout=3 in the script, plus the time to notice and to exit; JAX's
# own heartbeat would abort the survivor after 100 s, naming no process.
EXIT_BOUND = 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, work):
    port = _port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # Each script adds its own device count to the tests' compile flags.
    env["XLA_FLAGS"] = os.environ.get("EQXSCAN_TEST_XLA_FLAGS", "")
    logs = [open(tmp_path / f"{i}.log", "w+") for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(i), str(port), work],
            stdout=logs[i],
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for i in range(2)
    ]
    return procs, logs


def _stop(procs, logs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
    for f in logs:
        f.close()


# Process 1 dies mid-collective. (When process 0, which runs JAX's coordination
# service, dies, JAX's runtime ends the others at once with its own message,
# which no Python code can precede.)
def test_survivor_of_a_dead_peer_exits_naming_it(tmp_path, dead=1, work="collective"):
    procs, logs = _start(tmp_path, work)
    try:
        start = time.monotonic()
        while not all("ready" in (tmp_path / f"{i}.log").read_text() for i in (0, 1)):
            assert all(p.poll() is None for p in procs), [
                (tmp_path / f"{i}.log").read_text()[-2000:] for i in (0, 1)
            ]
            assert time.monotonic() - start < JOIN_TIMEOUT
            time.sleep(0.2)
        time.sleep(1)  # a few steps together
        procs[dead].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = procs[1 - dead]
        code = survivor.wait(timeout=EXIT_BOUND + 30)
        took = time.monotonic() - killed
        text = (tmp_path / f"{1 - dead}.log").read_text()
        assert took < EXIT_BOUND, (took, text[-3000:])
        assert code == 1, text[-3000:]
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines[-2].startswith(
            "eqxscan.distributed: process 0 of 2 lost process 1: it has shown no "
            "sign of life for "
        ), text[-3000:]
        assert lines[-1].startswith("Hint: see the log of process 1 for why")
    finally:
        _stop(procs, logs)


def test_a_peer_that_raises_is_reported_and_both_exit(tmp_path):
    # An uncaught exception ran the exit handlers: the peer was taken for one
    # that had left, and the survivor waited in its collective (minutes).
    procs, logs = _start(tmp_path, "crash")
    try:
        codes = [p.wait(timeout=JOIN_TIMEOUT + EXIT_BOUND) for p in procs]
        texts = [(tmp_path / f"{i}.log").read_text() for i in (0, 1)]
        # Process 1 exits with 1, or JAX's runtime aborts it once process 0,
        # which runs the coordination service, has gone.
        assert codes[0] == 1 and codes[1] in (1, -signal.SIGABRT), texts
        assert "RuntimeError: a bug in process 1" in texts[1]
        lines = [line for line in texts[0].splitlines() if line.strip()]
        assert lines[-2] == (
            "eqxscan.distributed: process 0 of 2 lost process 1: it crashed "
            "(RuntimeError); this process exits."
        ), texts[0][-3000:]
    finally:
        _stop(procs, logs)


@pytest.mark.parametrize("work", ["finish", "shutdown"])
def test_a_job_that_ends_exits_cleanly(tmp_path, work):
    # Its watch threads are stopped before the interpreter finalizes: one still
    # inside a call into JAX's client then aborted the process (status 134,
    # "FATAL: exception not rethrown"). After the user's own
    # `jax.distributed.shutdown()`, silence was taken for death (status 1).
    procs, logs = _start(tmp_path, work)
    try:
        codes = [p.wait(timeout=JOIN_TIMEOUT + EXIT_BOUND) for p in procs]
        texts = [(tmp_path / f"{i}.log").read_text() for i in (0, 1)]
        assert codes == [0, 0], texts
        for text in texts:
            assert "lost process" not in text, text[-3000:]
            assert "done\nwatch threads at exit: 0\n" in text, text[-3000:]
    finally:
        _stop(procs, logs)
