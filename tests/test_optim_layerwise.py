"""eqxscan.optim: batched Muon, layer-wise scales and per-layer norms, against
the same layers kept in a list (optax on the unstacked model, optax.multi_transform
with one label per layer, norms written by hand)."""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxscan


class Block(eqx.Module):
    up: eqx.nn.Linear  # weight [out, in] = [10, 6]
    down: eqx.nn.Linear  # weight [6, 10]
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(6, 10, key=k1)
        self.down = eqx.nn.Linear(10, 6, key=k2)
        self.norm = eqx.nn.LayerNorm(6)

    def __call__(self, x):
        return self.norm(x + self.down(jnp.tanh(self.up(x))))


def _chain(key):
    """Two repeats of [Block, Block, Linear] (a Stacked of units, each holding a
    Stacked run: two layer axes), then a lone bias-free Linear: 7 layers."""
    k = iter(jax.random.split(key, 7))
    layers = [
        Block(next(k)) if i % 3 < 2 else eqx.nn.Linear(6, 6, key=next(k))
        for i in range(6)
    ]
    chain = eqxscan.Chain(layers + [eqx.nn.Linear(6, 6, use_bias=False, key=next(k))])
    assert [s.per_step for s in chain.layout] == [3, 0]
    return chain


def _loss_stacked(model, x):
    return jnp.sum(jnp.sin(jax.vmap(model)(x)))


def _loss_list(layers, x):
    def one(v):
        for layer in layers:
            v = layer(v)
        return v

    return jnp.sum(jnp.sin(jax.vmap(one)(x)))


def _train(optimiser, model, loss, x, steps):
    with jax.numpy_dtype_promotion("standard"):
        # optax's Muon raises a float to an int32 step count (bias correction),
        # which the suite's strict promotion rejects.
        return _steps(optimiser, model, loss, x, steps)


def _steps(optimiser, model, loss, x, steps):
    params = eqx.filter(model, eqx.is_inexact_array)
    state = optimiser.init(params)

    @eqx.filter_jit
    def step(model, state):
        grads = eqx.filter_grad(loss)(model, x)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = optimiser.update(grads, state, params)
        return eqx.apply_updates(model, updates), state

    for _ in range(steps):
        model, state = step(model, state)
    return model


def _max_diff(a, b):
    a, b = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max(
        float(jnp.max(jnp.abs(p - q)))
        for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# -- Muon -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stacked", "chain"])
def test_muon_matches_unstacked(kind, getkey):
    if kind == "stacked":
        model = eqxscan.Stacked(Block, 3, key=getkey())
    else:
        model = _chain(getkey())
    x = jax.random.normal(getkey(), (4, 6))
    stacked = _train(eqxscan.optim.muon(1e-2), model, _loss_stacked, x, 3)
    listed = _train(optax.contrib.muon(1e-2), model.unstack(), _loss_list, x, 3)
    assert _max_diff(stacked.unstack(), listed) < 1e-5
    if kind == "stacked":
        # optax's default reads the [L, out, in] weights as non-matrices (Adam):
        # the difference the batched dimension numbers remove.
        plain = _train(optax.contrib.muon(1e-2), model, _loss_stacked, x, 3)
        assert _max_diff(plain.unstack(), listed) > 1e-4


def test_muon_dimension_numbers_as_optax_default(getkey):
    # Unstacked, the same rule as optax's default (ndim == 2 gets Muon, axis 0
    # reduction, axis 1 output); stacked, shifted past the layer axes.
    chain = _chain(getkey())
    dims = eqxscan.optim.muon_dimension_numbers(eqx.filter(chain, eqx.is_array))
    unit = dims.groups[0].layers.groups
    Dims = optax.contrib.MuonDimensionNumbers
    assert unit[0].layers.up.weight == Dims(2, 3)
    assert unit[0].layers.up.bias is None and unit[0].layers.norm.weight is None
    assert unit[1].weight == Dims(1, 2) and unit[1].bias is None
    assert dims.groups[1].weight == Dims(0, 1)
    top = eqxscan.optim.muon_dimension_numbers(
        {"w": jnp.ones((3, 4)), "v": jnp.ones(3)}
    )
    assert top == {"w": Dims(0, 1), "v": None}


def _count_dots(jaxpr) -> list:
    """Every dot_general in `jaxpr` and the jaxprs inside its equations."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(_count_dots(inner))
    return found


def _update_dots(optimiser, params):
    state = optimiser.init(params)
    with jax.numpy_dtype_promotion("standard"):  # as in `_train`
        update = jax.make_jaxpr(lambda g, s: optimiser.update(g, s, params))
        jaxpr = update(params, state)
    return _count_dots(jaxpr.jaxpr)


def test_muon_newton_schulz_is_batched(getkey):
    def stack(n):
        return eqx.filter(eqxscan.Stacked(Block, n, key=getkey()), eqx.is_array)

    dots2 = _update_dots(eqxscan.optim.muon(1e-2), stack(2))
    dots4 = _update_dots(eqxscan.optim.muon(1e-2), stack(4))
    # 3 products (in the Newton-Schulz loop's body) x 2 weights, whatever the
    # depth ...
    assert len(dots2) == len(dots4) == 6
    # ... each batched over the layer axis.
    for eqn in dots4:
        (_, _), (batch_lhs, batch_rhs) = eqn.params["dimension_numbers"]
        assert len(batch_lhs) == len(batch_rhs) == 1
        assert eqn.invars[0].aval.shape[batch_lhs[0]] == 4
    # The counting itself: a list of layers takes one set of products per layer.
    listed = eqxscan.Stacked(Block, 2, key=getkey()).unstack()
    dots = _update_dots(optax.contrib.muon(1e-2), eqx.filter(listed, eqx.is_array))
    assert len(dots) == 2 * 6


def test_muon_bad_arguments():
    with pytest.raises(ValueError, match="adaptive=True.*\n.*optim.layerwise"):
        eqxscan.optim.muon(1e-2, adaptive=True)
    with pytest.raises(TypeError, match="sets `muon_weight_dimension_numbers`"):
        eqxscan.optim.muon(1e-2, muon_weight_dimension_numbers=None)


# -- Layer-wise scales -------------------------------------------------------------


class Model(eqx.Module):
    embed: eqx.nn.Linear
    layers: eqxscan.Chain

    def __call__(self, x):
        return self.layers(self.embed(x))


def test_layerwise_scale_matches_multi_transform(getkey):
    model = Model(eqx.nn.Linear(6, 6, key=getkey()), _chain(getkey()))
    n = len(model.layers)
    x = jax.random.normal(getkey(), (4, 6))

    def fn(i):
        return 0.7 ** (n - 1 - i)

    stacked_tx = optax.chain(
        optax.adam(1e-2), eqxscan.optim.layerwise_scale(fn, unstacked=0.5)
    )
    stacked = _train(stacked_tx, model, _loss_stacked, x, 2)

    listed = {"embed": model.embed, "layers": model.layers.unstack()}

    def loss_list(m, x):
        return _loss_list([m["embed"], *m["layers"]], x)

    labels = {
        "embed": jax.tree.map(lambda _: "top", listed["embed"]),
        "layers": [
            jax.tree.map(lambda _, i=i: f"layer{i}", layer)
            for i, layer in enumerate(listed["layers"])
        ],
    }
    transforms = {
        f"layer{i}": optax.chain(optax.adam(1e-2), optax.scale(fn(i))) for i in range(n)
    }
    transforms["top"] = optax.chain(optax.adam(1e-2), optax.scale(0.5))
    reference = _train(
        optax.multi_transform(transforms, labels), listed, loss_list, x, 2
    )
    assert _max_diff(stacked.embed, reference["embed"]) < 1e-6
    assert _max_diff(stacked.layers.unstack(), reference["layers"]) < 1e-6


def test_layerwise_scale_nested_stack_takes_outer_index(getkey):
    # A Stacked inside each layer is part of that layer.
    nested = eqxscan.Stacked(
        lambda k: eqxscan.Stacked(lambda j: eqx.nn.Linear(2, 2, key=j), 3, key=k),
        2,
        key=getkey(),
    )
    ones = jax.tree.map(jnp.ones_like, eqx.filter(nested, eqx.is_array))
    tx = eqxscan.optim.layerwise_scale(lambda i: 10.0 + i)
    scaled, _ = jax.jit(tx.update)(ones, tx.init(ones))
    weight = scaled.layers.layers.weight  # [2, 3, 2, 2]
    expected = jnp.broadcast_to(
        jnp.array([10.0, 11.0])[:, None, None, None], (2, 3, 2, 2)
    )
    assert (weight == expected).all()


def test_layerwise_scale_bad_input(getkey):
    stack = eqx.filter(eqxscan.Stacked(Block, 2, key=getkey()), eqx.is_array)
    # (The runtime type checker of this suite, or the function's own check.)
    with pytest.raises(TypeError, match="fn must be callable|parameter 'fn'"):
        eqxscan.optim.layerwise_scale(0.9)
    tx = eqxscan.optim.layerwise_scale(lambda i: jnp.ones(2))
    with pytest.raises(
        ValueError,
        match=r"fn\(0\) returned shape \(2,\) for layer 0 \(at `\*\.up\.weight`\)",
    ) as info:
        tx.update(stack, tx.init(stack))
    assert "\nHint:" in str(info.value)
    tx = eqxscan.optim.layerwise_scale(lambda i: None)
    with pytest.raises(ValueError, match=r"fn\(0\) returned None"):
        tx.update(stack, tx.init(stack))


@pytest.mark.parametrize("factor", [-0.5, float("nan"), float("inf")])
def test_layerwise_scale_refuses_negative_and_non_finite_factors(getkey, factor):
    # A NaN would reach every parameter of the layer, a negative factor turn
    # its descent into ascent: both were applied without a word.
    stack = eqx.filter(eqxscan.Stacked(Block, 2, key=getkey()), eqx.is_array)
    tx = eqxscan.optim.layerwise_scale(lambda i: 1.0 if i == 0 else factor)
    with pytest.raises(ValueError, match=r"fn\(1\) returned .* for layer 1 .*finite"):
        tx.update(stack, tx.init(stack))
    # A zero factor stops the layer's updates, as `optax.scale(0.0)` does.
    tx = eqxscan.optim.layerwise_scale(lambda i: float(i))
    updates, _ = tx.update(stack, tx.init(stack))
    assert (updates.layers.up.weight[0] == 0).all()
    assert (updates.layers.up.weight[1] == stack.layers.up.weight[1]).all()


def test_layerwise_scale_inside_layerwise_is_refused(getkey):
    # Inside `layerwise` it saw one layer at a time, with no layer index, and
    # scaled nothing; outside it scales each layer.
    stack = eqx.filter(eqxscan.Stacked(Block, 3, key=getkey()), eqx.is_array)
    grads = jax.tree.map(jnp.ones_like, stack)
    scale = eqxscan.optim.layerwise_scale(lambda i: float(i))
    inside = eqxscan.optim.layerwise(optax.chain(optax.sgd(1.0), scale))
    with pytest.raises(ValueError, match="runs inside eqxscan.optim.layerwise"):
        inside.update(grads, inside.init(stack), stack)
    outside = optax.chain(eqxscan.optim.layerwise(optax.sgd(1.0)), scale)
    updates, _ = outside.update(grads, outside.init(stack), stack)
    assert updates.layers.up.weight[:, 0, 0].tolist() == [-0.0, -1.0, -2.0]


def test_layerwise_scale_names_the_layer_fn_fails_on(getkey):
    # Rates kept in a list one short of the stack: fn's own IndexError, with
    # the layer it was called for.
    stack = eqx.filter(eqxscan.Stacked(Block, 3, key=getkey()), eqx.is_array)
    tx = eqxscan.optim.layerwise_scale(lambda i: [1.0, 0.5][i])
    with pytest.raises(IndexError) as info:
        tx.update(stack, tx.init(stack))
    assert "called for layer 2" in "\n".join(getattr(info.value, "__notes__", []))


# -- Per-layer norms ---------------------------------------------------------------


class Nets(eqx.Module):
    embed: eqx.nn.Linear
    layers: eqxscan.Chain
    nested: eqxscan.Stacked


def _nets(getkey):
    nested = eqxscan.Stacked(
        lambda k: eqxscan.Stacked(lambda j: eqx.nn.Linear(2, 3, key=j), 3, key=k),
        2,
        key=getkey(),
    )
    return Nets(eqx.nn.Linear(6, 6, key=getkey()), _chain(getkey()), nested)


def _norms_by_hand(model, ord):
    """From the state dict: each name's layer numbers become `*` and index."""
    sizes = {"layers": (len(model.layers),), "nested": (2, 3)}
    expected = {}
    for name, value in eqxscan.to_state_dict(model).items():
        norm = np.linalg.norm(value.ravel().astype(np.float64), ord=ord)
        head, *rest = name.split(".")
        if head == "embed":
            expected[name] = norm
            continue
        depth = len(sizes[head])
        index, tail = tuple(int(r) for r in rest[:depth]), rest[depth:]
        key = ".".join([head] + ["*"] * depth + tail)
        expected.setdefault(key, np.full(sizes[head], np.nan))[index] = norm
    return expected


def test_layer_norms_match_unstacked(getkey):
    model = _nets(getkey)

    @jax.jit
    def norms(model):
        layer_norms = eqxscan.optim.layer_norms
        return layer_norms(model), layer_norms(model, ord=math.inf)

    for got, ord in zip(norms(model), [2, math.inf]):
        expected = _norms_by_hand(model, ord)
        assert set(got) == set(expected)
        for key, value in expected.items():
            np.testing.assert_allclose(np.asarray(got[key]), value, rtol=1e-6)
        # The lone bias-free layer 6 and the [2, 3] nested stack, as documented.
        assert np.isnan(np.asarray(got["layers.*.bias"]))[6]
        assert got["nested.*.*.weight"].shape == (2, 3)


def test_layer_norms_keys_and_bad_ord(getkey):
    model = eqxscan.StackedMLP(4, 3, key=getkey())
    norms = eqxscan.optim.layer_norms(model)  # eagerly: the dict keeps its order
    assert list(norms) == ["blocks.*.w1", "blocks.*.w2", "blocks.*.scale"]
    for i in range(3):
        expected = jnp.linalg.norm(model.blocks[i].w1)
        np.testing.assert_allclose(norms["blocks.*.w1"][i], expected, rtol=1e-6)
    with pytest.raises(TypeError, match="ord must be a number.*\nHint"):
        eqxscan.optim.layer_norms(model, ord=True)


def test_state_dict_name_form_is_what_layer_norms_shows(getkey):
    # The key form is the state dict's names with the layer numbers starred.
    model = _nets(getkey)
    starred = {re.sub(r"\.\d+", ".*", n) for n in eqxscan.to_state_dict(model)}
    assert starred == set(eqxscan.optim.layer_norms(model))


def test_a_chains_layerwise_state_saves_and_loads(tmp_path):
    # Each stack's buffers hold that stack's layers of the Chain (None at the
    # others'): read as a shallower chain, they were refused as a depth mismatch.
    keys = jax.random.split(jax.random.key(0), 4)
    layers = [eqx.nn.Linear(4, 4, key=k) for k in keys[:3]]
    chain = eqxscan.Chain([*layers, eqx.nn.Linear(4, 4, use_bias=False, key=keys[3])])
    tx = eqxscan.optim.layerwise(optax.adam(1e-3))
    params = eqx.filter(chain, eqx.is_array)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    with jax.numpy_dtype_promotion("standard"):  # optax's step count
        state = tx.update(grads, state, params)[1]  # moments that are not zeros
    back = eqxscan.from_state_dict(state, eqxscan.to_state_dict(state))
    assert all(
        (a == b).all() for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state))
    )
    eqxscan.save(tmp_path / "opt.safetensors", state)
    loaded = eqxscan.load(tmp_path / "opt.safetensors", state)
    assert all(
        (a == b).all() for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state))
    )
    # A chain of another depth is still refused.
    deeper = eqxscan.Chain([*layers, *layers])
    other = tx.init(eqx.filter(deeper, eqx.is_array))
    with pytest.raises(ValueError, match="Depth mismatch"):
        eqxscan.from_state_dict(other, eqxscan.to_state_dict(state))


def test_factored_moments_of_a_checked_model_save_and_load(tmp_path):
    # Adafactor's factored moments sit in the model's structure with other
    # shapes: saved, then refused on load by the model's own shape checks.
    model = eqxscan.StackedMLP(8, 3, key=jax.random.key(1))
    params = eqx.filter(model, eqx.is_inexact_array)
    tx = eqxscan.optim.layerwise(optax.adafactor(1e-2, min_dim_size_to_factor=4))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    with jax.numpy_dtype_promotion("standard"):  # optax's step count
        state = tx.update(grads, state, params)[1]
    eqxscan.save(tmp_path / "opt.safetensors", state)
    loaded = eqxscan.load(tmp_path / "opt.safetensors", state)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_plain_factored_state_is_refused_at_save_with_the_ways_that_work(tmp_path):
    # Plain adafactor's moments lack the layer axis: the refusal names where to
    # go (layerwise, or the Orbax manager, which saves it whole).
    model = eqxscan.StackedMLP(8, 3, key=jax.random.key(1))
    state = optax.adafactor(1e-2, min_dim_size_to_factor=4).init(
        eqx.filter(model, eqx.is_inexact_array)
    )
    with pytest.raises(
        ValueError,
        match=r"leading axes must be \(3,\)\.\nHint: .*eqxscan\.optim\.layerwise, "
        r"or whole with eqxscan\.checkpoint\.CheckpointManager",
    ):
        eqxscan.save(tmp_path / "opt.safetensors", state)
