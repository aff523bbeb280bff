"""Checkpoints under fault: crafted, truncated and corrupted files, killed saves,
stray step directories and bad step numbers. Every fault either loads exactly
what was saved or raises an error naming the file (and the member or array),
never a raw zip/NumPy error and never advice to unpickle."""

import errno
import fcntl
import hashlib
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile

import equinox as eqx
import jax
import numpy as np
import pytest

import eqxscan


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _mlp(seed=0, **kw):
    return eqxscan.StackedMLP(4, 2, key=jax.random.key(seed), **kw)


# `.npz` checkpoints are read-only now, with a DeprecationWarning that
# test_state_dict.py checks; here, the reader under fault.
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*an .npz checkpoint of an earlier eqxscan version:DeprecationWarning"
)


def _old_save(path, model):
    """What `eqxscan.save` wrote before it wrote safetensors: an `.npz` of the
    state dict and a manifest of each array's dtype, shape and digest."""
    arrays = eqxscan.to_state_dict(model)

    def digest(v):
        return hashlib.sha256(
            np.ascontiguousarray(v).reshape(-1).view(np.uint8)
        ).hexdigest()

    entries = {
        k: {"dtype": v.dtype.name, "shape": list(v.shape), "sha256": digest(v)}
        for k, v in arrays.items()
    }
    manifest = np.array(json.dumps({"format": 1, "arrays": entries}))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, array in {**arrays, "__eqxscan_manifest__": manifest}.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def _saved(tmp_path, model=None):
    path = tmp_path / "ckpt.npz"
    _old_save(path, _mlp() if model is None else model)
    return path


def _members(path):
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def _write(path, members, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)


def _npy(array):
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _manifest(path):
    return json.loads(
        str(np.load(io.BytesIO(_members(path)["__eqxscan_manifest__.npy"]))[()])
    )


def _with_manifest(path, manifest):
    members = _members(path)
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    members["__eqxscan_manifest__.npy"] = _npy(np.array(text))
    _write(path, members)


def _refused(path, *match, like=None):
    """`load` raises a ValueError naming `path` and each of `match`, no raw
    error and no word of pickles."""
    with pytest.raises(ValueError) as e:
        eqxscan.load(path, _mlp(1) if like is None else like)
    msg = str(e.value)
    assert str(path) in msg, msg
    for m in match:
        assert m in msg, msg
    assert "pickle" not in msg, msg
    assert len(msg.splitlines()) <= 2, msg
    return msg


# Integrity: digests, sizes and names checked against the manifest.


def test_every_array_has_a_digest_in_the_manifest(tmp_path):
    model = _mlp()
    manifest = _manifest(_saved(tmp_path, model))
    state = eqxscan.to_state_dict(model)
    assert manifest["format"] == 1
    assert set(manifest["arrays"]) == set(state)
    entry = manifest["arrays"]["blocks.1.w1"]
    assert entry["dtype"] == "float32" and entry["shape"] == [4, 16]
    assert len(entry["sha256"]) == 64


def test_changed_array_with_a_valid_zip_crc_is_refused_by_its_digest(tmp_path):
    # A rewritten member passes the zip's CRC: only the digest can tell.
    path = _saved(tmp_path)
    members = _members(path)
    array = np.load(io.BytesIO(members["blocks.1.w2.npy"]))
    array[0, 0] += 1.0
    members["blocks.1.w2.npy"] = _npy(array)
    _write(path, members)
    _refused(path, "'blocks.1.w2'", "SHA-256 digest")
    with pytest.raises(ValueError, match=r"'blocks\.1\.w2' does not match its SHA"):
        eqxscan.load_state_dict(path)


def test_member_not_in_manifest_is_refused_before_reading(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    members = _members(path)
    members["extra.npy"] = _npy(np.zeros(3, np.float32))
    _write(path, members)
    opened = []
    real_open = zipfile.ZipFile.open
    monkeypatch.setattr(
        zipfile.ZipFile,
        "open",
        lambda self, name, *a, **k: (
            opened.append(getattr(name, "filename", name))
            or real_open(self, name, *a, **k)
        ),
    )
    _refused(path, "'extra'", "not in the manifest")
    assert opened == ["__eqxscan_manifest__.npy"]


def test_member_larger_than_its_manifest_entry_is_refused_before_reading(
    tmp_path, monkeypatch
):
    # A stored 64 MiB member where the manifest promises float32[4, 16].
    path = _saved(tmp_path)
    members = _members(path)
    members["blocks.0.w1.npy"] = _npy(np.zeros((1 << 24,), np.float32))
    _write(path, members)
    tracemalloc.start()
    try:
        _refused(path, "'blocks.0.w1.npy'", "needs 256 plus a header")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_member_of_another_shape_of_the_same_size_is_refused(tmp_path):
    # [16, 4] where the manifest says [4, 16]: the same bytes, the same digest.
    path = _saved(tmp_path)
    members = _members(path)
    w1 = np.load(io.BytesIO(members["blocks.0.w1.npy"]))
    members["blocks.0.w1.npy"] = _npy(w1.reshape(16, 4))
    _write(path, members)
    _refused(path, "'blocks.0.w1.npy' holds float32[16, 4], unlike its manifest")


def test_decompression_bomb_is_refused_without_inflating(tmp_path):
    # 256 MiB of zeros deflate to 256 KiB: a small file naming a huge array.
    path = _saved(tmp_path)
    members = _members(path)
    bomb = np.zeros((1 << 26,), np.float32)
    members["blocks.0.w1.npy"] = _npy(bomb)
    manifest = _manifest(path)
    manifest["arrays"]["blocks.0.w1"]["shape"] = [1 << 26]
    members["__eqxscan_manifest__.npy"] = _npy(np.array(json.dumps(manifest)))
    del bomb
    _write(path, members, zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        _refused(path, "compressed")
        with pytest.raises(ValueError, match="is compressed"):
            eqxscan.load_state_dict(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_manifest_promising_a_huge_array_is_refused_by_the_model(tmp_path):
    # Sizes agree with the manifest, but not with the model: nothing is read.
    path = _saved(tmp_path)
    members = _members(path)
    members["blocks.0.w1.npy"] = _npy(np.zeros((4, 17), np.float32))
    manifest = _manifest(path)
    manifest["arrays"]["blocks.0.w1"]["shape"] = [4, 17]
    members["__eqxscan_manifest__.npy"] = _npy(np.array(json.dumps(manifest)))
    _write(path, members)
    with pytest.raises(
        ValueError,
        match=r"'blocks\.0\.w1': model has float32\[4, 16\], checkpoint has "
        r"float32\[4, 17\]",
    ):
        eqxscan.load(path, _mlp(1))


@pytest.mark.parametrize(
    "manifest, match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not one of format 1"),
        ({"format": "1", "arrays": {}}, "not one of format 1"),
        (
            lambda m: m["arrays"]["blocks.0.w1"].update(dtype="object"),
            "'blocks.0.w1' has dtype object",
        ),
        (
            lambda m: m["arrays"]["blocks.0.w1"].update(dtype="nonsense"),
            "'blocks.0.w1' has dtype 'nonsense'",
        ),
        (
            lambda m: m["arrays"]["blocks.0.w1"].update(shape=[-4, 16]),
            "'blocks.0.w1' has shape [-4, 16]",
        ),
        (
            lambda m: m["arrays"]["blocks.0.w1"].update(shape="4x16"),
            "'blocks.0.w1' has shape '4x16'",
        ),
        (lambda m: m["arrays"].update(ghost=m["arrays"]["blocks.0.w1"]), "'ghost'"),
        (lambda m: m["arrays"].pop("blocks.0.w1"), "'blocks.0.w1'"),
        (
            lambda m: m["arrays"]["blocks.0.w1"].update(sha256=7),
            "'blocks.0.w1' has sha256 7",
        ),
        (
            lambda m: m["arrays"]["blocks.0.w1"].update(sha256="0" * 64),
            "'blocks.0.w1' does not match its SHA-256",
        ),
    ],
)
def test_tampered_manifest_is_named(tmp_path, manifest, match):
    path = _saved(tmp_path)
    if callable(manifest):
        m = _manifest(path)
        manifest(m)
        manifest = m
    _with_manifest(path, manifest)
    msg = _refused(path, match)
    assert "manifest" in msg or "digest" in msg


def test_object_member_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "objects.npz"
    np.savez(path, **{"blocks.0.w1": np.array([{"x": 1}], dtype=object)})
    _refused(path, "'blocks.0.w1.npy'", "not plain numbers")


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04", b"not a checkpoint"])
def test_empty_and_non_zip_files_are_named(tmp_path, content):
    path = tmp_path / "bad.npz"
    path.write_bytes(content)
    _refused(path, "is not a checkpoint written by eqxscan.save")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No checkpoint file .*gone\.npz"):
        eqxscan.load(tmp_path / "gone.npz", _mlp())


def test_truncated_files_are_refused_and_named(tmp_path):
    path = _saved(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.npz"
    for n in sorted({1, 7, 30, 100, 500} | set(range(0, len(data), len(data) // 25))):
        cut.write_bytes(data[:n])
        _refused(cut)
    cut.write_bytes(data[:-1])
    _refused(cut)


def test_flipped_bits_load_the_saved_values_or_are_named(tmp_path):
    # Any byte changed anywhere: never another model, never a raw error.
    model = _mlp()
    path = _saved(tmp_path, model)
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(0)
    flipped = tmp_path / "flipped.npz"
    refused = 0
    for pos in rng.choice(len(data), 150, replace=False):
        changed = bytearray(data)
        changed[pos] ^= 1 << int(rng.integers(8))
        flipped.write_bytes(bytes(changed))
        try:
            loaded = eqxscan.load(flipped, _mlp(1))
        except ValueError as e:
            assert str(flipped) in str(e) and "pickle" not in str(e), (pos, e)
            refused += 1
        else:
            assert eqx.tree_equal(loaded, model), pos
    assert refused > 100


def _with_header(npy, text):
    """The `.npy` bytes `npy` with its header text replaced by `text`."""
    assert npy[:8] == b"\x93NUMPY\x01\x00"
    length = int.from_bytes(npy[8:10], "little")
    return npy[:8] + len(text).to_bytes(2, "little") + text + npy[10 + length :]


HEADER = b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 16), }"


@pytest.mark.parametrize(
    "header",
    [
        HEADER.replace(b"}", b"|"),  # one flipped bit: tokenize.TokenError
        HEADER.replace(b"}", b"[1]: 2}"),  # an unhashable key: TypeError
        b"-" * 9000 + b"1",  # the parser's stack overflows: MemoryError
    ],
    ids=["unclosed", "unhashable", "nested"],
)
@pytest.mark.parametrize("manifest", [True, False])
def test_unparsable_npy_headers_are_named(tmp_path, header, manifest):
    # With a valid zip CRC, as a flip in a member larger than zipfile's first
    # read leaves it when NumPy parses the header.
    path = tmp_path / "ckpt.npz"
    if manifest:
        _old_save(path, _mlp())
    else:
        np.savez(path, **eqxscan.to_state_dict(_mlp()))
    members = _members(path)
    members["blocks.0.w1.npy"] = _with_header(members["blocks.0.w1.npy"], header)
    _write(path, members)
    _refused(path, "'blocks.0.w1.npy' has no valid .npy header")
    with pytest.raises(ValueError, match="'blocks.0.w1.npy' has no valid .npy"):
        eqxscan.load_state_dict(path)


@pytest.mark.parametrize("manifest", [True, False])
def test_a_member_stored_twice_is_refused(tmp_path, manifest):
    # Readers differ on which of two same-named members they take: `zipfile`
    # the last, others the first. Here the last passes every other check.
    path = tmp_path / "ckpt.npz"
    if manifest:
        _old_save(path, _mlp())
    else:
        np.savez(path, **eqxscan.to_state_dict(_mlp()))
    members = _members(path)
    other = _npy(np.ones((4, 16), np.float32))
    with zipfile.ZipFile(path, "w") as z:
        with pytest.warns(UserWarning, match="Duplicate name"):
            for name, data in [("blocks.0.w1.npy", other), *members.items()]:
                z.writestr(name, data)
    _refused(path, "a second member named 'blocks.0.w1.npy'")


OLDER_WRITER = "was written by another version of eqxscan or by another program"


def test_files_of_other_writers_are_refused_in_plain_words(tmp_path):
    state = eqxscan.to_state_dict(_mlp())
    # An older eqxscan: a table of dtype names instead of the manifest.
    older = tmp_path / "older.npz"
    dtypes = json.dumps({k: v.dtype.name for k, v in state.items()})
    np.savez(older, **state, __eqxscan_dtypes__=np.array(dtypes))
    msg = _refused(
        older,
        OLDER_WRITER,
        "it holds '__eqxscan_dtypes__.npy' (str",
        " text), which eqxscan does not read, and no '__eqxscan_manifest__.npy' "
        "(the manifest eqxscan.save writes, format 1)",
    )
    assert "corrupt" not in msg.splitlines()[0] and "numpy.savez" in msg, msg
    # Another program: text next to the arrays.
    other = tmp_path / "other.npz"
    np.savez(other, **state, meta=np.array(b"step=3"))
    _refused(other, OLDER_WRITER, "'meta.npy' (bytes")
    # bfloat16 in a plain numpy.savez: raw bytes, and no manifest to name them.
    raw = tmp_path / "raw.npz"
    np.savez(raw, **eqxscan.to_state_dict(_mlp(dtype=jax.numpy.bfloat16)))
    _refused(raw, OLDER_WRITER, "(void16 raw bytes, as .npy stores bfloat16)")
    # A later format of the manifest.
    later = _saved(tmp_path)
    _with_manifest(later, {"format": 2, "arrays": {}})
    _refused(
        later,
        OLDER_WRITER,
        "its manifest ('__eqxscan_manifest__.npy') is of format 2, and this "
        "version of eqxscan reads format 1",
    )


def test_refused_saves_name_the_path(tmp_path, monkeypatch):
    # Too long a name for the temporary file, though not for the path itself.
    path = tmp_path / ("c" * 240 + ".safetensors")
    with pytest.raises(OSError) as e:
        eqxscan.save(path, _mlp())
    assert e.value.errno == errno.ENAMETOOLONG
    assert str(e.value).startswith(f"Cannot save to {str(path)!r}: "), e.value
    # The disk full at the end of a save: the system names no file at all.
    path = tmp_path / "model.safetensors"
    eqxscan.save(path, _mlp())
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        eqxscan.save(path, _mlp(1))
    monkeypatch.undo()
    assert type(e.value) is OSError and e.value.errno == errno.ENOSPC
    first, hint = str(e.value).splitlines()
    assert first == (
        f"Cannot save to {str(path)!r}: [Errno 28] No space left on device."
    ), first
    assert hint.startswith("Hint: save_safetensors writes temporary files ")
    assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


def test_plain_savez_files_without_digests_still_load(tmp_path):
    # A state dict written by `numpy.savez` (no manifest): every other check.
    plain = tmp_path / "plain.npz"
    model32 = _mlp()
    np.savez(plain, **eqxscan.to_state_dict(model32))
    assert eqx.tree_equal(eqxscan.load(plain, _mlp(1)), model32)
    # Arrays in Fortran order (a transpose written as it is): the square `w`
    # would load transposed if read as if in C order.
    w = np.arange(16.0).reshape(4, 4).T
    np.savez(plain, w=w, v=np.ones((2, 3), order="F"))
    state = eqxscan.load_state_dict(plain)
    np.testing.assert_array_equal(state["w"], w)
    np.testing.assert_array_equal(state["v"], np.ones((2, 3)))


# Temporary files of killed saves.


def test_stale_temporary_files_are_removed_by_the_next_save(tmp_path):
    stale = [".model.safetensors.ab12cd_9.tmp", ".model.safetensors.zzzzzzzz.tmp"]
    others = [
        ".model.safetensors.old.ab12cd_9.tmp",  # of `model.safetensors.old`
        ".other.safetensors.ab12cd_9.tmp",
        "model.safetensors.ab12cd_9.tmp",
        ".model.safetensors.ab12cd_9.tmp.keep",  # a copy of one: not the save's
    ]
    for name in stale + others:
        (tmp_path / name).write_bytes(b"partial")
    # One held by a save still running: locked, as `save` locks its own.
    live = tmp_path / ".model.safetensors.live1234.tmp"
    path = tmp_path / "model.safetensors"
    with live.open("wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        model = _mlp()
        eqxscan.save(path, model)
        assert sorted(os.listdir(tmp_path)) == sorted([path.name, live.name, *others])
    eqxscan.save(path, model)  # now it is stale too
    assert live.name not in os.listdir(tmp_path)
    assert eqx.tree_equal(eqxscan.load(path, _mlp(1)), model)


# Orbax step numbers and step directories.


def _same_arrays(a, b):
    sa, sb = eqxscan.to_state_dict(a), eqxscan.to_state_dict(b)
    assert list(sa) == list(sb)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


@pytest.mark.parametrize(
    "step, error, match",
    [
        ("../escape", TypeError, r"non-negative int, got str \('\.\./escape'\)"),
        (1.5, TypeError, r"non-negative int, got float \(1\.5\)"),
        ("a", TypeError, r"got str \('a'\)"),
        (True, TypeError, r"got bool \(True\)"),
        (None, TypeError, r"got NoneType \(None\)"),
        (-1, ValueError, r"step must be >= 0, got -1"),
    ],
)
def test_bad_step_numbers_are_refused(tmp_path, step, error, match):
    directory = tmp_path / "ckpt"
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    model = _mlp()
    with eqxscan.checkpoint.CheckpointManager(directory, asynchronous=False) as c:
        calls = [lambda: c.save(step, model)]
        if step is not None:
            calls.append(lambda: c.restore(model, mesh=mesh, step=step))
        for method, call in zip(("save", "restore"), calls):
            with pytest.raises(error) as e:
                call()
            # Where the tests type-check eqxscan's annotations (SupportsIndex),
            # those name the parameter and value first.
            msg = str(e.value)
            if "Type-check error" in msg:
                assert f"CheckpointManager.{method}" in msg and "'step'" in msg
                assert repr(step) in msg
            else:
                assert re.search(rf"CheckpointManager\.{method}: .*{match}", msg), msg
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert os.listdir(directory) == []


def test_numpy_integer_steps_are_plain_steps(tmp_path):
    model = _mlp()
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(np.int64(4), model)
        assert c.all_steps() == [4]
        restored, _, step = c.restore(model, mesh=mesh, step=np.int32(4), min_size=0)
    assert step == 4 and type(step) is int
    _same_arrays(restored, model)


def test_stray_and_incomplete_step_directories_are_skipped(tmp_path):
    model = _mlp()
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(3, model)
    (tmp_path / "7").mkdir()  # stray
    (tmp_path / "5").mkdir()  # a step whose files were partly deleted
    shutil.copytree(
        tmp_path / "3",
        tmp_path / "5",
        dirs_exist_ok=True,
        ignore=lambda d, names: ["_CHECKPOINT_METADATA"],
    )
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        assert c.all_steps() == [3]
        with pytest.warns(
            UserWarning, match=r"7 \(it has no '_CHECKPOINT_METADATA'\), 5"
        ):
            assert c.latest_step() == 3
        with pytest.warns(UserWarning, match="the latest complete step is 3"):
            restored, _, step = c.restore(model, mesh=mesh, min_size=0)
        assert step == 3
        _same_arrays(restored, model)
        with pytest.raises(
            FileNotFoundError,
            match=r"step 5 .*incomplete: it has no '_CHECKPOINT_METADATA'\); it has "
            r"steps \[3\]",
        ):
            c.restore(model, mesh=mesh, step=5)


BAD_STEPS = """
import os, sys
import jax
import eqxscan
from eqxscan import checkpoint

root = sys.argv[1]
model = eqxscan.StackedMLP(4, 2, key=jax.random.key(0))
with checkpoint.CheckpointManager(os.path.join(root, "ckpt"), asynchronous=False) as c:
    for step in ["../escape", 1.5, "a", True, -1]:
        try:
            c.save(step, model)
        except (TypeError, ValueError) as e:
            print(type(e).__name__, e)
        else:
            print("accepted", repr(step))
print(sorted(os.listdir(root)), os.listdir(os.path.join(root, "ckpt")))
"""


def test_bad_step_numbers_are_refused_without_type_checking_hooks(tmp_path):
    # As a user runs it: without the tests' runtime type checks of annotations.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(BAD_STEPS), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    prefix = "CheckpointManager.save: step must be"
    assert run.stdout.splitlines() == [
        f"TypeError {prefix} a non-negative int, got str ('../escape').",
        f"TypeError {prefix} a non-negative int, got float (1.5).",
        f"TypeError {prefix} a non-negative int, got str ('a').",
        f"TypeError {prefix} a non-negative int, got bool (True).",
        f"ValueError {prefix} >= 0, got -1.",
        "['ckpt'] []",
    ]


def test_corrupt_orbax_step_is_named_by_its_digests(tmp_path):
    model = _mlp()
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path) as c:  # asynchronous
        c.save(1, model)
        c.save(2, model)
    for step in (1, 2):
        digests = json.loads(
            (tmp_path / str(step) / "eqxscan_digests.json").read_text()
        )
        assert "_CHECKPOINT_METADATA" in digests and len(digests) > 5
    # One bit flipped in the largest data file of step 2.
    files = [p for p in (tmp_path / "2" / "model").rglob("*") if p.is_file()]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 4
    target.write_bytes(bytes(data))
    name = str(target.relative_to(tmp_path / "2"))
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        for step in (None, 2):
            with pytest.raises(ValueError) as e:
                c.restore(model, mesh=mesh, step=step, min_size=0)
            msg = str(e.value)
            assert f"Step 2 in {str(tmp_path)!r} is corrupt: its file {name!r}" in msg
            assert "differs from its digest" in msg and "[1, 2]" in msg
        for _ in range(2):  # restoring changes nothing that is checked
            restored, _, step = c.restore(model, mesh=mesh, step=1, min_size=0)
            assert step == 1
            _same_arrays(restored, model)
        # On request, the latest step that passes its digests.
        with pytest.warns(UserWarning, match=r"corrupt steps .*: 2 \(Step 2 in .*"):
            restored, _, step = c.restore(
                model, mesh=mesh, min_size=0, skip_corrupt=True
            )
        assert step == 1
        _same_arrays(restored, model)
        target.unlink()
        with pytest.raises(ValueError, match=rf"its file {re.escape(repr(name))} is "):
            c.restore(model, mesh=mesh, step=2, min_size=0)
