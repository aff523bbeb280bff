"""Several processes, one program: joining JAX's multi-controller runtime,
watching the other processes, checking they run the same job, and each one's
rows of a global batch. JAX does the communication (`jax.distributed.initialize`
connects the processes, `jit` over a mesh spanning them runs the collectives)."""

import atexit
import contextlib
import hashlib
import itertools
import math
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._internal import (
    check_mesh,
    check_size,
    Checked,
    distributed_client,
    docs,
    is_arraylike,
)


DOCS = f"see {docs('multihost.md')}"
_ALIVE = "eqxscan/alive/{}"  # the key of process i's heartbeat


def _exit_with(message: str) -> None:
    # Runs on a watchdog thread while the main thread is blocked inside JAX's
    # connect call, which cannot be interrupted and aborts the process on its own
    # timeout; so this reports first and ends the process itself.
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(1)


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"initialize: {name} must be a number of seconds, got "
            f"{type(value).__name__} ({value!r})."
        )
    if not 0 < value < 1e6:  # also refuses NaN
        raise ValueError(
            f"initialize: {name} must be a positive number of seconds, got {value!r}."
        )
    return float(value)


class _PeerWatch:
    """Every process bumps a counter in JAX's key-value store; one whose counter
    stands still for `timeout` seconds (the coordinator: whose store cannot be
    reached) is dead, and this process names it and exits, where JAX's own
    heartbeat would abort naming no process."""

    def __init__(self, client: Any, timeout: float):
        self.client, self.timeout = client, timeout
        self.me, count = jax.process_index(), jax.process_count()
        self.where = f"process {self.me} of {count}"
        self.interval = min(1.0, timeout / 4)
        now = time.monotonic()
        self.seen = {i: ("", now) for i in range(count) if i != self.me}
        self.reached = now  # when the store last answered
        self.exiting, self.crash = False, ""
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=target, daemon=True, name="eqxscan-peers")
            for target in (self._beat, self._judge)
        ]
        for thread in self.threads:
            thread.start()
        atexit.register(self._leave)
        # An uncaught exception, told the others at once (exit handlers may
        # close the collectives first): else they take it for a process that
        # left, and wait in a collective that cannot complete.
        hook = sys.excepthook

        def crashed(kind: type[BaseException], e: BaseException, tb: Any) -> None:
            self.crash = kind.__name__
            with contextlib.suppress(Exception):
                state = f"crashed:{self.crash}"
                self.client.key_value_set(_ALIVE.format(self.me), state, True)
            hook(kind, e, tb)

        sys.excepthook = crashed

    def _watching(self) -> bool:
        # The job ends at JAX's shutdown, called by the user or by `_leave`:
        # the store is gone then, and silence is no longer a sign of death.
        return not self.stop.is_set() and jax.distributed.is_initialized()

    def _beat(self) -> None:
        for beat in itertools.count(1):
            if not self._watching():
                return
            # If the store cannot be reached, `_judge` decides. Once this
            # process has left or crashed, its state stands in for the counter.
            with contextlib.suppress(Exception):
                if not (self.exiting or self.crash):
                    self.client.key_value_set(_ALIVE.format(self.me), str(beat), True)
                    self.reached = time.monotonic()
            for i in self.seen:
                try:
                    value = self.client.key_value_try_get(_ALIVE.format(i))
                except Exception:
                    continue  # not written yet, or the store is gone
                if value != self.seen[i][0]:
                    self.seen[i] = (value, time.monotonic())
            self.stop.wait(self.interval)

    def _judge(self) -> None:
        while not self.stop.wait(self.interval):
            if not self._watching():
                return
            now = time.monotonic()
            for i, (value, since) in list(self.seen.items()):
                if value.startswith("crashed"):
                    self._lost(i, 0.0, f"it crashed ({value.partition(':')[2]})")
                if value != "left" and now - since > self.timeout:
                    self._lost(i, now - since)
            if not self.exiting and now - self.reached > self.timeout:
                self._lost(0, now - self.reached)  # the store is process 0's

    def _lost(self, dead: int, silent: float, why: str = "") -> None:
        what = f"process {dead}" + (" (the coordinator)" if dead == 0 else "")
        why = why or (
            f"it has shown no sign of life for {silent:.0f} s "
            f"(heartbeat_timeout={self.timeout:g}), so it stopped or crashed"
        )
        _exit_with(
            f"eqxscan.distributed: {self.where} lost {what}: {why}; this process "
            f"exits.\nHint: see the log of process {dead} for why it stopped, "
            f"then restart the job from its last checkpoint; {DOCS}."
        )

    def _leave(self) -> None:
        # Before JAX's own exit handler (registered earlier, so it runs later):
        # a process that ends is not taken for a dead one by the others.
        self.exiting = True
        if not jax.distributed.is_initialized():  # the user ended the job
            self._stop()
            return
        state = f"crashed:{self.crash}" if self.crash else "left"
        try:
            self.client.key_value_set(_ALIVE.format(self.me), state, True)
        except Exception:
            if self.me != 0:  # the store, on process 0, is gone already
                self._lost(0, time.monotonic() - self.reached)
        if self.crash:
            self._end_crashed()
        # JAX's exit barrier, here rather than in its exit handler (which then
        # has nothing to do), so that the watch goes on through it and is
        # stopped after it: a thread still inside a call into JAX's client when
        # the interpreter finalizes aborts the process ("FATAL: exception not
        # rethrown", status 134).
        try:
            jax.distributed.shutdown()
        finally:
            self._stop()

    def _stop(self) -> None:
        self.stop.set()
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(timeout=10 * self.interval + 5)

    def _end_crashed(self) -> None:
        # Not JAX's exit barrier, which would wait shutdown_timeout for the
        # others: they stop once they have read the state. A peer gone quiet
        # (whose death may have failed this one's collective) is named first,
        # by `_judge`, once `timeout` has passed.
        end = time.monotonic() + 3 * self.interval
        while time.monotonic() < end:
            time.sleep(self.interval)
            for value, since in list(self.seen.values()):
                if value != "left" and time.monotonic() - since > 2 * self.interval:
                    end = max(end, since + self.timeout + 2 * self.interval)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: float | int = 300,
    heartbeat_timeout: float | int = 60,
    shutdown_timeout: float | int = 300,
) -> None:
    """Join this process to a multi-process JAX job (`jax.distributed.initialize`),
    failing with a clear message if the job does not form within `timeout` seconds.

    Call it once per process, before any other JAX call. With no arguments, JAX
    detects the cluster: SLURM, Open MPI, MPI via `mpi4py`, Kubernetes (an
    indexed Job or JobSet; needs `jax[k8s]`), Cloud TPU VMs and pods. Otherwise
    give all three arguments; process 0 also runs the coordinator, listening on
    the port of `coordinator_address`. CPU collectives use gloo.

    If not all `num_processes` processes join within `timeout` seconds (one was
    not started, or cannot reach the coordinator), this function reports on
    standard error which process waited for what and how long, and exits with
    status 1, where JAX's runtime would abort. Once the job has formed, when a
    process shows no sign of life for `heartbeat_timeout` seconds (it crashed,
    was killed, or its machine went away), every other one reports on standard
    error which process it lost and exits with status 1, rather than waiting in
    a collective that cannot complete; a process that ends on an uncaught
    exception tells them at once. (Process 0 runs JAX's coordination
    service: when it ends, JAX's runtime ends the others at once.)

    **Arguments:**

    - `coordinator_address`: `"host:port"` of process 0, reachable from all.
    - `num_processes`: the number of processes in the job.
    - `process_id`: this process's index, `0 <= process_id < num_processes`.
    - `timeout`: seconds to wait for every process to join.
    - `heartbeat_timeout`: seconds of silence after which a process is dead.
    - `shutdown_timeout`: seconds a process waits at exit for the others.
    """
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "initialize was called before in this process, which is in a job "
            f"already.\nHint: call it once per process, before any other JAX call; "
            f"{DOCS}."
        )
    where = _check_job(coordinator_address, num_processes, process_id)
    timeout = _check_seconds("timeout", timeout)
    heartbeat_timeout = _check_seconds("heartbeat_timeout", heartbeat_timeout)
    shutdown_timeout = _check_seconds("shutdown_timeout", shutdown_timeout)
    # The default in recent JAX; older versions have no CPU collectives without it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    args = (coordinator_address, num_processes, process_id)
    _join(where, args, timeout, heartbeat_timeout, shutdown_timeout)
    shown = "" if num_processes is None else f"num_processes={num_processes}"
    _agree("process count", num_processes or jax.process_count(), shown)
    if jax.process_count() == 1:
        return
    client = distributed_client()
    if client is None:
        warnings.warn(
            f"eqxscan.distributed.initialize: JAX {jax.__version__} has no "
            "key-value store client where eqxscan looks for it, so a process "
            "that stops is not reported by name; JAX's own heartbeat ends the "
            f"others later.\nHint: use a JAX version eqxscan supports; {DOCS}.",
            RuntimeWarning,
            stacklevel=2,
        )
    else:
        _PeerWatch(client, heartbeat_timeout)


def _check_job(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> str:
    """All three given or none, `process_id` in range; who this process is, in
    words. JAX's runtime crashes the process on a malformed address, and on
    process 0 (which listens on its port, on every interface) if it is taken."""
    given = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in given) and any(v is None for v in given):
        raise ValueError(
            "Give coordinator_address, num_processes and process_id together (got "
            f"{coordinator_address!r}, {num_processes!r}, {process_id!r}).\nHint: "
            f"or give none of them, to let JAX detect the cluster; {DOCS}."
        )
    if num_processes is None or process_id is None:
        return "this process (cluster detected by JAX)"
    num_processes = check_size("num_processes", num_processes)
    process_id = check_size("process_id", process_id, minimum=0)
    host, _, port = (
        coordinator_address.rpartition(":")
        if isinstance(coordinator_address, str)
        else ("", "", "")
    )
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"coordinator_address must be 'host:port' with a port in 1..65535, got "
            f"{coordinator_address!r}.\nHint: e.g. '10.0.0.1:1234' (process 0's "
            f"address and a free port); {DOCS}."
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} is outside 0..{num_processes - 1} for "
            f"num_processes={num_processes}.\nHint: number the processes "
            f"from 0; {DOCS}."
        )
    if process_id == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", int(port)))
            except OSError as e:
                raise RuntimeError(
                    f"process 0 cannot listen on port {int(port)} of "
                    f"coordinator_address {coordinator_address!r}: {e.strerror}.\n"
                    "Hint: choose a free port above 1023 (another program, or an "
                    f"earlier run, may hold this one); {DOCS}."
                ) from None
    return (
        f"process {process_id} of {num_processes} (coordinator {coordinator_address})"
    )


def _join(
    where: str, args: tuple, timeout: float, heartbeat: float, shutdown: float
) -> None:
    """`jax.distributed.initialize(*args)`, reported by a watchdog if the job has
    not formed within `timeout` seconds."""
    start = time.monotonic()
    message = (
        f"eqxscan.distributed.initialize: {where} waited {timeout:g} s for all "
        "processes to join the job, and not all did.\n"
        "Hint: start every process with the same coordinator address and "
        "process count, check process 0 is running and its port is reachable, "
        f"or raise timeout; {DOCS}."
    )
    watchdog = threading.Timer(timeout, _exit_with, (message,))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            *args,
            # JAX's own limit comes later, so that the watchdog speaks first.
            initialization_timeout=int(timeout) + 30,
            # JAX's heartbeat ends a survivor with an abort naming no process:
            # later than the watch below, which names it.
            heartbeat_timeout_seconds=int(2 * heartbeat) + 10,
            shutdown_timeout_seconds=max(1, round(shutdown)),
        )
    except Exception as e:
        raise RuntimeError(
            f"{where} could not join the job after "
            f"{time.monotonic() - start:.1f} s: {e}\nHint: check the coordinator "
            f"address and process count; {DOCS}."
        ) from e
    finally:
        watchdog.cancel()


def _agree(what: str, value: object, shown: str = "") -> None:
    """Every process holds the same `value`, or every process raises, naming the
    processes that differ (one allgather over every process's devices)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    # 62 bits of its text's digest, so that it fits an int64 in any collective.
    digest = hashlib.sha256(str(value).encode()).digest()[:8]
    fingerprint = np.int64(int.from_bytes(digest, "big") >> 2)
    values = [int(v) for v in multihost_utils.process_allgather(fingerprint)]
    if len(set(values)) == 1:
        return
    mine = jax.process_index()
    others = [i for i, v in enumerate(values) if v != values[mine]]
    detail = f" ({shown})" if shown else ""
    raise RuntimeError(
        f"The processes of this job disagree on the {what}: process {mine}"
        f"{detail} differs from process(es) {others}.\nHint: start every process "
        f"of one job with the same arguments and model; {DOCS}."
    )


def check_same_job(*trees: Any, mesh: Mesh | None = None) -> None:
    """Check that every process of a multi-process job holds the same model
    structure (tree structure, shapes and dtypes of `trees`, not values) and the
    same `mesh`: a mismatch would otherwise surface as a hang or a wrong result
    in the first collective. On one process this does nothing.

    **Arguments:**

    - `trees`: the model, optimiser state, or anything whose layout must match
      (with the partition spec of each array placed on a mesh).
    - `mesh`: the mesh (axis names, shape and device ids are compared).

    **Raises:**

    `RuntimeError` on every process, naming the processes that differ.
    """
    leaves, treedef = jtu.tree_flatten(trees)
    layout = [str(treedef)] + [
        f"{tuple(x.shape)}:{x.dtype}{_spec(x)}" if is_arraylike(x) else repr(type(x))
        for x in leaves
    ]
    _agree("model layout", "\n".join(layout))
    if mesh is not None:
        _agree("mesh", f"{dict(mesh.shape)} {[d.id for d in mesh.devices.flat]}")


def _spec(x: object) -> str:
    # How an array is split over the mesh: arrays placed alike on one process
    # and otherwise on another (`shard`'s `min_size`) hang the first collective.
    sharding = getattr(x, "sharding", None)
    return f" {sharding.spec}" if isinstance(sharding, NamedSharding) else ""


def local_rows(
    rows: Checked[int],
    mesh: Checked[Mesh],
    *,
    batch_axes: str | Sequence[str] = ("data", "fsdp"),
) -> slice:
    """The rows of a global batch of `rows` examples that this process feeds to
    [`eqxscan.sharding.shard`][] (`batch=`), for a batch split over `batch_axes`:
    for when every process can produce the global batch (e.g. from a seed), so
    that a run gives the same result on any topology.

    **Arguments:**

    - `rows`: the global batch size.
    - `mesh`: the mesh the batch is placed on.
    - `batch_axes`: the mesh axes the batch is split over (the default of
      `shard` on a `("data", "fsdp")` mesh).

    **Returns:**

    A `slice` of `range(rows)`.
    """
    # A negative count sliced rows off the end; a float, a bool or an array
    # went through as a slice's bound.
    rows = check_size("local_rows: rows", rows, minimum=0)
    mesh = check_mesh(mesh)
    given = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    axes = tuple(a for a in given if a in mesh.shape)
    if axes != given and given != ("data", "fsdp"):  # the default may miss some
        raise ValueError(
            f"local_rows: batch_axes {given} names mesh axes the mesh lacks; it has "
            f"{tuple(mesh.axis_names)}.\nHint: name the axes the batch is split "
            f"over, as passed to sharding.shard; {DOCS}."
        )
    total = math.prod(mesh.shape[a] for a in axes)
    if rows % total:
        raise ValueError(
            f"A batch of {rows} rows cannot be split over mesh axes {axes} "
            f"(total size {total}) of mesh {dict(mesh.shape)}.\nHint: use a "
            f"multiple of {total} rows; {DOCS}."
        )
    spec = PartitionSpec(axes if len(axes) > 1 else axes[0] if axes else None)
    # The rows each of this process's devices holds.
    indices = NamedSharding(mesh, spec).addressable_devices_indices_map((rows,))
    blocks = [index[0] for index in indices.values() if index is not None]
    starts = sorted({b.start or 0 for b in blocks})
    stops = sorted({rows if b.stop is None else b.stop for b in blocks})
    start, stop = starts[0], stops[-1]
    size = sum(b - a for a, b in zip(starts, stops))
    if size != stop - start:
        raise ValueError(
            f"The rows of process {jax.process_index()} are not contiguous in "
            f"a batch split over {axes} of mesh {dict(mesh.shape)}.\nHint: order "
            f"the mesh's devices by process, as make_mesh does; {DOCS}."
        )
    return slice(start, stop)
