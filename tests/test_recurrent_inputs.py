"""Recurrent over time: `time_axis`, broadcast arguments, `broadcast_key` and
`length` without inputs, each against a hand-written loop: values and gradients,
in scan and loop mode."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan

from .helpers import (
    B,
    elman,
    HID,
    IN,
    MemoryCell,
    MODES,
    T,
    tree_allclose,
    untyped,
    value_and_grads,
)


# ------------------------------------------------------- over time: time_axis


class BatchCell(eqx.Module):
    """A cell on a batch: `x [B, IN]`, `h [B, HID]`."""

    inner: eqxscan.ElmanCell

    def __call__(self, x, h):
        return jax.vmap(self.inner)(x, h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("time_axis", [1, -2])
def test_time_axis_batch_major(mode, time_axis, getkey):
    cell = BatchCell(elman(getkey()))
    h0, xs = jr.normal(getkey(), (B, HID)), jr.normal(getkey(), (B, T, IN))
    rnn = eqxscan.Recurrent(cell, mode=mode)

    def reference(cell, h0, xs):
        h, hs = h0, []
        for t in range(T):
            h = cell(xs[:, t], h)
            hs.append(h)
        return h, jnp.stack(hs, axis=1)

    run = lambda c, h, x: eqxscan.Recurrent(c, mode=mode)(h, x, time_axis=time_axis)
    out, grads = value_and_grads(run, cell, h0, xs)
    assert out[1].shape == (B, T, HID)
    want, want_grads = value_and_grads(reference, cell, h0, xs)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # The same as mapping an unbatched run over the batch.
    per_example = jax.vmap(eqxscan.Recurrent(cell.inner, mode=mode))(h0, xs)
    assert tree_allclose(out, per_example)
    assert tree_allclose(rnn(h0, xs, time_axis=time_axis), out)


def test_time_axis_pytree_and_reverse(getkey):
    # Leaves of different rank, each with time on axis 1; hs follows the carry.
    inner = elman(getkey())
    cell = lambda x, h: jax.vmap(inner)(x["a"] * x["b"], h)
    xs = {"a": jr.normal(getkey(), (B, T, IN)), "b": jr.normal(getkey(), (B, T, 1))}
    h0 = jr.normal(getkey(), (B, HID))
    h_T, hs = eqxscan.Recurrent(cell, reverse=True)(h0, xs, time_axis=1)
    moved = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), xs)
    want_T, want_hs = eqxscan.Recurrent(cell, reverse=True, mode="loop")(h0, moved)
    assert tree_allclose(h_T, want_T) and tree_allclose(hs, jnp.moveaxis(want_hs, 0, 1))
    assert jnp.allclose(hs[:, 0], h_T)  # reversed: the last carry is at t = 0


def test_time_axis_errors(getkey):
    rnn = eqxscan.Recurrent(BatchCell(elman(getkey())))
    h0 = jnp.zeros((B, HID))
    with pytest.raises(ValueError, match=r"xs\['b'\] has shape \(2, 6, 3\).*axis "):
        rnn(h0, {"a": jnp.ones((B, T, IN)), "b": jnp.ones((B, T + 1, IN))}, time_axis=1)
    with pytest.raises(ValueError, match=r"shape \(2, 5, 3\).*no axis time_axis=3"):
        rnn(h0, jnp.ones((B, T, IN)), time_axis=3)
    scalar_carry = eqxscan.Recurrent(lambda x, h: h + jnp.sum(x))
    with pytest.raises(ValueError, match=r"hs.*shape \(\) per step.*time_axis=1"):
        scalar_carry(jnp.float32(0), jnp.ones((B, T)), time_axis=1)


# ------------------------------------------------- over time: broadcast arguments


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_arguments(mode, getkey):
    cell = MemoryCell(elman(getkey()))
    h0, xs = jr.normal(getkey(), (HID,)), jr.normal(getkey(), (T, IN))
    memory, scale = jr.normal(getkey(), (HID, HID)), jnp.float32(0.5)

    def run(cell, h0, xs, memory, scale):
        rnn = eqxscan.Recurrent(cell, mode=mode)
        return rnn(h0, xs, memory, cell_kwargs={"scale": scale})

    def reference(cell, h0, xs, memory, scale):
        h, hs = h0, []
        for t in range(T):
            h = cell(xs[t], h, memory, scale=scale)
            hs.append(h)
        return h, jnp.stack(hs)

    out, grads = value_and_grads(run, cell, h0, xs, memory, scale)
    want, want_grads = value_and_grads(reference, cell, h0, xs, memory, scale)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads, rtol=1e-4)
    assert float(jnp.abs(grads[3]).sum()) > 0 and float(grads[4]) != 0
    # Both directions of a Bidirectional get the constants too.
    bi = eqxscan.Bidirectional(cell, cell)
    (h_f, h_b), _ = bi((h0, h0), xs, memory, cell_kwargs={"scale": scale})
    assert tree_allclose(h_f, want[0])


# ----------------------------------------------------- over time: broadcast_key


class DropCell(eqx.Module):
    """Recurrent dropout on the hidden state: one mask per key."""

    inner: eqxscan.ElmanCell

    def __call__(self, x, h, *, key):
        keep = jr.bernoulli(key, 0.5, h.shape)
        return self.inner(x, jnp.where(keep, h, 0.0))


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_key(mode, getkey):
    cell = DropCell(elman(getkey()))
    h0, xs, key = jr.normal(getkey(), (HID,)), jr.normal(getkey(), (T, IN)), getkey()
    rnn = eqxscan.Recurrent(cell, mode=mode)
    run = lambda c, h, x: eqxscan.Recurrent(c, mode=mode)(
        h, x, key=key, broadcast_key=True
    )

    def reference(cell, h0, xs):
        h, hs = h0, []
        for t in range(T):
            h = cell(xs[t], h, key=key)  # the same key at every step
            hs.append(h)
        return h, jnp.stack(hs)

    out, grads = value_and_grads(run, cell, h0, xs)
    want, want_grads = value_and_grads(reference, cell, h0, xs)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # Split keys (the default) drop other units: the option changes the result.
    assert not tree_allclose(rnn(h0, xs, key=key), out)
    # The one key is checked as a split one is, not blamed on the cell's input.
    for bad in (jr.split(key, 2), 0):
        with untyped(), pytest.raises(TypeError, match="Recurrent needs `key` to"):
            rnn(h0, xs, key=bad, broadcast_key=True)


# ------------------------------------------- over time: length without inputs


class Generator(eqx.Module):
    """Autoregressive: ignores its input (None) and feeds back its state."""

    weight: jax.Array

    def __call__(self, x, h, *, key=None):
        assert x is None
        h = jnp.tanh(self.weight @ h)
        return h if key is None else h + 0.1 * jr.normal(key, h.shape)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reverse", [False, True])
def test_length_without_inputs(mode, reverse, getkey):
    cell = Generator(jr.normal(getkey(), (HID, HID)))
    h0, key = jr.normal(getkey(), (HID,)), getkey()
    keys = jr.split(key, T)

    def run(cell, h0):
        return eqxscan.Recurrent(cell, mode=mode, reverse=reverse)(
            h0, length=T, key=key
        )

    def reference(cell, h0):
        h, hs = h0, [None] * T
        for t in reversed(range(T)) if reverse else range(T):
            h = hs[t] = cell(None, h, key=keys[t])
        return h, jnp.stack(hs)

    out, grads = value_and_grads(run, cell, h0)
    want, want_grads = value_and_grads(reference, cell, h0)
    assert out[1].shape == (T, HID)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # lax.scan's own spelling of the same run.
    h_T, _ = jax.lax.scan(
        lambda h, k: (cell(None, h, key=k),) * 2, h0, keys, reverse=reverse
    )
    assert jnp.allclose(h_T, out[0], atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_static_options_numpy_scalars_and_arrays(mode, getkey):
    # The options that shape the program read NumPy scalars as Python ones and
    # refuse arrays, in both modes (the compiled call would trace an array).
    cell = Generator(jr.normal(getkey(), (HID, HID)))
    h0, key = jr.normal(getkey(), (HID,)), getkey()
    rnn = eqxscan.Recurrent(cell, mode=mode)
    scalars = dict(truncate=np.int64(2), time_axis=np.int64(0))
    h_T, _ = rnn(
        h0, length=np.int64(T), key=key, broadcast_key=np.bool_(True), **scalars
    )
    h = h0
    for _ in range(T):
        h = cell(None, h, key=key)
    assert jnp.allclose(h_T, h, atol=1e-6)
    arrays = dict(
        truncate=jnp.array(2),
        length=np.array(T),
        time_axis=jnp.array(0),
        broadcast_key=np.array(True),
    )
    for name, value in arrays.items():
        with pytest.raises(
            TypeError, match=f"^{name} must be a Python (int|bool), got"
        ):
            rnn(h0, **{"length": T, name: value}, key=key)
    # A string would read as true.
    with untyped(), pytest.raises(TypeError, match="^broadcast_key must be a bool"):
        rnn(h0, length=T, key=key, broadcast_key="False")


@pytest.mark.parametrize("mode", MODES)
def test_length_zero(mode, getkey):
    cell = elman(getkey())
    lstm = eqx.nn.LSTMCell(IN, HID, key=getkey())
    h0 = jr.normal(getkey(), (HID,))
    rnn = eqxscan.Recurrent(cell, mode=mode)
    generator = eqxscan.Recurrent(lambda x, h: 2 * h, mode=mode)
    for h_T, hs in (rnn(h0, jnp.ones((0, IN))), generator(h0, length=0)):
        # Eager calls run compiled, so h_T is h0's value (not the same object).
        assert (
            jnp.array_equal(h_T, h0) and hs.shape == (0, HID) and hs.dtype == h0.dtype
        )
    # As lax.scan with length 0, pytree carries included.
    c0 = (h0, jnp.zeros(HID))
    h_T, hs = eqxscan.Recurrent(lstm, mode=mode)(c0, jnp.ones((0, IN)))
    want = jax.lax.scan(lambda c, x: (lstm(x, c),) * 2, c0, jnp.ones((0, IN)))
    assert tree_allclose((h_T, hs), want)
    # Batch-major, empty time axis: hs keeps the layout.
    _, hs = eqxscan.Recurrent(BatchCell(cell), mode=mode)(
        jnp.zeros((B, HID)), jnp.ones((B, 0, IN)), time_axis=1
    )
    assert hs.shape == (B, 0, HID)
    # Gradient of the final carry w.r.t. h0 is the identity.
    jac = jax.jacobian(lambda h: rnn(h, jnp.ones((0, IN)))[0])(h0)
    assert jnp.array_equal(jac, jnp.eye(HID))


def test_length_errors(getkey):
    rnn = eqxscan.Recurrent(elman(getkey()))
    h0 = jnp.zeros(HID)
    with pytest.raises(ValueError, match=r"length=4 was given, but xs has 5 steps"):
        rnn(h0, jnp.ones((T, IN)), length=4)
    with pytest.raises(ValueError, match="length must be a non-negative int"):
        rnn(h0, length=-1)
    with pytest.raises(ValueError, match="no array leaves.*length=T"):
        rnn(h0)
    # A cell that cannot run fails at T = 0 too, as it would on a longer sequence.
    bad = eqxscan.Recurrent(lambda x, h: jnp.concatenate([h, x]))
    with pytest.raises(TypeError, match="changed carry leaf"):
        bad(h0, jnp.ones((0, IN)))
