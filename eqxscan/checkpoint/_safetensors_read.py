"""Reading safetensors files and sharded directories: the arrays by name, their
shapes and dtypes from the headers, data read (and checked against the digest
eqxscan's writer records) only when asked for, each array copied from the file
into an array of its own: no mapping of the file stays resident, so a file read
piece by piece holds one piece at a time."""

import contextlib
import io
import json
import os
import struct
import threading
from collections.abc import Callable

import jax
import numpy as np

from ._files import (
    CorruptFileError,
    differences,
    digest,
    DOCS,
    host_empty,
    Lazy,
    spec,
)


SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DIGESTS = "eqxscan.sha256"  # metadata: JSON {name: hex digest}
_SPECS = "eqxscan.specs"  # metadata: JSON {name: "float32[4, 16]"}
_REPLACED_TRIES = 5
_TOKEN = "eqxscan.save"  # metadata of each file and of the index: one save's token


def _package():
    # Imported on first use, so that `import eqxscan` does without it.
    import safetensors.numpy

    return safetensors


def _bad(path: str, why: str) -> CorruptFileError:
    return CorruptFileError(
        f"Safetensors file {path!r} is corrupt or is not a safetensors file: {why}."
        f"\nHint: restore it from a copy, or save it again; {DOCS}."
    )


class _Files:
    """The arrays of a safetensors file or sharded directory, by name."""

    def __init__(self, path: str):
        self.handles: list[_Bytes] = []
        self.metadata: dict[str, dict[str, str]] = {}  # each file's, by file name
        self.entries: dict[str, Lazy] = {}
        files, token, self.where = self._resolve(path)
        try:
            for file, names in files.items():
                self._open(file, names, token)
        except BaseException:
            self.close()
            raise

    def _resolve(
        self, path: str
    ) -> tuple[dict[str, list[str] | None], str | None, str]:
        if os.path.isdir(path):
            # With an index too, the single file, as transformers reads it (a
            # sharded save over a single file takes over once it removes it).
            if os.path.isfile(os.path.join(path, SINGLE)):
                return {os.path.join(path, SINGLE): None}, None, path
            if os.path.isfile(os.path.join(path, INDEX)):
                path = os.path.join(path, INDEX)
            else:
                raise FileNotFoundError(
                    f"No safetensors checkpoint in {path!r}: neither {SINGLE} nor "
                    f"{INDEX} is there."
                )
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No safetensors file {path!r}.")
        if not path.endswith(".json"):
            return {path: None}, None, path
        try:
            with open(path, encoding="utf-8") as f:
                # A name given twice (a damaged byte): JSON keeps the last, and
                # the array the first named would go unread without a word.
                index = json.load(f, object_pairs_hook=_unique)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptFileError(
                f"Safetensors index {path!r} is not valid JSON ({e}).\nHint: "
                f"restore it from a copy, or save again; {DOCS}."
            ) from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and os.path.basename(v) == v
            and v not in ("", ".", "..")
            for k, v in weight_map.items()
        ):
            raise CorruptFileError(
                f"Safetensors index {path!r} has no valid 'weight_map' (an object "
                "from array names to file names in its directory).\nHint: an "
                f"index as Hugging Face writes it is expected; {DOCS}."
            )
        meta = index.get("metadata")
        token = meta.get(_TOKEN) if isinstance(meta, dict) else None
        directory = os.path.dirname(path)
        files: dict[str, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(os.path.join(directory, file), []).append(name)  # type: ignore[union-attr]
        absent = sorted(os.path.basename(f) for f in files if not os.path.isfile(f))
        if absent:
            raise FileNotFoundError(
                f"Safetensors index {path!r} names files that are not there: "
                f"{', '.join(map(repr, absent))}.\nHint: copy every shard beside "
                "the index, or save again."
            )
        return files, token if isinstance(token, str) else None, path

    def _open(self, file: str, names: list[str] | None, token: str | None) -> None:
        for _ in range(_REPLACED_TRIES):
            opened = None
            try:
                # The package checks the header (offsets, sizes); its handle
                # maps the whole file, whose pages read through it would stay
                # resident until it closes: the data is read by `_Bytes`,
                # through a descriptor opened first (while it is open, no other
                # file takes its inode) and read once the header is checked.
                opened = open(file, "rb", buffering=0)
                seen = os.fstat(opened.fileno()).st_ino
                before = os.stat(file).st_ino
                with _package().safe_open(file, framework="np") as handle:
                    keys = list(handle.keys())
                    meta = handle.metadata() or {}
                    specs = {}
                    for key in keys:
                        piece = handle.get_slice(key)
                        specs[key] = (tuple(piece.get_shape()), piece.get_dtype())
                # A save replacing the file between the opens: the header and
                # digests of one file, the bytes of another, taken for
                # corruption. (Compared by inode: a replaced file's number,
                # freed, may be the next save's, but not while `opened` holds it.)
                same = before == os.stat(file).st_ino == seen
                raw = _Bytes(opened) if same else None
            except Exception as e:  # the package's SafetensorError, or an OSError
                if opened is not None:
                    opened.close()
                raise _unreadable(file, e) from None
            if raw is not None:
                break
            opened.close()
        else:
            raise CorruptFileError(
                f"Safetensors file {file!r} was replaced {_REPLACED_TRIES} times "
                "while it was being opened.\nHint: load it once the program "
                "saving it has finished."
            )
        self.handles.append(raw)
        self.metadata[os.path.basename(file)] = dict(meta)
        # A file of eqxscan's saves holds its digests: one without them (the
        # entry's name damaged) would be read unchecked. (A converter may drop
        # the specs, which only restate the header.)
        if _TOKEN in meta and _DIGESTS not in meta:
            raise _bad(file, f"its metadata lacks {_DIGESTS!r}")
        records = []
        for entry in (_DIGESTS, _SPECS):
            try:
                record = json.loads(meta.get(entry, "{}"))
            except ValueError:
                record = None
            if not isinstance(record, dict):
                raise _bad(file, f"its metadata '{entry}' is not a JSON object")
            if record and sorted(record) != sorted(keys):
                why = "its arrays differ from the names its metadata records"
                raise _bad(file, why)
            records.append(record)
        digests, saved = records
        if token is not None and meta.get(_TOKEN) != token:
            raise CorruptFileError(
                f"Safetensors file {file!r} is of another save than its index "
                f"{self.where!r}: a save was interrupted, or files of two saves "
                "were mixed.\nHint: save again, or restore the directory from a copy."
            )
        if names is not None and (why := differences(keys, names, "index")):
            raise _bad(file, f"its arrays differ from its index: {why}")
        for key, (shape, dtype_name) in specs.items():
            if key in self.entries:
                raise _bad(file, f"'{key}' is in another file of the index too")
            # Not NumPy's codes: "F4" (4-bit floats) is no "f4" (float32).
            name = _DTYPES.get(dtype_name, dtype_name.lower())
            if name not in _DTYPES.values():
                raise ValueError(
                    f"Safetensors file {file!r} holds '{key}' of dtype "
                    f"{dtype_name}, which eqxscan cannot read: NumPy has no such "
                    "dtype.\nHint: convert the file's arrays to a dtype NumPy "
                    "holds (bfloat16, float8, ...) with the program that wrote it."
                )
            dtype = np.dtype(jax.numpy.dtype(name))
            # The digests cover the bytes only: a header giving them another
            # shape or dtype of the same size is caught here. But for bytes
            # saved as uint8 and given as float8 since (eqxscan.quant's fp8
            # codes, converted to safetensors' F8_E4M3: the same bits).
            retyped = dtype.itemsize == 1 and saved.get(key) == spec(shape, np.uint8)
            if (
                saved
                and saved[key] != spec(shape, dtype)
                and not (dtype_name.startswith("F8_") and retyped)
            ):
                raise _bad(
                    file,
                    f"its header gives '{key}' as {spec(shape, dtype)}, but it "
                    f"was saved as {saved[key]}",
                )
            raw.specs[key] = (shape, dtype_name, dtype)
            self.entries[key] = Lazy(
                shape, dtype, self._reader(raw, file, key, digests.get(key))
            )

    @staticmethod
    def _reader(
        handle: "_Bytes", file: str, key: str, expected: str | None
    ) -> Callable[[], np.ndarray]:
        # Not a reference to the `_Files`, whose entries hold this: a cycle
        # would keep everything they reach until the garbage collector runs.
        def read() -> np.ndarray:
            if handle.file.closed:
                raise ValueError(
                    f"Array '{key}' of {file!r} is read after its file was closed."
                    "\nHint: read the arrays inside `with open_safetensors(...)`, "
                    "or copy them there (numpy.asarray)."
                )
            try:
                array = handle.get_tensor(key)
            except Exception as e:
                raise _bad(file, f"'{key}' cannot be read ({e})") from None
            if expected is not None and digest(array) != expected:
                raise _bad(
                    file,
                    f"array '{key}' does not match its SHA-256 digest: its data "
                    "changed after it was saved",
                )
            return np.asarray(array)

        return read

    def close(self) -> None:
        for handle in self.handles:
            with contextlib.suppress(Exception):
                handle.__exit__(None, None, None)
        self.handles.clear()


def _unreadable(file: str, e: Exception) -> CorruptFileError:
    # The package's error naming the file, or what the file is instead.
    with open(file, "rb") as f:
        start = f.read(4)
    if start.startswith(b"PK"):
        return _bad(file, "it is a zip archive (an .npz?), not safetensors")
    return _bad(file, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"it names {key!r} twice")
        seen.add(key)
    return dict(pairs)


class _Bytes:
    """A file's arrays, read where its header places them into arrays of their
    own, through a descriptor opened with the file (it reads the file opened,
    not one saved over it since; the header the package checked is compared
    with its own). Float8 arrays too, which the package's NumPy API lacks."""

    def __init__(self, file: io.RawIOBase):
        self.file = file
        self.file.seek(0)
        (size,) = struct.unpack("<Q", self.file.read(8))
        self.start, self.header = 8 + size, json.loads(self.file.read(size))
        self.specs: dict[str, tuple[tuple[int, ...], str, np.dtype]] = {}
        self.lock = threading.Lock()  # one seek and read at a time

    def get_tensor(self, key: str) -> np.ndarray:
        shape, name, dtype = self.specs[key]
        info = self.header[key]
        if (tuple(info["shape"]), info["dtype"]) != (shape, name):
            raise ValueError(f"its header differs from the package's: {info}")
        begin, end = info["data_offsets"]
        data = host_empty((end - begin,), np.uint8)
        view, done = data.data, 0
        with self.lock:
            self.file.seek(self.start + begin)
            while done < len(data):
                got = self.file.readinto(view[done:])
                if not got:
                    raise ValueError(
                        f"the file is {len(data) - done} bytes short of it"
                    )
                done += got
        return data.view(dtype).reshape(shape)

    def close(self) -> None:
        self.file.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}  # fmt: skip
