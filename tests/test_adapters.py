"""LoRA adapters: the product from the stored base and adapters, against
hand-written references."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqxscan.adapters import LoRA


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


def test_base_alone_ignores_a_non_finite_adapter(getkey):
    lora = _lora(getkey, active=-1)
    lora = eqx.tree_at(lambda lo: lo.a, lora, lora.a.at[0].set(jnp.nan))
    x = jr.normal(getkey(), (6,))
    np.testing.assert_allclose(x @ lora, x @ lora.base, rtol=1e-6)


def test_base_alone_gives_adapters_no_gradient(getkey):
    lora = _lora(getkey, active=-1)
    x = jr.normal(getkey(), (6,))
    grads = eqx.filter_grad(lambda lo: jnp.sum(x @ lo))(lora)
    assert not jnp.any(grads.a) and not jnp.any(grads.b) and jnp.all(grads.base)


def test_a_traced_active_selects_per_row(getkey):
    lora = _lora(getkey)
    xs, ids = jr.normal(getkey(), (4, 6)), jnp.array([0, 2, -1, 1])
    rows = jax.vmap(lambda x, i: x @ eqx.tree_at(lambda lo: lo.active, lora, i))
    expected = [
        x @ lora.base + (2.0 * (x @ lora.a[i]) @ lora.b[i] if i >= 0 else 0)
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
    ):
        with pytest.raises(TypeError, match=r"The LoRA at `w`.*\n.*merge"):
            op()
    # jax.numpy functions refuse it as an operand (never silently use the base).
    for op in (jnp.matmul, jnp.dot, lambda x, w: jnp.einsum("bi,io->bo", x, w)):
        with pytest.raises(TypeError, match="requires ndarray or scalar"):
            op(x, lora)


def test_wrong_use_raises(getkey):
    lora = _lora(getkey)
    with pytest.raises(TypeError, match=r"'x@W' but was used as `lora @ x`"):
        lora @ jnp.ones(5)
    with pytest.raises(TypeError, match=r"got x of shape \(2, 5\).*size 6"):
        jnp.ones((2, 5)) @ lora
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), lora)
    with pytest.raises(TypeError, match=r"base float32\[2,6,5\] with 1 layer axes"):
        jnp.ones(6) @ stacked


# Models adapted by add_lora, against hand-written LoRA loops over their layers.

import optax  # noqa: E402

import eqxscan  # noqa: E402
from eqxscan import adapters, sharding  # noqa: E402
from eqxscan.nn import rms_norm  # noqa: E402


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
    model = eqxscan.StackedMLP(8, 3, key=getkey(), **options)
    model = adapters.add_lora(
        model, ["blocks.*.w1", "*.w2"], rank=2, alpha=4.0, num_adapters=k, key=getkey()
    )
    return _random_b(model, getkey())


def _loss_and_adapter_grads(fn, model, x):
    params, static = eqx.partition(model, adapters.trainable(model))
    loss = lambda p: jnp.sum(fn(eqx.combine(p, static), x) ** 2)  # noqa: E731
    return eqx.filter_jit(jax.value_and_grad(loss))(params)


def _assert_close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def test_stacked_mlp_equals_a_hand_written_lora_loop(getkey):
    model = _mlp(getkey)
    x = jr.normal(getkey(), (2, 8))
    expected = _loss_and_adapter_grads(_mlp_reference, model, x)
    loop = model.with_options(mode="loop")
    _assert_close(_loss_and_adapter_grads(lambda m, x: m(x), loop, x), expected)
    policy = jax.checkpoint_policies.dots_saveable
    for remat in (False, True, "auto", "nested", policy):
        scanned = model.with_options(remat=remat)
        got = _loss_and_adapter_grads(lambda m, x: m(x), scanned, x)
        _assert_close(got, expected)
    # Only the adapters have gradients.
    grads = got[1].blocks.layers
    assert grads.w1.base is None and grads.scale is None
    assert grads.w1.a.shape == (3, 1, 8, 2) and jnp.all(grads.w2.b != 0)


def test_drop_path_scan_equals_loop(getkey):
    model = _mlp(getkey, drop_path=0.5)
    x, key = jr.normal(getkey(), (4, 8)), getkey()
    run = lambda m, x: m(x, key=key)  # noqa: E731
    loop = model.with_options(mode="loop")
    _assert_close(
        _loss_and_adapter_grads(run, model, x), _loss_and_adapter_grads(run, loop, x)
    )


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

    def reference(stack, x):
        w, bias = stack.layers.linear.weight, stack.layers.linear.bias
        for i in range(3):
            base, a, b = w.base[i], w.a[i, 0], w.b[i, 0]
            x = x + jnp.tanh(base @ x + S * b @ (a @ x) + bias[i])
        return x

    x = jr.normal(getkey(), (6,))
    expected = _loss_and_adapter_grads(reference, stack, x)
    for s in (stack, stack.with_options(mode="loop", remat=True)):
        _assert_close(_loss_and_adapter_grads(lambda m, x: m(x), s, x), expected)


class Dense(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w)


class TwoDense(eqx.Module):
    w: jax.Array
    v: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w) @ self.v


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
    expected = _loss_and_adapter_grads(reference, chain, x)
    _assert_close(_loss_and_adapter_grads(lambda m, x: m(x), chain, x), expected)


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
    # b = 0: the adapted model starts as the base.
    x = jr.normal(getkey(), (2, 8))
    np.testing.assert_allclose(one(x), model(x), rtol=1e-6, atol=1e-6)


def test_optimiser_state_is_twice_the_adapters(getkey):
    model = _mlp(getkey, k=3)
    params = eqx.filter(model, adapters.trainable(model))
    state = optax.adam(1e-3).init(params)
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t) if eqx.is_array(x))  # noqa: E731
    loras = [x for x in jax.tree.leaves(model, is_leaf=_is_lora) if _is_lora(x)]
    adapter_bytes = sum(lo.a.nbytes + lo.b.nbytes for lo in loras)
    count = 4  # Adam's int32 step count
    assert nbytes(state) == 2 * adapter_bytes + count
    assert nbytes(params) == adapter_bytes


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
    with pytest.raises(ValueError, match="rank must be >= 1"):
        adapters.add_lora(model, "blocks.*.w1", rank=0, key=getkey())
    with pytest.raises(ValueError, match="Linear matches no module"):
        adapters.add_lora(model, eqx.nn.Linear, rank=2, key=getkey())
    with pytest.raises(TypeError, match="each target must be"):
        adapters.add_lora(model, [3], rank=2, key=getkey())
    with pytest.raises(TypeError, match="non-empty list"):
        adapters.add_lora(model, [], rank=2, key=getkey())
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        adapters.add_lora(model, "*.w1", rank=2, dropout=1.0, key=getkey())


def test_several_adapters_in_one_batch(getkey):
    base = eqxscan.StackedMLP(8, 3, key=getkey())
    model = adapters.add_lora(
        base, ["*.w1", "*.w2"], rank=2, alpha=4.0, num_adapters=3, key=getkey()
    )
    model = _random_b(model, getkey())
    xs, ids = jr.normal(getkey(), (6, 8)), jnp.array([0, 2, -1, 1, 0, 2])
    rows = jax.jit(jax.vmap(lambda x, i: adapters.select(model, i)(x)))(xs, ids)
    for k in (0, 1, 2, -1):
        mine = ids == k
        alone = adapters.select(model, k)(xs[mine])
        np.testing.assert_allclose(rows[mine], alone, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            rows[mine], _mlp_reference(model, xs[mine], k), rtol=1e-5, atol=1e-5
        )
    np.testing.assert_allclose(rows[ids == -1], base(xs[ids == -1]), rtol=1e-6)
    # The default after add_lora is adapter 0; a traced id out of range is the
    # base alone.
    np.testing.assert_allclose(model(xs), adapters.select(model, 0)(xs), rtol=1e-6)
    far = jax.jit(lambda x, i: adapters.select(model, i)(x))(xs, jnp.int32(7))
    np.testing.assert_allclose(far, base(xs), rtol=1e-5, atol=1e-5)


def test_select_errors(getkey):
    model = _mlp(getkey, k=2)
    with pytest.raises(ValueError, match=r"adapter 2 does not exist.*`blocks.\*.w1`"):
        adapters.select(model, 2)
    with pytest.raises(ValueError, match=r"must be in \[-1, 2\)"):
        adapters.select(model, -2)
    with pytest.raises(TypeError, match=r"ids must be an int.*float32\[3\]"):
        adapters.select(model, jnp.zeros(3))
    with pytest.raises(ValueError, match="holds no LoRA"):
        adapters.select(eqxscan.StackedMLP(8, 2, key=getkey()), 0)


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x))


class _FormsTheSum(adapters.LoRA):
    """The product as it must not be computed: `x @ (base + delta)`."""

    def __rmatmul__(self, x):
        k = jnp.maximum(self.active, 0)
        return x @ (self.base + self.scaling * self.a[k] @ self.b[k])


def _train_step_temp(model, spec, x):
    params, static = eqx.partition(model, spec)
    loss = lambda p: jnp.sum(eqx.combine(p, static)(x) ** 2)  # noqa: E731
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_base_is_not_copied(getkey):
    d, num_layers, k, r, batch = 64, 4, 3, 4, 2
    base = eqxscan.StackedMLP(d, num_layers, key=getkey())
    model = adapters.add_lora(
        base, ["*.w1", "*.w2"], rank=r, num_adapters=k, key=getkey()
    )
    # Arrays: the base's, K adapters per weight and layer, and the ids.
    one_adapter = num_layers * (d * r + r * 4 * d) * 4 * 2  # w1 and w2, f32
    ids = 2 * num_layers * 4
    assert _nbytes(model) == _nbytes(base) + k * one_adapter + ids
    # A train step's temporaries: the unadapted step's plus at most one layer's
    # adapters and activations.
    x = jnp.ones((batch, d))
    plain = _train_step_temp(base, eqx.is_inexact_array, x)
    adapted = _train_step_temp(model, adapters.trainable(model), x)
    bound = k * one_adapter // num_layers + batch * 5 * d * 4
    assert adapted <= plain + bound
    # Forming `base + delta` in the layer keeps a merged weight per layer.
    summed = jax.tree.map(
        lambda n: (
            _FormsTheSum(n.base, n.a, n.b, n.active, n.alpha, n.rank, n.orientation)
            if _is_lora(n)
            else n
        ),
        model,
        is_leaf=_is_lora,
    )
    assert _train_step_temp(summed, adapters.trainable(summed), x) > plain + bound


def test_merge_and_unmerge(getkey):
    model = _mlp(getkey, k=3)
    x = jr.normal(getkey(), (2, 8))
    for k in (2, -1):
        merged = adapters.merge(model, k)
        w1 = merged.blocks.layers.w1
        assert isinstance(w1, jax.Array) and w1.shape == (3, 8, 32)
        lo = model.blocks.layers.w1
        if k >= 0:
            delta = S * jnp.einsum("lir,lro->lio", lo.a[:, k], lo.b[:, k])
        else:
            delta = 0.0
        np.testing.assert_allclose(w1, lo.base + delta, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            merged(x), adapters.select(model, k)(x), rtol=1e-5, atol=1e-5
        )
        back = adapters.unmerge(merged, model, k)
        assert jax.tree.structure(back) == jax.tree.structure(model)
        np.testing.assert_allclose(back.blocks.layers.w1.base, lo.base, atol=1e-6)
        np.testing.assert_allclose(back(x), model(x), rtol=1e-5, atol=1e-5)
    # W@x (eqx.nn.Linear): delta = b @ a.
    stack = eqxscan.Stacked(lambda k: LinearBlock(6, key=k), 2, key=getkey())
    stack = _random_b(
        adapters.add_lora(stack, eqx.nn.Linear, rank=2, key=getkey()), getkey()
    )
    lo = stack.layers.linear.weight
    np.testing.assert_allclose(
        adapters.merge(stack).layers.linear.weight,
        lo.base + jnp.einsum("lor,lri->loi", lo.b[:, 0], lo.a[:, 0]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_merge_runs_layer_by_layer(getkey):
    d, num_layers = 64, 8
    model = adapters.add_lora(
        eqxscan.StackedMLP(d, num_layers, key=getkey()), "*.w1", rank=4, key=getkey()
    )
    lo = model.blocks.layers.w1
    layer = d * 4 * d * 4
    args = (lo.base, lo.a, lo.b)
    static = dict(adapter=0, scale=lo.scaling, orientation="x@W")
    for fn in (adapters._merge._jitted, adapters._merge._donating):
        memory = fn.lower(*args, **static).compile().memory_analysis()
        # One layer's delta at a time, not the stack's (8 layers).
        assert memory.temp_size_in_bytes <= layer + _nbytes((lo.a, lo.b))
    # Donating: the merged weights are written over the base.
    assert memory.alias_size_in_bytes == lo.base.nbytes
    base = jnp.array(lo.base)
    merged = adapters.merge(
        eqx.tree_at(lambda m: m.blocks.layers.w1.base, model, base), donate=True
    )
    assert base.is_deleted() and merged.blocks.layers.w1.shape == lo.base.shape


def test_merge_errors(getkey):
    model = _mlp(getkey, k=2)
    with pytest.raises(ValueError, match=r"merge: adapter 2 does not exist.*`blocks"):
        adapters.merge(model, 2)
    with pytest.raises(TypeError, match="adapter must be an int"):
        adapters.merge(model, 0.5)
    other = eqxscan.StackedMLP(8, 2, key=getkey())
    with pytest.raises((ValueError, TypeError)):
        adapters.unmerge(other, model)
    wrong = eqx.tree_at(
        lambda m: m.blocks.layers.w1, adapters.merge(model), jnp.zeros((3, 8, 8))
    )
    with pytest.raises(
        ValueError, match=r"unmerge: at the LoRA `blocks.\*.w1`.*float32\[3,8,8\]"
    ):
        adapters.unmerge(wrong, model)


def test_dropout_on_the_adapter_input(getkey):
    model = eqxscan.StackedMLP(8, 3, key=getkey())
    model = adapters.add_lora(
        model, ["*.w1", "*.w2"], rank=2, alpha=4.0, dropout=0.5, key=getkey()
    )
    model = _random_b(model, getkey())
    x = jr.normal(getkey(), (2, 8))
    with pytest.raises(ValueError, match=r"LoRA at `blocks.\*.w1` has dropout=0.5"):
        model(x)
    keyed = adapters.with_dropout_key(model, getkey())
    w1, w2 = keyed.blocks.layers.w1, keyed.blocks.layers.w2
    data = jax.random.key_data
    # Each layer and each weight its own key.
    assert len({tuple(np.asarray(data(k)).ravel()) for k in [*w1.key, *w2.key]}) == 6

    def dropped(w, h, i):
        keep = jr.bernoulli(w.key[i], 0.5, h.shape)
        lo = _at(w, i)
        return h @ lo.base + S * (jnp.where(keep, h / 0.5, 0.0) @ lo.a[0]) @ lo.b[0]

    def reference(m, x):
        layers = m.blocks.layers
        for i in range(3):
            h = jax.nn.gelu(dropped(layers.w1, rms_norm(layers.scale[i], x), i))
            x = x + dropped(layers.w2, h, i)
        return x

    expected = _loss_and_adapter_grads(reference, keyed, x)
    for m in (keyed, keyed.with_options(mode="loop")):
        _assert_close(_loss_and_adapter_grads(lambda m, x: m(x), m, x), expected)
    # Off in inference mode, with or without keys.
    for m in (model, keyed):
        off = eqx.nn.inference_mode(m)
        _assert_close(off(x), _mlp_reference(model, x))


def test_taps_report_each_adapted_layer(getkey):
    model = _mlp(getkey)
    x = jr.normal(getkey(), (2, 8))
    y, rms = eqxscan.tap(model.blocks, eqxscan.stats.rms)(x)
    expected, h = [], x
    layers = model.blocks.layers
    for i in range(3):
        g = jax.nn.gelu(_adapt(_at(layers.w1, i), rms_norm(layers.scale[i], h)))
        h = h + _adapt(_at(layers.w2, i), g)
        expected.append(jnp.sqrt(jnp.mean(h**2)))
    _assert_close((y, rms), (h, jnp.stack(expected)))


def test_fsdp_base_with_replicated_adapters(getkey):
    # The test process has two devices: the bases sharded over both, the
    # adapters (below min_size) replicated.
    model = _mlp(getkey)
    x = jr.normal(getkey(), (4, 8))
    mesh = sharding.make_mesh(fsdp=2)
    placed, _, batch = sharding.shard(model, None, x, mesh=mesh, min_size=256)
    w1 = placed.blocks.layers.w1
    assert not w1.base.sharding.is_fully_replicated
    assert w1.a.sharding.is_fully_replicated and w1.b.sharding.is_fully_replicated
    _assert_close(
        _loss_and_adapter_grads(lambda m, x: m(x), placed, batch),
        _loss_and_adapter_grads(lambda m, x: m(x), model, x),
    )


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
    logits = eqx.filter_jit(lambda m: m(tokens))
    _assert_close(logits(adapted), logits(adapters.merge(adapted)), tol=1e-4)
    assert not np.allclose(logits(adapted), logits(model), atol=1e-3)
