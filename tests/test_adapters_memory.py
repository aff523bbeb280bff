"""LoRA adapters and memory: the base is not copied, the optimiser state holds
the adapters only, merge runs layer by layer, FSDP bases."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqxscan
from eqxscan import adapters, sharding

from .test_adapters import (
    _assert_close,
    _call,
    _is_lora,
    _losses_and_grads,
    _mlp,
    _random_b,
    LinearBlock,
    S,
)


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


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x))


class _FormsTheSum(adapters.LoRA):
    """The product as it must not be computed: `x @ (base + delta)`."""

    def __rmatmul__(self, x):
        k = jnp.maximum(self.active, 0)
        return x @ (self.base + self.scaling * self.a[k] @ self.b[k])


def _gradient_temp(model, spec, x):
    params, static = eqx.partition(model, spec)
    loss = lambda p: jnp.sum(eqx.combine(p, static)(x) ** 2)  # noqa: E731
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_base_is_not_copied(getkey):
    d, num_layers, k, r, batch = 64, 2, 3, 4, 2
    base = eqxscan.StackedMLP(d, num_layers, key=getkey())
    model = adapters.add_lora(
        base, ["*.w1", "*.w2"], rank=r, num_adapters=k, key=getkey()
    )
    # Arrays: the base's and K adapters per weight and layer (the id is an int).
    one_adapter = num_layers * (d * r + r * 4 * d) * 4 * 2  # w1 and w2, f32
    assert _nbytes(model) == _nbytes(base) + k * one_adapter
    # A gradient's temporaries: the unadapted one's plus one layer's adapters
    # and activations when each layer is recomputed; when matmul outputs are
    # saved (remat="auto" here), also the adapter branch's (`x @ a`, then
    # `@ b`) in every layer.
    x = jnp.ones((batch, d))
    layer = k * one_adapter // num_layers + batch * 5 * d * 4
    branch = num_layers * batch * ((r + 4 * d) + (r + d)) * 4
    for remat, bound in ((True, layer), ("auto", layer + branch)):
        plain = _gradient_temp(base.with_options(remat=remat), eqx.is_inexact_array, x)
        adapted = model.with_options(remat=remat)
        assert _gradient_temp(adapted, adapters.trainable(adapted), x) <= plain + bound
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
    assert _gradient_temp(summed, adapters.trainable(summed), x) > plain + bound


def test_merge_and_unmerge(getkey):
    model = _mlp(getkey, k=3)
    x = jr.normal(getkey(), (2, 8))
    for k in (2, -1):
        merged = adapters.merge(model, k)
        w1 = merged.blocks.layers.w1
        assert isinstance(w1, jax.Array) and w1.shape == (2, 8, 32)
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


def test_a_bfloat16_merge_rounds_once(getkey):
    # The exact base + delta (float32), rounded once to bfloat16; and back.
    model = eqxscan.StackedMLP(16, 2, key=getkey(), dtype=jnp.bfloat16)
    model = _random_b(adapters.add_lora(model, "*.w1", rank=4, key=getkey()), getkey())
    model = eqx.tree_at(
        lambda m: m.blocks.layers.w1.b,
        model,
        model.blocks.layers.w1.b.astype("bfloat16"),
    )
    lo = model.blocks.layers.w1
    a, b = (x[:, 0].astype(jnp.float32) for x in (lo.a, lo.b))
    exact = lo.base.astype(jnp.float32) + jnp.einsum("lir,lro->lio", a, b)
    merged = adapters.merge(model).blocks.layers.w1
    np.testing.assert_array_equal(merged, exact.astype(jnp.bfloat16))
    back = adapters.unmerge(adapters.merge(model), model).blocks.layers.w1.base
    assert back.dtype == jnp.bfloat16
    # Within an ulp of the merged weights (bfloat16 has 8 bits).
    ulp = 2**-7 * float(jnp.max(jnp.abs(merged.astype(jnp.float32))))
    np.testing.assert_allclose(back.astype(jnp.float32), lo.base, rtol=0, atol=ulp)


def test_merge_follows_select(getkey):
    # Without `adapter`, merge and unmerge take the adapter each layer has
    # selected: the merged model computes what the adapted one does.
    model = _mlp(getkey, k=3)
    x = jr.normal(getkey(), (2, 8))
    lo = model.blocks.layers.w1
    chosen = adapters.select(model, 1)
    mixed = eqx.tree_at(  # layer 0 uses adapter 2, layer 1 the base alone
        lambda m: m.blocks.layers.w1.active, model, jnp.array([2, -1], jnp.int32)
    )
    for adapted, ids in ((chosen, [1, 1]), (mixed, [2, -1])):
        merged = adapters.merge(adapted)
        for i, k in enumerate(ids):
            delta = S * lo.a[i, k] @ lo.b[i, k] if k >= 0 else 0.0
            np.testing.assert_allclose(
                merged.blocks.layers.w1[i], lo.base[i] + delta, rtol=1e-5, atol=1e-6
            )
        np.testing.assert_allclose(merged(x), adapted(x), rtol=1e-5, atol=1e-5)
        back = adapters.unmerge(merged, adapted)
        np.testing.assert_allclose(back.blocks.layers.w1.base, lo.base, atol=1e-6)
    # Under jit, with `active` traced.
    jitted = eqx.filter_jit(lambda m: adapters.merge(m).blocks.layers.w1)(chosen)
    np.testing.assert_allclose(
        jitted, adapters.merge(model, 1).blocks.layers.w1, rtol=1e-6, atol=1e-6
    )


def test_merge_runs_layer_by_layer(getkey):
    d, num_layers = 64, 4
    model = adapters.add_lora(
        eqxscan.StackedMLP(d, num_layers, key=getkey()), "*.w1", rank=4, key=getkey()
    )
    lo = model.blocks.layers.w1
    layer = d * 4 * d * 4
    args = (lo.base, lo.a, lo.b, lo.active)
    static = dict(scale=lo.scaling, orientation="x@W")
    for fn in (adapters._merge._jitted, adapters._merge._donating):
        memory = fn.lower(*args, **static).compile().memory_analysis()
        # One layer's delta at a time, not the stack's (4 layers).
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
    np.testing.assert_array_equal(  # a NumPy integer is an adapter too
        adapters.merge(model, np.int64(1)).blocks.layers.w1,
        adapters.merge(model, 1).blocks.layers.w1,
    )
    other = eqxscan.StackedMLP(8, 3, key=getkey())  # a layer more
    with pytest.raises(ValueError, match=r"not shaped as the adapted.*tree.blocks"):
        adapters.unmerge(other, model)
    wrong = eqx.tree_at(
        lambda m: m.blocks.layers.w1, adapters.merge(model), jnp.zeros((2, 8, 8))
    )
    with pytest.raises(
        ValueError, match=r"unmerge: at the LoRA `blocks.\*.w1`.*float32\[2,8,8\]"
    ):
        adapters.unmerge(wrong, model)
    # The model the LoRAs were added to holds their bases, never merged.
    plain = eqxscan.StackedMLP(8, 2, key=getkey())
    adapted = adapters.add_lora(plain, "*.w1", rank=2, key=getkey())
    with pytest.raises(ValueError, match=r"`blocks.\*.w1`.*own base, which no"):
        adapters.unmerge(plain, adapted)
    back = adapters.unmerge(plain, adapted, -1)  # the base alone: nothing merged
    assert back.blocks.layers.w1.base is plain.blocks.layers.w1
    # A model without LoRAs: merge has nothing to merge, unmerge (its arguments
    # swapped) nothing to recover.
    with pytest.raises(ValueError, match="merge: the model holds no LoRA"):
        adapters.merge(plain, 0)
    with pytest.raises(ValueError, match=r"unmerge: the adapted model \(its second"):
        adapters.unmerge(adapted, adapters.merge(adapted))


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
        _losses_and_grads(batch, (_call, placed)), _losses_and_grads(x, (_call, model))
    )
