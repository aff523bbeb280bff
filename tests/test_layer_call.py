"""The layer-call seam: what layer `i` receives, whoever runs it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan
from eqxscan._scan.buffers import PerLayer
from eqxscan._scan.layer_call import LayerCall, OneLayer


class Seen(eqx.Module):
    """A layer that adds what it receives: its per-layer value, its key's
    first word and every keyword's name length (so an extra keyword shows)."""

    weight: jax.Array
    tag: int = eqx.field(static=True, default=0)

    def __call__(self, x, extra, *, key=None, **kwargs):
        names = float(sum(len(n) for n in kwargs))
        k = 0.0 if key is None else (jax.random.key_data(key)[-1] % 7).astype(x.dtype)
        return x * self.weight + extra + k + names


class NoKey(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return x + self.weight


def _layers(n):
    return [Seen(jnp.float32(1.0 + 0.1 * i)) for i in range(n)]


def _loop(layers, x, extra, keys=None, **kwargs):
    for i, layer in enumerate(layers):
        k = None if keys is None else keys[i]
        x = layer(x, extra[i], key=k, **kwargs)
    return x


def test_at_placed_take_and_inner_slice_every_per_layer_value():
    keys = jax.random.split(jax.random.key(0), 6)
    call = LayerCall(
        (PerLayer(jnp.arange(6.0)), 2.0), {"c": PerLayer(-jnp.arange(6.0))}, keys
    )
    one = call.at(4)
    assert isinstance(one, OneLayer)
    assert one.args == (4.0, 2.0) and float(one.kwargs["c"]) == -4.0
    assert jnp.array_equal(jax.random.key_data(one.key), jax.random.key_data(keys[4]))
    # A traced index reads the same slice.
    traced = jax.jit(lambda i: call.at(i).args[0])(jnp.int32(4))
    assert float(traced) == 4.0
    # Layers 2..5 placed as a pattern of 2 repeated twice: [repeat, K, ...].
    part = call.placed(2, 4, 2)
    assert part.args[0].tree.shape == (2, 2)
    assert part.keys.shape == (2, 2)
    inner = part.inner(part.at(1))  # repeat 1: layers 4 and 5
    assert isinstance(inner.args[0], PerLayer)
    assert jnp.array_equal(inner.args[0].tree, jnp.array([4.0, 5.0]))
    assert inner.args[1] == 2.0
    taken = call.take(np.array([5, 0]))
    assert jnp.array_equal(taken.kwargs["c"].tree, jnp.array([-5.0, -0.0]))


@pytest.mark.parametrize("mode", ["scan", "loop"])
@pytest.mark.parametrize("pattern", ["stack", "pattern", "lone"])
def test_every_container_hands_layer_i_its_own_inputs(mode, pattern):
    # Stacks, repeated patterns and lone layers of a Chain, and a Stacked, give layer
    # i exactly its slice, its key and the user's keywords, nothing more.
    n = 6
    if pattern == "stack":
        layers = _layers(n)
    elif pattern == "pattern":
        layers = [Seen(jnp.float32(1.0 + 0.1 * i), tag=i % 2) for i in range(n)]
    else:
        layers = [Seen(jnp.float32(1.0 + 0.1 * i), tag=i) for i in range(n)]
    extra = jnp.arange(n, dtype=jnp.float32) / 10
    key = jax.random.key(3)
    keys = jax.random.split(key, n)
    x = jnp.ones((1,))
    want = _loop(layers, x, extra, keys, flag=1.0)
    chain = eqxscan.Chain(layers, mode=mode)
    kinds = {"stack": (1,), "pattern": (2,), "lone": (0,) * n}[pattern]
    assert tuple(s.per_step for s in chain.layout) == kinds
    got = chain(x, eqxscan.per_layer(extra), key=key, flag=1.0)
    assert jnp.allclose(got, want, atol=1e-5)
    if pattern == "stack":
        stack = eqxscan.Stacked.from_layers(layers, mode=mode)
        got = stack(x, eqxscan.per_layer(extra), key=key, flag=1.0)
        assert jnp.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("container", ["stacked", "chain"])
def test_concrete_negative_indices_count_from_the_end(container):
    layers = [NoKey(jnp.float32(10.0**i)) for i in range(4)]
    model = (
        eqxscan.Stacked.from_layers(layers)
        if container == "stacked"
        else eqxscan.Chain(layers)
    )
    x = jnp.float32(0.0)
    as_ints = eqxscan.run_layers(model, x, [-2, 1])
    as_numpy = eqxscan.run_layers(model, x, np.array([-2, 1]))
    as_array = eqxscan.run_layers(model, x, jnp.array([-2, 1]))
    assert float(as_ints) == 110.0  # layers 2 and 1
    assert float(as_numpy) == float(as_array) == float(as_ints)
    with pytest.raises(IndexError, match="out of range"):
        eqxscan.run_layers(model, x, jnp.array([-5, 1]))


@pytest.mark.parametrize("container", ["stacked", "chain"])
def test_inference_mode_with_drop_rates_calls_keyless_layers_without_a_key(container):
    layers = [NoKey(jnp.float32(i)) for i in range(4)]
    if container == "stacked":
        model = eqxscan.Stacked.from_layers(layers)
        model = eqxscan.Stacked(
            layers=model.layers, num_layers=4, drop_path=0.2, layer_drop=0.3
        )
    else:
        model = eqxscan.Chain(layers, drop_path=0.2, layer_drop=0.3)
    x = jnp.float32(1.0)
    still = eqx.nn.inference_mode(model)
    got = still(x, key=jax.random.key(0))
    assert float(got) == 1.0 + 0 + 1 + 2 + 3
    assert float(still(x)) == float(got)
    # While training the key draws the drops, and the layers still get none.
    trained = model(x, key=jax.random.key(1))
    assert jnp.isfinite(trained)
    # Without drop rates, a key for layers that take none is still an error.
    plain = (
        eqxscan.Chain(layers)
        if container == "chain"
        else eqxscan.Stacked.from_layers(layers)
    )
    with pytest.raises(TypeError, match="takes no `key` argument"):
        plain(x, key=jax.random.key(0))


@pytest.mark.parametrize("container", ["stacked", "chain"])
def test_named_inputs_leave_broadcast_numbers_alone(container):
    # With save_inputs named, a traced subset names what each step reads; a
    # broadcast Python float among a layer's arguments is not an array to name.
    cp = eqxscan.ScanRemat(policy=True, save_inputs=True)

    class Scaled(eqx.Module):
        weight: jax.Array

        def __call__(self, x, scale):
            return jnp.tanh(x * self.weight) * scale

    scaled = [Scaled(jnp.float32(0.5 + i)) for i in range(4)]
    model = (
        eqxscan.Stacked.from_layers(scaled, remat=cp)
        if container == "stacked"
        else eqxscan.Chain(scaled, remat=cp)
    )
    x = jnp.float32(0.3)
    idx = jnp.array([2, 0])

    def loss(m, idx):
        return eqxscan.run_layers(m, x, idx, scale=0.5)

    got = eqx.filter_grad(loss)(model, idx)
    want = eqx.filter_grad(lambda m: eqxscan.run_layers(m, x, [2, 0], scale=0.5))(model)
    assert all(
        jnp.allclose(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )
