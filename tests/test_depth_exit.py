"""Early exit (`eqxscan.run_until`) and layer subsets (`eqxscan.run_layers`),
against hand-written Python loops over the unstacked layers and `mode="loop"`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jaxtyping import Array

import eqxscan


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

    @jax.jit
    def f(stack, x, lo, hi):
        return eqxscan.run_until(stack, x, pred, min_layers=lo, max_layers=hi)

    for lo, hi in [(0, 4), (3, 4), (0, 1), (1, 3), (4, 4), (0, 0)]:
        want, m = _hand_until(layers, x, pred, lo=lo, hi=hi)
        got, n = eqxscan.run_until(stack, x, pred, min_layers=lo, max_layers=hi)
        traced, k = f(stack, x, jnp.int32(lo), jnp.int32(hi))
        assert int(n) == int(k) == m
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(traced, want, rtol=1e-6)
    assert f._cache_size() == 1


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
    assert {s.period for s in chain.layout} == {0, 1, 2}  # lone, run, pattern
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


def test_stacked_mlp_run_until_and_run_layers():
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
        lambda m, x: m.run_until(
            x, lambda c: jnp.linalg.norm(c, axis=-1) > t, per_example=True
        )
    )
    got, n = run(model, x)
    traj = np.asarray(trajectory(model, x))
    for b in range(x.shape[0]):
        above = [k for k in range(len(norms)) if norms[k, b] > t]
        depth = above[0] if above else len(norms) - 1
        assert int(n[b]) == depth
        np.testing.assert_allclose(got[b], traj[depth, b], rtol=1e-5, atol=1e-6)
    sub = eqx.filter_jit(lambda m, x: m.run_layers(x, slice(0, 2)))(model, x)
    np.testing.assert_allclose(sub, traj[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "checkpoint", ["auto", eqxscan.ScanCheckpoint(policy=True, save_inputs=False)]
)
def test_run_layers_values_and_grads_traced_indices(stack, checkpoint):
    stack = stack.with_options(checkpoint=checkpoint)
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
    with pytest.raises(TypeError, match="1-D integer array, got float32"):
        eqxscan.run_layers(stack, x, jnp.array([0.0, 1.0]))
    with pytest.raises(TypeError, match="static layer choices"):
        eqxscan.run_layers(eqxscan.Chain(_chain_layers()), x, jnp.array([0]))
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
        y, n = m.run_until(x, lambda c: jnp.linalg.norm(c) > t)
        return y, n, m.run_layers(x, idx)

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
