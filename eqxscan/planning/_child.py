"""Compiling a plan's candidates in a fresh process with `N` simulated CPU
devices: this process writes the `Spec` to a file and reads the candidates back
from another; the child (`main`, run as `python -m eqxscan.planning SPEC OUT`)
reports its progress on stderr."""

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax

from ._candidates import compile_all, Progress
from ._report import MeshCandidate
from ._spec import decode, Spec


_PROGRESS = "eqxscan-plan-progress "
_TAIL = 40  # lines of the child's stderr kept for the error
# The folder holding the `eqxscan` package, for the child's import path.
_ROOT = str(Path(__file__).resolve().parents[2])
_MAIN = __name__.rpartition(".")[0]  # this package, whose __main__ runs `main`


def _child_env(devices: int) -> dict[str, str]:
    count = "--xla_force_host_platform_device_count"
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)
    ]
    # The working directory too: references may name modules found from it.
    path = (os.getcwd(), _ROOT, os.environ.get("PYTHONPATH", ""))
    return {
        **os.environ,
        "XLA_FLAGS": " ".join([*flags, f"{count}={devices}"]),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
    }


def compile_in_child(spec: Spec, progress: Progress) -> list[MeshCandidate]:
    """Every candidate of `spec`, compiled in a fresh process on
    `spec["devices"]` simulated CPU devices."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        with subprocess.Popen(
            [sys.executable, "-m", _MAIN, spec_path, out_path],
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(spec["devices"]),
        ) as proc:
            assert proc.stderr is not None  # opened with stderr=PIPE
            # The child's progress lines passed on, the last other lines kept.
            tail: list[str] = []
            for line in proc.stderr:
                if line.startswith(_PROGRESS):
                    i, n, what = line[len(_PROGRESS) :].rstrip("\n").split(" ", 2)
                    progress(int(i), int(n), what)
                else:
                    tail = (tail + [line])[-_TAIL:]
        if proc.returncode != 0:
            raise RuntimeError(
                f"plan: the process compiling the candidates on {spec['devices']} "
                f"CPU devices exited with status {proc.returncode}:\n" + "".join(tail)
            )
        with open(out_path) as f:
            return [MeshCandidate.from_json(row) for row in json.load(f)]


def _report(i: int, n: int, what: str) -> None:
    print(f"{_PROGRESS}{i} {n} {what}", file=sys.stderr, flush=True)


def main(argv: Sequence[str]) -> None:
    """The child: compile the candidates of the spec at `argv[0]` on this
    process's devices and write them as JSON to `argv[1]`."""
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec: Spec = json.load(f)
    job, shapes, remat, accelerator = decode(spec)
    devices = jax.devices()[: spec["devices"]]
    rows = compile_all(job, shapes, remat, devices, accelerator, _report)
    with open(out_path, "w") as f:
        json.dump([row.to_json() for row in rows], f)
