"""Quantized models in files: `quant.save`/`quant.load` bit for bit in the
stacked layout, the mismatches each named, `quant.quantize_file` equal to
quantizing the loaded float model (its memory: test_quant_memory.py), and
faults (truncated, corrupted, interrupted saves)."""

import functools
import importlib.util
import json
import os
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import eqxscan
from eqxscan import quant
from eqxscan.checkpoint import CorruptFileError

from .helpers import Dense, TwoDense


ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "llama_example", ROOT / "examples" / "llama.py"
)
assert _spec is not None and _spec.loader is not None
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)

MLP = ["blocks.*.w1", "blocks.*.w2"]
KINDS = [("int8", 128), ("int4", 32), ("fp8", 128)]


@functools.cache  # models are immutable: build each once
def _mlp(seed=0, dim=32, num_layers=2, dtype=jnp.float32):
    return eqxscan.StackedMLP(dim, num_layers, key=jax.random.key(seed), dtype=dtype)


@functools.cache
def _quantized(kind="int8", group_size=128, seed=0, **kw):
    return quant.quantize(_mlp(seed, **kw), MLP, kind=kind, group_size=group_size)


def _like(kind="int8", group_size=128, **kw):
    # Abstract: nothing to be overwritten.
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    return jax.tree.map(
        lambda x: abstract(x) if eqx.is_array(x) else x,
        _quantized(kind, group_size, 1, **kw),
    )


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint32)


def _same_bits(a, b):
    # Bit for bit (float8 included), and the same static fields.
    (da, sa), (db, sb) = eqx.partition(a, eqx.is_array), eqx.partition(b, eqx.is_array)
    assert eqx.tree_equal(sa, sb)
    la, ta = jax.tree.flatten(da)
    lb, tb = jax.tree.flatten(db)
    assert ta == tb and la
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(_bits(x), _bits(y))


def _refused(path, like, *match, error=ValueError):
    with pytest.raises(error) as e:
        quant.load(path, like)
    msg = str(e.value)
    assert str(path) in msg.splitlines()[0], msg
    for m in match:
        assert m in msg, msg
    assert len(msg.splitlines()) == 2 and msg.splitlines()[1].startswith("Hint:")
    return msg


@pytest.mark.parametrize("kind, group_size", KINDS)
def test_round_trip_is_bitwise_in_the_stacked_layout(tmp_path, kind, group_size):
    q = _quantized(kind, group_size)
    path = tmp_path / "q.safetensors"
    assert quant.save(path, q) == [str(path)]
    loaded = quant.load(path, _like(kind, group_size))
    _same_bits(loaded, q)
    w1 = loaded.blocks.layers.w1
    assert isinstance(w1, quant.Quantized) and w1.values.shape[0] == 2
    # The documented layout, read with the package alone: each layer's stored
    # arrays under the weight's name, the floats under eqxscan.save's names,
    # and how each weight was quantized in the metadata.
    with safetensors.safe_open(path, framework="np") as f:
        names = set(f.keys())
        record = json.loads(f.metadata()["eqxscan.quant"])
    assert names == {
        f"blocks.{i}.{n}" for i in range(2) for n in ("scale", "w1.values",
        "w1.scales", "w2.values", "w2.scales")
    }  # fmt: skip
    size = group_size if kind == "int4" else None
    assert record == {
        n: {"kind": kind, "group_size": size, "orientation": "x@W", "dtype": "float32"}
        for n in MLP
    }
    state = eqxscan.read_safetensors(path)
    np.testing.assert_array_equal(
        _bits(state["blocks.1.w2.values"]), _bits(q.blocks.layers.w2.values[1])
    )
    np.testing.assert_array_equal(
        state["blocks.1.w2.scales"], q.blocks.layers.w2.scales[1]
    )


def test_a_numpy_group_size_is_saved_as_an_int(tmp_path):
    # A group size read from a NumPy config: stored, saved and loaded as 32.
    q = quant.quantize(_mlp(), MLP, kind="int4", group_size=np.int64(32))
    assert type(q.blocks.layers.w1.group_size) is int
    quant.save(tmp_path / "q.safetensors", q)
    _same_bits(quant.load(tmp_path / "q.safetensors", _like("int4", 32)), q)


def test_sharded_round_trip_of_a_module_target_in_bfloat16(tmp_path):
    # `eqx.nn.Linear` weights ("W@x", square), bfloat16, several files.
    model = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(64, 64, key=k, dtype=jnp.bfloat16),
        3,
        key=jax.random.key(0),
    )
    q = quant.quantize(model, eqx.nn.Linear, kind="int4", group_size=64)
    written = quant.save(tmp_path, q, max_shard_size="3KB")
    assert len(written) > 3 and written[-1].endswith("index.json")
    like = eqx.filter_eval_shape(
        quant.quantize, model, eqx.nn.Linear, kind="int4", group_size=64
    )
    loaded = quant.load(tmp_path, like)
    _same_bits(loaded, q)
    assert loaded.layers.weight.dtype == jnp.bfloat16
    # The loaded stack runs as the saved one, and as the loop over its layers.
    x = jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(loaded(x), q(x))
    loop = loaded.with_options(mode="loop")(x)
    np.testing.assert_allclose(
        np.asarray(loop, np.float32), np.asarray(q(x), np.float32), rtol=2e-2
    )
    # The same square weights used as `x @ W` would read the same bytes: only
    # the recorded orientation tells them apart.
    other = eqx.filter_eval_shape(
        quant.quantize, model, "*.weight", kind="int4", group_size=64
    )
    _refused(
        tmp_path / "model.safetensors.index.json",
        other,
        "`*.weight` is quantized as int4, group size 64, W@x, bfloat16 in the "
        "file, as int4, group size 64, x@W, bfloat16 in the model",
    )


def test_a_quantized_base_under_lora_adapters(tmp_path):
    # QLoRA: the Quantized is the LoRA's `base`, and named so.
    q = eqxscan.adapters.add_lora(
        _quantized("int4", 32), "blocks.*.w1", rank=2, key=jax.random.key(1)
    )
    path = tmp_path / "qlora.safetensors"
    quant.save(path, q)
    with safetensors.safe_open(path, framework="np") as f:
        assert "blocks.1.w1.base.values" in f.keys()
        assert list(json.loads(f.metadata()["eqxscan.quant"])) == [
            "blocks.*.w1.base",
            "blocks.*.w2",
        ]
    _same_bits(quant.load(path, q), q)


def _rewrite(path, drop=(), metadata=None):
    # The file as another writer would leave it: arrays dropped, metadata
    # changed, no digests.
    with safetensors.safe_open(path, framework="np") as f:
        meta = dict(f.metadata())
    arrays = eqxscan.read_safetensors(path)
    meta = {k: v for k, v in meta.items() if not k.startswith("eqxscan.")}
    safetensors.numpy.save_file(
        {k: v for k, v in arrays.items() if k not in drop},
        path,
        metadata={**meta, **(metadata or {})},
    )


def test_mismatches_are_named_by_weight(tmp_path):
    int4 = tmp_path / "int4.safetensors"
    quant.save(int4, _quantized("int4", 32, dim=64))
    _refused(
        int4,
        _like("int4", 64, dim=64),
        "`blocks.*.w1` is quantized as int4, group size 32, x@W, float32 in the "
        "file, as int4, group size 64, x@W, float32 in the model",
        "`blocks.*.w2`",
    )
    _refused(int4, _like("int8", dim=64), "as int4, group size 32", "as int8, x@W")
    _refused(
        int4,
        _like("int4", 32, dim=64, dtype=jnp.bfloat16),
        "x@W, float32 in the file, as int4, group size 32, x@W, bfloat16 in the",
    )
    # Of the same kind but another size: the array and layer, both shapes.
    _refused(
        int4,
        _like("int4", 32),
        "does not fit the model",
        "'blocks.0.w1.values': model has uint8[16, 128], checkpoint has uint8[32, 256]",
    )
    # A layer too few, and one layer's array gone.
    _refused(
        int4,
        _like("int4", 32, dim=64, num_layers=3),
        "model has L=3 layers in blocks, checkpoint has 2",
    )
    _rewrite(int4, drop=["blocks.1.w2.scales"], metadata={"eqxscan.quant": json.dumps(
        {n: {"kind": "int4", "group_size": 32, "orientation": "x@W", "dtype": "float32"}
         for n in MLP})})  # fmt: skip
    _refused(int4, _like("int4", 32, dim=64), "missing keys: 'blocks.1.w2.scales'")
    # A quantized file of another writer, which records nothing: the hint
    # once said to write it with quant.save, as if it could not be read.
    quant.save(int4, _quantized("int4", 32, dim=64))
    _rewrite(int4)
    _refused(
        int4,
        _like("int4", 32, dim=64),
        "`blocks.*.w1` is quantized in the file ('blocks.0.w1.values') with no "
        "record of how (its metadata 'eqxscan.quant')",
        "Hint: eqxscan.load(path, like) reads it",
    )
    assert eqx.tree_equal(
        eqxscan.load(int4, _like("int4", 32, dim=64)), _quantized("int4", 32, dim=64)
    )


def test_float_and_quantized_files_are_not_mistaken_for_each_other(tmp_path):
    floats, quantized = tmp_path / "f.safetensors", tmp_path / "q.safetensors"
    eqxscan.save(floats, _mlp())
    quant.save(quantized, _quantized())
    _refused(
        floats,
        _like(),
        "`blocks.*.w1` is a float array in the file (float32[32, 128] at "
        "'blocks.0.w1'), and quantized in the model (int8->float32[2,32,128])",
        "Hint: quantize a float file with eqxscan.quant.quantize_file",
    )
    _refused(
        quantized,
        _mlp(1),
        "`blocks.*.w1` is quantized in the file (int8, x@W, float32), and a "
        "float array in the model (float32[2, 32, 128])",
    )
    # Partly quantized models: only the weights that differ are named.
    msg = _refused(
        quantized,
        eqx.filter_eval_shape(quant.quantize, _mlp(), "blocks.*.w2"),
        "`blocks.*.w1` is quantized in the file",
    )
    assert "w2" not in msg


def test_a_chain_whose_stacks_share_a_name_in_and_out_of_files(tmp_path):
    # `layers.*.w` is [32, 32] in the stack of layers 0-1 and [32, 64] in layer
    # 2: each layer's name says which.
    keys = iter(jax.random.split(jax.random.key(0), 4))
    normal = lambda *shape: jax.random.normal(next(keys), shape)  # noqa: E731
    chain = eqxscan.Chain(
        [Dense(normal(32, 32)), Dense(normal(32, 32)),
         TwoDense(normal(32, 64), normal(64, 32))]
    )  # fmt: skip
    floats = tmp_path / "f.safetensors"
    eqxscan.save(floats, chain)
    got = quant.quantize_file(floats, chain, targets="*.w", kind="int4", group_size=32)
    want = quant.quantize(chain, "*.w", kind="int4", group_size=32)
    _same_bits(got, want)
    quant.save(tmp_path / "q.safetensors", want)
    _same_bits(quant.load(tmp_path / "q.safetensors", want), want)


LLAMA_TARGETS = ["blocks.*.wqkv", "blocks.*.w13", "blocks.*.w2"]


def test_quantize_file_through_a_name_map_equals_quantizing_the_loaded_model(
    tmp_path,
):
    # A Hugging Face Llama checkpoint (its PyTorch names, q/k/v and gate/up
    # apart, `[out, in]`), sharded; every layer's fused weights quantized. Its
    # fused weights share two shapes ([32, 64] and [32, 32]): fewer programs.
    config = llama.Config(vocab=16, dim=32, hidden=32, layers=2, heads=2, kv_heads=1)
    names = llama.torch_names(config)
    model = llama.Llama(config, key=jax.random.key(0))
    eqxscan.save_safetensors(tmp_path, model, names=names, max_shard_size="10KB")
    assert len(os.listdir(tmp_path)) > 3
    like = eqx.filter_eval_shape(llama.Llama, config, key=jax.random.key(1))
    floats = eqxscan.load_safetensors(tmp_path, like, names=names)
    # int8 is the peak test's; "W@x" reads the file's `[out, in]` the other way.
    for kind, group_size, orientation in [("int4", 32, "W@x"), ("fp8", 128, "x@W")]:
        options = dict(kind=kind, group_size=group_size, orientation=orientation)
        got = quant.quantize_file(
            tmp_path, like, name_map=names, targets=LLAMA_TARGETS, **options
        )
        _same_bits(got, quant.quantize(floats, LLAMA_TARGETS, **options))
        assert isinstance(got.blocks.layers.w13, quant.Quantized)
        assert got.blocks.layers.w13.kind == kind


def _float_file(path, dim, num_layers):
    # Drawn with NumPy (no random-number programs for these sizes).
    like = eqx.filter_eval_shape(_mlp, 1, dim, num_layers)
    rng = np.random.default_rng(0)

    def draw(s):
        if not isinstance(s, jax.ShapeDtypeStruct):
            return s
        return rng.standard_normal(s.shape, dtype=np.float32).astype(s.dtype)

    eqxscan.save(path, jax.tree.map(draw, like))
    return like


def test_quantize_file_equals_quantizing_the_loaded_model(tmp_path):
    # int8 in eqxscan's names, several layers (its peak memory is measured in
    # test_quant_memory.py, in a process of its own).
    path = tmp_path / "model.safetensors"
    like = _float_file(path, 128, 4)
    got = quant.quantize_file(path, like, targets=MLP)
    _same_bits(got, quant.quantize(eqxscan.load_safetensors(path, like), MLP))


def test_quantize_file_groups_int4_weights_by_128_by_default(tmp_path):
    # The default group_size, pinned: 128 inputs share a scale (w1 [128, 512]:
    # one group; w2 [512, 128]: 4).
    path = tmp_path / "model.safetensors"
    like = _float_file(path, 128, 2)
    got = quant.quantize_file(path, like, targets=MLP, kind="int4")
    w1, w2 = got.blocks.layers.w1, got.blocks.layers.w2
    assert w1.group_size == w2.group_size == 128
    assert w1.scales.shape == (2, 1, 512) and w2.scales.shape == (2, 4, 128)
    floats = eqxscan.load_safetensors(path, like)
    _same_bits(got, quant.quantize(floats, MLP, kind="int4", group_size=128))


def test_quantize_file_errors_name_the_array(tmp_path):
    path = tmp_path / "model.safetensors"
    model = _mlp()
    w2 = model.blocks.layers.w2
    eqxscan.save(
        path,
        eqx.tree_at(lambda m: m.blocks.layers.w2, model, w2.at[1, 3, 4].set(jnp.nan)),
    )
    with pytest.raises(ValueError) as e:
        quant.quantize_file(path, _mlp(1), targets=MLP)
    first, hint = str(e.value).splitlines()
    assert "'blocks.1.w2'" in first and "holds NaN or inf" in first, first
    # The file fits the model: it holds a NaN, which is said once.
    assert first.startswith("quantize_file: ") and "does not fit" not in first
    assert str(path) in first and hint.startswith("Hint:")
    with pytest.raises(ValueError) as e:
        quant.quantize_file(path, _mlp(1, dim=64), targets=MLP)
    first, hint = str(e.value).splitlines()
    assert (
        "'blocks.0.w1': model has float32[64, 256], checkpoint has float32[32, 128]"
        in first
    )
    assert hint.startswith("Hint:")
    # A float file without a layer of a target: its quantized arrays are the
    # missing keys, and the hint says where they come from (it once asked for
    # like "quantized as the file was", of a float file).
    state = {k: np.asarray(v) for k, v in eqxscan.to_state_dict(model).items()}
    del state["blocks.1.w1"]
    safetensors.numpy.save_file(state, path)
    with pytest.raises(ValueError) as e:
        quant.quantize_file(path, _mlp(1), targets=MLP)
    first, hint = str(e.value).splitlines()
    assert "missing keys: 'blocks.1.w1.values', 'blocks.1.w1.scales'" in first
    assert "'<name>' of the file" in hint and "quantized as the file" not in hint
    with pytest.raises(ValueError, match=r"match no array of the model"):
        quant.quantize_file(path, _mlp(1), targets="blocks.*.wq")
    with pytest.raises(TypeError, match="like must be a model") as e:
        quant.quantize_file(path, None, targets=MLP)
    # The float model's: a quantized like (as quant.load takes) is refused.
    assert "quant.quantize" not in str(e.value).splitlines()[1]
    # A quantized like (quant.load's): the float model is wanted.
    with pytest.raises(ValueError) as e:
        quant.quantize_file(path, _like(), targets=MLP)
    first, hint = str(e.value).splitlines()
    assert "like must be the float model" in first and "`blocks.*.w1`" in first
    assert "eqxscan.quant.load" in hint


@pytest.mark.parametrize("recorded", [True, False])
def test_quantize_file_refuses_a_quantized_file(recorded, tmp_path):
    # Its `.values` and `.scales` were once loaded as they were, whatever
    # kind or orientation was asked for, with none of quant.load's checks.
    path = tmp_path / "q.safetensors"
    if recorded:
        quant.save(path, _quantized("int8"))
    else:  # another writer's, with no record of how
        eqxscan.save_safetensors(path, _quantized("int8"))
    for kind in ("int8", "fp8"):
        with pytest.raises(ValueError) as e:
            quant.quantize_file(path, _mlp(1), targets=MLP, kind=kind)
        first, hint = str(e.value).splitlines()
        assert "holds quantized weights already" in first and str(path) in first
        assert ("`blocks.*.w1` (int8" if recorded else "'blocks.0.w1.values'") in first
        assert "eqxscan.quant.load" in hint


def test_a_float_load_of_a_quantized_file_points_to_quant_load(tmp_path):
    # Its missing and unexpected keys came with no hint.
    path = tmp_path / "q.safetensors"
    quant.save(path, _quantized("int8"))
    for load in (eqxscan.load_safetensors, eqxscan.load):
        with pytest.raises(ValueError) as e:
            load(path, _mlp(1))
        first, hint = str(e.value).splitlines()
        assert "does not fit the model" in first and "'blocks.0.w1.values'" in first
        assert "holds quantized weights" in hint and "eqxscan.quant.load" in hint


def test_truncated_or_corrupted_files_are_refused_and_named(tmp_path):
    path = tmp_path / "q.safetensors"
    quant.save(path, _quantized("fp8"))
    like = _like("fp8")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    for n in (0, 9, 200, len(data) // 2, len(data) - 1):
        cut.write_bytes(data[:n])
        _refused(cut, like, "is corrupt", error=CorruptFileError)
    # A flipped bit in a layer's fp8 values: its digest.
    header = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + header])["blocks.1.w1.values"]["data_offsets"]
    flipped = bytearray(data)
    flipped[8 + header + begin + 5] ^= 0x10
    cut.write_bytes(bytes(flipped))
    _refused(
        cut,
        like,
        "'blocks.1.w1.values' does not match its SHA-256 digest",
        error=CorruptFileError,
    )
    # A record that is not eqxscan.quant.save's.
    _rewrite(path, metadata={"eqxscan.quant": "{not json"})
    _refused(
        path,
        like,
        # The file itself (its name was joined to itself).
        f"file '{path}' has a metadata entry 'eqxscan.quant' that is not what "
        "eqxscan.quant.save writes",
        error=CorruptFileError,
    )
    # One shard's record damaged: that shard is named, not an intact one.
    shards = tmp_path / "shards"
    quant.save(shards, _quantized("fp8"), max_shard_size="2KB")
    names = sorted(p.name for p in shards.glob("*.safetensors"))
    assert len(names) > 2
    # Only that entry changed in its header, the rest of the file kept.
    raw = (shards / names[1]).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    head["__metadata__"]["eqxscan.quant"] = "{not json"
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    (shards / names[1]).write_bytes(
        len(text).to_bytes(8, "little") + text + raw[8 + n :]
    )
    _refused(
        shards / "model.safetensors.index.json",
        like,
        f"'{names[1]}' differs from '{names[0]}'",
        error=CorruptFileError,
    )


def test_an_interrupted_save_leaves_the_previous_file_loadable(tmp_path, monkeypatch):
    path = tmp_path / "q.safetensors"
    old, new = _quantized("int4", 32), _quantized("int4", 32, seed=1)
    quant.save(path, old)
    before = path.read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)  # how each file's bytes are written
    with pytest.raises(OSError) as e:
        quant.save(path, new)
    monkeypatch.undo()
    assert e.value.errno == 28 and str(path) in str(e.value)
    assert os.listdir(tmp_path) == ["q.safetensors"]  # no temporary file left
    assert path.read_bytes() == before
    _same_bits(quant.load(path, _like("int4", 32)), old)


def test_an_abstract_model_quantizes_to_the_like_of_its_file(tmp_path):
    # A model of ShapeDtypeStructs: quantize raised JAX's "not a valid JAX type"
    # and dequantize an AttributeError.
    path = tmp_path / "q.safetensors"
    quant.save(path, _quantized("int4", 32))
    abstract = eqx.filter_eval_shape(_mlp)
    like = quant.quantize(abstract, MLP, kind="int4", group_size=32)
    expected = eqx.filter_eval_shape(
        quant.quantize, _mlp(), MLP, kind="int4", group_size=32
    )
    assert eqx.tree_equal(like, expected)
    _same_bits(quant.load(path, like), _quantized("int4", 32))
    assert eqx.tree_equal(quant.dequantize(like), abstract)


def test_shards_of_two_saves_are_refused(tmp_path):
    # A shard without the record, under an index of another writer (no save
    # id to tell the saves apart): which quantization it holds is not known.
    written = quant.save(tmp_path, _quantized("int8"), max_shard_size="10KB")
    _rewrite(written[1])
    index = json.loads(pathlib.Path(written[-1]).read_text())
    del index["metadata"]["eqxscan.save"]
    pathlib.Path(written[-1]).write_text(json.dumps(index))
    _refused(
        tmp_path,
        _like("int8"),
        "record different quantizations in their metadata 'eqxscan.quant'",
        error=CorruptFileError,
    )


@pytest.mark.parametrize("specs_kept", [False, True])
def test_fp8_values_stored_as_float8_load_as_their_codes(tmp_path, getkey, specs_kept):
    # quant.save writes fp8 codes as uint8; a file whose `values` were converted
    # to safetensors' F8_E4M3 (the same bytes) was refused as "does not fit",
    # and, its metadata kept (the shapes and dtypes eqxscan's writer records,
    # the digests), as corrupt.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(8, 8, key=k), 3, key=getkey())
    model = quant.quantize(stack, "*.weight", kind="fp8")
    quant.save(tmp_path / "u8.safetensors", model)
    raw = (tmp_path / "u8.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    for name, entry in header.items():
        if name.endswith(".values"):
            assert entry["dtype"] == "U8"
            entry["dtype"] = "F8_E4M3"
    if not specs_kept:  # as another writer leaves it
        del header["__metadata__"]["eqxscan.specs"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    converted = len(text).to_bytes(8, "little") + text + raw[8 + size :]
    (tmp_path / "f8.safetensors").write_bytes(converted)
    like = eqx.filter_eval_shape(quant.quantize, stack, "*.weight", kind="fp8")
    loaded = quant.load(tmp_path / "f8.safetensors", like)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(model)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
