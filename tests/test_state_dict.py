import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqxscan

from .helpers import tree_allclose


def _mlp(key, num_layers=3, dim=4, **kw):
    return eqxscan.StackedMLP(dim, num_layers, key=key, **kw)


class DenseReLU(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, *, key):
        self.linear = eqx.nn.Linear(2, 2, key=key)

    def __call__(self, x):
        return jax.nn.relu(self.linear(x))


# The two-layer worked example of docs/concepts.md: [1, -2] -> [1, 1] -> [2, 0].
W1, B1 = np.array([[1.0, 0.0], [0.0, -1.0]], np.float32), np.array([0.0, -1.0])
W2, B2 = np.array([[1.0, 1.0], [-1.0, -1.0]], np.float32), np.array([0.0, 0.0])


def test_names_follow_layers_not_the_stacked_axis(getkey):
    model = _mlp(getkey())
    state = eqxscan.to_state_dict(model)
    assert list(state) == [
        f"blocks.{i}.{name}" for i in range(3) for name in ("w1", "w2", "scale")
    ]
    for i in range(3):
        np.testing.assert_array_equal(
            state[f"blocks.{i}.w1"], model.blocks.layers.w1[i]
        )
        np.testing.assert_array_equal(state[f"blocks.{i}.w2"], model.blocks[i].w2)
        assert state[f"blocks.{i}.w1"].shape == (4, 16)
        assert isinstance(state[f"blocks.{i}.scale"], np.ndarray)


def test_round_trip_into_another_model(getkey):
    model, other = _mlp(getkey()), _mlp(getkey())
    assert not tree_allclose(model, other)
    loaded = eqxscan.from_state_dict(other, eqxscan.to_state_dict(model))
    assert eqx.tree_equal(loaded, model)
    x = jr.normal(getkey(), (4,))
    np.testing.assert_array_equal(loaded(x), model(x))


def test_state_dict_matches_a_list_of_unstacked_layers(getkey):
    # The per-layer names are the names a plain list of layers would get.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(3, 3, key=k), 4, key=getkey())
    as_list = {"blocks": stack.unstack()}
    from_stack = eqxscan.to_state_dict({"blocks": stack})
    from_list = eqxscan.to_state_dict(as_list)
    assert list(from_stack) == list(from_list)
    for k in from_stack:
        np.testing.assert_array_equal(from_stack[k], from_list[k])


class Nested(eqx.Module):
    towers: list
    inner: eqxscan.Stacked
    table: dict
    pair: tuple
    act: object = jax.nn.relu

    def __init__(self, key):
        k = jr.split(key, 5)
        self.towers = [
            eqxscan.Stacked(lambda kk: eqx.nn.Linear(2, 2, key=kk), 2, key=k[0]),
            eqx.nn.Linear(2, 3, use_bias=False, key=k[1]),
        ]
        # A Stacked of layers that themselves hold a Stacked: two layer indices.
        self.inner = eqxscan.Stacked(
            lambda kk: eqxscan.Stacked(
                lambda kkk: eqx.nn.Linear(2, 2, key=kkk), 3, key=kk
            ),
            2,
            key=k[2],
        )
        self.table = {"final": jnp.ones(2), "gain": 2.0}
        self.pair = (jnp.zeros(1), None)


def test_nested_containers_and_nested_stacks(getkey):
    model = Nested(getkey())
    state = eqxscan.to_state_dict(model)
    inner = {
        f"inner.{i}.{j}.{n}"
        for i in range(2)
        for j in range(3)
        for n in ("weight", "bias")
    }
    assert set(state) == inner | {
        "towers.0.0.weight",
        "towers.0.0.bias",
        "towers.0.1.weight",
        "towers.0.1.bias",
        "towers.1.weight",
        "table.final",
        "pair.0",
    }
    np.testing.assert_array_equal(
        state["inner.1.2.weight"], model.inner.layers.layers.weight[1, 2]
    )
    np.testing.assert_array_equal(state["inner.1.2.weight"], model.inner[1][2].weight)
    loaded = eqxscan.from_state_dict(Nested(getkey()), state)
    assert eqx.tree_equal(loaded, model)
    assert loaded.table["gain"] == 2.0 and loaded.pair[1] is None


def test_missing_and_unexpected_keys_are_named(getkey):
    model = _mlp(getkey())
    state = eqxscan.to_state_dict(model)
    del state["blocks.1.w2"]
    state["blocks.1.bias"] = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="missing keys: 'blocks.1.w2'") as e:
        eqxscan.from_state_dict(model, state)
    assert "unexpected keys: 'blocks.1.bias'" in str(e.value)


def test_jax_arrays_are_accepted_as_values(getkey):
    model = _mlp(getkey())
    state = {k: jnp.asarray(v) for k, v in eqxscan.to_state_dict(model).items()}
    assert eqx.tree_equal(eqxscan.from_state_dict(_mlp(getkey()), state), model)


def test_wrong_shape_and_dtype_are_named(getkey):
    model = _mlp(getkey())
    state = eqxscan.to_state_dict(model)
    state["blocks.2.w1"] = np.zeros((4, 8), np.float32)
    state["blocks.0.scale"] = state["blocks.0.scale"].astype(np.float16)
    with pytest.raises(ValueError) as e:
        eqxscan.from_state_dict(model, state)
    msg = str(e.value)
    assert (
        "'blocks.2.w1': model has float32[4, 16], checkpoint has float32[4, 8]" in msg
    )
    assert "'blocks.0.scale': model has float32[4], checkpoint has float16[4]" in msg
    assert "wrong shape or dtype" in msg and "Hint" not in msg
    # Only dtypes differ (pretrained bfloat16 weights): said so, with the cast.
    state["blocks.2.w1"] = state["blocks.1.w1"]
    with pytest.raises(ValueError, match=r"wrong dtype \(their shapes fit\)") as e:
        eqxscan.from_state_dict(model, state)
    assert "dtype=jnp.float32 casts" in str(e.value)


def _first_layers(model, num_layers):
    # Cheaper than building another model: its first layers, as a StackedMLP.
    return eqx.tree_at(lambda m: m.blocks, model, model.blocks[:num_layers])


@pytest.mark.parametrize("saved_depth", [6, 2])
def test_depth_mismatch_names_both_depths(getkey, saved_depth):
    deep = _mlp(getkey(), num_layers=6)
    model = _first_layers(deep, 4)
    state = eqxscan.to_state_dict(_first_layers(deep, saved_depth))
    with pytest.raises(
        ValueError,
        match=f"model has L=4 layers in blocks, checkpoint has {saved_depth}",
    ):
        eqxscan.from_state_dict(model, state)


def test_depth_mismatch_of_a_nested_stack(getkey):
    model = Nested(getkey())
    state = eqxscan.to_state_dict(model)
    state.update({f"inner.{i}.3.weight": state["inner.0.0.weight"] for i in range(2)})
    with pytest.raises(
        ValueError, match=r"model has L=3 layers in inner\.\*, checkpoint has 4"
    ):
        eqxscan.from_state_dict(model, state)


def test_depth_mismatch_of_a_top_level_chain(getkey):
    # A Chain, named as such, not as a Stacked.
    layers = [eqx.nn.Linear(2, 2, key=k) for k in jr.split(getkey(), 3)]
    state = eqxscan.to_state_dict(eqxscan.Chain(layers))
    with pytest.raises(
        ValueError, match="model has L=2 layers in the top-level Chain, c"
    ):
        eqxscan.from_state_dict(eqxscan.Chain(layers[:2]), state)


class Positive(eqx.Module):
    scale: jax.Array

    def __check_init__(self):
        if not bool(jnp.all(self.scale > 0)):
            raise ValueError(f"scale must be positive, got {self.scale}")


def test_check_init_runs_again_after_loading(getkey):
    stack = eqxscan.Stacked(lambda k: Positive(jnp.ones(2)), 3, key=getkey())
    model = {"top": Positive(jnp.ones(2)), "stack": stack}
    state = eqxscan.to_state_dict(model)
    eqxscan.from_state_dict(model, state)  # fine
    bad = dict(state, **{"stack.1.scale": np.array([1.0, -1.0], np.float32)})
    with pytest.raises(ValueError, match="scale must be positive"):
        eqxscan.from_state_dict(model, bad)
    bad = dict(state, **{"top.scale": np.array([0.0, 1.0], np.float32)})
    with pytest.raises(ValueError, match="scale must be positive"):
        eqxscan.from_state_dict(model, bad)
    # Into a template of zeros, which fails the same check itself.
    zeros = jax.tree.map(jnp.zeros_like, model)
    with pytest.raises(ValueError, match="scale must be positive"):
        eqxscan.from_state_dict(zeros, bad)


def test_gradient_trees_load_into_gradient_trees(getkey):
    # `eqx.filter` (and gradients) leave `None` where a module held no float
    # array: a Quantized weight's int8 values. Its checks cannot run there; the
    # checks of whole modules still do.
    model = {
        "q": eqxscan.quant.quantize(_mlp(getkey()), "blocks.*.w1", kind="int8"),
        "top": Positive(jnp.ones(2)),
    }
    grads = jax.tree.map(lambda a: a + 1, eqx.filter(model, eqx.is_inexact_array))
    assert grads["q"].blocks.layers.w1.values is None
    state = eqxscan.to_state_dict(grads)
    back = eqxscan.from_state_dict(eqx.filter(model, eqx.is_inexact_array), state)
    assert jax.tree.structure(back) == jax.tree.structure(grads)
    assert tree_allclose(back, grads)
    bad = dict(state, **{"top.scale": np.array([0.0, 1.0], np.float32)})
    with pytest.raises(ValueError, match="scale must be positive"):
        eqxscan.from_state_dict(grads, bad)


def test_masked_optimizer_states_load(getkey):
    # optax.masked leaves a MaskedNode where the mask is False: here a Quantized
    # weight's int8 values. Loading its state ran the Quantized's checks, which
    # read the values it does not hold, and failed.
    model = eqxscan.quant.quantize(_mlp(getkey()), "blocks.*.w1", kind="int8")
    mask = jax.tree.map(eqx.is_inexact_array, model)
    state = optax.masked(optax.adam(1e-2), mask).init(eqx.filter(model, eqx.is_array))
    mu = state.inner_state[0].mu.blocks.layers.w1
    assert isinstance(mu.values, optax.MaskedNode) and mu.scales.shape == (3, 1, 16)
    state = jax.tree.map(lambda a: a + 1, state)
    back = eqxscan.from_state_dict(state, eqxscan.to_state_dict(state))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert tree_allclose(back, state)


def test_load_into_abstract_model(getkey):
    model = _mlp(getkey(), dtype=jnp.bfloat16)
    like = eqx.filter_eval_shape(_mlp, jr.key(0), dtype=jnp.bfloat16)
    assert isinstance(like.blocks.layers.w1, jax.ShapeDtypeStruct)
    loaded = eqxscan.from_state_dict(like, eqxscan.to_state_dict(model))
    assert eqx.tree_equal(loaded, model)
    with pytest.raises(TypeError, match="abstract"):
        eqxscan.to_state_dict(like)


def test_sharding_of_like_is_kept(getkey):
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    sharding = NamedSharding(mesh, P(None, "d"))
    model = _mlp(getkey())
    like = eqx.tree_at(
        lambda m: m.blocks.layers.w1,
        model,
        jax.device_put(model.blocks.layers.w1, sharding),
    )
    loaded = eqxscan.from_state_dict(like, eqxscan.to_state_dict(model))
    assert loaded.blocks.layers.w1.sharding == sharding
    np.testing.assert_array_equal(loaded.blocks.layers.w1, model.blocks.layers.w1)


def test_bad_leaves_are_named():
    with pytest.raises(ValueError, match="contain no '.'"):
        eqxscan.to_state_dict({"a.b": jnp.ones(1)})


class _Noisy(eqx.Module):
    # A layer holding its own typed PRNG key (for dropout, say).
    w: jax.Array
    key: jax.Array

    def __call__(self, x):
        return x @ self.w + jr.normal(self.key, x.shape)


def _data(x):
    return jr.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def test_typed_prng_keys_round_trip_as_their_data(tmp_path):
    # Keys were refused ("typed PRNG keys have no NumPy dtype"): a model or
    # optimizer state holding one (optax.add_noise) could not be saved.
    def make(seed):
        key = jr.key(seed)
        stack = eqxscan.Stacked(
            lambda k: _Noisy(jr.normal(k, (3, 3)), jr.fold_in(k, 1)), 2, key=key
        )
        rbg = jr.split(jr.key(seed, impl="rbg"), 3)
        return {"stack": stack, "rng": jr.fold_in(key, 7), "rbg": rbg}

    model, like = make(1), make(2)
    state = eqxscan.to_state_dict(model)
    assert state["stack.1.key"].dtype == np.uint32
    assert state["stack.1.key"].shape == (2,) and state["rbg"].shape == (3, 4)
    np.testing.assert_array_equal(
        state["stack.1.key"], jr.key_data(model["stack"].layers.key[1])
    )
    path = tmp_path / "keys.safetensors"
    eqxscan.save(path, model)
    for loaded in (
        eqxscan.from_state_dict(like, state),
        eqxscan.from_state_dict(eqx.filter_eval_shape(make, 2), state),
        eqxscan.load(path, like),
    ):
        assert jr.key_impl(loaded["rbg"]) == jr.key_impl(model["rbg"])
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(_data(a), _data(b))
        x = jnp.ones(3)
        np.testing.assert_array_equal(loaded["stack"](x), model["stack"](x))
    # Keys of another implementation in the file: named, not wrapped wrongly.
    with pytest.raises(ValueError, match=r"'rng': model has uint32\[4\]"):
        eqxscan.from_state_dict({"rng": jr.key(0, impl="rbg")}, {"rng": state["rng"]})


def test_save_load_round_trip_keeps_bfloat16(getkey, tmp_path):
    model = _mlp(getkey(), dtype=jnp.bfloat16)
    path = tmp_path / "model.safetensors"
    assert eqxscan.save(path, model) == [str(path)]
    loaded = eqxscan.load(path, _mlp(getkey(), dtype=jnp.bfloat16))
    assert loaded.blocks.layers.w1.dtype == jnp.bfloat16
    assert eqx.tree_equal(loaded, model)
    # The file is safetensors, with per-layer names.
    state = eqxscan.load_state_dict(path)
    assert eqx.tree_equal(state, eqxscan.to_state_dict(model))
    assert state["blocks.2.w2"].dtype == jnp.bfloat16
    assert os.listdir(tmp_path) == ["model.safetensors"]


FIXTURE = os.path.join(os.path.dirname(__file__), "data", "stacked_mlp_4x2_bf16.npz")


def test_npz_files_are_refused_by_name(tmp_path):
    # Written by a development version's `.npz` writer: StackedMLP(4, 2) in
    # bfloat16. eqxscan reads safetensors only, and says so before reading.
    like = eqx.filter_eval_shape(
        lambda: eqxscan.StackedMLP(4, 2, key=jr.key(1), dtype=jnp.bfloat16)
    )
    plain = tmp_path / "plain"  # a zip without the suffix, as `numpy.savez` wrote
    with open(FIXTURE, "rb") as f:
        plain.write_bytes(f.read())
    for path in [FIXTURE, plain]:
        for who, read in [
            ("load", lambda p: eqxscan.load(p, like)),
            ("load_state_dict", eqxscan.load_state_dict),
        ]:
            with pytest.raises(ValueError) as e:
                read(path)
            first, hint = str(e.value).splitlines()
            assert first == (
                f"{who}: {str(path)!r} is an .npz archive, and eqxscan reads "
                "safetensors only."
            ), first
            assert hint.startswith("Hint: an .npz of a development version's"), hint
    with pytest.raises(ValueError, match="eqxscan writes safetensors only"):
        eqxscan.save(tmp_path / "model.npz", eqxscan.StackedMLP(4, 2, key=jr.key(0)))
    assert os.listdir(tmp_path) == ["plain"]


def test_load_checks_depth(getkey, tmp_path):
    deep = _mlp(getkey(), num_layers=6)
    eqxscan.save(tmp_path / "c.safetensors", deep)
    with pytest.raises(ValueError, match="model has L=4 layers in blocks, checkpoint"):
        eqxscan.load(tmp_path / "c.safetensors", _first_layers(deep, 4))


def test_save_load_name_the_path_on_bad_files(getkey, tmp_path):
    model = _mlp(getkey())
    missing = tmp_path / "no" / "such" / "ckpt.safetensors"
    with pytest.raises(FileNotFoundError, match=r"ckpt\.safetensors.*does not exist"):
        eqxscan.save(missing, model)
    assert os.listdir(tmp_path) == []
    corrupt = eqxscan.checkpoint.CorruptFileError
    garbage = tmp_path / "notes.safetensors"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(corrupt, match=r"notes\.safetensors' is corrupt or is not a"):
        eqxscan.load(garbage, model)
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.npz' is an \.npz archive"):
        eqxscan.load(empty, model)


def _two_layer_stack(key):
    return eqxscan.Stacked(lambda k: DenseReLU(key=k), 2, key=key)


def test_two_layer_example_from_hand_built_flax_tree(getkey):
    # Flax kernels are [in, out]: kernel = W.T.
    params = {
        "params": {
            "Dense_0": {
                "kernel": np.stack([W1.T, W2.T]),
                "bias": np.stack([B1, B2]).astype(np.float32),
            }
        }
    }
    stack = eqxscan.from_flax_scan(_two_layer_stack(getkey()), params)
    np.testing.assert_array_equal(stack.layers.linear.weight[1], W2)
    x = jnp.array([1.0, -2.0])
    np.testing.assert_array_equal(stack[0](x), [1.0, 1.0])
    np.testing.assert_array_equal(stack(x), [2.0, 0.0])
    with pytest.raises(ValueError, match="model has L=3 layers in the top-level"):
        eqxscan.from_flax_scan(
            eqxscan.Stacked(lambda k: DenseReLU(key=k), 3, key=getkey()), params
        )


def test_flax_dense_layers_pair_in_numeric_order(getkey):
    # Dense_10 after Dense_9, not after Dense_1: square layers paired in string
    # order would load each other's weights without an error.
    class Eleven(eqx.Module):
        linears: list

        def __init__(self, key):
            self.linears = [
                eqx.nn.Linear(2, 2, key=k) for k in jax.random.split(key, 11)
            ]

    kernels = np.arange(11 * 3 * 4, dtype=np.float32).reshape(11, 3, 2, 2)
    params = {
        f"Dense_{j}": {"kernel": kernels[j], "bias": kernels[j, :, 0]}
        for j in range(11)
    }
    stack = eqxscan.from_flax_scan(eqxscan.Stacked(Eleven, 3, key=getkey()), params)
    for j in range(11):
        np.testing.assert_array_equal(
            stack.layers.linears[j].weight, kernels[j].transpose(0, 2, 1)
        )


def test_flax_import_errors(getkey):
    stack = _two_layer_stack(getkey())
    norm = {"LayerNorm_0": {"scale": np.ones((2, 2), np.float32)}}
    with pytest.raises(ValueError, match="'LayerNorm_0.scale' is not part of a Dense"):
        eqxscan.from_flax_scan(stack, norm)
    two = {f"Dense_{i}": {"kernel": np.ones((2, 2, 2), np.float32)} for i in range(2)}
    with pytest.raises(ValueError, match="2 Dense layers"):
        eqxscan.from_flax_scan(stack, two)
    with pytest.raises(ValueError, match="missing keys: '0.linear.bias'"):
        eqxscan.from_flax_scan(stack, two, modules={"Dense_1": "linear"})
    # A Dense left out, or two into one Linear, loaded without a word.
    biased = {k: {**v, "bias": np.ones((2, 2), np.float32)} for k, v in two.items()}
    with pytest.raises(ValueError, match=r"\['Dense_0'\] unpaired"):
        eqxscan.from_flax_scan(stack, biased, modules={"Dense_1": "linear"})
    both = {"Dense_0": "linear", "Dense_1": "linear"}
    with pytest.raises(ValueError, match=r"\['linear'\] given twice"):
        eqxscan.from_flax_scan(stack, biased, modules=both)


def test_two_layer_example_from_real_flax_scan(getkey):
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.relu(nn.Dense(2)(x)), None

    scanned = nn.scan(
        Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
    )()
    x = jnp.array([1.0, -2.0])
    variables = scanned.init(jr.key(0), x, None)
    kernel = variables["params"]["Dense_0"]["kernel"]
    assert kernel.shape == (2, 2, 2)  # [N, in, out]
    variables = {
        "params": {
            "Dense_0": {
                "kernel": jnp.asarray(np.stack([W1.T, W2.T])),
                "bias": jnp.asarray(np.stack([B1, B2]), jnp.float32),
            }
        }
    }
    np.testing.assert_array_equal(scanned.apply(variables, x, None)[0], [2.0, 0.0])
    stack = eqxscan.from_flax_scan(_two_layer_stack(getkey()), variables)
    np.testing.assert_array_equal(stack(x), [2.0, 0.0])

    # And random Flax weights on a random input agree with Flax itself.
    variables = scanned.init(jr.key(1), x, None)
    stack = eqxscan.from_flax_scan(_two_layer_stack(getkey()), variables)
    xr = jr.normal(getkey(), (2,))
    np.testing.assert_allclose(
        stack(xr), scanned.apply(variables, xr, None)[0], rtol=1e-6, atol=1e-6
    )


class TwoDense(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2 = jr.split(key)
        self.up = eqx.nn.Linear(3, 5, key=k1)
        self.down = eqx.nn.Linear(5, 3, key=k2)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_flax_block_with_two_non_square_dense_layers(getkey):
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            # Flax numbers submodules in creation order: Dense_0 is `up`.
            h = nn.relu(nn.Dense(5)(x))
            return nn.Dense(3)(h), None

    scanned = nn.scan(
        Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
    )()
    x = jr.normal(getkey(), (3,))
    variables = scanned.init(jr.key(3), x, None)
    assert variables["params"]["Dense_1"]["kernel"].shape == (4, 5, 3)
    like = eqxscan.Stacked(lambda k: TwoDense(key=k), 4, key=getkey())
    expected = scanned.apply(variables, x, None)[0]
    # Default pairing: Dense_0, Dense_1 with the layer's Linears in attribute order.
    stack = eqxscan.from_flax_scan(like, variables)
    np.testing.assert_allclose(stack(x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        stack.layers.down.weight[2], variables["params"]["Dense_1"]["kernel"][2].T
    )
    explicit = eqxscan.from_flax_scan(
        like, variables, modules={"Dense_1": "down", "Dense_0": "up"}
    )
    assert eqx.tree_equal(explicit, stack)
    # Pairing them the wrong way round is caught by the shape check.
    with pytest.raises(ValueError, match=r"'0.up.weight': model has float32\[5, 3\]"):
        eqxscan.from_flax_scan(
            like, variables, modules={"Dense_0": "down", "Dense_1": "up"}
        )


class Gain(eqx.Module):
    gain: jax.Array

    def __call__(self, x):
        return x * self.gain


def test_per_layer_scalars_are_arrays(getkey):
    stack = eqxscan.Stacked(lambda k: Gain(jr.uniform(k, ())), 3, key=getkey())
    state = eqxscan.to_state_dict(stack)
    assert list(state) == ["0.gain", "1.gain", "2.gain"]
    for i in range(3):
        assert type(state[f"{i}.gain"]) is np.ndarray and state[f"{i}.gain"].shape == ()
        assert state[f"{i}.gain"] == stack.layers.gain[i]
    assert eqx.tree_equal(eqxscan.from_state_dict(stack, state), stack)


def test_stage_ordered_stack_names_its_natural_layers(getkey, tmp_path):
    # Names mean layer numbers: a stack stored in pipeline stage order saves
    # layer i as "i" and loads "i" into where that order keeps layer i.
    from eqxscan import load_safetensors, save_safetensors
    from eqxscan.checkpoint import NameMap
    from eqxscan.sharding import pipeline_order

    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(2, 2, key=k), 6, key=getkey())
    staged = pipeline_order(stack, stages=3, repeats=2)
    # Position (s * R + r) * K + k holds layer (r * S + s) * K + k (K = 1 here); a
    # non-square S x R, so the permutation is not its own inverse.
    held = [r * 3 + s for s in range(3) for r in range(2)]
    assert held == [0, 3, 1, 4, 2, 5]
    assert jnp.array_equal(staged.layers.weight, stack.layers.weight[jnp.array(held)])
    natural = eqxscan.to_state_dict(stack)
    assert tree_allclose(eqxscan.to_state_dict(staged), natural)
    back = eqxscan.from_state_dict(stack, eqxscan.to_state_dict(staged))
    assert tree_allclose(back, stack)
    assert tree_allclose(eqxscan.from_state_dict(staged, natural), staged)
    names = NameMap({"{i}.weight": "layer_{i}.w", "{i}.bias": "layer_{i}.b"})
    save_safetensors(tmp_path / "m.safetensors", staged, names=names)
    loaded = load_safetensors(tmp_path / "m.safetensors", stack, names=names)
    assert tree_allclose(loaded, stack)
    x = jnp.arange(2.0)
    assert jnp.allclose(loaded(x), stack(x))
    restaged = load_safetensors(tmp_path / "m.safetensors", staged, names=names)
    assert tree_allclose(restaged, staged)


def test_a_chains_stage_ordered_stack_names_its_natural_layers(getkey):
    from eqxscan.sharding import pipeline_order

    first = eqx.nn.Linear(2, 3, key=getkey())
    chain = eqxscan.Chain(
        [first, *[eqx.nn.Linear(3, 3, key=getkey()) for _ in range(4)]]
    )
    staged = eqx.tree_at(
        lambda c: c.groups[1],
        chain,
        pipeline_order(chain.groups[1], stages=2, repeats=2),
    )
    natural = eqxscan.to_state_dict(chain)
    assert tree_allclose(eqxscan.to_state_dict(staged), natural)
    assert tree_allclose(eqxscan.from_state_dict(staged, natural), staged)


def test_a_stage_order_that_does_not_fit_the_stack_is_refused(getkey):
    # It was kept, and naming the layers failed later with a NumPy reshape error.
    def make(k):
        return eqx.nn.Linear(2, 2, key=k)

    with pytest.raises(ValueError, match=r"stage_order=\(3, 2\) cuts .* 6 chunks"):
        eqxscan.Stacked(make, 8, key=getkey(), stage_order=(3, 2))
    # 6 layers fit 2 stages, but not 2 stages x 2 repeats.
    with pytest.raises(ValueError, match=r"stage_order=\(2, 2\) cuts .* 4 chunks"):
        eqxscan.Stacked(make, 6, key=getkey(), stage_order=(2, 2))
    with pytest.raises(ValueError, match=r"stage_order\[0\] must be >= 1"):
        eqxscan.Stacked(make, 8, key=getkey(), stage_order=(0, 2))


class Leaky(eqx.Module):
    linear: eqx.nn.Linear
    act: eqx.nn.PReLU  # its slope is weakly typed, as `jnp.array(0.25)`

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 4, key=key, dtype=jnp.bfloat16)
        self.act = eqx.nn.PReLU()

    def __call__(self, x):
        return self.act(self.linear(x))


def test_weakly_typed_arrays_stay_weak(getkey):
    # A strong float32 slope would turn the bfloat16 activations float32.
    model = {"stack": eqxscan.Stacked(Leaky, 2, key=getkey()), "one": Leaky(getkey())}
    like = eqx.filter_eval_shape(lambda: model)
    x = jnp.ones(4, jnp.bfloat16)
    for into in (model, like):
        loaded = eqxscan.from_state_dict(into, eqxscan.to_state_dict(model))
        assert loaded["stack"].layers.act.negative_slope.weak_type
        assert loaded["one"].act.negative_slope.weak_type
        assert eqx.tree_equal(loaded, model)
        assert loaded["stack"](x).dtype == loaded["one"](x).dtype == jnp.bfloat16


def _trained_leaky(model):
    # An update as an optimizer's, strongly typed: it makes the weak slopes strong.
    params = eqx.filter(model, eqx.is_array)
    updates = jax.tree.map(lambda p: jnp.full(p.shape, -0.01, p.dtype), params)
    return eqx.apply_updates(model, updates)


def test_a_saved_slope_loads_typed_as_it_was_saved(tmp_path, getkey):
    # A resumed run computes as the uninterrupted one: trained, PReLU's slope is
    # strongly typed (bfloat16 activations computed in float32), and a fresh
    # model to load into has it weak; loaded, it was bfloat16 again.
    model = {"stack": eqxscan.Stacked(Leaky, 2, key=getkey()), "one": Leaky(getkey())}
    trained = _trained_leaky(model)
    slope = lambda m: (
        m["stack"].layers.act.negative_slope,
        m["one"].act.negative_slope,
    )
    assert not any(s.weak_type for s in slope(trained))
    x = -jnp.linspace(1, 2, 4, dtype=jnp.bfloat16)
    eqxscan.save(tmp_path / "t.safetensors", trained)
    eqxscan.save(tmp_path / "fresh.safetensors", model)
    for like in (model, eqx.filter_eval_shape(lambda: model)):
        loaded = eqxscan.load(tmp_path / "t.safetensors", like)
        assert not any(s.weak_type for s in slope(loaded))
        out, want = loaded["one"](x), trained["one"](x)
        assert out.dtype == want.dtype == jnp.float32
        np.testing.assert_array_equal(out, want)
        # (A stack of them now changes its bfloat16 carry to float32: the
        # trained model's error, where the weak slope ran on in bfloat16.)
        with pytest.raises(TypeError, match="carry leaf `carry` from bfloat16"):
            loaded["stack"](x)
        # Saved weak, it loads weak into a strong model too.
        fresh = eqxscan.load(tmp_path / "fresh.safetensors", trained)
        assert all(s.weak_type for s in slope(fresh))
        assert fresh["one"](x).dtype == jnp.bfloat16
    # A file without the record (another writer's) loads as `like` has it.
    safetensors = pytest.importorskip("safetensors.numpy")
    safetensors.save_file(eqxscan.to_state_dict(trained), tmp_path / "o.safetensors")
    other = eqxscan.load(tmp_path / "o.safetensors", model)
    assert all(s.weak_type for s in slope(other))


class _Gain(eqx.Module):
    a: jax.Array

    def __call__(self, x):
        return x * self.a


def test_weak_records_name_each_layer(tmp_path):
    # Recorded by pattern (`*.a`), one weak gain made every gain of the chain
    # weak: the strong one loaded weak, and the chain computed in bfloat16.
    weak, strong = jnp.asarray(0.5), jnp.asarray(0.5, jnp.float32)
    chains = [
        eqxscan.Chain([_Gain(weak), _Gain(weak), _Gain(strong)]),
        eqxscan.Chain([_Gain(weak), _Gain(strong)] * 2),
    ]
    for n, chain in enumerate(chains):
        eqxscan.save(tmp_path / f"{n}.safetensors", chain)
        back = eqxscan.load(tmp_path / f"{n}.safetensors", chain)
        flags = lambda m: [x.weak_type for x in jax.tree.leaves(m)]
        assert flags(back) == flags(chain) == [True, False]


class _Empty(eqx.Module):
    w: jax.Array
    none: jax.Array  # no entries: a zero-size array


def test_zero_size_and_big_endian_arrays_load(tmp_path):
    # A stacked [3, 0, 2] array saved but could not load ("cannot reshape array
    # of size 0"); a big-endian state dict was refused as "float32, checkpoint
    # has float32".
    stack = eqxscan.Stacked(
        lambda k: _Empty(jr.normal(k, (2,)), jnp.zeros((0, 2))), 3, key=jr.key(0)
    )
    model = {"stack": stack, "top": jnp.arange(3.0), "empty": jnp.zeros((0,))}
    like = jax.tree.map(jnp.zeros_like, model)
    state = eqxscan.to_state_dict(model)
    big = {k: v.astype(v.dtype.newbyteorder(">")) for k, v in state.items()}
    eqxscan.save(tmp_path / "m.safetensors", model)
    for loaded in (
        eqxscan.from_state_dict(like, state),
        eqxscan.from_state_dict(like, big),
        eqxscan.load(tmp_path / "m.safetensors", like),
    ):
        assert loaded["stack"].layers.none.shape == (3, 0, 2)
        assert jax.tree.all(jax.tree.map(jnp.array_equal, loaded, model))
