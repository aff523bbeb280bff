"""eqxscan.optim.layerwise: training a stacked model with `layerwise(tx)` equals
training the same layers kept in a list with `tx`; without it, transformations
that read whole arrays give another result."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxscan
from eqxscan.optim import freeze_layers, layerwise, LayerwiseState, weight_decay_mask

from .helpers import run_script


DIM = 8
STEPS = 3


class Attention(eqx.Module):
    """A tiny pre-norm Transformer block on `[T, D]`."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(2, DIM, key=k1)
        self.ln2 = eqx.nn.LayerNorm(DIM)
        self.mlp_in = eqx.nn.Linear(DIM, 2 * DIM, key=k2)
        self.mlp_out = eqx.nn.Linear(2 * DIM, DIM, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class Net(eqx.Module):
    """An unstacked embedding and a body: a `Stacked`, a `Chain` or a list."""

    embed: eqx.nn.Linear
    body: Any

    def __call__(self, x):
        x = jax.vmap(self.embed)(x)
        if isinstance(self.body, list):
            for layer in self.body:
                x = layer(x)
            return x
        return self.body(x)


class Dense(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(DIM, DIM, key=key)

    def __call__(self, x):
        return jnp.tanh(jax.vmap(self.linear)(x))


def mlp(key):
    return eqxscan.MLPBlock(DIM, key=key)


def _layers(body) -> list:
    """The body's layers as the list an unstacked model holds."""
    return body.unstack()


def _models(key, kind: str) -> tuple[Net, Net]:
    """A stacked model and the same weights with the body as a list."""
    k0, k1 = jax.random.split(key)
    embed = eqx.nn.Linear(DIM, DIM, key=k0)
    if kind == "stacked":
        body = eqxscan.Stacked(mlp, 3, key=k1)
    elif kind == "transformer":
        body = eqxscan.Stacked(Attention, 2, key=k1)
    else:  # a Chain: two repeats of (MLP, MLP, Linear), its MLP pairs stacked
        keys = jax.random.split(k1, 6)
        layers = [Dense(k) if i % 3 == 2 else mlp(k) for i, k in enumerate(keys)]
        body = eqxscan.Chain(layers)
        # A stack of the two repeats, each holding a stack of its two MLPs.
        assert isinstance(body.groups[0].layers.groups[0], eqxscan.Stacked)
    return Net(embed, body), Net(embed, _layers(body))


def _loss(model: Net, x):
    # Large enough gradients that a global-norm clip at 1 acts.
    return 100.0 * jnp.mean(jnp.tanh(model(x)) ** 2)


# Compiled once per model structure for the whole file.
_grads = eqx.filter_jit(eqx.filter_grad(_loss))


def _train(model: Net, tx, x, steps: int = STEPS) -> Net:
    @eqx.filter_jit
    def step(model, state, grads):
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        state = tx.init(eqx.filter(model, eqx.is_inexact_array))
        for _ in range(steps):
            model, state = step(model, state, _grads(model, x))
    return model


def _gap(stacked: Net, unstacked: Net) -> float:
    """The largest difference between the two models' weights."""
    flat = Net(stacked.embed, _layers(stacked.body))
    a = jax.tree.leaves(eqx.filter(flat, eqx.is_inexact_array))
    b = jax.tree.leaves(eqx.filter(unstacked, eqx.is_inexact_array))
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(a, b, strict=True))


def _x(key):
    return jax.random.normal(key, (4, DIM))


def _ndim_mask(params):
    return jax.tree.map(lambda a: a.ndim >= 2, params)


TRANSFORMS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lamb": lambda: optax.lamb(1e-2, weight_decay=0.1),
    "lars": lambda: optax.lars(1.0, weight_decay=0.1),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "muon": lambda: optax.contrib.muon(1e-2),
    "block_rms": lambda: optax.chain(optax.clip_by_block_rms(1e-3), optax.sgd(1.0)),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_per_layer_equals_unstacked(getkey, name):
    stacked, unstacked = _models(getkey(), "stacked")
    x = _x(getkey())
    tx = TRANSFORMS[name]
    got = _train(stacked, layerwise(tx()), x)
    want = _train(unstacked, tx(), x)
    assert _gap(got, want) < 1e-5
    assert _gap(stacked, want) > 1e-3  # the steps moved the weights


@pytest.mark.parametrize("kind", ["transformer", "chain"])
def test_per_layer_structures(getkey, kind):
    stacked, unstacked = _models(getkey(), kind)
    x = _x(getkey())
    # The global clip stays global outside layerwise; inside it Muon
    # orthogonalises each layer's matrices, LAMB takes one trust ratio per
    # layer's array. The chain's repeated unit is a stack of units holding a
    # stack of two blocks: nested layer axes.
    clip = optax.clip_by_global_norm(1.0)
    tx = {
        "transformer": optax.contrib.muon(1e-2),
        "chain": optax.lamb(1e-2),
    }[kind]
    got = _train(stacked, optax.chain(clip, layerwise(tx)), x)
    want = _train(unstacked, optax.chain(clip, tx), x)
    assert _gap(got, want) < 1e-5
    assert _gap(stacked, want) > 1e-3


def test_without_per_layer_results_differ(getkey):
    # The pitfall: on `[L, ...]` arrays Muon's `ndim == 2` rule sends every
    # stacked weight to Adam, and an `ndim >= 2` decay mask decays the stacked
    # biases and norm scales.
    stacked, unstacked = _models(getkey(), "stacked")
    x = _x(getkey())
    for tx in (
        optax.contrib.muon(1e-2),
        optax.adamw(1e-2, weight_decay=0.5, mask=_ndim_mask),
    ):
        want = _train(unstacked, tx, x)
        assert _gap(_train(stacked, tx, x), want) > 1e-4
        assert _gap(_train(stacked, layerwise(tx), x), want) < 1e-5


def test_per_layer_with_freeze_and_masks(getkey):
    stacked, unstacked = _models(getkey(), "stacked")
    x = _x(getkey())
    adamw = optax.adamw(1e-2, weight_decay=0.5, mask=_ndim_mask)
    tx = freeze_layers(layerwise(adamw), [0], where=lambda p: p.body)
    got = _train(stacked, tx, x)
    # By hand on the list: layer 0 gets no update at all.
    labels = Net("train", ["frozen", "train", "train"])  # a callable itself
    ref = optax.multi_transform(
        {"train": adamw, "frozen": optax.set_to_zero()}, lambda _: labels
    )
    want = _train(unstacked, ref, x)
    assert _gap(got, want) < 1e-5
    np.testing.assert_array_equal(got.body.layers.w1[0], stacked.body.layers.w1[0])
    # LAMB's trust ratio reads the whole array: frozen, the stacked layer 0's
    # weights still enter the others' ratio, unless it runs per layer.
    lamb = optax.lamb(1e-2)
    ref = optax.multi_transform(
        {"train": lamb, "frozen": optax.set_to_zero()}, lambda _: labels
    )
    want = _train(unstacked, ref, x)
    where = lambda p: p.body  # noqa: E731
    assert (
        _gap(_train(stacked, freeze_layers(layerwise(lamb), [0], where=where), x), want)
        < 1e-5
    )
    assert _gap(_train(stacked, freeze_layers(lamb, [0], where=where), x), want) > 1e-4
    # A mask outside layerwise sees the whole tree, one inside sees one layer.
    lamb = optax.lamb(1e-2)
    got = _train(stacked, optax.masked(layerwise(lamb), weight_decay_mask), x)
    want = _train(unstacked, optax.masked(lamb, _ndim_mask), x)
    assert _gap(got, want) < 1e-5


def test_per_layer_state_and_errors(getkey):
    stacked, _ = _models(getkey(), "stacked")
    params = eqx.filter(stacked, eqx.is_inexact_array)
    tx = layerwise(optax.adam(1e-2))
    state = tx.init(params)
    mu = state.stacks[0][0].mu
    # Buffers have the parameters' layout, each layer's state a row of it.
    assert type(mu) is Net and mu.embed.weight is None
    assert mu.body.layers.w1.shape == params.body.layers.w1.shape
    assert state.stacks[0][0].count.shape == (3,)
    assert state.rest[0].mu.embed.weight.shape == (DIM, DIM)
    with pytest.raises(TypeError, match="GradientTransformation"):
        layerwise(optax.adam)  # type: ignore[arg-type]
    short = eqx.tree_at(lambda p: p.body.layers.w1, params, params.body.layers.w1[:2])
    with pytest.raises(ValueError, match=r"\.body\.layers\.w1` has shape \(2, 8, 32\)"):
        tx.init(short)
    match = "hold 1 Stacked modules.*not a LayerwiseState"
    with pytest.raises(ValueError, match=match):
        tx.update(params, optax.adam(1e-2).init(params), params)
    # A state for another depth is named, not left to optax's tree error.
    fewer = eqx.filter(stacked.body[:2], eqx.is_inexact_array)
    fewer = eqx.tree_at(lambda p: p.body, params, fewer)
    with pytest.raises(
        ValueError, match=r"`\.body` has 2 layers.*`.*count` has 3 rows"
    ):
        tx.update(fewer, state, fewer)
    # Only some leaves sliced: the one left whole is named, with its rows (the
    # message said "has 2 layers, but ... built for 2").
    half = eqx.tree_at(
        lambda s: s.stacks[0][0].mu,
        state,
        jax.tree.map(lambda a: a[:2], state.stacks[0][0].mu),
    )
    with pytest.raises(ValueError, match=r"has 2 layers.*`\[0\]\.count` has 3 rows"):
        tx.update(fewer, half, fewer)
    # A hyperparameter injected inside `layerwise` is one per layer: set to a
    # scalar, the update failed with `vmap`'s rank error.
    inject = layerwise(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    scalar = optax.tree_utils.tree_set(inject.init(params), learning_rate=0.25)
    with pytest.raises(ValueError, match=r"`.*learning_rate'\]` has no layer axis"):
        inject.update(params, scalar, params)
    # MultiSteps accumulates whole steps: it goes outside, as the hint says.
    with pytest.raises(TypeError, match=r"MultiSteps\(layerwise\(tx\)"):
        layerwise(optax.MultiSteps(optax.adam(1e-2), 2))
    outside = optax.MultiSteps(layerwise(optax.adam(1e-2)), 2)
    with jax.numpy_dtype_promotion("standard"):  # optax's own mixes int and float
        _, ms_state = outside.update(params, outside.init(params), params)
    assert isinstance(ms_state.inner_opt_state, LayerwiseState)


def test_per_layer_mask_tree_of_the_whole_model_is_named(getkey):
    # Each layer's state is built from one layer's parameters: a mask or labels
    # tree of the whole model fails inside, with a hint, not optax's bare
    # pytree-structure error.
    stacked, _ = _models(getkey(), "stacked")
    params = eqx.filter(stacked, eqx.is_inexact_array)
    labels = jax.tree.map(lambda a: "w" if a.ndim >= 2 else "b", params)
    for tx in (
        optax.masked(optax.adam(1e-2), _ndim_mask(params)),
        optax.multi_transform({"w": optax.adam(1e-2), "b": optax.sgd(1.0)}, labels),
    ):
        with pytest.raises(ValueError, match=r"one layer of the Stacked at `\.body`"):
            layerwise(tx).init(params)


def test_freeze_layers_inside_layerwise_is_refused(getkey):
    # Inside, it saw one layer: "found 0 Stacked modules ... pass `where=`",
    # and with `where=lambda m: m.body` an AttributeError.
    stacked, _ = _models(getkey(), "stacked")
    params = eqx.filter(stacked, eqx.is_inexact_array)
    for where in (None, lambda m: m.body):
        tx = layerwise(freeze_layers(optax.sgd(1.0), [0], where=where))
        with pytest.raises(ValueError, match="freeze_layers runs inside"):
            tx.update(params, tx.init(params), params)


def test_per_layer_noise_is_each_layers_own(getkey):
    # vmap gave every layer's `init` the same key: every layer drew the same
    # noise. Layer i's key is now the key with i folded in.
    stacked, _ = _models(getkey(), "stacked")
    params = eqx.filter(stacked, eqx.is_inexact_array)
    zeros = jax.tree.map(jnp.zeros_like, params)
    noisy = optax.noisy_sgd(1.0, key=jax.random.key(3))
    tx = layerwise(noisy)
    with jax.numpy_dtype_promotion("standard"):  # optax's noise schedule
        updates, _ = tx.update(zeros, tx.init(params), params)
        for i, layer in enumerate(_layers(updates.body)):
            state = noisy.init(layer)
            key = jax.random.fold_in(state[0].rng_key, i)
            state = (state[0]._replace(rng_key=key),) + state[1:]
            zero = jax.tree.map(jnp.zeros_like, layer)
            want, _ = noisy.update(zero, state, layer)
            np.testing.assert_allclose(layer.w1, want.w1, rtol=1e-6)
    w1 = updates.body.layers.w1
    assert not jnp.allclose(w1[0], w1[1])


def test_per_layer_sharded_and_checkpointed():
    """Under FSDP the state is sharded like its parameters, the update gathers
    no whole stack, and the state resumes bit-identically from a checkpoint."""
    out = run_script("optim_checks.py", timeout=300)
    assert "ok" in out.split()
