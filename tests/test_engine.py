"""The scan engine: one normalised remat value, nested remat in reverse
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


# --- one remat value --------------------------------------------------------


def test_every_checkpoint_value_is_one_scan_checkpoint():
    plain = dict(save_carries=None, save_inputs=None)
    policy = jax.checkpoint_policies.dots_saveable
    for given, want in (
        (False, eqxscan.ScanRemat(policy=False, **plain)),
        (True, eqxscan.ScanRemat(policy=True, **plain)),
        ("auto", eqxscan.ScanRemat(policy="auto", **plain)),
        (policy, eqxscan.ScanRemat(policy=policy, **plain)),
        ("nested", eqxscan.ScanRemat(save_carries=False, save_inputs=None)),
        (eqxscan.ScanRemat(nested=2), eqxscan.ScanRemat(nested=2)),
    ):
        options = eqxscan.ScanOptions(remat=given)
        assert options.scan_remat == want, given
        assert options.remat is given  # as the user gave it
    offload = eqxscan.ScanOptions(remat="offload").scan_remat
    assert callable(offload.policy) and not offload.named
    # Only "auto" is resolved by the rule.
    rules = [
        eqxscan.ScanOptions(remat=c).scan_remat.is_rule
        for c in (False, True, "auto", "nested", "offload", eqxscan.ScanRemat())
    ]
    assert rules == [False, False, True, False, False, False]
    assert eqxscan.ScanOptions(remat="auto") == eqxscan.ScanOptions()
    assert eqxscan.ScanOptions(remat=True) != eqxscan.ScanOptions()
    with pytest.raises((TypeError, ValueError), match="save_inputs"):
        eqxscan.ScanRemat(save_inputs="host")


# --- nested remat, reversed, against the loop ---------------------------------------


NESTED = [
    "nested",
    eqxscan.ScanRemat(nested=2),
    eqxscan.ScanRemat(nested=(2, 3)),
    eqxscan.ScanRemat(nested=3, save_carries="offload", save_inputs=True),
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


@pytest.mark.parametrize("remat", NESTED)
def test_nested_recurrent_reverse_matches_the_loop(remat, getkey):
    cell = eqxscan.ElmanCell(D, D, key=getkey())
    h0, xs = jr.normal(getkey(), (D,)), jr.normal(getkey(), (6, D))

    for reverse in (False, True):
        loop = eqxscan.Recurrent(cell, mode="loop", remat=False, reverse=reverse)
        scan = eqxscan.Recurrent(cell, remat=remat, reverse=reverse)
        want = value_and_grads(_loss, loop, h0, xs)
        got = value_and_grads(_loss, scan, h0, xs)
        assert tree_allclose(got, want, rtol=1e-4), (remat, reverse)
        # The reversed run differs from the forward one (so the check has teeth).
        if reverse:
            fwd = eqxscan.Recurrent(cell, mode="loop", remat=False)
            assert not np.allclose(value_and_grads(_loss, fwd, h0, xs)[0], want[0])


@pytest.mark.parametrize("remat", NESTED)
def test_nested_stacked_and_chain_reverse_match_the_loop(remat, getkey):
    def make(key):
        k1, k2 = jr.split(key)
        return Tagged(_dense(k1), jr.normal(k2, (D,)))

    stack = eqxscan.Stacked(make, 6, key=getkey())
    x = jr.normal(getkey(), (D,))

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x, reverse=True)))

    want = value_and_grads(loss, stack.with_options(mode="loop", remat=False), x)
    got = value_and_grads(loss, stack.with_options(remat=remat), x)
    assert tree_allclose(got, want, rtol=1e-4), remat
    forward = jax.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x))))(stack)[0]
    assert not np.allclose(forward, want[0])

    # A Chain: a scanned run of six between two lone layers, reversed.
    layers = [eqx.nn.Lambda(jnp.tanh), *stack.unstack(), eqx.nn.Lambda(jnp.sin)]
    chain = eqxscan.Chain(layers, remat=remat)
    ref = eqxscan.Chain(layers, mode="loop", remat=False)
    assert tree_allclose(
        value_and_grads(loss, chain, x), value_and_grads(loss, ref, x), rtol=1e-4
    ), remat


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


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_a_numpy_carry_is_taken_as_jax_takes_it(mode):
    # NumPy's default float64 is float32 to JAX (without x64): the loop takes
    # such a carry as the scan does, rather than calling float32 a change.
    stack = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(D, D, key=k), 2, key=jr.key(0), mode=mode
    )
    x = np.linspace(-1.0, 1.0, D)
    y = stack(x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, stack[1](stack[0](jnp.asarray(x))), rtol=1e-6)
    rnn = eqxscan.Recurrent(eqx.nn.GRUCell(D, D, key=jr.key(1)), mode=mode)
    h, _ = rnn(np.zeros(D), jnp.ones((2, D)))
    want = rnn.cell(jnp.ones(D), rnn.cell(jnp.ones(D), jnp.zeros(D)))
    np.testing.assert_allclose(h, want, rtol=1e-6)
