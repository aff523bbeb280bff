"""Checkpoints under fault: refused and killed saves, stray step directories and
bad step numbers, corrupt Orbax steps. Every fault either loads exactly what was
saved or raises an error naming the file (and the array). Crafted, truncated and
corrupted safetensors files: tests/test_safetensors.py."""

import errno
import fcntl
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import numpy as np
import pytest

import eqxscan


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _mlp(seed=0, **kw):
    return eqxscan.StackedMLP(4, 2, key=jax.random.key(seed), **kw)


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


def test_a_sharded_save_that_cannot_remove_the_old_single_file_fails(
    tmp_path, monkeypatch
):
    # A directory load reads model.safetensors before an index: left behind,
    # it would keep loading the old weights after a save that said nothing.
    old, new, like = (eqxscan.StackedMLP(8, 3, key=jax.random.key(i)) for i in range(3))
    eqxscan.save_safetensors(tmp_path, old)
    remove = os.remove

    def refused(path, *args, **kwargs):
        if os.path.basename(path) == "model.safetensors":
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", refused)
    with pytest.raises(PermissionError, match="could not be removed") as e:
        eqxscan.save_safetensors(tmp_path, new, max_shard_size=1500)
    monkeypatch.undo()
    assert "load model.safetensors.index.json's path" in str(e.value)
    index = tmp_path / "model.safetensors.index.json"
    assert eqx.tree_equal(eqxscan.load_safetensors(index, like), new)
    assert eqx.tree_equal(eqxscan.load_safetensors(tmp_path, like), old)


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


# Orbax's failed read of a truncated file leaves asyncio callbacks that run
# after their event loop closed ("Event loop is closed", raised where no one
# can catch it): its noise, not a result of the test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
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
        # Truncated, restored unverified: Orbax's bare `Exception` (kilobytes of
        # TensorStore text) becomes a `ValueError` naming the step and item.
        for data in (p for p in files if p.parent.name == "d"):
            data.write_bytes(data.read_bytes()[:10])
        with pytest.raises(ValueError, match=r"Step 2 in .* could not be read: item"):
            c.restore(model, mesh=mesh, step=2, min_size=0, verify=False)
        # Deleted (a cleanup killed midway): no complete step any more.
        target.unlink()
        with pytest.raises(
            FileNotFoundError, match=rf"it has no {re.escape(repr(name))}"
        ):
            c.restore(model, mesh=mesh, step=2, min_size=0)
        assert c.all_steps() == [1]
