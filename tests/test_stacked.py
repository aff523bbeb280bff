import dataclasses
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqxscan
from eqxscan.remat import THRESHOLDS

from .helpers import once_per_values, stable_id, sub_jaxprs, tree_allclose


SHORT_SCAN = THRESHOLDS.short_scan
OPT = optax.adam(1e-2)


REMATS = [
    False,
    True,
    "auto",
    "nested",
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.nothing_saveable,
]


def rms_norm(scale, x):
    inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return x * inv * jnp.broadcast_to(scale, x.shape)


class Block(eqx.Module):
    """A small layer with a norm, an activation and two matmuls."""

    lin1: eqx.nn.Linear
    lin2: eqx.nn.Linear
    scale: jax.Array

    def __init__(self, dim, *, key):
        k1, k2, k3 = jr.split(key, 3)
        self.lin1 = eqx.nn.Linear(dim, 2 * dim, key=k1)
        self.lin2 = eqx.nn.Linear(2 * dim, dim, key=k2)
        self.scale = 1.0 + 0.1 * jr.normal(k3, (dim,))

    def __call__(self, x, *, key=None):
        h = jax.nn.gelu(self.lin1(rms_norm(self.scale, x)))
        if key is not None:
            h = h + 0.1 * jr.normal(key, h.shape)
        return x + self.lin2(h)


def make_stack(L, dim=4, key=None, **kw):
    key = jr.key(0) if key is None else key
    return eqxscan.Stacked(lambda k: Block(dim, key=k), L, key=key, **kw)


def python_loop(layers, x, key=None):
    keys = [None] * len(layers) if key is None else list(jr.split(key, len(layers)))
    for layer, k in zip(layers, keys, strict=True):
        x = layer(x, key=k)
    return x


def test_layer_i_is_make_layer_of_key_i():
    key = jr.key(3)
    stack = make_stack(5, key=key)
    for i, k in enumerate(jr.split(key, 5)):
        assert eqx.tree_equal(stack[i], Block(4, key=k))
    assert stack.layers.lin1.weight.shape == (5, 8, 4)
    assert len(stack) == stack.num_layers == 5


@pytest.mark.parametrize("mode", ["scan", "loop"])
@pytest.mark.parametrize("remat", REMATS, ids=stable_id)
def test_matches_python_loop_values_grads_update(mode, remat, getkey):
    stack = make_stack(5, mode=mode, remat=remat)
    x = jr.normal(getkey(), (3, 4))
    key = getkey()

    def loss(model, x):
        y = jax.vmap(lambda xi: model(xi, key=key))(x)
        return jnp.mean(y**2)

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(stack, x)
    ref_value, ref_grads, ref_layers = loop_reference(stack.unstack(), x, key)
    assert jnp.allclose(value, ref_value, rtol=1e-5)
    assert type(grads) is eqxscan.Stacked
    assert tree_allclose(grads.unstack(), ref_grads, rtol=1e-4, atol=1e-6)

    # One optax step on the stacked model equals one on the list of layers.
    params = eqx.filter(stack, eqx.is_array)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = OPT.update(grads, OPT.init(params), params)
    new_stack = eqx.apply_updates(stack, updates)
    assert tree_allclose(new_stack.unstack(), ref_layers, rtol=1e-4, atol=1e-6)


@once_per_values  # every case above has the same layers, x and key
def loop_reference(layers, x, key):
    """The Python loop's value, gradients and layers after one Adam step."""
    y = lambda layers, x: jax.vmap(lambda xi: python_loop(layers, xi, key))(x)
    loss = lambda layers, x: jnp.mean(y(layers, x) ** 2)
    value, grads = jax.jit(jax.value_and_grad(loss))(layers, x)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes floats and int32
        updates, _ = OPT.update(grads, OPT.init(layers), layers)
    return value, grads, optax.apply_updates(layers, updates)


def test_matches_hand_written_equinox_recipe(getkey):
    # The recipe from Equinox's docs: filter_vmap, partition, lax.scan, combine.
    key = getkey()
    dynamic, static = eqx.partition(
        eqx.filter_vmap(lambda k: Block(4, key=k))(jr.split(key, 6)), eqx.is_array
    )

    def recipe(x):
        def f(x, layer):
            return eqx.combine(layer, static)(x), None

        return jax.lax.scan(f, x, dynamic)[0]

    stack = make_stack(6, key=key)
    x = jr.normal(getkey(), (4,))
    assert jnp.allclose(stack(x), recipe(x), rtol=1e-6, atol=1e-6)
    g1 = jax.grad(lambda x: stack(x).sum())(x)
    g2 = jax.grad(lambda x: recipe(x).sum())(x)
    assert jnp.allclose(g1, g2, rtol=1e-5, atol=1e-6)


# Unoptimised arithmetic rounds the 7-layer gradients ~3e-6 apart (O(1) values),
# past this tolerance; optimised, ~2e-6.
@pytest.mark.optimized
@pytest.mark.parametrize("L", [1, 2, 7, 16])
def test_nested_any_depth(L, getkey):
    # Primes and perfect squares: blocks of ceil(sqrt(L)) plus a remainder.
    stack = make_stack(L, remat="nested")
    x = jr.normal(getkey(), (4,))
    key = getkey()

    @eqx.filter_jit
    def value_and_grad(m):
        return eqx.filter_value_and_grad(lambda m: m(x, key=key).sum())(m)

    value, g = value_and_grad(stack)
    ref_value, g_ref = value_and_grad(stack.with_options(remat=False))
    # The value sums O(1) terms to about 0.03: float32 rounding in a different
    # order moves it by ~1e-7 absolute, over 1e-6 relative (seen once in CI).
    assert jnp.allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    assert tree_allclose(g.layers, g_ref.layers, rtol=1e-5)


def test_nested_saves_sqrt_many_carries():
    # With remat, what is saved is (about) one carry per outer step plus one
    # block's worth: count the carry-sized residuals.
    L, dim = 64, 32
    stack = make_stack(L, dim=dim, remat="nested")
    x = jnp.ones((dim,))
    f = jax.linearize(lambda m: m(x), stack)[1]
    saved = [
        leaf
        for leaf in jtu.tree_leaves(f)
        if eqx.is_array(leaf) and leaf.shape[-1:] == (dim,) and leaf.ndim == 2
    ]
    assert saved and max(leaf.shape[0] for leaf in saved) <= 16


@pytest.mark.parametrize("unroll", [1, 2, 5, True])
def test_unroll(unroll, getkey):
    stack = make_stack(5, unroll=unroll)
    x = jr.normal(getkey(), (4,))
    assert jnp.allclose(stack(x), python_loop(stack.unstack(), x), rtol=1e-5)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("unroll", [1, 2, 5, True])
def test_unroll_reaches_the_program(unroll):
    # Unrolling never changes values, so look at the program: `unroll` reaches
    # `lax.scan`, and `True` leaves no scan but every layer's two matmuls.
    stack = make_stack(5, unroll=unroll, remat=False)
    jaxpr = jax.make_jaxpr(lambda x: stack(x))(jnp.ones(4)).jaxpr
    eqns = list(_eqns(jaxpr))
    scans = [e.params["unroll"] for e in eqns if e.primitive.name == "scan"]
    dots = sum(e.primitive.name == "dot_general" for e in eqns)
    if unroll is True:
        assert (scans, dots) == ([], 10)
    else:
        assert (scans, dots) == ([unroll], 2)


def test_keys_are_split_per_layer():
    class Noise(eqx.Module):
        w: jax.Array

        def __call__(self, x, *, key):
            return x * self.w + jr.normal(key, x.shape)

    stack = eqxscan.Stacked(lambda k: Noise(jr.uniform(k, (3,))), 4, key=jr.key(1))
    key = jr.key(2)
    expected = jnp.zeros(3)
    for layer, k in zip(stack.unstack(), jr.split(key, 4), strict=True):
        expected = expected * layer.w + jr.normal(k, (3,))
    for mode in ("scan", "loop"):
        out = stack.with_options(mode=mode)(jnp.zeros(3), key=key)
        assert jnp.allclose(out, expected, rtol=1e-6)


def test_same_key_same_weights_whatever_options():
    a = make_stack(4, key=jr.key(9))
    b = make_stack(4, key=jr.key(9), mode="loop", remat=True, unroll=2)
    assert eqx.tree_equal(a.layers, b.layers)


def test_unstack_from_layers_round_trip():
    stack = make_stack(4)
    layers = stack.unstack()
    again = eqxscan.Stacked.from_layers(layers)
    assert eqx.tree_equal(again.layers, stack.layers)
    assert eqx.tree_equal(again.unstack(), layers)
    assert again.num_layers == 4


def test_indexing_and_slicing():
    stack = make_stack(5)
    layers = stack.unstack()
    assert eqx.tree_equal(stack[-1], layers[4])
    assert eqx.tree_equal(stack[-5], layers[0])
    sub = stack[1:4]
    assert isinstance(sub, eqxscan.Stacked) and len(sub) == 3
    assert eqx.tree_equal(sub.unstack(), layers[1:4])
    assert eqx.tree_equal(stack[::2].unstack(), layers[::2])
    for bad in (5, -6, 100):
        with pytest.raises(IndexError, match="out of range"):
            stack[bad]
    with pytest.raises(ValueError, match="selects no layers"):
        stack[3:3]
    with pytest.raises(TypeError, match="index"):
        stack[1.0]
    # A bool is an int to Python but a mask to NumPy and JAX: refused.
    for flag in (True, False):
        with pytest.raises(TypeError, match="ints or slices, got bool"):
            stack[flag]
        with pytest.raises(TypeError, match="ints or slices, got bool"):
            eqxscan.Chain(layers)[flag]
    # A traced index cannot be range-checked (JAX would clamp it): say so.
    with pytest.raises(TypeError, match="traced index.*static"):
        jax.jit(lambda i: stack[i])(1)


def test_with_options_keeps_weights_and_unset_options():
    stack = make_stack(3, remat=True, unroll=3)
    other = stack.with_options(mode="loop")
    assert other.layers is stack.layers
    assert (other.mode, other.remat, other.unroll) == ("loop", True, 3)
    with pytest.raises(ValueError, match="mode"):
        stack.with_options(mode="fast")


def test_broadcast_module_gradient_is_sum_over_layers(getkey):
    # A module passed to every layer: its gradient is the sum of what each layer
    # contributes, which is what per-layer copies of it receive.
    class UsesShared(eqx.Module):
        w: jax.Array

        def __call__(self, x, shared):
            return jnp.tanh(self.w * shared(x))

    L = 4
    stack = eqxscan.Stacked(lambda k: UsesShared(jr.normal(k, (3,))), L, key=getkey())
    shared = eqx.nn.Linear(3, 3, key=getkey())
    x = jr.normal(getkey(), (3,))

    def loss(shared, stack):
        return jnp.sum(stack(x, shared) ** 2)

    g_shared = jax.grad(loss)(shared, stack)

    copies = eqx.filter_vmap(lambda _: shared, axis_size=L)(jnp.arange(L))

    def loss_copies(copies):
        return jnp.sum(stack(x, eqxscan.per_layer(copies)) ** 2)

    g_copies = jax.grad(loss_copies)(copies)
    summed = jtu.tree_map(lambda g: g.sum(0), g_copies)
    assert tree_allclose(g_shared, summed, rtol=1e-5)
    assert float(jnp.abs(g_shared.weight).sum()) > 0
    # And the loop mode agrees.
    g_loop = jax.grad(loss)(shared, stack.with_options(mode="loop"))
    assert tree_allclose(g_shared, g_loop, rtol=1e-5)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_per_layer_positional_and_keyword(mode):
    class AddBias(eqx.Module):
        w: jax.Array

        def __call__(self, x, b, *, c, scale):
            return (x + b["b"]) * self.w * scale + c

    L = 3
    stack = eqxscan.Stacked(
        lambda k: AddBias(jr.uniform(k, (2,))), L, key=jr.key(0), mode=mode
    )
    bs = {"b": jnp.arange(L * 2.0).reshape(L, 2)}
    cs = jnp.arange(L, dtype=jnp.float32)[:, None] * jnp.ones((L, 2))
    out = stack(jnp.ones(2), eqxscan.per_layer(bs), c=eqxscan.per_layer(cs), scale=2.0)
    expected = jnp.ones(2)
    for i, layer in enumerate(stack.unstack()):
        expected = (expected + bs["b"][i]) * layer.w * 2.0 + cs[i]
    assert jnp.allclose(out, expected, rtol=1e-6)


def test_scan_collects_ys_and_none():
    class Emit(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            x = x * self.w
            return x, {"x": x, "sum": x.sum(), "tag": "emit"}

    class EmitNone(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x * self.w, None

    stack = eqxscan.Stacked(lambda k: Emit(jr.uniform(k, (2,))), 3, key=jr.key(0))
    for mode in ("scan", "loop"):
        s = stack.with_options(mode=mode)
        final, ys = s.scan(jnp.ones(2))
        assert ys["x"].shape == (3, 2) and ys["sum"].shape == (3,)
        assert ys["tag"] == "emit"  # non-array leaves are kept, not stacked
        assert jnp.allclose(ys["x"][-1], final)
        assert jnp.allclose(ys["x"][0], stack.layers.w[0])
        none_stack = eqxscan.Stacked.from_layers(
            [EmitNone(layer.w) for layer in s.unstack()], mode=mode
        )
        final2, ys2 = none_stack.scan(jnp.ones(2))
        assert ys2 is None and jnp.allclose(final2, final)
    with pytest.raises(TypeError, match=r"\(carry, y\) pair"):
        make_stack(2).scan(jnp.ones(4))


def test_scan_ys_non_array_leaves_same_in_both_modes():
    # Non-array leaves of y are kept as they are (not stacked), in both modes.
    class Tagged(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            x = x * self.w
            return x, {"x": x, "name": "tagged", "scale": 2.0}

    stack = eqxscan.Stacked(lambda k: Tagged(jr.uniform(k, (2,))), 3, key=jr.key(0))
    out = {m: stack.with_options(mode=m).scan(jnp.ones(2)) for m in ("scan", "loop")}
    for _, ys in out.values():
        assert ys["name"] == "tagged" and ys["scale"] == 2.0
        assert ys["x"].shape == (3, 2)
    assert tree_allclose(out["scan"], out["loop"])


def test_pytree_carry_with_static_leaf():
    class Layer(eqx.Module):
        w: jax.Array

        def __call__(self, carry):
            h, (c, tag) = carry
            return h * self.w + c, (c + 1.0, tag)

    stack = eqxscan.Stacked(lambda k: Layer(jr.uniform(k, (2,))), 3, key=jr.key(0))
    carry = (jnp.ones(2), (jnp.zeros(2), "tag"))
    out_scan = stack(carry)
    out_loop = stack.with_options(mode="loop")(carry)
    assert out_scan[1][1] == "tag"
    assert tree_allclose(out_scan, out_loop)


# --- errors --------------------------------------------------------------------


class Promotes(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return {"h": x["h"] * self.w}  # float32 weights promote a bf16 carry


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_carry_dtype_promotion_error(mode):
    stack = eqxscan.Stacked(
        lambda k: Promotes(jr.normal(k, (3,))), 2, key=jr.key(0), mode=mode
    )
    x = {"h": jnp.ones(3, jnp.bfloat16)}
    with jax.numpy_dtype_promotion("standard"), pytest.raises(TypeError) as info:
        stack(x)
    msg = str(info.value)
    assert "carry['h']" in msg and "bfloat16[3]" in msg and "float32[3]" in msg
    assert "Promotes" in msg and "(a dtype promotion: cast" in msg
    if mode == "loop":
        assert "Layer 0" in msg


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_carry_structure_and_shape_errors(mode):
    class Grows(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jnp.concatenate([x, self.w])

    class Restructures(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return (x * self.w, x)

    grow = eqxscan.Stacked(lambda k: Grows(jnp.ones(1)), 2, key=jr.key(0), mode=mode)
    with pytest.raises(TypeError, match=r"carry` from float32\[3\] to float32\[4\]"):
        grow(jnp.ones(3))
    restr = eqxscan.Stacked(
        lambda k: Restructures(jnp.ones(3)), 2, key=jr.key(0), mode=mode
    )
    with pytest.raises(TypeError, match="tree structure"):
        restr(jnp.ones(3))

    class FillsIn(eqx.Module):
        w: jax.Array

        def __call__(self, c):
            return {"x": c["x"] * self.w, "extra": c["x"]}

    fill = eqxscan.Stacked(lambda k: FillsIn(jnp.ones(3)), 2, key=jr.key(0), mode=mode)
    # The message names the first leaf that differs, the input's side first.
    with pytest.raises(TypeError, match="tree structure") as info:
        fill({"x": jnp.ones(3), "extra": None})
    assert "At `carry['extra']` the input has None but the output has float32[3]" in (
        str(info.value)
    )


class _Signed(eqx.Module):
    w: jax.Array
    sign: object = eqx.field(static=True)
    flag: object = True  # a Python leaf

    def __call__(self, x):
        return (
            x
            * self.w
            * jnp.copysign(1.0, self.sign)
            * (2.0 if self.flag is True else 3.0)
        )


@pytest.mark.parametrize(
    "field, a, b",
    [
        ("sign", 0.0, -0.0),
        ("sign", 1, 1.0),
        ("flag", True, 1),
        ("flag", 0.0, -0.0),
    ],
)
def test_values_equal_but_not_the_same_are_not_stacked_as_one(field, a, b):
    # Python's `==` (and so a treedef's) takes 0.0 for -0.0 and True for 1:
    # stacked, layer 1 ran with layer 0's value (another output, no error).
    w = jnp.ones(3)
    layers = [_Signed(w, **{"sign": 1.0, field: v}) for v in (a, b)]
    with pytest.raises(
        ValueError, match=rf"layer 1 \(_Signed\) cannot be stacked.*`\.{field}`"
    ):
        eqxscan.Stacked.from_layers(layers)
    chain = eqxscan.Chain(layers)
    want = layers[1](layers[0](w))
    np.testing.assert_array_equal(chain(w), want)
    assert [repr(getattr(m, field)) for m in chain.unstack()] == [repr(a), repr(b)]


def test_one_dtype_written_two_ways_still_stacks():
    w = jnp.ones(3)
    layers = [_Signed(w, jnp.float32), _Signed(w, jnp.dtype("float32"))]
    assert len(eqxscan.Stacked.from_layers(layers)) == 2
    assert len(eqxscan.Chain(layers).groups) == 1


def test_from_layers_errors():
    a = Block(4, key=jr.key(0))
    wrong_shape = Block(5, key=jr.key(1))
    with pytest.raises(ValueError) as info:
        eqxscan.Stacked.from_layers([a, a, wrong_shape])
    msg = str(info.value)
    assert "layer 2" in msg and ".lin1.weight" in msg
    assert "float32[8,4]" in msg and "float32[10,5]" in msg

    wrong_dtype = jtu.tree_map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_array(x) else x, a
    )
    with pytest.raises(ValueError, match=r"bfloat16\[8,4\]"):
        eqxscan.Stacked.from_layers([a, wrong_dtype])
    # Iterables that are no sequence of layers (a dict stacked its keys).
    for bad, name in (({"a": a}, "dict"), ("ab", "str"), (a, "Block")):
        with pytest.raises(TypeError, match=f"sequence of layers, got {name}"):
            eqxscan.Stacked.from_layers(bad)  # pyright: ignore[reportArgumentType]
    assert len(eqxscan.Stacked.from_layers(layer for layer in [a, a])) == 2
    # Modules that hold layers iterate over them, as before.
    two = eqxscan.Stacked.from_layers(eqx.nn.Sequential([a, a]))
    assert len(eqxscan.Stacked.from_layers(two)) == 2

    relu = eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.relu, key=jr.key(0))
    tanh = eqx.nn.MLP(2, 2, 4, 1, activation=jnp.tanh, key=jr.key(0))
    with pytest.raises(ValueError, match=r"layer 1 .*\.activation"):
        eqxscan.Stacked.from_layers([relu, tanh])
    wide = eqx.nn.MLP(2, 2, 4, 2, key=jr.key(0))
    with pytest.raises(ValueError, match="layer 1"):
        eqxscan.Stacked.from_layers([relu, wide])
    with pytest.raises(ValueError, match="at least one layer"):
        eqxscan.Stacked.from_layers([])


def test_per_layer_leading_axis_error():
    stack = make_stack(3)

    class Takes(eqx.Module):
        w: jax.Array

        def __call__(self, x, extra):
            return x * self.w + extra["b"]

    s = eqxscan.Stacked(lambda k: Takes(jnp.ones(4)), 3, key=jr.key(0))
    with pytest.raises(ValueError) as info:
        s(jnp.ones(4), eqxscan.per_layer({"b": jnp.ones((2, 4))}))
    msg = str(info.value)
    assert "args[0]['b']" in msg and "(2, 4)" in msg and "length 3" in msg
    with pytest.raises(ValueError, match=r"kwargs\['extra'\]\['b'\]"):
        s(jnp.ones(4), extra=eqxscan.per_layer({"b": jnp.ones(4)}))
    del stack


def test_per_layer_of_numbers_is_refused():
    # `per_layer` slices arrays: a list of numbers reached every layer whole,
    # here each layer adding [1, 2, 3] rather than its own number.
    class Adds(eqx.Module):
        w: jax.Array

        def __call__(self, x, b):
            return x * self.w + jnp.asarray(b, x.dtype)

    s = eqxscan.Stacked(lambda k: Adds(jnp.ones(3)), 3, key=jr.key(0))
    with pytest.raises(TypeError, match=r"per_layer args\[0\] holds no arrays"):
        s(jnp.zeros(3), eqxscan.per_layer([1.0, 2.0, 3.0]))
    want = jnp.full(3, 6.0)  # 1 + 2 + 3, added by layers 0, 1, 2
    got = s(jnp.zeros(3), eqxscan.per_layer(jnp.asarray([1.0, 2.0, 3.0])))
    assert jnp.allclose(got, want)


def test_error_inside_a_layer_names_the_layer():
    class Dropping(eqx.Module):
        lin: eqx.nn.Linear
        drop: eqx.nn.Dropout

        def __call__(self, x, *, key=None):
            return self.drop(self.lin(x), key=key)

    s = eqxscan.Stacked(
        lambda k: Dropping(eqx.nn.Linear(4, 4, key=k), eqx.nn.Dropout(0.5)),
        3,
        key=jr.key(0),
    )
    expected = {
        "loop": "(raised by layer 0 (Dropping), run by eqxscan; see "
        "https://eqxscan.readthedocs.io/en/latest/debugging/)",
        "scan": "(raised by the stacked layer Dropping (one body for all 3 layers)",
    }
    for mode, note in expected.items():
        with pytest.raises(RuntimeError, match="requires a key") as info:
            s.with_options(mode=mode)(jnp.ones(4))
        notes = getattr(info.value, "__notes__", [])
        assert any(n.startswith(note) for n in notes), notes
    assert s(jnp.ones(4), key=jr.key(1)).shape == (4,)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_key_for_layers_without_key_error(mode):
    class NoKey(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return self.lin(x)

    s = eqxscan.Stacked(
        lambda k: NoKey(eqx.nn.Linear(4, 4, key=k)), 3, key=jr.key(0), mode=mode
    )
    with pytest.raises(TypeError) as info:
        s(jnp.ones(4), key=jr.key(1))
    msg = str(info.value)
    assert "Stacked was called with `key=...`" in msg
    assert "NoKey(x) takes no `key` argument" in msg
    assert "NoKey.__call__ a keyword-only `key=None`" in msg
    # Layers taking `**kwargs` are trusted to accept it.
    s2 = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=jr.key(0), mode=mode
    )
    assert s2(jnp.ones(4), key=jr.key(1)).shape == (4,)


CONSTRUCTION_ERRORS = [
    (dict(num_layers=0), ValueError, "num_layers must be >= 1"),
    (dict(num_layers=2.0), TypeError, "num_layers"),
    (dict(num_layers=True), TypeError, "num_layers"),
    # Past the bound: gigabytes of keys, or an abort inside jax.random.split.
    (dict(num_layers=2**62), ValueError, "num_layers must be at most 1048576"),
    (dict(num_layers=2**31), ValueError, "num_layers must be at most"),
    (dict(num_layers=10**9), ValueError, "num_layers must be at most"),
    (dict(mode="unrolled"), ValueError, "mode must be one of"),
    (dict(remat="sqrt"), ValueError, "remat must be one of"),
    (dict(remat=3), TypeError, "remat must be"),
    (dict(unroll=0), ValueError, "unroll must be >= 1"),
    (dict(unroll=1.5), TypeError, "unroll"),
]


@pytest.mark.parametrize("kwargs, exc, match", CONSTRUCTION_ERRORS)
def test_construction_errors(kwargs, exc, match):
    kwargs = {"num_layers": 2, **kwargs}
    with pytest.raises(exc, match=match):
        eqxscan.Stacked(lambda k: Block(2, key=k), key=jr.key(0), **kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [case for case in CONSTRUCTION_ERRORS if "num_layers" not in case[0]],
)
def test_scan_options_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        eqxscan.ScanOptions(**kwargs)
    stack = eqxscan.Stacked(lambda k: Block(2, key=k), 2, key=jr.key(0))
    with pytest.raises(exc, match=match):
        stack.with_options(**kwargs)


def test_options_are_one_frozen_value():
    stack = eqxscan.Stacked(
        lambda k: Block(2, key=k), 2, key=jr.key(0), mode="loop", unroll=2
    )
    assert stack.options == eqxscan.ScanOptions("loop", "auto", 2)
    other = stack.with_options(remat=True)
    assert other.options == eqxscan.ScanOptions("loop", True, 2)
    assert stack.options.remat == "auto"  # unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        stack.options.mode = "scan"
    with pytest.raises(TypeError, match="unexpected keyword argument 'moed'"):
        stack.with_options(moed="loop")
    # Slicing, loading and with_options rebuild through __init__: checks run.
    with pytest.raises(TypeError, match="layer_sharding"):
        stack[:1].with_options(layer_sharding="replicated")


def test_a_misspelt_constructor_keyword_names_the_container():
    # It was "ScanOptions.__init__() got an unexpected keyword argument".
    make = lambda k: Block(2, key=k)  # noqa: E731
    key = jr.key(0)
    stacked = lambda **kw: eqxscan.Stacked(make, 2, key=key, **kw)  # noqa: E731
    for call, what, name in [
        (lambda: stacked(dropout=0.1), "Stacked", "dropout"),
        (lambda: eqxscan.Stacked.from_layers([make(key)], mdoe=1), "Stacked", "mdoe"),
        (lambda: eqxscan.Chain([make(key)], pattern=False), "Chain", "pattern"),
        (lambda: eqxscan.Recurrent(make(key), revers=True), "Recurrent", "revers"),
        (
            lambda: eqxscan.Stacked(lambda k, d: make(k), 2, d=3, key=key),
            "Stacked",
            "d",
        ),
    ]:
        said = rf"{what}\(\) got an unexpected keyword argument '{name}'; "
        with pytest.raises(TypeError, match=said):
            call()


class _Seeded(eqx.Module):
    w: jax.Array
    seed: jax.Array  # a typed key the layer holds

    def __call__(self, x):
        return x * self.w + jax.random.normal(self.seed, x.shape)


def test_with_layer_of_layers_holding_typed_keys():
    # `with_layer` cast every leaf with `astype`, which typed keys lack.
    stack = eqxscan.Stacked(lambda k: _Seeded(jnp.ones(3), k), 3, key=jr.key(0))
    new = _Seeded(jnp.full(3, 2.0), jr.key(7))
    layers = stack.unstack()
    layers[1] = new
    x = want = jnp.ones(3)
    for layer in layers:
        want = layer(want)
    got = stack.with_layer(1, new)
    assert jnp.allclose(got(x), want)
    assert (jr.key_data(got[1].seed) == jr.key_data(new.seed)).all()


# --- program size ----------------------------------------------------------------


def _lowered_lines(stack, x):
    dyn, static = eqx.partition(stack, eqx.is_array)

    def loss(dyn, x):
        return jnp.sum(eqx.combine(dyn, static)(x) ** 2)

    text = jax.jit(jax.grad(loss)).lower(dyn, x).as_text()
    return len(text.splitlines())


def test_program_size_flat_for_scan_growing_for_loop():
    x = jnp.ones(4)
    # From L=9 on: "auto" unrolls stacks of at most `SHORT_SCAN` small layers.
    depths = (SHORT_SCAN + 1, 16, 32)
    scan = [_lowered_lines(make_stack(L), x) for L in depths]
    loop = [_lowered_lines(make_stack(L, mode="loop"), x) for L in depths]
    assert scan[0] == scan[1] == scan[2]
    assert loop[0] < loop[1] < loop[2]
    assert loop[2] > 8 * scan[2] / 2
    # ... up to which the default is the loop's program.
    short = make_stack(SHORT_SCAN)
    assert _lowered_lines(short, x) == _lowered_lines(
        make_stack(SHORT_SCAN, mode="loop"), x
    )


def test_auto_saves_less_than_plain_scan_and_loop():
    # XLA's temp memory is machine-independent for a given program: the default
    # must beat both the plain scan and the unrolled loop.
    model = eqxscan.StackedMLP(64, 16, key=jr.key(0))
    x = jnp.ones((128, 64))

    def temp(blocks_kw):
        m = eqx.tree_at(
            lambda m: m.blocks, model, model.blocks.with_options(**blocks_kw)
        )
        dyn, static = eqx.partition(m, eqx.is_array)
        f = jax.jit(jax.grad(lambda d: jnp.mean(eqx.combine(d, static)(x) ** 2)))
        return f.lower(dyn).compile().memory_analysis().temp_size_in_bytes

    auto, plain, loop = temp({}), temp(dict(remat=False)), temp(dict(mode="loop"))
    assert auto < loop < plain


@pytest.mark.parametrize("method", ["__call__", "scan"])
@pytest.mark.parametrize("bad", ["False", 0, None])
def test_reverse_must_be_a_bool(getkey, method, bad):
    # A string would be truthy and run the layers reversed without a word. The
    # test run's runtime type checks would catch it first: call what a user
    # without them runs.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=getkey())
    run = inspect.unwrap(getattr(eqxscan.Stacked, method))
    with pytest.raises(TypeError, match=f"reverse must be a bool, got .*{bad!r}"):
        run(stack, jnp.ones(4), reverse=bad)
