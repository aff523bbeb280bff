"""Per-layer buffers updated in place (`eqxscan.buffer`): values and buffer
contents against `mode="loop"` and hand-written loops, gradients of a prefill
under every remat setting, batching, Chain layouts, in-place memory from
XLA's own analysis, compile counts, and bad input."""

import functools as ft
import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan


D, H = 8, 2


class Attn(eqx.Module):
    """A decode layer: writes its new keys/values at `pos` into its cache and
    attends over the cache (positions up to `pos + S - 1`)."""

    wqkv: jax.Array
    wo: jax.Array
    window: int = eqx.field(static=True, default=0)

    def __init__(self, *, key: jax.Array, window: int = 0):
        k1, k2 = jr.split(key)
        self.wqkv = jr.normal(k1, (D, 3 * D)) / math.sqrt(D)
        self.wo = jr.normal(k2, (D, D)) / math.sqrt(D)
        self.window = window

    def __call__(self, x, cache, pos):
        s = x.shape[0]
        q, k, v = (a.reshape(s, H, D // H) for a in jnp.split(x @ self.wqkv, 3, -1))
        kc, vc = cache
        t = kc.shape[0]
        at = pos % t if self.window else pos  # a window layer keeps a ring buffer
        kc = jax.lax.dynamic_update_slice(kc, k, (at, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v, (at, 0, 0))
        if self.window:
            # Slot j holds the latest position congruent to j.
            slot = jnp.arange(t)
            seen = pos + s - 1 - (pos + s - 1 - slot) % t
            ok = (seen[None] <= pos + jnp.arange(s)[:, None]) & (seen[None] >= 0)
            ok &= seen[None] > pos + jnp.arange(s)[:, None] - t
        else:
            ok = jnp.arange(t)[None] <= pos + jnp.arange(s)[:, None]
        scores = jnp.einsum("shd,thd->hst", q, kc) / math.sqrt(D // H)
        scores = jnp.where(ok[None], scores, -1e30)
        o = jnp.einsum("hst,thd->shd", jax.nn.softmax(scores, -1), vc)
        return x + jnp.tanh(o.reshape(s, D) @ self.wo), (kc, vc)


def cache_of(t: int, lead: tuple[int, ...] = ()):
    shape = (*lead, t, H, D // H)
    return (jnp.zeros(shape), jnp.zeros(shape))


def hand_loop(layers, x, caches, pos):
    """The reference: a Python loop over the layers and their own caches."""
    new = []
    for layer, c in zip(layers, caches):
        x, c = layer(x, c, pos)
        new.append(c)
    return x, new


def stacked(n: int = 3, **options) -> eqxscan.Stacked:
    return eqxscan.Stacked(lambda k: Attn(key=k), n, key=jr.key(0), **options)


def per_layer_list(tree, n):
    return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(n)]


def assert_close(a, b, tol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["scan", "loop"])
@pytest.mark.parametrize("reverse", [False, True])
def test_stacked_decode_matches_hand_loop(mode, reverse):
    n, t = 3, 8
    stack = stacked(n, mode=mode)
    step = jax.jit(
        lambda s, x, c, p: s(x, eqxscan.buffer(c), pos=p, reverse=reverse),
        donate_argnums=2,
    )
    layers = stack.unstack()[::-1] if reverse else stack.unstack()
    cache = cache_of(t, (n,))
    ref = per_layer_list(cache, n)
    ref = ref[::-1] if reverse else ref
    x = jr.normal(jr.key(1), (2, D))
    for pos in range(0, 6, 2):  # a prefill of 2 rows, then chunks of 2
        y, cache = step(stack, x, cache, pos)
        x_ref, ref = hand_loop(layers, x, ref, pos)
        assert_close(y, x_ref)
        assert_close(
            cache,
            jax.tree.map(lambda *a: jnp.stack(a), *(ref[::-1] if reverse else ref)),
        )
        x = y
    assert step._cache_size() == 1  # one program for every position


def test_scan_returns_ys_beside_buffer():
    n = 3
    stack = stacked(n)

    def one(layer, x, cache, pos):
        x, cache = layer(x, cache, pos)
        return (x, cache), x.sum()

    x = jr.normal(jr.key(1), (1, D))
    built = eqxscan.layer_buffers(stack, lambda i, layer: cache_of(4))
    assert_close(built, cache_of(4, (n,)))  # a Stacked's: stacked on axis 0
    (y, cache), ys = stack.scan(x, eqxscan.buffer(cache_of(4, (n,))), 1, method=one)
    ref_x, ref_c = hand_loop(
        stack.unstack(), x, per_layer_list(cache_of(4, (n,)), n), 1
    )
    assert_close(y, ref_x)
    assert_close(cache, jax.tree.map(lambda *a: jnp.stack(a), *ref_c))
    assert ys.shape == (n,)
    loop = stack.with_options(mode="loop")
    (_, _), ys_loop = loop.scan(x, eqxscan.buffer(cache_of(4, (n,))), 1, method=one)
    assert_close(ys, ys_loop)


def test_batched_decode_positions_per_sequence():
    n, t, b = 2, 8, 3
    stack = stacked(n)
    pos = jnp.array([0, 3, 5])
    x = jr.normal(jr.key(2), (b, 1, D))
    cache = jax.tree.map(lambda a: jr.normal(jr.key(3), a.shape), cache_of(t, (b, n)))
    step = jax.jit(jax.vmap(lambda x, c, p: stack(x, eqxscan.buffer(c), pos=p)))
    y, new = step(x, cache, pos)
    for i in range(b):
        mine = jax.tree.map(lambda a, i=i: a[i], cache)
        x_ref, c_ref = hand_loop(
            stack.unstack(), x[i], per_layer_list(mine, n), int(pos[i])
        )
        assert_close(y[i], x_ref, 1e-5)
        assert_close(
            jax.tree.map(lambda a, i=i: a[i], new),
            jax.tree.map(lambda *a: jnp.stack(a), *c_ref),
            1e-5,
        )


REMATS = [
    False,
    True,
    "auto",
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nested",
    "offload",
    eqxscan.ScanRemat(policy=True, save_carries=True, save_inputs=False),
]


@pytest.mark.parametrize("remat", REMATS, ids=str)
def test_prefill_gradients(remat):
    # Training through the cache: a prefill writes rows 0-2, a decode step at 3
    # reads them; gradients with respect to weights and input.
    n, t = 4, 6
    stack = stacked(n, remat=remat)
    x = jr.normal(jr.key(4), (3, D))

    def loss(stack, x):
        y, cache = stack(x, eqxscan.buffer(cache_of(t, (n,))), pos=0)
        z, cache = stack(y[-1:], eqxscan.buffer(cache), pos=3)
        return jnp.sum(z**2) + jnp.sum(cache[0] ** 2)

    def loss_ref(layers, x):
        y, caches = hand_loop(layers, x, [cache_of(t)] * n, 0)
        z, caches = hand_loop(layers, y[-1:], caches, 3)
        return jnp.sum(z**2) + sum(jnp.sum(c[0] ** 2) for c in caches)

    val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(stack, x)
    ref_val, (ref_layers, ref_x) = jax.value_and_grad(loss_ref, argnums=(0, 1))(
        stack.unstack(), x
    )
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    assert_close(grads[1], ref_x, 1e-5)
    assert_close(
        grads[0].layers, jax.tree.map(lambda *a: jnp.stack(a), *ref_layers), 1e-5
    )


def test_prefill_gradient_finite_differences():
    n, t = 2, 4
    stack = stacked(n)
    x = jr.normal(jr.key(5), (2, D))
    v = jr.normal(jr.key(6), (2, D))

    def loss(x):
        y, cache = stack(x, eqxscan.buffer(cache_of(t, (n,))), pos=1)
        return jnp.sum(jnp.sin(y)) + jnp.sum(cache[1] * cache[0])

    g = jax.grad(loss)(x)
    eps = 1e-3
    fd = (loss(x + eps * v) - loss(x - eps * v)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(g, v), fd, rtol=2e-3)


def _chain_layers():
    # Mistral/Gemma style: two window layers (ring buffers of 3), one global
    # layer (the full length), repeated twice, then a lone projection-free
    # layer with no cache.
    keys = jr.split(jr.key(7), 7)
    layers = [Attn(key=keys[i], window=0 if i % 3 == 2 else 3) for i in range(6)]
    return layers + [Lone()]


class Lone(eqx.Module):
    scale: jax.Array = eqx.field(default_factory=lambda: jnp.array(0.5))

    def __call__(self, x, cache, pos):
        assert cache is None
        return x * self.scale, None


def _make(t):
    return lambda i, layer: (
        None if isinstance(layer, Lone) else cache_of(layer.window or t)
    )


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_chain_window_and_global_caches(mode):
    t = 8
    layers = _chain_layers()
    chain = eqxscan.Chain(layers, mode=mode)
    assert "repeats" in chain.explain()
    buffers = eqxscan.layer_buffers(chain, _make(t))
    own = sum(
        2 * (layer.window or t) * D * 4 for layer in layers if isinstance(layer, Attn)
    )
    assert buffers.nbytes == own  # the sum of the layers' own sizes, not L x T
    step = jax.jit(lambda c, x, b, p: c(x, eqxscan.buffer(b), pos=p))
    refs = [buffers.layer(i) for i in range(len(layers))]
    x = jr.normal(jr.key(8), (1, D))
    for pos in range(6):  # past the window: the ring buffers wrap
        y, buffers = step(chain, x, buffers, pos)
        x_ref, refs = hand_loop(layers, x, refs, pos)
        assert_close(y, x_ref, 1e-5)
        for i, r in enumerate(refs):
            assert_close(buffers.layer(i), r, 1e-5)
        x = y
    assert step._cache_size() == 1


def test_chain_runs_and_lone_layers_match_loop_mode():
    keys = jr.split(jr.key(9), 5)
    layers = [Attn(key=k) for k in keys[:3]] + [
        Attn(key=keys[3], window=2),
        Attn(key=keys[4]),
    ]
    chain = eqxscan.Chain(layers)
    loop = chain.with_options(mode="loop")
    buffers = eqxscan.layer_buffers(chain, _make(5))
    x = jr.normal(jr.key(10), (2, D))
    y, b = chain(x, eqxscan.buffer(buffers), pos=1)
    y_loop, b_loop = loop(x, eqxscan.buffer(buffers), pos=1)
    y_ref, refs = hand_loop(layers, x, [buffers.layer(i) for i in range(5)], 1)
    assert_close(y, y_loop)
    assert_close(y, y_ref, 1e-5)
    assert_close(b.groups, b_loop.groups)
    for i, r in enumerate(refs):
        assert_close(b.layer(i), r, 1e-5)


def _memory(fn, *args):
    exe = jax.jit(fn, donate_argnums=len(args) - 1).lower(*args).compile()
    mem = exe.memory_analysis()
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return mem.temp_size_in_bytes, mem.alias_size_in_bytes, cost["bytes accessed"]


@pytest.mark.parametrize("reads", ["view", "copy"])
def test_decode_updates_the_cache_in_place(reads):
    # XLA's own analysis: the donated cache is aliased to the output, no step
    # holds a second copy of it, and the bytes a step touches are the loop's
    # order, not the cache's. The per-layer `ys` way copies the cache, which
    # this test tells apart. `reads="copy"` adds one read and one write of a
    # layer's slice per layer, and one slice of temp memory.
    n, t = 4, 512
    stack = stacked(n)
    x = jr.normal(jr.key(11), (1, D))
    cache = cache_of(t, (n,))
    nbytes = sum(a.nbytes for a in cache)
    slice_bytes = nbytes // n

    def in_place(s, x, c, reads=reads):
        return s(x, eqxscan.buffer(c, reads=reads), pos=7)

    def ys(s, x, c):
        return s.scan(x, eqxscan.per_layer(c), 7, method=lambda f, x, c, p: f(x, c, p))

    def loop(layers, x, caches):
        return hand_loop(layers, x, caches, 7)

    temp, alias, accessed = _memory(in_place, stack, x, cache)
    loop_temp, loop_alias, loop_accessed = _memory(
        loop, stack.unstack(), x, per_layer_list(cache, n)
    )
    ys_temp, _, _ = _memory(ys, stack, x, cache)
    assert alias == nbytes == loop_alias
    assert temp <= loop_temp + slice_bytes
    if reads == "view":
        assert accessed <= 1.2 * loop_accessed
    else:
        _, _, view_accessed = _memory(
            ft.partial(in_place, reads="view"), stack, x, cache
        )
        # Each layer's slice read and written once more (a stack of 4 layers
        # is unrolled, so every layer's copy is counted), plus each copy's
        # index and predicate scalars.
        assert view_accessed < accessed <= view_accessed + 2 * nbytes + 64 * n
        auto_temp, _, auto_accessed = _memory(
            ft.partial(in_place, reads="auto"), stack, x, cache
        )
        assert (auto_temp, auto_accessed) == (temp, accessed)  # CPU: copy
    assert ys_temp >= nbytes  # the copy this avoids
    y, c = in_place(stack, x, cache)
    y_view, c_view = in_place(stack, x, cache, reads="view")
    assert_close(y, y_view)
    assert_close(c, c_view)


def test_whole_slice_write_costs_what_a_hand_written_scan_does():
    # A layer that rewrites its whole slice (no rows found) is written into the
    # one buffer, aliased to the input: the same program as `lax.scan` by hand
    # with the slice read and written back. (For a slice computed elementwise
    # from the old one, XLA's CPU backend copies the buffer in both.)
    class Decay(eqx.Module):
        w: jax.Array

        def __call__(self, x, state):
            state = 0.5 * state + x[None]
            return x + state.sum(), state

    n = 4
    stack = eqxscan.Stacked(lambda k: Decay(jr.normal(k, (256,))), n, key=jr.key(0))
    state = jnp.ones((n, 1024, 256))
    x = jnp.ones(256)
    temp, alias, _ = _memory(lambda s, x, c: s(x, eqxscan.buffer(c)), stack, x, state)

    def hand(s, x, c):
        dyn, static = eqx.partition(s.layers, eqx.is_array)

        def step(carry, a):
            (x, c), (d, i) = carry, a
            sl = jax.lax.dynamic_index_in_dim(c, i, 0, False)
            x, sl = eqx.combine(d, static)(x, sl)
            return (x, jax.lax.dynamic_update_index_in_dim(c, sl, i, 0)), None

        return jax.lax.scan(step, (x, c), (dyn, jnp.arange(n)))[0]

    hand_temp, hand_alias, _ = _memory(hand, stack, x, state)
    assert alias == hand_alias == state.nbytes
    assert temp <= hand_temp
    y, new = stack(x, eqxscan.buffer(state))
    xs, outs = x, []
    for i in range(n):
        xs, s_i = stack[i](xs, state[i])
        outs.append(s_i)
    assert_close(y, xs)
    assert_close(new, jnp.stack(outs))


def test_unchanged_buffer_is_not_written():
    class Reader(eqx.Module):
        w: jax.Array

        def __call__(self, x, table):
            return x + table[0] * self.w, table

    stack = eqxscan.Stacked(lambda k: Reader(jr.normal(k, (4,))), 3, key=jr.key(0))
    table = jr.normal(jr.key(1), (3, 2, 4))
    jaxpr = jax.make_jaxpr(lambda s, x, t: stack(x, eqxscan.buffer(t)))(
        stack, jnp.ones(4), table
    )
    assert "dynamic_update_slice" not in str(jaxpr)
    y, same = stack(jnp.ones(4), eqxscan.buffer(table))
    assert_close(same, table)


def test_bad_input_errors():
    stack = stacked(3)
    x = jnp.ones((1, D))
    with pytest.raises(ValueError, match=r"buffer leaf `buffer\[0\]`.*layer axis"):
        stack(x, eqxscan.buffer(cache_of(4, (2,))), pos=0)
    # (Under the suite's runtime type checking, beartype may speak first.)
    with pytest.raises(Exception, match=r"reads='fused'; expected 'auto'|'reads'"):
        eqxscan.buffer(cache_of(4, (2,)), reads="fused")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="pytree of arrays"):
        eqxscan.buffer({"k": 1.0})

    class NoBuffer(eqx.Module):
        w: jax.Array

        def __call__(self, x, cache):
            return x * self.w[None]

    bad = eqxscan.Stacked(lambda k: NoBuffer(jnp.ones(D)), 2, key=jr.key(0))
    with pytest.raises(TypeError, match=r"must return \(x, buffer\)"):
        bad(x, eqxscan.buffer(jnp.zeros((2, 3))))

    class Widen(eqx.Module):
        w: jax.Array

        def __call__(self, x, cache):
            return x, cache.astype(jnp.float16)

    widen = eqxscan.Stacked(lambda k: Widen(jnp.ones(D)), 2, key=jr.key(0))
    with pytest.raises(TypeError, match=r"keeps its shape and dtype"):
        widen(x, eqxscan.buffer(jnp.zeros((2, 3))))

    class Forget(eqx.Module):
        w: jax.Array

        def __call__(self, x, cache):
            return x, None

    # A layer that returns no buffer for one it received is told so by name.
    forget = eqxscan.Stacked(lambda k: Forget(jnp.ones(D)), 2, key=jr.key(0))
    with pytest.raises(TypeError, match="returned a buffer of another structure"):
        forget(x, eqxscan.buffer(jnp.zeros((2, 3))))
    with pytest.raises(TypeError, match="does not take an eqxscan.buffer"):
        stack.vmap(x, eqxscan.buffer(cache_of(4, (3,))), pos=0)
    with pytest.raises(TypeError, match="does not take an eqxscan.buffer"):
        eqxscan.run_layers(stack, x, [0, 1], eqxscan.buffer(cache_of(4, (3,))), pos=0)
    # A Recurrent's hint is its own (it was to call the model itself).
    rnn = eqxscan.Recurrent(eqx.nn.GRUCell(D, D, key=jr.key(0)))
    with pytest.raises(TypeError, match=r"Hint: the state carried over time is the"):
        rnn(jnp.zeros(D), jnp.ones((3, D)), eqxscan.buffer(jnp.zeros((3, D))))
    with pytest.raises(TypeError, match="2 eqxscan.buffer arguments"):
        stack(x, eqxscan.buffer(cache_of(4, (3,))), eqxscan.buffer(cache_of(4, (3,))))
    # A dropped layer would skip its write: refused before the scan.
    for rates in ({"drop_path": 0.5}, {"layer_drop": 0.5}):
        with pytest.raises(
            TypeError, match=DROPS.format("This Stacked of Attn layers")
        ):
            stacked(3, **rates)(
                x, eqxscan.buffer(cache_of(4, (3,))), pos=0, key=jr.key(0)
            )


DROPS = (
    "^{} is called with an eqxscan.buffer and with drop_path or "
    "layer_drop, which would skip a dropped layer's write to the buffer.\n"
    "Hint: decode in inference mode"
)


def test_chain_buffer_errors():
    layers = _chain_layers()
    # Dropping refused at the call, whether a lone layer or a scanned group drops.
    keys = jr.split(jr.key(1), 2)
    for layers_ in (
        [Lone(), Attn(key=keys[0])],
        layers,
    ):
        dropping = eqxscan.Chain(layers_, drop_path=0.5)
        buffers = eqxscan.buffer(eqxscan.layer_buffers(dropping, _make(4)))
        with pytest.raises(TypeError, match=DROPS.format("This Chain")):
            dropping(jnp.ones((1, D)), buffers, pos=0, key=jr.key(0))
    chain = eqxscan.Chain(layers)
    with pytest.raises(TypeError, match="layer_buffers"):
        chain(jnp.ones((1, D)), eqxscan.buffer(cache_of(4, (7,))), pos=0)
    other = eqxscan.Chain(layers[:3])
    with pytest.raises(TypeError, match="another chain"):
        chain(
            jnp.ones((1, D)),
            eqxscan.buffer(eqxscan.layer_buffers(other, _make(4))),
            pos=0,
        )
    # Layers scanned together need buffers of one shape.
    run = eqxscan.Chain([Attn(key=k) for k in jr.split(jr.key(0), 3)])
    with pytest.raises(ValueError, match="layers 0 and 1 are scanned together"):
        eqxscan.layer_buffers(run, lambda i, layer: cache_of(4 + i))
    # A chain's buffers given to a Stacked of as many layers: named, not
    # unpacked by the layer as if they were its cache.
    chain_buffers = eqxscan.layer_buffers(run, lambda i, layer: cache_of(4))
    with pytest.raises(TypeError, match="got LayerBuffers, which lay out a Chain"):
        stacked(3)(jnp.ones((1, D)), eqxscan.buffer(chain_buffers), pos=0)
    # ... named by their indices in the whole chain.
    keys = jr.split(jr.key(0), 3)
    late = eqxscan.Chain([Lone(), *(Attn(key=k) for k in keys)])
    with pytest.raises(ValueError, match="layers 1 and 2 are scanned together"):
        eqxscan.layer_buffers(late, lambda i, _: None if i == 0 else cache_of(4 + i))


@pytest.mark.parametrize("split", ["batch", "heads"])
def test_sharded_decode_matches_one_device(split):
    # FSDP weights (each scan step gathers one layer) and a cache split over
    # the batch or the heads: the values of one device.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    n, t, b = 2, 4, 2
    stack = stacked(n)
    mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(AxisType.Auto,))
    placed, _, _ = eqxscan.sharding.shard(stack, mesh=mesh, min_size=0)
    assert placed.layer_sharding is not None
    spec = P("fsdp") if split == "batch" else P(None, None, None, "fsdp")
    cache = jax.tree.map(lambda a: jr.normal(jr.key(12), a.shape), cache_of(t, (b, n)))
    x = jr.normal(jr.key(13), (b, 1, D))
    pos = jnp.array([1, 2])

    def step(s, x, c, p):
        return jax.vmap(lambda x, c, p: s(x, eqxscan.buffer(c), pos=p))(x, c, p)

    want = jax.jit(step)(stack, x, cache, pos)
    sharded = jax.device_put(cache, NamedSharding(mesh, spec))
    got = jax.jit(step)(placed, x, sharded, pos)
    assert_close(got, want, 1e-5)
    assert tuple(got[1][0].sharding.spec)[: len(spec)] == tuple(spec)  # stays split


def test_cross_layer_kv_sharing_inside_the_pattern():
    # A layer that reads an earlier layer's cache instead of keeping its own:
    # the pair is one layer of the pattern, with one cache between them.
    class SharedKV(eqx.Module):
        writer: Attn
        reader_wo: jax.Array

        def __call__(self, x, cache, pos):
            x, cache = self.writer(x, cache, pos)
            q = x.reshape(x.shape[0], H, D // H)
            k, v = cache
            ok = jnp.arange(k.shape[0])[None] <= pos + jnp.arange(x.shape[0])[:, None]
            s = jnp.where(ok[None], jnp.einsum("shd,thd->hst", q, k), -1e30)
            o = jnp.einsum("hst,thd->shd", jax.nn.softmax(s, -1), v)
            return x + o.reshape(x.shape) @ self.reader_wo, cache

    keys = jr.split(jr.key(14), 4)
    pairs = [SharedKV(Attn(key=k), jr.normal(k, (D, D)) / D) for k in keys]
    chain = eqxscan.Chain(pairs)
    buffers = eqxscan.layer_buffers(chain, lambda i, pair: cache_of(6))
    assert buffers.nbytes == 4 * 2 * 6 * D * 4  # one cache per pair, not two
    x = jr.normal(jr.key(15), (2, D))
    y, new = chain(x, eqxscan.buffer(buffers), pos=2)
    y_ref, refs = hand_loop(pairs, x, [buffers.layer(i) for i in range(4)], 2)
    assert_close(y, y_ref, 1e-5)
    for i, r in enumerate(refs):
        assert_close(new.layer(i), r, 1e-5)


def test_make_gets_each_layers_own_index_in_a_repeated_pattern():
    # `make` fills each layer's buffer with its index: every layer,
    # lone, in a run or at any place of a repeated pattern, must read back its
    # own (a wrong index inside a repeat once passed every test).
    layers = _chain_layers() + _chain_layers()[:3]
    chain = eqxscan.Chain(layers)
    assert "repeats" in chain.explain()
    seen = []

    def make(i, layer):
        seen.append((i, layer))
        if isinstance(layer, Lone):
            return None
        return jnp.full((layer.window or 5, 2), float(i))

    buffers = eqxscan.layer_buffers(chain, make)
    assert sorted(i for i, _ in seen) == list(range(len(layers)))
    for i, layer in seen:
        assert type(layer) is type(layers[i])
        assert getattr(layer, "window", None) == getattr(layers[i], "window", None)
    for i, layer in enumerate(layers):
        got = buffers.layer(i)
        if isinstance(layer, Lone):
            assert got is None
        else:
            np.testing.assert_array_equal(got, np.full((layer.window or 5, 2), i))
    # Negative numbers count from the end, as `chain[i]` does; out of range says so.
    n = len(layers)
    for i in range(-n, 0):
        assert eqx.tree_equal(buffers.layer(i), buffers.layer(i + n))
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match=f"{bad} is out of range"):
            buffers.layer(bad)


def test_rows_written_into_one_leaf_and_returned_as_two():
    # A layer returning one row-written slice as two leaves (a tied cache):
    # both leaves are written, in the scan and in the loop.
    class Tied(eqx.Module):
        w: jax.Array

        def __call__(self, x, cache, pos):
            k = jax.lax.dynamic_update_slice(cache[0], (x * self.w)[None], (pos, 0))
            return x + k.sum(), (k, k)

    stack = eqxscan.Stacked(lambda k: Tied(jr.normal(k, (4,))), 2, key=jr.key(0))
    cache = (jnp.zeros((2, 3, 4)), jnp.ones((2, 3, 4)))
    x = jnp.ones(4)
    y_ref, refs = hand_loop(stack.unstack(), x, per_layer_list(cache, 2), 1)
    for mode in ("scan", "loop"):
        y, new = stack.with_options(mode=mode)(x, eqxscan.buffer(cache), pos=1)
        assert_close(y, y_ref, 1e-5)
        assert_close(new, jax.tree.map(lambda *a: jnp.stack(a), *refs))


def test_layer_of_batched_buffers_is_refused():
    # Buffers with a batch axis in front (as `jax.vmap` returns them): `layer(i)`
    # would index the batch, so it names the leaf and how to pick a sequence.
    buffers = eqxscan.layer_buffers(eqxscan.Chain(_chain_layers()), _make(4))
    batched = jax.tree.map(lambda a: jnp.stack([a, a + 1, a + 2]), buffers)
    for i in (0, 2, 5):
        with pytest.raises(ValueError, match=r"a\[b\], buffers\)\.layer"):
            batched.layer(i)
        one = jax.tree.map(lambda a: a[1], batched).layer(i)
        assert_close(one, jax.tree.map(lambda a: a + 1, buffers.layer(i)))
    # A batch as large as a group's layers: told apart by the number of axes
    # (it indexed the batch).
    stack = eqxscan.Chain([Attn(key=k) for k in jr.split(jr.key(0), 3)])
    buffers = eqxscan.layer_buffers(stack, lambda i, layer: cache_of(4))
    assert buffers.layout[0][1] == 3
    batched = jax.tree.map(lambda a: jnp.stack([a, a, a]), buffers)
    with pytest.raises(ValueError, match="built of 4 axes with the group's 3 layers"):
        batched.layer(1)
    step = jax.vmap(lambda x, c: stack(x, eqxscan.buffer(c), pos=0), (0, None))
    _, out = step(jnp.ones((3, 1, D)), buffers)
    with pytest.raises(ValueError, match="built of 4 axes"):
        out.layer(1)
    want = jax.tree.map(lambda a: a[2, 1], out.groups[0])  # sequence 2, layer 1
    assert_close(jax.tree.map(lambda a: a[2], out).layer(1), want)
    # A lone layer's buffer came back batched, without a word.
    lone = eqxscan.Chain([Attn(key=jr.key(1), window=3), Attn(key=jr.key(2))])
    buffers = eqxscan.layer_buffers(lone, lambda i, layer: cache_of(3 + i))
    assert [place[2] for place in buffers.layout] == [0, 0]
    batched = jax.tree.map(lambda a: jnp.stack([a, a]), buffers)
    for i in (0, 1):
        with pytest.raises(ValueError, match=r"built of 3 axes as a lone layer's"):
            batched.layer(i)
        assert_close(jax.tree.map(lambda a: a[1], batched).layer(i), buffers.layer(i))


def test_buffer_marked_inside_another_argument_is_refused():
    # Inside another argument (or another marker) the buffer reached each
    # layer whole, unsliced, and a per_layer inside a buffer was not sliced.
    class Pass(eqx.Module):
        w: jax.Array

        def __call__(self, x, cache, *rest):
            return x * self.w, cache

    stack = eqxscan.Stacked(lambda k: Pass(jnp.ones(())), 3, key=jr.key(0))
    x, c = jnp.ones(2), jnp.zeros((3, 2))
    with pytest.raises(TypeError, match="inside its argument 1 after x"):
        stack(x, (eqxscan.buffer(c), 1.0))
    with pytest.raises(TypeError, match="inside its argument 1 after x"):
        stack(x, eqxscan.per_layer(eqxscan.buffer(c)))
    with pytest.raises(TypeError, match="inside 'extra'"):
        stack(x, eqxscan.buffer(c), extra=[eqxscan.buffer(c)])
    with pytest.raises(TypeError, match="holding an eqxscan.per_layer marker"):
        eqxscan.buffer(eqxscan.per_layer(c))
    with pytest.raises(TypeError, match="holding an eqxscan.buffer marker"):
        eqxscan.buffer(eqxscan.buffer(c))


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_a_decode_step_is_tapped_like_the_hand_loop(mode):
    n, stack = 3, stacked(3, mode=mode)
    x, cache = jr.normal(jr.key(1), (2, D)), cache_of(8, (3,))
    rms = eqxscan.stats.rms
    (y, _), got = eqxscan.tap(stack, rms)(x, eqxscan.buffer(cache), pos=1)
    want, h = [], x
    for layer, c in zip(stack.unstack(), per_layer_list(cache, n)):
        h, _ = layer(h, c, 1)
        want.append(rms(h))
    assert_close(got, jnp.stack(want))
    probe = eqxscan.probe(rms, x, n)

    def loss(p, stack):
        (y, _), _ = eqxscan.tap(stack, probe=p)(x, eqxscan.buffer(cache), pos=1)
        return jnp.sum(y**2)

    assert jax.grad(loss)(probe, stack).values.shape == (n,)
    bad = eqx.tree_at(lambda s: s.layers.wo, stack, stack.layers.wo.at[1].set(jnp.nan))
    decode = lambda s, x: jnp.sum(s(x, eqxscan.buffer(cache), pos=1)[0] ** 2)  # noqa: E731
    r = eqxscan.find_nonfinite(bad, decode, x)
    assert (r.where, r.index) == ("forward", 1), r


def test_a_tpu_is_warned_of_a_buffer_it_would_copy(monkeypatch):
    # On a TPU a buffer whose last axis is not a multiple of 128 is laid out
    # with another axis minor, and a scanned step copies it whole: warned, with
    # the fix; a merged-heads cache and any buffer off a TPU pass silently.
    cache = jnp.zeros((2, 16, 4, 64))
    merged = jnp.zeros((2, 16, 256))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqxscan.buffer(cache)  # CPU
        monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
        eqxscan.buffer(merged)
        eqxscan.buffer(jnp.zeros((2, 3)))  # [L, D]: a row per layer
    with pytest.warns(UserWarning, match=r"\[2, 16, 4, 64\].*\n.*\[\.\., T, H \* E\]"):
        eqxscan.buffer((merged, cache))


class _RowAt(eqx.Module):
    # Writes one row at `pos` as given: negative starts reach the primitive.
    w: jax.Array
    negative: bool = eqx.field(static=True)

    def __call__(self, x, cache, pos):
        row = jnp.tanh(x @ self.w)[None]
        opts = {"allow_negative_indices": self.negative}
        cache = jax.lax.dynamic_update_slice(cache, row, (pos, 0), **opts)
        return x + (cache * jnp.arange(1.0, cache.shape[0] + 1)[:, None]).sum(0), cache


@pytest.mark.parametrize("negative, pos", [(False, -1), (True, -11), (True, -2)])
def test_negative_row_starts_write_where_the_layer_would(negative, pos):
    # A start still negative at the primitive (allow_negative_indices=False, or
    # below -T) is clamped to 0 by JAX; the stacked write added T again and
    # wrote the row at the cache's end.
    t, n = 8, 3
    stack = eqxscan.Stacked(
        lambda k: _RowAt(jr.normal(k, (D, D)), negative), n, key=jr.key(0)
    )
    x, cache = jnp.linspace(-1.0, 1.0, D), jr.normal(jr.key(1), (n, t, D))
    _writes_as_the_hand_loop(stack, x, cache, jnp.int32(pos))


def _writes_as_the_hand_loop(stack, x, cache, pos):
    want_x, want = hand_loop(stack.unstack(), x, list(cache), pos)
    for mode in ("scan", "loop"):
        call = eqx.filter_jit(lambda s, x, c, p: s(x, eqxscan.buffer(c), pos=p))
        y, new = call(stack.with_options(mode=mode), x, cache, pos)
        assert_close(y, want_x, 1e-5)
        assert_close(new, jnp.stack(want))


class _ScalarAt(eqx.Module):
    w: jax.Array

    def __call__(self, x, cache, pos):
        cache = jax.lax.dynamic_update_slice(cache, jnp.tanh(x * self.w), (pos,))
        return x + jnp.sum(cache * jnp.arange(1.0, cache.shape[0] + 1)), cache


@pytest.mark.parametrize("pos", [np.uint32(2**31 + 5), np.uint8(200), np.uint32(2)])
def test_unsigned_row_starts_write_where_the_layer_would(pos):
    # A uint32 start past 2**31 was cast to a negative int32 before the stacked
    # write, which put the row at 0; the layer's own write clamps it to the end.
    n = 3
    stack = eqxscan.Stacked(lambda k: _ScalarAt(jr.normal(k, (1,))), n, key=jr.key(0))
    x, cache = jnp.ones(1), jr.normal(jr.key(1), (n, 8))
    _writes_as_the_hand_loop(stack, x, cache, jnp.asarray(pos))


def test_training_through_a_long_cache_keeps_slices_by_default():
    # `remat="auto"` chose full remat for 32 layers (a step's residuals over
    # 4 MiB), which saves each step's carry: the whole cache once a layer,
    # 70 MiB of temp where saving everything held 7.6.
    n, t, x = 32, 2048, jnp.ones((1, D))
    cache = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), cache_of(t))

    def temp(stack):
        loss = lambda s, c: jnp.sum(s(x, eqxscan.buffer(c), pos=5)[0] ** 2)
        compiled = jax.jit(jax.grad(loss)).lower(stack, cache).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    stack = stacked(n)
    (choice,) = eqxscan.explain_auto(
        lambda s, c: s(x, eqxscan.buffer(c), pos=5), stack, cache
    )
    assert (choice.remat, choice.rule.remat) == (False, "carry")
    whole = sum(a.nbytes for a in jax.tree.leaves(cache))
    default, full = temp(stack), temp(stack.with_options(remat=True))
    assert default == temp(stack.with_options(remat=False))
    assert default < 6 * whole < full


MAX_LEN = 4  # read by a `make` below; rebound by the test


def test_layer_buffers_follow_what_make_reads():
    # `make` reading a global (a maximum length) was compiled once: after the
    # global changed, the old length came back without a word.
    global MAX_LEN
    make = lambda i, layer: cache_of(MAX_LEN)  # noqa: E731
    models = [stacked(3), eqxscan.Chain(_chain_layers())]
    try:
        for model in models:
            for length in (4, 6):
                MAX_LEN = length
                buffers = eqxscan.layer_buffers(model, make)
                layer = buffers.layer(0) if isinstance(model, eqxscan.Chain) else None
                first = jax.tree.leaves(buffers if layer is None else layer)[0]
                assert first.shape[-3] == length
    finally:
        MAX_LEN = 4


class _Rolling(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x, cache):
        return x + jnp.tanh(self.lin(cache.mean(0))), cache.at[0].set(x)


@pytest.mark.parametrize("reads", ["copy", "view"])
def test_an_eager_loop_mode_call_with_a_buffer_compiles_nothing_again(reads):
    # Eagerly, `reads="copy"` read each layer's slice through a `cond` of fresh
    # branches: a program per layer and call, each kept (24 memory maps a call
    # at L=2, until the process ran out).
    from .helpers import compiles

    make = lambda k: _Rolling(eqx.nn.Linear(8, 8, key=k))  # noqa: E731
    stack = eqxscan.Stacked(make, 3, key=jr.key(0), mode="loop")
    cache, x = jnp.zeros((3, 4, 8)), jnp.linspace(-1, 1, 8)
    call = lambda s: s(x, eqxscan.buffer(cache, reads=reads))  # noqa: E731
    call(stack)
    assert compiles(lambda: [call(stack) for _ in range(3)]) == 0
    # The loop's values and writes are the scan's.
    got, want = call(stack), call(stack.with_options(mode="scan"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
