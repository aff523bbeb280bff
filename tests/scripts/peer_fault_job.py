"""One process of a two-process job for tests/test_faults_processes.py:
`python tests/scripts/peer_fault_job.py PROCESS_ID PORT WORK`.

Joins the job, prints `ready`, then works until it is killed or its peer dies:
`WORK` is `collective` (an allgather every 0.1 s), `host` (no collectives) or
`crash` (collectives; process 1 raises an uncaught error after 20 steps).
"""

import os
import sys
import time


os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from eqxscan import distributed  # noqa: E402


def main() -> int:
    pid, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    distributed.initialize(f"127.0.0.1:{port}", 2, pid, timeout=60, heartbeat_timeout=3)
    print("ready", flush=True)
    step = 0
    while True:
        if work == "crash" and pid == 1 and step == 20:
            raise RuntimeError("a bug in process 1")
        if work in ("collective", "crash"):
            total = multihost_utils.process_allgather(np.int64(step)).sum()
            assert total == 2 * step, total
        step += 1
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
