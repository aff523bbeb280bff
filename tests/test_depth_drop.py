"""Stochastic depth (drop-path) and LayerDrop: scan against loop and a
hand-written reference (values, gradients, per-layer keys), keep-rate
statistics, inference mode, the `cond` in the program, compile once, errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan

from .helpers import sub_jaxprs


D, L, B = 4, 4, 3


class Block(eqx.Module):
    lin: eqx.nn.Linear

    def __init__(self, key):
        self.lin = eqx.nn.Linear(D, D, key=key)

    def __call__(self, x, scale=1.0):
        h = x @ self.lin.weight.T
        return x + scale * jnp.tanh(h + jnp.broadcast_to(self.lin.bias, h.shape))


class Noisy(Block):
    """A layer that takes its own key: it must still get `split(key, L)[i]`."""

    def __call__(self, x, *, key=None):
        return super().__call__(x) + 0.1 * jax.random.normal(key, x.shape)


class Other(eqx.Module):
    weight: jax.Array

    def __init__(self, key):
        self.weight = jax.random.normal(key, (D, D)) * 0.3

    def __call__(self, x, scale=1.0):
        return x + scale * jnp.sin(x @ self.weight)


class Third(Other):
    """Like `Other`, but another class: a lone layer at the end of a chain."""


def reference(layers, x, key, drop_path, layer_drop, per=None, layer_keys=False):
    """The documented semantics, by hand: drop keys from
    `split(fold_in(key, 0x5D0), L)`, per layer `k_layer, k_path = split(.)`;
    a dropped layer leaves the carry as it was."""
    n = len(layers)
    drop_keys = jax.random.split(jax.random.fold_in(key, 0x5D0), n)
    own = jax.random.split(key, n)
    one = jnp.float32(1)
    for i, layer in enumerate(layers):
        k_layer, k_path = jax.random.split(drop_keys[i])
        q, p = jnp.float32(layer_drop[i]), jnp.float32(drop_path[i])
        kw = {"key": own[i]} if layer_keys else {}
        new = layer(x, *(() if per is None else (per[i],)), **kw)
        if drop_path[i] > 0:
            keep = jax.random.bernoulli(k_path, one - p, (x.shape[0],))
            new = jnp.where(keep[:, None], x + (new - x) * (one / (one - p)), x)
        x = jnp.where(jax.random.bernoulli(k_layer, one - q), new, x)
    return x


RATES = dict(drop_path=[0.0, 0.3, 0.5, 0.7], layer_drop=[0.5, 0.2, 0.6, 0.4])


def _loss(model, x, key, *args):
    return jnp.sum(model(x, *args, key=key) ** 2)


def _agree(model, x, seeds, rates, **ref_kw):
    """Scan, loop and the reference: values and gradients, one compile."""
    loop = model.with_options(mode="loop")
    drop = model.drop_rates

    def ref_loss(layers, key):
        return jnp.sum(
            reference(layers, x, key, drop.drop_path, drop.layer_drop, **ref_kw) ** 2
        )

    @eqx.filter_jit
    def all_three(model, loop, layers, key):
        grad = eqx.filter_value_and_grad(_loss)
        return (
            grad(model, x, key),
            grad(loop, x, key),
            jax.value_and_grad(ref_loss)(layers, key),
        )

    values = set()
    for seed in seeds:
        (v, g), (v_loop, g_loop), (v_ref, g_ref) = all_three(
            model, loop, model.unstack(), jax.random.key(seed)
        )
        values.add(float(v))
        np.testing.assert_allclose(v, v_ref, rtol=1e-5)
        np.testing.assert_allclose(v_loop, v_ref, rtol=1e-5)
        flat_ref = jax.tree.leaves(eqx.filter(g_ref, eqx.is_array))
        for got in (g, g_loop):
            layers = got.unstack()
            flat = jax.tree.leaves(eqx.filter(layers, eqx.is_array))
            for a, b in zip(flat, flat_ref, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert len(values) > 1  # the keys chose different drops


def test_scan_loop_and_reference_agree():
    stack = eqxscan.Stacked(Block, L, key=jax.random.key(0), remat=False, **RATES)
    x = jax.random.normal(jax.random.key(1), (B, D))
    _agree(stack, x, range(3), RATES)


@pytest.mark.parametrize("remat", [True, "nested"])
def test_checkpoint_and_per_layer_inputs(remat):
    rates = dict(drop_path=eqxscan.linear_rates(0.6), layer_drop=0.4)
    stack = eqxscan.Stacked(
        Block, L, key=jax.random.key(0), remat=remat, unroll=1, **rates
    )
    x = jax.random.normal(jax.random.key(1), (B, D))
    per = jnp.linspace(0.5, 1.5, L)
    drop = stack.drop_rates
    assert drop.drop_path == pytest.approx((0.0, 0.2, 0.4, 0.6))

    @eqx.filter_jit
    def both(stack, layers, key):
        got = eqx.filter_value_and_grad(_loss)(stack, x, key, eqxscan.per_layer(per))

        def ref_loss(layers):
            out = reference(layers, x, key, drop.drop_path, drop.layer_drop, per=per)
            return jnp.sum(out**2)

        return got, jax.value_and_grad(ref_loss)(layers)

    for seed in range(2):
        (v, g), (v_ref, g_ref) = both(stack, stack.unstack(), jax.random.key(seed))
        np.testing.assert_allclose(v, v_ref, rtol=1e-5)
        want = jnp.stack([layer.lin.weight for layer in g_ref])
        np.testing.assert_allclose(g.layers.lin.weight, want, rtol=1e-4, atol=1e-6)


def test_layers_keep_their_own_keys():
    stack = eqxscan.Stacked(Noisy, L, key=jax.random.key(0), layer_drop=0.5)
    x = jnp.ones((B, D))
    run = eqx.filter_jit(lambda s, k: s(x, key=k))
    ref = jax.jit(
        lambda layers, k: reference(
            layers, x, k, (0.0,) * L, (0.5,) * L, layer_keys=True
        )
    )
    for seed in range(2):
        key = jax.random.key(seed)
        np.testing.assert_allclose(
            run(stack, key), ref(stack.unstack(), key), rtol=1e-5, atol=1e-6
        )


def test_chain_global_layer_indices():
    keys = jax.random.split(jax.random.key(0), 5)
    # Block, Other, Block, Other (one scan over a periodic unit), a lone Third.
    layers = [Block(k) if i % 2 == 0 else Other(k) for i, k in enumerate(keys[:4])]
    layers.append(Third(keys[4]))
    rates = dict(drop_path=eqxscan.linear_rates(0.5), layer_drop=0.3)
    chain = eqxscan.Chain(layers, remat=False, **rates)
    assert any(s.per_step > 1 for s in chain.layout)
    assert chain.drop_rates.drop_path[-1] == 0.5  # rising over all 5 layers
    x = jax.random.normal(jax.random.key(1), (B, D))
    _agree(chain, x, range(3), rates)


def test_stacked_mlp():
    model = eqxscan.StackedMLP(
        D, L, key=jax.random.key(0), drop_path=0.3, layer_drop=0.3
    )
    plain = eqxscan.StackedMLP(D, L, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, D))

    @eqx.filter_jit
    def run(model, plain, key):
        want = reference(model.blocks.unstack(), x, key, (0.3,) * L, (0.3,) * L)
        return model(x, key=key), want, eqx.nn.inference_mode(model)(x), plain(x)

    got, want, inference, plain_out = run(model, plain, jax.random.key(2))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert jnp.array_equal(inference, plain_out)
    assert model.with_options(drop_path=0.0, layer_drop=0.0).blocks.drop_rates is None
    with pytest.raises(ValueError, match="StackedMLP drops layers"):
        model(x)


def test_inference_mode_and_zero_rates_are_the_plain_model():
    plain = eqxscan.Stacked(Block, L, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, D))
    zero = eqxscan.Stacked(Block, L, key=jax.random.key(0), drop_path=[0.0] * L)
    assert zero.drop_rates is None
    assert jnp.array_equal(zero(x), plain(x))
    dropping = eqxscan.Stacked(
        Block, L, key=jax.random.key(0), drop_path=0.5, layer_drop=0.5
    )
    off = eqx.nn.inference_mode(dropping)
    assert off.drop_rates.inference
    assert jnp.array_equal(off(x), plain(x))  # no key needed
    assert off[1:3].drop_rates.inference  # slicing keeps the mode
    assert not jnp.array_equal(dropping(x, key=jax.random.key(5)), plain(x))


def test_slicing_and_with_options_keep_rates():
    stack = eqxscan.Stacked(
        Block, L, key=jax.random.key(0), drop_path=eqxscan.linear_rates(0.3)
    )
    assert stack[1:3].drop_rates.drop_path == stack.drop_rates.drop_path[1:3]
    assert stack.with_options(mode="loop").drop_rates == stack.drop_rates
    assert stack.with_options(layer_drop=0.2).drop_rates.layer_drop == (0.2,) * L


def test_gradient_trees_slice_like_the_model():
    # `eqx.filter_grad` and optax give a tree of the model's structure with
    # `None` for every non-array leaf, `DropRates.inference` included.
    stack = eqxscan.Stacked(Block, L, key=jax.random.key(0), drop_path=0.3)
    chain = eqxscan.Chain(_chain_layers(), layer_drop=0.2)
    for model in stack, chain:
        grads = eqx.filter(model, eqx.is_inexact_array)
        assert grads.drop_rates.inference is None
        got, want = grads[1:3], eqx.filter(model[1:3], eqx.is_inexact_array)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert jnp.array_equal(a, b)


def _chain_layers():
    # Block x2 (a scanned run), a lone Other, Block x2 (another run).
    keys = jax.random.split(jax.random.key(0), 5)
    kinds = [Block, Block, Other, Block, Block]
    return [kind(k) for kind, k in zip(kinds, keys)]


def test_chain_with_options_sets_rates():
    layers = _chain_layers()
    plain = eqxscan.Chain(layers, remat=False)
    assert {s.per_step for s in plain.layout} == {0, 1}
    rates = dict(
        drop_path=eqxscan.linear_rates(0.6), layer_drop=[0.5, 0.2, 0.6, 0.4, 0.3]
    )
    built = eqxscan.Chain(layers, remat=False, **rates)
    changed = plain.with_options(**rates)
    assert changed.drop_rates == built.drop_rates
    assert changed.drop_rates.drop_path[-1] == 0.6  # over all 5 layers
    x = jax.random.normal(jax.random.key(1), (B, D))

    @eqx.filter_jit
    def value_and_grad(model, key):
        return eqx.filter_value_and_grad(_loss)(model, x, key)

    for seed in range(2):
        key = jax.random.key(seed)
        (v, g), (v_built, g_built) = (
            value_and_grad(changed, key),
            value_and_grad(built, key),
        )
        np.testing.assert_allclose(v, v_built, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_built), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    # Against the hand-written reference too, not only the constructor.
    _agree(changed, x, range(3), rates)
    # One rate changed, the other kept.
    only = changed.with_options(layer_drop=0.1)
    assert only.drop_rates.layer_drop == (0.1,) * 5
    assert only.drop_rates.drop_path == built.drop_rates.drop_path


def test_chain_with_options_zero_rates_and_inference_mode():
    layers = _chain_layers()
    plain = eqxscan.Chain(layers)
    dropping = eqxscan.Chain(layers, drop_path=0.3, layer_drop=0.3)
    x = jax.random.normal(jax.random.key(1), (B, D))
    zero = dropping.with_options(layer_drop=0.0, drop_path=0.0)
    assert zero.drop_rates is None
    assert jnp.array_equal(zero(x), plain(x))  # no key needed
    off = eqx.nn.inference_mode(dropping).with_options(drop_path=0.5, mode="loop")
    assert off.drop_rates.inference and off.mode == "loop"
    assert off.drop_rates.drop_path == (0.5,) * 5
    np.testing.assert_allclose(off(x), plain(x), rtol=1e-6)
    on = dropping.with_options(drop_path=0.5)
    assert not on.drop_rates.inference
    assert not jnp.allclose(on(x, key=jax.random.key(3)), plain(x))


@pytest.mark.parametrize(
    "rates, error, match",
    [
        (dict(drop_path=1.0), ValueError, r"drop_path must be in \[0, 1\), got 1.0"),
        (dict(layer_drop=[0.1, 0.2]), ValueError, "has 2 rates, but the module has 5"),
        (dict(drop_path=[0.1, 0.1, float("nan"), 0.1, 0.1]), ValueError, r"\[2\]"),
        (dict(layer_drop="linear"), TypeError, "linear_rates"),
    ],
)
def test_chain_with_options_bad_rates(rates, error, match):
    chain = eqxscan.Chain(_chain_layers())
    with pytest.raises(error, match=match) as info:
        chain.with_options(**rates)
    with pytest.raises(error) as built:
        eqxscan.Chain(_chain_layers(), **rates)
    assert str(info.value) == str(built.value)
    assert str(info.value).splitlines()[1].startswith("Hint:")
    with pytest.raises(TypeError, match="unexpected keyword argument 'drop'"):
        chain.with_options(drop=0.1)


class Count(eqx.Module):
    """Adds one: the carry counts the layers that ran (the residual is 1)."""

    def __call__(self, x):
        return x + 1.0


def test_keep_rate_statistics():
    n_keys, p, q = 400, 0.3, 0.5
    keys = jax.random.split(jax.random.key(0), n_keys)
    # LayerDrop: one choice per call; the count of layers run is binomial.
    stack = eqxscan.Stacked(layers=Count(), num_layers=L, layer_drop=q)
    ran = jax.vmap(lambda k: stack(jnp.zeros((1,)), key=k))(keys)
    frac = float(jnp.mean(ran)) / L
    bound = 4 * np.sqrt(q * (1 - q) / (n_keys * L))
    assert abs(frac - (1 - q)) < bound
    # Drop-path: per example, residual 1 kept with 1 - p and scaled: unbiased.
    stack = eqxscan.Stacked(layers=Count(), num_layers=L, drop_path=p)
    out = jax.vmap(lambda k: stack(jnp.zeros((B, 1)), key=k))(keys)
    scale = 1 / (1 - p)
    kept = out / scale  # layers kept per example
    frac = float(jnp.mean(kept)) / L
    assert abs(frac - (1 - p)) < 4 * np.sqrt(p * (1 - p) / (n_keys * L * B))
    assert abs(float(jnp.mean(out)) - L) < 4 * np.sqrt(L * p / (1 - p) / (n_keys * B))
    # Per example: the rows of one call differ.
    assert bool(jnp.any(out[:, 0] != out[:, 1]))


def _eqns(jaxpr, name):
    """Every equation named `name`, searching sub-jaxprs too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for sub in sub_jaxprs(eqn.params):
            found.extend(_eqns(sub, name))
    return found


@pytest.mark.parametrize("remat", [False, True, "auto"])
def test_layer_drop_is_a_cond_in_the_scan_body_forward_and_backward(remat):
    stack = eqxscan.Stacked(
        Block, L, key=jax.random.key(0), layer_drop=0.5, remat=remat, unroll=1
    )
    x = jnp.ones((B, D))
    key = jax.random.key(0)
    fwd = eqx.filter_make_jaxpr(lambda s: s(x, key=key))(stack)[0].jaxpr
    (scan,) = _eqns(fwd, "scan")
    assert len(_eqns(scan.params["jaxpr"].jaxpr, "cond")) == 1
    grad = eqx.filter_make_jaxpr(eqx.filter_grad(lambda s: _loss(s, x, key)))(stack)
    scans = _eqns(grad[0].jaxpr, "scan")
    assert len(scans) == 2  # forward and backward
    backward = scans[-1].params["jaxpr"].jaxpr
    (cond,) = _eqns(backward, "cond")
    # One branch (the skipped layer) does no matmul; the other does.
    dots = sorted(len(_eqns(b.jaxpr, "dot_general")) for b in cond.params["branches"])
    assert dots[0] == 0 and dots[1] > 0
    # Every matmul of the backward step is inside the cond: a skip skips them.
    assert len(_eqns(backward, "dot_general")) == dots[1]


DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@pytest.mark.parametrize(
    "remat, saves",
    [(True, [(L, B, D)]), (DOTS, [(L, B, D), (L, B, D)])],
)
def test_layer_drop_saves_what_checkpoint_says_and_skipped_layers_touch_no_weights(
    remat, saves
):
    # The forward scan saves, per layer, the carry it received and what the
    # policy keeps (here the one matmul output), never the layer's weights. The
    # weights are not scanned inputs (which every step would slice, kept or
    # not): the stacked weights reach the step whole and only the running branch
    # indexes them; the backward scan carries the stacked gradient and only the
    # running branch writes into it. The old design (weights sliced as scan
    # inputs) fails the `xs` and the slicing checks.
    stack = eqxscan.Stacked(
        Block, L, key=jax.random.key(0), layer_drop=0.5, remat=remat, unroll=1
    )
    x = jnp.ones((B, D))
    key = jax.random.key(0)
    grad = eqx.filter_make_jaxpr(eqx.filter_grad(lambda s: _loss(s, x, key)))(stack)
    forward, backward = _eqns(grad[0].jaxpr, "scan")
    carry = forward.params["num_carry"]
    saved = sorted(tuple(v.aval.shape) for v in forward.outvars[carry:])
    assert saved == saves
    for scan in (forward, backward):
        consts = scan.params["num_consts"]
        scanned = [
            v.aval.shape for v in scan.invars[consts + scan.params["num_carry"] :]
        ]
        assert (L, D, D) not in scanned  # the weights are not sliced per step
        body = scan.params["jaxpr"].jaxpr
        (cond,) = _eqns(body, "cond")
        assert not [e for e in body.eqns if e.primitive.name == "dynamic_slice"]
        skip, kept = sorted(
            cond.params["branches"], key=lambda b: len(_eqns(b.jaxpr, "dot_general"))
        )
        assert not _eqns(skip.jaxpr, "dynamic_slice")
        assert _eqns(kept.jaxpr, "dynamic_slice")
    # The stacked weight gradient is a carry of the backward scan, written only
    # by the running branch.
    carried = [v.aval.shape for v in backward.outvars[: backward.params["num_carry"]]]
    assert (L, D, D) in carried
    (cond,) = _eqns(backward.params["jaxpr"].jaxpr, "cond")
    writes = sorted(
        len(_eqns(b.jaxpr, "dynamic_update_slice")) for b in cond.params["branches"]
    )
    assert writes[0] == 0 and writes[1] > 0


def test_every_drop_pattern_reuses_one_executable():
    stack = eqxscan.Stacked(
        Block, L, key=jax.random.key(0), drop_path=0.5, layer_drop=0.5
    )
    params, static = eqx.partition(stack, eqx.is_array)
    x = jnp.ones((B, D))

    @jax.jit
    def step(params, key):
        return jax.value_and_grad(lambda p: _loss(eqx.combine(p, static), x, key))(
            params
        )

    outs = [step(params, jax.random.key(s))[0] for s in range(6)]
    assert len({float(v) for v in outs}) > 1  # the patterns differ
    assert step._cache_size() == 1


def test_vmap_with_one_key_shares_the_choice():
    stack = eqxscan.Stacked(
        Block, L, key=jax.random.key(0), drop_path=0.5, layer_drop=0.5
    )
    x = jax.random.normal(jax.random.key(1), (B, D))
    key = jax.random.key(4)
    batched = eqx.filter_vmap(lambda r: stack(r, key=key))(x)
    # Each row is one call on a carry without a batch axis: one draw per call.
    rows = jnp.stack([stack(x[i], key=key) for i in range(B)])
    np.testing.assert_allclose(batched, rows, rtol=1e-5, atol=1e-6)
    # Per-example keys give per-example drops.
    keys = jax.random.split(key, B)
    per_key = eqx.filter_vmap(lambda r, k: stack(r, key=k))(x, keys)
    rows = jnp.stack([stack(x[i], key=keys[i]) for i in range(B)])
    np.testing.assert_allclose(per_key, rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "rates, error, match",
    [
        (dict(drop_path=1.0), ValueError, r"drop_path must be in \[0, 1\), got 1.0"),
        (dict(layer_drop=-0.1), ValueError, r"layer_drop must be in \[0, 1\)"),
        (dict(drop_path=[0.1, float("nan"), 0.1, 0.1]), ValueError, r"drop_path\[1\]"),
        (dict(layer_drop=[0.1, 0.2]), ValueError, "has 2 rates, but the module has 4"),
        (dict(drop_path=True), TypeError, "must be a number"),
        (dict(drop_path="linear"), TypeError, "linear_rates"),
        (dict(drop_path=np.zeros((2, 2))), ValueError, r"shape \(2, 2\)"),
        # Below 1, but 1 in float32: 1 / (1 - p) was inf and the gradients NaN.
        (dict(drop_path=1 - 1e-8), ValueError, r"1\.0 in float32"),
        (dict(layer_drop=[0.1, 0.1, 0.1, 1 - 1e-8]), ValueError, r"layer_drop\[3\]"),
    ],
)
def test_bad_rates(rates, error, match):
    with pytest.raises(error, match=match) as info:
        eqxscan.Stacked(Block, L, key=jax.random.key(0), **rates)
    assert "\nHint:" in str(info.value)


def test_traced_rate_and_missing_key():
    def build(rate):
        return eqxscan.Stacked(Block, L, key=jax.random.key(0), drop_path=rate)

    with pytest.raises(TypeError, match="traced value"):
        jax.jit(lambda r: build(r).layers.lin.weight)(0.1)
    with pytest.raises(ValueError, match=r"linear_rates\(max_rate\)"):
        eqxscan.linear_rates(1.5)
    with pytest.raises(ValueError, match="needs a `key`") as info:
        build(0.1)(jnp.ones((B, D)))
    assert "inference_mode" in str(info.value)
    chain = eqxscan.Chain([Block(jax.random.key(i)) for i in range(2)], layer_drop=0.1)
    with pytest.raises(ValueError, match="Chain drops layers"):
        chain(jnp.ones((B, D)))


class Counting(eqx.Module):
    """A residual layer that also counts, per example, the layers run."""

    w: jax.Array

    def __call__(self, carry):
        x, n = carry
        return x + jnp.tanh(x * self.w[None]), n + 1


def test_drop_path_refuses_a_carry_leaf_it_cannot_rescale():
    # An int leaf's branch `1 / (1 - p)` was cast to the leaf's dtype: with
    # p = 0.5 each kept layer counted 2, with p = 0.3 it counted 1.
    stack = eqxscan.Stacked(
        lambda k: Counting(jax.random.normal(k, (D,))), 2, key=jax.random.key(0)
    )
    carry = (jnp.ones((B, D)), jnp.zeros((B, 1), jnp.int32))
    with pytest.raises(TypeError, match=r"carry leaf `carry\[1\]` is int32") as info:
        stack.with_options(drop_path=0.5)(carry, key=jax.random.key(1))
    assert "\nHint:" in str(info.value)
    # A per-example value of one axis ([B]) beside [B, D] is refused, saying
    # why: one axis could be one example's features.
    carry = (jnp.ones((B, D)), jnp.zeros((B,)))
    with pytest.raises(ValueError, match=r"(?s)at least two axes.*\[B, 1\]"):
        stack.with_options(drop_path=0.5)(carry, key=jax.random.key(1))
    carry = (jnp.ones((B, D)), jnp.zeros((B, 1), jnp.int32))
    # LayerDrop does not rescale: such a carry drops as it is.
    dropped = stack.with_options(layer_drop=0.5)
    x, n = dropped.with_options(mode="loop")(carry, key=jax.random.key(1))
    assert n.dtype == jnp.int32 and set(np.unique(n)) <= {0, 1, 2}


class Embed(eqx.Module):
    """A lone input projection, `[B, 2] -> [B, D]`: it changes the carry."""

    w: jax.Array

    def __call__(self, x):
        return x @ self.w


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_a_layer_that_changes_the_carry_is_not_dropped_without_a_word(mode):
    # A Chain's lone projection cannot be skipped or drop its branch: with its
    # rate above 0 it used to run every time (a rate of 0.9 was never drawn).
    keys = jax.random.split(jax.random.key(0), 3)
    layers = [Embed(jax.random.normal(keys[0], (2, D)))]
    layers += [Block(k) for k in keys[1:]]
    x, key = jnp.ones((B, 2)), jax.random.key(1)
    for name in ("layer_drop", "drop_path"):
        chain = eqxscan.Chain(layers, mode=mode, **{name: [0.9, 0.2, 0.2]})
        with pytest.raises(ValueError, match=f"{name} is above 0 for layer 0"):
            chain(x, key=key)
    # With its rate 0 it runs, and the others drop as the reference does.
    rates = dict(drop_path=[0.0, 0.3, 0.5], layer_drop=[0.0, 0.5, 0.4])
    chain = eqxscan.Chain(layers, mode=mode, **rates)
    # (The reference's first layer: the projection, applied beforehand.)
    want = reference([lambda h: h] + layers[1:], layers[0](x), key, **rates)
    np.testing.assert_allclose(chain(x, key=key), want, rtol=1e-5, atol=1e-6)


def test_a_layer_that_changes_the_carry_inside_a_repeated_pattern():
    # Inside a pattern's scan the layer's index is traced: the error comes at
    # run time, and only from a rate above 0.
    keys = jax.random.split(jax.random.key(0), 4)
    up = lambda k: Embed(jax.random.normal(k, (D, 2 * D)))  # noqa: E731
    down = lambda k: Embed(jax.random.normal(k, (2 * D, D)))  # noqa: E731
    layers = [up(keys[0]), down(keys[1]), up(keys[2]), down(keys[3])]
    x, key = jnp.ones((B, D)), jax.random.key(1)
    chain = eqxscan.Chain(layers, layer_drop=[0.0, 0.5] * 2)
    assert chain.layout[0].per_step == 2  # one scan over [up, down] units
    with pytest.raises(eqx.EquinoxRuntimeError, match="layer_drop is above 0"):
        chain(x, key=key)
    chain = chain.with_options(layer_drop=0.0, drop_path=[0.0, 0.5] * 2)
    with pytest.raises(eqx.EquinoxRuntimeError, match="drop_path is above 0"):
        chain(x, key=key)


def test_jax_jit_of_a_model_with_drop_rates_says_what_to_use():
    # `jax.jit` traces the rates' bool `inference` leaf (as an `eqx.nn.Dropout`'s):
    # the error was JAX's TracerBoolConversionError, naming no option.
    stack = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=jax.random.key(0), layer_drop=0.1
    )
    stack = eqx.nn.inference_mode(stack)
    x = jnp.ones(4)
    with pytest.raises(TypeError, match=r"(?s)`inference` flag .* traced.*filter_jit"):
        jax.jit(lambda m, x: m(x))(stack, x)
    got = eqx.filter_jit(lambda m, x: m(x))(stack, x)
    for layer in stack.unstack():
        x = layer(x)
    assert jnp.allclose(got, x, atol=1e-6)
