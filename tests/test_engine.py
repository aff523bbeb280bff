"""The scan engine: one normalised checkpoint value, nested remat in reverse
against the loop, and the caller's `eqx.nn.State` left valid."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan

from .helpers import tree_allclose


D = 3
POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


# --- one checkpoint value --------------------------------------------------------


def test_every_checkpoint_value_is_one_scan_checkpoint():
    plain = dict(save_carries=None, save_inputs=None)
    policy = jax.checkpoint_policies.dots_saveable
    for given, want in (
        (False, eqxscan.ScanCheckpoint(policy=False, **plain)),
        (True, eqxscan.ScanCheckpoint(policy=True, **plain)),
        ("auto", eqxscan.ScanCheckpoint(policy="auto", **plain)),
        (policy, eqxscan.ScanCheckpoint(policy=policy, **plain)),
        ("nested", eqxscan.ScanCheckpoint(save_carries=False, save_inputs=None)),
        (eqxscan.ScanCheckpoint(nested=2), eqxscan.ScanCheckpoint(nested=2)),
    ):
        options = eqxscan.ScanOptions(checkpoint=given)
        assert options.scan_checkpoint == want, given
        assert options.checkpoint is given  # as the user gave it
    offload = eqxscan.ScanOptions(checkpoint="offload").scan_checkpoint
    assert callable(offload.policy) and not offload.named
    # Only "auto" is resolved by the rule.
    rules = [
        eqxscan.ScanOptions(checkpoint=c).scan_checkpoint.is_rule
        for c in (False, True, "auto", "nested", "offload", eqxscan.ScanCheckpoint())
    ]
    assert rules == [False, False, True, False, False, False]
    assert eqxscan.ScanOptions(checkpoint="auto") == eqxscan.ScanOptions()
    assert eqxscan.ScanOptions(checkpoint=True) != eqxscan.ScanOptions()
    with pytest.raises((TypeError, ValueError), match="save_inputs"):
        eqxscan.ScanCheckpoint(save_inputs="host")


# --- nested remat, reversed, against the loop ---------------------------------------


NESTED = [
    "nested",
    eqxscan.ScanCheckpoint(nested=2),
    eqxscan.ScanCheckpoint(nested=(2, 3)),
    eqxscan.ScanCheckpoint(nested=3, save_carries="offload", save_inputs=True),
]


def value_and_grads(fn, *args):
    """The value and every argument's gradient, as a list of arrays (so that
    modules with different options compare)."""
    out = eqx.filter_value_and_grad(lambda args: fn(*args))(args)
    return jax.tree_util.tree_leaves(eqx.filter(out, eqx.is_array))


def _dense(key):
    return eqx.nn.Linear(D, D, key=key)


class Tagged(eqx.Module):
    """A layer whose output depends on the step's position (via `shift`), so a
    reversed run that read its layers or inputs out of order is caught."""

    linear: eqx.nn.Linear
    shift: jax.Array

    def __call__(self, x):
        return jnp.tanh(self.linear(x) + self.shift)


def _loss(rnn, h0, xs):
    h, hs = rnn(h0, xs)
    return jnp.sum(jnp.sin(h)) + jnp.sum(jnp.cos(hs) * jnp.arange(6.0)[:, None])


@pytest.mark.parametrize("checkpoint", NESTED)
def test_nested_recurrent_reverse_matches_the_loop(checkpoint, getkey):
    cell = eqxscan.ElmanCell(D, D, key=getkey())
    h0, xs = jr.normal(getkey(), (D,)), jr.normal(getkey(), (6, D))

    for reverse in (False, True):
        loop = eqxscan.Recurrent(cell, mode="loop", checkpoint=False, reverse=reverse)
        scan = eqxscan.Recurrent(cell, checkpoint=checkpoint, reverse=reverse)
        want = value_and_grads(_loss, loop, h0, xs)
        got = value_and_grads(_loss, scan, h0, xs)
        assert tree_allclose(got, want, rtol=1e-4), (checkpoint, reverse)
        # The reversed run differs from the forward one (so the check has teeth).
        if reverse:
            fwd = eqxscan.Recurrent(cell, mode="loop", checkpoint=False)
            assert not np.allclose(value_and_grads(_loss, fwd, h0, xs)[0], want[0])


@pytest.mark.parametrize("checkpoint", NESTED)
def test_nested_stacked_and_chain_reverse_match_the_loop(checkpoint, getkey):
    def make(key):
        k1, k2 = jr.split(key)
        return Tagged(_dense(k1), jr.normal(k2, (D,)))

    stack = eqxscan.Stacked(make, 6, key=getkey())
    x = jr.normal(getkey(), (D,))

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x, reverse=True)))

    want = value_and_grads(loss, stack.with_options(mode="loop", checkpoint=False), x)
    got = value_and_grads(loss, stack.with_options(checkpoint=checkpoint), x)
    assert tree_allclose(got, want, rtol=1e-4), checkpoint
    forward = jax.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x))))(stack)[0]
    assert not np.allclose(forward, want[0])

    # A Chain: a scanned run of six between two lone layers, reversed.
    layers = [eqx.nn.Lambda(jnp.tanh), *stack.unstack(), eqx.nn.Lambda(jnp.sin)]
    chain = eqxscan.Chain(layers, checkpoint=checkpoint)
    ref = eqxscan.Chain(layers, mode="loop", checkpoint=False)
    assert tree_allclose(
        value_and_grads(loss, chain, x), value_and_grads(loss, ref, x), rtol=1e-4
    ), checkpoint


# --- the caller's eqx.nn.State stays valid --------------------------------------


class Counter(eqx.Module):
    """A cell whose carry holds an `eqx.nn.State`: it adds each input to a sum."""

    index: eqx.nn.StateIndex

    def __init__(self):
        self.index = eqx.nn.StateIndex(jnp.zeros(D))

    def __call__(self, x, carry):
        h, state = carry
        total = state.get(self.index)
        return jnp.tanh(h + x), state.set(self.index, total + x)


@pytest.mark.parametrize("options", [dict(), dict(unroll=True), dict(mode="loop")])
def test_recurrent_leaves_the_callers_state_valid(options):
    cell, state = eqx.nn.make_with_state(Counter)()
    xs = jnp.arange(4 * D, dtype=jnp.float32).reshape(4, D)
    (h, new), hs = eqxscan.Recurrent(cell, **options)((jnp.zeros(D), state), xs)
    np.testing.assert_array_equal(state.get(cell.index), jnp.zeros(D))
    np.testing.assert_allclose(new.get(cell.index), xs.sum(0))
    # As `jax.lax.scan` over the same cell leaves it.
    _, _ = jax.lax.scan(lambda c, x: (cell(x, c), None), (jnp.zeros(D), state), xs)
    np.testing.assert_array_equal(state.get(cell.index), jnp.zeros(D))


class Tally(eqx.Module):
    """A stateful layer, `layer(x, state) -> (x, state)`, summing its inputs."""

    linear: eqx.nn.Linear
    index: eqx.nn.StateIndex

    def __init__(self, *, key):
        self.linear = eqx.nn.Linear(D, D, key=key)
        self.index = eqx.nn.StateIndex(jnp.zeros(D))

    def __call__(self, x, state):
        total = state.get(self.index)
        return jnp.tanh(self.linear(x)), state.set(self.index, total + x)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_stateful_stacked_leaves_the_callers_state_valid(mode):
    model, state = eqx.nn.make_with_state(eqxscan.Stacked)(
        lambda k: Tally(key=k), 3, key=jr.key(0), mode=mode
    )
    x = jnp.ones(D)
    y, new = model(x, state)
    np.testing.assert_array_equal(state.get(model.layers.index), jnp.zeros((3, D)))
    np.testing.assert_allclose(new.get(model.layers.index)[0], x)
    y2, _ = model(x, state)  # the old state can be used again
    np.testing.assert_allclose(y2, y)
