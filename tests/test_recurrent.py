import functools as ft
import os
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxscan

from .helpers import stable_id, tree_allclose, untyped


IN, HID, T = 3, 4, 7
CELLS = ("elman", "gru", "lstm")


def make_cell(name, key, dtype=None):
    if name == "elman":
        return eqxscan.ElmanCell(IN, HID, dtype=dtype, key=key)
    if name == "gru":
        return eqx.nn.GRUCell(IN, HID, dtype=dtype, key=key)
    return eqx.nn.LSTMCell(IN, HID, dtype=dtype, key=key)


def make_h0(name, key, dtype=jnp.float32):
    k1, k2 = jr.split(key)
    h = jr.normal(k1, (HID,), dtype)
    return (h, jr.normal(k2, (HID,), dtype)) if name == "lstm" else h


class NoisyCell(eqx.Module):
    inner: eqxscan.ElmanCell

    def __call__(self, x, h, *, key):
        return self.inner(x, h) + 0.1 * jr.normal(key, h.shape)


def python_loop(cell, h0, xs, *, reverse=False, mask=None, truncate=None, keys=None):
    """The reference: a plain Python loop over time, no eqxscan machinery."""
    hs = [None] * len(xs)
    h, n = h0, 0  # n: the steps consumed so far (a masked step is skipped)
    order = range(len(xs) - 1, -1, -1) if reverse else range(len(xs))
    for t in order:
        kept = mask is None or bool(mask[t])
        if truncate is not None and kept and n > 0 and n % truncate == 0:
            h = jax.lax.stop_gradient(h)
        new = cell(xs[t], h) if keys is None else cell(xs[t], h, key=keys[t])
        if not kept:
            new = h
        n += kept
        h = hs[t] = new
    return h, jtu.tree_map(lambda *a: jnp.stack(a), *hs)


def readout(out):
    """A scalar loss touching the final carry and every step's carry."""
    h_T, hs = out
    return sum(jnp.sum(jnp.sin(a)) for a in jtu.tree_leaves(hs)) + sum(
        jnp.sum(a**2) for a in jtu.tree_leaves(h_T)
    )


def grads(run, cell, h0, xs):
    """Gradients of `readout(run(cell, h0, xs))` w.r.t. the cell, h0 and xs."""
    return jax.grad(lambda c, h, x: readout(run(c, h, x)), argnums=(0, 1, 2))(
        cell, h0, xs
    )


# ---------------------------------------------------------------------- values


@pytest.mark.parametrize("name", CELLS)
@pytest.mark.parametrize("reverse", [False, True])
def test_matches_python_loop(name, reverse, getkey):
    cell, h0 = make_cell(name, getkey()), make_h0(name, getkey())
    xs = jr.normal(getkey(), (T, IN))
    scan = lambda c, h, x: eqxscan.Recurrent(c, reverse=reverse)(h, x)
    mode_loop = lambda c, h, x: eqxscan.Recurrent(c, reverse=reverse, mode="loop")(h, x)
    ref = lambda c, h, x: python_loop(c, h, x, reverse=reverse)
    expected = ref(cell, h0, xs)
    assert tree_allclose(scan(cell, h0, xs), expected)
    assert tree_allclose(mode_loop(cell, h0, xs), expected)
    expected_grads = grads(ref, cell, h0, xs)
    assert tree_allclose(grads(scan, cell, h0, xs), expected_grads, rtol=1e-5)
    assert tree_allclose(grads(mode_loop, cell, h0, xs), expected_grads, rtol=1e-5)


@pytest.mark.parametrize("name", CELLS)
def test_matches_handwritten_lax_scan(name, getkey):
    cell, h0 = make_cell(name, getkey()), make_h0(name, getkey())
    xs = jr.normal(getkey(), (T, IN))

    def by_hand(c, h, x):
        def body(h, x_t):
            h = c(x_t, h)
            return h, h

        return jax.lax.scan(body, h, x)

    run = lambda c, h, x: eqxscan.Recurrent(c)(h, x)
    assert tree_allclose(run(cell, h0, xs), by_hand(cell, h0, xs))
    assert tree_allclose(grads(run, cell, h0, xs), grads(by_hand, cell, h0, xs))


@pytest.mark.parametrize(
    "options",
    [
        dict(remat=False),
        dict(remat=True),
        dict(remat="nested"),
        dict(remat=jax.checkpoint_policies.nothing_saveable),
        dict(unroll=3),
        dict(remat="nested", reverse=True),
    ],
    ids=stable_id,
)
def test_options_give_same_values_and_grads(options, getkey):
    # Every option combined with mask, truncate and per-step keys.
    cell, h0 = NoisyCell(make_cell("gru", getkey())), make_h0("gru", getkey())
    xs, key = jr.normal(getkey(), (T, IN)), getkey()
    mask = jnp.array([True, False, True, True, True, False, True])
    reverse = options.get("reverse", False)
    run = lambda c, h, x: eqxscan.Recurrent(c, **options)(
        h, x, mask=mask, truncate=3, key=key
    )
    ref = lambda c, h, x: python_loop(
        c, h, x, reverse=reverse, mask=mask, truncate=3, keys=jr.split(key, T)
    )
    assert tree_allclose(run(cell, h0, xs), ref(cell, h0, xs))
    assert tree_allclose(grads(run, cell, h0, xs), grads(ref, cell, h0, xs))


def test_pytree_inputs_and_non_array_leaves(getkey):
    # xs may be any pytree with time on axis 0; non-array leaves pass through.
    cell = eqxscan.ElmanCell(IN, HID, key=getkey())
    a, b = jr.normal(getkey(), (T, IN)), jr.normal(getkey(), (T, IN))
    seen = []

    def two_inputs(x, h):
        seen.append(x["tag"])
        return cell(x["a"] * x["b"], h)

    xs = {"a": a, "b": b, "tag": "hello"}
    out = eqxscan.Recurrent(two_inputs)(jnp.zeros(HID), xs)
    assert tree_allclose(out, python_loop(cell, jnp.zeros(HID), a * b))
    assert set(seen) == {"hello"}


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_non_array_carry_leaf_with_mask_and_truncate(mode, getkey):
    # A static leaf of the carry passes through, with a mask and truncation too.
    cell = eqxscan.ElmanCell(IN, HID, key=getkey())
    xs = jr.normal(getkey(), (T, IN))
    mask = jnp.arange(T) % 3 != 1
    tagged = eqxscan.Recurrent(lambda x, h: (cell(x, h[0]), h[1]), mode=mode)
    plain = eqxscan.Recurrent(cell, mode=mode)

    def run(h0, tag):
        h_T, hs = tagged((h0, tag), xs, mask=mask, truncate=2)
        assert h_T[1] == hs[1] == tag
        return jnp.sum(jnp.sin(hs[0])), (h_T[0], hs[0])

    def run_plain(h0):
        h_T, hs = plain(h0, xs, mask=mask, truncate=2)
        return jnp.sum(jnp.sin(hs)), (h_T, hs)

    h0 = jr.normal(getkey(), (HID,))
    (_, out), g = jax.value_and_grad(run, has_aux=True)(h0, "tag")
    (_, ref), g_ref = jax.value_and_grad(run_plain, has_aux=True)(h0)
    assert tree_allclose((out, g), (ref, g_ref))


def test_hs_alignment_and_reverse(getkey):
    # hs[t] is the carry right after consuming xs[t], in both directions.
    cell, h0 = make_cell("elman", getkey()), make_h0("elman", getkey())
    xs = jr.normal(getkey(), (T, IN))
    h_T, hs = eqxscan.Recurrent(cell, reverse=True)(h0, xs)
    h_f, hs_f = eqxscan.Recurrent(cell)(h0, xs[::-1])
    assert tree_allclose(hs, hs_f[::-1]) and tree_allclose(h_T, h_f)
    assert tree_allclose(h_T, hs[0])
    assert tree_allclose(hs[-1], cell(xs[-1], h0))
    assert tree_allclose(hs[-2], cell(xs[-2], hs[-1]))
    _, hs = eqxscan.Recurrent(cell)(h0, xs)
    assert tree_allclose(hs[0], cell(xs[0], h0))
    assert tree_allclose(hs[1], cell(xs[1], hs[0]))


def test_single_step(getkey):
    cell, h0 = make_cell("lstm", getkey()), make_h0("lstm", getkey())
    x = jr.normal(getkey(), (1, IN))
    h_T, hs = eqxscan.Recurrent(cell)(h0, x)
    assert tree_allclose(h_T, cell(x[0], h0))
    assert tree_allclose(hs, jtu.tree_map(lambda a: a[None], h_T))


def test_is_a_pytree_module(getkey):
    rnn = eqxscan.Recurrent(make_cell("elman", getkey()), remat=True)
    xs = jr.normal(getkey(), (T, IN))
    g = eqx.filter_grad(lambda r: jnp.sum(r(jnp.zeros(HID), xs)[0]))(rnn)
    assert type(g) is eqxscan.Recurrent and g.remat is True
    assert g.cell.weight_hh.shape == (HID, HID)
    loop = rnn.with_options(mode="loop", unroll=2)
    assert (loop.mode, loop.unroll, loop.remat) == ("loop", 2, True)
    assert loop.cell is rnn.cell


# ---------------------------------------------------------------- batching


@pytest.mark.parametrize("name", ["gru", "lstm"])
def test_vmap_batch_equals_per_example(name, getkey):
    rnn = eqxscan.Recurrent(make_cell(name, getkey()))
    h0s = jax.vmap(lambda k: make_h0(name, k))(jr.split(getkey(), 3))
    xss = jr.normal(getkey(), (3, T, IN))
    batched = jax.vmap(rnn)(h0s, xss)
    for i in range(3):
        pick = ft.partial(jtu.tree_map, lambda a, i=i: a[i])
        assert tree_allclose(pick(batched), rnn(pick(h0s), xss[i]))


def test_jit_grad_vmap_composes(getkey):
    rnn = eqxscan.Recurrent(make_cell("gru", getkey()))
    h0s, xss = jnp.zeros((3, HID)), jr.normal(getkey(), (3, T, IN))
    mask = jnp.arange(T)[None, :] < jnp.array([[T], [3], [5]])

    def loss(rnn, xss, mask):
        h_T, hs = jax.vmap(ft.partial(rnn, truncate=2))(h0s, xss, mask=mask)
        return jnp.sum(h_T**2) + jnp.sum(jnp.tanh(hs))

    g_jit = jax.jit(jax.grad(loss))(rnn, xss, mask)
    g_loop = jax.grad(loss)(rnn.with_options(mode="loop"), xss, mask)
    assert tree_allclose(g_jit.cell, g_loop.cell)


# ----------------------------------------------------------------- masking


@pytest.mark.parametrize("name", CELLS)
def test_padded_batch_equals_unpadded_sequences(name, getkey):
    rnn = eqxscan.Recurrent(make_cell(name, getkey()))
    lengths = [T, 2, 5]
    xss = jr.normal(getkey(), (3, T, IN))
    h0s = jax.vmap(lambda k: make_h0(name, k))(jr.split(getkey(), 3))
    mask = jnp.arange(T)[None, :] < jnp.array(lengths)[:, None]
    h_T, hs = jax.vmap(rnn)(h0s, xss, mask=mask)
    for i, n in enumerate(lengths):
        pick = ft.partial(jtu.tree_map, lambda a, i=i: a[i])
        ref_T, ref_hs = rnn(pick(h0s), xss[i, :n])
        assert tree_allclose(pick(h_T), ref_T)
        assert tree_allclose(jtu.tree_map(lambda a, n=n: a[:n], pick(hs)), ref_hs)
        # On padded steps the carry is the one passed through.
        for t in range(n, T):
            assert tree_allclose(jtu.tree_map(lambda a, t=t: a[t], pick(hs)), ref_T)

    # Gradients agree too (padding contributes nothing).
    def padded(rnn):
        return jnp.sum(jtu.tree_leaves(jax.vmap(rnn)(h0s, xss, mask=mask)[0])[0])

    def unpadded(rnn):
        return sum(
            jnp.sum(
                jtu.tree_leaves(
                    rnn(jtu.tree_map(lambda a, i=i: a[i], h0s), xss[i, :n])
                )[0]
            )
            for i, n in enumerate(lengths)
        )

    assert tree_allclose(jax.grad(padded)(rnn), jax.grad(unpadded)(rnn))


def test_mask_any_pattern_matches_loop(getkey):
    # Left padding and holes: masked steps are skipped, in both directions.
    cell, h0 = make_cell("gru", getkey()), make_h0("gru", getkey())
    xs = jr.normal(getkey(), (T, IN))
    mask = jnp.array([False, False, True, False, True, True, False])
    for reverse in (False, True):
        for mode in ("scan", "loop"):
            run = lambda c, h, x, r=reverse, m=mode: eqxscan.Recurrent(
                c, reverse=r, mode=m
            )(h, x, mask=mask)
            ref = lambda c, h, x, r=reverse: python_loop(c, h, x, reverse=r, mask=mask)
            assert tree_allclose(run(cell, h0, xs), ref(cell, h0, xs))
            assert tree_allclose(grads(run, cell, h0, xs), grads(ref, cell, h0, xs))
    # Equal to running on the kept steps only.
    kept = xs[np.asarray(mask)]
    assert tree_allclose(
        eqxscan.Recurrent(cell)(h0, xs, mask=mask)[0],
        eqxscan.Recurrent(cell)(h0, kept)[0],
    )


PADDING = (jnp.nan, jnp.inf, -jnp.inf)


def pad(xs, value, before, after):
    """`xs` with `before` and `after` steps of `value` around it, and its mask."""
    fill = lambda n: jnp.full((n, *xs.shape[1:]), value, xs.dtype)
    padded = jnp.concatenate([fill(before), xs, fill(after)])
    mask = jnp.arange(len(padded)) >= before
    return padded, mask & (jnp.arange(len(padded)) < before + len(xs))


@pytest.mark.parametrize("name", ["elman", "lstm"])
@pytest.mark.parametrize("mode", ["scan", "loop"])
@pytest.mark.parametrize("reverse", [False, True])
def test_nonfinite_padding_leaves_values_and_grads_unchanged(
    name, mode, reverse, getkey
):
    # The `jnp.where` trap: the cell still runs on a masked step, and 0 * nan in
    # reverse mode would make every weight gradient NaN. Values and gradients
    # (cell weights, h0, the kept inputs) must be those of the unpadded run.
    cell, h0 = make_cell(name, getkey()), make_h0(name, getkey())
    xs = jr.normal(getkey(), (4, IN))
    before, after = 2, 3
    keep = slice(before, before + len(xs))

    def loss(run, cell, h0, xs):
        h_T, hs = run(cell, h0, xs)
        return readout((h_T, jtu.tree_map(lambda a: a[keep], hs)))

    def short(cell, h0, xs):
        h_T, hs = eqxscan.Recurrent(cell, reverse=reverse, mode=mode)(h0, xs[keep])
        # Aligned with the padded sequence, so `loss` picks the same steps.
        spread = lambda a: jnp.zeros((before, *a.shape[1:]), a.dtype)
        return h_T, jtu.tree_map(
            lambda a: jnp.concatenate([spread(a), a, a[:after]]), hs
        )

    grad = jax.grad(loss, argnums=(1, 2, 3))
    spread = jnp.concatenate([xs[:before], xs, xs[:after]])
    want, want_grads = short(cell, h0, spread), grad(short, cell, h0, spread)
    kept = ft.partial(jtu.tree_map, lambda a: a[keep])
    checkpoints = ("auto", "nested") if mode == "scan" else ("auto",)
    for remat in checkpoints:
        rnn = eqxscan.Recurrent(cell, reverse=reverse, mode=mode, remat=remat)

        @eqx.filter_jit  # one program for every padding value
        def both(cell, h0, padded, mask, rnn=rnn):
            run = lambda c, h, x: eqx.tree_at(lambda r: r.cell, rnn, c)(h, x, mask=mask)
            return run(cell, h0, padded), grad(run, cell, h0, padded)

        for value in PADDING:
            padded, mask = pad(xs, value, before, after)
            (h_T, hs), (g_cell, g_h0, g_xs) = both(cell, h0, padded, mask)
            where = (value, remat)
            assert tree_allclose(h_T, want[0]) and tree_allclose(
                kept(hs), kept(want[1])
            )
            assert tree_allclose(g_cell, want_grads[0]), where
            assert tree_allclose(g_h0, want_grads[1]), where
            assert tree_allclose(g_xs[keep], want_grads[2][keep]), where
            assert not jnp.any(g_xs[:before]) and not jnp.any(g_xs[keep.stop :])


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_an_all_padding_sequence_in_a_batch_keeps_grads_finite(mode, getkey):
    # A sequence with every step masked (an empty one in a padded batch) has no
    # kept input to stand in for its masked steps: run on its first input, NaN
    # padding, its cell would make every weight gradient of the batch NaN.
    cell, h0 = make_cell("elman", getkey()), make_h0("elman", getkey())
    xs = jr.normal(getkey(), (4, IN))
    batch = jnp.stack([xs, jnp.full_like(xs, jnp.nan)])
    mask = jnp.array([[True] * 4, [False] * 4])
    h0s = jnp.stack([h0, h0])

    def loss(cell):
        h_T, _ = jax.vmap(eqxscan.Recurrent(cell, mode=mode))(h0s, batch, mask=mask)
        return jnp.sum(h_T**2), h_T[1]  # the empty one's carry is h0

    want = jax.grad(lambda c: jnp.sum(eqxscan.Recurrent(c)(h0, xs)[0] ** 2))(cell)
    got, h_empty = jax.grad(loss, has_aux=True)(cell)
    assert tree_allclose(got, want)
    assert tree_allclose(h_empty, h0)


class Features(eqx.Module):
    """A cell on features of its input, finite on the data but not at zero."""

    inner: eqxscan.ElmanCell
    name: str = eqx.field(static=True)

    def __call__(self, x, h):
        f = jnp.log(x) if self.name == "log" else x / jnp.linalg.norm(x)
        return self.inner(f, h)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_masked_steps_see_a_kept_input(mode, getkey):
    # A masked step's cell sees the first kept input, not zeros, where log(x)
    # or x / |x| has infinite derivatives (0 * inf: NaN weight gradients, even
    # with harmless padding). Per-example masks, as in a padded batch.
    xs = jnp.exp(jr.normal(getkey(), (2, 4, IN)))  # positive
    h0 = jr.normal(getkey(), (2, HID))
    lengths = [(1, 3), (0, 2)]  # (padding before, kept steps) per example
    padded = jnp.ones((2, 6, IN))
    for i, (before, n) in enumerate(lengths):
        padded = padded.at[i, before : before + n].set(xs[i, :n])
    mask = jnp.array([[b <= t < b + n for t in range(6)] for b, n in lengths])
    for name in ("log", "unit"):
        cell = Features(make_cell("elman", getkey()), name)

        def loss(cell, xs, mask=None):
            rnn = eqxscan.Recurrent(cell, mode=mode)
            return jnp.sum(jax.vmap(rnn)(h0, xs, mask=mask)[0] ** 2)

        def short(cell, xs):
            rnn = eqxscan.Recurrent(cell, mode=mode)
            n = [n for _, n in lengths]
            return sum(jnp.sum(rnn(h0[i], xs[i, : n[i]])[0] ** 2) for i in range(2))

        want, padded_grad = jax.grad(short)(cell, xs), eqx.filter_jit(jax.grad(loss))
        for value in (1.0, jnp.nan):
            bad = jnp.where(mask[..., None], padded, value)
            assert tree_allclose(padded_grad(cell, bad, mask), want), (name, value)


def test_bidirectional_nonfinite_padding(getkey):
    bi = eqxscan.Bidirectional(make_cell("gru", getkey()), make_cell("gru", getkey()))
    h0 = (jr.normal(getkey(), (HID,)), jr.normal(getkey(), (HID,)))
    xs = jr.normal(getkey(), (4, IN))

    def loss(bi, h0, xs, **kw):
        (h_f, h_b), (hs_f, hs_b) = bi(h0, xs, **kw)
        return readout(((h_f, h_b), (hs_f[:4], hs_b[:4])))

    want = jax.value_and_grad(loss, argnums=(0, 1))(bi, h0, xs)
    padded_loss = eqx.filter_jit(jax.value_and_grad(loss, argnums=(0, 1)))
    for value in PADDING:
        padded, mask = pad(xs, value, 0, 3)
        assert tree_allclose(padded_loss(bi, h0, padded, mask=mask), want), value


# ------------------------------------------------- the cell's own arguments


class OwnMaskCell(eqx.Module):
    """A cell whose own keywords share names with Recurrent's: `mask` (over its
    hidden units) and `length` (a scale)."""

    inner: eqxscan.ElmanCell

    def __call__(self, x, h, *, mask, length):
        return jnp.where(mask, self.inner(x, h), length * h)


def test_mask_does_not_copy_xs(getkey):
    # The stand-in input of a masked step is selected inside the step: a masked
    # run's XLA temp stays within a few steps' inputs of the unmasked run's
    # (selecting before the scan writes a second [T, ...] copy of xs).
    T, n_in = 512, 256
    cell = eqx.nn.GRUCell(n_in, 8, key=getkey())
    xs, h0 = jnp.ones((T, n_in)), jnp.zeros(8)

    def temp(mask):
        loss = lambda xs: jnp.sum(eqxscan.Recurrent(cell)(h0, xs, mask=mask)[1])
        compiled = jax.jit(jax.grad(loss)).lower(xs).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(jnp.arange(T) < 300) <= temp(None) + 16 * n_in * 4


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_cell_kwargs_reach_the_cell_apart_from_own_mask(mode, getkey):
    cell = OwnMaskCell(make_cell("elman", getkey()))
    h0, xs = jr.normal(getkey(), (HID,)), jr.normal(getkey(), (T, IN))
    units = jnp.array([True, False, True, True])  # the cell's mask
    steps = jnp.array([True, True, False, True, True, False, False])  # Recurrent's
    scale = jnp.float32(0.5)

    def run(cell, h0, scale):
        rnn = eqxscan.Recurrent(cell, mode=mode)
        kw = {"mask": units, "length": scale}
        return rnn(h0, xs, mask=steps, cell_kwargs=kw)

    def reference(cell, h0, scale):
        own = ft.partial(cell, mask=units, length=scale)
        return python_loop(own, h0, xs, mask=steps)

    out = run(cell, h0, scale)
    assert tree_allclose(out, reference(cell, h0, scale))
    g = jax.grad(lambda *a: readout(run(*a)), argnums=(0, 1, 2))(cell, h0, scale)
    g_ref = jax.grad(lambda *a: readout(reference(*a)), argnums=(0, 1, 2))(
        cell, h0, scale
    )
    assert tree_allclose(g, g_ref) and float(g[2]) != 0
    # Recurrent's mask is not the cell's: without it, the masked steps run.
    assert not tree_allclose(
        eqxscan.Recurrent(cell, mode=mode)(
            h0, xs, cell_kwargs={"mask": units, "length": scale}
        ),
        out,
    )
    # Bidirectional passes both on to each direction.
    bi = eqxscan.Bidirectional(cell, cell)
    (h_f, h_b), (hs_f, hs_b) = bi(
        (h0, h0), xs, mask=steps, cell_kwargs={"mask": units, "length": scale}
    )
    own = ft.partial(cell, mask=units, length=scale)
    assert tree_allclose((h_f, hs_f), out)
    assert tree_allclose(
        (h_b, hs_b), python_loop(own, h0, xs, mask=steps, reverse=True)
    )


# -------------------------------------------------------------- truncation


@pytest.mark.parametrize("k", [1, 3, T])
@pytest.mark.parametrize("reverse", [False, True])
def test_truncate_matches_handwritten(k, reverse, getkey):
    cell, h0 = make_cell("elman", getkey()), make_h0("elman", getkey())
    xs = jr.normal(getkey(), (T, IN))  # T = 7 is not a multiple of 3
    run = lambda c, h, x: eqxscan.Recurrent(c, reverse=reverse)(h, x, truncate=k)
    ref = lambda c, h, x: python_loop(c, h, x, reverse=reverse, truncate=k)
    full = lambda c, h, x: python_loop(c, h, x, reverse=reverse)
    # Values are unchanged; gradients are the truncated ones.
    assert tree_allclose(run(cell, h0, xs), full(cell, h0, xs))
    g_run, g_ref, g_full = (grads(f, cell, h0, xs) for f in (run, ref, full))
    assert tree_allclose(g_run, g_ref)
    if k < T:
        assert not tree_allclose(g_run[0], g_full[0], rtol=1e-3, atol=1e-4)
        # The initial carry only influences the first block.
        assert not tree_allclose(g_run[1], g_full[1], rtol=1e-3, atol=1e-4)
    else:
        assert tree_allclose(g_run, g_full)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_truncate_blocks_count_unmasked_steps(mode, getkey):
    # Padding (before, after, holes) moves no block boundary: values and
    # gradients are those of the unpadded sequence, in both directions (a mask
    # that is no palindrome: reversed, the steps are counted from the end).
    cell, h0 = make_cell("elman", getkey()), make_h0("elman", getkey())
    xs = jr.normal(getkey(), (T, IN))
    mask = jnp.array([False, True, True, False, True, False, False])
    kept = np.asarray(mask)
    for reverse in (False, True):

        def padded(c, h, x, r=reverse):
            rnn = eqxscan.Recurrent(c, reverse=r, mode=mode)
            h_T, hs = rnn(h, x, mask=mask, truncate=2)
            return h_T, hs[kept]

        def short(c, h, x, r=reverse):
            return python_loop(c, h, x[kept], reverse=r, truncate=2)

        assert tree_allclose(padded(cell, h0, xs), short(cell, h0, xs))
        assert tree_allclose(
            grads(padded, cell, h0, xs)[:2], grads(short, cell, h0, xs)[:2]
        )


def test_truncate_cuts_the_carry_gradient(getkey):
    # d h_T / d h0 is zero once a block boundary lies between them, and equal to
    # the full Jacobian otherwise.
    rnn = eqxscan.Recurrent(make_cell("elman", getkey()))
    h0, xs = make_h0("elman", getkey()), jr.normal(getkey(), (T, IN))
    jac = lambda **kw: jax.jacobian(lambda h: rnn(h, xs, **kw)[0])(h0)
    assert np.all(np.asarray(jac(truncate=3)) == 0)
    assert tree_allclose(jac(truncate=T), jac())
    assert np.abs(np.asarray(jac())).max() > 1e-3
    # Per step: hs[t] depends on h0 only for t < k.
    jac_hs = jax.jacobian(lambda h: rnn(h, xs, truncate=3)[1])(h0)
    nonzero = [bool(np.any(np.asarray(jac_hs[t]) != 0)) for t in range(T)]
    assert nonzero == [True, True, True, False, False, False, False]


# ---------------------------------------------------------------------- keys


def test_keys_per_step(getkey):
    cell, h0 = NoisyCell(make_cell("elman", getkey())), make_h0("elman", getkey())
    xs, key = jr.normal(getkey(), (T, IN)), getkey()
    keys = jr.split(key, T)
    for reverse in (False, True):
        expected = python_loop(cell, h0, xs, reverse=reverse, keys=keys)
        for mode in ("scan", "loop"):
            rnn = eqxscan.Recurrent(cell, reverse=reverse, mode=mode)
            assert tree_allclose(rnn(h0, xs, key=key), expected)
    # A different key changes the result; no key means no `key=` argument.
    rnn = eqxscan.Recurrent(cell)
    assert not tree_allclose(rnn(h0, xs, key=getkey()), rnn(h0, xs, key=key))
    with pytest.raises(TypeError, match="key"):
        rnn(h0, xs)


def test_cell_without_key_argument(getkey):
    cell = make_cell("elman", getkey())
    no_key = lambda x, h: cell(x, h)  # does not accept `key=`
    xs = jr.normal(getkey(), (T, IN))
    assert tree_allclose(
        eqxscan.Recurrent(no_key)(jnp.zeros(HID), xs),
        python_loop(cell, jnp.zeros(HID), xs),
    )


def test_key_for_cell_without_key_error(getkey):
    cell = make_cell("elman", getkey())

    def no_key(x, h):
        return cell(x, h)

    xs = jr.normal(getkey(), (T, IN))
    with pytest.raises(TypeError) as info:
        eqxscan.Recurrent(no_key)(jnp.zeros(HID), xs, key=getkey())
    msg = str(info.value)
    assert "Recurrent was called with `key=...`" in msg
    assert "step t gets key=keys[t]" in msg
    assert "no_key(x, h) takes no `key` argument" in msg


# ------------------------------------------------------- finite differences


@pytest.mark.parametrize("name", CELLS)
def test_finite_differences_float64(name, getkey):
    with jax.enable_x64(True):
        cell = make_cell(name, getkey(), dtype=jnp.float64)
        h0 = make_h0(name, getkey(), jnp.float64)
        xs = jr.normal(getkey(), (T, IN), jnp.float64)
        mask = jnp.array([True] * (T - 2) + [False] * 2)
        params, static = eqx.partition(cell, eqx.is_array)

        @jax.jit
        def loss(p, h0, xs):
            rnn = eqxscan.Recurrent(eqx.combine(p, static))
            return readout(rnn(h0, xs, mask=mask))

        g = jax.grad(loss, argnums=(0, 1, 2))(params, h0, xs)
        eps = 1e-6
        errs = []
        for k in jr.split(getkey(), 3):
            leaves, treedef = jtu.tree_flatten((params, h0, xs))
            v = jtu.tree_unflatten(
                treedef,
                [
                    jr.normal(kk, a.shape, a.dtype)
                    for kk, a in zip(jr.split(k, len(leaves)), leaves)
                ],
            )
            plus, minus = (
                jtu.tree_map(lambda a, d, s=s: a + s * eps * d, (params, h0, xs), v)
                for s in (1, -1)
            )
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
            exact = sum(
                jnp.vdot(a, b) for a, b in zip(jtu.tree_leaves(g), jtu.tree_leaves(v))
            )
            assert exact.dtype == jnp.float64
            errs.append(float(jnp.abs(fd - exact) / jnp.abs(exact)))
        assert max(errs) < 1e-7, errs


# ------------------------------------------------------------------ cells


def test_elman_cell(getkey):
    cell = eqxscan.ElmanCell(IN, HID, key=getkey())
    x, h = jr.normal(getkey(), (IN,)), jr.normal(getkey(), (HID,))
    expected = np.tanh(
        np.asarray(cell.weight_ih) @ np.asarray(x)
        + np.asarray(cell.weight_hh) @ np.asarray(h)
        + np.asarray(cell.bias)
    )
    np.testing.assert_allclose(cell(x, h), expected, rtol=1e-5, atol=1e-6)
    lim = 1 / np.sqrt(HID)
    for w in (cell.weight_ih, cell.weight_hh, cell.bias):
        assert w.dtype == jnp.float32 and np.abs(np.asarray(w)).max() <= lim
    assert cell.weight_ih.shape == (HID, IN) and cell.weight_hh.shape == (HID, HID)
    no_bias = eqxscan.ElmanCell(IN, HID, use_bias=False, key=getkey())
    assert no_bias.bias is None
    np.testing.assert_allclose(
        no_bias(x, h), np.tanh(no_bias.weight_ih @ x + no_bias.weight_hh @ h), rtol=1e-5
    )
    assert (
        eqxscan.ElmanCell(IN, HID, dtype=jnp.bfloat16, key=getkey())(
            x.astype(jnp.bfloat16), h.astype(jnp.bfloat16)
        ).dtype
        == jnp.bfloat16
    )


def test_cells_name_a_wrong_step_shape(getkey):
    # Either of an ElmanCell's operands of the wrong size is named (else a wrong
    # input would end in a cryptic dot_general error).
    cell = eqxscan.ElmanCell(IN, HID, key=getkey())
    x, h = jnp.ones(IN), jnp.zeros(HID)
    takes = rf"ElmanCell\({IN}, {HID}\) takes one time step of one example"
    for bad_x, bad_h in ((jnp.ones(IN + 1), h), (x, jnp.zeros(HID + 1))):
        with pytest.raises(ValueError, match=takes) as info:
            cell(bad_x, bad_h)
        assert f"input float32[{bad_x.shape[0]}]" in str(info.value)
        assert f"hidden float32[{bad_h.shape[0]}]" in str(info.value)


# ------------------------------------------------------------ bidirectional


def test_bidirectional_equals_two_directions(getkey):
    fwd, bwd = make_cell("lstm", getkey()), make_cell("lstm", getkey())
    h0 = (make_h0("lstm", getkey()), make_h0("lstm", getkey()))
    xs, key = jr.normal(getkey(), (T, IN)), getkey()
    bi = eqxscan.Bidirectional(fwd, bwd)
    (h_f, h_b), (hs_f, hs_b) = bi(h0, xs)
    assert tree_allclose((h_f, hs_f), python_loop(fwd, h0[0], xs))
    assert tree_allclose((h_b, hs_b), python_loop(bwd, h0[1], xs, reverse=True))
    # Recurrents given explicitly keep their options; keys are split per direction.
    bi = eqxscan.Bidirectional(
        eqxscan.Recurrent(NoisyCell(make_cell("elman", getkey())), mode="loop"),
        eqxscan.Recurrent(NoisyCell(make_cell("elman", getkey())), reverse=True),
    )
    assert bi.forward.mode == "loop" and bi.backward.reverse
    h0 = (jnp.zeros(HID), jnp.zeros(HID))
    out = bi(h0, xs, key=key)
    kf, kb = jr.split(key)
    assert tree_allclose(out[1][0], bi.forward(h0[0], xs, key=kf)[1])
    assert tree_allclose(out[1][1], bi.backward(h0[1], xs, key=kb)[1])
    # A direction in mode="loop" (the debugging path) runs as written, eagerly.
    traced = []
    noted = lambda x, h: traced.append(isinstance(h[0], jax.core.Tracer)) or fwd(x, h)
    bi = eqxscan.Bidirectional(eqxscan.Recurrent(noted, mode="loop"), bwd)
    bi((make_h0("lstm", getkey()),) * 2, xs)
    assert traced == [False] * T


def test_bidirectional_padded_equals_unpadded(getkey):
    # The backward direction must start at each sequence's true end.
    bi = eqxscan.Bidirectional(make_cell("gru", getkey()), make_cell("gru", getkey()))
    lengths = [T, 3, 5]
    xss = jr.normal(getkey(), (3, T, IN))
    h0 = (jnp.zeros((3, HID)), jr.normal(getkey(), (3, HID)))
    mask = jnp.arange(T)[None, :] < jnp.array(lengths)[:, None]
    (h_f, h_b), (hs_f, hs_b) = jax.vmap(bi)(h0, xss, mask=mask)
    for i, n in enumerate(lengths):
        (r_f, r_b), (rs_f, rs_b) = bi((h0[0][i], h0[1][i]), xss[i, :n])
        assert tree_allclose((h_f[i], h_b[i]), (r_f, r_b))
        assert tree_allclose((hs_f[i, :n], hs_b[i, :n]), (rs_f, rs_b))
        # Padded positions: forward holds its final state, backward its initial.
        assert tree_allclose(hs_b[i, n:], jnp.broadcast_to(h0[1][i], (T - n, HID)))
    # Without the mask the backward direction would read the padding first.
    (_, h_b_unmasked), _ = jax.vmap(bi)(h0, xss)
    assert not tree_allclose(h_b_unmasked[1], h_b[1])


# ------------------------------------------------------------------- errors


def test_error_xs_time_axes_differ(getkey):
    rnn = eqxscan.Recurrent(lambda x, h: h + x["a"][:HID] + x["b"][:HID])
    xs = {"a": jnp.ones((T, HID)), "b": jnp.ones((T + 1, HID))}
    with pytest.raises(ValueError, match=r"xs\['b'\] has shape \(8, 4\).*length 7"):
        rnn(jnp.zeros(HID), xs)
    with pytest.raises(ValueError, match=r"xs\['a'\] is a scalar"):
        rnn(jnp.zeros(HID), {"a": jnp.float32(1)})
    with pytest.raises(ValueError, match="no array leaves.*length=T"):
        rnn(jnp.zeros(HID), {"a": None})


def test_error_bad_mask(getkey):
    rnn = eqxscan.Recurrent(make_cell("elman", getkey()))
    xs = jnp.ones((T, IN))
    with pytest.raises(
        ValueError, match=r"boolean array of shape \(7,\).*float32\[7\]"
    ):
        rnn(jnp.zeros(HID), xs, mask=jnp.ones(T))
    with pytest.raises(ValueError, match=r"shape \(7,\).*bool\[3, 7\]"):
        rnn(jnp.zeros(HID), xs, mask=jnp.ones((3, T), bool))
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        rnn(jnp.zeros(HID), xs, mask=True)


def test_error_bad_truncate(getkey):
    rnn = eqxscan.Recurrent(make_cell("elman", getkey()))
    xs = jnp.ones((T, IN))
    with pytest.raises(ValueError, match="truncate must be >= 1, got 0"):
        rnn(jnp.zeros(HID), xs, truncate=0)
    with pytest.raises(TypeError, match="truncate"):
        rnn(jnp.zeros(HID), xs, truncate=True)
    with pytest.raises(TypeError):
        rnn(jnp.zeros(HID), xs, truncate=2.5)
    # Longer than the sequence: no cut (it overflowed int32 past 2**31 - 1).
    want = rnn(jnp.zeros(HID), xs)
    for big in (T, 2**31, 10**12):
        assert jnp.array_equal(rnn(jnp.zeros(HID), xs, truncate=big)[0], want[0])


def test_error_unknown_keywords(getkey):
    # A keyword that is not Recurrent's own is never silently given to the cell.
    rnn = eqxscan.Recurrent(OwnMaskCell(make_cell("elman", getkey())))
    h0, xs = jnp.zeros(HID), jnp.ones((T, IN))
    with pytest.raises(
        TypeError,
        match=r"Recurrent got unknown keyword argument 'lenght';.*mask, truncate, "
        r"length, time_axis, broadcast_key, key and cell_kwargs\.\n"
        r"Hint:.*cell_kwargs=\{'lenght': \.\.\.\}",
    ):
        rnn(h0, xs, lenght=3)
    with pytest.raises(TypeError, match=r"arguments 'gain', 'scale';"):
        rnn(h0, xs, gain=1.0, scale=2.0)
    # The module's own options: when built (the hint sent them to the cell).
    for name in ("reverse", "method", "chunk_size", "remat"):
        with pytest.raises(TypeError, match=rf"got '{name}' when called.*\n.*with_o"):
            rnn(h0, xs, **{name: True})
    bi = eqxscan.Bidirectional(rnn.cell, rnn.cell)
    with pytest.raises(TypeError, match=r"Bidirectional got unknown keyword .*'gain'"):
        bi((h0, h0), xs, gain=1.0)
    with pytest.raises(TypeError, match=r"cell_kwargs has 'key'.*broadcast_key=True"):
        rnn(h0, xs, cell_kwargs={"key": jr.key(0)})


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_error_cell_changes_carry(mode, getkey):
    xs = jnp.ones((T, IN))
    grow = eqxscan.Recurrent(lambda x, h: jnp.concatenate([h, x]), mode=mode)
    with pytest.raises(TypeError, match=r"carry.*float32\[4\] to float32\[7\]"):
        grow(jnp.zeros(HID), xs)
    # A bf16 carry promoted by float32 weights: named, with a hint.
    cell = make_cell("elman", jr.key(0))
    with pytest.raises(TypeError, match=r"bfloat16\[4\] to float32\[4\].*astype"):
        eqxscan.Recurrent(lambda x, h: cell(x, h.astype(jnp.float32)), mode=mode)(
            jnp.zeros(HID, jnp.bfloat16), xs
        )
    # An integer initial carry into a float cell: start it as a float.
    with (
        jax.numpy_dtype_promotion("standard"),  # JAX's default
        pytest.raises(TypeError, match=r"int32\[4\] to float32\[4\] \(the carry came"),
    ):
        float_cell = lambda x, h: jnp.tanh(h + x.sum())
        eqxscan.Recurrent(float_cell, mode=mode)(jnp.zeros(HID, jnp.int32), xs)
    # bfloat16 weights, float32 inputs: the hint names the inputs too.
    bf16 = eqxscan.Recurrent(make_cell("gru", jr.key(0), dtype=jnp.bfloat16), mode=mode)
    with (
        jax.numpy_dtype_promotion("standard"),  # JAX's default
        pytest.raises(TypeError, match=r"to float32\[4\].*parameters and inputs in"),
    ):
        bf16(jnp.zeros(HID, jnp.bfloat16), xs)
    # LSTM-style tuple carry: the leaf path is named.
    bad = lambda x, h: (h[0], jnp.zeros(2 * HID))
    with pytest.raises(TypeError, match=r"carry\[1\].*float32\[4\] to float32\[8\]"):
        eqxscan.Recurrent(bad, mode=mode)(make_h0("lstm", jr.key(0)), xs)
    with pytest.raises(TypeError, match="tree structure"):
        eqxscan.Recurrent(lambda x, h: h[0], mode=mode)(make_h0("lstm", jr.key(0)), xs)
    # A (carry, output) pair, as a lax.scan body returns: named as such.
    pair = eqxscan.Recurrent(lambda x, h: (cell(x, h), h), mode=mode)
    for mask in (None, jnp.ones(T, bool)):
        with pytest.raises(TypeError, match=r"returned a pair \(carry, output\)"):
            pair(jnp.zeros(HID), xs, mask=mask)
    with pytest.raises(TypeError, match="time step 0" if mode == "loop" else "all 7"):
        grow(jnp.zeros(HID), xs)
    # With a mask the carry is checked before it is merged with the old one.
    with pytest.raises(TypeError, match=r"carry.*float32\[4\] to float32\[7\]"):
        grow(jnp.zeros(HID), xs, mask=jnp.ones(T, bool))


def test_error_bad_options(getkey):
    cell = make_cell("elman", getkey())
    with pytest.raises(ValueError, match="mode"):
        eqxscan.Recurrent(cell, mode="fast")
    with pytest.raises(ValueError, match="remat"):
        eqxscan.Recurrent(cell, remat="sometimes")
    with pytest.raises(ValueError, match="mode must be one of"):
        eqxscan.Recurrent(cell).with_options(mode="fast")
    with pytest.raises(ValueError, match="unroll"):
        eqxscan.Recurrent(cell, unroll=0)
    with pytest.raises(TypeError):
        eqxscan.Recurrent(cell, reverse="yes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'revers'"):
        eqxscan.Recurrent(cell).with_options(revers=True)
    # A cell's class, not a cell: refused up front rather than called at each
    # step (where it failed as "missing argument 'key'").
    for wrap in (eqxscan.Recurrent, lambda c: eqxscan.Bidirectional(c, c)):
        with pytest.raises(TypeError, match="needs a cell, got the class GRUCell"):
            wrap(eqx.nn.GRUCell)


def test_error_bidirectional(getkey):
    cell = make_cell("elman", getkey())
    with pytest.raises(ValueError, match="backward.*reverse=False.*reverse=True"):
        eqxscan.Bidirectional(cell, eqxscan.Recurrent(cell))
    with pytest.raises(ValueError, match="forward.*reverse=True.*reverse=False"):
        eqxscan.Bidirectional(eqxscan.Recurrent(cell, reverse=True), cell)
    bi = eqxscan.Bidirectional(cell, cell)
    with pytest.raises(
        TypeError, match=r"h0 = \(h0_forward, h0_backward\), got float32\[4\]\."
    ):
        bi(jnp.zeros(HID), jnp.ones((T, IN)))
    with pytest.raises(TypeError, match=r"got a tuple of length 3\."):
        bi((jnp.zeros(HID),) * 3, jnp.ones((T, IN)))
    with untyped(), pytest.raises(TypeError, match="Bidirectional needs `key` to be"):
        bi((jnp.zeros(HID),) * 2, jnp.ones((T, IN)), key=jr.split(jr.key(0), 2))


@pytest.mark.parametrize("name", ["elman", "gru", "lstm"])
def test_error_known_cell_shapes(name, getkey):
    rnn = eqxscan.Recurrent(make_cell(name, getkey()))
    h0 = make_h0(name, getkey())
    xs = jnp.ones((T, IN))
    batched_h0 = jtu.tree_map(lambda a: jnp.stack([a, a]), h0)
    cls = type(rnn.cell).__name__
    # A batch passed without `jax.vmap`: named before the cell's matmul fails.
    with pytest.raises(ValueError) as info:
        rnn(batched_h0, jnp.ones((2, T, IN)))
    msg = str(info.value)
    assert f"{cls}(input_size={IN}, hidden_size={HID})" in msg
    assert "h0 is" in msg and f"[2,{HID}]" in msg and "jax.vmap(rnn)" in msg
    with pytest.raises(ValueError, match=rf"xs is float32\[{T},5\].*\(T, {IN}\)"):
        rnn(h0, jnp.ones((T, 5)))
    # Batch-major, unmapped: the shape given is named, time on `time_axis`.
    with pytest.raises(ValueError, match=rf"xs is float32\[2,{T},{IN}\].*\({IN}, T\)"):
        rnn(h0, jnp.ones((2, T, IN)), time_axis=1)
    if name == "lstm":
        with pytest.raises(ValueError, match=r"pair \(h, c\)"):
            rnn(h0[0], xs)
    # The batched call is fine under vmap.
    h_T, _ = jax.vmap(rnn)(batched_h0, jnp.ones((2, T, IN)))
    assert tree_allclose(h_T, jtu.tree_map(lambda a: jnp.stack([a, a]), rnn(h0, xs)[0]))


def test_subclassed_cell_shapes_are_not_assumed(getkey):
    # A subclass may take other shapes (here a batch): the known-cell check skips it.
    class BatchedElman(eqxscan.ElmanCell):
        def __call__(self, input, hidden, *, key=None):
            return jax.vmap(super().__call__)(input, hidden)

    cell = BatchedElman(IN, HID, key=getkey())
    xs = jr.normal(getkey(), (T, 2, IN))
    h_T, _ = eqxscan.Recurrent(cell)(jnp.zeros((2, HID)), xs)
    expected = python_loop(cell, jnp.zeros((2, HID)), xs)[0]
    assert tree_allclose(h_T, expected)


def test_cell_runs_through_the_layer_call_seam(getkey):
    # A tapped Recurrent taps its time steps (the cell is no layer), and a
    # container inside the cell gets rows of its own, per time step.
    inner = eqxscan.Stacked(
        lambda k: eqxscan.ElmanCell(HID, HID, key=k), 2, key=getkey()
    )

    class Deep(eqx.Module):
        cell: eqxscan.ElmanCell
        inner: eqxscan.Stacked

        def __call__(self, x, h):
            return self.inner(self.cell(x, h), method=lambda c, h: c(h, h))

    cell = Deep(eqxscan.ElmanCell(IN, HID, key=getkey()), inner)
    xs = jr.normal(getkey(), (T, IN))
    h0 = jnp.zeros(HID)
    rms = lambda h: jnp.sqrt(jnp.mean(h**2))
    for mode in ("scan", "loop"):
        rnn = eqxscan.Recurrent(cell, mode=mode)
        (h_T, hs), got = eqxscan.tap(rnn, rms)(h0, xs)
        assert got["Recurrent"].shape == (T,) and got["Stacked"].shape == (T, 2)
        np.testing.assert_allclose(got["Recurrent"], jax.vmap(rms)(hs), rtol=1e-5)
        np.testing.assert_allclose(h_T, python_loop(cell, h0, xs)[0], rtol=1e-5)
        mids = jax.vmap(lambda x, h: cell.cell(x, h))(
            xs, jnp.concatenate([h0[None], hs[:-1]])
        )
        inner_taps = jax.vmap(
            lambda m: eqxscan.tap(inner, rms)(m, method=lambda c, h: c(h, h))[1]
        )(mids)
        np.testing.assert_allclose(got["Stacked"], inner_taps, rtol=1e-5)


# ------------------------------------------------------------------ example


def test_example_trains_below_baseline():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = os.environ.get("EQXSCAN_TEST_XLA_FLAGS", "")  # one device
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "rnn_bptt.py"), "--tiny"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    baseline = float(re.search(r"baseline MSE \(predict 1\.0\)\s+([\d.]+)", out)[1])
    final = float(re.search(r"final MSE\s+([\d.]+)", out)[1])
    assert 0.15 < baseline < 0.18
    assert final < 0.5 * baseline, out
    errors = [float(e) for e in re.findall(r"max rel err\s+([\d.e+-]+)", out)]
    assert len(errors) == 2 and max(errors) < 1e-6, out
