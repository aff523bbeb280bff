"""`eqxscan.save` and `eqxscan.load`: safetensors, the one format eqxscan reads
and writes."""

import os
from typing import TypeVar

import numpy as np
from jaxtyping import PyTree

from .._internal import check_like
from ._files import check_path
from ._safetensors import load_safetensors, read_safetensors, save_safetensors


T = TypeVar("T")
_ZIP = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first bytes (an empty zip's too)


def _refuse_npz(path: str, who: str) -> None:
    # An `.npz` (a zip archive): named as such, not as a corrupt safetensors file.
    try:
        with open(path, "rb") as f:
            npz = path.endswith(".npz") or f.read(4) in _ZIP
    except OSError:  # a directory, or no such file: the safetensors reader says
        return
    if npz:
        raise ValueError(
            f"{who}: {path!r} is an .npz archive, and eqxscan reads safetensors "
            "only.\nHint: an .npz of a development version's eqxscan.save loads "
            "with that version; save it again there with eqxscan.save."
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
            "only.\n"
            "Hint: save to 'model.safetensors' (or a directory) instead."
        )
    return save_safetensors(path, model)


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read the state dict of a file written by [`eqxscan.save`][]: the same as
    [`eqxscan.read_safetensors`][]`(path)` (original dtypes, bfloat16 included,
    digests checked).

    **Arguments:**

    - `path`: a safetensors file or directory.

    **Returns:**

    A `dict[str, numpy.ndarray]`, as [`eqxscan.to_state_dict`][] made it.

    **Raises:**

    `FileNotFoundError` if there is no such file;
    [`eqxscan.checkpoint.CorruptFileError`][] naming the file (and member or
    array) if it is truncated or its sizes or digests disagree with its arrays;
    `ValueError` if it is another program's file (an `.npz` included).
    """
    path = check_path("load_state_dict: path", path)
    _refuse_npz(path, "load_state_dict")
    return read_safetensors(path)


def load(path: str | os.PathLike, like: T) -> T:
    """Load a file written by [`eqxscan.save`][] into a model shaped like `like`:
    the same as [`eqxscan.load_safetensors`][]`(path, like)`. Names, shapes and
    dtypes are checked against `like` before any array is read, and each array
    against its digest as it is read.

    **Arguments:**

    - `path`: a safetensors file or directory.
    - `like`: a model of the wanted layout (arrays or `jax.ShapeDtypeStruct`s),
      as for [`eqxscan.from_state_dict`][].

    **Returns:**

    `like` with its arrays replaced by the saved ones.

    **Raises:**

    `FileNotFoundError` if there is no such file; `ValueError` naming
    missing/unexpected keys, wrong shapes/dtypes or a different number of
    layers or another program's file (an `.npz` included);
    [`eqxscan.checkpoint.CorruptFileError`][] naming the file (and the array) if
    it is corrupt.
    """
    path = check_path("load: path", path)
    check_like("load", like)
    _refuse_npz(path, "load")
    return load_safetensors(path, like)
