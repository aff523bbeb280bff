"""Files written whole or not at all: locked temporary files beside the final
ones (created with the mode the umask allows, as `open` would), the removal of
those that killed writers left behind, and fsyncs of directories."""

import os
import re
import tempfile
import threading


try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: stale files are not collected
    fcntl = None


# mkstemp's names: the prefix, 8 characters of this alphabet, the suffix.
_TOKEN = re.compile(r"[a-z0-9_]{8}")
_UMASK = threading.Lock()


class CorruptFileError(ValueError):
    """A checkpoint file that is truncated, changed after it was saved (an
    array no longer matches its digest), mixed with the files of another save,
    or not such a file at all. The message names the file (and the array or
    member) and ends with a hint; a `ValueError`, so code that caught those
    still does.
    """


def _umask() -> int:
    # Linux says it without changing it; elsewhere, set and restore it (under a
    # lock, as no other thread of eqxscan creates files meanwhile).
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def locked_temporary(directory: str, prefix: str) -> tuple[int, str]:
    """A new temporary file for `prefix`, locked for as long as it stays open:
    the lock tells the saves of other processes that it is not stale (the
    system releases it when its process dies, however it dies). Its mode is
    what `open` gives a new file (0644 under umask 022), not mkstemp's 0600."""
    while True:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".tmp")
        try:
            os.fchmod(fd, 0o666 & ~_umask())
        except OSError:  # pragma: no cover - a file system without modes
            pass
        if fcntl is None:  # pragma: no cover
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            return fd, tmp
        # Another save took it for stale in the instant before it was locked.
        os.close(fd)


def remove_stale(directory: str, prefix: str) -> None:
    """Remove the temporary files of killed saves to the same path: those named
    as `locked_temporary` names them that no living save holds locked."""
    if fcntl is None:  # pragma: no cover
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (
            name.startswith(prefix)
            and name.endswith(".tmp")
            and _TOKEN.fullmatch(name[len(prefix) : -len(".tmp")])
        ):
            continue
        full = os.path.join(directory, name)
        try:
            fd = os.open(full, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(full).st_ino == os.fstat(fd).st_ino:
                os.remove(full)
        except OSError:
            pass  # locked by a save in progress, or not ours to remove
        finally:
            os.close(fd)


def fsync_dir(directory: str) -> None:
    # Makes renames and removals durable; not possible on every platform.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
