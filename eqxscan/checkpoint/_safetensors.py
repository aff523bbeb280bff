"""safetensors files of a model's per-layer state dict: one file, or shards with
Hugging Face's index JSON, through the `safetensors` package's NumPy API.

Each shard gathers only its own layer slices, so a model is never held twice in
host memory. A save killed at any instant leaves the old checkpoint or the new
one (see `_commit_shards`). Each file's metadata holds the SHA-256 digest,
dtype and shape of each array and a token of the save, which the index
repeats: loading checks them, refusing a flipped bit, a header that lies about
an array, or a shard of another save.
"""

import contextlib
import errno
import functools
import json
import os
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple, TypeVar

import jax
import numpy as np
from jaxtyping import PyTree
from numpy.typing import DTypeLike

from .._internal import check_like, docs, parse_bytes
from ._files import (
    check_path,
    CorruptFileError,
    digest,
    fsync_dir,
    Lazy,
    listed,
    locked_temporary,
    remove_stale,
    spec,
)
from ._names import _LAYOUTS, NameMap
from ._records import check_records, records_metadata, saved_weak, weak_metadata
from ._safetensors_read import (
    _DIGESTS,
    _DTYPES,
    _Files,
    _package,
    _SPECS,
    _TOKEN,
    INDEX,
    SINGLE,
)
from ._state_dict import host_entries, load_state_dict_into


T = TypeVar("T")
_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
# A new shard under the name of its save, until its index replaces the old one.
_STAGED = re.compile(r"model-(\d{5})-of-(\d{5})\.[0-9a-f]{16}\.safetensors")
# What a safetensors file can hold.
_KINDS = {np.dtype(jax.numpy.dtype(name)) for name in _DTYPES.values()}


@functools.cache
def _writes(dtype: np.dtype) -> bool:
    # The format's dtypes that the installed package writes (older ones lack
    # complex64 and float8).
    if dtype not in _KINDS:
        return False
    try:
        _package().numpy.save({"a": np.zeros(1, dtype)})
    except Exception:  # the package's own error class differs across versions
        return False
    return True


def _size(max_shard_size: int | str | None) -> int | None:
    if max_shard_size is None:
        return None
    # At least 1 byte: "0" or "0.1" would give each array a file of its own.
    try:
        return parse_bytes(
            "" if isinstance(max_shard_size, bool) else str(max_shard_size)
        )
    except ValueError:
        raise ValueError(
            f"max_shard_size must be a number of bytes (at least 1) or a size such "
            f"as '5GB' or '500MiB', got {max_shard_size!r}."
        ) from None


def _shards(
    entries: Sequence[tuple[str, Lazy]], max_size: int | None
) -> list[list[tuple[str, Lazy]]]:
    # Consecutive entries in files of at most `max_size` bytes (a larger array
    # gets a file of its own), as Hugging Face does.
    shards: list[list[tuple[str, Lazy]]] = [[]]
    size = 0
    for name, lazy in entries:
        nbytes = int(np.prod(lazy.shape, dtype=np.int64)) * lazy.dtype.itemsize
        if max_size is not None and shards[-1] and size + nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append((name, lazy))
        size += nbytes
    return shards


def save_safetensors(
    path: str | os.PathLike,
    model: PyTree,
    *,
    names: NameMap | None = None,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Save `model`'s per-layer state dict as safetensors: one file, or a
    directory as Hugging Face lays it out.

    A `path` ending in `.safetensors` is one file. Otherwise it is a directory
    (made if absent): `model.safetensors`, or, past `max_shard_size`,
    `model-00001-of-0000N.safetensors` files and `model.safetensors.index.json`
    (`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`). Each
    layer's slice is taken as its file is written, so the model is never copied
    whole; bfloat16 stays bfloat16. Files are written to temporary files and
    moved into place once all are written: an error mid-save leaves the
    previous files intact.

    **Arguments:**

    - `path`: a `.safetensors` file, or a directory.
    - `model`: any model that [`eqxscan.to_state_dict`][] accepts.
    - `names`: a [`eqxscan.checkpoint.NameMap`][] to write another convention's
      names (e.g. Hugging Face's); by default eqxscan's own.
    - `max_shard_size`: bytes per file (an int, or `"5GB"`, `"500MiB"`); only
      with a directory.
    - `metadata`: extra string entries for each file's metadata (`format`
      defaults to the name map's, or `"pt"`; with `names`, only the map's).
      Each file also records, under `"eqxscan.records"`, what the arrays do not
      hold: each [`eqxscan.adapters.LoRA`][]'s `alpha`, which loading checks.

    **Returns:**

    The paths written, the index last.
    """
    path = check_path("save_safetensors: path", path)
    if not path:
        raise ValueError(
            "save_safetensors: path is empty.\nHint: pass a .safetensors file or "
            "a directory, e.g. 'checkpoints/model.safetensors'."
        )
    max_size = _size(max_shard_size)
    single = path.endswith(".safetensors")
    if single and max_size is not None:
        raise ValueError(
            f"save_safetensors: max_shard_size needs a directory, but {path!r} "
            "names one .safetensors file.\nHint: pass the directory to write "
            "model-00001-of-0000N.safetensors files into."
        )
    entries = host_entries(model, "save_safetensors", sliced=True)
    external = entries if names is None else names.plan_export(entries)
    if bad := [f"'{k}' {x.dtype.name}" for k, x in external if not _writes(x.dtype)]:
        raise TypeError(
            f"save_safetensors: safetensors {_package().__version__} has no dtype "
            f"for {listed(bad, ', ')}.\nHint: cast them (to int8, bfloat16, ...), "
            "or save quantized models with eqxscan.quant.save, which packs 4-bit "
            "values two a byte."
        )
    info = {
        "format": "pt" if names is None else names.format,
        **records_metadata(model),
        **weak_metadata(model),
        **(metadata or {}),
    }
    if names is not None and info["format"] != names.format:
        raise ValueError(
            f"save_safetensors: metadata format {info['format']!r} is not the name "
            f"map's, {names.format!r}: loading checks a file's layout by it.\nHint: "
            "leave 'format' out of metadata, or give it to NameMap(..., format=)."
        )
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in info.items()):
        raise TypeError("save_safetensors: metadata must map strings to strings.")
    shards = _shards(external, max_size)
    # The directory to save into; one named by `path` is made if its parent exists.
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        where = f"directory {parent!r}" if single else "parent directory"
        raise FileNotFoundError(f"Cannot save to {path!r}: its {where} does not exist.")
    directory = parent if single else path
    if not single and os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(
            errno.EEXIST,
            f"Cannot save to {path!r}: it is a file, and a path not ending in "
            ".safetensors names a directory to save into.\nHint: pass a path "
            "ending in .safetensors for one file, or a directory.",
        )
    os.makedirs(directory, exist_ok=True)
    n = len(shards)
    bases = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    files = [os.path.join(directory, b) for b in (bases if n > 1 else [SINGLE])]
    with _Save(path, directory, info) as save:
        for file, shard in zip([path] if single else files, shards):
            save.write(file, shard)
        return save.commit(single)


class _Save:
    """The files of one save, in locked temporary files beside their final ones
    until `commit`: an error before removes them, leaving the old files."""

    def __init__(self, path: str, directory: str, info: dict[str, str]):
        self.path, self.directory = path, directory
        self.token = secrets.token_hex(8)
        self.info = {**info, _TOKEN: self.token}
        self.temporaries: list[tuple[str, str, int]] = []  # (tmp, final, locked fd)
        self.staged: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.committed = False  # set once the file, or an index of the shards, is there

    def write(self, final: str, shard: list[tuple[str, Lazy]]) -> None:
        # Not `np.ascontiguousarray`: it makes a 0-d array 1-d.
        arrays = {
            name: np.require(lazy.read(), requirements="C") for name, lazy in shard
        }
        self.weight_map |= dict.fromkeys(arrays, os.path.basename(final))
        self.total += sum(array.nbytes for array in arrays.values())
        meta = {
            **self.info,
            _DIGESTS: json.dumps({k: digest(v) for k, v in arrays.items()}),
            _SPECS: json.dumps({k: spec(v.shape, v.dtype) for k, v in arrays.items()}),
        }
        data = _package().numpy.save(arrays, metadata=meta)
        del arrays  # before the next shard's slices are gathered
        self._temporary(final, data)

    def _temporary(self, final: str, data: bytes) -> str:
        # Written through the locked descriptor: the package's `save_file`
        # replaces the file it is given with one of mode 0600, which neither
        # the lock nor the umask would cover.
        directory, base = os.path.split(final)
        remove_stale(directory, f".{base}.")
        fd, tmp = locked_temporary(directory, f".{base}.")
        self.temporaries.append((tmp, final, fd))
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        return tmp

    def commit(self, single: bool) -> list[str]:
        if len(self.temporaries) > 1:
            return self._commit_shards()
        # One file: it is in place, or it is not; a single file is read before
        # an index, so the old shards go only after it is there.
        ((tmp, final, _),) = self.temporaries
        os.replace(tmp, final)
        self.committed = True
        fsync_dir(self.directory)
        if not single:
            _remove_old(self.directory, {SINGLE}, INDEX)
        return [final]

    def _commit_shards(self) -> list[str]:
        """Put the shards and their index in place so that at every instant the
        directory holds a complete checkpoint, the old or the new: the old index
        names files of the same names as the new, so the new shards first take
        names of their own (`model-00001-of-00003.<token>.safetensors`), an index
        naming them replaces the old one, the old files go, the shards get their
        usual names (hard links), and a second index names those."""
        finals = [final for _, final, _ in self.temporaries]
        self.staged = [
            f"{final[: -len('.safetensors')]}.{self.token}.safetensors"
            for final in finals
        ]
        for (tmp, _, _), stage in zip(self.temporaries, self.staged):
            os.replace(tmp, stage)
        fsync_dir(self.directory)
        self._index(dict(zip(finals, self.staged)))
        self.committed = True
        # The new checkpoint is complete: the old one's files may go. A single
        # file is read before an index, so one left behind would keep loading:
        # failing to remove it fails the save.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.directory, SINGLE))
        _remove_old(self.directory, set(map(os.path.basename, self.staged)), SINGLE)
        index = os.path.join(self.directory, INDEX)
        try:
            for stage, final in zip(self.staged, finals):
                os.link(stage, final)
        except OSError:  # pragma: no cover - a file system without hard links
            return [*self.staged, index]
        self._index({final: final for final in finals})
        for stage in self.staged:
            os.remove(stage)
        fsync_dir(self.directory)
        return [*finals, index]

    def _index(self, files: dict[str, str]) -> None:
        # The index naming each array's file, as `files` renames it.
        names = {os.path.basename(k): os.path.basename(v) for k, v in files.items()}
        index = {
            "metadata": {"total_size": self.total, _TOKEN: self.token},
            "weight_map": {k: names[v] for k, v in self.weight_map.items()},
        }
        final = os.path.join(self.directory, INDEX)
        tmp = self._temporary(final, json.dumps(index, indent=2).encode())
        os.replace(tmp, final)  # while locked: not stale to other saves
        fsync_dir(self.directory)

    def __enter__(self) -> "_Save":
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if error is not None:
            leftovers = [tmp for tmp, _, _ in self.temporaries]
            for leftover in leftovers + ([] if self.committed else self.staged):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
        for _, _, fd in self.temporaries:
            os.close(fd)
        if isinstance(error, OSError):
            shadowed = self.staged and os.path.isfile(
                os.path.join(self.directory, SINGLE)
            )
            left = (
                f"the new shards are in place, but the old {SINGLE}, which a load "
                f"of the directory reads first, could not be removed: remove it, "
                f"or load {INDEX}'s path"
                if self.committed and shadowed
                else "the new checkpoint is in place and loads (its shards perhaps "
                "still under the save's own names, "
                "model-00001-of-0000N.<token>.safetensors)"
                if self.committed
                else "the previous files are left as they were"
            )
            refused = type(error)(
                f"Cannot save to {self.path!r}: {error}.\nHint: save_safetensors "
                "writes temporary files ('.<name>.XXXXXXXX.tmp') beside the final "
                f"ones, then renames them; {left}."
            )
            refused.errno = error.errno
            raise refused from error


def _remove_old(directory: str, keep: set[str], other: str) -> None:
    # Remove the files of earlier saves to `directory` (shards, staged shards,
    # and `other`: the index or the single file) but `keep`.
    for name in os.listdir(directory):
        old = _SHARD.fullmatch(name) or _STAGED.fullmatch(name) or name == other
        if old and name not in keep:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))
    fsync_dir(directory)


def _check_format(files: _Files, names: NameMap) -> None:
    # The same names can hold a matrix either way round (GPT-2's `Conv1D` is
    # [in, out] in PyTorch, [out, in] in Flax), and a square one fits both: only
    # the file's own word for its layout tells them apart.
    formats = {meta.get("format") for meta in files.metadata.values()}
    other = sorted(f for f in formats if f in _LAYOUTS and f != names.format)
    if other and names.format in _LAYOUTS:
        raise ValueError(
            f"{files.where!r} says it holds format {other[0]!r} (its metadata), "
            f"and the name map is for format {names.format!r}: the same names "
            "may hold matrices transposed, and a square one would load "
            "transposed without another error.\nHint: load it with a name map "
            f"for {other[0]!r} (NameMap(..., format={other[0]!r}), with that "
            f"layout's Transpose rules); see {docs('pretrained.md')}."
        )


def _cast(arrays: Mapping[str, Lazy], dtype: np.dtype) -> dict[str, Lazy]:
    def cast(lazy: Lazy) -> Lazy:
        if not jax.numpy.issubdtype(lazy.dtype, jax.numpy.floating):
            return lazy
        return Lazy(lazy.shape, dtype, lambda: lazy.read().astype(dtype))

    return {name: cast(lazy) for name, lazy in arrays.items()}


def _float_dtype(dtype: DTypeLike) -> np.dtype:
    # A cast to an integer dtype would truncate the weights (to 0 for most).
    try:
        cast = np.dtype(jax.numpy.dtype(dtype))
    except TypeError:
        cast = None
    if cast is None or not jax.numpy.issubdtype(cast, jax.numpy.floating):
        raise TypeError(
            f"dtype must be a floating-point dtype to cast the file's "
            f"floating-point arrays to, got {dtype!r}.\nHint: e.g. "
            "dtype=jnp.float32 or jnp.bfloat16; integer arrays keep their dtype."
        )
    return cast


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read every array of a safetensors file or directory (as
    [`eqxscan.save_safetensors`][] or Hugging Face write them) in its dtype,
    bfloat16 included, checked against its digest where the file has one.

    **Arguments:**

    - `path`: a `.safetensors` file, a `model.safetensors.index.json`, or a
      directory holding either (both: `model.safetensors`, as transformers
      reads it).

    **Returns:**

    A `dict[str, numpy.ndarray]` of the file's own names.
    """
    path = check_path("read_safetensors: path", path)
    with contextlib.closing(_Files(path)) as files:
        return {name: lazy.read() for name, lazy in files.entries.items()}


class Opened(NamedTuple):
    """What [`eqxscan.checkpoint.open_safetensors`][] gives."""

    arrays: Mapping[str, Lazy]
    """Array-likes by name: `shape` and `dtype` known without reading, the data
    read (and checked against its digest) by `numpy.asarray(array)`."""
    metadata: dict[str, dict[str, str]]
    """Each file's safetensors `__metadata__`, by file name."""
    where: str
    """The file or index read."""


@contextlib.contextmanager
def open_safetensors(
    path: str | os.PathLike,
    like: PyTree | None = None,
    *,
    names: NameMap | None = None,
    dtype: DTypeLike | None = None,
) -> Iterator[Opened]:
    """Open a safetensors file or directory, reading each array only when asked
    for: what [`eqxscan.load_safetensors`][] reads from, for code that loads
    (or converts) a checkpoint piece by piece.

    ```python
    import os, tempfile
    import jax, numpy as np, eqxscan
    from eqxscan.checkpoint import open_safetensors

    model = eqxscan.StackedMLP(4, 2, key=jax.random.key(0))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        eqxscan.save_safetensors(path, model, metadata={"note": "hi"})
        with open_safetensors(path) as opened:
            w1 = opened.arrays["blocks.1.w1"]
            assert w1.shape == (4, 16)  # from the header: nothing read yet
            np.testing.assert_array_equal(np.asarray(w1), model.blocks[1].w1)
            assert opened.metadata["model.safetensors"]["note"] == "hi"
    ```

    **Arguments:**

    - `path`: a `.safetensors` file, a `model.safetensors.index.json`, or a
      directory holding either (both: `model.safetensors`, as transformers
      reads it).
    - `like`: with `names`, the model whose names the arrays get. Given, the
      `alpha` the files record of each of its [`eqxscan.adapters.LoRA`][]s is
      checked against its own (a `ValueError` naming the weight and both).
    - `names`: a [`eqxscan.checkpoint.NameMap`][] from the file's names to
      eqxscan's for `like`: every name and shape is checked at once, as
      `load_safetensors` does, and the arrays get eqxscan's names (by default,
      the file's own).
    - `dtype`: the file's floating-point arrays are cast to it as they are read.

    **Returns:**

    A context manager giving an [`eqxscan.checkpoint.Opened`][] (`arrays`,
    `metadata`, `where`); the files are closed on leaving it.

    **Raises:**

    As [`eqxscan.load_safetensors`][] for the files and the name map.
    """
    if names is not None and like is None:
        raise TypeError(
            "open_safetensors: names needs like, the model whose names the "
            "arrays get.\nHint: pass like=model (arrays or "
            "jax.ShapeDtypeStructs)."
        )
    if like is not None:
        check_like("open_safetensors", like)
    cast = None if dtype is None else _float_dtype(dtype)
    path = check_path("open_safetensors: path", path)
    with contextlib.closing(_Files(path)) as files:
        if like is not None:
            check_records(files.metadata, like, files.where)
        arrays: Mapping[str, Lazy] = files.entries
        if cast is not None:
            arrays = _cast(files.entries, cast)
        if names is not None:
            _check_format(files, names)
            arrays = names.mapping(like, arrays, source=repr(files.where), cast=cast)  # pyright: ignore[reportAssignmentType]
        yield Opened(arrays, files.metadata, files.where)


def load_safetensors(
    path: str | os.PathLike,
    like: T,
    *,
    names: NameMap | None = None,
    dtype: DTypeLike | None = None,
) -> T:
    """Load a safetensors file or directory into a model shaped like `like`.
    Names, shapes and dtypes are checked against `like` before any array is
    read (through `names` if given, reporting every missing, unused or
    mis-shaped name at once, with its layer), each array against its digest
    where the file has one.

    **Arguments:**

    - `path`: a `.safetensors` file, a `model.safetensors.index.json`, or a
      directory holding either (as Hugging Face lays them out; both:
      `model.safetensors`, as transformers reads it).
    - `like`: a model of the wanted layout (arrays or `jax.ShapeDtypeStruct`s),
      as for [`eqxscan.from_state_dict`][].
    - `names`: a [`eqxscan.checkpoint.NameMap`][] from the file's names to
      eqxscan's; by default the file holds eqxscan's own names.
    - `dtype`: the file's floating-point arrays are cast to it as they are read
      (as Hugging Face's `torch_dtype=`), e.g. a bfloat16 file into a float32
      model; integer and boolean arrays are not. By default each array keeps
      the file's dtype, which must be the model's.

    **Returns:**

    `like` with its arrays replaced by the file's.

    **Raises:**

    `FileNotFoundError` for a missing file or shard;
    [`eqxscan.checkpoint.CorruptFileError`][] (a `ValueError`) naming the file
    for a corrupt one (truncated, a bad header, a changed array, a shard of
    another save); `ValueError` naming the keys, layers, shapes or dtypes that
    differ from the model, or when the file's metadata names another `format`
    than `names` (`"pt"`, `"flax"`: layouts that may hold a matrix transposed),
    or records another `alpha` for one of the model's
    [`eqxscan.adapters.LoRA`][]s (naming the weight and both).
    """
    check_like("load_safetensors", like)
    with open_safetensors(path, like, names=names, dtype=dtype) as opened:
        try:
            return load_state_dict_into(
                like, opened.arrays, saved_weak(opened.metadata)
            )
        except CorruptFileError:
            raise
        except ValueError as e:
            first, *rest = str(e).splitlines()
            # "eqxscan.quant": the metadata entry of eqxscan.quant.save's files.
            if not rest and any("eqxscan.quant" in m for m in opened.metadata.values()):
                rest = [
                    "Hint: the file holds quantized weights (eqxscan.quant.save's); "
                    "load it with eqxscan.quant.load(path, like), like quantized as "
                    "the file was."
                ]
            if dtype is not None and re.search("wrong (shape or )?dtype", first):
                rest = [
                    f"Hint: dtype={_float_dtype(dtype).name} casts every "
                    "floating-point array of the file (the checkpoint's dtypes "
                    "above are after the cast); load a model of several "
                    "floating-point dtypes without dtype=."
                ]
            rest = rest or [
                "Hint: build like with the saved model's configuration (depth, "
                "sizes, dtypes); a file of another convention's names loads "
                f"through names=NameMap(...), see {docs('pretrained.md')}."
            ]
            raise ValueError(
                "\n".join([f"{opened.where!r} does not fit the model: {first}", *rest])
            ) from None
