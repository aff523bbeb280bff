"""int4 values held native (`jnp.int4`, the TPU's own type) against packed (two
a byte in uint8, as files hold them): the same numbers, products, gradients and
files, whichever a model holds; and int4 with a scale per output channel
(`group_size=None`) against NumPy."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import safetensors

import eqxscan
from eqxscan import quant
from eqxscan.quant._products import native_grouped_product

from .test_quant import _nibbles, Holder


TARGETS = ["blocks.*.w1", "blocks.*.w2"]


def _mlp(dtype=jnp.float32, dim=64):
    return eqxscan.StackedMLP(dim, 3, key=jr.key(0), dtype=dtype)


@pytest.mark.parametrize("orientation", ["x@W", "W@x"])
def test_native_values_are_the_packed_nibbles(getkey, orientation):
    w = jr.normal(getkey(), (2, 64, 24))
    if orientation == "W@x":
        w = jnp.swapaxes(w, -1, -2)
    stack = eqxscan.Stacked.from_layers([Holder(wi) for wi in w])
    kw = dict(kind="int4", group_size=32, orientation=orientation)
    packed = quant.quantize(stack, "*.w", **kw, int4_storage="packed").layers.w
    native = quant.quantize(stack, "*.w", **kw, int4_storage="native").layers.w
    assert packed.values.dtype == jnp.uint8 and not packed.native
    assert native.values.dtype == jnp.int4 and native.native
    assert native.shape == packed.shape == w.shape
    # NumPy's reading of the packed bytes, in the `[in, out]` layout.
    in_out = lambda a: a if orientation == "x@W" else np.swapaxes(a, -1, -2)
    codes = in_out(_nibbles(in_out(np.asarray(packed.values))))
    # "x@W" holds each group of 32 inputs as its own slice: `[L, 2, 32, out]`.
    if orientation == "x@W":
        codes = codes.reshape(2, 2, 32, 24)
    assert native.split == (orientation == "x@W") and native.ndim == 3
    np.testing.assert_array_equal(np.asarray(native.values, np.int8), codes)
    np.testing.assert_array_equal(native.scales, packed.scales)
    np.testing.assert_array_equal(native.dequantize(), packed.dequantize())
    # Converted either way, bit for bit.
    back = quant.with_int4_storage(Holder(native), "packed").w
    np.testing.assert_array_equal(back.values, packed.values)
    there = quant.with_int4_storage(Holder(packed), "native").w
    np.testing.assert_array_equal(np.asarray(there.values, np.int8), codes)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_model_runs_as_the_packed_one_scanned_and_looped(dtype):
    model = _mlp(dtype)
    packed = quant.quantize(model, TARGETS, kind="int4", group_size=32,
                            int4_storage="packed")  # fmt: skip
    native = quant.with_int4_storage(packed, "native")
    x = jr.normal(jr.key(1), (5, 64)).astype(dtype)
    call = eqx.filter_jit(lambda m, x: m(x))
    want = np.asarray(call(packed, x), np.float32)
    for mode in ("scan", "loop"):
        m = eqx.tree_at(
            lambda m: m.blocks, native, native.blocks.with_options(mode=mode)
        )
        got = np.asarray(call(m, x), np.float32)
        tol = 1e-5 if dtype == jnp.float32 else 5e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)

    # Gradients (to the input and to the float arrays), against finite
    # differences of the same quantized model.
    def loss(m, x):
        return jnp.mean(m(x).astype(jnp.float32) ** 2)

    if dtype == jnp.float32:
        g_native = eqx.filter_grad(loss)(native, x)
        g_packed = eqx.filter_grad(loss)(packed, x)
        for a, b in zip(jax.tree.leaves(g_native), jax.tree.leaves(g_packed)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        gx = jax.grad(lambda x: loss(native, x))(x)
        d = jr.normal(jr.key(2), x.shape)
        eps = 1e-3
        fd = (loss(native, x + eps * d) - loss(native, x - eps * d)) / (2 * eps)
        np.testing.assert_allclose(jnp.vdot(gx, d), fd, rtol=2e-3)


@pytest.mark.parametrize("group_size", [32, 64])
def test_native_grouped_product_matches_the_dequantized_weight(getkey, group_size):
    # The product accelerators run for native values (batched over groups,
    # scaled per group), here in float32 on CPU.
    w = jr.normal(getkey(), (128, 48))
    q = quant.quantize(Holder(w), "w", kind="int4", group_size=group_size,
                       int4_storage="native").w  # fmt: skip
    x = jr.normal(getkey(), (2, 3, 128))
    got = native_grouped_product(x, q.values, q.scales, jnp.float32)
    want = x @ q.dequantize()
    np.testing.assert_allclose(got, want, atol=1e-6 * float(jnp.abs(want).max()))
    one = quant.quantize(Holder(w[:32]), "w", kind="int4", group_size=32,
                         int4_storage="native").w  # fmt: skip
    got = native_grouped_product(x[..., :32], one.values, one.scales, jnp.float32)
    want = x[..., :32] @ one.dequantize()
    np.testing.assert_allclose(got, want, atol=1e-6 * float(jnp.abs(want).max()))
    # No inputs: no groups, a zero product.
    empty = quant.quantize(Holder(w[:0]), "w", kind="int4", group_size=32,
                           int4_storage="native").w  # fmt: skip
    got = native_grouped_product(x[..., :0], empty.values, empty.scales, jnp.float32)
    np.testing.assert_array_equal(got, np.zeros((2, 3, 48)))


def test_kernel_option_runs_the_xla_path_for_native_values():
    native = quant.quantize(_mlp(), TARGETS, kind="int4", group_size=32,
                            int4_storage="native")  # fmt: skip
    x = jr.normal(jr.key(1), (8, 64))
    got = quant.with_kernel(native, "interpret")(x)
    np.testing.assert_array_equal(got, native(x))


def test_files_hold_int4_packed_whichever_the_model_holds(tmp_path):
    packed = quant.quantize(_mlp(), TARGETS, kind="int4", group_size=32,
                            int4_storage="packed")  # fmt: skip
    native = quant.with_int4_storage(packed, "native")
    quant.save(tmp_path / "n.safetensors", native)
    quant.save(tmp_path / "p.safetensors", packed)
    with safetensors.safe_open(tmp_path / "n.safetensors", framework="np") as f:
        n = {k: f.get_tensor(k) for k in f.keys()}
    with safetensors.safe_open(tmp_path / "p.safetensors", framework="np") as f:
        p = {k: f.get_tensor(k) for k in f.keys()}
    assert n.keys() == p.keys() and n["blocks.0.w1.values"].dtype == np.uint8
    for k in n:
        np.testing.assert_array_equal(n[k], p[k])
    # Loaded as the `like` holds them, abstract or concrete.
    like_native = eqx.filter_eval_shape(lambda: native)
    for like, is_native in ((like_native, True), (packed, False), (native, True)):
        loaded = quant.load(tmp_path / "n.safetensors", like)
        w1 = loaded.blocks.layers.w1
        assert w1.native == is_native
        want = native if is_native else packed
        np.testing.assert_array_equal(
            np.asarray(w1.values, np.int8),
            np.asarray(want.blocks.layers.w1.values, np.int8),
        )


def test_quantize_file_holds_int4_as_asked(tmp_path):
    model = _mlp()
    eqxscan.save_safetensors(tmp_path / "f.safetensors", model)
    like = eqx.filter_eval_shape(_mlp)
    kw = dict(targets=TARGETS, kind="int4", group_size=32)
    got = quant.quantize_file(tmp_path / "f.safetensors", like, **kw,
                              int4_storage="native")  # fmt: skip
    want = quant.quantize(model, TARGETS, kind="int4", group_size=32,
                          int4_storage="native")  # fmt: skip
    assert got.blocks.layers.w2.native
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(
            np.asarray(a, np.float32), np.asarray(b, np.float32)
        )


def test_auto_is_native_on_a_tpu_only(monkeypatch):
    model = _mlp()
    q = quant.quantize(model, TARGETS, kind="int4", group_size=32)
    assert not q.blocks.layers.w1.native  # a CPU
    assert not quant.with_int4_storage(q, "auto").blocks.layers.w1.native
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert quant.quantize(
        model, TARGETS, kind="int4", group_size=32
    ).blocks.layers.w1.native
    assert quant.with_int4_storage(q, "auto").blocks.layers.w1.native
    # Other kinds are held as they are.
    q8 = quant.quantize(model, TARGETS, kind="int8")
    assert (
        quant.with_int4_storage(q8, "native").blocks.layers.w1.values.dtype == jnp.int8
    )


def test_bad_storage_and_native_values_elsewhere_are_refused():
    model = _mlp()
    with pytest.raises(ValueError, match="int4 storage must be 'auto' or one of"):
        quant.quantize(model, TARGETS, kind="int4", int4_storage="nibbles")
    q = quant.quantize(model, TARGETS, kind="int4", group_size=32)
    with pytest.raises(ValueError, match=r"with_int4_storage: int4 storage must"):
        quant.with_int4_storage(q, "int4")
    native = quant.with_int4_storage(q, "native").blocks.layers.w1
    with pytest.raises(ValueError, match="'int8' values must be int8 with 2 axes"):
        quant.Quantized(native.values, native.scales[..., :1, :], "int8", "x@W", None,
                        jnp.float32)  # fmt: skip
    # Split values must be `[in // g, g, out]` with g the group size.
    split = quant.with_int4_storage(q, "native").blocks.layers.w1
    assert split.split and split.values.shape == (3, 2, 32, 256)
    regrouped = split.values.reshape(3, 4, 16, 256)
    with pytest.raises(ValueError, match=r"`\[in // g, g, out\]` for 'x@W' with g"):
        quant.Quantized(regrouped, split.scales, "int4", "x@W", 32, jnp.float32)
    # ... and not `[in, out]`: one native layout for each case.
    flat = split.values.reshape(3, 64, 256)
    with pytest.raises(ValueError, match="native int4 values are `"):
        quant.Quantized(flat, split.scales, "int4", "x@W", 32, jnp.float32)
    # eqxscan.save has no 4-bit dtype to write: refused before writing, with
    # the way that packs them.
    with pytest.raises(TypeError, match="eqxscan.quant.save"):
        eqxscan.save_safetensors(
            "unused.safetensors", quant.with_int4_storage(q, "native")
        )


@pytest.mark.parametrize("storage", ["packed", "native"])
@pytest.mark.parametrize("orientation", ["x@W", "W@x"])
def test_int4_per_channel_layout_bound_and_products(getkey, storage, orientation):
    w = jr.normal(getkey(), (2, 64, 24)) * jnp.exp(jr.normal(getkey(), (1, 1, 24)))
    w = w.at[1, :, 3].set(0.0)
    wn = np.asarray(w)
    if orientation == "W@x":
        w = jnp.swapaxes(w, -1, -2)
    stack = eqxscan.Stacked.from_layers([Holder(wi) for wi in w])
    kw = dict(kind="int4", group_size=None, orientation=orientation)
    q = quant.quantize(stack, "*.w", **kw, int4_storage=storage).layers.w
    in_out = lambda a: np.asarray(
        a if orientation == "x@W" else jnp.swapaxes(a, -1, -2)
    )
    amax = np.abs(wn).max(axis=1, keepdims=True)
    scale = np.where(amax == 0, 1.0, amax / 7)
    np.testing.assert_array_equal(in_out(q.scales), scale)  # [L, 1, out]
    values = in_out(q.values)
    codes = values.astype(np.int8) if storage == "native" else _nibbles(values)
    np.testing.assert_array_equal(codes, np.clip(np.round(wn / scale), -7, 7))
    err = np.abs(in_out(q.dequantize()) - wn)
    assert np.all(err <= scale / 2 * (1 + 1e-5))
    # One layer's products (and the accelerators' product), against its weight.
    one = jax.tree.map(lambda a: a[1], q)
    dense = one.dequantize()
    x = jr.normal(getkey(), (3, 64))
    if orientation == "x@W":
        np.testing.assert_allclose(x @ one, x @ dense, rtol=1e-5, atol=1e-5)
        if storage == "native":
            got = native_grouped_product(x, one.values, one.scales, jnp.float32)
            np.testing.assert_allclose(got, x @ dense, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(one @ x.T, dense @ x.T, rtol=1e-5, atol=1e-5)


def test_int4_per_channel_files_record_no_group(tmp_path):
    model = _mlp()
    q = quant.quantize(model, TARGETS, kind="int4", group_size=None)
    path = tmp_path / "c.safetensors"
    quant.save(path, q)
    with safetensors.safe_open(path, framework="np") as f:
        record = json.loads(f.metadata()["eqxscan.quant"])
    assert {r["group_size"] for r in record.values()} == {None}
    loaded = quant.load(path, q)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(q)):
        np.testing.assert_array_equal(a, b)
    grouped = eqx.filter_eval_shape(
        quant.quantize, model, TARGETS, kind="int4", group_size=32
    )
    with pytest.raises(
        ValueError, match="int4, a scale per channel, x@W, float32 in the file"
    ):
        quant.load(path, grouped)


def test_the_kernel_leaves_per_channel_int4_to_xla(getkey):
    # The Pallas kernel reads scales by group: a per-channel weight of a shape
    # it takes (128 outputs) runs the XLA path, with the same result.
    w = jr.normal(getkey(), (256, 128))
    q = quant.quantize(Holder(w), "w", kind="int4", group_size=None)
    x = jr.normal(getkey(), (8, 256))
    by_kernel = quant.with_kernel(q, "interpret").w
    np.testing.assert_array_equal(x @ by_kernel, x @ q.w)
    assert "pallas" not in str(jax.make_jaxpr(lambda x: x @ by_kernel)(x))


def test_orbax_checkpoints_hold_native_int4_bit_for_bit(tmp_path):
    # A TPU's default storage through the sharded checkpoints: restored as held.
    from eqxscan.checkpoint import CheckpointManager

    q = quant.quantize(_mlp(), TARGETS, kind="int4", group_size=32,
                       int4_storage="native")  # fmt: skip
    mesh = jax.make_mesh((1,), ("fsdp",))
    with CheckpointManager(tmp_path / "ck", asynchronous=False) as manager:
        manager.save(3, q, wait=True)
        restored, _, step = manager.restore(eqx.filter_eval_shape(lambda: q), mesh=mesh)
    assert step == 3 and restored.blocks.layers.w1.native
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
    assert len(arrays(restored)) == len(arrays(q)) == 5  # 2 x (values, scales), scale
    for a, b in zip(arrays(restored), arrays(q)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(
            np.asarray(a, np.float32), np.asarray(b, np.float32)
        )


def test_split_values_shard_their_groups_as_the_float_weights_inputs():
    # `model_shardings` of a native model: the float weight's spec, with the
    # split `[L, groups, g, out]` values unsharded along `g`.
    from eqxscan import sharding

    model = _mlp(dim=128)
    q = quant.quantize(model, TARGETS, kind="int4", group_size=32,
                       int4_storage="native")  # fmt: skip
    assert q.blocks.layers.w1.values.shape == (3, 4, 32, 512)
    mesh = sharding.make_mesh(fsdp=1)
    floats = sharding.model_shardings(model, mesh, min_size=0).blocks.layers
    got = sharding.model_shardings(q, mesh, min_size=0).blocks.layers
    pad = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))  # noqa: E731
    for name in ("w1", "w2"):
        spec = pad(getattr(floats, name).spec, 3)
        assert "fsdp" in spec  # a sharded axis to follow
        assert pad(getattr(got, name).values.spec, 4) == (*spec[:2], None, spec[2])
        assert pad(getattr(got, name).scales.spec, 3) == spec


def test_equinox_serialisation_of_native_int4_never_reads_other_values(tmp_path):
    # NumPy has no 4-bit type: Equinox's files cannot read native values back.
    # The documented way round (packed on disk) is exact, and the direct way
    # may fail but never loads other numbers.
    native = quant.quantize(_mlp(), TARGETS, kind="int4", group_size=32,
                            int4_storage="native")  # fmt: skip
    other = quant.quantize(eqxscan.StackedMLP(64, 3, key=jr.key(5)), TARGETS,
                           kind="int4", group_size=32)  # fmt: skip
    x = jr.normal(jr.key(1), (4, 64))
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, quant.with_int4_storage(native, "packed"))
    like = quant.with_int4_storage(other, "packed")
    back = quant.with_int4_storage(eqx.tree_deserialise_leaves(path, like), "native")
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for a, b in zip(arrays(back), arrays(native), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), b.astype(np.float32))
    np.testing.assert_array_equal(back(x), native(x))
    eqx.tree_serialise_leaves(path, native)
    try:
        direct = eqx.tree_deserialise_leaves(
            path, quant.with_int4_storage(other, "native")
        )
    except Exception as e:  # Equinox names the leaf
        assert "w1.values" in str(e)
    else:
        np.testing.assert_array_equal(direct(x), native(x))


def test_abstract_conversions_keep_the_placement():
    # `eval_shape` drops shardings: a converted abstract weight is described
    # where the held one would lie (the groups of split values as the inputs,
    # `g` unsharded), with its scales as they were.
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eqxscan import sharding

    mesh = sharding.make_mesh(fsdp=1)
    layers = quant.quantize(_mlp(dim=128), TARGETS, kind="int4", group_size=32,
                            int4_storage="packed").blocks.layers  # fmt: skip
    placed = lambda a, spec: jax.ShapeDtypeStruct(  # noqa: E731
        a.shape, a.dtype, sharding=NamedSharding(mesh, P(*spec))
    )
    # w2 sharded along its inputs, w1 along its outputs.
    for q, spec, split in [
        (layers.w2, (None, "fsdp", None), (None, "fsdp", None, None)),
        (layers.w1, (None, None, "fsdp"), (None, None, None, "fsdp")),
    ]:
        abstract = eqx.tree_at(
            lambda q: (q.values, q.scales),
            q,
            (placed(q.values, spec), placed(q.scales, spec)),
        )
        native = quant.with_int4_storage(abstract, "native")
        assert native.values.ndim == 4 and native.split
        assert native.values.sharding.spec == P(*split)
        assert native.scales.sharding == abstract.scales.sharding
        back = quant.with_int4_storage(native, "packed")
        assert back.values.shape == q.values.shape
        assert back.values.sharding.spec == P(*spec)


def test_eqxscan_load_of_a_quantized_file_into_a_native_model_points_to_quant_load(
    tmp_path,
):
    # Files hold int4 packed: the generic loader cannot fit them to native
    # values, and says which loader can.
    native = quant.quantize(_mlp(), TARGETS, kind="int4", group_size=32,
                            int4_storage="native")  # fmt: skip
    path = tmp_path / "q.safetensors"
    quant.save(path, native)
    with pytest.raises(ValueError) as e:
        eqxscan.load(path, native)
    message = str(e.value)
    assert "'blocks.0.w1.values': model has int4[2, 32, 256]" in message
    assert message.splitlines()[-1].startswith("Hint: the file holds quantized")
    assert "eqxscan.quant.load(path, like)" in message
    back = quant.load(path, native)
    np.testing.assert_array_equal(back(jnp.ones((2, 64))), native(jnp.ones((2, 64))))
