"""eqxscan.optim: layer-axis-aware weight decay and layer freezing, against
hand-written references."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxscan


class Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(6, 6, key=key)
        self.norm = eqx.nn.LayerNorm(6)

    def __call__(self, x):
        return self.norm(jnp.tanh(self.linear(x)))


def _stack(key, n=4):
    return eqxscan.Stacked(Block, n, key=key)


def test_weight_decay_mask_matches_unstacked_rule(getkey):
    stack = _stack(getkey())
    mask = eqxscan.optim.weight_decay_mask(eqx.filter(stack, eqx.is_array))
    # The rule as written for one layer kept on its own.
    expected = jax.tree.map(lambda a: a.ndim >= 2, stack[0])
    assert jax.tree.leaves(mask.layers) == jax.tree.leaves(expected)
    assert mask.layers.linear.weight is True
    assert mask.layers.linear.bias is False
    assert mask.layers.norm.weight is False


def test_weight_decay_mask_nested_and_models(getkey):
    # A Chain's periodic group nests a Stacked inside a Stacked: two layer axes.
    k = iter(jax.random.split(getkey(), 8))
    layers = [
        Block(next(k)) if i % 3 < 2 else eqx.nn.Linear(6, 6, key=next(k))
        for i in range(6)
    ]
    chain = eqxscan.Chain(layers)  # 2 repeats of [Block, Block, Linear]
    assert len(chain.groups) == 1
    mask = eqxscan.optim.weight_decay_mask(chain)
    decayed = {
        (path, a.shape)
        for (path, a), m in zip(
            jax.tree_util.tree_leaves_with_path(chain), jax.tree.leaves(mask)
        )
        if m
    }
    # Exactly the weight matrices: [repeat, run, 6, 6] and [repeat, 6, 6].
    assert sorted(shape for _, shape in decayed) == [(2, 2, 6, 6), (2, 6, 6)]
    mlp = eqxscan.StackedMLP(8, 3, key=getkey())
    mask = eqxscan.optim.weight_decay_mask(mlp)
    assert mask.blocks.layers.w1 and mask.blocks.layers.w2
    assert not mask.blocks.layers.scale


def test_weight_decay_mask_in_adamw(getkey):
    stack = _stack(getkey())
    params = eqx.filter(stack, eqx.is_inexact_array)
    zeros = jax.tree.map(jnp.zeros_like, params)
    opt = optax.adamw(0.1, weight_decay=0.5, mask=eqxscan.optim.weight_decay_mask)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        updates, _ = opt.update(zeros, opt.init(params), params)
    new = eqx.apply_updates(stack, updates)
    # Zero gradients: only weight decay moves anything, and only the matrices.
    expected = stack.layers.linear.weight * 0.95
    np.testing.assert_allclose(new.layers.linear.weight, expected, rtol=1e-6)
    assert (new.layers.linear.bias == stack.layers.linear.bias).all()
    assert (new.layers.norm.weight == stack.layers.norm.weight).all()


def _adamw_reference(params, grads, mu, nu, t, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    """AdamW written out (optax's formulation: decay added after the Adam step)."""
    mu = b1 * mu + (1 - b1) * grads
    nu = b2 * nu + (1 - b2) * grads**2
    mu_hat = mu / (1 - b1**t)
    nu_hat = nu / (1 - b2**t)
    step = mu_hat / (np.sqrt(nu_hat) + eps) + wd * params
    return params - lr * step, mu, nu


def _loss(model, x):
    return jnp.sum(jax.vmap(model)(x) ** 2)


@pytest.mark.parametrize("clip", [False, True])
def test_freeze_layers_adamw(getkey, clip):
    n, frozen, steps, lr, wd = 5, (1, 2), 4, 0.05, 0.1
    stack = _stack(getkey(), n)
    x = jax.random.normal(getkey(), (3, 6))
    inner = optax.adamw(lr, weight_decay=wd)
    if clip:  # a global-norm clip must see only the trained layers
        inner = optax.chain(optax.clip_by_global_norm(0.05), inner)
    opt = eqxscan.optim.freeze_layers(inner, slice(1, 3))

    @eqx.filter_jit
    def train_step(model, state):
        grads = eqx.filter_grad(_loss)(model, x)
        params = eqx.filter(model, eqx.is_inexact_array)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
            updates, state = opt.update(grads, state, params)
        return eqx.apply_updates(model, updates), state, grads

    model, state = stack, opt.init(eqx.filter(stack, eqx.is_inexact_array))
    trained = [i for i in range(n) if i not in frozen]
    ref = [np.asarray(a, np.float64) for a in jax.tree.leaves(stack)]
    ref = [a[trained] for a in ref]
    mu = [np.zeros_like(a) for a in ref]
    nu = [np.zeros_like(a) for a in ref]
    for t in range(1, steps + 1):
        model, state, grads = train_step(model, state)
        g = [np.asarray(a, np.float64)[trained] for a in jax.tree.leaves(grads)]
        if clip:
            norm = np.sqrt(sum(np.sum(a**2) for a in g))
            g = [a * min(1.0, 0.05 / norm) for a in g]
        new = [_adamw_reference(*s, t, lr, wd) for s in zip(ref, g, mu, nu)]
        ref, mu, nu = map(list, zip(*new))
    for before, after, r in zip(jax.tree.leaves(stack), jax.tree.leaves(model), ref):
        before, after = np.asarray(before), np.asarray(after)
        for i in frozen:  # bit for bit
            assert before[i].tobytes() == after[i].tobytes()
        np.testing.assert_allclose(after[trained], r, rtol=2e-5, atol=2e-6)
        assert not np.allclose(after[trained], before[trained])


def test_freeze_layers_keeps_signed_zeros(getkey):
    stack = _stack(getkey(), 3)
    stack = eqx.tree_at(lambda s: s.layers.linear.bias, stack, -jnp.zeros((3, 6)))
    opt = eqxscan.optim.freeze_layers(optax.adamw(0.1, weight_decay=0.5), [0, -1])
    params = eqx.filter(stack, eqx.is_inexact_array)
    grads = jax.tree.map(jnp.ones_like, params)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        updates, _ = opt.update(grads, opt.init(params), params)
    new = eqx.apply_updates(stack, updates)
    bias = np.asarray(new.layers.linear.bias)
    assert np.signbit(bias[[0, 2]]).all()
    assert (bias[1] < 0).all()  # trained: moved by the gradient


def test_freeze_layers_where_and_errors(getkey):
    class Two(eqx.Module):
        a: eqxscan.Stacked
        b: eqxscan.Stacked

    model = Two(_stack(getkey(), 2), _stack(getkey(), 3))
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), 0)
    with pytest.raises(ValueError, match="found 2 Stacked.*where="):
        opt.update(grads, opt.init(params), params)
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), 0, where=lambda m: m.b)
    updates, _ = opt.update(grads, opt.init(params), params)
    assert (updates.b.layers.linear.weight[0] == 0).all()
    assert (updates.b.layers.linear.weight[1:] == -1).all()
    assert (updates.a.layers.linear.weight == -1).all()
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), 2, where=lambda m: (m.a, m.b))
    with pytest.raises(IndexError, match="Layer index 2 is out of range.*2 layers"):
        opt.update(grads, opt.init(params), params)
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), 0, where=lambda m: m.a.layers)
    with pytest.raises(TypeError, match="not an eqxscan.Stacked"):
        opt.update(grads, opt.init(params), params)
    # A batch of stacks (an ensemble) outside a vmap is named, not broadcast.
    keys = jax.random.split(getkey(), 3)
    ensemble = eqx.filter_vmap(lambda k: _stack(k, 2))(keys)
    params = eqx.filter(ensemble, eqx.is_inexact_array)
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), 0)
    with pytest.raises(ValueError, match="first axis is not the layer axis"):
        opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
    # So by the other tools that read the layer axis: they reshaped it into the
    # layers (a TypeError), or decayed biases and gave Muon no matrix.
    grads = jax.tree.map(jnp.ones_like, params)
    scale = eqxscan.optim.layerwise_scale(lambda i: i + 1.0)
    for who, call in [
        ("layer_norms", lambda: eqxscan.optim.layer_norms(ensemble)),
        ("layerwise_scale", lambda: scale.update(grads, scale.init(params))),
        ("weight_decay_mask", lambda: eqxscan.optim.weight_decay_mask(params)),
        (
            "muon_dimension_numbers",
            lambda: eqxscan.optim.muon_dimension_numbers(params),
        ),
    ]:
        with pytest.raises(
            ValueError, match=rf"{who}: `.*` has shape \(3, 2, .*inside"
        ):
            call()


class _Heads(eqx.Module):
    heads: eqxscan.Stacked

    def __init__(self, key):
        make = lambda k: eqx.nn.Linear(4, 4, key=k)  # noqa: E731
        self.heads = eqxscan.Stacked(make, 3, key=key)


@pytest.mark.parametrize("outer", [3, 2])
def test_freeze_layers_of_a_stack_inside_another(outer, getkey):
    # `where` naming the inner stack froze along the outer layer axis: every
    # head of outer layer 0 (or, at another outer depth, an unrelated error).
    model = eqxscan.Stacked(_Heads, outer, key=getkey())
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = eqxscan.optim.freeze_layers(
        optax.sgd(1.0), [2], where=lambda m: m.layers.heads
    )
    updates, _ = opt.update(grads, opt.init(params), params)
    w = updates.layers.heads.layers.weight  # [outer, inner, 4, 4]
    assert (w[:, 2] == 0).all() and (w[:, :2] == -1).all()
    # A Chain's repeated pattern: the stack's layer 1 in every repeat.
    layers = [eqx.nn.Linear(4, 4, key=k) for k in jax.random.split(getkey(), 4)]
    layers = [layers[0], layers[1], _Lone(), layers[2], layers[3], _Lone()]
    chain = eqx.filter(eqxscan.Chain(layers), eqx.is_inexact_array)
    grads = jax.tree.map(jnp.ones_like, chain)
    pick = lambda c: c.groups[0].layers.groups[0]  # noqa: E731
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), 1, where=pick)
    updates, _ = opt.update(grads, opt.init(chain), chain)
    w = pick(updates).layers.weight  # [repeats, 2, 4, 4]
    assert (w[:, 1] == 0).all() and (w[:, 0] == -1).all()


class _Lone(eqx.Module):
    scale: jax.Array = eqx.field(default_factory=lambda: jnp.ones(4))

    def __call__(self, x):
        return x * self.scale


@pytest.mark.parametrize("as_array", [np.asarray, jnp.asarray])
def test_freeze_layers_takes_an_index_array(getkey, as_array):
    # Indices kept as an array (e.g. `np.nonzero(...)[0]`) freeze those layers,
    # as the same ints in a list do.
    stack = _stack(getkey(), 4)
    params = eqx.filter(stack, eqx.is_inexact_array)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), as_array([0, -2]))
    updates, _ = opt.update(grads, opt.init(params), params)
    moved = (updates.layers.linear.weight != 0).any(axis=(1, 2))
    assert moved.tolist() == [False, True, False, True]
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), as_array([0.0]))
    with pytest.raises(TypeError, match="as an int, a slice"):
        opt.update(grads, opt.init(params), params)


def test_freeze_layers_refuses_a_chain(getkey):
    # The chain's one Stacked is its layers 1-3: index 0 would be layer 1.
    layers = [eqx.nn.Linear(3, 6, key=getkey())] + [Block(getkey()) for _ in range(3)]
    chain = eqxscan.Chain(layers)
    params = eqx.filter(chain, eqx.is_inexact_array)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), 0)
    with pytest.raises(ValueError, match="(?s)found a Chain.*where="):
        opt.update(grads, opt.init(params), params)
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), 0, where=lambda c: c.groups[1])
    updates, _ = opt.update(grads, opt.init(params), params)
    assert [bool((u.linear.weight == 0).all()) for u in updates.unstack()[1:]] == [
        True,
        False,
        False,
    ]


def test_freeze_layers_freezes_layer_numbers_of_a_stage_ordered_stack(getkey):
    # Position 2 of this stage order holds layer 4: freezing layer 2 froze it.
    stack = _stack(getkey(), 8)
    staged = eqxscan.sharding.pipeline_order(stack, stages=2, repeats=2)
    opt = eqxscan.optim.freeze_layers(optax.sgd(1.0), [2, 7])
    grads = jax.tree.map(jnp.ones_like, eqx.filter(staged, eqx.is_inexact_array))
    updates, _ = opt.update(grads, opt.init(grads))
    natural = eqxscan.sharding.pipeline_order(
        updates, stages=2, repeats=2, inverse=True
    )
    for leaf in jax.tree.leaves(natural):
        zero = [i for i in range(8) if not np.any(np.asarray(leaf[i]))]
        assert zero == [2, 7]


def test_layerwise_scale_numbers_the_layers_of_a_stage_ordered_stack(getkey):
    stack = _stack(getkey(), 8)
    staged = eqxscan.sharding.pipeline_order(stack, stages=2, repeats=2)
    scale = eqxscan.optim.layerwise_scale(lambda i: 1.0 + i)
    grads = jax.tree.map(jnp.ones_like, eqx.filter(staged, eqx.is_inexact_array))
    updates, _ = scale.update(grads, scale.init(grads))
    natural = eqxscan.sharding.pipeline_order(
        updates, stages=2, repeats=2, inverse=True
    )
    for leaf in jax.tree.leaves(natural):
        want = np.arange(1.0, 9.0).reshape((8,) + (1,) * (leaf.ndim - 1))
        np.testing.assert_array_equal(leaf, np.broadcast_to(want, leaf.shape))
