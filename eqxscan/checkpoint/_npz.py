"""Reading the `.npz` checkpoints of earlier versions (read-only: eqxscan now
writes safetensors, and [`eqxscan.load`][] reads these with a
`DeprecationWarning`).

Such a file is an `.npz` of [`eqxscan.to_state_dict`][] plus a manifest: each
array's dtype name (`.npy` cannot name bfloat16 and other ML dtypes), shape and
SHA-256 digest. A plain `numpy.savez` of a state dict reads too.

Reading trusts nothing in the file: the members are matched against the
manifest (names, and their sizes in the zip directory against shape x itemsize)
before any array is read, members must be stored uncompressed (as `numpy.savez`
writes them), so no member can inflate beyond the file's own size, and every
array is checked against its digest. No member is ever unpickled.
"""

import hashlib
import io
import json
import math
import os
import re
import struct
import tokenize
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import TypedDict, TypeVar

import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from ._files import (
    CorruptFileError,
)


_MANIFEST = "__eqxscan_manifest__"  # {"format": 1, "arrays": {name: entry}}
_FORMAT = 1
_MAX_HEADER = 10_000  # bytes of a `.npy` header, as NumPy's own limit
_MAX_MANIFEST = 1 << 28
_DOCS = "see docs/checkpoints.md"
# What `zipfile` raises for files it cannot read (a `_Corrupt` is re-raised first).
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    EOFError,
    OSError,
    NotImplementedError,
    RuntimeError,
    ValueError,
    struct.error,
    zlib.error,
)


# What NumPy's `.npy` header parser raises besides those: `ast.literal_eval`'s
# errors (`MemoryError` is its parser's stack overflow on a deeply nested
# header, at most `_MAX_HEADER` bytes), and `tokenize`'s, from its second try at
# a header it cannot parse.
_HEADER_ERRORS = (SyntaxError, tokenize.TokenError, TypeError, MemoryError)


T = TypeVar("T")
# A `.npy` header: shape, Fortran order, dtype, and its size in bytes.
_Header = tuple[tuple[int, ...], bool, np.dtype, int]


class _Entry(TypedDict):
    """What the manifest (or a `.npy` header) says of one array."""

    dtype: np.dtype
    shape: tuple[int, ...]
    sha256: str | None


class _Corrupt(ValueError):
    """Raised inside the reader; `load_state_dict` adds the file's name."""


class _Foreign(_Corrupt):
    """A well-formed file, but of another writer or another format."""


def _digest(array: np.ndarray) -> str:
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return hashlib.sha256(flat.data).hexdigest()


# Reading.


def _header(f: io.BufferedIOBase, member: str) -> _Header:
    """`(shape, fortran_order, dtype, header bytes)` of the `.npy` member open
    as `f`, reading only its header."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(
                f, max_header_size=_MAX_HEADER
            )
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(
                f, max_header_size=_MAX_HEADER
            )
        else:
            raise ValueError(f".npy format version {version}")
    except _Corrupt:
        raise
    except (*_ZIP_ERRORS, *_HEADER_ERRORS) as e:
        why = str(e) or type(e).__name__
        raise _Corrupt(f"member {member!r} has no valid .npy header ({why})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise _Corrupt(
            f"member {member!r} holds {dtype} values, not plain numbers; eqxscan "
            "never stores such members and does not read them"
        )
    return tuple(shape), bool(fortran), dtype, f.tell()


def _is_number(dtype: np.dtype) -> bool:
    # "V": how `.npy` stores bfloat16 and the other ML dtypes.
    return dtype.kind in "biufcV" and not dtype.hasobject and not dtype.fields


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class _Member:
    """One array of the archive, read (and checked against its digest) only when
    NumPy asks for it: `shape` and `dtype` come from the manifest, so a model's
    names, shapes and dtypes are all checked before anything is read."""

    def __init__(self, archive: "_Archive", name: str, entry: _Entry):
        self.archive, self.name = archive, name
        self.shape = entry["shape"]
        self.dtype = entry["dtype"]
        self.sha256 = entry["sha256"]

    def read(self) -> np.ndarray:
        return self.archive.read(self)

    def __array__(
        self, dtype: DTypeLike | None = None, copy: bool | None = None
    ) -> np.ndarray:
        array = self.read()
        return array if dtype is None else array.astype(dtype)


class _Archive(Mapping[str, _Member]):
    """The members of a checkpoint file, validated against its manifest and the
    zip directory; nothing but `.npy` headers and the manifest is read."""

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
        except _ZIP_ERRORS as e:
            raise CorruptFileError(
                f"{path!r} is not a checkpoint written by eqxscan.save (an .npz "
                f"archive of arrays): {'empty file' if size == 0 else e}."
            ) from None
        try:
            self.members = self._members(size)
            self._entries = self._manifest()
        except BaseException:
            self.zip.close()
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
        if _MANIFEST in self.members:
            text = self._text(_MANIFEST)
            try:
                manifest = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise _Corrupt(f"its manifest is not valid JSON ({e})") from None
            found = manifest.get("format") if isinstance(manifest, dict) else None
            if type(found) is int and found != _FORMAT:
                raise _Foreign(
                    f"its manifest ('{_MANIFEST}.npy') is of format {found}, and "
                    f"this version of eqxscan reads format {_FORMAT}"
                )
            if (
                not isinstance(manifest, dict)
                or found != _FORMAT
                or not isinstance(manifest.get("arrays"), dict)
            ):
                raise _Corrupt(
                    f"its manifest is not one of format {_FORMAT} (a JSON object "
                    "with 'format' and 'arrays')"
                )
            entries = {
                name: self._entry(name, entry)
                for name, entry in manifest["arrays"].items()
            }
            names = set(self.members) - {_MANIFEST}
            missing, extra = sorted(set(entries) - names), sorted(names - set(entries))
            if missing or extra:
                raise _Corrupt(
                    "its members differ from its manifest: "
                    + "; ".join(
                        f"{what} {', '.join(map(repr, items[:10]))}"
                        for what, items in (
                            ("missing", missing),
                            ("not in the manifest", extra),
                        )
                        if items
                    )
                )
            for name, entry in entries.items():
                overhead = self.members[name].file_size - _nbytes(
                    entry["shape"], entry["dtype"]
                )
                if not 10 <= overhead <= 16 + _MAX_HEADER:
                    raise _Corrupt(
                        f"member '{name}.npy' holds {self.members[name].file_size} "
                        f"bytes, but its manifest entry "
                        f"{entry['dtype'].name}{entry['shape']} needs "
                        f"{_nbytes(entry['shape'], entry['dtype'])} plus a header"
                    )
            return entries
        # A plain `numpy.savez` of a state dict: shapes, dtypes and sizes come
        # from each member's `.npy` header.
        entries: dict[str, _Entry] = {}
        for name in self.members:
            shape, _, dtype, offset = self._open_header(name)
            if not _is_number(dtype):
                what = {"U": "text", "S": "bytes"}.get(dtype.kind, "values")
                raise _Foreign(
                    f"it holds '{name}.npy' ({dtype.name} {what}), which eqxscan "
                    f"does not read, and no '{_MANIFEST}.npy' (the manifest "
                    f"eqxscan.save writes, format {_FORMAT})"
                )
            if self.members[name].file_size != offset + _nbytes(shape, dtype):
                raise _Corrupt(
                    f"member '{name}.npy' holds {self.members[name].file_size} "
                    f"bytes, but its header says {dtype.name}{list(shape)}"
                )
            entry = {"dtype": dtype.name, "shape": list(shape)}
            entries[name] = self._entry(name, entry)
        return entries

    def _entry(self, name: object, entry: object) -> _Entry:
        def bad(why: str) -> _Corrupt:
            return _Corrupt(f"its manifest entry {name!r} {why}")

        if not isinstance(name, str) or name not in self.members:
            raise bad("names no member of the file")
        if not isinstance(entry, dict):
            raise bad("is not a JSON object")
        shape = entry.get("shape")
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
        digest = entry.get("sha256")
        if digest is not None and not (
            isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)
        ):
            raise bad(f"has sha256 {digest!r}, not 64 hex digits")
        return {"dtype": dtype, "shape": tuple(shape), "sha256": digest}

    def _member_file(self, info: zipfile.ZipInfo) -> io.BufferedIOBase:
        f = self.zip.open(info)
        assert isinstance(f, io.BufferedIOBase)  # a `zipfile.ZipExtFile`
        return f

    def _open_header(self, name: str) -> _Header:
        try:
            with self._member_file(self.members[name]) as f:
                return _header(f, f"{name}.npy")
        except _Corrupt:
            raise
        except _ZIP_ERRORS as e:
            raise _Corrupt(f"member '{name}.npy' cannot be read ({e})") from None

    def _text(self, name: str) -> str:
        info = self.members[name]
        if info.file_size > _MAX_MANIFEST:
            raise _Corrupt(f"its manifest holds {info.file_size} bytes")
        data = self._data(name, lambda shape, dtype: dtype.kind == "U" and not shape)
        return str(data[()])

    def _data(
        self, name: str, accept: Callable[[tuple[int, ...], np.dtype], bool]
    ) -> np.ndarray:
        member = f"{name}.npy"
        info = self.members[name]
        try:
            with self._member_file(info) as f:
                shape, fortran, dtype, offset = _header(f, member)
                if not accept(shape, dtype):
                    raise _Corrupt(
                        f"member {member!r} holds {dtype.name}{list(shape)}, "
                        "unlike its manifest entry"
                    )
                if info.file_size != offset + _nbytes(shape, dtype):
                    raise _Corrupt(
                        f"member {member!r} holds {info.file_size} bytes, but its "
                        f"header says {dtype.name}{list(shape)}"
                    )
                array = np.empty(shape[::-1] if fortran else shape, dtype)
                view = array.reshape(-1).view(np.uint8).data
                if f.readinto(view) != view.nbytes or f.read(1):
                    raise _Corrupt(f"member {member!r} is truncated")
        except _Corrupt:
            raise
        except _ZIP_ERRORS as e:
            raise _Corrupt(f"member {member!r} cannot be read ({e})") from None
        return array.T if fortran else array

    def read(self, member: _Member) -> np.ndarray:
        want = member.dtype

        def accept(shape: tuple[int, ...], dtype: np.dtype) -> bool:
            # `.npy` stores bfloat16 and other ML dtypes as raw void bytes.
            return shape == member.shape and (
                dtype == want or (dtype.kind == "V" and dtype.itemsize == want.itemsize)
            )

        try:
            array = self._data(member.name, accept)
            if array.dtype != want:
                array = array.view(want)
            if member.sha256 is not None and _digest(array) != member.sha256:
                raise _Corrupt(
                    f"array '{member.name}' does not match its SHA-256 digest: its "
                    "data changed after it was saved"
                )
        except _Corrupt as e:
            raise _corrupt(self.path, e) from None
        return array

    def __getitem__(self, name: str) -> _Member:
        return _Member(self, name, self._entries[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self.zip.close()


def _corrupt(path: str, e: _Corrupt) -> ValueError:
    if isinstance(e, _Foreign):
        return ValueError(
            f"Checkpoint file {path!r} was written by another version of eqxscan "
            f"or by another program: {e}.\nHint: load it with what wrote it and "
            "save it again with eqxscan.save_safetensors (a plain numpy.savez "
            f"of eqxscan.to_state_dict's arrays loads too); {_DOCS}."
        )
    return CorruptFileError(
        f"Checkpoint file {path!r} is corrupt or was not written by eqxscan.save: "
        f"{e}.\nHint: restore it from a copy; {_DOCS}."
    )


def open_npz(path: str) -> _Archive:
    """The arrays of an `.npz` checkpoint, by name, read when asked for."""
    try:
        return _Archive(path)
    except _Corrupt as e:
        raise _corrupt(path, e) from None


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of an `.npz` checkpoint, each checked against its digest."""
    archive = open_npz(path)
    try:
        return {name: archive[name].read() for name in archive}
    finally:
        archive.close()
