"""Carry taps and gradient taps (`eqxscan.tap`, `eqxscan.probe`), checked
against the same statistics computed by hand-written loops over the layers (and
per-layer `jax.vjp`s for the cotangents), and against `mode="loop"`."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jaxtyping import Array

import eqxscan
from eqxscan.stats import max_abs, nonfinite_count, rms

from .helpers import compiles, untyped


D = 4


class A(eqx.Module):
    w: Array

    def __init__(self, key):
        self.w = 0.5 * jr.normal(key, (D, D))

    def __call__(self, x):
        return jnp.tanh(self.w @ x) + x


class B(eqx.Module):
    s: Array

    def __init__(self, key):
        self.s = 1.0 + 0.2 * jr.normal(key, (D,))

    def __call__(self, x):
        return x * self.s


MAKERS = {"A": A, "B": B}


def build(pattern, key):
    return [MAKERS[c](k) for c, k in zip(pattern, jr.split(key, len(pattern)))]


def both(x):
    return {"rms": rms(x), "max": max_abs(x)}


def hand_taps(layers, x, stat, reverse=False):
    """`stat` of each layer's output, by layer index, from a Python loop."""
    out = [None] * len(layers)
    order = list(enumerate(layers))
    for i, layer in reversed(order) if reverse else order:
        x = layer(x)
        out[i] = stat(x)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *out)


def close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(a) == jax.tree.structure(b)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_stacked_carry_taps_match_a_loop(mode, getkey):
    layers = build("AAAAA", getkey())
    stack = eqxscan.Stacked.from_layers(layers, mode=mode)
    x = jr.normal(getkey(), (D,))
    want_y, want = hand_taps(layers, x, both)
    y, got = eqxscan.tap(stack, both)(x)
    close(y, want_y)
    close(got, want)
    y, got = jax.jit(lambda s, x: eqxscan.tap(s, both)(x))(stack, x)
    close(got, want)


@pytest.mark.parametrize("pattern", ["AB" * 3, "AAB" * 2 + "AB", "BAAAB"])
@pytest.mark.parametrize("reverse", [False, True])
def test_chain_taps_in_global_layer_order(pattern, reverse, getkey):
    layers = build(pattern, getkey())
    chain = eqxscan.Chain(layers)
    x = jr.normal(getkey(), (D,))
    _, want = hand_taps(layers, x, rms, reverse)
    for model in (chain, chain.with_options(mode="loop")):
        y, got = eqxscan.tap(model, rms)(x, reverse=reverse)
        close(got, want)


def test_stat_of_output_and_input(getkey):
    layers = build("AAA", getkey())
    stack = eqxscan.Stacked.from_layers(layers)
    x = jr.normal(getkey(), (D,))

    def update(out, inp):  # the size of each layer's residual update
        return jnp.sqrt(jnp.sum((out - inp) ** 2))

    want, h = [], x
    for layer in layers:
        new = layer(h)
        want.append(update(new, h))
        h = new
    _, got = eqxscan.tap(stack, update)(x)
    np.testing.assert_allclose(got, jnp.stack(want), rtol=1e-5)


def test_recurrent_taps_per_time_step(getkey):
    cell = eqxscan.ElmanCell(3, D, key=getkey())
    xs = jr.normal(getkey(), (6, 3))
    h0 = jnp.zeros(D)
    for reverse in (False, True):
        rnn = eqxscan.Recurrent(cell, reverse=reverse)
        (_, hs), got = eqxscan.tap(rnn, max_abs)(h0, xs)
        np.testing.assert_allclose(got, jnp.max(jnp.abs(hs), axis=1), rtol=1e-5)
        loop = eqxscan.Recurrent(cell, reverse=reverse, mode="loop")
        _, got_loop = eqxscan.tap(loop, max_abs)(h0, xs)
        np.testing.assert_allclose(got_loop, got, rtol=1e-5)


def test_taps_under_vmap_and_grad(getkey):
    layers = build("AAAA", getkey())
    stack = eqxscan.Stacked.from_layers(layers)
    xs = jr.normal(getkey(), (3, D))
    _, got = jax.vmap(lambda x: eqxscan.tap(stack, rms)(x))(xs)
    want = jnp.stack([hand_taps(layers, x, rms)[1] for x in xs])
    np.testing.assert_allclose(got, want, rtol=1e-5)

    def loss(model, x):
        y, r = eqxscan.tap(model, rms)(x)
        return jnp.sum(y**2), r

    (value, r), g = eqx.filter_value_and_grad(loss, has_aux=True)(stack, xs[0])
    g_plain = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))(stack, xs[0])
    np.testing.assert_allclose(g.layers.w, g_plain.layers.w, rtol=1e-5)
    np.testing.assert_allclose(r, hand_taps(layers, xs[0], rms)[1], rtol=1e-5)


def test_one_trace_for_any_data(getkey):
    traces = []

    class Counted(eqx.Module):
        w: Array

        def __call__(self, x):
            traces.append(None)
            return jnp.tanh(self.w @ x)

    stack = eqxscan.Stacked(lambda k: Counted(jr.normal(k, (D, D))), 6, key=getkey())
    step = eqx.filter_jit(lambda s, x: eqxscan.tap(s, both)(x))
    for _ in range(3):
        step(stack, jr.normal(getkey(), (D,)))
    assert len(traces) == 1  # one body traced, once, for every call
    # Eager: one program (a layer reading a list of its closure would be
    # compiled at every call, as an eager call of the container is).
    stack = eqxscan.Stacked(A, 6, key=getkey())
    eager = eqxscan.tap(stack, both)
    eager(jr.normal(getkey(), (D,)))
    assert compiles(lambda: [eager(jr.normal(getkey(), (D,))) for _ in range(2)]) == 0


def test_container_inside_a_layer_is_not_tapped(getkey):
    inner = eqxscan.Stacked.from_layers(build("BB", getkey()))

    class Outer(eqx.Module):
        inner: eqxscan.Stacked

        def __call__(self, x):
            return self.inner(x) + 1.0

    stack = eqxscan.Stacked.from_layers([Outer(inner), Outer(inner), Outer(inner)])
    x = jr.normal(getkey(), (D,))
    _, got = eqxscan.tap(stack, rms)(x)
    assert got.shape == (3,)
    np.testing.assert_allclose(got, hand_taps(stack.unstack(), x, rms)[1], rtol=1e-5)


def test_tap_errors(getkey):
    with untyped(), pytest.raises(TypeError, match="needs a statistic.*got 'rms'"):
        eqxscan.probe("rms", jnp.ones(2), 3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="ran no layers"):
        eqxscan.tap(lambda x: x, rms)(jnp.ones(2))
    # A container called under a transformation inside the tapped function:
    # named, before its statistics escape that transformation.
    stack = eqxscan.Stacked.from_layers(build("AA", getkey()))
    xs = jnp.ones((2, D))
    jitted = jax.jit(lambda x: stack(x))
    for inner in (lambda xs: jax.vmap(stack)(xs), lambda xs: jitted(xs[0])):
        with pytest.raises(TypeError, match=r"Stacked was called inside a JAX.*\n"):
            eqxscan.tap(inner, rms)(xs)
    loss = lambda m, xs: jnp.sum(jax.vmap(m)(xs))
    with pytest.raises(TypeError, match="loss_fn must call the containers directly"):
        eqxscan.find_nonfinite(stack, loss, xs)
    with pytest.raises(TypeError, match="model must be callable, got ArrayImpl"):
        # The arguments in the wrong order.
        eqxscan.tap(jnp.ones(2), rms)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="stat is a Stacked, and model a function: "):
        # Swapped: both callable, so this was "ran no layers", blaming the model.
        eqxscan.tap(rms, stack)(xs[0])  # pyright: ignore[reportArgumentType]
    with (
        untyped(),
        pytest.raises(
            TypeError, match=r"stat must be a function, got 'rms'.\nHint: .*stats.rms"
        ),
    ):
        eqxscan.tap(stack, "rms")  # pyright: ignore[reportArgumentType]
    # A statistic of another shape at some layers (the carry itself, across a
    # projection): named, not JAX's concatenate error.
    keys = jr.split(getkey(), 3)
    chain = eqxscan.Chain(
        [eqx.nn.Linear(3, D, key=keys[0]), eqx.nn.Linear(D, D, key=keys[1])]
        + [eqx.nn.Linear(D, 2, key=keys[2])]
    )
    with pytest.raises(TypeError, match=r"different structures or shapes.*\(2,\)"):
        eqxscan.tap(chain, lambda h: {"h": h})(jnp.ones(3))
    # Dtypes may differ (a bfloat16 stack, a float32 head): they promote.
    mixed = eqxscan.Chain(
        [eqx.nn.Linear(3, 3, key=k, dtype=jnp.bfloat16) for k in keys[:2]]
        + [eqx.nn.Lambda(lambda h: h.astype(jnp.float32))]
    )
    _, got = eqxscan.tap(mixed, lambda h: jnp.sum(h))(jnp.ones(3, jnp.bfloat16))
    assert got.shape == (3,) and got.dtype == jnp.float32


# --- gradient taps ----------------------------------------------------------


def hand_cotangents(layers, x, loss, reverse=False):
    """The cotangent reaching each layer's output, by layer index: the forward
    loop keeps each layer's `jax.vjp`, the backward loop runs them in turn."""
    order = [i for i in range(len(layers))]
    if reverse:
        order = order[::-1]
    vjps = {}
    for i in order:
        x, vjps[i] = jax.vjp(layers[i], x)
    ct = jax.grad(loss)(x)
    cts = [None] * len(layers)
    for i in reversed(order):
        cts[i] = ct
        (ct,) = vjps[i](ct)
    return cts


def loss_fn(y):
    return jnp.sum(jnp.sin(y) * jnp.arange(1.0, D + 1.0))


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_grad_taps_match_per_layer_vjps(mode, getkey):
    layers = build("AAAAA", getkey())
    stack = eqxscan.Stacked.from_layers(layers, mode=mode)
    x = jr.normal(getkey(), (D,))
    p = eqxscan.probe(both, x, len(stack))

    def loss(model_and_probe, x):
        model, p = model_and_probe
        y, _ = eqxscan.tap(model, probe=p)(x)
        return loss_fn(y)

    value, (g, gp) = eqx.filter_jit(eqx.filter_value_and_grad(loss))((stack, p), x)
    assert isinstance(gp, eqxscan.Probe)
    cts = hand_cotangents(layers, x, loss_fn)
    want = jax.tree.map(lambda *a: jnp.stack(a), *[both(c) for c in cts])
    close(gp.values, want)
    g_plain = eqx.filter_grad(lambda m: loss_fn(m(x)))(stack)
    np.testing.assert_allclose(g.layers.w, g_plain.layers.w, rtol=1e-5)
    np.testing.assert_allclose(value, loss_fn(stack(x)), rtol=1e-5)


@pytest.mark.parametrize("pattern", ["AB" * 3, "AAB" * 2 + "A"])
def test_grad_taps_in_a_chain(pattern, getkey):
    layers = build(pattern, getkey())
    chain = eqxscan.Chain(layers, remat=True)
    x = jr.normal(getkey(), (D,))
    p = eqxscan.probe(rms, x, len(chain))
    for reverse in (False, True):

        def loss(p, reverse=reverse):
            y, _ = eqxscan.tap(chain, probe=p)(x, reverse=reverse)
            return loss_fn(y)

        gp = jax.grad(loss)(p)
        cts = hand_cotangents(layers, x, loss_fn, reverse)
        np.testing.assert_allclose(
            gp.values, jnp.stack([rms(c) for c in cts]), rtol=1e-5
        )


def test_grad_taps_of_two_calls_follow_each_other(getkey):
    # One probe over a function that calls two stacks: the second call's rows
    # follow the first's.
    first, second = build("AAA", getkey()), build("AA", getkey())
    s1, s2 = eqxscan.Stacked.from_layers(first), eqxscan.Stacked.from_layers(second)
    x = jr.normal(getkey(), (D,))
    p = eqxscan.probe(rms, x, len(first) + len(second))

    def loss(p):
        y, _ = eqxscan.tap(lambda x: s2(s1(x)), probe=p)(x)
        return loss_fn(y)

    h = x
    for layer in first:
        h = layer(h)
    early = hand_cotangents(first, x, lambda y: loss_fn(s2(y)))
    late = hand_cotangents(second, h, loss_fn)
    want = jnp.stack([rms(c) for c in early + late])
    np.testing.assert_allclose(jax.grad(loss)(p).values, want, rtol=1e-5)


def test_grad_taps_per_time_step(getkey):
    cell = eqxscan.ElmanCell(3, D, key=getkey())
    xs = jr.normal(getkey(), (5, 3))
    h0 = jr.normal(getkey(), (D,))
    rnn = eqxscan.Recurrent(cell)
    p = eqxscan.probe(rms, h0, 5)

    def loss(p):
        (h, _), _ = eqxscan.tap(rnn, probe=p)(h0, xs)
        return loss_fn(h)

    steps = [lambda h, x=x: cell(x, h) for x in xs]
    cts = hand_cotangents(steps, h0, loss_fn)
    got = jax.grad(loss)(p).values
    np.testing.assert_allclose(got, jnp.stack([rms(c) for c in cts]), rtol=1e-5)


def test_grad_taps_of_a_call_after_a_recurrent_whose_cell_calls_a_stack(getkey):
    # The stack called after the Recurrent has the probe's rows right after the
    # Recurrent's time steps: the stack inside the cell (taps per time step, no
    # rows of the probe) moves them on by none, or they would be read past the
    # probe's end.
    inner = eqxscan.Stacked.from_layers(build("AA", getkey()))
    after = eqxscan.Stacked.from_layers(build("AAA", getkey()))

    class Cell(eqx.Module):
        inner: eqxscan.Stacked

        def __call__(self, x, h):
            return self.inner(h + x)

    rnn = eqxscan.Recurrent(Cell(inner))
    xs, h0 = jr.normal(getkey(), (3, D)), jr.normal(getkey(), (D,))
    p = eqxscan.probe(rms, h0, len(xs) + len(after))

    def loss(p):
        y, _ = eqxscan.tap(lambda h: after(rnn(h, xs)[0]), probe=p)(h0)
        return loss_fn(y)

    steps = [lambda h, x=x: inner(h + x) for x in xs]
    early = hand_cotangents(steps, h0, lambda h: loss_fn(after(h)))
    h = rnn(h0, xs)[0]
    late = hand_cotangents(list(after.unstack()), h, loss_fn)
    want = jnp.stack([rms(c) for c in early + late])
    np.testing.assert_allclose(jax.grad(loss)(p).values, want, rtol=1e-5)


@pytest.mark.parametrize("kind", ["stacked", "chain", "recurrent"])
def test_probe_after_an_untapped_eager_call(kind, getkey):
    # An eager call compiles itself once per structure; the probe lives outside
    # the call's arguments, so a cached untapped program must not be reused.
    x = jr.normal(getkey(), (D,))
    if kind == "recurrent":
        cell = eqxscan.ElmanCell(3, D, key=getkey())
        xs = jr.normal(getkey(), (5, 3))
        model = eqxscan.Recurrent(cell)
        steps = [lambda h, x=x: cell(x, h) for x in xs]
        args = (x, xs)
    else:
        steps = build("AB" * 2 + "A" if kind == "chain" else "AAAAA", getkey())
        model = (
            eqxscan.Chain(steps)
            if kind == "chain"
            else eqxscan.Stacked.from_layers(steps)
        )
        args = (x,)
    model(*args)  # eager, untapped: fills the compiled-call cache
    p = eqxscan.probe(rms, x, len(steps))

    def loss(p):
        y, _ = eqxscan.tap(model, probe=p)(*args)
        return loss_fn(y[0] if kind == "recurrent" else y)

    cts = hand_cotangents(steps, x, loss_fn)
    got = jax.grad(loss)(p).values
    np.testing.assert_allclose(got, jnp.stack([rms(c) for c in cts]), rtol=1e-5)


@pytest.mark.parametrize("kind", ["stacked", "chain"])
def test_taps_of_run_layers_are_by_layer_index(kind, getkey):
    # One row per layer of the model, zeros for the layers not run, whatever the
    # choice (a run, an index list out of order, an index array under jit).
    layers = build("AAAAA" if kind == "stacked" else "ABAAB", getkey())
    model = (
        eqxscan.Stacked.from_layers(layers)
        if kind == "stacked"
        else eqxscan.Chain(layers)
    )
    x = jr.normal(getkey(), (D,))
    for sel in (slice(1, 4), [0, 2, 3], [4, 1], jnp.array([3, 0, 2])):
        order = range(5)[sel] if isinstance(sel, slice) else [int(i) for i in sel]
        y, want = x, np.zeros((5,), np.float32)
        for i in order:
            y = layers[i](y)
            want[i] = rms(y)
        run = ft.partial(eqxscan.run_layers, model, layers=sel)
        got_y, got = eqxscan.tap(run, rms)(x)
        close(got_y, y)
        close(got, want)
        if isinstance(sel, jax.Array):
            got = jax.jit(
                lambda x, sel: eqxscan.tap(
                    lambda x: eqxscan.run_layers(model, x, sel), rms
                )(x)[1]
            )(x, sel)
            close(got, want)
        # The gradient reaching each chosen layer's output, at its index.
        p = eqxscan.probe(rms, x, 5)
        gp = jax.grad(lambda p, run=run: loss_fn(eqxscan.tap(run, probe=p)(x)[0]))(p)
        cts = hand_cotangents([layers[i] for i in order], x, loss_fn)
        want = np.zeros((5,), np.float32)
        for i, ct in zip(order, cts):
            want[i] = rms(ct)
        close(gp.values, want)


def test_taps_refuse_run_layers_running_a_layer_twice(getkey):
    # One row per layer by index cannot hold two runs of layer 1 (it once kept
    # one of them without a word).
    stack = eqxscan.Stacked.from_layers(build("AAA", getkey()))
    x = jnp.ones(D)
    with pytest.raises(ValueError, match=r"run layer 1 twice, but a tap has one row"):
        eqxscan.tap(lambda x: eqxscan.run_layers(stack, x, [1, 0, 1]), rms)(x)
    p = eqxscan.probe(rms, x, 3)
    with pytest.raises(ValueError, match="run layer 2 twice"):
        eqxscan.tap(lambda x: eqxscan.run_layers(stack, x, [2, 2]), probe=p)(x)
    # Indices in an array are checked when the program runs.
    with pytest.raises(RuntimeError, match="run a layer twice, but a tap has one row"):
        eqxscan.tap(lambda x: eqxscan.run_layers(stack, x, jnp.array([1, 1])), rms)(x)
    eqxscan.tap(lambda x: eqxscan.run_layers(stack, x, jnp.array([2, 1])), rms)(x)


def test_run_until_is_refused_by_taps(getkey):
    stack = eqxscan.Stacked.from_layers(build("AAA", getkey()))

    def run(x):
        return eqxscan.run_until(stack, x, lambda c: jnp.array(False))

    with pytest.raises(TypeError, match=r"tap does not reach run_until"):
        eqxscan.tap(run, rms)(jnp.ones(D))


def test_nonfinite_counts_in_the_backward_pass(getkey):
    layers = build("AAAA", getkey())
    stack = eqxscan.Stacked.from_layers(layers)
    x = jr.normal(getkey(), (D,))
    p = eqxscan.probe(nonfinite_count, x, 4)

    def loss(p):
        y, _ = eqxscan.tap(stack, probe=p)(x)
        return jnp.sum(jnp.sqrt(y - 100.0))  # nan cotangents from the loss

    np.testing.assert_array_equal(jax.grad(loss)(p).values, [D, D, D, D])


def test_taps_with_fsdp_weights_match_one_device(getkey):
    # Weights split over two devices (each scan step gathers one layer), a
    # batch split over them too: carry and gradient taps as on one device.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    layers = build("AAAA", getkey())
    stack = eqxscan.Stacked.from_layers(layers)
    mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(AxisType.Auto,))
    placed, _, _ = eqxscan.sharding.shard(stack, mesh=mesh, min_size=0)
    assert placed.layer_sharding is not None
    xs = jr.normal(getkey(), (4, D))
    p = eqxscan.probe(both, xs[0], len(stack))

    def step(model, p, xs):
        def loss(mp, x):
            y, stats = eqxscan.tap(mp[0], both, probe=mp[1])(x)
            return loss_fn(y), stats

        per = jax.vmap(
            lambda x: eqx.filter_value_and_grad(loss, has_aux=True)((model, p), x)
        )
        (_, stats), (_, gp) = per(xs)
        return stats, gp.values

    want = eqx.filter_jit(step)(stack, p, xs)
    sharded = jax.device_put(xs, NamedSharding(mesh, P("fsdp")))
    got = eqx.filter_jit(step)(placed, p, sharded)
    close(got, want)
    # And against the hand-written loop and per-layer vjps, per example.
    for k in range(4):
        _, taps = hand_taps(layers, xs[k], both)
        cts = [both(c) for c in hand_cotangents(layers, xs[k], loss_fn)]
        close(
            jax.tree.map(lambda a, k=k: a[k], got),
            (taps, jax.tree.map(lambda *a: jnp.stack(a), *cts)),
        )


@pytest.mark.parametrize("rows", [4, 6])
def test_a_probe_of_the_wrong_length_is_an_error(rows, getkey):
    # It once merged rows silently: 4 rows for 5 layers added layers 3 and 4.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(3, 3, key=k), 5, key=getkey())
    x = jnp.ones(3)
    p = eqxscan.probe(eqxscan.stats.rms, x, rows)

    def loss(p):
        return jnp.sum(eqxscan.tap(stack, eqxscan.stats.rms, probe=p)(x)[0])

    with pytest.raises(ValueError, match=f"probe has {rows} rows, .* ran 5 layers"):
        jax.grad(loss)(p)
    # The right length: each row the statistic of that layer's own cotangent.
    g = jax.grad(loss)(eqxscan.probe(eqxscan.stats.rms, x, 5)).values
    layers = stack.unstack()

    def tail(h, i):
        for layer in layers[i + 1 :]:
            h = layer(h)
        return jnp.sum(h)

    h = x
    for i, layer in enumerate(layers):
        h = layer(h)
        want = eqxscan.stats.rms(jax.grad(tail)(h, i))
        np.testing.assert_allclose(g[i], want, rtol=1e-5)


def test_each_container_call_gets_its_own_rows(getkey):
    # Two calls once shared rows: the second's layer i wrote over the first's.
    first = eqxscan.Stacked.from_layers(build("AAAA", getkey()))
    second = eqxscan.Stacked.from_layers(build("AAA", getkey()))
    rnn = eqxscan.Recurrent(eqxscan.ElmanCell(D, D, key=getkey()))
    x, xs = jr.normal(getkey(), (D,)), jr.normal(getkey(), (5, D))
    y, got = eqxscan.tap(lambda x: second(first(x)), rms)(x)
    assert sorted(got) == ["Stacked", "Stacked_1"]
    close(got["Stacked"], eqxscan.tap(first, rms)(x)[1])
    close(got["Stacked_1"], eqxscan.tap(second, rms)(first(x))[1])
    _, got = eqxscan.tap(lambda x: rnn(first(x), xs), rms)(x)
    close(got["Recurrent"], eqxscan.tap(rnn, rms)(first(x), xs)[1])
    close(got["Stacked"], eqxscan.tap(first, rms)(x)[1])


def test_taps_inside_a_recurrent_cell_match_the_container_alone(getkey):
    stack = eqxscan.Stacked.from_layers(build("AAA", getkey()))

    class Cell(eqx.Module):
        stack: eqxscan.Stacked

        def __call__(self, x, h):
            y, r = eqxscan.tap(self.stack, rms)(h[0] + x)
            return y, r

    xs = jr.normal(getkey(), (4, D))
    h, want = jnp.zeros(D), []
    for x in xs:
        h, r = eqxscan.tap(stack, rms)(h + x)
        want.append(r)
    for mode in ("scan", "loop"):
        rnn = eqxscan.Recurrent(Cell(stack), mode=mode)
        _, (_, got) = rnn((jnp.zeros(D), jnp.zeros(3)), xs)
        close(got, jnp.stack(want))
        # Tapped itself too: the cell's own taps are still the stack's.
        ((_, (_, got)), _) = eqxscan.tap(rnn, rms)((jnp.zeros(D), jnp.zeros(3)), xs)
        close(got, jnp.stack(want))


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_containers_in_a_tapped_recurrent_cell_are_tapped(mode, getkey):
    # They once went untapped: a cell is no layer of a stack, and the rows of
    # the containers it calls are their own, one row of layers per time step.
    inner = eqxscan.Stacked.from_layers(build("AAA", getkey()))
    chain = eqxscan.Chain(build("AB" * 2 + "A", getkey()))

    class Cell(eqx.Module):
        inner: eqxscan.Stacked
        chain: eqxscan.Chain

        def __call__(self, x, h):
            return self.chain(self.inner(h + x))

    rnn = eqxscan.Recurrent(Cell(inner, chain), mode=mode)
    xs = jr.normal(getkey(), (4, D))
    (_, hs), got = eqxscan.tap(rnn, rms)(jnp.zeros(D), xs)
    assert sorted(got) == ["Chain", "Recurrent", "Stacked"]
    close(got["Recurrent"], jax.vmap(rms)(hs))
    h, want_inner, want_chain = jnp.zeros(D), [], []
    for x in xs:
        mid, r = eqxscan.tap(inner, rms)(h + x)
        h, c = eqxscan.tap(chain, rms)(mid)
        want_inner.append(r)
        want_chain.append(c)
    close(got["Stacked"], jnp.stack(want_inner))
    close(got["Chain"], jnp.stack(want_chain))
    with pytest.raises(TypeError, match="ran no layers"):  # no time steps
        eqxscan.tap(rnn, rms)(jnp.zeros(D), xs[:0])
    # A probe still has one row per time step of the Recurrent itself.
    p = eqxscan.probe(rms, jnp.zeros(D), 4)
    g = jax.grad(lambda p: jnp.sum(eqxscan.tap(rnn, probe=p)(jnp.zeros(D), xs)[0][0]))
    assert g(p).values.shape == (4,)


def test_statistics_of_a_complex_carry_use_the_modulus(getkey):
    linear = eqx.nn.Linear(D, D, use_bias=False, key=getkey())
    w = jax.lax.complex(*jr.normal(getkey(), (2, 3, D, D)))
    stack = eqxscan.Stacked(
        layers=eqx.tree_at(lambda m: m.weight, linear, w), num_layers=3
    )
    x = jax.lax.complex(jnp.ones(D), 2 * jnp.ones(D))
    y, got = eqxscan.tap(stack, both)(x)
    hand = [x := layer(x) for layer in stack.unstack()]
    close(got["rms"], jnp.stack([jnp.sqrt(jnp.mean(jnp.abs(h) ** 2)) for h in hand]))
    close(got["max"], jnp.stack([jnp.max(jnp.abs(h)) for h in hand]))


def test_layers_layerdrop_skipped_have_zeros_in_every_grouping(getkey):
    # A stack skips in its scan; a repeated pattern's and a lone layer's draws
    # are made in the layer call, which once tapped a skipped layer's carry.
    # Their gradient probes too (a pattern's were the next layer's cotangent).
    key, x = jr.key(11), jr.normal(getkey(), (D,))
    skipped, probed = [], []
    for pattern in ("AAAAAA", "ABABAB", "AAAAAB"):
        chain = eqxscan.Chain(build(pattern, getkey()), layer_drop=0.5)

        def loss(p):
            y, got = eqxscan.tap(chain, rms, probe=p)(x, key=key)  # noqa: B023
            return jnp.sum(jnp.sin(y)), got

        grads, got = jax.grad(loss, has_aux=True)(eqxscan.probe(rms, x, 6))
        skipped.append(np.asarray(got) == 0)
        probed.append(np.asarray(grads.values) == 0)
    assert 0 < skipped[0].sum() < 6  # the same draws for every grouping
    for s, p in zip(skipped, probed):
        np.testing.assert_array_equal(s, skipped[0])
        np.testing.assert_array_equal(p, skipped[0])


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_a_statistic_may_return_python_numbers(mode, getkey):
    # A constant per layer (a count, a flag) is a row like any other statistic.
    chain = eqxscan.Chain(build("AABA", getkey()), mode=mode)
    x = jr.normal(getkey(), (D,))
    y, got = eqxscan.tap(chain, lambda h: {"rms": rms(h), "one": 1.0, "n": 2})(x)
    hand = [x := layer(x) for layer in chain.unstack()]
    close(got["rms"], jnp.stack([rms(h) for h in hand]))
    np.testing.assert_array_equal(got["one"], np.ones(4))
    np.testing.assert_array_equal(got["n"], np.full(4, 2))


GAIN = 1.0  # read by a layer and a statistic below; rebound by the test


class _Gained(eqx.Module):
    w: Array

    def __call__(self, x):
        return x + GAIN * jnp.tanh(self.w @ x)


def test_an_eager_tap_follows_the_globals_its_layers_and_stat_read(getkey):
    # tap's own cache served the old program after a global changed.
    global GAIN
    chain = eqxscan.Chain(
        [_Gained(jr.normal(k, (D, D))) for k in jr.split(getkey(), 3)]
    )
    x = jr.normal(getkey(), (D,))
    stat = lambda h: GAIN * rms(h)  # noqa: E731
    try:
        for gain in (1.0, 0.5, 1.0):
            GAIN = gain
            y, got = eqxscan.tap(chain, stat)(x)
            want_y, want = hand_taps(chain.unstack(), x, stat)
            close((y, got), (want_y, want))
    finally:
        GAIN = 1.0


class _Counting(eqx.Module):
    # A stateful layer (eqx.nn.State): it returns (x, state).
    w: Array
    index: eqx.nn.StateIndex

    def __init__(self, key):
        self.w = 0.3 * jr.normal(key, (D, D))
        self.index = eqx.nn.StateIndex(jnp.zeros(D))

    def __call__(self, x, state):
        seen = state.get(self.index)
        y = x + jnp.tanh(self.w @ x) + 0.1 * seen
        return y, state.set(self.index, seen + y)


class _Counting2(_Counting):  # another class: the chain groups its layers apart
    pass


@pytest.mark.parametrize("pattern", ["AAAA", "ABAB", "AB"])
def test_stateful_layers_are_tapped_by_their_output(pattern, getkey):
    # A repeated pattern's or a lone stateful layer handed `stat` its
    # `(x, state)` pair, which failed inside the statistic.
    keys = jr.split(getkey(), len(pattern))
    layers = [(_Counting if c == "A" else _Counting2)(k) for c, k in zip(pattern, keys)]
    chain, state = eqx.nn.make_with_state(eqxscan.Chain)(layers)
    x = jr.normal(getkey(), (D,))
    (y, _), got = eqxscan.tap(chain, jnp.sum)(x, state)
    hand, h = [], x
    for layer in layers:  # each layer's state starts at zeros
        h = h + jnp.tanh(layer.w @ h)
        hand.append(jnp.sum(h))
    close((y, got), (h, jnp.stack(hand)))
