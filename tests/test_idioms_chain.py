"""Chain: grouping layers that differ only by identity, saying why a layer was
left alone, portable checkpoints, and the layer named in a dtype error."""

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan


def _loop(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _mlps(key, n, activation):
    return [
        eqx.nn.MLP(4, 4, 8, 1, activation=activation(), key=k) for k in jr.split(key, n)
    ]


class Scaled(eqx.Module):
    """A layer with a static callable, as configuration."""

    linear: eqx.nn.Linear
    act: object = eqx.field(static=True)

    def __call__(self, x):
        return self.act(self.linear(x))


@pytest.mark.parametrize(
    "activation",
    [
        lambda: functools.partial(jax.nn.leaky_relu, negative_slope=0.1),
        lambda: lambda x: x * jax.nn.sigmoid(x),  # one lambda, made per layer
    ],
    ids=["partial", "lambda"],
)
def test_chain_groups_layers_differing_only_by_identity(getkey, activation):
    layers = _mlps(getkey(), 4, activation)
    static = [
        Scaled(eqx.nn.Linear(4, 4, key=k), activation()) for k in jr.split(getkey(), 3)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chain = eqxscan.Chain(layers)
        chain_static = eqxscan.Chain(static)
    assert [span.size for span in chain.layout] == [4]
    assert [span.size for span in chain_static.layout] == [3]
    x = jnp.linspace(-1.0, 1.0, 4)
    np.testing.assert_allclose(chain(x), _loop(layers, x), rtol=1e-6)
    np.testing.assert_allclose(chain_static(x), _loop(static, x), rtol=1e-6)


def test_chain_keeps_apart_what_really_differs(getkey):
    keys = jr.split(getkey(), 4)
    slopes = [
        eqx.nn.MLP(
            4,
            4,
            8,
            1,
            activation=functools.partial(jax.nn.leaky_relu, negative_slope=s),
            key=k,
        )
        for s, k in zip([0.1, 0.2, 0.1, 0.2], keys)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a real difference is not warned about
        chain = eqxscan.Chain(slopes, patterns=False)
    assert [span.size for span in chain.layout] == [1, 1, 1, 1]
    x = jnp.linspace(-1.0, 1.0, 4)
    np.testing.assert_allclose(chain(x), _loop(slopes, x), rtol=1e-6)


def _through(x, like):
    return x.astype(like.dtype).astype(x.dtype)  # rounded to `like`'s dtype


def test_chain_keeps_apart_static_arrays_of_another_dtype(getkey):
    # Equal values of different dtypes are different configuration: a layer
    # that rounds through float16 does not share a body with one through float32.
    likes = [np.zeros((), np.float32), np.zeros((), np.float16)]
    layers = [
        Scaled(eqx.nn.Linear(4, 4, key=k), functools.partial(_through, like=like))
        for k, like in zip(jr.split(getkey(), 2), likes)
    ]
    chain = eqxscan.Chain(layers)
    assert [span.size for span in chain.layout] == [1, 1]
    x = jnp.linspace(-1.0, 1.0, 4)
    np.testing.assert_allclose(chain(x), _loop(layers, x), rtol=1e-6)


def _apply(linear, x):
    return jnp.tanh(linear(x))


def test_layers_closing_over_modules_with_other_weights_stay_apart(getkey):
    # A closure or partial is one leaf, not stacked: built per layer around a
    # module of its own weights, it is not layer 0's. Both ran layer 0's.
    keys = jr.split(getkey(), 3)
    lambdas = []
    for k in keys:
        linear = eqx.nn.Linear(4, 4, key=k)
        lambdas.append(eqx.nn.Lambda(lambda x, linear=linear: _apply(linear, x)))
    partials = [
        eqx.nn.Lambda(functools.partial(_apply, eqx.nn.Linear(4, 4, key=k)))
        for k in keys
    ]
    x = jnp.linspace(-1.0, 1.0, 4)
    for layers in [lambdas, partials]:
        chain = eqxscan.Chain(layers)
        assert [span.size for span in chain.layout] == [1, 1, 1]
        np.testing.assert_allclose(chain(x), _loop(layers, x), rtol=1e-6)
        with pytest.raises(ValueError, match="layer 1 .* at `.fn`"):
            eqxscan.Stacked.from_layers(layers)
    # One module in every layer's own partial is the same configuration.
    linear = partials[0].fn.args[0]
    shared = [eqx.nn.Lambda(functools.partial(_apply, linear)) for _ in keys]
    assert [span.size for span in eqxscan.Chain(shared).layout] == [3]


class Swish:
    """A callable with no notion of equality: instances compare by identity."""

    def __call__(self, x):
        return x * jax.nn.sigmoid(x)


def test_chain_warns_once_when_identity_keeps_layers_apart(getkey):
    layers = _mlps(getkey(), 4, Swish)
    with pytest.warns(UserWarning) as record:
        chain = eqxscan.Chain(layers)
    assert len(record) == 1
    message = str(record[0].message)
    assert ".activation" in message
    assert message.count("Swish object at") == 2
    assert "same object" in message
    assert [span.size for span in chain.layout] == [1, 1, 1, 1]
    x = jnp.linspace(-1.0, 1.0, 4)
    np.testing.assert_allclose(chain(x), _loop(layers, x), rtol=1e-6)
    # Sharing one object, as the warning says, groups them.
    swish = Swish()
    shared = [eqx.tree_at(lambda m: m.activation, layer, swish) for layer in layers]
    assert [span.size for span in eqxscan.Chain(shared).layout] == [4]


def test_chain_explain(getkey):
    k = iter(jr.split(getkey(), 8))
    layers = [eqx.nn.Linear(4, 4, key=next(k)) for _ in range(3)]
    layers.append(eqx.nn.Linear(4, 4, use_bias=False, key=next(k)))
    layers.append(eqx.nn.Linear(4, 4, key=next(k), dtype=jnp.float16))
    chain = eqxscan.Chain(layers)
    text = chain.explain()
    assert "layers 0-2" in text and "scanned" in text
    # Each lone layer says why: the first difference from its neighbours.
    assert "layer 3" in text and ".bias" in text
    assert "layer 4" in text and "float16[4,4]" in text and "float32[4,4]" in text


def test_chain_explain_names_both_neighbours_of_layer_1(getkey):
    # A lone layer 1 says how it differs from layer 0 as well as from layer 2.
    k = iter(jr.split(getkey(), 4))
    layers = [eqx.nn.Linear(4, 4, key=next(k))]
    layers.append(eqx.nn.Linear(4, 4, use_bias=False, key=next(k)))
    layers += [eqx.nn.Linear(4, 4, key=next(k), dtype=jnp.float16) for _ in range(2)]
    lines = eqxscan.Chain(layers).explain().splitlines()
    line = next(line for line in lines if line.startswith("  layer 1 "))
    assert "unlike layer 0 (Linear) at `.bias`" in line
    assert "unlike layer 2 (Linear) at `.weight`" in line


# Portable checkpoints --------------------------------------------------------------


class Holder(eqx.Module):
    layers: object


def _mixed(key):
    k = iter(jr.split(key, 8))
    lin = lambda: eqx.nn.Linear(4, 4, key=next(k))  # noqa: E731
    mlp = lambda: eqx.nn.MLP(4, 4, 8, 1, key=next(k))  # noqa: E731
    return [mlp(), lin(), mlp(), lin(), mlp(), lin(), lin()]


def test_chain_state_dict_by_global_layer_index(getkey):
    layers = _mixed(getkey())
    repeated = Holder(eqxscan.Chain(layers))
    stacks = Holder(eqxscan.Chain(layers, patterns=False))
    plain = Holder(list(layers))
    assert repeated.layers.layout != stacks.layers.layout
    sd = eqxscan.to_state_dict(repeated)
    assert sd.keys() == eqxscan.to_state_dict(plain).keys()
    assert "layers.1.weight" in sd and "layers.0.layers.0.weight" in sd
    for name, value in eqxscan.to_state_dict(plain).items():
        np.testing.assert_array_equal(sd[name], value)
    x = jnp.ones(4)
    for like in (stacks, plain, repeated):
        loaded = eqxscan.from_state_dict(like, sd)
        assert eqx.tree_equal(loaded, like)
    # And back: a list's checkpoint loads into either grouping.
    loaded = eqxscan.from_state_dict(stacks, eqxscan.to_state_dict(plain))
    np.testing.assert_array_equal(loaded.layers(x), _loop(layers, x))


# The layer named in a dtype error -------------------------------------------------


class Up(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        return self.linear(x)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_chain_dtype_error_names_the_layer(getkey, mode):
    k = iter(jr.split(getkey(), 4))
    # Layer 0 changes the shape on purpose; layers 1-3 promote bf16 to f32.
    layers = [Up(eqx.nn.Linear(4, 8, key=next(k), dtype=jnp.bfloat16))]
    layers += [eqx.nn.Linear(8, 8, key=next(k)) for _ in range(3)]
    chain = eqxscan.Chain(layers, mode=mode)
    with jax.numpy_dtype_promotion("standard"):
        with pytest.raises(TypeError) as info:
            chain(jnp.ones(4, jnp.bfloat16))
    headline = str(info.value).splitlines()[0]
    layer = "layer 1 (Linear" if mode == "loop" else "layers 1-3 (stack of Linear"
    assert headline.startswith(f"Chain {layer}")
    assert "from bfloat16[8] to float32[8]" in headline
    assert "layer 0" not in headline
