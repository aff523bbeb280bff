"""Equinox idioms on stacked layers: ensembles, loading without recompiling,
NumPy sizes (stateful layers, Chain grouping, surgery and portable Chain
checkpoints are in test_idioms_*.py)."""

import logging
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan


def _linear(k):
    return eqx.nn.Linear(4, 4, key=k)


# Ensembles ----------------------------------------------------------------------


def test_ensemble_index_and_call_inside_vmap(getkey):
    keys = jr.split(getkey(), 3)
    ens = eqx.filter_vmap(lambda k: eqxscan.Stacked(_linear, 4, key=k))(keys)
    assert ens.layers.weight.shape == (3, 4, 4, 4)
    # JAX would clamp index 3 into the member axis and give member 2.
    with pytest.raises(ValueError, match=r"layers\.weight` has shape \(3, 4, 4, 4\)"):
        ens[3]
    with pytest.raises(ValueError, match=r"(?s)Cannot call this Stacked.*filter_vmap"):
        ens(jnp.ones(4))
    with pytest.raises(ValueError, match="Cannot index"):
        ens.unstack()
    with pytest.raises(ValueError, match=r"(?s)Cannot vmap this Stacked.*filter_vmap"):
        ens.vmap(jnp.ones(4))  # it mapped over the members, each layer a batch
    # Inside vmap both work, and agree with each member built on its own.
    third = eqx.filter_vmap(lambda s: s[3])(ens)
    xs = jr.normal(getkey(), (3, 4))
    ys = eqx.filter_vmap(lambda s, x: s(x))(ens, xs)
    for m in range(3):
        ref = [_linear(k) for k in jr.split(keys[m], 4)]
        np.testing.assert_array_equal(third.weight[m], ref[3].weight)
        y = xs[m]
        for layer in ref:
            y = layer(y)
        np.testing.assert_allclose(ys[m], y, rtol=1e-5, atol=1e-6)


# Loading does not recompile -------------------------------------------------------


class _CountCompiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        if record.getMessage().startswith("Compiling"):
            self.count += 1


class _Scaled(eqx.Module):
    stack: eqxscan.Stacked
    scale: jax.Array

    def __call__(self, x):
        return self.stack(x) * self.scale


@pytest.mark.parametrize("placement", ["default", "committed"])
def test_load_does_not_recompile(getkey, tmp_path, placement):
    model = _Scaled(eqxscan.Stacked(_linear, 3, key=getkey()), jnp.array(0.5))
    assert model.scale.weak_type
    if placement == "committed":
        model = jax.device_put(model, jax.devices()[1])
    step = eqx.filter_jit(lambda m, x: m(x))
    x = jnp.ones(4)
    expected = step(model, x)
    path = os.fspath(tmp_path / "model.safetensors")
    eqxscan.save(path, model)
    loaded = eqxscan.load(path, model)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded)):
        assert (a.committed, a.sharding, a.weak_type) == (
            b.committed,
            b.sharding,
            b.weak_type,
        )
    counter = _CountCompiles()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    try:
        with jax.log_compiles():
            np.testing.assert_array_equal(step(loaded, x), expected)
    finally:
        logger.removeHandler(counter)
    assert counter.count == 0


# Sizes as NumPy integers -------------------------------------------------------------


def test_numpy_integer_sizes(getkey):
    stack = eqxscan.Stacked(_linear, np.int64(3), key=getkey())
    assert type(stack.num_layers) is int and len(stack) == 3
    ref = eqxscan.Stacked(_linear, 3, key=jr.key(0))
    same = eqxscan.Stacked(_linear, np.int32(3), key=jr.key(0))
    np.testing.assert_array_equal(same(jnp.ones(4)), ref(jnp.ones(4)))
    mlp = eqxscan.StackedMLP(np.int64(8), np.int16(2), key=getkey())
    assert mlp.blocks.layers.w1.shape == (2, 8, 32)
    cell = eqxscan.ElmanCell(np.int64(3), np.uint8(5), key=getkey())
    assert type(cell.hidden_size) is int and cell.weight_hh.shape == (5, 5)
    mesh = eqxscan.sharding.make_mesh(data=np.int64(2))
    assert mesh.shape == {"data": 2, "fsdp": 1}
    for bad in (True, 2.0, "3"):
        with pytest.raises(TypeError, match="num_layers"):
            eqxscan.Stacked(_linear, bad, key=getkey())
    with pytest.raises(ValueError, match="dim must be >= 1, got 0"):
        eqxscan.StackedMLP(np.int64(0), 2, key=getkey())


# Layer surgery ------------------------------------------------------------------


def test_with_layer(getkey):
    stack = eqxscan.Stacked(_linear, 4, key=getkey(), mode="loop", remat=True)
    new_layer = _linear(getkey())
    for i in (1, -1):
        replaced = stack.with_layer(i, new_layer)
        layers = stack.unstack()
        layers[i] = new_layer
        expected = eqxscan.Stacked.from_layers(layers, mode="loop", remat=True)
        assert eqx.tree_equal(replaced, expected)
    assert (replaced.mode, replaced.remat) == ("loop", True)
    x = jnp.ones(4)
    np.testing.assert_allclose(replaced(x), _loop(layers, x), rtol=1e-6)
    with pytest.raises(IndexError, match="Layer index 4 is out of range"):
        stack.with_layer(4, new_layer)
    half = eqx.nn.Linear(4, 4, key=getkey(), dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"\.weight.*float32\[4,4\].*float16\[4,4\]"):
        stack.with_layer(2, half)
    with pytest.raises(ValueError, match=r"new layer.*`.bias`.*float32\[4\].*None"):
        stack.with_layer(2, eqx.nn.Linear(4, 4, use_bias=False, key=getkey()))


def _loop(layers, x):
    for layer in layers:
        x = layer(x)
    return x


# make_layer mistakes --------------------------------------------------------------


def test_make_layer_mistakes_are_named(getkey):
    layer = _linear(getkey())
    with pytest.raises(TypeError, match=r"(?s)make_layer.*Linear.*lambda"):
        eqxscan.Stacked(layer, 3, key=getkey())
    with pytest.raises(
        TypeError, match=r"(?s)make_layer returned an array.*float32\[4\]"
    ):
        eqxscan.Stacked(lambda k: jr.normal(k, (4,)), 3, key=getkey())
