"""Features peer libraries have (Flax, NNX, Haliax, Equinox), each checked against
a hand-written reference: values and gradients, in scan and loop mode."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqxscan
from eqxscan import sharding

from . import partition_model
from .helpers import run_device_script, tree_allclose


IN, HID, T, B = 3, 4, 5, 2
MODES = ("scan", "loop")


def value_and_grads(fn, *args):
    """`fn(*args)` and the gradient of a scalar readout of it w.r.t. every arg."""

    def loss(*a):
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(fn(*a)))

    return fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def elman(key):
    return eqxscan.ElmanCell(IN, HID, key=key)


# ------------------------------------------------------- over time: time_axis


class BatchCell(eqx.Module):
    """A cell on a batch: `x [B, IN]`, `h [B, HID]`."""

    inner: eqxscan.ElmanCell

    def __call__(self, x, h):
        return jax.vmap(self.inner)(x, h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("time_axis", [1, -2])
def test_time_axis_batch_major(mode, time_axis, getkey):
    cell = BatchCell(elman(getkey()))
    h0, xs = jr.normal(getkey(), (B, HID)), jr.normal(getkey(), (B, T, IN))
    rnn = eqxscan.Recurrent(cell, mode=mode)

    def reference(cell, h0, xs):
        h, hs = h0, []
        for t in range(T):
            h = cell(xs[:, t], h)
            hs.append(h)
        return h, jnp.stack(hs, axis=1)

    run = lambda c, h, x: eqxscan.Recurrent(c, mode=mode)(h, x, time_axis=time_axis)
    out, grads = value_and_grads(run, cell, h0, xs)
    assert out[1].shape == (B, T, HID)
    want, want_grads = value_and_grads(reference, cell, h0, xs)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # The same as mapping an unbatched run over the batch.
    per_example = jax.vmap(eqxscan.Recurrent(cell.inner, mode=mode))(h0, xs)
    assert tree_allclose(out, per_example)
    assert tree_allclose(rnn(h0, xs, time_axis=time_axis), out)


def test_time_axis_pytree_and_reverse(getkey):
    # Leaves of different rank, each with time on axis 1; hs follows the carry.
    inner = elman(getkey())
    cell = lambda x, h: jax.vmap(inner)(x["a"] * x["b"], h)
    xs = {"a": jr.normal(getkey(), (B, T, IN)), "b": jr.normal(getkey(), (B, T, 1))}
    h0 = jr.normal(getkey(), (B, HID))
    h_T, hs = eqxscan.Recurrent(cell, reverse=True)(h0, xs, time_axis=1)
    moved = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), xs)
    want_T, want_hs = eqxscan.Recurrent(cell, reverse=True, mode="loop")(h0, moved)
    assert tree_allclose(h_T, want_T) and tree_allclose(hs, jnp.moveaxis(want_hs, 0, 1))
    assert jnp.allclose(hs[:, 0], h_T)  # reversed: the last carry is at t = 0


def test_time_axis_errors(getkey):
    rnn = eqxscan.Recurrent(BatchCell(elman(getkey())))
    h0 = jnp.zeros((B, HID))
    with pytest.raises(ValueError, match=r"xs\['b'\] has shape \(2, 6, 3\).*axis "):
        rnn(h0, {"a": jnp.ones((B, T, IN)), "b": jnp.ones((B, T + 1, IN))}, time_axis=1)
    with pytest.raises(ValueError, match=r"shape \(2, 5, 3\).*no axis time_axis=3"):
        rnn(h0, jnp.ones((B, T, IN)), time_axis=3)
    scalar_carry = eqxscan.Recurrent(lambda x, h: h + jnp.sum(x))
    with pytest.raises(ValueError, match=r"hs.*shape \(\) per step.*time_axis=1"):
        scalar_carry(jnp.float32(0), jnp.ones((B, T)), time_axis=1)


# ------------------------------------------------- over time: broadcast arguments


class MemoryCell(eqx.Module):
    inner: eqxscan.ElmanCell

    def __call__(self, x, h, memory, *, scale, key=None):
        return self.inner(x, h) + scale * jnp.tanh(memory @ h)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_arguments(mode, getkey):
    cell = MemoryCell(elman(getkey()))
    h0, xs = jr.normal(getkey(), (HID,)), jr.normal(getkey(), (T, IN))
    memory, scale = jr.normal(getkey(), (HID, HID)), jnp.float32(0.5)

    def run(cell, h0, xs, memory, scale):
        rnn = eqxscan.Recurrent(cell, mode=mode)
        return rnn(h0, xs, memory, cell_kwargs={"scale": scale})

    def reference(cell, h0, xs, memory, scale):
        h, hs = h0, []
        for t in range(T):
            h = cell(xs[t], h, memory, scale=scale)
            hs.append(h)
        return h, jnp.stack(hs)

    out, grads = value_and_grads(run, cell, h0, xs, memory, scale)
    want, want_grads = value_and_grads(reference, cell, h0, xs, memory, scale)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads, rtol=1e-4)
    assert float(jnp.abs(grads[3]).sum()) > 0 and float(grads[4]) != 0
    # Both directions of a Bidirectional get the constants too.
    bi = eqxscan.Bidirectional(cell, cell)
    (h_f, h_b), _ = bi((h0, h0), xs, memory, cell_kwargs={"scale": scale})
    assert tree_allclose(h_f, want[0])


# ----------------------------------------------------- over time: broadcast_key


class DropCell(eqx.Module):
    """Recurrent dropout on the hidden state: one mask per key."""

    inner: eqxscan.ElmanCell

    def __call__(self, x, h, *, key):
        keep = jr.bernoulli(key, 0.5, h.shape)
        return self.inner(x, jnp.where(keep, h, 0.0))


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_key(mode, getkey):
    cell = DropCell(elman(getkey()))
    h0, xs, key = jr.normal(getkey(), (HID,)), jr.normal(getkey(), (T, IN)), getkey()
    rnn = eqxscan.Recurrent(cell, mode=mode)
    run = lambda c, h, x: eqxscan.Recurrent(c, mode=mode)(
        h, x, key=key, broadcast_key=True
    )

    def reference(cell, h0, xs):
        h, hs = h0, []
        for t in range(T):
            h = cell(xs[t], h, key=key)  # the same key at every step
            hs.append(h)
        return h, jnp.stack(hs)

    out, grads = value_and_grads(run, cell, h0, xs)
    want, want_grads = value_and_grads(reference, cell, h0, xs)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # Split keys (the default) drop other units: the option changes the result.
    assert not tree_allclose(rnn(h0, xs, key=key), out)


# ------------------------------------------- over time: length without inputs


class Generator(eqx.Module):
    """Autoregressive: ignores its input (None) and feeds back its state."""

    weight: jax.Array

    def __call__(self, x, h, *, key=None):
        assert x is None
        h = jnp.tanh(self.weight @ h)
        return h if key is None else h + 0.1 * jr.normal(key, h.shape)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reverse", [False, True])
def test_length_without_inputs(mode, reverse, getkey):
    cell = Generator(jr.normal(getkey(), (HID, HID)))
    h0, key = jr.normal(getkey(), (HID,)), getkey()
    keys = jr.split(key, T)

    def run(cell, h0):
        return eqxscan.Recurrent(cell, mode=mode, reverse=reverse)(
            h0, length=T, key=key
        )

    def reference(cell, h0):
        h, hs = h0, [None] * T
        for t in reversed(range(T)) if reverse else range(T):
            h = hs[t] = cell(None, h, key=keys[t])
        return h, jnp.stack(hs)

    out, grads = value_and_grads(run, cell, h0)
    want, want_grads = value_and_grads(reference, cell, h0)
    assert out[1].shape == (T, HID)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # lax.scan's own spelling of the same run.
    h_T, _ = jax.lax.scan(
        lambda h, k: (cell(None, h, key=k),) * 2, h0, keys, reverse=reverse
    )
    assert jnp.allclose(h_T, out[0], atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_length_zero(mode, getkey):
    cell = elman(getkey())
    lstm = eqx.nn.LSTMCell(IN, HID, key=getkey())
    h0 = jr.normal(getkey(), (HID,))
    rnn = eqxscan.Recurrent(cell, mode=mode)
    generator = eqxscan.Recurrent(lambda x, h: 2 * h, mode=mode)
    for h_T, hs in (rnn(h0, jnp.ones((0, IN))), generator(h0, length=0)):
        assert h_T is h0 and hs.shape == (0, HID) and hs.dtype == h0.dtype
    # As lax.scan with length 0, pytree carries included.
    c0 = (h0, jnp.zeros(HID))
    h_T, hs = eqxscan.Recurrent(lstm, mode=mode)(c0, jnp.ones((0, IN)))
    want = jax.lax.scan(lambda c, x: (lstm(x, c),) * 2, c0, jnp.ones((0, IN)))
    assert tree_allclose((h_T, hs), want)
    # Batch-major, empty time axis: hs keeps the layout.
    _, hs = eqxscan.Recurrent(BatchCell(cell), mode=mode)(
        jnp.zeros((B, HID)), jnp.ones((B, 0, IN)), time_axis=1
    )
    assert hs.shape == (B, 0, HID)
    # Gradient of the final carry w.r.t. h0 is the identity.
    jac = jax.jacobian(lambda h: rnn(h, jnp.ones((0, IN)))[0])(h0)
    assert jnp.array_equal(jac, jnp.eye(HID))


def test_length_errors(getkey):
    rnn = eqxscan.Recurrent(elman(getkey()))
    h0 = jnp.zeros(HID)
    with pytest.raises(ValueError, match=r"length=4 was given, but xs has 5 steps"):
        rnn(h0, jnp.ones((T, IN)), length=4)
    with pytest.raises(ValueError, match="length must be a non-negative int"):
        rnn(h0, length=-1)
    with pytest.raises(ValueError, match="no array leaves.*length=T"):
        rnn(h0)
    # A cell that cannot run fails at T = 0 too, as it would on a longer sequence.
    bad = eqxscan.Recurrent(lambda x, h: jnp.concatenate([h, x]))
    with pytest.raises(TypeError, match="changed carry leaf"):
        bad(h0, jnp.ones((0, IN)))


# ------------------------------------------- sharding: tensor parallelism + FSDP


def test_logical_specs_and_errors(getkey):
    mesh = jax.make_mesh((1, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    model, x, _ = partition_model.make_problem()
    axes, rules = partition_model.AXES, partition_model.RULES
    specs = sharding.logical_shardings(model, mesh, axes, rules).blocks.layers
    # The names are one layer's; the layer axis is added, unsharded.
    assert specs.w1.spec == P(None, "fsdp", "model")
    assert specs.w2.spec == P(None, "model", "fsdp")
    assert specs.scale.spec == P()  # no names and fsdp_axis=None: replicated
    # Unnamed parameters fall back to the FSDP rule; a function gives names too.
    fn = lambda path, leaf: ("mlp", None) if path.endswith("w2") else None
    specs = sharding.logical_shardings(
        model, mesh, fn, rules, fsdp_axis="model", min_size=0
    ).blocks.layers
    assert specs.w2.spec == P(None, "model", None)
    assert specs.w1.spec == P(None, None, "model") and specs.scale.spec == P(
        None, "model"
    )
    # Nested Stackeds: one unsharded axis per level.
    outer = eqxscan.Stacked.from_layers([model.blocks, model.blocks])
    nested = sharding.logical_shardings(outer, mesh, {"*.w1": ("embed", "mlp")}, rules)
    assert nested.layers.layers.w1.spec == P(None, None, "fsdp", "model")
    # Placed and run: the same values as on one device.
    placed = sharding.constrain(
        model, sharding.logical_shardings(model, mesh, axes, rules)
    )
    assert placed.blocks.layers.w1.addressable_shards[0].data.shape == (3, 16, 32)
    assert jnp.allclose(
        eqx.filter_jit(type(model).__call__)(placed, x), model(x), atol=1e-5
    )

    with pytest.raises(
        ValueError,
        match=r"blocks.layers.w1` has shape \(3, 16, 64\)"
        r", so it needs 2 logical names after its 1 layer axis",
    ):
        sharding.logical_shardings(model, mesh, {"*.w1": ("embed",)}, rules)
    with pytest.raises(ValueError, match=r"'vocab' has no rule"):
        sharding.logical_spec(("vocab",), rules)
    with pytest.raises(ValueError, match=r"picks mesh axis 'tensor'.*axes \('fsdp', "):
        sharding.logical_spec(("mlp",), {"mlp": "tensor"}, mesh)
    with pytest.raises(ValueError, match=r"'model' would shard two axes"):
        sharding.logical_spec(("mlp", "heads"), {"mlp": "model", "heads": "model"})
    odd = eqxscan.StackedMLP(5, 2, key=getkey())  # w2 [2, 20, 5]
    with pytest.raises(
        ValueError,
        match=r"w2` with shape \(2, 20, 5\): its axis 'embed' has size 5, which mesh "
        r"axis 'model' of size 2 does not divide",
    ):
        sharding.logical_shardings(
            odd, mesh, {"*.w2": ("mlp", "embed")}, {"mlp": None, "embed": "model"}
        )


@pytest.fixture(scope="module")
def eight_devices():
    return run_device_script("partition_checks.py", timeout=300)


def test_tensor_parallel_eight_devices(eight_devices):
    # A 2 (fsdp) x 4 (model) mesh: one SGD-with-momentum step equals one device,
    # with or without `gather_layers`.
    for name, r in eight_devices.items():
        for err in ("err_loss", "err_grads", "err_params", "err_opt_state"):
            assert r[err] < 1e-5, (name, r)
        assert r["w1_spec"] == r["mu_w1_spec"] == "P(None, 'fsdp', 'model')", r
        assert r["w1_shard"] == [3, 16 // 2, 64 // 4]  # [L, D/fsdp, 4D/model]
    r = eight_devices["plain"]
    # Row-parallel w2: each device holds a partial sum of the block's output,
    # all-reduced over "model" ([B/fsdp, D] activations).
    assert "f32[4,16]" in r["all_reduces"], r
    # FSDP: a layer's weights are all-gathered over "fsdp" ([D, 4D/model]).
    assert "f32[16,16]" in r["all_gathers"], r


def test_tensor_parallel_gather_keeps_model_axis(eight_devices):
    # gather_layers(keep="model"): each step gathers one layer's "fsdp" shards
    # ([D, 4D/4]) and keeps "model" split (the activations are all-reduced),
    # never a whole [D, 4D] weight; keep=() gathers the whole layer.
    kept, whole = eight_devices["kept"], eight_devices["whole"]
    assert "P(None, 'model')" in kept["layer_sharding"], kept
    gathered = [s.replace("[1,", "[") for s in kept["all_gathers"]]
    assert gathered and set(gathered) == {"f32[16,16]"}, kept
    assert "f32[4,16]" in kept["all_reduces"], kept
    whole_gathers = [s.replace("[1,", "[") for s in whole["all_gathers"]]
    assert "f32[16,64]" in whole_gathers and "f32[64,16]" in whole_gathers, whole


# ------------------------------------------------------------ over layers: shared


L, D = 4, 6


class Block(eqx.Module):
    """A layer with a second method, a per-layer scale and optional randomness."""

    w: jax.Array
    b: jax.Array

    def __init__(self, key, scale=1.0):
        kw, kb = jr.split(key)
        self.w = jr.normal(kw, (D, D)) * 0.4 * scale
        self.b = jr.normal(kb, (D,)) * 0.1

    def __call__(self, x, *, key=None):
        h = jnp.tanh(self.w @ x + self.b)
        return h if key is None else h + 0.1 * jr.normal(key, h.shape)

    def decode(self, x, shift, *, key=None):
        h = jnp.sin(self.w.T @ x) + shift
        return h if key is None else h * jr.uniform(key, h.shape)

    def step(self, x, shift):
        y = self.decode(x, shift)
        return y, jnp.sum(y)


def make_stack(getkey, mode="scan", **options):
    return eqxscan.Stacked(lambda k: Block(k), L, key=getkey(), mode=mode, **options)


# ------------------------------------------------ 1. a method other than __call__


@pytest.mark.parametrize("mode", MODES)
def test_method_fold_and_scan(mode, getkey):
    stack = make_stack(getkey, mode)
    x, shift, key = jr.normal(getkey(), (D,)), jr.normal(getkey(), (L, D)), getkey()
    keys = jr.split(key, L)

    def run(stack, x, shift):
        per = eqxscan.per_layer(shift)
        y = stack(x, per, method=Block.decode, key=key)
        carry, ys = stack.scan(x, per, method="step")
        return y, carry, ys

    def reference(stack, x, shift):
        layers = stack.unstack()
        y = x
        for i, layer in enumerate(layers):
            y = layer.decode(y, shift[i], key=keys[i])
        c, ys = x, []
        for i, layer in enumerate(layers):
            c, s = layer.step(c, shift[i])
            ys.append(s)
        return y, c, jnp.stack(ys)

    out, grads = value_and_grads(run, stack, x, shift)
    want, want_grads = value_and_grads(reference, stack, x, shift)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # Any function of (layer, carry, ...) works, like Haliax's fold_via.
    fn = lambda layer, c: layer(c) * 2.0
    assert jnp.allclose(stack(x, method=fn), reference_fold(stack, x, fn), atol=1e-6)


def reference_fold(stack, x, fn):
    for layer in stack.unstack():
        x = fn(layer, x)
    return x


def test_method_errors(getkey):
    stack = make_stack(getkey)
    with pytest.raises(AttributeError, match=r"Block has no method 'encode'"):
        stack(jnp.ones(D), method="encode")
    with pytest.raises(TypeError, match="method"):
        stack(jnp.ones(D), method=3)


# ------------------------------------------------------- 2. all layers in parallel


@pytest.mark.parametrize("mode", MODES)
def test_vmap_over_layers(mode, getkey):
    stack = make_stack(getkey, mode)
    x, shift, key = jr.normal(getkey(), (D,)), jr.normal(getkey(), (L, D)), getkey()
    keys = jr.split(key, L)

    def run(stack, x, shift):
        plain = stack.vmap(x, key=key)
        decoded = stack.vmap(x, eqxscan.per_layer(shift), method=Block.decode)
        return plain, decoded

    def reference(stack, x, shift):
        layers = stack.unstack()
        plain = jnp.stack([layer(x, key=keys[i]) for i, layer in enumerate(layers)])
        decoded = jnp.stack(
            [layer.decode(x, shift[i]) for i, layer in enumerate(layers)]
        )
        return plain, decoded

    out, grads = value_and_grads(run, stack, x, shift)
    assert out[0].shape == (L, D)
    want, want_grads = value_and_grads(reference, stack, x, shift)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    if mode == "scan":
        # One vmap: the program has no loop over the layers.
        text = str(jax.make_jaxpr(lambda s: s.vmap(x))(stack))
        assert "scan" not in text and "while" not in text


# ------------------------------------------------------------ 3. reverse over layers


@pytest.mark.parametrize("mode", MODES)
def test_reverse_stacked(mode, getkey):
    stack = make_stack(getkey, mode)
    x, key = jr.normal(getkey(), (D,)), getkey()
    keys = jr.split(key, L)

    def run(stack, x):
        return stack(x, reverse=True, key=key), stack.scan(
            x, method="step", shift=0.0, reverse=True
        )

    def reference(stack, x):
        layers = stack.unstack()
        y = x
        for i in reversed(range(L)):
            y = layers[i](y, key=keys[i])  # layer i keeps keys[i]
        c, ys = x, [None] * L
        for i in reversed(range(L)):
            c, ys[i] = layers[i].step(c, 0.0)  # ys aligned with the layers
        return y, (c, jnp.stack(ys))

    out, grads = value_and_grads(run, stack, x)
    want, want_grads = value_and_grads(reference, stack, x)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    assert jnp.allclose(stack(x, reverse=True), stack[::-1](x), atol=1e-6)
    if mode == "scan":
        # No reversed copy of the weights: the scan runs backwards instead.
        scanned = stack.with_options(unroll=1)  # L=4 alone would be unrolled
        text = str(jax.make_jaxpr(lambda s: s(x, reverse=True))(scanned))
        assert not re.search(r"\brev\[", text) and "reverse=True" in text


@pytest.mark.parametrize("mode", MODES)
def test_reverse_chain(mode, getkey):
    lin = lambda: eqx.nn.Linear(D, D, key=getkey())
    # A scanned run, a lone layer and a scanned pattern of two.
    layers = [Block(getkey()) for _ in range(3)]
    layers += [eqx.nn.Linear(D, D, use_bias=False, key=getkey())]
    layers += [Block(getkey()), lin(), Block(getkey()), lin()]
    chain = eqxscan.Chain(layers, mode=mode)
    assert [span.period for span in chain.layout] == [1, 0, 2]
    x = jr.normal(getkey(), (D,))

    def run(chain, x):
        return chain(x, reverse=True)

    def reference(chain, x):
        for layer in reversed(chain.unstack()):
            x = layer(x)
        return x

    out, grads = value_and_grads(run, chain, x)
    want, want_grads = value_and_grads(reference, chain, x)
    assert tree_allclose(out, want) and tree_allclose(grads, want_grads)
    # .scan: ys aligned with the layers.
    pairs = eqxscan.Chain([_Pair(layer) for layer in layers], mode=mode)
    c, ys = pairs.scan(x, reverse=True)
    y, want_ys = x, [None] * len(layers)
    for i in reversed(range(len(layers))):
        y, want_ys[i] = _Pair(layers[i])(y)
    assert jnp.allclose(c, y, atol=1e-5) and jnp.allclose(
        ys, jnp.stack(want_ys), atol=1e-5
    )


class _Pair(eqx.Module):
    layer: eqx.Module

    def __call__(self, x):
        y = self.layer(x)
        return y, jnp.sum(y)


# ----------------------------------------------- 4. per-layer construction arguments


@pytest.mark.parametrize("mode", MODES)
def test_per_layer_construction(mode, getkey):
    key, scales = getkey(), jnp.linspace(0.5, 2.0, L)
    offset = jnp.float32(0.25)

    def make_layer(k, scale, index, offset):
        block = Block(k, scale)
        return eqx.tree_at(
            lambda b: b.b, block, block.b + offset * jnp.asarray(index, jnp.float32)
        )

    stack = eqxscan.Stacked(
        make_layer,
        L,
        eqxscan.per_layer(scales),
        eqxscan.per_layer(jnp.arange(L)),
        offset,
        key=key,
        mode=mode,
    )
    keys = jr.split(key, L)
    for i in range(L):
        want = make_layer(keys[i], scales[i], i, offset)
        assert tree_allclose(stack[i], want)
    with pytest.raises(ValueError, match=r"per_layer args\[0\] has shape \(3,\)"):
        eqxscan.Stacked(
            make_layer, L, eqxscan.per_layer(scales[:3]), 0, offset, key=key
        )


# ------------------------------------------------------- 5. Chain is a sequence


def test_chain_is_a_sequence(getkey):
    lin = lambda: eqx.nn.Linear(D, D, key=getkey())
    layers = [
        lin(),
        Block(getkey()),
        lin(),
        Block(getkey()),
        lin(),
        Block(getkey()),
        eqx.nn.Linear(D, D, use_bias=False, key=getkey()),
    ]
    chain = eqxscan.Chain(layers)
    seq = eqx.nn.Sequential(layers)
    assert len(chain) == len(seq) == 7
    for i in range(-7, 7):
        assert tree_allclose(chain[i], seq[i]), i
    assert all(tree_allclose(a, b) for a, b in zip(chain, layers, strict=True))
    x = jr.normal(getkey(), (D,))
    for sl in (
        slice(1, 5),
        slice(None, None, 2),
        slice(-3, None),
        slice(None, None, -1),
    ):
        part = chain[sl]
        assert isinstance(part, eqxscan.Chain) and len(part) == len(layers[sl])
        assert jnp.allclose(part(x), seq[sl](x), atol=1e-5)
    with pytest.raises(
        IndexError, match="Layer index 7 is out of range for a Chain with 7 layers"
    ):
        chain[7]
    with pytest.raises(ValueError, match="selects no layers"):
        chain[3:3]


# --------------------------------------------------------- 6. nested remat shapes


@pytest.mark.parametrize(
    "nested, outer_carries", [(2, 2), (3, 3), ((2, 2, 3), 2), ((3, 4), 3)]
)
def test_nested_shapes(nested, outer_carries, getkey):
    layers = 12
    stack = eqxscan.Stacked(lambda k: Block(k), layers, key=getkey())
    x = jr.normal(getkey(), (D,))
    policy = eqxscan.ScanCheckpoint(nested=nested)
    loss = lambda s, x: jnp.sum(jnp.sin(s(x)))
    want = arrays(jax.value_and_grad(loss, argnums=(0, 1))(stack, x))
    for mode in MODES:
        s = stack.with_options(checkpoint=policy, mode=mode)
        got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
        assert tree_allclose(got, want, rtol=1e-4), (mode, nested)
    # Only the carries at the outermost block boundaries are kept; inner levels
    # are recomputed block by block.
    shapes = residual_shapes(loss, stack.with_options(checkpoint=policy), x)
    assert (outer_carries, D) in shapes and (layers, D) not in shapes, shapes


def arrays(tree):
    """The array leaves only: the gradients of two stacks differ in options."""
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def residual_shapes(fn, *args):
    from jax._src.ad_checkpoint import saved_residuals

    return [tuple(aval.shape) for aval, _ in saved_residuals(fn, *args)]


def test_nested_errors(getkey):
    stack = make_stack(getkey)
    with pytest.raises(ValueError, match=r"nested=\(2, 3\)\) has 6 steps.*has 4"):
        stack.with_options(checkpoint=eqxscan.ScanCheckpoint(nested=(2, 3)))(
            jnp.ones(D)
        )
    with pytest.raises(ValueError, match="two or more positive int lengths"):
        eqxscan.ScanCheckpoint(nested=(4,))
    with pytest.raises(ValueError, match="block count must be >= 1"):
        eqxscan.ScanCheckpoint(nested=0)


# ------------------------------------------ 7. carries and inputs: save / offload


def test_checkpoint_carries_and_inputs(getkey):
    stack = make_stack(getkey)
    x = jr.normal(getkey(), (D,))
    loss = lambda s, x: jnp.sum(jnp.sin(s(x)))
    want = arrays(jax.value_and_grad(loss, argnums=(0, 1))(stack, x))

    def run(**options):
        policy = eqxscan.ScanCheckpoint(**options)
        s = stack.with_options(checkpoint=policy)
        got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
        assert tree_allclose(got, want, rtol=1e-4), options
        from jax._src.ad_checkpoint import saved_residuals

        return [(aval.str_short(), src) for aval, src in saved_residuals(loss, s, x)]

    def made(residuals, shape):
        # Residuals the forward pass made (not the arguments), of one type.
        return [src for a, src in residuals if a == shape and "argument" not in src]

    carries, weights = f"float32[{L},{D}]", f"float32[{L},{D},{D}]"
    full = run(policy=True)  # full remat still keeps each step's carry
    assert made(full, carries) and not made(full, weights), full
    offloaded = run(policy=True, save_carries="offload")
    assert made(offloaded, f"float32<host>[{L},{D}]"), offloaded
    assert not made(offloaded, carries), offloaded
    # Inputs: by default read again from the stacked weights; saved, a copy of
    # each layer as the step used it (after an FSDP gather); or offloaded.
    assert made(run(policy=True, save_inputs=True), weights)
    offloaded = run(policy=True, save_inputs="offload")
    assert made(offloaded, f"float32<host>[{L},{D},{D}]"), offloaded
    # Recomputed carries: only those at the block boundaries (2 blocks of 2).
    recomputed = run(save_carries=False)
    assert not made(recomputed, carries), recomputed
    assert made(recomputed, f"float32[2,{D}]"), recomputed
    # Combined with any jax policy, and with mode="loop".
    run(policy=jax.checkpoint_policies.dots_saveable, save_carries="offload")
    s = stack.with_options(
        checkpoint=eqxscan.ScanCheckpoint(save_carries="offload"), mode="loop"
    )
    got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
    assert tree_allclose(got, want, rtol=1e-4)


def test_checkpoint_policy_errors(getkey):
    # (A runtime type checker may catch these first, by the annotations.)
    with pytest.raises((TypeError, ValueError), match=r"save_carries"):
        eqxscan.ScanCheckpoint(save_carries="host")
    with pytest.raises((TypeError, ValueError), match=r"policy"):
        eqxscan.ScanCheckpoint(policy="nested")
    with pytest.raises((TypeError, ValueError), match="checkpoint"):
        make_stack(getkey, checkpoint="everything")


@pytest.mark.parametrize("mode", MODES)
def test_scan_checkpoint_over_time(mode, getkey):
    cell = MemoryCell(elman(getkey()))
    h0, xs = jr.normal(getkey(), (HID,)), jr.normal(getkey(), (6, IN))
    memory = jr.normal(getkey(), (HID, HID))

    def run(checkpoint, reverse):
        rnn = eqxscan.Recurrent(cell, mode=mode, checkpoint=checkpoint, reverse=reverse)
        return value_and_grads(
            lambda h, m: rnn(h, xs, m, cell_kwargs={"scale": 0.5}), h0, memory
        )

    for reverse in (False, True):
        want = run(False, reverse)
        for policy in (
            eqxscan.ScanCheckpoint(nested=(2, 3), save_carries="offload"),
            eqxscan.ScanCheckpoint(nested=4, save_inputs=True),
        ):
            assert tree_allclose(run(policy, reverse), want, rtol=1e-4), policy
