"""Single-file checkpoints: an `.npz` of the per-layer state dict, written atomically.

Why an `.npz` of [`eqxscan.to_state_dict`][] rather than
`eqx.tree_serialise_leaves`: the latter stores leaves by position, so a model of
another depth or layout either fails with an unnamed size error or, worse, loads
shifted weights. A named archive lets `load` say which keys are missing or
unexpected and which depths differ, and it can be read by NumPy (or PyTorch)
without eqxscan or the model's class. `.npy` cannot name bfloat16 and other
ML dtypes, so the archive also stores each array's dtype name in a small
manifest entry.
"""

import json
import os
import tempfile
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._state_dict import from_state_dict, to_state_dict


_MANIFEST = "__eqxscan_dtypes__"


def save(path: str | os.PathLike, model: Any) -> None:
    """Save `model`'s arrays to one `.npz` file, atomically.

    The archive holds [`eqxscan.to_state_dict`][]`(model)` (per-layer names such
    as `"blocks.0.w1"`) plus a manifest of dtype names, so bfloat16 survives. It
    is written to a temporary file in the same directory, flushed and fsynced,
    then moved over `path` with `os.replace`: a crash or error mid-write leaves
    any previous file at `path` intact and no temporary file behind.

    **Arguments:**

    - `path`: the file to write (used as given; `.npz` is a good suffix).
    - `model`: any model that [`eqxscan.to_state_dict`][] accepts.
    """
    path = os.fspath(path)
    arrays = to_state_dict(model)
    if _MANIFEST in arrays:
        raise ValueError(f"'{_MANIFEST}' is reserved and cannot name a model array.")
    manifest = json.dumps({k: v.dtype.name for k, v in arrays.items()})
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        # Otherwise the error names the temporary file, not the one asked for.
        raise FileNotFoundError(
            f"Cannot save to {path!r}: its directory {directory!r} does not exist."
        )
    fd, tmp = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays, **{_MANIFEST: np.array(manifest)})
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable; not possible on every platform.
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


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read the state dict of a file written by [`eqxscan.save`][], with the
    original dtypes (bfloat16 included).

    **Arguments:**

    - `path`: the checkpoint file.

    **Returns:**

    A `dict[str, numpy.ndarray]`, as [`eqxscan.to_state_dict`][] made it.
    """
    path = os.fspath(path)
    try:
        archive = np.load(path, allow_pickle=False)
    except ValueError as e:  # NumPy's message speaks of pickles and allow_pickle
        raise ValueError(
            f"{path!r} is not a checkpoint written by eqxscan.save (an .npz "
            f"archive of arrays): {e}"
        ) from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(
            f"{path!r} holds a single .npy array, not a checkpoint written by "
            "eqxscan.save (an .npz archive of arrays)."
        )
    with archive:
        arrays = {k: archive[k] for k in archive.files}
    manifest = json.loads(str(arrays.pop(_MANIFEST, np.array("{}"))))
    for name, dtype_name in manifest.items():
        if name in arrays and arrays[name].dtype.name != dtype_name:
            arrays[name] = arrays[name].view(jnp.dtype(dtype_name))
    return arrays


def load(path: str | os.PathLike, like: Any) -> Any:
    """Load a file written by [`eqxscan.save`][] into a model shaped like `like`.

    **Arguments:**

    - `path`: the checkpoint file.
    - `like`: a model of the wanted layout (arrays or `jax.ShapeDtypeStruct`s),
      as for [`eqxscan.from_state_dict`][].

    **Returns:**

    `like` with its arrays replaced by the saved ones.

    **Raises:**

    `ValueError` naming missing/unexpected keys, wrong shapes/dtypes or a
    different number of layers.
    """
    return from_state_dict(like, load_state_dict(path))
