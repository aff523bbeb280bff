"""A program that ends while its last asynchronous save is being written: the
save lands before Python shuts its thread pools down (it was lost, the process
exiting with status 0)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan


ROOT = Path(__file__).resolve().parents[1]

SAVES = """
import sys
import jax.numpy as jnp
from eqxscan import checkpoint

manager = checkpoint.CheckpointManager(sys.argv[1])
for step in (1, 2, 3):
    manager.save(step, {"w": jnp.full(1000, float(step))})
if sys.argv[2] == "raise":
    raise RuntimeError("a bug after the last save")
del manager  # and the program ends without wait() or close()
"""


@pytest.mark.parametrize("ending", ["del", "raise"])
def test_the_last_asynchronous_save_lands_at_exit(tmp_path, ending):
    script = tmp_path / "saves.py"
    script.write_text(textwrap.dedent(SAVES))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), ending],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr[-3000:]
    assert "at exit" not in done.stderr, done.stderr[-3000:]
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.all_steps() == [1, 2, 3]
        like = {"w": jnp.zeros(1000)}
        restored, _, step = manager.restore(like, mesh=mesh)  # digests checked
    assert step == 3
    np.testing.assert_array_equal(restored["w"], np.full(1000, 3.0))


FAILING = """
import sys
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from eqxscan import checkpoint

async def refuse(self, *args, **kwargs):
    raise PermissionError(13, "Permission denied", str(self.get_final()))

manager = checkpoint.CheckpointManager(sys.argv[1])
manager.save(1, {"w": jnp.ones(10)}, wait=True)
atomicity.AtomicRenameTemporaryPath.finalize = refuse  # read-only storage
manager.save(2, {"w": jnp.ones(10)})
print("returned", flush=True)
"""


def test_a_last_save_that_fails_at_exit_is_named_and_fails_the_process(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent(FAILING))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.stdout == "returned\n"
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        "eqxscan.checkpoint: at exit, a save still being written failed: "
        "PermissionError: CheckpointManager could not save step 2"
    ) in done.stderr, done.stderr[-3000:]
