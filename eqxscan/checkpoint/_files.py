"""Files written whole or not at all (locked temporary files beside the final
ones, the removal of those killed writers left, fsyncs of directories), and what
the readers share: lazy arrays, the error for a corrupt file, digests, lists."""

import contextlib
import hashlib
import math
import mmap
import os
import re
import secrets
import string
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .._internal import describe, docs, Lazy as Lazy, listed as listed


try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: stale files are not collected
    fcntl = None


DOCS = f"see {docs('checkpoints.md')}"
# A temporary file's name: the prefix, 8 characters of this alphabet, ".tmp".
_ALPHABET = string.ascii_lowercase + string.digits + "_"
_TOKEN = r"[a-z0-9_]{8}\.tmp"


class CorruptFileError(ValueError):
    """A checkpoint file that is truncated, changed after it was saved (an
    array no longer matches its digest), mixed with the files of another save,
    or not such a file at all. The message names the file (and the array or
    member) and ends with a hint; a `ValueError`, as before it existed."""


def shape_dtype(value: object) -> tuple[tuple[int, ...], np.dtype]:
    # Of an array, a `Lazy` or anything NumPy makes one of (a list, a number).
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        array = np.asarray(value)
        shape, dtype = array.shape, array.dtype
    # Byte order is storage, not the values: '>f4' is read as float32.
    return tuple(shape), np.dtype(dtype).newbyteorder("=")


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    # The leaves of nested mappings, by their keys joined with ".".
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def spec(shape: tuple[int, ...], dtype: DTypeLike) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"  # "float32[4, 16]"


def digest(array: np.ndarray) -> str:
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return hashlib.sha256(flat.data).hexdigest()


def differences(found: Iterable[str], listed: Iterable[str], where: str) -> str:
    # The names `listed` but not `found`, and those `found` but not listed in
    # `where` (10 of each at most); empty if none.
    missing, extra = sorted(set(listed) - set(found)), sorted(set(found) - set(listed))
    return "; ".join(
        f"{what} {', '.join(map(repr, names[:10]))}"
        for what, names in (("missing", missing), (f"not in the {where}", extra))
        if names
    )


def locked_temporary(directory: str, prefix: str) -> tuple[int, str]:
    """A new temporary file for `prefix`, locked for as long as it stays open:
    the lock tells the saves of other processes that it is not stale (the
    system releases it when its process dies, however it dies). Its mode is
    what `open` gives a new file (0644 under umask 022), not mkstemp's 0600."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        token = "".join(secrets.choice(_ALPHABET) for _ in range(8))
        tmp = os.path.join(directory, f"{prefix}{token}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:  # pragma: no cover - one in 36**8
            continue
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
    stale = re.compile(re.escape(prefix) + _TOKEN)
    for full in [os.path.join(directory, n) for n in names if stale.fullmatch(n)]:
        # An OSError: locked by a save in progress, or not ours to remove.
        with contextlib.suppress(OSError):
            fd = os.open(full, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(full).st_ino == os.fstat(fd).st_ino:
                    os.remove(full)
            finally:
                os.close(fd)


def fsync_dir(directory: str) -> None:
    # Makes renames and removals durable; not possible on every platform.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_path(name: str, path: object) -> str:
    """`os.fspath(path)`, or a `TypeError` naming `name` (e.g. `"save: path"`)
    for anything that is not a path (`None`, a number, an array)."""
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes):
        return os.fspath(path)
    raise TypeError(
        f"{name} must be a path (a str or an os.PathLike such as pathlib.Path), "
        f"got {type(path).__name__} ({describe(path)}).\nHint: pass the file or "
        "directory name, e.g. 'checkpoints/model.safetensors'."
    )


# Past this, `host_empty` maps its own pages.
_MAPPED = 1 << 20
_POSIX = hasattr(mmap, "MAP_PRIVATE")


def host_empty(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """`numpy.empty(shape, dtype)`, in pages of its own when large, which go back
    to the system when freed (glibc's heap would keep them resident)."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    if size < _MAPPED:
        return np.empty(shape, dtype)
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if _POSIX else {}
    return np.frombuffer(mmap.mmap(-1, size, **private), dtype).reshape(shape)


def cast_hint(arg: str, cast: np.dtype | None, file: bool) -> str:
    # What fits the shapes and not the dtypes, as its caller can cast.
    if cast is not None:
        return (
            f"dtype={cast.name} cast the file's floating-point arrays (the dtypes "
            f"above are after the cast); load with {arg}"
        )
    if file:
        return (
            f"the shapes fit: load with {arg}, which casts the file's "
            "floating-point arrays"
        )
    return (
        "the shapes fit: cast the arrays to the model's dtypes first (a file: "
        f"eqxscan.load_safetensors(path, like, names=..., {arg}) casts them)"
    )
