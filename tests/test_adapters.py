"""LoRA adapters: the product from the stored base and adapters, against
hand-written references."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqxscan
from eqxscan import adapters
from eqxscan._models.mlp import rms_norm
from eqxscan.adapters import LoRA

from .helpers import Dense, TwoDense


def _lora(getkey, orientation="x@W", m=6, n=5, r=2, k=3, active=1, alpha=4.0):
    base = jr.normal(getkey(), (m, n))
    if orientation == "x@W":
        a, b = jr.normal(getkey(), (k, m, r)), jr.normal(getkey(), (k, r, n))
    else:
        a, b = jr.normal(getkey(), (k, r, n)), jr.normal(getkey(), (k, m, r))
    return LoRA(base, a, b, jnp.asarray(active), alpha, r, orientation, name="w")


@pytest.mark.parametrize("active", [0, 2, -1])
def test_x_at_lora_is_the_low_rank_product(getkey, active):
    lora = _lora(getkey, active=active)
    x = jr.normal(getkey(), (2, 3, 6))  # any leading shape
    expected = x @ lora.base
    if active >= 0:
        expected = expected + 2.0 * (x @ lora.a[active]) @ lora.b[active]
    np.testing.assert_allclose(x @ lora, expected, rtol=1e-5, atol=1e-5)
    # NumPy inputs and a jitted call give the same.
    np.testing.assert_allclose(np.asarray(x) @ lora, expected, rtol=1e-5, atol=1e-5)
    jitted = eqx.filter_jit(lambda lo, x: x @ lo)(lora, x)
    np.testing.assert_allclose(jitted, expected, rtol=1e-5, atol=1e-5)
    assert (lora.shape, lora.dtype, lora.ndim) == ((6, 5), jnp.float32, 2)


@pytest.mark.parametrize("active", [1, -1])
def test_lora_at_x_is_the_mirror(getkey, active):
    lora = _lora(getkey, "W@x", active=active)
    for x in (jr.normal(getkey(), (5,)), jr.normal(getkey(), (4, 5, 2))):
        expected = lora.base @ x
        if active >= 0:
            expected = expected + 2.0 * lora.b[active] @ (lora.a[active] @ x)
        np.testing.assert_allclose(lora @ x, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("orientation", ["x@W", "W@x"])
def test_a_wider_input_keeps_the_adapters_term_wide(getkey, orientation):
    # A bfloat16 LoRA used on float32 inputs (standard promotion): the output is
    # float32, and so is the adapters' term added to it, as with its weights
    # upcast by hand.
    lora = _lora(getkey, orientation)
    half = [x.astype(jnp.bfloat16) for x in (lora.base, lora.a, lora.b)]
    lora = eqx.tree_at(lambda lo: (lo.base, lo.a, lo.b), lora, tuple(half))
    base, a, b = (x.astype(jnp.float32) for x in (half[0], half[1][1], half[2][1]))
    if orientation == "x@W":
        x = jr.normal(getkey(), (3, 6))
        expected, got = x @ base + 2.0 * (x @ a) @ b, lambda: x @ lora
    else:
        x = jr.normal(getkey(), (5, 3))
        expected, got = base @ x + 2.0 * b @ (a @ x), lambda: lora @ x
    with jax.numpy_dtype_promotion("standard"):
        y = got()
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("orientation", ["x@W", "W@x"])
def test_dropout_masks_the_adapters_input(getkey, orientation):
    # A quarter of x's entries dropped (the rest scaled by 4/3) on the way into
    # the adapters only, in either orientation; the base sees x whole.
    key = getkey()
    lora = _lora(getkey, orientation)
    lora = dataclasses.replace(lora, dropout=0.25, key=key)
    x = jr.normal(getkey(), (3, 6) if orientation == "x@W" else (5, 4))
    dropped = jnp.where(jr.bernoulli(key, 0.75, x.shape), x / 0.75, 0.0)
    if orientation == "x@W":
        expected = x @ lora.base + 2.0 * (dropped @ lora.a[1]) @ lora.b[1]
        got = x @ lora
    else:
        expected = lora.base @ x + 2.0 * lora.b[1] @ (lora.a[1] @ dropped)
        got = lora @ x
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_base_alone_ignores_a_non_finite_adapter(getkey):
    lora = _lora(getkey, active=-1)
    lora = eqx.tree_at(lambda lo: lo.a, lora, lora.a.at[0].set(jnp.nan))
    x = jr.normal(getkey(), (6,))
    np.testing.assert_allclose(x @ lora, x @ lora.base, rtol=1e-6)


def test_base_alone_gives_adapters_no_gradient(getkey):
    lora = _lora(getkey, active=-1)
    x = jr.normal(getkey(), (6,))
    loss = lambda lo_x: jnp.sum(lo_x[1] @ lo_x[0])  # noqa: E731
    grads, dx = eqx.filter_jit(eqx.filter_grad(loss))((lora, x))
    assert not jnp.any(grads.a) and not jnp.any(grads.b) and not jnp.any(grads.base)
    np.testing.assert_allclose(dx, lora.base.sum(-1), rtol=1e-6)


def test_a_traced_active_selects_per_row(getkey):
    lora = _lora(getkey)
    # 3 is no adapter of the 3: as -1, the base alone.
    xs, ids = jr.normal(getkey(), (5, 6)), jnp.array([0, 2, -1, 1, 3])
    rows = jax.vmap(lambda x, i: x @ eqx.tree_at(lambda lo: lo.active, lora, i))
    expected = [
        x @ lora.base + (2.0 * (x @ lora.a[i]) @ lora.b[i] if 0 <= i < 3 else 0)
        for x, i in zip(xs, ids.tolist())
    ]
    np.testing.assert_allclose(rows(xs, ids), jnp.stack(expected), rtol=1e-5)


def test_other_operations_raise(getkey):
    lora = _lora(getkey)
    x = jnp.ones((2, 6))
    for op in (
        lambda: x + lora,
        lambda: lora * 2,
        lambda: lora[0],
        lambda: jnp.asarray(lora),
        lambda: np.asarray(lora),
        lambda: lora.T,
        lambda: x @ lora.astype(x.dtype),  # a mixed-precision layer's cast
        lambda: lora.reshape(-1),
    ):
        with pytest.raises(TypeError, match=r"The LoRA at `w`.*\n.*merge"):
            op()
    # jax.numpy functions refuse it as an operand (never silently use the base).
    for op in (jnp.matmul, jnp.dot, lambda x, w: jnp.einsum("bi,io->bo", x, w)):
        with pytest.raises(TypeError, match="requires ndarray or scalar"):
            op(x, lora)


def test_wrong_use_raises(getkey):
    lora = _lora(getkey)
    with pytest.raises(
        TypeError,
        match=r"'x@W' but was used as `lora @ x`; it computes `x @ lora` only",
    ):
        lora @ jnp.ones(5)
    with pytest.raises(TypeError, match=r"got x of shape \(2, 5\).*size 6"):
        jnp.ones((2, 5)) @ lora
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), lora)
    with pytest.raises(TypeError, match=r"\(base float32\[2,6,5\]\) has 1 layer axes"):
        jnp.ones(6) @ stacked


# Models adapted by add_lora, against hand-written LoRA loops over their layers.


S = 2.0  # alpha / rank below


def _random_b(model, key):
    """Adapters that change the output (`add_lora` starts `b` at zero)."""
    loras = [x for x in jax.tree.leaves(model, is_leaf=_is_lora) if _is_lora(x)]
    keys = jr.split(key, len(loras))
    return eqx.tree_at(
        lambda m: [lo.b for lo in jax.tree.leaves(m, is_leaf=_is_lora) if _is_lora(lo)],
        model,
        [0.5 * jr.normal(k, lo.b.shape) for k, lo in zip(keys, loras)],
    )


def _is_lora(x):
    return isinstance(x, adapters.LoRA)


def _at(tree, i):
    """Layer `i` of stacked arrays (a LoRA's `inference` flag is not stacked)."""
    return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, tree)


def _adapt(w, x, k=0):
    """x @ W + s * (x @ A) @ B, written out, for one layer's LoRA (or array)."""
    if not _is_lora(w):
        return x @ w
    if k < 0:
        return x @ w.base
    return x @ w.base + S * (x @ w.a[k]) @ w.b[k]


def _mlp_reference(model, x, k=0):
    layers = model.blocks.layers
    for i in range(model.num_layers):
        w1, w2, scale = (_at(t, i) for t in (layers.w1, layers.w2, layers.scale))
        h = jax.nn.gelu(_adapt(w1, rms_norm(scale, x), k))
        x = x + _adapt(w2, h, k)
    return x


def _mlp(getkey, k=1, **options):
    model = eqxscan.StackedMLP(8, 2, key=getkey(), **options)
    model = adapters.add_lora(
        model, ["blocks.*.w1", "*.w2"], rank=2, alpha=4.0, num_adapters=k, key=getkey()
    )
    return _random_b(model, getkey())


def _call(model, x):
    return model(x)


def _losses_and_grads(x, *runs):
    """For each `(fn, model)`, the loss `sum(fn(model, x) ** 2)` and its gradient
    with respect to the adapters, all in one compiled program (one compile)."""
    parts = [eqx.partition(m, adapters.trainable(m)) for _, m in runs]

    @jax.jit
    def all_runs(params, x):
        out = []
        for (fn, _), p, (_, static) in zip(runs, params, parts):
            loss = lambda p, fn=fn, s=static: jnp.sum(fn(eqx.combine(p, s), x) ** 2)  # noqa: E731
            out.append(jax.value_and_grad(loss)(p))
        return out

    return all_runs([p for p, _ in parts], x)


def _assert_close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def test_stacked_mlp_equals_a_hand_written_lora_loop(getkey):
    model = _mlp(getkey)
    x, key = jr.normal(getkey(), (2, 8)), getkey()
    policy = jax.checkpoint_policies.dots_saveable
    runs = [model.with_options(mode="loop")]
    runs += [
        model.with_options(remat=r) for r in (False, True, "auto", "nested", policy)
    ]
    dropping = model.with_options(drop_path=0.5)
    drop = lambda m, x: m(x, key=key)  # noqa: E731
    expected, *got, dropped, dropped_loop = _losses_and_grads(
        x,
        (_mlp_reference, model),
        *[(_call, r) for r in runs],
        (drop, dropping),
        (drop, dropping.with_options(mode="loop")),
    )
    for g in got:
        _assert_close(g, expected)
    # Only the adapters have gradients.
    grads = got[0][1].blocks.layers
    assert grads.w1.base is None and grads.scale is None
    assert grads.w1.a.shape == (2, 1, 8, 2) and jnp.all(grads.w2.b != 0)
    # Drop path: the scan drops what the loop drops.
    _assert_close(dropped, dropped_loop)
    assert not np.allclose(dropped[0], expected[0])


class LinearBlock(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, dim, *, key):
        self.linear = eqx.nn.Linear(dim, dim, key=key)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


def test_linear_stack_equals_a_hand_written_lora_loop(getkey):
    stack = eqxscan.Stacked(lambda k: LinearBlock(6, key=k), 3, key=getkey())
    stack = adapters.add_lora(stack, eqx.nn.Linear, rank=2, alpha=4.0, key=getkey())
    stack = _random_b(stack, getkey())
    lora = stack.layers.linear.weight
    assert lora.orientation == "W@x" and lora.a.shape == (3, 1, 2, 6)
    assert lora.name == "*.linear.weight"  # the state dict's, as for a pattern

    def reference(stack, x):
        w, bias = stack.layers.linear.weight, stack.layers.linear.bias
        for i in range(3):
            base, a, b = w.base[i], w.a[i, 0], w.b[i, 0]
            x = x + jnp.tanh(base @ x + S * b @ (a @ x) + bias[i])
        return x

    x = jr.normal(getkey(), (6,))
    loop = stack.with_options(mode="loop", remat=True)
    expected, *got = _losses_and_grads(
        x, (reference, stack), (_call, stack), (_call, loop)
    )
    for g in got:
        _assert_close(g, expected)


def test_chain_equals_a_hand_written_lora_loop(getkey):
    layers = [Dense(jr.normal(getkey(), (4, 4))) for _ in range(2)]
    layers += [TwoDense(jr.normal(getkey(), (4, 3)), jr.normal(getkey(), (3, 4)))]
    layers += [Dense(jr.normal(getkey(), (4, 4)))]
    chain = adapters.add_lora(
        eqxscan.Chain(layers), "*.w", rank=2, alpha=4.0, key=getkey()
    )
    chain = _random_b(chain, getkey())
    stack, two, last = chain.groups
    assert _is_lora(stack.layers.w) and _is_lora(two.w) and not _is_lora(two.v)

    def reference(chain, x):
        stack, two, last = chain.groups
        for i in range(2):
            x = x + jnp.tanh(_adapt(_at(stack.layers.w, i), x))
        x = x + jnp.tanh(_adapt(two.w, x)) @ two.v
        return x + jnp.tanh(_adapt(last.w, x))

    x = jr.normal(getkey(), (3, 4))
    expected, got = _losses_and_grads(x, (reference, chain), (_call, chain))
    _assert_close(got, expected)


def test_init_is_pefts(getkey):
    key = getkey()
    model = eqxscan.StackedMLP(8, 3, key=getkey())
    loop = model.with_options(mode="loop")
    one, two = (
        adapters.add_lora(m, "blocks.*.w1", rank=2, num_adapters=2, key=key)
        for m in (model, loop)
    )
    lora = one.blocks.layers.w1
    assert lora.base is model.blocks.layers.w1  # the base itself, not a copy
    assert lora.alpha == 2.0 and lora.rank == 2 and not jnp.any(lora.b)
    assert jnp.all(lora.active == 0)
    # a ~ U(-1/sqrt(in), 1/sqrt(in)), every layer and adapter its own.
    assert jnp.max(jnp.abs(lora.a)) <= 8**-0.5 and jnp.max(jnp.abs(lora.a)) > 0.2
    flat = lora.a.reshape(6, -1)
    assert len({tuple(np.asarray(r).round(6)) for r in flat}) == 6
    # The same key gives the same adapters whatever the mode.
    np.testing.assert_array_equal(lora.a, two.blocks.layers.w1.a)
    # Two weights of one shape get adapters of their own.
    w = jr.normal(getkey(), (4, 4))
    pair = adapters.add_lora(TwoDense(w, w), ["w", "v"], rank=2, key=key)
    assert not np.allclose(pair.w.a, pair.v.a)
    # b = 0: the adapted model starts as the base.
    x = jr.normal(getkey(), (2, 8))
    np.testing.assert_allclose(one(x), model(x), rtol=1e-6, atol=1e-6)


def test_add_lora_errors(getkey):
    model = eqxscan.StackedMLP(8, 2, key=getkey())
    with pytest.raises(
        ValueError, match=r"\['blocks.\*.w3'\] match no array.*blocks.\*.w1"
    ):
        adapters.add_lora(model, "blocks.*.w3", rank=2, key=getkey())
    with pytest.raises(ValueError, match=r"`blocks.\*.scale` has shape \(2, 8\)"):
        adapters.add_lora(model, "blocks.*.scale", rank=2, key=getkey())
    with pytest.raises(
        ValueError, match=r"rank=9 .* `blocks.\*.w1` \(8x32\).*at most 8"
    ):
        adapters.add_lora(model, "blocks.*.w1", rank=9, key=getkey())
    with pytest.raises(ValueError, match="add_lora: rank must be >= 1"):
        adapters.add_lora(model, "blocks.*.w1", rank=0, key=getkey())
    with pytest.raises(ValueError, match="Linear matches no module"):
        adapters.add_lora(model, eqx.nn.Linear, rank=2, key=getkey())
    with pytest.raises(TypeError, match="each target must be"):
        adapters.add_lora(model, [3], rank=2, key=getkey())
    with pytest.raises(TypeError, match="non-empty list"):
        adapters.add_lora(model, [], rank=2, key=getkey())
    # The model passed as targets (arguments swapped): shortened, not its repr.
    with pytest.raises(TypeError, match="targets must be .* got StackedMLP") as e:
        adapters.add_lora("blocks.*.w1", model, rank=2, key=getkey())
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError, match="num_adapters must be >= 1"):
        adapters.add_lora(model, "*.w1", rank=2, num_adapters=0, key=getkey())
    with pytest.raises(ValueError, match="orientation must be 'x@W' or 'W@x'"):
        adapters.add_lora(model, "*.w1", rank=2, orientation="xW", key=getkey())
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        adapters.add_lora(model, "*.w1", rank=2, dropout=1.0, key=getkey())
    # A module type whose weight is adapted already.
    stack = eqxscan.Stacked(lambda k: LinearBlock(4, key=k), 2, key=getkey())
    once = adapters.add_lora(stack, [eqx.nn.Linear], rank=2, key=getkey())
    with pytest.raises(ValueError, match=r"Linear at `.layers.linear` is adapted al"):
        adapters.add_lora(once, eqx.nn.Linear, rank=2, key=getkey())
    # ... or named twice in one call, by its type and by name.
    with pytest.raises(TypeError, match=r"holds a LoRA as its weight.*\n.*once"):
        adapters.add_lora(stack, ["*.weight", eqx.nn.Linear], rank=2, key=getkey())
    for alpha in (0.0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="alpha must be a positive finite"):
            adapters.add_lora(model, "*.w1", rank=2, alpha=alpha, key=getkey())
    with pytest.raises(TypeError, match="alpha must be a number, got '8'"):
        adapters.add_lora(model, "*.w1", rank=2, alpha="8", key=getkey())
    for bad in (None, 0, jr.split(getkey(), 2)):
        with pytest.raises(TypeError, match="add_lora needs `key` to be one JAX"):
            adapters.add_lora(model, "*.w1", rank=2, key=bad)
        with pytest.raises(TypeError, match="with_dropout_key needs `key` to be"):
            adapters.with_dropout_key(_mlp(getkey), bad)
    # A weight inside a LoRA (its base) is not adapted a second time.
    adapted = adapters.add_lora(model, "blocks.*.w1", rank=2, key=getkey())
    with pytest.raises(ValueError, match=r"`blocks.\*.w1.base` is inside the LoRA at"):
        adapters.add_lora(adapted, "blocks.*.w1.base", rank=2, key=getkey())
    # The same pattern again (a cell run twice) names the LoRA itself.
    with pytest.raises(ValueError, match=r"target `blocks.\*.w1` is adapted already"):
        adapters.add_lora(adapted, ["*.w2", "blocks.*.w1"], rank=2, key=getkey())
    counts = {"w": jnp.ones((4, 4)), "counts": jnp.ones((4, 4), jnp.int32)}
    with pytest.raises(TypeError, match=r"`counts` is int32\[4, 4\], but a LoRA"):
        adapters.add_lora(counts, "*", rank=2, key=getkey())


def test_several_adapters_in_one_batch(getkey):
    base = eqxscan.StackedMLP(8, 2, key=getkey())
    model = adapters.add_lora(
        base, ["*.w1", "*.w2"], rank=2, alpha=4.0, num_adapters=3, key=getkey()
    )
    model = _random_b(model, getkey())
    xs, ids = jr.normal(getkey(), (6, 8)), jnp.array([0, 2, -1, 1, 0, 2])

    @jax.jit
    def run(xs, ids, far):
        rows = jax.vmap(lambda x, i: adapters.select(model, i)(x))(xs, ids)
        alone = {k: adapters.select(model, k)(xs) for k in (0, 1, 2, -1)}
        by_hand = {k: _mlp_reference(model, xs, k) for k in (0, 1, 2, -1)}
        # The default after add_lora is adapter 0; a traced id out of range is
        # the base alone.
        return rows, alone, by_hand, model(xs), adapters.select(model, far)(xs)

    # Compared in NumPy: no program for each row selection.
    outs = jax.device_get((run(xs, ids, jnp.int32(7)), base(xs), ids))
    (rows, alone, by_hand, default, far), plain, ids = outs
    for k in (0, 1, 2, -1):
        _assert_close(rows[ids == k], alone[k][ids == k])
        _assert_close(rows[ids == k], by_hand[k][ids == k])
    _assert_close(rows[ids == -1], plain[ids == -1])
    _assert_close((default, far), (alone[0], plain))


def test_select_errors(getkey):
    model = _mlp(getkey, k=2)
    with pytest.raises(ValueError, match=r"adapter 2 does not exist.*`blocks.\*.w1`"):
        adapters.select(model, 2)
    with pytest.raises(ValueError, match=r"must be in \[-1, 2\)"):
        adapters.select(model, -2)
    with pytest.raises(TypeError, match=r"ids must be an int.*float32\[3\]"):
        adapters.select(model, jnp.zeros(3))
    # A float id was truncated to an adapter, a one-element vector read as its id:
    # both are refused as the vector above is.
    for bad in (jnp.float32(1.0), jnp.array([1])):
        with pytest.raises(TypeError, match=r"ids must be an int or an integer scalar"):
            adapters.select(model, bad)
    with pytest.raises(ValueError, match="holds no LoRA"):
        adapters.select(eqxscan.StackedMLP(8, 2, key=getkey()), 0)
    with pytest.raises(ValueError, match="trainable: the model holds no LoRA"):
        adapters.trainable(eqxscan.StackedMLP(8, 2, key=getkey()))


def test_dropout_on_the_adapter_input(getkey):
    model = eqxscan.StackedMLP(8, 2, key=getkey())
    model = adapters.add_lora(
        model, ["*.w1", "*.w2"], rank=2, alpha=4.0, dropout=0.25, key=getkey()
    )
    model = _random_b(model, getkey())
    x = jr.normal(getkey(), (2, 8))
    with pytest.raises(ValueError, match=r"LoRA at `blocks.\*.w1` has dropout=0.25"):
        model(x)
    keyed = adapters.with_dropout_key(model, getkey())
    w1, w2 = keyed.blocks.layers.w1, keyed.blocks.layers.w2
    data = jax.random.key_data
    # Each layer and each weight its own key.
    assert len({tuple(np.asarray(data(k)).ravel()) for k in [*w1.key, *w2.key]}) == 4

    def dropped(w, h, i):
        keep = jr.bernoulli(w.key[i], 0.75, h.shape)  # drops a quarter
        lo = _at(w, i)
        return h @ lo.base + S * (jnp.where(keep, h / 0.75, 0.0) @ lo.a[0]) @ lo.b[0]

    def reference(m, x):
        layers = m.blocks.layers
        for i in range(2):
            h = jax.nn.gelu(dropped(layers.w1, rms_norm(layers.scale[i], x), i))
            x = x + dropped(layers.w2, h, i)
        return x

    loop = keyed.with_options(mode="loop")
    expected, *got = _losses_and_grads(
        x, (reference, keyed), (_call, keyed), (_call, loop)
    )
    for g in got:
        _assert_close(g, expected)
    # Off in inference mode, with or without keys.
    off = jax.jit(lambda x: [eqx.nn.inference_mode(m)(x) for m in (model, keyed)])
    _assert_close(off(x), [eqx.filter_jit(_mlp_reference)(model, x)] * 2)


def test_taps_report_each_adapted_layer(getkey):
    model = _mlp(getkey)
    x = jr.normal(getkey(), (2, 8))
    y, rms = eqxscan.tap(model.blocks, eqxscan.stats.rms)(x)
    expected, h = [], x
    layers = model.blocks.layers
    for i in range(model.num_layers):
        g = jax.nn.gelu(_adapt(_at(layers.w1, i), rms_norm(layers.scale[i], h)))
        h = h + _adapt(_at(layers.w2, i), g)
        expected.append(jnp.sqrt(jnp.mean(h**2)))
    _assert_close((y, rms), (h, jnp.stack(expected)))


def test_llama_example(getkey):
    # examples/llama.py's decoder: adapted attention and MLP projections give
    # the logits of the same model with the adapters merged into its weights.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "llama.py"
    spec = importlib.util.spec_from_file_location("llama_for_adapters", path)
    llama = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama)
    config = llama.Config(vocab=32, dim=16, hidden=24, layers=2, heads=2, kv_heads=1)
    model = llama.Llama(config, key=getkey())
    adapted = adapters.add_lora(
        model, ["blocks.*.wqkv", "blocks.*.w13", "blocks.*.w2"], rank=2, key=getkey()
    )
    adapted = _random_b(adapted, getkey())
    assert _is_lora(adapted.blocks.layers.wqkv) and not _is_lora(adapted.lm_head)
    tokens = jnp.arange(5) % 32
    # One program: the adapted logits and the merged model's.
    both = eqx.filter_jit(lambda m: (m(tokens), adapters.merge(m)(tokens)))
    _assert_close(*both(adapted), tol=1e-4)


def test_the_adapters_alone_are_saved_and_loaded(getkey, tmp_path):
    # eqxscan.save of the trainable part only, loaded into another adapted
    # model's trainable part: the adapters come back, the rest is the new model's.
    model = _mlp(getkey, k=2)
    spec = adapters.trainable(model)
    eqxscan.save(tmp_path / "adapters.safetensors", eqx.filter(model, spec))
    fresh = _mlp(getkey, k=2)
    like = eqx.filter(fresh, adapters.trainable(fresh))
    loaded = eqxscan.load(tmp_path / "adapters.safetensors", like)
    assert eqx.tree_equal(loaded, eqx.filter(model, spec))


def test_an_optimiser_over_every_array_moves_only_the_adapters(getkey):
    # trainable as optax labels (its docstring's recipe), with the gradient of
    # every float array of the model: the base and scales stay as they were.
    model = _mlp(getkey)
    x = jr.normal(getkey(), (2, 8))
    params = eqx.filter(model, eqx.is_inexact_array)
    tx = optax.multi_transform(
        {True: optax.sgd(0.1), False: optax.set_to_zero()}, adapters.trainable
    )
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    updates, _ = tx.update(grads, tx.init(params), params)
    trained = eqx.apply_updates(model, updates)
    spec = adapters.trainable(model)
    assert eqx.tree_equal(
        eqx.filter(trained, spec, inverse=True), eqx.filter(model, spec, inverse=True)
    )
    layers = trained.blocks.layers
    _assert_close(
        (layers.w1.b, layers.w2.b),
        (
            model.blocks.layers.w1.b - 0.1 * grads.blocks.layers.w1.b,
            model.blocks.layers.w2.b - 0.1 * grads.blocks.layers.w2.b,
        ),
    )


def test_layerwise_optimiser_trains_only_the_adapters(getkey):
    # eqxscan.optim.layerwise(LAMB) on an adapted StackedMLP: every layer's
    # adapters get their own trust ratio, as optax.lamb run on each layer's
    # adapters apart does (one shared ratio per stacked array would differ).
    model = _mlp(getkey, k=2)
    x = jr.normal(getkey(), (4, 8))
    lamb = optax.lamb(0.05, weight_decay=0.1)
    tx = eqxscan.optim.layerwise(lamb)
    params, static = eqx.partition(model, adapters.trainable(model))
    loss = lambda p: jnp.sum(jnp.sin(eqx.combine(p, static)(x)))  # noqa: E731

    def adapters_of(m):
        return [
            getattr(w, f)
            for w in (m.blocks.layers.w1, m.blocks.layers.w2)
            for f in ("a", "b")
        ]

    def by_layer(m):
        # Each layer's adapters apart, and the hand-written model's loss.
        layers = [[f[i] for f in adapters_of(m)] for i in range(m.num_layers)]

        def hand_loss(layers):
            stacked = [jnp.stack(f) for f in zip(*layers, strict=True)]
            return jnp.sum(
                jnp.sin(_mlp_reference(eqx.tree_at(adapters_of, m, stacked), x))
            )

        return layers, hand_loss

    @jax.jit
    def both(params):
        state = tx.init(params)
        layers, hand_loss = by_layer(eqx.combine(params, static))
        states = [lamb.init(p) for p in layers]
        for _ in range(2):
            updates, state = tx.update(jax.grad(loss)(params), state, params)
            params = eqx.apply_updates(params, updates)
            grads = jax.grad(hand_loss)(layers)
            for i, (g, p) in enumerate(zip(grads, layers, strict=True)):
                u, states[i] = lamb.update(g, states[i], p)
                layers[i] = optax.apply_updates(p, u)
        return params, state, layers

    with jax.numpy_dtype_promotion("standard"):  # optax's int32 step count
        new, state, layers = both(params)
    trained = eqx.combine(new, static)
    for i, expected in enumerate(layers):
        _assert_close([f[i] for f in adapters_of(trained)], expected)
    # Only the adapters moved and have optimiser state: the base weights and
    # norm scales are the model's own, and Adam's moments are the adapters' size.
    assert eqx.tree_equal(
        eqx.filter(trained, adapters.trainable(model), inverse=True),
        eqx.filter(model, adapters.trainable(model), inverse=True),
    )
    assert not eqx.tree_equal(adapters_of(trained), adapters_of(model))
    adapter_bytes = sum(a.nbytes for a in adapters_of(model))
    moments = [a for a in jax.tree.leaves(state) if a.ndim >= 3]
    assert sum(a.nbytes for a in moments) == 2 * adapter_bytes


def test_the_base_is_frozen(getkey):
    # The model differentiated whole (Equinox's usual loop): a LoRA's base, also
    # a quantized one's scales, gets an exactly zero gradient, the adapters
    # their gradient as with the documented partition, and Adam over every
    # float array leaves the base as it was.
    model = eqxscan.StackedMLP(8, 2, key=getkey())
    model = eqxscan.quant.quantize(model, "blocks.*.w1")
    model = adapters.add_lora(
        model, ["blocks.*.w1", "*.w2"], rank=2, alpha=4.0, key=getkey()
    )
    model = _random_b(model, getkey())
    x = jr.normal(getkey(), (2, 8))
    tx = optax.adam(0.1)
    params, static = eqx.partition(model, adapters.trainable(model))

    @eqx.filter_jit
    def run(model, params):
        whole = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        parted = jax.grad(lambda p: jnp.sum(eqx.combine(p, static)(x) ** 2))(params)
        floats = eqx.filter(model, eqx.is_inexact_array)
        updates, _ = tx.update(whole, tx.init(floats), floats)
        return whole, parted, eqx.apply_updates(model, updates)

    with jax.numpy_dtype_promotion("standard"):  # optax's int32 step count
        whole, parted, trained = run(model, params)
    w1, w2 = whole.blocks.layers.w1, whole.blocks.layers.w2
    for base in (w1.base.scales, w2.base):
        assert base.shape[0] == 2 and not np.any(base)
    _assert_close(eqx.filter(whole, adapters.trainable(model)), parted)
    assert np.any(parted.blocks.layers.w1.a) and np.any(parted.blocks.layers.w2.b)
    for lora, new in zip(
        (model.blocks.layers.w1, model.blocks.layers.w2),
        (trained.blocks.layers.w1, trained.blocks.layers.w2),
    ):
        assert eqx.tree_equal(new.base, lora.base)
        assert not np.allclose(new.b, lora.b)


@pytest.mark.parametrize("container", ["Stacked", "Chain"])
def test_the_equinox_training_loop_trains_the_adapters(getkey, container):
    # Equinox's usual loop (Adam over `eqx.filter(model, eqx.is_array)`, the
    # gradient of the whole model) on a model whose every weight is adapted:
    # the adapters the documented partition route gives, the bases as they were.
    if container == "Stacked":
        model = eqxscan.Stacked(lambda k: Dense(jr.normal(k, (4, 4))), 3, key=getkey())
        targets = "*.w"
    else:  # a stacked group and a lone layer
        layers = [Dense(jr.normal(getkey(), (4, 4))) for _ in range(2)]
        layers += [TwoDense(jr.normal(getkey(), (4, 3)), jr.normal(getkey(), (3, 4)))]
        model, targets = eqxscan.Chain(layers), ["*.w", "*.v"]
    model = adapters.add_lora(model, targets, rank=2, num_adapters=2, key=getkey())
    model = adapters.select(_random_b(model, getkey()), 1)
    x = jr.normal(getkey(), (3, 4))
    tx = optax.adam(1e-2)
    loss = lambda m: jnp.sum(m(x) ** 2)  # noqa: E731

    @eqx.filter_jit
    def step(model, state):
        grads = eqx.filter_grad(loss)(model)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    spec = adapters.trainable(model)
    params, static = eqx.partition(model, spec)

    @jax.jit
    def reference(params):
        state = tx.init(params)
        for _ in range(2):
            grads = jax.grad(lambda p: loss(eqx.combine(p, static)))(params)
            updates, state = tx.update(grads, state)
            params = eqx.apply_updates(params, updates)
        return params

    with jax.numpy_dtype_promotion("standard"):  # optax's int32 step count
        trained, state = model, tx.init(eqx.filter(model, eqx.is_array))
        for _ in range(2):
            trained, state = step(trained, state)
        expected = reference(params)
    _assert_close(eqx.filter(trained, spec), expected)
    assert not eqx.tree_equal(eqx.filter(trained, spec), params)
    assert eqx.tree_equal(
        eqx.filter(trained, spec, inverse=True), eqx.filter(model, spec, inverse=True)
    )
