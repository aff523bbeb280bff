"""Both ends of the subprocess protocol.

The parent calls `run_worker(spec)`, which starts `python -m benchmarks.bench._worker
SPEC` (this package's own name, however it was imported) with the persistent
compilation cache off. The child prints one `PROGRESS`
line per finished timing round and finally one `RESULT <json>` line.
"""

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


PROGRESS = "#bench-progress"
RESULT = "#bench-result "


class WorkerError(RuntimeError):
    """A measurement subprocess failed; the message holds the end of its stderr."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    # Make the child import this very copy of the bench (`benchmarks.bench` from
    # the checkout's root, or `bench` from benchmarks/) and of eqxscan.
    here = Path(__file__).resolve().parent
    top = here.parents[__package__.count(".")]
    roots = list(dict.fromkeys([str(top), str(here.parents[1])]))
    env["PYTHONPATH"] = os.pathsep.join(
        roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env


def run_worker(
    spec: dict[str, Any], on_progress: Callable[[], object] = lambda: None
) -> Any:
    """Run one measurement (`spec["task"]` is "compile" or "steps") in a fresh
    Python process and return its result."""
    result = None
    # stderr goes to a file: a pipe left unread could fill up and block the child.
    with (
        tempfile.TemporaryFile("w+") as err,
        subprocess.Popen(
            [sys.executable, "-m", f"{__package__}._worker", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=_env(),
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS):
                on_progress()
            elif line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
        code = proc.wait()
        err.seek(0)
        stderr = err.read()
    if code != 0 or result is None:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise WorkerError(
            f"the {spec['task']} measurement of {spec.get('impl') or spec['impls']} "
            f"at L={spec['num_layers']} failed (exit code {code}):\n{tail}"
        )
    return result


def _main(argv: list[str]) -> None:
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from ._measure import measure_compile, measure_steps

    spec = json.loads(argv[0])
    task = spec.pop("task")
    if task == "compile":
        result = measure_compile(spec.pop("impl"), **spec)
    elif task == "steps":
        result = measure_steps(
            spec.pop("impls"),
            **spec,
            on_round=lambda: print(PROGRESS, flush=True),
        )
    else:
        raise ValueError(f"unknown task {task!r}")
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
