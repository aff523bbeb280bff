"""Both ends of the subprocess protocol.

The parent calls `run_worker(spec)`, which starts `python -m benchmarks.bench._worker
SPEC` (this package's own name, however it was imported) with the persistent
compilation cache off. The child prints one `PROGRESS` line per finished timing
round and finally one `RESULT <json>` line.

Everything that opens the device runs in such a child, one at a time, and the
parent never initialises a JAX backend: a TPU (or a GPU with memory
preallocation) is held by one process at a time, so a parent that had touched it
would lock every child out. The tasks (`spec["task"]`):

- `"describe"`: the machine and its first device (`describe_machine`), whose
  `"backend"` chooses the presets;
- `"agree"`: `check_agreement` at each of `spec["dtypes"]`;
- `"compile"`: `measure_compile`;
- `"steps"`: `measure_steps`;
- `"depth"`: `measure_depth` (an accelerator's compiles and steps of one depth).

A compile or a problem that runs out of device memory gives the result
`{"does_not_fit": <the error's first line>}` instead of failing the worker.
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
    """Run one measurement (`spec["task"]`, as listed above) in a fresh
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
        raise WorkerError(f"{describe_task(spec)} failed (exit code {code}):\n{tail}")
    return result


def describe_task(spec: dict[str, Any]) -> str:
    """`spec` in words, for messages: "the compile measurement of eqxscan at L=4"."""
    task = spec["task"]
    if task == "describe":
        return "the description of the machine"
    if task == "agree":
        return "the agreement check"
    impls = spec.get("impl") or ", ".join(spec["impls"])
    task = {"depth": "compile and step"}.get(task, task)
    return f"the {task} measurement of {impls} at L={spec['num_layers']}"


def _agree(spec: dict[str, Any]) -> dict[str, Any]:
    from ._impls import MismatchError
    from ._measure import check_agreement, registry

    impls, _ = registry(spec["size"]["model"])
    errors = {}
    for dtype in spec["dtypes"]:
        try:
            errors[dtype] = check_agreement(
                [impls[n] for n in spec["impls"]], dtype=dtype, **spec["size"]
            )
        except MismatchError as e:
            return {"mismatch": str(e)}
    return {"errors": errors}


def _run(spec: dict[str, Any]) -> Any:
    from ._machine import describe_machine
    from ._measure import (
        measure_compile,
        measure_depth,
        measure_steps,
        out_of_memory,
    )

    task = spec.pop("task")
    if task == "describe":
        return describe_machine()
    if task == "agree":
        return _agree(spec)
    try:
        if task == "compile":
            return measure_compile(spec.pop("impl"), **spec)
        if task == "depth":
            return measure_depth(
                spec.pop("impls"),
                **spec,
                on_progress=lambda: print(PROGRESS, flush=True),
            )
        if task == "steps":
            return measure_steps(
                spec.pop("impls"),
                **spec,
                on_round=lambda: print(PROGRESS, flush=True),
            )
    except Exception as e:
        if (message := out_of_memory(e)) is None:
            raise
        return {"does_not_fit": message}
    raise ValueError(f"unknown task {task!r}")


def _main(argv: list[str]) -> None:
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    result = _run(json.loads(argv[0]))
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
