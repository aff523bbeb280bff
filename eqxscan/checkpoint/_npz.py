"""Reading the `.npz` checkpoints of earlier versions (read-only, with a
`DeprecationWarning`): an `.npz` of [`eqxscan.to_state_dict`][] plus a manifest
of each array's dtype name (`.npy` cannot name bfloat16), shape and SHA-256
digest; a plain `numpy.savez` of a state dict reads too.

Nothing in the file is trusted: members are matched against the manifest (names,
and zip directory sizes against shape x itemsize) before any array is read, must
be stored uncompressed (so none can inflate beyond the file), and each array is
checked against its digest. No member is ever unpickled.
"""

import contextlib
import functools
import io
import json
import math
import os
import re
import struct
import tokenize
import zipfile
import zlib
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np

from ._files import CorruptFileError, differences, digest, DOCS, Lazy


_MANIFEST = "__eqxscan_manifest__"  # {"format": 1, "arrays": {name: entry}}
_FORMAT = 1
_MAX_HEADER = 10_000  # bytes of a `.npy` header, as NumPy's own limit
_MAX_MANIFEST = 1 << 28
# What `zipfile` raises for files it cannot read (a `_Corrupt` is re-raised
# first), and NumPy's `.npy` header parser besides: `ast.literal_eval`'s errors
# (`MemoryError` is its stack overflow on a deeply nested header) and those of
# `tokenize`, its second try.
_ERRORS = (
    zipfile.BadZipFile,
    EOFError,
    OSError,
    RuntimeError,  # NotImplementedError too
    ValueError,
    struct.error,
    zlib.error,
    SyntaxError,
    tokenize.TokenError,
    TypeError,
    MemoryError,
)
Shape = tuple[int, ...]
_Entry = tuple[Shape, np.dtype, str | None]  # shape, dtype, SHA-256 digest


class _Corrupt(ValueError):
    """Raised inside the reader, which adds the file's name."""


class _Foreign(_Corrupt):
    """A well-formed file, but of another writer or another format."""


def _header(f: io.BufferedIOBase, member: str) -> tuple[Shape, bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f".npy format version {version}")
        read = np.lib.format.read_array_header_1_0
        if version == (2, 0):
            read = np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f, max_header_size=_MAX_HEADER)
    except _ERRORS as e:
        why = str(e) or type(e).__name__
        raise _Corrupt(f"member {member!r} has no valid .npy header ({why})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise _Corrupt(
            f"member {member!r} holds {dtype} values, not plain numbers; eqxscan "
            "never stores such members and does not read them"
        )
    return tuple(shape), bool(fortran), dtype


def _is_number(dtype: np.dtype) -> bool:
    # "V": how `.npy` stores bfloat16 and the other ML dtypes.
    return dtype.kind in "biufcV" and not dtype.hasobject and not dtype.fields


class NpzArchive:
    """The arrays of a checkpoint file, validated against its manifest and the
    zip directory before any array is read."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                start = f.read(6)
        except FileNotFoundError:
            raise FileNotFoundError(f"No checkpoint file {path!r}.") from None
        if start == b"\x93NUMPY":
            raise ValueError(
                f"{path!r} holds a single .npy array, not a checkpoint written by "
                "eqxscan.save (an .npz archive of arrays)."
            )
        try:
            self.zip = zipfile.ZipFile(path)
        except _ERRORS as e:
            raise CorruptFileError(
                f"{path!r} is not a checkpoint written by eqxscan.save (an .npz "
                f"archive of arrays): {'empty file' if size == 0 else e}."
            ) from None
        try:
            self.members = self._members(size)
            manifest = _MANIFEST in self.members
            self.entries = self._manifest() if manifest else self._headers()
            self.arrays = {
                name: Lazy(shape, dtype, functools.partial(self.read, name))
                for name, (shape, dtype, _) in self.entries.items()
            }
        except BaseException as e:
            self.zip.close()
            if isinstance(e, _Corrupt):
                raise _error(path, e) from None
            raise

    def _members(self, size: int) -> dict[str, zipfile.ZipInfo]:
        members: dict[str, zipfile.ZipInfo] = {}
        for info in self.zip.infolist():
            name = info.filename
            if not name.endswith(".npy") or name[:-4] in members:
                what = "a second member" if name[:-4] in members else "a member"
                raise _Corrupt(f"{what} named {name!r}, not one array's .npy")
            if info.flag_bits & 0x21:  # encrypted, or a patch
                raise _Corrupt(
                    f"member {name!r} is encrypted or patched (zip flags "
                    f"{info.flag_bits:#x}); eqxscan.save wrote plain members"
                )
            if info.compress_type != zipfile.ZIP_STORED:
                raise _Corrupt(
                    f"member {name!r} is compressed; eqxscan.save stored arrays "
                    "uncompressed, so that no member can inflate beyond the file"
                )
            if info.file_size != info.compress_size or info.file_size > size:
                raise _Corrupt(
                    f"member {name!r} claims {info.file_size} bytes (stored in "
                    f"{info.compress_size}) in a file of {size}"
                )
            members[name[:-4]] = info
        return members

    def _manifest(self) -> dict[str, _Entry]:
        if self.members[_MANIFEST].file_size > _MAX_MANIFEST:
            raise _Corrupt(f"its manifest holds {self.members[_MANIFEST].file_size}")
        text = self._npy(
            _MANIFEST, lambda shape, dtype: dtype.kind == "U" and not shape
        )
        try:
            manifest = json.loads(str(text[()]))
        except (ValueError, RecursionError) as e:
            raise _Corrupt(f"its manifest is not valid JSON ({e})") from None
        found = manifest.get("format") if isinstance(manifest, dict) else None
        if type(found) is int and found != _FORMAT:
            raise _Foreign(
                f"its manifest ('{_MANIFEST}.npy') is of format {found}, and "
                f"this version of eqxscan reads format {_FORMAT}"
            )
        if found != _FORMAT or not isinstance(manifest.get("arrays"), dict):
            raise _Corrupt(
                f"its manifest is not one of format {_FORMAT} (a JSON object "
                "with 'format' and 'arrays')"
            )
        entries = {k: self._entry(k, v) for k, v in manifest["arrays"].items()}
        if why := differences(set(self.members) - {_MANIFEST}, entries, "manifest"):
            raise _Corrupt(f"its members differ from its manifest: {why}")
        for name, (shape, dtype, _) in entries.items():
            size = self.members[name].file_size
            needs = math.prod(shape) * dtype.itemsize
            if not 10 <= size - needs <= 16 + _MAX_HEADER:
                raise _Corrupt(
                    f"member '{name}.npy' holds {size} bytes, but its manifest "
                    f"entry {dtype.name}{list(shape)} needs {needs} plus a header"
                )
        return entries

    def _headers(self) -> dict[str, _Entry]:
        # A plain `numpy.savez`: shapes and dtypes from the `.npy` headers.
        entries: dict[str, _Entry] = {}
        for name in self.members:
            with self._open(name) as (_, shape, _, dtype):
                pass
            # Raw bytes: a manifest names their dtype (bfloat16, float8, ...).
            if not _is_number(dtype) or dtype.kind == "V":
                raw = "raw bytes, as .npy stores bfloat16"
                what = {"U": "text", "S": "bytes", "V": raw}.get(dtype.kind, "values")
                raise _Foreign(
                    f"it holds '{name}.npy' ({dtype.name} {what}), which eqxscan "
                    f"does not read, and no '{_MANIFEST}.npy' (the manifest "
                    f"eqxscan.save writes, format {_FORMAT})"
                )
            entries[name] = self._entry(
                name, {"dtype": dtype.name, "shape": list(shape)}
            )
        return entries

    def _entry(self, name: object, entry: object) -> _Entry:
        def bad(why: str) -> _Corrupt:
            return _Corrupt(f"its manifest entry {name!r} {why}")

        if not isinstance(name, str) or name not in self.members:
            raise bad("names no member of the file")
        if not isinstance(entry, dict):
            raise bad("is not a JSON object")
        shape, sha256 = entry.get("shape"), entry.get("sha256")
        if not isinstance(shape, list) or not all(
            type(d) is int and 0 <= d < 2**62 for d in shape
        ):
            raise bad(f"has shape {shape!r}, not a list of non-negative ints")
        try:
            dtype = jnp.dtype(entry.get("dtype"))
        except (TypeError, ValueError):
            raise bad(
                f"has dtype {entry.get('dtype')!r}, which NumPy does not know"
            ) from None
        if not _is_number(dtype):
            raise bad(f"has dtype {dtype}, which eqxscan never stores")
        if sha256 is not None and not (
            isinstance(sha256, str) and re.fullmatch(r"[0-9a-f]{64}", sha256)
        ):
            raise bad(f"has sha256 {sha256!r}, not 64 hex digits")
        return tuple(shape), dtype, sha256

    @contextlib.contextmanager
    def _open(
        self, name: str
    ) -> Iterator[tuple[io.BufferedIOBase, Shape, bool, np.dtype]]:
        # Member `name` past its `.npy` header, and the header's shape, Fortran
        # order and dtype, checked against the member's size.
        member, info = f"{name}.npy", self.members[name]
        try:
            with self.zip.open(info) as f:
                assert isinstance(f, io.BufferedIOBase)  # a `zipfile.ZipExtFile`
                shape, fortran, dtype = _header(f, member)
                if info.file_size != f.tell() + math.prod(shape) * dtype.itemsize:
                    raise _Corrupt(
                        f"member {member!r} holds {info.file_size} bytes, but its "
                        f"header says {dtype.name}{list(shape)}"
                    )
                yield f, shape, fortran, dtype
        except _Corrupt:
            raise
        except _ERRORS as e:
            raise _Corrupt(f"member {member!r} cannot be read ({e})") from None

    def _npy(self, name: str, accept: Callable[[Shape, np.dtype], bool]) -> np.ndarray:
        with self._open(name) as (f, shape, fortran, dtype):
            if not accept(shape, dtype):
                raise _Corrupt(
                    f"member '{name}.npy' holds {dtype.name}{list(shape)}, unlike "
                    "its manifest entry"
                )
            array = np.empty(shape[::-1] if fortran else shape, dtype)
            view = array.reshape(-1).view(np.uint8).data
            if f.readinto(view) != view.nbytes or f.read(1):
                raise _Corrupt(f"member '{name}.npy' is truncated")
        return array.T if fortran else array

    def read(self, name: str) -> np.ndarray:
        shape, want, sha256 = self.entries[name]

        def accept(found: Shape, dtype: np.dtype) -> bool:
            # `.npy` stores bfloat16 and other ML dtypes as raw void bytes.
            return found == shape and (
                dtype == want or (dtype.kind == "V" and dtype.itemsize == want.itemsize)
            )

        try:
            array = self._npy(name, accept).view(want)
            if sha256 is not None and digest(array) != sha256:
                raise _Corrupt(
                    f"array '{name}' does not match its SHA-256 digest: its "
                    "data changed after it was saved"
                )
        except _Corrupt as e:
            raise _error(self.path, e) from None
        return array

    def __enter__(self) -> "NpzArchive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.zip.close()


def _error(path: str, e: _Corrupt) -> ValueError:
    if isinstance(e, _Foreign):
        return ValueError(
            f"Checkpoint file {path!r} was written by another version of eqxscan "
            f"or by another program: {e}.\nHint: load it with what wrote it and "
            "save it again with eqxscan.save_safetensors (a plain numpy.savez "
            f"of eqxscan.to_state_dict's arrays loads too); {DOCS}."
        )
    return CorruptFileError(
        f"Checkpoint file {path!r} is corrupt or was not written by eqxscan.save: "
        f"{e}.\nHint: restore it from a copy; {DOCS}."
    )
