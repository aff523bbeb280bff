"""One process of a two-process job for tests/test_faults_processes.py:
`python tests/scripts/peer_fault_job.py PROCESS_ID PORT WORK`.

Joins the job, prints `ready`, then works until it is killed or its peer dies:
`WORK` is `collective` (an allgather every 0.1 s), `host` (no collectives),
`crash` (collectives; process 1 raises an uncaught error after 20 steps),
`finish` (10 collectives, then returns) or `shutdown` (10 collectives, then
`jax.distributed.shutdown()` and host work for longer than the heartbeat timeout).
Last, after JAX's own exit handler, it prints how many of eqxscan's watch
threads are still alive.
"""

import atexit
import os
import sys
import threading
import time


def _watch_threads_at_exit() -> None:
    # Registered before JAX is imported, so it runs after JAX's exit handler.
    alive = [t for t in threading.enumerate() if t.name == "eqxscan-peers"]
    print(f"watch threads at exit: {len(alive)}", flush=True)


atexit.register(_watch_threads_at_exit)
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
        if work in ("finish", "shutdown") and step == 10:
            break
        if work == "crash" and pid == 1 and step == 20:
            raise RuntimeError("a bug in process 1")
        if work in ("collective", "crash"):
            total = multihost_utils.process_allgather(np.int64(step)).sum()
            assert total == 2 * step, total
        step += 1
        time.sleep(0.1)
    if work == "shutdown":
        import jax

        jax.distributed.shutdown()
        time.sleep(5)  # past heartbeat_timeout: the job has ended, nobody is lost
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
