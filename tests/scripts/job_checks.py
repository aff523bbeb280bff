"""One process of a two-process job for tests/test_job_agreement.py:
`python tests/scripts/job_checks.py PROCESS_ID NUM_PROCESSES PORT WIDTH`.

Checks a layout every process shares, then a `(WIDTH, 4)` array's (a negative
WIDTH: a `(4, 4)` array split over the job's devices on process 0 and not on
the others): prints `agreed` after each check that passes, or the
RuntimeError's message and exits with status 3.
"""

import os
import sys


os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from eqxscan import distributed  # noqa: E402


def _array(width: int, pid: int) -> jax.Array:
    if width >= 0:
        return jnp.zeros((width, 4))
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    spec = P("x") if pid == 0 else P()  # as `shard` with another min_size
    zeros = np.zeros((4, 4), np.float32)
    return jax.make_array_from_callback(
        zeros.shape, NamedSharding(mesh, spec), lambda index: zeros[index]
    )


def main() -> int:
    pid, count, port, width = (int(a) for a in sys.argv[1:5])
    try:
        distributed.initialize(f"127.0.0.1:{port}", count, pid, timeout=60)
        distributed.check_same_job({"w": jnp.zeros((4, 4))})
        print("agreed", flush=True)
        distributed.check_same_job({"w": _array(width, pid)})
    except RuntimeError as e:
        print(f"RuntimeError: {e}", flush=True)
        # The job is broken: skip JAX's exit-time shutdown barrier, which would
        # wait (up to its timeout) for a peer that may already be gone.
        os._exit(3)
    print("agreed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
