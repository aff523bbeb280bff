"""`eqxscan.save` and `eqxscan.load`: safetensors, the one format eqxscan writes;
the `.npz` files of earlier versions still load, with a `DeprecationWarning`."""

import os
import warnings
from typing import TypeVar

import numpy as np
from jaxtyping import PyTree

from .._internal import check_like, check_path
from ._files import CorruptFileError
from ._npz import NpzArchive
from ._safetensors import load_safetensors, read_safetensors, save_safetensors
from ._state_dict import from_state_dict


T = TypeVar("T")
_ZIP = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first bytes (an empty zip's too)


def _npz(path: str, who: str) -> NpzArchive | None:
    # The `.npz` archive at `path` (with a `DeprecationWarning`), or `None`.
    try:
        with open(path, "rb") as f:
            npz = path.endswith(".npz") or f.read(4) in _ZIP
    except OSError:  # a directory, or no such file: the readers say which
        npz = path.endswith(".npz")
    if not npz:
        return None
    warnings.warn(
        f"{who}: {path!r} is an .npz checkpoint of an earlier eqxscan version; "
        "reading .npz is deprecated and eqxscan no longer writes it.\nHint: save "
        "the loaded model again with eqxscan.save_safetensors (or eqxscan.save, "
        "which writes safetensors), e.g. to 'model.safetensors'.",
        DeprecationWarning,
        stacklevel=3,
    )
    return NpzArchive(path)


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
    [`eqxscan.read_safetensors`][], or, for an earlier version's `.npz`, with a
    `DeprecationWarning` (original dtypes, bfloat16 included, digests checked).

    **Arguments:**

    - `path`: a safetensors file or directory, or an earlier version's `.npz`.

    **Returns:**

    A `dict[str, numpy.ndarray]`, as [`eqxscan.to_state_dict`][] made it.

    **Raises:**

    `FileNotFoundError` if there is no such file;
    [`eqxscan.checkpoint.CorruptFileError`][] naming the file (and member or
    array) if it is truncated or its sizes or digests disagree with its arrays;
    `ValueError` if it is another program's file.
    """
    path = check_path("load_state_dict: path", path)
    archive = _npz(path, "load_state_dict")
    if archive is None:
        return read_safetensors(path)
    with archive:
        return {name: archive.read(name) for name in archive.entries}


def load(path: str | os.PathLike, like: T) -> T:
    """Load a file written by [`eqxscan.save`][] into a model shaped like `like`:
    as [`eqxscan.load_safetensors`][], or, for an earlier version's `.npz`, with
    a `DeprecationWarning`. Names, shapes and dtypes are checked against `like`
    before any array is read, and each array against its digest as it is read.

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
    check_like("load", like)
    archive = _npz(path, "load")
    if archive is None:
        return load_safetensors(path, like)
    with archive:
        try:
            return from_state_dict(like, archive.arrays)
        except CorruptFileError:
            raise
        except ValueError as e:  # as load_safetensors's: naming the file
            first = str(e).splitlines()[0]
            raise ValueError(
                f"{path!r} does not fit the model: {first}\nHint: build like with "
                "the saved model's configuration (depth, sizes, dtypes)."
            ) from None
