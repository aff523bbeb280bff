"""Storage that fails under an asynchronous `CheckpointManager`: the failure
surfaces with a headline naming the step and the directory, and the process
exits (each case in a fresh process, bounded by a timeout)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 90

FAILING_SAVES = """
import os, shutil, sys
import jax
import eqxscan
from eqxscan import checkpoint
from orbax.checkpoint._src.path import atomicity

model = eqxscan.StackedMLP(4, 2, key=jax.random.key(0))
real = atomicity.AtomicRenameTemporaryPath.finalize

async def refuse(self, *args, **kwargs):
    raise PermissionError(13, "Permission denied", str(self.get_final()))

# The write of a step fails in the background (read-only storage): the error
# surfaces at the next save.
with checkpoint.CheckpointManager(sys.argv[1]) as c:  # asynchronous
    c.save(1, model, wait=True)
    atomicity.AtomicRenameTemporaryPath.finalize = refuse
    c.save(2, model)
    print("save returned", flush=True)
    try:
        c.save(3, model)
    except PermissionError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        print(f"errno {e.errno}", file=sys.stderr, flush=True)
    atomicity.AtomicRenameTemporaryPath.finalize = real
    c.save(4, model)  # storage back: saves go on
    c.wait()
    print("steps", c.all_steps(), flush=True)

# The directory is gone, a file in its place: `save` itself raises, and the
# error ends the process.
with checkpoint.CheckpointManager(sys.argv[2]) as c:
    c.save(1, model, wait=True)
    shutil.rmtree(sys.argv[2])
    with open(sys.argv[2], "w") as f:
        f.write("not a directory")
    c.save(2, model)
print("not reached", flush=True)
"""


def test_failed_asynchronous_saves_are_named_and_the_process_exits(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FAILING_SAVES), str(first), str(second)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,  # before the fix: Orbax's threads wait 300 s, then more
    )
    took = time.monotonic() - start
    assert run.returncode == 1, (run.stdout, run.stderr[-3000:])
    assert run.stdout.splitlines() == ["save returned", "steps [1, 4]"], run.stdout
    lines = run.stderr.strip().splitlines()
    hint = "Hint: check that the directory exists and can be written"
    for error, where, kept in (
        ("PermissionError", first, "the complete steps in it are [1]"),
        ("NotADirectoryError", second, ""),
    ):
        headline = (
            f"{error}: CheckpointManager could not save step 2 to {str(where)!r}: "
            f"{error}: "
        )
        (at,) = [i for i, line in enumerate(lines) if line.startswith(headline)]
        assert lines[at + 1].startswith(hint) and kept in lines[at + 1], lines[at:]
    assert "errno 13" in lines  # the system's errno kept, as the docs say
    assert lines[-1].startswith(hint)  # the second one ended the process
    assert took < 60, took
