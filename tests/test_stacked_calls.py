"""Stacked calls beyond a plain fold: a method other than `__call__`, all layers
in parallel, reverse order and per-layer construction arguments, each against
a hand-written loop: values and gradients, in scan and loop mode."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan

from .helpers import (
    Block,
    D,
    L,
    make_stack,
    MODES,
    tree_allclose,
    value_and_grads,
)


# ---- a method other than __call__


@pytest.mark.parametrize("mode", MODES)
def test_method_fold_and_scan(mode, getkey):
    stack = make_stack(getkey, mode)
    x, shift, key = jr.normal(getkey(), (D,)), jr.normal(getkey(), (L, D)), getkey()
    keys = jr.split(key, L)

    def run(stack, x, shift):
        per = eqxscan.per_layer(shift)
        y = stack(x, per, method=Block.decode, key=key)
        carry, ys = stack.scan(x, per, method="step")
        return y, carry, ys

    def reference(stack, x, shift):
        layers = stack.unstack()
        y = x
        for i, layer in enumerate(layers):
            y = layer.decode(y, shift[i], key=keys[i])
        c, ys = x, []
        for i, layer in enumerate(layers):
            c, s = layer.step(c, shift[i])
            ys.append(s)
        return y, c, jnp.stack(ys)

    out, grads = value_and_grads(run, stack, x, shift)
    want, want_grads = value_and_grads(reference, stack, x, shift)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # Any function of (layer, carry, ...) works, like Haliax's fold_via.
    fn = lambda layer, c: layer(c) * 2.0
    assert jnp.allclose(stack(x, method=fn), reference_fold(stack, x, fn), atol=1e-6)


def reference_fold(stack, x, fn):
    for layer in stack.unstack():
        x = fn(layer, x)
    return x


def test_method_errors(getkey):
    stack = make_stack(getkey)
    with pytest.raises(AttributeError, match=r"Block has no method 'encode'"):
        stack(jnp.ones(D), method="encode")
    with pytest.raises(TypeError, match="method"):
        stack(jnp.ones(D), method=3)


# ---- all layers in parallel


@pytest.mark.parametrize("mode", MODES)
def test_vmap_over_layers(mode, getkey):
    stack = make_stack(getkey, mode)
    x, shift, key = jr.normal(getkey(), (D,)), jr.normal(getkey(), (L, D)), getkey()
    keys = jr.split(key, L)

    def run(stack, x, shift):
        plain = stack.vmap(x, key=key)
        decoded = stack.vmap(x, eqxscan.per_layer(shift), method=Block.decode)
        return plain, decoded

    def reference(stack, x, shift):
        layers = stack.unstack()
        plain = jnp.stack([layer(x, key=keys[i]) for i, layer in enumerate(layers)])
        decoded = jnp.stack(
            [layer.decode(x, shift[i]) for i, layer in enumerate(layers)]
        )
        return plain, decoded

    out, grads = value_and_grads(run, stack, x, shift)
    assert out[0].shape == (L, D)
    want, want_grads = value_and_grads(reference, stack, x, shift)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    if mode == "scan":
        # One vmap: the program has no loop over the layers.
        text = str(jax.make_jaxpr(lambda s: s.vmap(x))(stack))
        assert "scan" not in text and "while" not in text


# ---- reverse over layers


@pytest.mark.parametrize("mode", MODES)
def test_reverse_stacked(mode, getkey):
    stack = make_stack(getkey, mode)
    x, key = jr.normal(getkey(), (D,)), getkey()
    keys = jr.split(key, L)

    def run(stack, x):
        return stack(x, reverse=True, key=key), stack.scan(
            x, method="step", shift=0.0, reverse=True
        )

    def reference(stack, x):
        layers = stack.unstack()
        y = x
        for i in reversed(range(L)):
            y = layers[i](y, key=keys[i])  # layer i keeps keys[i]
        c, ys = x, [None] * L
        for i in reversed(range(L)):
            c, ys[i] = layers[i].step(c, 0.0)  # ys aligned with the layers
        return y, (c, jnp.stack(ys))

    out, grads = value_and_grads(run, stack, x)
    want, want_grads = value_and_grads(reference, stack, x)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    assert jnp.allclose(stack(x, reverse=True), stack[::-1](x), atol=1e-6)
    if mode == "scan":  # the scan fully unrolled runs backwards too
        assert tree_allclose(run(stack.with_options(unroll=True), x), want)
    if mode == "scan":
        # No reversed copy of the weights: the scan runs backwards instead.
        scanned = stack.with_options(unroll=1)  # L=4 alone would be unrolled
        text = str(jax.make_jaxpr(lambda s: s(x, reverse=True))(scanned))
        assert not re.search(r"\brev\[", text) and "reverse=True" in text


@pytest.mark.parametrize("mode", MODES)
def test_reverse_chain(mode, getkey):
    lin = lambda: eqx.nn.Linear(D, D, key=getkey())
    # A scanned run, a lone layer and a scanned pattern of two.
    layers = [Block(getkey()) for _ in range(3)]
    layers += [eqx.nn.Linear(D, D, use_bias=False, key=getkey())]
    layers += [Block(getkey()), lin(), Block(getkey()), lin()]
    chain = eqxscan.Chain(layers, mode=mode)
    assert [span.per_step for span in chain.layout] == [1, 0, 2]
    x = jr.normal(getkey(), (D,))

    def run(chain, x):
        return chain(x, reverse=True)

    def reference(chain, x):
        for layer in reversed(chain.unstack()):
            x = layer(x)
        return x

    out, grads = value_and_grads(run, chain, x)
    want, want_grads = value_and_grads(reference, chain, x)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # .scan: ys aligned with the layers.
    pairs = eqxscan.Chain([_Pair(layer) for layer in layers], mode=mode)
    c, ys = pairs.scan(x, reverse=True)
    y, want_ys = x, [None] * len(layers)
    for i in reversed(range(len(layers))):
        y, want_ys[i] = _Pair(layers[i])(y)
    assert jnp.allclose(c, y, atol=1e-5) and jnp.allclose(
        ys, jnp.stack(want_ys), atol=1e-5
    )


class _Flips(eqx.Module):
    w: jax.Array

    def __call__(self, x, *, reverse=False):
        return (x[::-1] if reverse else x) * self.w

    def plain(self, x):
        return x * self.w


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_taking_reverse_is_not_run_backwards_without_a_word(mode, getkey):
    # `reverse=True` is the container's: it ran the layers last to first, and a
    # layer's own `reverse` never saw it (another output, no error).
    stack = eqxscan.Stacked(lambda k: _Flips(jr.normal(k, (D,))), 3, key=getkey())
    stack = stack.with_options(mode=mode)
    x = jr.normal(getkey(), (D,))
    for run in (stack, eqxscan.Chain(stack.unstack(), mode=mode)):
        who = type(run).__name__
        with pytest.raises(TypeError, match=rf"^{who}\(.*_Flips.__call__ takes a `rev"):
            run(x, reverse=True)
        # A method that takes none, and `reverse=False`, run as before.
        want = x
        for layer in reversed(stack.unstack()):
            want = layer.plain(want)
        assert jnp.allclose(run(x, reverse=True, method="plain"), want, atol=1e-5)
        assert jnp.allclose(run(x, reverse=False), run(x), atol=0)
        # A `reverse` bound already, and containers as layers, run as before.
        bound = functools.partial(_Flips.__call__, reverse=True)
        want = x
        for layer in reversed(stack.unstack()):
            want = layer(want, reverse=True)
        assert jnp.allclose(run(x, reverse=True, method=bound), want, atol=1e-5)
    inner = eqxscan.Stacked(lambda k: eqx.nn.Linear(D, D, key=k), 2, key=getkey())
    lone = eqx.nn.Linear(D, D, key=getkey())
    chain = eqxscan.Chain([lone, inner], mode=mode)
    assert jnp.allclose(chain(x, reverse=True), lone(inner(x)), atol=1e-5)


class _Pair(eqx.Module):
    layer: eqx.Module

    def __call__(self, x):
        y = self.layer(x)
        return y, jnp.sum(y)


# ---- per-layer construction arguments


@pytest.mark.parametrize("mode", MODES)
def test_per_layer_construction(mode, getkey):
    key, scales = getkey(), jnp.linspace(0.5, 2.0, L)
    offset = jnp.float32(0.25)

    def make_layer(k, scale, index, offset):
        block = Block(k, scale)
        return eqx.tree_at(
            lambda b: b.b, block, block.b + offset * jnp.asarray(index, jnp.float32)
        )

    stack = eqxscan.Stacked(
        make_layer,
        L,
        eqxscan.per_layer(scales),
        eqxscan.per_layer(jnp.arange(L)),
        offset,
        key=key,
        mode=mode,
    )
    keys = jr.split(key, L)
    for i in range(L):
        want = make_layer(keys[i], scales[i], i, offset)
        assert tree_allclose(stack[i], want)
    with pytest.raises(ValueError, match=r"per_layer args\[0\] has shape \(3,\)"):
        eqxscan.Stacked(
            make_layer, L, eqxscan.per_layer(scales[:3]), 0, offset, key=key
        )


class Tagged(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        i = eqxscan.layer_index()
        return jnp.tanh(self.linear(x)), (i, 0.5, "tag")


@pytest.mark.parametrize("mode", MODES)
def test_outputs_that_are_not_arrays_agree_across_modes(mode, getkey):
    # Layer `i` gives `i`: traced in a scan, an int in a loop, which kept layer
    # 0's alone (and `vmap` in a loop failed on the string).
    make = lambda k: Tagged(eqx.nn.Linear(3, 3, key=k))  # noqa: E731
    stack = eqxscan.Stacked(make, 3, key=getkey(), mode=mode)
    x = jnp.ones(3)
    outputs = [stack.scan(x)[1], stack.vmap(x, method=lambda m, x: m(x)[1])]
    for index, half, tag in outputs:
        np.testing.assert_array_equal(index, [0, 1, 2])
        assert (half, tag) == (0.5, "tag")  # one traced body's: kept once
    # A string that differs cannot be stacked: an error, not layer 0's.
    named = lambda m, x: (m(x)[0], f"layer {eqxscan.layer_index()}")  # noqa: E731
    if mode == "loop":
        with pytest.raises(TypeError, match="Layer 1 \\(Tagged\\) gave `` = .layer 1."):
            stack.scan(x, method=named)


class _Flagged(eqx.Module):
    w: jax.Array

    def __call__(self, x, *, flag, times):
        # Python values, in either mode: `is True` of NumPy's bool is False.
        assert type(times) is int
        return x * self.w * (2.0 if flag is True else 7.0) ** times


def test_numpy_scalars_by_keyword_reach_the_layers_alike_in_every_mode(getkey):
    # The scan passed NumPy's scalars given by keyword on as Python values
    # (static, as a Python int), the loop as they were: another output.
    stack = eqxscan.Stacked(lambda k: _Flagged(jr.normal(k, (3,))), 2, key=getkey())
    x = jnp.ones(3)
    want = x * stack.layers.w[0] * stack.layers.w[1] * 4.0
    for mode in MODES:
        got = stack.with_options(mode=mode)(x, flag=np.True_, times=np.int32(1))
        np.testing.assert_allclose(got, want, rtol=1e-6)
