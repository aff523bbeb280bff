"""Asynchronous saves still being written when the program ends: finished
before Python shuts down the thread pools Orbax writes with, so that a step
`save` accepted is on disk (it was lost, the process exiting with status 0)."""

import atexit
import os
import sys
import threading
from typing import Protocol, runtime_checkable

import jax


@runtime_checkable
class _Saving(Protocol):
    directory: str

    def wait(self) -> None: ...


_IN_FLIGHT: dict[int, _Saving] = {}  # held here until their saves have landed
_registered = False


def flying(manager: _Saving) -> bool:
    """Finish `manager`'s saves at exit; `False` if the program is exiting
    already (its caller waits then)."""
    global _registered
    if not _registered:
        # Hooks registered so run before the thread pools' own exit hook (which
        # makes them refuse new work), last registered first; `atexit`'s run
        # after it (a Python without this private hook: too late, but tried).
        register = getattr(threading, "_register_atexit", atexit.register)
        try:
            register(_finish)
        except RuntimeError:  # "can't register atexit after shutdown"
            return False
        _registered = True
    _IN_FLIGHT[id(manager)] = manager
    return True


def landed(manager: _Saving) -> None:
    _IN_FLIGHT.pop(id(manager), None)


def _finish() -> None:
    failed = False
    for manager in list(_IN_FLIGHT.values()):
        try:
            manager.wait()
        except Exception as e:
            failed = True
            sys.stderr.write(
                f"eqxscan.checkpoint: at exit, a save still being written failed: "
                f"{type(e).__name__}: {e}\n"
            )
    if failed and jax.process_count() == 1:
        # Status 1, not the 0 of a program that returned: its last save is
        # lost. (Not in a job of several processes: it would skip the job's
        # exit barrier, and the others would wait for it.)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
