"""Processes of one job that disagree (process count, model layout) all fail
fast with one headline, instead of training apart (two processes on 127.0.0.1)."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import script_path


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = script_path("job_checks.py")
TIMEOUT = 120


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(counts: tuple[int, int], widths: tuple[int, int]) -> list[tuple[int, str]]:
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(i), str(counts[i]), str(port), str(w)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for i, w in enumerate(widths)
    ]
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=TIMEOUT)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return out


@pytest.mark.parametrize(
    "counts, widths, what",
    [
        ((2, 3), (4, 4), "process count"),
        ((2, 2), (4, 5), "model layout"),
        # Same shapes, split otherwise: passed, then hung the first collective.
        ((2, 2), (-1, -1), "model layout"),
    ],
)
def test_every_process_fails_with_one_headline(counts, widths, what):
    for i, (code, text) in enumerate(_job(counts, widths)):
        assert code == 3, text
        assert (
            f"disagree on the {what}: process {i}" in text
            and f"differs from process(es) [{1 - i}]" in text
        ), text
        # Processes that agree go on: in a job that forms, the check of the
        # layout they share passes before the one that differs.
        assert text.count("agreed") == (what == "model layout"), text
