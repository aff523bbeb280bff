"""`eqxscan.layer_index()`: a layer's own index inside its call, checked
against `mode="loop"` and a hand-written loop, in `Stacked` and in `Chain`s
of every grouping (runs, repeated units, lone layers), under jit, vmap, grad."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jaxtyping import Array

import eqxscan


D = 3


class A(eqx.Module):
    w: Array

    def __init__(self, key):
        self.w = 1.0 + 0.1 * jr.normal(key, (D,))

    def __call__(self, x):
        return jnp.tanh(x * self.w + 0.1 * _f(eqxscan.layer_index()))


class B(eqx.Module):
    w: Array

    def __init__(self, key):
        self.w = 0.1 * jr.normal(key, (D, D))

    def __call__(self, x):
        return x + self.w @ x - 0.05 * _f(eqxscan.layer_index())


def _f(i):
    return jnp.asarray(i, jnp.float32)


MAKERS = {"A": A, "B": B}


def build(pattern, key):
    return [MAKERS[c](k) for c, k in zip(pattern, jr.split(key, len(pattern)))]


def by_hand(layers, x, reverse=False, first=0):
    order = list(enumerate(layers, first))
    for i, layer in reversed(order) if reverse else order:
        if isinstance(layer, A):
            x = jnp.tanh(x * layer.w + 0.1 * i)
        else:
            x = x + layer.w @ x - 0.05 * i
    return x


class Seen(eqx.Module):
    def __call__(self, x):
        i = eqxscan.layer_index()
        return x.at[i].set(jnp.asarray(i, x.dtype) + 100.0 * isinstance(i, int))


def test_stacked_traced_in_scan_int_in_loop(getkey):
    stack = eqxscan.Stacked(lambda k: Seen(), 4, key=getkey())
    x = jnp.zeros(4)
    np.testing.assert_array_equal(stack(x), [0, 1, 2, 3])
    np.testing.assert_array_equal(jax.jit(stack)(x), [0, 1, 2, 3])
    loop = stack.with_options(mode="loop")
    np.testing.assert_array_equal(jax.jit(loop)(x), [100, 101, 102, 103])
    np.testing.assert_array_equal(stack(x, reverse=True), [0, 1, 2, 3])


def test_index_returned_as_y_is_stacked(getkey):
    # A layer may return its index as a `y`: traced in a scan, a Python int
    # per step in the loop, which stacks the ints as the scan stacks the array.
    class Emit(eqx.Module):
        def __call__(self, x):
            return x, eqxscan.layer_index()

    stack = eqxscan.Stacked(lambda k: Emit(), 4, key=getkey())
    for mode in ("scan", "loop"):
        _, ys = stack.with_options(mode=mode).scan(jnp.zeros(()))
        np.testing.assert_array_equal(ys, [0, 1, 2, 3])


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_stacked_vmap_gives_each_layer_its_index(mode, getkey):
    layers = build("BBB", getkey())
    stack = eqxscan.Stacked.from_layers(layers, mode=mode)
    x = jr.normal(getkey(), (D,))
    want = [by_hand([layer], x, first=i) for i, layer in enumerate(layers)]
    np.testing.assert_allclose(stack.vmap(x), jnp.stack(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "pattern", ["AAAA", "AABB", "AB" * 3, "AAB" * 3 + "AA", "BABABAA"]
)
@pytest.mark.parametrize("reverse", [False, True])
def test_chain_global_index_matches_loop_and_hand(pattern, reverse, getkey):
    layers = build(pattern, getkey())
    chain = eqxscan.Chain(layers)
    x = jr.normal(getkey(), (D,))
    want = by_hand(layers, x, reverse)
    got = jax.jit(lambda c, x: c(x, reverse=reverse))(chain, x)
    loop = chain.with_options(mode="loop")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loop(x, reverse=reverse), want, rtol=1e-5, atol=1e-6)


def test_under_vmap_and_grad(getkey):
    layers = build("AB" * 2 + "AA", getkey())
    chain = eqxscan.Chain(layers)
    xs = jr.normal(getkey(), (5, D))
    np.testing.assert_allclose(
        jax.vmap(chain)(xs), jax.vmap(lambda x: by_hand(layers, x))(xs), rtol=1e-5
    )

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    stack = eqxscan.Stacked.from_layers(build("AAAA", getkey()))
    g = eqx.filter_grad(loss)(stack, xs[0])
    g_loop = eqx.filter_grad(loss)(stack.with_options(mode="loop"), xs[0])
    g_hand = jax.grad(lambda ls: jnp.sum(by_hand(ls, xs[0]) ** 2))(stack.unstack())
    np.testing.assert_allclose(g.layers.w, g_loop.layers.w, rtol=1e-5)
    np.testing.assert_allclose(g.layers.w, jnp.stack([h.w for h in g_hand]), rtol=1e-5)


def test_with_remat_and_unroll(getkey):
    layers = build("AAAAAA", getkey())
    x = jr.normal(getkey(), (D,))
    want = by_hand(layers, x)
    for options in [
        dict(remat=True),
        dict(remat="nested"),
        dict(unroll=True),
    ]:
        stack = eqxscan.Stacked.from_layers(layers, **options)
        np.testing.assert_allclose(stack(x), want, rtol=1e-5, atol=1e-6)


def test_outside_a_layer_is_an_error(getkey):
    with pytest.raises(RuntimeError, match=r"layer_index\(\) was called outside"):
        eqxscan.layer_index()

    class Plain(eqx.Module):
        def __call__(self, x):
            return x + _f(eqxscan.layer_index())

    # A layer called by hand is not run by a container.
    with pytest.raises(RuntimeError, match="outside a layer"):
        Plain()(jnp.ones(()))

    # A Recurrent's steps are time steps, not layers: its cell gets no index
    # (not the time step, read as a layer's).
    class Cell(eqx.Module):
        def __call__(self, x, h):
            return h + x * _f(eqxscan.layer_index())

    for mode in ("scan", "loop"):
        with pytest.raises(RuntimeError, match="outside a layer"):
            eqxscan.Recurrent(Cell(), mode=mode)(jnp.zeros(()), jnp.ones(3))


class ReadsIndex(eqxscan.MatrixLinearCell):
    """A one-head matrix cell whose read-out asks for a layer index."""

    def gates(self, x_t):
        return jax.nn.sigmoid(x_t)[None], x_t[None], x_t[None], x_t[None]

    def output(self, S_t, x_t):
        eqxscan.layer_index()
        return super().output(S_t, x_t)


class HoldsRecurrent(eqx.Module):
    rnn: eqxscan.Recurrent

    def __call__(self, x):
        _, os = self.rnn(jnp.zeros((1, D, D)), jnp.stack([x, 2 * x]))
        return x + os[-1, 0]


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_time_steps_inside_a_layer_read_no_layer_index(mode):
    # A Recurrent inside a Chain's layer 1: its steps are time steps, so its
    # cell's read-out (run in the step, outside the cell's call) gets no index,
    # not that of the layer around the Recurrent.
    rnn = eqxscan.Recurrent(ReadsIndex(), method="sequential", mode=mode)
    chain = eqxscan.Chain([eqx.nn.Lambda(jnp.tanh), HoldsRecurrent(rnn)], mode=mode)
    with pytest.raises(RuntimeError, match="outside a layer"):
        chain(jnp.ones(D))


CHOICES = {
    "list": ([1, 3, 4], [1, 3, 4]),
    "tuple": ((4, 0, 2), [4, 0, 2]),
    "slice": (slice(1, 5, 2), [1, 3]),
    "array": (jnp.asarray([3, 1, 4]), [3, 1, 4]),
}


@pytest.mark.parametrize("form", list(CHOICES))
@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_run_layers_sees_global_index(form, mode, getkey):
    # Each chosen layer reads its index in the whole model, whatever form the
    # choice takes (a list or tuple once raised "called outside a layer").
    layers, chosen = CHOICES[form]
    stack = eqxscan.Stacked(lambda k: Seen(), 5, key=getkey(), mode=mode)
    got = eqxscan.run_layers(stack, jnp.zeros(5), layers)
    want = np.zeros(5)
    want[chosen] = np.asarray(chosen)
    np.testing.assert_array_equal(got % 100, want)  # + 100: a Python int

    hand = build("AABAB", getkey())
    chain = eqxscan.Chain(hand, mode=mode)
    x = jr.normal(getkey(), (D,))
    want_x = x
    for i in chosen:
        want_x = by_hand(hand[i : i + 1], want_x, first=i)
    got_x = eqxscan.run_layers(chain, x, layers)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-6)
