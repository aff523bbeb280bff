"""Early exit (`eqxscan.run_until`) and layer subsets (`eqxscan.run_layers`),
against hand-written Python loops over the unstacked layers and `mode="loop"`."""

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jaxtyping import Array

import eqxscan

from .helpers import sub_jaxprs


L, D = 4, 3


class Grow(eqx.Module):
    """Grows a positive carry at every layer, so a norm threshold picks the
    exit depth."""

    w: Array

    def __init__(self, key):
        self.w = jr.uniform(key, (D,), minval=0.2, maxval=0.6)

    def __call__(self, x, extra=None, *, key=None):
        y = x * (1.0 + self.w)
        if extra is not None:
            y = y + extra
        if key is not None:
            y = y + 0.01 * jr.uniform(key, x.shape)
        return y


class Shift(eqx.Module):
    """Another kind of layer, so a chain has groups of several kinds."""

    b: Array

    def __init__(self, key):
        self.b = jr.uniform(key, (D,), minval=0.1, maxval=0.3)

    def __call__(self, x, extra=None, *, key=None):
        del extra
        return x + self.b if key is None else x + self.b * 1.5


def _norm_above(t):
    return lambda c: jnp.sum(c) > t


def _hand_until(layers, x, predicate, keys=None, extras=None, lo=0, hi=None):
    """The definition: stop before the first layer at which, with at least
    `lo` layers run, the predicate holds; at most `hi` layers."""
    hi = len(layers) if hi is None else hi
    n = 0
    while n < hi and not (n >= lo and bool(predicate(x))):
        extra = None if extras is None else extras[n]
        key = None if keys is None else keys[n]
        x = layers[n](x, extra, key=key)
        n += 1
    return x, n


@pytest.fixture
def stack():
    return eqxscan.Stacked(Grow, L, key=jr.key(0))


def _depth_sums(layers, x, keys=None, extras=None):
    """sum(x) after 0, 1, ..., L layers: thresholds between them exit at each
    depth."""
    sums = [float(jnp.sum(x))]
    for i, layer in enumerate(layers):
        x = layer(
            x,
            None if extras is None else extras[i],
            key=None if keys is None else keys[i],
        )
        sums.append(float(jnp.sum(x)))
    assert sums == sorted(sums)
    return sums


def test_run_until_matches_hand_loop_at_every_depth_one_compile(stack):
    # Every exit depth (0 to L, and never) from one executable, against the
    # hand-written loop with the same per-layer keys and per_layer inputs.
    x = jnp.ones(D)
    key = jr.key(1)
    keys = jr.split(key, L)
    extras = jnp.linspace(0.0, 0.3, L * D).reshape(L, D)
    layers = stack.unstack()
    sums = _depth_sums(layers, x, keys, extras)

    @jax.jit
    def f(stack, x, t):
        return eqxscan.run_until(
            stack, x, lambda c: jnp.sum(c) > t, eqxscan.per_layer(extras), key=key
        )

    thresholds = [sums[0] - 1.0] + [(a + b) / 2 for a, b in zip(sums, sums[1:])]
    thresholds.append(sums[-1] + 1.0)  # never holds: all L layers
    depths = []
    for t in thresholds:
        got, n = f(stack, x, jnp.float32(t))
        want, m = _hand_until(layers, x, _norm_above(t), keys, extras)
        loop, k = eqxscan.run_until(
            stack.with_options(mode="loop"),
            x,
            _norm_above(t),
            eqxscan.per_layer(extras),
            key=key,
        )
        assert int(n) == m == int(k)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(loop, want, rtol=1e-6)
        depths.append(m)
    assert depths == [0, 1, 2, 3, 4, 4]
    assert f._cache_size() == 1


def test_min_and_max_layers_static_and_traced(stack):
    x = jnp.ones(D)
    layers = stack.unstack()
    sums = _depth_sums(layers, x)
    t = (sums[1] + sums[2]) / 2  # holds after 2 layers
    pred = _norm_above(t)
    loop = stack.with_options(mode="loop")

    @jax.jit
    def f(stack, x, lo, hi):
        return eqxscan.run_until(stack, x, pred, min_layers=lo, max_layers=hi)

    for lo, hi in [(0, 4), (3, 4), (0, 1), (1, 3), (4, 4), (0, 0)]:
        want, m = _hand_until(layers, x, pred, lo=lo, hi=hi)
        got, n = eqxscan.run_until(stack, x, pred, min_layers=lo, max_layers=hi)
        traced, k = f(stack, x, jnp.int32(lo), jnp.int32(hi))
        # `mode="loop"` masks the layers past the stop rather than skipping them.
        looped, j = eqxscan.run_until(loop, x, pred, min_layers=lo, max_layers=hi)
        assert int(n) == int(k) == int(j) == m
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(traced, want, rtol=1e-6)
        np.testing.assert_allclose(looped, want, rtol=1e-6)
    assert f._cache_size() == 1
    # Concrete arrays are checked as ints are (they were traced and clamped).
    for bounds, match in [
        ({"max_layers": jnp.int32(9)}, "max_layers must be at most 4, got 9"),
        ({"min_layers": np.int32(3), "max_layers": jnp.int32(2)}, "3 is more than"),
    ]:
        with pytest.raises(ValueError, match=match):
            eqxscan.run_until(stack, x, pred, **bounds)


def test_per_example_freezes_rows_like_hand_loop(stack):
    # Rows of different sizes halt at different depths; a halted row whose
    # next layer would give NaN keeps its (finite) value.
    x = jnp.array([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [3.0, 3.0, 3.0], [0.01] * 3])
    t = 4.0
    pred = lambda c: jnp.sum(c, axis=-1) > t  # noqa: E731

    def poisoned(layer, c):
        # NaN for rows that are already past the threshold.
        out = jax.vmap(layer)(c)
        return jnp.where(jnp.sum(c, -1, keepdims=True) > t, jnp.nan, out)

    got, n = eqxscan.run_until(stack, x, pred, per_example=True, method=poisoned)
    loop, k = eqxscan.run_until(
        stack.with_options(mode="loop"), x, pred, per_example=True, method=poisoned
    )
    layers = stack.unstack()
    wants = [_hand_until(layers, row, lambda r: jnp.sum(r) > t) for row in x]
    assert n.tolist() == k.tolist() == [m for _, m in wants]
    assert len(set(n.tolist())) >= 3  # rows really halt at different depths
    np.testing.assert_allclose(got, jnp.stack([w for w, _ in wants]), rtol=1e-6)
    np.testing.assert_allclose(loop, got, rtol=1e-6)
    assert bool(jnp.all(jnp.isfinite(got)))


def test_vmap_and_jvp_of_run_until(stack):
    xs = jnp.array([[0.1] * 3, [1.0] * 3, [2.0] * 3])
    pred = _norm_above(4.0)
    got, n = jax.vmap(lambda x: eqxscan.run_until(stack, x, pred))(xs)
    layers = stack.unstack()
    for row, g, m in zip(xs, got, n):
        want, k = _hand_until(layers, row, pred)
        assert int(m) == k
        np.testing.assert_allclose(g, want, rtol=1e-6)
    # Forward mode works (the exit depth is a function of the primal only).
    x = jnp.ones(D)
    _, tangent = jax.jvp(
        lambda x: eqxscan.run_until(stack, x, pred)[0], (x,), (jnp.ones(D),)
    )
    depth = int(eqxscan.run_until(stack, x, pred)[1])
    scale = jnp.prod(1.0 + stack.layers.w[:depth], axis=0)
    np.testing.assert_allclose(tangent, scale, rtol=1e-6)


def test_reverse_mode_through_run_until_fails_loudly(stack):
    loss = lambda x: jnp.sum(eqxscan.run_until(stack, x, _norm_above(4.0))[0])  # noqa: E731
    with pytest.raises(ValueError, match="while_loop"):
        jax.grad(loss)(jnp.ones(D))


def _chain_layers():
    keys = jr.split(jr.key(3), 9)
    kinds = [Shift, Grow, Grow, Grow, Shift, Grow, Shift, Grow, Shift]
    return [kind(k) for kind, k in zip(kinds, keys)]


def test_chain_run_until_every_depth_global_keys():
    layers = _chain_layers()
    chain = eqxscan.Chain(layers)
    assert {s.per_step for s in chain.layout} == {0, 1, 2}  # lone, stack, pattern
    x = jnp.ones(D)
    key = jr.key(4)
    keys = jr.split(key, len(layers))
    extras = jnp.linspace(0.0, 0.2, len(layers) * D).reshape(len(layers), D)
    sums = _depth_sums(layers, x, keys, extras)

    @jax.jit
    def f(chain, x, t):
        return eqxscan.run_until(
            chain, x, lambda c: jnp.sum(c) > t, eqxscan.per_layer(extras), key=key
        )

    for depth in range(len(layers) + 1):
        t = sums[depth] - 1e-3 if depth == 0 else (sums[depth - 1] + sums[depth]) / 2
        got, n = f(chain, x, jnp.float32(t))
        want, m = _hand_until(layers, x, _norm_above(t), keys, extras)
        assert int(n) == m == depth
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert f._cache_size() == 1
    loop, k = eqxscan.run_until(
        chain.with_options(mode="loop"),
        x,
        _norm_above(sums[5]),
        eqxscan.per_layer(extras),
        key=key,
    )
    want, m = _hand_until(layers, x, _norm_above(sums[5]), keys, extras)
    assert int(k) == m
    np.testing.assert_allclose(loop, want, rtol=1e-6)


def test_run_until_and_run_layers_on_the_blocks_of_a_stacked_mlp():
    model = eqxscan.StackedMLP(8, 4, key=jr.key(5))
    x = jr.normal(jr.key(6), (3, 8))

    @eqx.filter_jit
    def trajectory(model, x):
        # The carry after 0, 1, ..., L blocks, by hand over the unstacked blocks.
        out = [x]
        for block in model.blocks.unstack():
            out.append(block(out[-1]))
        return jnp.stack(out)

    norms = np.linalg.norm(np.asarray(trajectory(model, x)), axis=-1)  # [L+1, B]
    t = float(np.sort(norms[2])[1:].mean())  # between two rows' norms
    run = eqx.filter_jit(
        lambda m, x: eqxscan.run_until(
            m.blocks, x, lambda c: jnp.linalg.norm(c, axis=-1) > t, per_example=True
        )
    )
    got, n = run(model, x)
    traj = np.asarray(trajectory(model, x))
    for b in range(x.shape[0]):
        above = [k for k in range(len(norms)) if norms[k, b] > t]
        depth = above[0] if above else len(norms) - 1
        assert int(n[b]) == depth
        np.testing.assert_allclose(got[b], traj[depth, b], rtol=1e-5, atol=1e-6)
    sub = eqx.filter_jit(lambda m, x: eqxscan.run_layers(m.blocks, x, slice(0, 2)))(
        model, x
    )
    np.testing.assert_allclose(sub, traj[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "remat", ["auto", eqxscan.ScanRemat(policy=True, save_inputs=False)]
)
def test_run_layers_values_and_grads_traced_indices(stack, remat):
    stack = stack.with_options(remat=remat)
    x = jnp.ones(D)
    key = jr.key(7)
    keys = jr.split(key, L)
    extras = jnp.linspace(0.0, 0.3, L * D).reshape(L, D)

    def hand(stack, idx):
        y = x
        for i in idx:
            y = stack[i](y, extras[i], key=keys[i])
        return jnp.sum(y**2)

    @jax.jit
    def loss(stack, idx):
        y = eqxscan.run_layers(stack, x, idx, eqxscan.per_layer(extras), key=key)
        return jnp.sum(y**2)

    grad = jax.jit(jax.grad(loss))
    for idx in ([1, 2], [3, 3], [2, 0]):
        got = loss(stack, jnp.array(idx))
        np.testing.assert_allclose(got, hand(stack, idx), rtol=1e-6)
        g = grad(stack, jnp.array(idx)).layers.w
        want = jax.grad(hand)(stack, idx).layers.w
        np.testing.assert_allclose(g, want, rtol=1e-5)
        unchosen = [i for i in range(L) if i not in idx]
        assert bool(jnp.all(g[jnp.array(unchosen, jnp.int32)] == 0))
    assert loss._cache_size() == 1 and grad._cache_size() == 1
    # The same choice given statically (sliced before the scan).
    static = eqxscan.run_layers(stack, x, [2, 0], eqxscan.per_layer(extras), key=key)
    np.testing.assert_allclose(jnp.sum(static**2), hand(stack, [2, 0]), rtol=1e-6)


def test_run_layers_slice_matches_full_run_and_loop(stack):
    x = jnp.ones(D)
    key = jr.key(8)
    full_keys = jr.split(key, L)
    # Layers 1..3 with the keys they have in a full run.
    want = x
    for i in (1, 2):
        want = stack[i](want, key=full_keys[i])
    for s in (stack, stack.with_options(mode="loop")):
        for layers in (slice(1, 3), jnp.array([1, 2])):
            got = eqxscan.run_layers(s, x, layers, key=key)
            np.testing.assert_allclose(got, want, rtol=1e-6)
    # The whole range is the full call.
    np.testing.assert_allclose(
        eqxscan.run_layers(stack, x, slice(None), key=key), stack(x, key=key), rtol=1e-6
    )


def test_run_layers_consecutive_static_choice_slices_the_stack():
    # Consecutive layers chosen statically run as a stack of those layers (a
    # static slice of the weights), not as a scan reading each layer by index.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(D, D, key=k), 4, key=jr.key(0))

    def primitives(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for sub in sub_jaxprs(eqn.params):
                yield from primitives(sub)

    for layers in (slice(1, 3), [1, 2]):
        run = lambda s, x, layers=layers: eqxscan.run_layers(s, x, layers)  # noqa: E731
        names = set(primitives(jax.make_jaxpr(run)(stack, jnp.ones(D)).jaxpr))
        assert "slice" in names
        assert not names & {"dynamic_slice", "gather"}


def test_chain_run_until_per_example():
    layers = _chain_layers()
    chain = eqxscan.Chain(layers)
    x = jnp.array([[0.1] * 3, [1.0] * 3, [2.0] * 3])
    t = 12.0
    rows = lambda layer, c: jax.vmap(layer)(c)  # noqa: E731
    pred = lambda c: jnp.sum(c, axis=-1) > t  # noqa: E731
    got, n = eqxscan.run_until(chain, x, pred, per_example=True, method=rows)
    loop, k = eqxscan.run_until(
        chain.with_options(mode="loop"), x, pred, per_example=True, method=rows
    )
    wants = [_hand_until(layers, row, lambda r: jnp.sum(r) > t) for row in x]
    assert n.tolist() == k.tolist() == [m for _, m in wants]
    assert len(set(n.tolist())) == 3
    np.testing.assert_allclose(got, jnp.stack([w for w, _ in wants]), rtol=1e-6)
    np.testing.assert_allclose(loop, got, rtol=1e-6)


def test_chain_run_layers_static():
    layers = _chain_layers()
    chain = eqxscan.Chain(layers)
    x = jnp.ones(D)
    key = jr.key(9)
    keys = jr.split(key, len(layers))
    for idx in (slice(2, 7), [0, 4, 8]):
        order = range(len(layers))[idx] if isinstance(idx, slice) else idx
        want = x
        for i in order:
            want = layers[i](want, key=keys[i])
        got = eqxscan.run_layers(chain, x, idx, key=key)
        np.testing.assert_allclose(got, want, rtol=1e-6)


class Scale(eqx.Module):
    """A third kind of layer, for a chain of two runs around a lone layer."""

    s: Array

    def __init__(self, key):
        self.s = jr.uniform(key, (D,), minval=0.8, maxval=1.2)

    def __call__(self, x, extra=None, *, key=None):
        y = x * self.s + (0.0 if extra is None else extra)
        return y if key is None else y - 0.01 * jr.uniform(key, x.shape)


def _runs_and_lone():
    # Grow x3 (a scanned run), a lone Shift, Scale x2 (another run).
    keys = jr.split(jr.key(12), 6)
    kinds = [Grow, Grow, Grow, Shift, Scale, Scale]
    return eqxscan.Chain([kind(k) for kind, k in zip(kinds, keys)])


def _hand_layers(chain, x, idx, keys, extras):
    """The definition: the chosen layers in order, each with its own key and
    `per_layer` slice."""
    for i in idx:
        x = chain[int(i)](x, extras[i], key=keys[i])
    return x


def _leaves(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


@pytest.mark.parametrize(
    "remat", ["auto", eqxscan.ScanRemat(policy=True, save_inputs=False)]
)
def test_chain_run_layers_traced_values_grads_one_compile(remat):
    chain = _runs_and_lone().with_options(remat=remat)
    assert [s.per_step for s in chain.layout] == [1, 0, 1]
    n = len(chain)
    x = jnp.linspace(0.5, 1.0, D)
    key = jr.key(13)
    keys = jr.split(key, n)
    extras = jnp.linspace(0.0, 0.3, n * D).reshape(n, D)

    def hand(chain, idx):
        return jnp.sum(_hand_layers(chain, x, idx, keys, extras) ** 2)

    @jax.jit
    def loss(chain, idx):
        y = eqxscan.run_layers(chain, x, idx, eqxscan.per_layer(extras), key=key)
        return jnp.sum(y**2)

    grad = jax.jit(jax.grad(loss))
    # In order, repeated, out of order, across all three groups, one group only.
    for idx in ([0, 3, 5], [3, 3, 1], [5, 4, 0], [4, 2, 3], [1, 1, 1]):
        got = loss(chain, jnp.array(idx))
        np.testing.assert_allclose(got, hand(chain, idx), rtol=1e-5)
        g = grad(chain, jnp.array(idx))
        want = jax.grad(hand)(chain, idx)
        for a, b in zip(_leaves(g), _leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        for i in range(n):
            chosen = any(bool(jnp.any(a != 0)) for a in _leaves(g[i]))
            assert chosen == (i in idx), (idx, i)
    assert loss._cache_size() == 1 and grad._cache_size() == 1


def test_chain_run_layers_traced_repeated_pattern_and_loop():
    # A lone layer, a stack and a repeated pattern [Grow, Shift]: the step
    # picks the repeat, then the pattern's layer.
    layers = _chain_layers()
    chain = eqxscan.Chain(layers)
    assert [s.per_step for s in chain.layout] == [0, 1, 2]
    n = len(layers)
    x = jnp.ones(D)
    key = jr.key(14)
    keys = jr.split(key, n)
    extras = jnp.linspace(0.0, 0.2, n * D).reshape(n, D)

    @jax.jit
    def f(chain, idx):
        return eqxscan.run_layers(chain, x, idx, eqxscan.per_layer(extras), key=key)

    loop = chain.with_options(mode="loop")
    for idx in ([3, 4, 5, 6], [8, 7, 6, 5], [6, 6, 0, 2], [4, 8, 1, 7]):
        want = _hand_layers(chain, x, idx, keys, extras)
        np.testing.assert_allclose(f(chain, jnp.array(idx)), want, rtol=1e-5)
        np.testing.assert_allclose(f(loop, jnp.array(idx)), want, rtol=1e-5)
    assert f._cache_size() == 2  # one for each mode
    # Gradients reach the chosen repeat's layer, and only it.
    g = jax.grad(lambda c: jnp.sum(f(c, jnp.array([5, 5, 8, 0]))))(chain)
    want = jax.grad(lambda c: jnp.sum(_hand_layers(c, x, [5, 5, 8, 0], keys, extras)))(
        chain
    )
    for a, b in zip(_leaves(g), _leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert [
        i for i in range(n) if any(bool(jnp.any(a != 0)) for a in _leaves(g[i]))
    ] == [0, 5, 8]


def test_chain_run_layers_traced_vmap_and_clamping():
    chain = _runs_and_lone()
    n = len(chain)
    xs = jnp.linspace(0.1, 1.0, 2 * D).reshape(2, D)
    keys = jr.split(jr.key(15), n)
    extras = jnp.zeros((n, D))

    def run(x, idx):
        return eqxscan.run_layers(chain, x, idx, key=jr.key(15))

    # Over a batch of carries, and over a batch of index arrays.
    idx = jnp.array([4, 0, 3])
    got = jax.jit(jax.vmap(run, in_axes=(0, None)))(xs, idx)
    for x, y in zip(xs, got):
        want = _hand_layers(chain, x, [4, 0, 3], keys, extras)
        np.testing.assert_allclose(y, want, rtol=1e-5)
    choices = jnp.array([[5, 3, 1], [0, 0, 4]])
    got = jax.jit(jax.vmap(run))(xs, choices)
    for x, c, y in zip(xs, choices.tolist(), got):
        np.testing.assert_allclose(
            y, _hand_layers(chain, x, c, keys, extras), rtol=1e-5
        )
    # Traced indices count from the end when negative, as concrete ones do
    # (the same array eager and under jit runs the same layers; -3 ran layer
    # 0 under jit), then are clamped to [0, L-1], as for a Stacked.
    eager = eqxscan.run_layers(chain, xs[0], [-3, 2], key=jr.key(15))
    clamped = jax.jit(run)(xs[0], jnp.array([-3, 99, 2, -99]))
    want = _hand_layers(chain, xs[0], [n - 3, n - 1, 2, 0], keys, extras)
    np.testing.assert_allclose(jax.jit(run)(xs[0], jnp.array([-3, 2])), eager)
    np.testing.assert_allclose(clamped, want, rtol=1e-5)
    # Broadcast arguments need not be arrays (a method reading a string).
    tagged = lambda layer, x, tag, scale: layer(x) * (scale if tag == "half" else 2)  # noqa: E731
    got = jax.jit(
        lambda i: eqxscan.run_layers(chain, xs[0], i, "half", scale=0.5, method=tagged)
    )(jnp.array([3, 1]))
    np.testing.assert_allclose(got, chain[1](chain[3](xs[0]) * 0.5) * 0.5, rtol=1e-5)


class Widen(eqx.Module):
    """Doubles the carry's width: fine in a call of the chain, not as one step
    of a scan over chosen layers."""

    def __call__(self, x, *, key=None):
        return jnp.concatenate([x, x])


class Half(eqx.Module):
    def __call__(self, x, *, key=None):
        return x.astype(jnp.float16)


@pytest.mark.parametrize(
    "odd, match",
    [
        (
            Widen(),
            r"Layer 2 \(Widen\) changed carry leaf `carry` from float32\[3\] to "
            r"float32\[6\]",
        ),
        (
            Half(),
            r"Layer 2 \(Half\) changed carry leaf `carry` from float32\[3\] to "
            r"float16\[3\] \(a dtype change: cast",
        ),
    ],
)
def test_chain_run_layers_traced_carry_must_keep_its_type(odd, match):
    keys = jr.split(jr.key(16), 4)
    chain = eqxscan.Chain([Grow(keys[0]), Grow(keys[1]), odd, Shift(keys[3])])
    x = jnp.ones(D)
    # Whatever is chosen: every body is traced, so the error comes first.
    with pytest.raises(TypeError, match=match) as info:
        jax.jit(lambda i: eqxscan.run_layers(chain, x, i))(jnp.array([0, 1]))
    lines = str(info.value).splitlines()
    assert lines[0].startswith("run_layers of a Chain: Layer 2")
    assert len(lines) == 2 and lines[1].startswith("Hint:")
    # Chosen statically, the chain is regrouped and a lone layer may widen.
    static = eqxscan.run_layers(chain, x, [0, 1])
    np.testing.assert_allclose(static, chain[1](chain[0](x)), rtol=1e-6)


def test_chain_run_layers_traced_names_a_layer_failing_on_the_carry():
    # An input projection (3 -> 8) runs in the switch on the 8-d carry: JAX's
    # dot_general error came through, naming no layer.
    keys = jr.split(jr.key(17), 3)
    chain = eqxscan.Chain(
        [eqx.nn.Linear(3, 8, key=keys[0])]
        + [eqx.nn.Linear(8, 8, key=k) for k in keys[1:]]
    )
    with pytest.raises(TypeError) as info:
        eqxscan.run_layers(chain, jnp.ones(8), jnp.array([1, 2]))
    first, hint = str(info.value).splitlines()
    assert first.startswith("Layer 0 (Linear) failed on its input float32[8]: ")
    assert "dot_general" in first and "one step of one scan" in hint


def test_bad_inputs(stack):
    x = jnp.ones(D)
    with pytest.raises(TypeError, match="must return a bool scalar, got float32"):
        eqxscan.run_until(stack, x, lambda c: jnp.sum(c))
    with pytest.raises(TypeError, match=r"must return bool\[2\]"):
        eqxscan.run_until(
            stack, jnp.ones((2, D)), lambda c: jnp.sum(c) > 1, per_example=True
        )
    with pytest.raises(ValueError, match="min_layers=3 is more than max_layers=2"):
        eqxscan.run_until(stack, x, _norm_above(1.0), min_layers=3, max_layers=2)
    with pytest.raises(ValueError, match="max_layers must be at most 4"):
        eqxscan.run_until(stack, x, _norm_above(1.0), max_layers=5)
    with pytest.raises(TypeError, match="max_layers must be an int"):
        eqxscan.run_until(stack, x, _norm_above(1.0), max_layers=jnp.float32(2))
    with pytest.raises(IndexError, match="layer index 4 is out of range for 4"):
        eqxscan.run_layers(stack, x, [0, 4])
    with pytest.raises(IndexError, match="layer index 7 is out of range"):
        eqxscan.run_layers(stack, x, jnp.array([7]))
    with pytest.raises(ValueError, match="selects no layers"):
        eqxscan.run_layers(stack, x, slice(3, 1))
    for empty in ([], (), np.array([], np.int32)):
        with pytest.raises(ValueError, match="layers is empty"):
            eqxscan.run_layers(stack, x, empty)
    with pytest.raises(TypeError, match="1-D integer array, got float32"):
        eqxscan.run_layers(stack, x, jnp.array([0.0, 1.0]))
    with pytest.raises(IndexError, match="layer index 9 is out of range for 9"):
        eqxscan.run_layers(eqxscan.Chain(_chain_layers()), x, jnp.array([0, 9]))
    # Under the test suite's runtime type checker the annotation catches it
    # first; without, eqxscan's own error names both.
    with pytest.raises(TypeError, match="Stacked"):
        eqxscan.run_until(stack.layers, x, _norm_above(1.0))
    with pytest.raises(IndexError) as info:
        eqxscan.run_layers(stack, x, [9])
    assert len(str(info.value).splitlines()) == 2  # a headline and a hint
    assert str(info.value).splitlines()[1].startswith("Hint:")


def test_fsdp_sharded_stack_gathers_one_layer_per_step():
    # FSDP: the weights are split over two devices and each step gathers its
    # one layer (`layer_sharding`); results match the unsharded model.
    mesh = eqxscan.sharding.make_mesh(fsdp=2)
    model = eqxscan.StackedMLP(8, 4, key=jr.key(10))
    sharded, _, _ = eqxscan.sharding.shard(model, mesh=mesh, min_size=0)
    assert sharded.blocks.layer_sharding is not None
    x = jr.normal(jr.key(11), (2, 8))
    t = 1.5 * float(jnp.linalg.norm(x))

    @eqx.filter_jit
    def both(m, x, idx):
        y, n = eqxscan.run_until(m.blocks, x, lambda c: jnp.linalg.norm(c) > t)
        return y, n, eqxscan.run_layers(m.blocks, x, idx)

    idx = jnp.array([3, 1])
    got = both(sharded, x, idx)
    want = both(model, x, idx)
    assert int(got[1]) == int(want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)


def test_drop_rates_are_refused_in_training_and_off_in_inference(getkey):
    # run_until/run_layers call the layers themselves: drop rates would be
    # skipped silently, so a training-mode model with rates is refused.
    stack = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=getkey(), layer_drop=0.5
    )
    x = jnp.ones(4)
    with pytest.raises(ValueError, match="does not apply drop_path/layer_drop"):
        eqxscan.run_layers(stack, x, slice(0, 2))
    with pytest.raises(ValueError, match="does not apply drop_path/layer_drop"):
        eqxscan.run_until(stack, x, lambda c: jnp.array(False))
    quiet = eqx.nn.inference_mode(stack)
    out, n = eqxscan.run_until(quiet, x, lambda c: jnp.array(False))
    ref = x
    for layer in quiet.unstack():
        ref = layer(ref)
    assert int(n) == 3 and np.allclose(out, ref, rtol=1e-6)
    # A stack among a Chain's layers is called whole: its own rates apply, as
    # when the Chain itself is called with the same key.
    chain = eqxscan.Chain([stack, eqx.nn.Linear(4, 4, key=getkey())])
    key = jax.random.key(3)
    out, n = eqxscan.run_until(chain, x, lambda c: jnp.array(False), key=key)
    assert int(n) == 2 and np.array_equal(out, chain(x, key=key))
    assert not np.allclose(out, eqx.nn.inference_mode(chain)(x))


def test_an_eager_run_until_is_compiled_once_per_predicate(caplog):
    # Outside jit it compiled every call anew (and kept each program); the
    # same predicate written at each call now reuses one, a changed value it
    # reads compiles anew, and the values are the loop's.
    stack = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(4, 4, key=k), 12, key=jax.random.key(0)
    )
    x = jnp.ones(4)
    runs = []
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        for limit in (1.0, 1.0, 1.0, 4.0):
            runs.append(eqxscan.run_until(stack, x, lambda c: jnp.sum(c**2) > limit))  # noqa: B023
    compiled = [m for m in caplog.messages if "float32[12,4,4]" in m]
    assert len(compiled) == 2, compiled  # one per value of `limit`
    loop = stack.with_options(mode="loop")
    for limit, (out, n) in zip((1.0, 1.0, 1.0, 4.0), runs):
        want, m = eqxscan.run_until(loop, x, lambda c: jnp.sum(c**2) > limit)  # noqa: B023
        assert int(n) == int(m)
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_reverse_is_refused_not_passed_to_the_layers(stack):
    # A call's option: passed on to each layer, it ran the layers forward (a
    # layer taking **kwargs) or failed inside the first layer.
    x = jnp.ones(D)
    with pytest.raises(TypeError, match=r"run_layers takes no reverse=.*\n.*-1\)\)"):
        eqxscan.run_layers(stack, x, slice(0, 3), reverse=True)
    with pytest.raises(TypeError, match=r"run_until takes no reverse=.*from layer 0"):
        eqxscan.run_until(stack, x, lambda c: False, reverse=True)
    # `reverse=False`, a call's default, is taken as a call takes it.
    forwards = eqxscan.run_layers(stack, x, slice(0, L), reverse=False)
    np.testing.assert_allclose(forwards, stack(x), rtol=1e-6)
    backwards = eqxscan.run_layers(stack, x, slice(None, None, -1))
    np.testing.assert_allclose(backwards, stack(x, reverse=True), rtol=1e-6)


def test_narrow_index_dtypes_on_a_deep_stack():
    # `L` = 130 does not fit an int8: adding it to a negative index, or taking
    # the indices modulo it, overflowed (an OverflowError, traced or not), and
    # the index cast back to int8 ran layer 3 for -1.
    deep = eqxscan.Stacked(lambda k: eqx.nn.Linear(2, 2, key=k), 130, key=jr.key(1))
    x = jnp.ones(2)
    want = deep[129](deep[5](deep[0](x)))
    for idx in (jnp.array([0, 5, -1], jnp.int8), jnp.array([0, 5, 129], jnp.int16)):
        np.testing.assert_allclose(eqxscan.run_layers(deep, x, idx), want, rtol=1e-5)
        traced = jax.jit(lambda i: eqxscan.run_layers(deep, x, i))(idx)
        np.testing.assert_allclose(traced, want, rtol=1e-5)
