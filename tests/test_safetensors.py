"""safetensors checkpoints: one file and sharded directories as Hugging Face lays
them out, bfloat16, streaming, and faults (truncated, flipped bits, foreign
files, the wrong model, a missing shard, interrupted saves). Every fault either
loads exactly what was saved or raises an error naming the file."""

import functools
import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eqxscan


ROOT = Path(__file__).resolve().parent.parent
KILLS = ROOT / "tests" / "scripts" / "safetensors_kills.py"


@functools.cache  # models are immutable: build each once
def _mlp(seed=0, dim=4, num_layers=2, **kw):
    return eqxscan.StackedMLP(dim, num_layers, key=jax.random.key(seed), **kw)


def _refused(path, *match, like=None, error=ValueError, where=None, **kw):
    with pytest.raises(error) as e:
        eqxscan.load_safetensors(path, _mlp(1) if like is None else like, **kw)
    msg = str(e.value)
    assert str(where or path) in msg, msg
    for m in match:
        assert m in msg, msg
    assert len(msg.splitlines()) <= 2, msg
    return msg


def test_one_file_round_trip_keeps_bfloat16_and_reads_with_plain_safetensors(
    tmp_path,
):
    model = _mlp(dtype=jnp.bfloat16)
    path = tmp_path / "model.safetensors"
    assert eqxscan.save_safetensors(path, model) == [str(path)]
    assert os.listdir(tmp_path) == ["model.safetensors"]
    loaded = eqxscan.load_safetensors(path, _mlp(1, dtype=jnp.bfloat16))
    assert loaded.blocks.layers.w1.dtype == jnp.bfloat16
    assert eqx.tree_equal(loaded, model)
    # The package alone reads the same per-layer arrays, as bfloat16.
    plain = safetensors.numpy.load_file(path)
    state = eqxscan.to_state_dict(model)
    assert sorted(plain) == sorted(state)
    for name, array in state.items():
        assert plain[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(plain[name], array)
    # And an abstract like: nothing initialised to be overwritten.
    like = eqx.filter_eval_shape(_mlp, 0, dtype=jnp.bfloat16)
    assert eqx.tree_equal(eqxscan.load_safetensors(path, like), model)


def test_sharded_directory_as_hugging_face_lays_it_out(tmp_path):
    model = _mlp(dim=8, num_layers=3)
    state = eqxscan.to_state_dict(model)
    sizes = {k: v.nbytes for k, v in state.items()}  # w1, w2: 1024, scale: 32
    written = eqxscan.save_safetensors(tmp_path, model, max_shard_size="2.1KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert list(index["weight_map"]) == list(state)  # to_state_dict's order
    # Greedy, as Hugging Face: a new file when the next array would not fit.
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{k:05d}-of-00003.safetensors" for k in range(1, 4)]
    for name, file in index["weight_map"].items():
        assert file == files[int(name.split(".")[1])], name  # a layer each
    for file in files:
        size = sum(sizes[n] for n, f in index["weight_map"].items() if f == file)
        assert size <= 2100
        assert sorted(safetensors.numpy.load_file(tmp_path / file)) == sorted(
            n for n, f in index["weight_map"].items() if f == file
        )
    assert written[-1] == str(tmp_path / "model.safetensors.index.json")
    for where in (tmp_path, tmp_path / "model.safetensors.index.json"):
        loaded = eqxscan.load_safetensors(where, _mlp(1, dim=8, num_layers=3))
        assert eqx.tree_equal(loaded, model)
    # Saving again unsharded replaces the shards and the index.
    eqxscan.save_safetensors(tmp_path, model)
    assert os.listdir(tmp_path) == ["model.safetensors"]
    eqxscan.save_safetensors(tmp_path, model, max_shard_size=1500)
    assert "model.safetensors" not in os.listdir(tmp_path)


def test_a_directory_holding_a_file_and_an_index_loads_the_file(tmp_path):
    # As transformers' from_pretrained reads it; the index's path loads the shards.
    single, sharded = _mlp(0, dim=8), _mlp(2, dim=8)
    eqxscan.save_safetensors(tmp_path / "one", single)
    eqxscan.save_safetensors(tmp_path, sharded, max_shard_size=1500)
    os.replace(tmp_path / "one" / "model.safetensors", tmp_path / "model.safetensors")
    like = _mlp(1, dim=8)
    assert eqx.tree_equal(eqxscan.load_safetensors(tmp_path, like), single)
    index = tmp_path / "model.safetensors.index.json"
    assert eqx.tree_equal(eqxscan.load_safetensors(index, like), sharded)


def test_saving_streams_one_shard_at_a_time(tmp_path):
    # 8 layers of 2 x [64, 256] float32: 1 MiB in all, 64 KiB a layer's matrix.
    model = _mlp(dim=64, num_layers=8)
    host = jax.tree.map(lambda x: np.asarray(x) if eqx.is_array(x) else x, model)
    total = sum(v.nbytes for v in eqxscan.to_state_dict(host).values())
    # Once before measuring: what a first call traces or imports is not held
    # per shard (and differs with what the process ran before).
    eqxscan.save_safetensors(tmp_path / "warm", host, max_shard_size=70_000)
    tracemalloc.start()
    try:
        eqxscan.save_safetensors(tmp_path, host, max_shard_size=70_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len([f for f in os.listdir(tmp_path) if f != "warm"]) > 8
    # Every shard held at once would be `total`; one shard and the copies the
    # serialiser makes of it (safetensors 0.4.1 makes more) stay well below.
    assert peak < total / 3, (peak, total)
    like = _mlp(1, dim=64, num_layers=8)
    assert eqx.tree_equal(eqxscan.load_safetensors(tmp_path, like), model)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="max_shard_size needs a directory"):
        eqxscan.save_safetensors(tmp_path / "m.safetensors", _mlp(), max_shard_size=10)
    with pytest.raises(ValueError, match="'5 parsecs'"):
        eqxscan.save_safetensors(tmp_path, _mlp(), max_shard_size="5 parsecs")
    # Not a file per array: each of these was taken for 0 bytes, or for 1.
    for size in [0, "0", "0.5", "0KB", True, -1]:
        with pytest.raises(ValueError, match=f"max_shard_size .*got {size!r}"):
            eqxscan.save_safetensors(tmp_path, _mlp(), max_shard_size=size)
    assert not os.listdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        eqxscan.save_safetensors(tmp_path / "a" / "b" / "m.safetensors", _mlp())
    (tmp_path / "model.pt").write_bytes(b"")  # a file, not a directory
    with pytest.raises(FileExistsError, match="it is a file, and a path not endi"):
        eqxscan.save_safetensors(tmp_path / "model.pt", _mlp())
    with pytest.raises(TypeError, match="abstract"):
        eqxscan.save_safetensors(
            tmp_path / "m.safetensors", eqx.filter_eval_shape(_mlp)
        )
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        eqxscan.load_safetensors(tmp_path, _mlp())
    with pytest.raises(FileNotFoundError, match="No safetensors file"):
        eqxscan.load_safetensors(tmp_path / "gone.safetensors", _mlp())


# Faults.


def _saved(tmp_path, model=None):
    path = tmp_path / "model.safetensors"
    eqxscan.save_safetensors(path, _mlp() if model is None else model)
    return path


def test_truncated_files_are_refused_and_named(tmp_path):
    data = _saved(tmp_path).read_bytes()
    cut = tmp_path / "cut.safetensors"
    for n in sorted({0, 1, 7, 8, 9, 30, 100} | set(range(0, len(data), 97))):
        cut.write_bytes(data[:n])
        _refused(cut, "is corrupt or is not a safetensors file")
    cut.write_bytes(data[:-1])
    _refused(cut, "is corrupt")


def test_flipped_bits_load_the_saved_values_or_are_named(tmp_path):
    # Anywhere, the header and the data alike: never another model, never a
    # raw error of the package.
    model = _mlp()
    path = _saved(tmp_path, model)
    data = bytearray(path.read_bytes())
    (header,) = struct.unpack("<Q", data[:8])
    rng = np.random.default_rng(0)
    flipped = tmp_path / "flipped.safetensors"
    refused = {"header": 0, "data": 0}
    positions = [*rng.choice(8 + header, 100, replace=False)]
    positions += [*rng.choice(np.arange(8 + header, len(data)), 60, replace=False)]
    for pos in positions:
        changed = bytearray(data)
        changed[pos] ^= 1 << int(rng.integers(8))
        flipped.write_bytes(bytes(changed))
        try:
            loaded = eqxscan.load_safetensors(flipped, _mlp(1))
        except ValueError as e:
            assert str(flipped) in str(e) and len(str(e).splitlines()) == 2, (pos, e)
            refused["header" if pos < 8 + header else "data"] += 1
        else:
            assert eqx.tree_equal(loaded, model), pos
    assert refused["data"] == 60  # every change of the data: its digest
    assert refused["header"] > 50


def test_flipped_header_byte_is_the_packages_error_named_with_the_file(tmp_path):
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[8] ^= 0x40  # the header's opening brace
    path.write_bytes(bytes(data))
    msg = _refused(path, "SafetensorError")
    assert msg.splitlines()[1].startswith("Hint: restore it from a copy")


def test_foreign_files_are_refused_in_plain_words(tmp_path):
    npz = tmp_path / "model.npz"
    np.savez(npz, **eqxscan.to_state_dict(_mlp()))
    _refused(npz, "it is a zip archive (an .npz?), not safetensors")
    text = tmp_path / "notes.safetensors"
    text.write_text("hello, world: not weights at all")
    _refused(text, "is corrupt or is not a safetensors file")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    _refused(index, "is not valid JSON")
    index.write_text(json.dumps({"weight_map": {"blocks.0.w1": "../elsewhere"}}))
    _refused(index, "has no valid 'weight_map'")


def test_an_index_naming_an_array_twice_is_refused(tmp_path):
    # One damaged byte made two entries one name: JSON kept the last, and the
    # first's array went unread (load_state_dict returned 8 of 9, no error).
    model = eqxscan.StackedMLP(4, 3, key=jax.random.key(0))
    directory = tmp_path / "sharded"
    eqxscan.save_safetensors(directory, model, max_shard_size=300)
    index = directory / "model.safetensors.index.json"
    assert (
        eqxscan.load_state_dict(directory).keys() == eqxscan.to_state_dict(model).keys()
    )
    index.write_text(index.read_text().replace('"blocks.0.w1"', '"blocks.1.w1"', 1))
    with pytest.raises(
        eqxscan.checkpoint.CorruptFileError, match="names 'blocks.1.w1' twice"
    ):
        eqxscan.load_state_dict(directory)


def test_files_of_other_writers_without_digests_load(tmp_path):
    # As another program writes them: the same names, no eqxscan metadata.
    model = _mlp()
    path = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file(eqxscan.to_state_dict(model), path)
    assert eqx.tree_equal(eqxscan.load_safetensors(path, _mlp(1)), model)
    state = eqxscan.read_safetensors(path)
    assert list(state) and all(isinstance(v, np.ndarray) for v in state.values())


def test_the_wrong_model_is_named(tmp_path):
    path = _saved(tmp_path, _mlp(num_layers=3))
    _refused(path, "model has L=2 layers in blocks, checkpoint has 3", where="blocks")
    _refused(
        path,
        "'blocks.0.w1': model has float32[8, 32], checkpoint has float32[4, 16]",
        like=_mlp(dim=8, num_layers=3),
    )
    _refused(
        path,
        "checkpoint has float32",
        like=_mlp(num_layers=3, dtype=jnp.bfloat16),
    )
    msg = _refused(
        path, "missing keys: 'w'; unexpected keys: 'blocks.0.", like={"w": jnp.ones(3)}
    )
    assert msg.splitlines()[1].startswith("Hint: build like with the saved model's")


def test_missing_or_mixed_shards_are_named(tmp_path):
    model = _mlp(dim=8, num_layers=3)
    eqxscan.save_safetensors(tmp_path, model, max_shard_size=1500)
    shards = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    like = _mlp(1, dim=8, num_layers=3)
    # A shard of another save of the same model, in place of the right one.
    other = tmp_path / "other"
    eqxscan.save_safetensors(other, _mlp(2, dim=8, num_layers=3), max_shard_size=1500)
    good = (tmp_path / shards[1]).read_bytes()
    (tmp_path / shards[1]).write_bytes((other / shards[1]).read_bytes())
    _refused(tmp_path, "is of another save than its index", like=like, where=shards[1])
    (tmp_path / shards[1]).write_bytes(good)
    assert eqx.tree_equal(eqxscan.load_safetensors(tmp_path, like), model)
    # A shard gone.
    os.remove(tmp_path / shards[2])
    _refused(
        tmp_path,
        "names files that are not there",
        repr(shards[2]),
        like=like,
        error=FileNotFoundError,
    )


def test_index_and_shard_that_disagree_are_named(tmp_path):
    eqxscan.save_safetensors(tmp_path, _mlp(dim=8), max_shard_size=1500)
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    moved = index["weight_map"]["blocks.0.w1"] = index["weight_map"]["blocks.1.w1"]
    path.write_text(json.dumps(index))
    _refused(
        tmp_path, "its arrays differ from its index", like=_mlp(dim=8), where=moved
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_interrupted_save_leaves_the_old_files_intact(tmp_path, monkeypatch, sharded):
    old, new = _mlp(0, dim=8), _mlp(1, dim=8)
    kw = {"max_shard_size": 1500} if sharded else {}
    target = tmp_path if sharded else tmp_path / "model.safetensors"
    eqxscan.save_safetensors(target, old, **kw)
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    real = os.write
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == (2 if sharded else 1):  # the second shard, or the file
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(os, "write", flaky)  # how each file's bytes are written
    with pytest.raises(OSError) as e:
        eqxscan.save_safetensors(target, new, **kw)
    monkeypatch.undo()
    assert e.value.errno == 28 and str(e.value).startswith(
        f"Cannot save to {str(target)!r}"
    )
    after = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    assert after == before  # no temporary file left, nothing replaced
    assert eqx.tree_equal(eqxscan.load_safetensors(target, new), old)
    eqxscan.save_safetensors(target, new, **kw)
    assert eqx.tree_equal(eqxscan.load_safetensors(target, old), new)


def test_a_save_that_fails_once_its_index_took_over_leaves_the_new_checkpoint(
    tmp_path, monkeypatch
):
    # The disk full at the second index (naming the shards' usual names): the
    # first, naming the shards' staged names, is in place, and so are they.
    old, new = _mlp(0, dim=8), _mlp(1, dim=8)
    eqxscan.save_safetensors(tmp_path, old, max_shard_size=1500)
    shards = len([p for p in os.listdir(tmp_path) if p.startswith("model-")])
    real, calls = os.write, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == shards + 2:  # each shard, the first index, the second
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(os, "write", flaky)
    with pytest.raises(OSError) as e:
        eqxscan.save_safetensors(tmp_path, new, max_shard_size=1500)
    monkeypatch.undo()
    assert e.value.errno == 28
    assert "the new checkpoint is in place and loads" in str(e.value), e.value
    assert eqx.tree_equal(eqxscan.load_safetensors(tmp_path, old), new)


def test_a_save_killed_at_any_file_event_leaves_the_old_or_the_new_checkpoint(
    tmp_path,
):
    # A sharded save over a sharded checkpoint of the same file names, over a
    # single file, and a single file over shards: SIGKILLed before each rename,
    # link, removal and fsync in turn (before the fix, 6 of the 15 kills of the
    # first left a directory from which neither loaded).
    pairs = ["1500,1500", "0,1500", "1500,0"]
    run = subprocess.run(
        [sys.executable, str(KILLS), str(tmp_path), *pairs],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    for pair in pairs:
        seen = [line for line in lines if line["pair"] == pair]
        assert not seen[-1]["killed"] and all(x["killed"] for x in seen[:-1])
        assert len(seen) > 8, seen  # every file event of the save, in turn
        bad = [(x["k"], x["loads"]) for x in seen if x["loads"] not in ("old", "new")]
        assert not bad, (pair, bad)
        # Old first, then new, never back.
        loads = [x["loads"] for x in seen]
        assert loads == sorted(loads, key=["old", "new"].index), loads
        files = {tuple(x["files_after_next_save"]) for x in seen}
        if pair.endswith(",0"):
            assert files == {("model.safetensors",)}, files
        else:
            assert files == {
                (
                    *(f"model-{k:05d}-of-00006.safetensors" for k in range(1, 7)),
                    "model.safetensors.index.json",
                )
            }, files


def test_a_shard_that_exactly_fills_max_shard_size_is_not_split(tmp_path):
    model = _mlp(dim=8, num_layers=3)
    sizes = [v.nbytes for v in eqxscan.to_state_dict(model).values()]
    total, layer = sum(sizes), sum(sizes) // 3  # 2080 bytes a layer
    for max_size, files in [
        (total, ["model.safetensors"]),  # exactly all: one file
        (total - 1, ["model-00001-of-00002.safetensors"]),  # one byte over
        (layer, [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]),
        (layer - 1, ["model-00001-of-00005.safetensors"]),
    ]:
        where = tmp_path / str(max_size)
        eqxscan.save_safetensors(where, model, max_shard_size=max_size)
        found = sorted(p for p in os.listdir(where) if p.endswith(".safetensors"))
        assert found[: len(files)] == files, (max_size, found)
        if max_size == layer:
            assert len(found) == 3
    # An array larger than a shard, first or later: a file of its own, no
    # empty file before it.
    big = {"a": jnp.ones(100), "b": jnp.ones(2), "c": jnp.ones(100)}
    eqxscan.save_safetensors(tmp_path / "big", big, max_shard_size=100)
    index = json.loads((tmp_path / "big" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "a": "model-00001-of-00003.safetensors",
        "b": "model-00002-of-00003.safetensors",
        "c": "model-00003-of-00003.safetensors",
    }
    assert eqx.tree_equal(eqxscan.load_safetensors(tmp_path / "big", big), big)


def test_files_respect_the_umask(tmp_path):
    model = _mlp(dim=8)
    old = os.umask(0o022)
    try:
        eqxscan.save_safetensors(tmp_path / "one.safetensors", model)
        eqxscan.save_safetensors(tmp_path / "d", model, max_shard_size=1500)
        os.umask(0o077)
        eqxscan.save_safetensors(tmp_path / "private.safetensors", model)
    finally:
        os.umask(old)
    modes = {
        p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777
        for p in tmp_path.rglob("*")
        if p.is_file()
    }
    assert modes.pop("private.safetensors") == 0o600
    assert len(modes) == 6 and set(modes.values()) == {0o644}, modes


def test_corrupt_files_raise_the_public_error_class(tmp_path):
    path = _saved(tmp_path)
    data = path.read_bytes()
    error = eqxscan.checkpoint.CorruptFileError
    assert issubclass(error, ValueError)
    path.write_bytes(data[:-1])  # truncated
    _refused(path, "is corrupt", error=error)
    changed = bytearray(data)
    changed[-1] ^= 1  # a changed array
    path.write_bytes(bytes(changed))
    _refused(path, "does not match its SHA-256 digest", error=error)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    _refused(index, "is not valid JSON", error=error)
    # The wrong model is not a corrupt file.
    path.write_bytes(data)
    with pytest.raises(ValueError) as e:
        eqxscan.load_safetensors(path, _mlp(dim=8))
    assert not isinstance(e.value, error)


def test_dtype_casts_floating_arrays_on_load(tmp_path):
    f32, bf16 = _mlp(), _mlp(dtype=jnp.bfloat16)
    for saved, like, dtype in [(bf16, f32, jnp.float32), (f32, bf16, jnp.bfloat16)]:
        path = tmp_path / f"{jnp.dtype(dtype).name}.safetensors"
        eqxscan.save_safetensors(path, saved)
        # Not without dtype=, which the hint names with the model's dtype.
        name = jnp.dtype(dtype).name
        _refused(path, "wrong dtype (their", f"dtype=jnp.{name} casts", like=like)
        loaded = eqxscan.load_safetensors(path, like, dtype=dtype)
        want = jax.tree.map(
            lambda x, d=dtype: x.astype(d) if eqx.is_inexact_array(x) else x, saved
        )
        assert eqx.tree_equal(loaded, want), dtype
        assert loaded.blocks.layers.w1.dtype == dtype
    # Integer and boolean arrays keep their dtype.
    mixed = {
        "w": jnp.ones(3, jnp.bfloat16),
        "ids": jnp.arange(3),
        "on": jnp.ones(2, bool),
    }
    eqxscan.save_safetensors(tmp_path / "mixed.safetensors", mixed)
    zeros = {**mixed, "w": jnp.zeros(3)}
    loaded = eqxscan.load_safetensors(
        tmp_path / "mixed.safetensors", zeros, dtype=jnp.float32
    )
    assert eqx.tree_equal(loaded, {**mixed, "w": jnp.ones(3)})
    # A cast to another dtype than the model's: the error says the cast made
    # it, not the file.
    _refused(
        tmp_path / "mixed.safetensors",
        "model has float32[3], checkpoint has bfloat16[3]",
        "Hint: dtype=bfloat16 casts every floating-point array of the file",
        like=zeros,
        dtype=jnp.bfloat16,
    )
    # Not an integer dtype: it truncated every weight (most to 0) without a word.
    for bad in [jnp.int8, "foo"]:
        with pytest.raises(TypeError, match="dtype must be a floating-point dtype"):
            eqxscan.load_safetensors(path, like, dtype=bad)


def _package_writes(*dtypes):
    # Whether the installed safetensors writes these (older ones lack complex64
    # and float8; the minimum-versions run has one of those).
    try:
        safetensors.numpy.save({f"{i}": np.zeros(1, d) for i, d in enumerate(dtypes)})
    except Exception:
        return False
    return True


def test_dtypes_the_package_cannot_write_are_named(tmp_path):
    if _package_writes(jnp.complex64):
        pytest.skip("this safetensors writes complex64")
    with pytest.raises(TypeError, match=r"safetensors [\d.]+ has no dtype for 'c'"):
        eqxscan.save_safetensors(
            tmp_path / "c.safetensors", {"c": jnp.zeros(2, jnp.complex64)}
        )


def test_float8_and_complex_arrays_load_back_as_saved(tmp_path):
    # The package's NumPy API cannot make float8 arrays: eqxscan's own files of
    # them were refused as corrupt, and complex64 ones as "NumPy cannot hold".
    if not _package_writes(jnp.float8_e4m3fn):
        pytest.skip("this safetensors does not write float8")
    values = np.linspace(-400, 400, 24, dtype=np.float32).reshape(2, 3, 4)
    model = {
        "e4m3": jnp.asarray(values, jnp.float8_e4m3fn),
        "e5m2": jnp.asarray(values, jnp.float8_e5m2),
    }
    if _package_writes(jnp.complex64):
        model["c"] = jnp.asarray(values[0] + 1j * values[1], jnp.complex64)
    path = tmp_path / "f8.safetensors"
    eqxscan.save_safetensors(path, model)
    loaded = eqxscan.load_safetensors(path, model)
    for name, array in model.items():
        assert loaded[name].dtype == array.dtype
        np.testing.assert_array_equal(
            np.asarray(loaded[name]).view(np.uint8), np.asarray(array).view(np.uint8)
        )
    # A changed byte of a float8 array is still caught by its digest.
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last array's last byte
    path.write_bytes(bytes(data))
    with pytest.raises(eqxscan.checkpoint.CorruptFileError, match="its SHA-256"):
        eqxscan.read_safetensors(path)
    # A dtype safetensors lacks is named before anything is written (the
    # package's "Unknown dtype" named no array).
    with pytest.raises(TypeError, match="no dtype for 'packed' int4"):
        eqxscan.save_safetensors(path, {**model, "packed": jnp.zeros(3, jnp.int4)})


def test_arrays_read_after_their_file_is_closed_are_not_called_corrupt(tmp_path):
    # Such a read raised CorruptFileError ('File is closed'), with the hint to
    # restore a sound file from a copy.
    path = tmp_path / "model.safetensors"
    eqxscan.save_safetensors(path, _mlp())
    with eqxscan.checkpoint.open_safetensors(path) as opened:
        arrays = opened.arrays
    with pytest.raises(ValueError, match="read after its file was closed") as e:
        np.asarray(arrays["blocks.0.w1"])
    assert not isinstance(e.value, eqxscan.checkpoint.CorruptFileError)


def test_a_dtype_numpy_lacks_is_named_not_read_as_another(tmp_path):
    # 'F4' (4-bit floats, two a byte) was looked up as NumPy's code 'f4': the
    # array was described as float32[8] and checked as such against the model.
    if not hasattr(safetensors, "__version__") or tuple(
        int(p) for p in safetensors.__version__.split(".")[:2]
    ) < (0, 6):
        pytest.skip("safetensors before 0.6 cannot parse an F4 header")
    header = json.dumps({"a": {"dtype": "F4", "shape": [8], "data_offsets": [0, 4]}})
    header += " " * (-len(header) % 8)
    path = tmp_path / "f4.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(4))
    with pytest.raises(ValueError, match="'a' of dtype F4, which eqxscan cannot"):
        eqxscan.load_safetensors(path, {"a": jnp.zeros(8)})


def test_float8_arrays_are_read_from_the_file_opened(tmp_path):
    # Read by path, a float8 array came from a file saved over the opened one
    # since (with no digest, as other writers' files have none, unnoticed).
    if not _package_writes(jnp.float8_e4m3fn):
        pytest.skip("this safetensors does not write float8")
    path, new = tmp_path / "model.safetensors", tmp_path / "new.safetensors"
    old = {"a": np.linspace(-4, 4, 6).astype(jnp.float8_e4m3fn).reshape(2, 3)}
    safetensors.numpy.save_file(old, path)
    safetensors.numpy.save_file({"a": old["a"][::-1].copy()}, new)
    with eqxscan.checkpoint.open_safetensors(path) as opened:
        os.replace(new, path)  # as a save does
        np.testing.assert_array_equal(
            np.asarray(opened.arrays["a"]).view(np.uint8), old["a"].view(np.uint8)
        )


def _rewrite_header(path, change):
    # The file with `change(header)` for its header: the data left as it was.
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size :])


def test_a_header_giving_an_array_another_shape_or_dtype_of_its_size_is_named(
    tmp_path,
):
    # The digests cover the bytes, not what the header says they are: bfloat16
    # read as float16, or [4, 16] as [16, 4], loaded other numbers without a word.
    bf16 = _mlp(dtype=jnp.bfloat16)
    path = _saved(tmp_path, bf16)
    _rewrite_header(path, lambda h: h["blocks.1.w2"].update(dtype="F16"))
    with pytest.raises(eqxscan.checkpoint.CorruptFileError) as e:
        eqxscan.load_safetensors(path, _mlp(dtype=jnp.float16), dtype=jnp.float16)
    headline, hint = str(e.value).splitlines()
    assert (
        headline.endswith(
            "its header gives 'blocks.1.w2' as float16[16, 4], but it was saved as "
            "bfloat16[16, 4]."
        )
        and str(path) in headline
    ), headline
    assert hint.startswith("Hint: restore it from a copy"), hint
    path = _saved(tmp_path)
    _rewrite_header(path, lambda h: h["blocks.0.w1"].update(shape=[16, 4]))
    with pytest.raises(eqxscan.checkpoint.CorruptFileError, match=r"float32\[4, 16\]"):
        eqxscan.read_safetensors(path)
    # Files of other writers record no shapes: they load as their headers say.
    _rewrite_header(path, lambda h: h.pop("__metadata__"))
    assert eqxscan.read_safetensors(path)["blocks.0.w1"].shape == (16, 4)


def test_a_damaged_digest_entry_name_is_corruption_not_a_file_of_another_writer(
    tmp_path,
):
    # One flipped bit in the metadata key 'eqxscan.sha256' turned the digest
    # check off: a flipped data byte then loaded without a word.
    path = tmp_path / "model.safetensors"
    eqxscan.save_safetensors(path, _mlp())

    def damage(header):
        meta = header["__metadata__"]
        meta["eqxscan.sha246"] = meta.pop("eqxscan.sha256")

    _rewrite_header(path, damage)
    with pytest.raises(
        eqxscan.checkpoint.CorruptFileError, match="metadata lacks 'eqxscan.sha256'"
    ):
        eqxscan.load_safetensors(path, _mlp())


def test_a_file_saved_over_while_it_is_opened_is_not_called_corrupt(
    tmp_path, monkeypatch
):
    # The header and digests were read from one file and the bytes from the
    # one saved over it: CorruptFileError, 'restore it from a copy'.
    from eqxscan.checkpoint import _safetensors_read as read

    path, new = tmp_path / "model.safetensors", tmp_path / "new.safetensors"
    eqxscan.save_safetensors(path, _mlp(seed=0))
    eqxscan.save_safetensors(new, _mlp(seed=1))
    opened = read._package().safe_open
    saves = [new]

    def safe_open_then_saved_over(file, **kw):
        handle = opened(file, **kw)
        if saves:
            os.replace(saves.pop(), path)  # a save, between the two opens
        return handle

    monkeypatch.setattr(read._package(), "safe_open", safe_open_then_saved_over)
    loaded = eqxscan.load_safetensors(path, _mlp())
    want = eqxscan.to_state_dict(_mlp(seed=1))
    for name, array in eqxscan.to_state_dict(loaded).items():
        np.testing.assert_array_equal(array, want[name])
