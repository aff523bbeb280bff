"""`eqxscan.save` and `eqxscan.load`: safetensors, the one format eqxscan writes.

The `.npz` checkpoints of earlier versions still load, read-only and with a
`DeprecationWarning` naming the replacement, so that they can be saved again.
"""

import os
import warnings
from typing import TypeVar

import jax
import numpy as np
from jaxtyping import PyTree

from .._internal import check_path, describe, is_arraylike
from ._npz import open_npz, read_npz
from ._safetensors import load_safetensors, read_safetensors, save_safetensors
from ._state_dict import from_state_dict


T = TypeVar("T")
_ZIP = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first bytes (an empty zip's too)


def _is_npz(path: str) -> bool:
    if path.endswith(".npz"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) in _ZIP
    except OSError:  # a directory, or no such file: safetensors says which
        return False


def _deprecated(path: str, what: str) -> None:
    warnings.warn(
        f"{what}: {path!r} is an .npz checkpoint of an earlier eqxscan version; "
        "reading .npz is deprecated and eqxscan no longer writes it.\nHint: save "
        "the loaded model again with eqxscan.save_safetensors (or eqxscan.save, "
        "which writes safetensors), e.g. to 'model.safetensors'.",
        DeprecationWarning,
        stacklevel=3,
    )


def save(path: str | os.PathLike, model: PyTree) -> list[str]:
    """Save `model`'s arrays as safetensors: the same as
    [`eqxscan.save_safetensors`][]`(path, model)`.

    **Arguments:**

    - `path`: a `.safetensors` file, or a directory (then `model.safetensors`
      in it).
    - `model`: any model that [`eqxscan.to_state_dict`][] accepts.

    **Returns:**

    The paths written.
    """
    path = check_path("save: path", path)
    if path.endswith(".npz"):
        raise ValueError(
            f"save: path {path!r} names an .npz file, and eqxscan writes safetensors "
            "only (.npz checkpoints of earlier versions still load, read-only).\n"
            "Hint: save to 'model.safetensors' (or a directory) instead."
        )
    return save_safetensors(path, model)


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read the state dict of a file written by [`eqxscan.save`][]: as
    [`eqxscan.read_safetensors`][], or, for an `.npz` of an earlier version,
    with a `DeprecationWarning` (its original dtypes, bfloat16 included, each
    array checked against its digest).

    **Arguments:**

    - `path`: a safetensors file or directory, or an earlier version's `.npz`.

    **Returns:**

    A `dict[str, numpy.ndarray]`, as [`eqxscan.to_state_dict`][] made it.

    **Raises:**

    `FileNotFoundError` if there is no such file;
    [`eqxscan.checkpoint.CorruptFileError`][] naming the file (and the member
    or array) if it is truncated or its sizes or digests disagree with its
    arrays; `ValueError` if it is another program's file.
    """
    path = check_path("load_state_dict: path", path)
    if _is_npz(path):
        _deprecated(path, "load_state_dict")
        return read_npz(path)
    return read_safetensors(path)


def load(path: str | os.PathLike, like: T) -> T:
    """Load a file written by [`eqxscan.save`][] into a model shaped like `like`:
    as [`eqxscan.load_safetensors`][], or, for an `.npz` of an earlier version,
    with a `DeprecationWarning`.

    Names, shapes and dtypes are checked against `like` before any array is
    read, and each array against its digest as it is read.

    **Arguments:**

    - `path`: a safetensors file or directory, or an earlier version's `.npz`.
    - `like`: a model of the wanted layout (arrays or `jax.ShapeDtypeStruct`s),
      as for [`eqxscan.from_state_dict`][].

    **Returns:**

    `like` with its arrays replaced by the saved ones.

    **Raises:**

    `FileNotFoundError` if there is no such file; `ValueError` naming
    missing/unexpected keys, wrong shapes/dtypes or a different number of
    layers; [`eqxscan.checkpoint.CorruptFileError`][] naming the file (and the
    member or array) if it is corrupt.
    """
    path = check_path("load: path", path)
    if not _is_npz(path):
        return load_safetensors(path, like)
    if not any(is_arraylike(x) for x in jax.tree_util.tree_leaves(like)):
        raise TypeError(
            f"load: like must be a model of the saved layout, with arrays (or "
            f"jax.ShapeDtypeStructs) in it, got {type(like).__name__} "
            f"({describe(like)}).\nHint: pass a model built with the saved "
            "configuration, e.g. eqx.filter_eval_shape(make_model, key)."
        )
    _deprecated(path, "load")
    archive = open_npz(path)
    try:
        return from_state_dict(like, archive)
    finally:
        archive.close()
