"""Quantized weights: the stored layouts against NumPy, the rounding bounds of
each kind, and quantized models against the same models on the dequantized
float weights (scan and loop, values and gradients)."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jaxtyping
import ml_dtypes
import numpy as np
import pytest

import eqxscan
from eqxscan import adapters, quant
from eqxscan.quant import Quantized

from .helpers import Dense, TwoDense
from .test_adapters import _assert_close, _call, _losses_and_grads, _random_b


def _weights(getkey, shape=(2, 64, 24)):
    # Columns of very different sizes, and a zero column in layer 1.
    w = jr.normal(getkey(), shape) * jnp.exp(jr.normal(getkey(), (1, 1, shape[-1])))
    return w.at[1, :, 3].set(0.0)


class Holder(eqx.Module):
    w: jax.Array


def _quantize(w, **kwargs):
    """The `Quantized` of `w`'s layers (axis 0), as `quantize` makes it in a stack."""
    stack = eqxscan.Stacked.from_layers([Holder(wi) for wi in w])
    return quant.quantize(stack, "*.w", **kwargs).layers.w


def _nibbles(packed):
    """NumPy's reading of the int4 layout: row 2i the low nibble, 2i+1 the high,
    two's complement."""
    packed = np.asarray(packed).astype(np.int16)
    low, high = packed & 0xF, packed >> 4
    low, high = (np.where(v >= 8, v - 16, v) for v in (low, high))
    out = np.empty(packed.shape[:-2] + (2 * packed.shape[-2], packed.shape[-1]))
    out[..., 0::2, :], out[..., 1::2, :] = low, high
    return out


def test_int8_layout_and_bound(getkey):
    w = _weights(getkey)
    q = _quantize(w, kind="int8")
    wn = np.asarray(w)
    amax = np.abs(wn).max(axis=1, keepdims=True)
    scale = np.where(amax == 0, 1.0, amax / 127)
    assert q.values.dtype == jnp.int8 and q.values.shape == (2, 64, 24)
    np.testing.assert_array_equal(q.scales, scale)  # exactly max abs / limit
    np.testing.assert_array_equal(q.values, np.round(wn / scale))
    assert np.all(np.abs(np.asarray(q.values)) <= 127)
    # Per element within half a step of its column's scale, in every layer.
    err = np.abs(np.asarray(q.dequantize()) - wn)
    assert np.all(err <= scale / 2 * (1 + 1e-5))
    assert np.all(np.asarray(q.dequantize())[1, :, 3] == 0) and scale[1, 0, 3] == 1
    assert (q.shape, q.dtype, q.ndim) == ((2, 64, 24), jnp.float32, 3)


def test_int4_layout_and_bound(getkey):
    w = _weights(getkey)
    q = _quantize(w, kind="int4", group_size=32)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (2, 32, 24)
    assert q.scales.shape == (2, 2, 24) and q.group_size == 32
    wn = np.asarray(w).reshape(2, 2, 32, 24)
    amax = np.abs(wn).max(axis=2)
    scale = np.where(amax == 0, 1.0, amax / 7)
    np.testing.assert_array_equal(q.scales, scale)  # exactly max abs / limit
    expected = np.round(wn / scale[:, :, None, :]).reshape(2, 64, 24)
    np.testing.assert_array_equal(_nibbles(q.values), expected)
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(w)).reshape(2, 2, 32, 24)
    assert np.all(err <= scale[:, :, None, :] / 2 * (1 + 1e-5))
    assert q.shape == (2, 64, 24)


def test_fp8_bound(getkey):
    w = _weights(getkey)
    q = _quantize(w, kind="fp8")
    wn = np.asarray(w)
    amax = np.abs(wn).max(axis=1, keepdims=True)
    scale = np.where(amax == 0, 1.0, amax / 448)
    # The bits of float8_e4m3fn values, as uint8.
    assert q.values.dtype == jnp.uint8
    np.testing.assert_array_equal(q.scales, scale)  # exactly max abs / limit
    stored = (wn / scale).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(q.values, stored.view(np.uint8))
    # float8 values given are stored as their bits.
    again = Quantized(jnp.asarray(stored), q.scales, "fp8", "x@W", None, "float32")
    np.testing.assert_array_equal(again.values, q.values)
    # e4m3: 3 mantissa bits (relative step 2^-3, so 2^-4 rounding); subnormals
    # below 2^-6 are spaced 2^-9.
    err = np.abs(np.asarray(q.dequantize()) - wn)
    assert np.all(err <= 2.0**-4 * np.abs(wn) + 2.0**-10 * scale + 1e-7)


def test_fp8_every_code_dequantizes_as_float8():
    # The integer decoding of the stored bits against ml_dtypes' conversion, for
    # each of the 256 codes (subnormals, both zeros, 448 and NaN included).
    codes = np.arange(256, dtype=np.uint8)
    q = Quantized(
        jnp.asarray(codes[:, None]), jnp.ones((1, 1)), "fp8", "x@W", None, "float32"
    )
    expected = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)[:, None]
    got = np.asarray(q.dequantize())
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


@pytest.mark.parametrize("orientation", ["x@W", "W@x"])
def test_int4_products_equal_the_dequantized_weights(getkey, orientation):
    # int4 multiplies the even and odd input rows by their halves of the weight
    # (no interleaving): the product is the dequantized weight's.
    w = _weights(getkey)
    if orientation == "W@x":
        w = jnp.swapaxes(w, -1, -2)
    one = _layer(_quantize(w, kind="int4", group_size=32, orientation=orientation), 1)
    dense = one.dequantize()
    for shape in [(64,), (3, 64), (2, 3, 64)]:
        x = jr.normal(getkey(), shape)
        if orientation == "x@W":
            got, expected = x @ one, x @ dense
        else:
            x = x if x.ndim == 1 else jnp.swapaxes(x, -1, -2)
            got, expected = one @ x, dense @ x
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_w_at_x_stores_the_transpose(getkey, kind):
    w = _weights(getkey)
    wt = jnp.swapaxes(w, -1, -2)
    a = _quantize(w, kind=kind, group_size=32)
    b = _quantize(wt, kind=kind, group_size=32, orientation="W@x")
    assert b.orientation == "W@x" and b.shape == (2, 24, 64)
    np.testing.assert_array_equal(
        np.asarray(b.values, np.float32),
        np.swapaxes(np.asarray(a.values, np.float32), 1, 2),
    )
    np.testing.assert_array_equal(b.scales, jnp.swapaxes(a.scales, 1, 2))
    np.testing.assert_array_equal(b.dequantize(), jnp.swapaxes(a.dequantize(), 1, 2))
    x = jr.normal(getkey(), (64, 3))
    one = _layer(b, 0)
    # int4 sums the even and odd rows apart: float32 rounding of another order.
    np.testing.assert_allclose(one @ x, one.dequantize() @ x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "int4", "int4-native", "fp8"])
def test_weights_without_elements(kind):
    # No inputs, or no outputs: quantized, multiplied and reported as NumPy
    # multiplies the empty float weight.
    kind, _, storage = kind.partition("-")
    for shape in [(2, 0, 8), (2, 64, 0)]:
        w = np.zeros(shape, np.float32)
        stack = eqxscan.Stacked.from_layers([Holder(jnp.asarray(wi)) for wi in w])
        kw = dict(kind=kind, group_size=32, int4_storage=storage or "packed")
        q = quant.quantize(stack, "*.w", **kw)
        assert q.layers.w.shape == shape
        np.testing.assert_array_equal(q.layers.w.dequantize(), w)
        x = np.ones((3, shape[1]), np.float32)
        np.testing.assert_array_equal(x @ _layer(q.layers.w, 1), x @ w[1])
        assert [(r.max_abs, r.relative) for r in quant.report(stack, q)] == [(0, 0)] * 2


@pytest.mark.parametrize("kind", ["int8", "int4", "int4-native", "fp8"])
def test_a_column_too_small_for_its_scale_dequantizes_to_zero(kind):
    # max / limit is subnormal, flushed to 0: a scale of 0 made fp8's zeros
    # 0/0 = NaN, and the others' values 0, without a word.
    kind, _, storage = kind.partition("-")
    w = np.zeros((1, 64, 3), np.float32)
    w[0, 0, 0], w[0, 5, 1], w[0, :, 2] = 1e-38, -5e-38, 1.0
    stack = eqxscan.Stacked.from_layers([Holder(jnp.asarray(w[0]))])
    kw = dict(kind=kind, group_size=32, int4_storage=storage or "packed")
    q = quant.quantize(stack, "*.w", **kw).layers.w
    assert np.all(np.asarray(q.scales)[..., :2] == 1)
    got = np.asarray(q.dequantize())
    np.testing.assert_array_equal(got[..., :2], 0)  # within 5e-38 of the weights
    x = np.ones((2, 64), np.float32)
    np.testing.assert_allclose(x @ _layer(q, 0), x @ w[0], atol=0.05)


@pytest.mark.parametrize("change", ["dtype", "orientation"])
def test_a_file_into_a_weight_quantized_otherwise_is_refused(getkey, tmp_path, change):
    # The arrays alike (square weights, float32 scales), the static fields
    # not: eqxscan.load computed with the model's without a word.
    w = _weights(getkey, (2, 64, 64))
    stack = eqxscan.Stacked.from_layers([Holder(wi) for wi in w])
    saved = quant.quantize(stack, "*.w", kind="int8")
    other = {
        "dtype": lambda: quant.quantize(
            jax.tree.map(lambda a: a.astype(jnp.bfloat16), stack), "*.w", kind="int8"
        ),
        "orientation": lambda: quant.quantize(
            stack, "*.w", kind="int8", orientation="W@x"
        ),
    }[change]()
    eqxscan.save(tmp_path / "q.safetensors", saved)
    loaded = eqxscan.load(tmp_path / "q.safetensors", saved)
    assert jnp.array_equal(loaded.layers.w.values, saved.layers.w.values)
    with pytest.raises(
        ValueError,
        match=rf"Quantized weight at `\*\.w` was saved with {change}=.*\n"
        r"Hint: build like as the saved model was: quantize a model",
    ):
        eqxscan.load(tmp_path / "q.safetensors", other)


def test_an_optimizer_state_of_a_quantized_model_saves_and_loads(getkey, tmp_path):
    # Its moments of the scales may be bfloat16 (mu_dtype): not a cast model's
    # scales, which the records refuse.
    import optax

    stack = eqxscan.Stacked.from_layers([Holder(wi) for wi in _weights(getkey)])
    q = quant.quantize(stack, "*.w", kind="int8")
    state = optax.adam(1e-3, mu_dtype=jnp.bfloat16).init(
        eqx.filter(q, eqx.is_inexact_array)
    )
    assert state[0].mu.layers.w.scales.dtype == jnp.bfloat16
    eqxscan.save(tmp_path / "opt.safetensors", state)
    loaded = eqxscan.load(tmp_path / "opt.safetensors", state)
    assert eqx.tree_equal(loaded, state)


def _layer(q, i):
    return jax.tree.map(lambda a: a[i], q)


def test_bf16_weights_stay_bf16(getkey):
    w = _weights(getkey).astype(jnp.bfloat16)
    q = _quantize(w, kind="int8")
    assert q.dtype == jnp.bfloat16 and q.dequantize().dtype == jnp.bfloat16
    x = jr.normal(getkey(), (5, 64)).astype(jnp.bfloat16)
    layer = _layer(q, 0)
    y = x @ layer
    assert y.dtype == jnp.bfloat16
    # The stored values go into the matmul and the scales multiply its float32
    # output: rounded once, where a bfloat16 dequantized weight rounds twice.
    v, s = (np.asarray(a, np.float64) for a in layer.stored_arrays())
    exact = (np.asarray(x, np.float64) @ v) * s
    got = np.asarray(y, np.float64)
    np.testing.assert_allclose(got, exact, rtol=2**-8, atol=1e-6)
    by_weight = np.asarray(x @ layer.dequantize(), np.float64)
    assert np.abs(got - exact).max() <= np.abs(by_weight - exact).max()


def test_a_cast_of_the_quantized_model_is_refused_where_used_or_saved(getkey, tmp_path):
    # Casting the float arrays casts the scales, not the static `dtype`: the
    # model asked for float32 inputs, ran on bfloat16 scales, and saved a file
    # that `quant.load` refused.
    targets = ["blocks.*.w1", "blocks.*.w2"]
    model = eqxscan.StackedMLP(64, 2, key=getkey())
    to_bf16 = lambda t: jax.tree.map(  # noqa: E731
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, t
    )
    q16 = to_bf16(quant.quantize(model, targets))
    x = jnp.ones((2, 64), jnp.bfloat16)
    match = r"`blocks\.\*\.w1` has bfloat16 scales.*float32.*\n.*before quantizing"
    for use in (
        lambda: q16(x),
        lambda: q16(x.astype(jnp.float32)),
        lambda: quant.dequantize(q16),
        lambda: quant.save(tmp_path / "m.safetensors", q16),
        lambda: eqxscan.save(tmp_path / "m.safetensors", q16),
    ):
        _raises(TypeError, match, use)
    assert not list(tmp_path.iterdir())
    # The recipe of the hint: cast the float model, then quantize.
    q = quant.quantize(to_bf16(model), targets)
    assert q(x).dtype == jnp.bfloat16 and q.blocks.layers.w1.scales.dtype == jnp.float32


@pytest.mark.parametrize("orientation", ["x@W", "W@x"])
def test_int4_products_in_bfloat16_round_once(getkey, orientation):
    # The products by the even and the odd rows were each rounded to bfloat16
    # before their sum: twice the rounding error of the dequantized weight's.
    w = jr.normal(getkey(), (1, 256, 256)).astype(jnp.bfloat16) / 16
    one = _layer(_quantize(w, kind="int4", group_size=32, orientation=orientation), 0)
    x = jr.normal(getkey(), (8, 256)).astype(jnp.bfloat16)
    mul = (lambda x, w: x @ w) if orientation == "x@W" else (lambda x, w: w @ x.T)
    dense = one.dequantize()
    exact = mul(np.asarray(x, np.float64), np.asarray(dense, np.float64))
    err = lambda y: np.abs(np.asarray(y, np.float64) - exact).max()  # noqa: E731
    got = mul(x, one)
    assert got.dtype == jnp.bfloat16
    assert err(got) <= 1.1 * err(mul(x, dense))


@pytest.mark.parametrize("orientation", ["x@W", "W@x"])
def test_int4_products_keep_a_complex_input_whole(getkey, orientation):
    # Summed in float32 as asked, the halves' products dropped the imaginary
    # part of a complex x without a word (JAX's standard promotion).
    w = jr.normal(getkey(), (1, 64, 64))
    one = _layer(_quantize(w, kind="int4", group_size=32, orientation=orientation), 0)
    x = jax.lax.complex(jr.normal(getkey(), (3, 64)), jr.normal(getkey(), (3, 64)))
    mul = (lambda x, w: x @ w) if orientation == "x@W" else (lambda x, w: w @ x.T)
    with jax.numpy_dtype_promotion("standard"):
        got, expected = mul(x, one), mul(x, one.dequantize())
    assert got.dtype == jnp.complex64
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def _loss_and_grads(model, x):
    return eqx.filter_value_and_grad(lambda m, x: jnp.sum(jnp.sin(m(x))))(model, x)


def _is_q(x):
    return isinstance(x, Quantized)


def _decoded(kind, values):
    """Stored values (`[..., in, out]` layout) as floats, in NumPy."""
    if kind == "fp8":
        return values.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return _nibbles(values) if kind == "int4" else values.astype(np.float32)


def _assert_same_as_dequantized(qmodel, x):
    """`qmodel` (scan and loop) against the model on its dequantized weights: the
    output, the float leaves' gradients, and each quantized weight's scales'
    gradient against the float weight's, folded by hand."""
    fmodel = quant.dequantize(qmodel)
    runs = [_mode(m, mode) for mode in ("scan", "loop") for m in (qmodel, fmodel)]

    @eqx.filter_jit  # one compile for the four runs
    def all_runs(runs, x):
        return [(m(x), _loss_and_grads(m, x)) for m in runs]

    results = all_runs(runs, x)
    for (yq, (lq, gq)), (yf, (lf, gf)) in zip(results[0::2], results[1::2]):
        np.testing.assert_allclose(yq, yf, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lq, lf, rtol=1e-5)
        stored = iter(q for q in jax.tree.leaves(qmodel, is_leaf=_is_q) if _is_q(q))
        pairs = zip(
            jax.tree.leaves(gq, is_leaf=_is_q), jax.tree.leaves(gf), strict=True
        )
        for g, expected in pairs:
            if not _is_q(g):
                np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-5)
                continue
            # d/d scale = sum over the scale's inputs of value * d/dW.
            # `g` holds the gradient of the scales beside the model's values.
            flip = (
                (lambda a: np.swapaxes(a, -1, -2))
                if g.orientation == "W@x"
                else np.asarray
            )
            gw, got = flip(np.asarray(expected)), flip(np.asarray(g.scales))
            values = flip(np.asarray(next(stored).values))
            prod = _decoded(g.kind, values) * gw
            groups = got.shape[-2]
            prod = prod.reshape(*prod.shape[:-2], groups, -1, prod.shape[-1]).sum(-2)
            # Sums of terms up to 127 times larger than the result: an absolute
            # tolerance from the largest.
            atol = 1e-5 * np.abs(prod).max()
            np.testing.assert_allclose(got, prod, rtol=1e-4, atol=atol)


def _mode(model, mode):
    # Every stack of the model in `mode`.
    is_stack = lambda n: isinstance(n, eqxscan.Stacked)  # noqa: E731
    return jax.tree.map(
        lambda n: n.with_options(mode=mode) if is_stack(n) else n,
        model,
        is_leaf=is_stack,
    )


TARGETS = ["blocks.*.w1", "blocks.*.w2"]


# Each kind once in a model run in full; the layouts are checked above per kind.
def test_stacked_mlp_equals_its_dequantized_weights(getkey):
    model = eqxscan.StackedMLP(32, 3, key=getkey())
    q = quant.quantize(model, ["blocks.*.w1", "blocks.*.w2"], kind="int8")
    w1 = q.blocks.layers.w1
    assert isinstance(w1, Quantized) and w1.name == "blocks.*.w1"
    assert w1.values.shape[0] == 3 and w1.shape == (3, 32, 128)
    _assert_same_as_dequantized(q, jr.normal(getkey(), (2, 32)))


class LinearBlock(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, dim, *, key):
        self.linear = eqx.nn.Linear(dim, dim, key=key)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


def test_linear_stack_by_module_type(getkey):
    stack = eqxscan.Stacked(lambda k: LinearBlock(64, key=k), 3, key=getkey())
    q = quant.quantize(stack, eqx.nn.Linear, kind="int4", group_size=32)
    weight = q.layers.linear.weight
    assert weight.orientation == "W@x" and weight.values.shape == (3, 64, 32)
    assert weight.scales.shape == (3, 64, 2) and weight.name.endswith(".weight")
    _assert_same_as_dequantized(q, jr.normal(getkey(), (64,)))


def test_chain(getkey):
    layers = [Dense(jr.normal(getkey(), (32, 32))) for _ in range(2)]
    layers += [TwoDense(jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 32)))]
    q = quant.quantize(eqxscan.Chain(layers), "*.w", kind="fp8")
    stack, two = q.groups
    assert _is_q(stack.layers.w) and _is_q(two.w) and not _is_q(two.v)
    assert stack.layers.w.values.shape == (2, 32, 32)
    _assert_same_as_dequantized(q, jr.normal(getkey(), (3, 32)))


def test_weight_bytes(getkey):
    model = eqxscan.StackedMLP(128, 2, key=getkey())
    targets = ["blocks.*.w1", "blocks.*.w2"]
    f32 = sum(x.nbytes for x in (model.blocks.layers.w1, model.blocks.layers.w2))

    def stored(kind):
        # Shapes only: nothing is computed.
        q = jax.eval_shape(lambda m: quant.quantize(m, targets, kind=kind), model)
        found = [n for n in jax.tree.leaves(q, is_leaf=_is_q) if _is_q(n)]
        assert len(found) == 2
        arrays = [a for n in found for a in (n.values, n.scales)]
        return sum(a.size * a.dtype.itemsize for a in arrays)

    assert stored("int8") <= 0.26 * f32
    assert stored("fp8") <= 0.26 * f32
    assert stored("int4") <= 0.14 * f32


def _unchecked(cls, *fields):
    # The module's own checks, on fields its annotations would refuse first
    # under the tests' runtime type checking (not at a user's call).
    module = object.__new__(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for name, value in zip(names, fields, strict=True):
        object.__setattr__(module, name, value)
    module.__check_init__()


def _raises(error, match, fn):
    with pytest.raises(error, match=match) as info:
        fn()
    assert "\nHint: " in str(info.value)


def test_quantize_errors(getkey):
    model = eqxscan.StackedMLP(32, 3, key=getkey())
    w1 = ["blocks.*.w1"]
    _raises(
        ValueError,
        "group_size must be one of",
        lambda: quant.quantize(model, w1, kind="int4", group_size=48),
    )
    _raises(
        ValueError,
        r"group_size must be one of .* got 32\.0",
        lambda: quant.quantize(model, w1, kind="int4", group_size=32.0),
    )
    _raises(
        ValueError,
        "kind must be one of",
        lambda: quant.quantize(model, w1, kind="int2"),
    )
    # w1 is [32, 128]: 32 inputs, not a multiple of 64.
    _raises(
        ValueError,
        r"`blocks\.\*\.w1` \(float32\[3,32,128\], 1 layer axes\): its input "
        r"size 32 .* group_size=64.*\nHint: pass group_size=32, which divides it",
        lambda: quant.quantize(model, w1, kind="int4", group_size=64),
    )
    # An odd input size.
    odd = eqxscan.Stacked.from_layers([Holder(jnp.ones((33, 8)))] * 2)
    _raises(
        ValueError,
        r"input size 33 .*\nHint: no group size in \[32, 64, 128\] divides it: "
        "quantize this weight with kind='int8' or 'fp8'",
        lambda: quant.quantize(odd, "*.w", kind="int4", group_size=32),
    )
    even = eqxscan.Stacked.from_layers([Holder(jnp.ones((48, 8)))] * 2)
    _raises(
        ValueError,
        r"input size 48 .*\nHint: no group size in \[32, 64, 128\] divides it: "
        r"pass group_size=None \(a scale per channel\), or quantize this weight",
        lambda: quant.quantize(even, "*.w", kind="int4", group_size=32),
    )
    # With a scale per channel, in either storage: two inputs a byte (it was
    # a broadcasting error from packing, for native values at their save).
    for storage in ("packed", "native"):
        _raises(
            ValueError,
            r"input size 33 \(orientation 'x@W'\) is odd, but 'int4' stores two "
            r"inputs a byte.*\nHint: quantize this weight with kind='int8'",
            lambda storage=storage: quant.quantize(
                odd, "*.w", kind="int4", group_size=None, int4_storage=storage
            ),
        )
    _raises(
        ValueError,
        r"\['blocks\.\*\.w3'\] match no array.*'blocks\.\*\.w1'",
        lambda: quant.quantize(model, ["blocks.*.w1", "blocks.*.w3"]),
    )
    _raises(
        ValueError,
        "Linear matches no module",
        lambda: quant.quantize(model, eqx.nn.Linear),
    )
    # A weight quantized already is named as such, not as a missing one.
    _raises(
        ValueError,
        r"`blocks\.\*\.w1` is quantized already \('int8'\)",
        lambda: quant.quantize(quant.quantize(model, w1), w1),
    )
    ints = eqxscan.Stacked.from_layers([Holder(jnp.ones((4, 4), jnp.int32))] * 2)
    _raises(
        TypeError,
        r"`\*\.w` \(int32\[2,4,4\].*not a floating array",
        lambda: quant.quantize(ints, "*.w"),
    )
    _raises(
        ValueError,
        r"`blocks\.\*\.scale` .* 1 axes per layer",
        lambda: quant.quantize(model, "blocks.*.scale"),
    )
    _raises(TypeError, "targets must be", lambda: quant.quantize(model, []))
    # A non-finite weight is named with its layer.
    w = model.blocks.layers.w2.at[2, 5, 1].set(jnp.inf)
    bad = eqx.tree_at(lambda m: m.blocks.layers.w2, model, w)
    _raises(
        ValueError,
        r"`blocks\.\*\.w2` .* NaN or inf in `blocks\.2\.w2`",
        lambda: quant.quantize(bad, "blocks.*.w2"),
    )


@pytest.mark.parametrize("conv", [eqx.nn.Conv2d, eqx.nn.ConvTranspose1d])
def test_a_convolution_targeted_by_type_is_refused(conv, getkey):
    # Its kernel's axes in front of [out, in] were taken for layers of matrices,
    # and the layer failed when called (in XLA's words).
    make = lambda k: conv(4, 4, 3, key=k)  # noqa: E731
    stack = eqxscan.Stacked(make, 2, key=getkey())
    where = rf"the {conv.__name__} at `\.layers` holds a convolution kernel"
    _raises(TypeError, where, lambda: quant.quantize(stack, conv))
    lora = lambda: adapters.add_lora(stack, conv, rank=2, key=getkey())  # noqa: E731
    _raises(TypeError, where, lora)


def test_inconsistent_quantized_raises():
    def make(values, scales, kind="int8", group_size=None, orientation="x@W"):
        return Quantized(values, scales, kind, orientation, group_size, "float32", "w")

    i8, u8 = jnp.zeros((64, 8), jnp.int8), jnp.zeros((32, 8), jnp.uint8)
    _raises(
        ValueError,
        r"`w`: 'int8' values int8\[64,8\] \(x@W\) need float32 scales of shape "
        r"\[1, 8\], got float32\[1,4\]",
        lambda: make(i8, jnp.ones((1, 4))),
    )
    _raises(
        ValueError,
        r"need float32 scales .* got bfloat16\[1,8\]",
        lambda: make(i8, jnp.ones((1, 8), jnp.bfloat16)),
    )
    _raises(
        ValueError,
        "'fp8' values must be uint8",
        lambda: make(i8, jnp.ones((1, 8)), "fp8"),
    )
    # Under the tests' runtime type checking the `Literal` is checked first.
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match="int2"):
        make(i8, jnp.ones((1, 8)), "int2")
    _raises(
        ValueError,
        r"group_size must be one of \[32, 64, 128\] or None for 'int4'",
        lambda: make(u8, jnp.ones((1, 8)), "int4", 48),
    )
    _raises(
        ValueError,
        r"group_size must be one of .* and None otherwise, got 32 for 'int8'",
        lambda: make(i8, jnp.ones((1, 8)), "int8", 32),
    )
    # No group size: a scale per output channel, `[1, out]`.
    assert make(u8, jnp.ones((1, 8)), "int4").shape == (64, 8)
    _raises(
        ValueError,
        r"need float32 scales of shape \[1, 8\], got float32\[2,8\]",
        lambda: make(u8, jnp.ones((2, 8)), "int4"),
    )
    # Scales of another rank: the scales' shape, not native int4's layouts.
    _raises(
        ValueError,
        r"'int8' values int8\[64,8\] \(x@W\) need float32 scales of shape "
        r"\[1, 8\], got float32\[8\]",
        lambda: _unchecked(
            Quantized,
            i8,
            jnp.ones(8),
            "int8",
            "x@W",
            None,
            jnp.dtype("float32"),
            "",
            "xla",
        ),
    )
    _raises(
        ValueError,
        "input size 64 is not a multiple of group_size=128",
        lambda: make(u8, jnp.ones((1, 8)), "int4", 128),
    )
    # The float weight's dtype: not an integer one, which would round.
    _raises(
        ValueError,
        "dtype is the float weight's, a floating dtype, got int32",
        lambda: Quantized(i8, jnp.ones((1, 8)), "int8", "x@W", None, "int32"),
    )
    # W@x: the transpose of every array.
    q = make(u8.T, jnp.ones((8, 2)), "int4", 32, "W@x")
    assert q.shape == (8, 64)


def test_wrong_use_raises(getkey):
    w = _quantize(_weights(getkey), kind="int8")
    one = _layer(w, 0)
    _raises(
        TypeError,
        r"orientation 'x@W' but was used as `q @ x`",
        lambda: one @ jnp.ones((24,)),
    )
    _raises(TypeError, r"1 layer axes in front", lambda: jnp.ones((64,)) @ w)
    _raises(
        TypeError,
        r"got x of shape \(3, 5\).* axis -1 must have size 64",
        lambda: jnp.ones((3, 5)) @ one,
    )
    _raises(
        TypeError, r"`\*\.w` \(int8->float32\[64,24\]\) supports only", lambda: one + 1
    )
    _raises(TypeError, "supports only", lambda: one.T)
    _raises(TypeError, "supports only", lambda: jnp.asarray(one))
    # jnp's products check their arguments first: JAX's own TypeError.
    with pytest.raises(TypeError, match="dot requires ndarray"):
        jnp.dot(jnp.ones((3, 64)), one)


class XW(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return x @ self.weight


def test_a_module_type_used_as_x_at_w_is_pointed_to_a_name_pattern(getkey):
    # A module type's weights are taken as 'W@x' whatever orientation= says:
    # the hint to pass orientation='x@W' to quantize changed nothing.
    model, x = XW(jr.normal(getkey(), (32, 8))), jnp.ones((3, 32))
    hint = r"pass quantize a name pattern and orientation='x@W'"
    for orientation in ("W@x", "x@W"):
        q = quant.quantize(model, XW, orientation=orientation)
        _raises(TypeError, hint, functools.partial(q, x))
    q = quant.quantize(model, "weight", orientation="x@W")  # as the hint says
    np.testing.assert_allclose(q(x), x @ q.weight.dequantize(), rtol=1e-6)


def test_report_against_errors_by_hand(getkey):
    model = eqxscan.StackedMLP(32, 3, key=getkey())
    q = quant.quantize(model, TARGETS, kind="int4", group_size=32)
    report = quant.report(model, q)
    assert [(r.name, r.layer) for r in report] == [
        (name, (i,)) for name in TARGETS for i in range(3)
    ]
    float_weights = {
        "blocks.*.w1": model.blocks.layers.w1,
        "blocks.*.w2": model.blocks.layers.w2,
    }
    deq = quant.dequantize(q)
    deq_weights = {
        "blocks.*.w1": deq.blocks.layers.w1,
        "blocks.*.w2": deq.blocks.layers.w2,
    }
    for r in report:
        w = np.asarray(float_weights[r.name][r.layer[0]], np.float64)
        diff = np.asarray(deq_weights[r.name][r.layer[0]], np.float64) - w
        np.testing.assert_allclose(r.max_abs, np.abs(diff).max(), rtol=1e-6)
        np.testing.assert_allclose(
            r.relative, np.linalg.norm(diff) / np.linalg.norm(w), rtol=1e-5
        )
    assert report.worst().relative == max(r.relative for r in report)
    text = str(report).splitlines()
    assert text[0].split() == "weight layer max abs error relative error".split()
    # A header, a rule, then a row per weight and layer.
    assert text[4].split() == [
        "blocks.*.w1",
        "2",
        f"{report.rows[2].max_abs:.3e}",
        f"{report.rows[2].relative:.3e}",
    ]
    assert len(text) == 2 + 6
    # The wrong pair of models is named.
    _raises(ValueError, "holds no Quantized", lambda: quant.report(model, model))
    shallow = eqxscan.StackedMLP(32, 2, key=getkey())
    # Where they differ is named (once only "different pytree metadata").
    _raises(
        ValueError,
        r"not shaped as .*: at `\.blocks\.layers\.w1` the float model holds "
        r"float32\[2,32,128\], the quantized one float32\[3,32,128\]",
        lambda: quant.report(shallow, q),
    )
    abstract = eqx.filter_eval_shape(quant.quantize, model, TARGETS)
    _raises(
        ValueError,
        r"Quantized weight at `blocks\.\*\.w1` holds no arrays to compare: "
        r"its values are a ShapeDtypeStruct int8\[3,32,128\]",
        lambda: quant.report(model, abstract),
    )
    wide = eqxscan.StackedMLP(64, 3, key=getkey())
    _raises(
        ValueError,
        r"at `blocks\.\*\.w1` the float model holds float32\[3,64,256\]",
        lambda: quant.report(wide, q),
    )
    # Two quantized models: the Quantized was described over 8 lines.
    with pytest.raises(ValueError, match="the float model holds Quantized") as e:
        quant.report(q, q)
    assert len(str(e.value).splitlines()) == 2, str(e.value)


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_qlora_trains_the_adapters_as_on_the_float_base(getkey, kind):
    model = eqxscan.StackedMLP(32, 2, key=getkey())
    q = quant.quantize(model, TARGETS, kind=kind, group_size=32)
    qlora = adapters.add_lora(q, ["blocks.*.w1", "*.w2"], rank=2, key=getkey())
    qlora = _random_b(qlora, getkey())
    lora = qlora.blocks.layers.w1
    assert isinstance(lora.base, Quantized)
    assert lora.base.values is q.blocks.layers.w1.values  # not a copy
    assert lora.a.shape == (2, 1, 32, 2) and lora.dtype == jnp.float32
    # The adapters over the dequantized float base: the reference.
    on_float = quant.dequantize(qlora)
    assert isinstance(on_float.blocks.layers.w1.base, jax.Array)
    loop = qlora.with_options(mode="loop")
    expected, *got = _losses_and_grads(
        jr.normal(getkey(), (2, 32)),
        (_call, on_float),
        (_call, qlora),
        (_call, loop),
    )
    for g in got:
        _assert_close(g, expected)
    # Gradients exist for the adapters only, and are not zero.
    grads = got[0][1].blocks.layers
    assert grads.scale is None and jax.tree.leaves(grads.w1.base) == []
    assert jnp.all(grads.w1.a != 0) and jnp.all(grads.w2.b != 0)


def test_qlora_by_module_type_and_merge(getkey):
    stack = eqxscan.Stacked(lambda k: LinearBlock(64, key=k), 2, key=getkey())
    q = quant.quantize(stack, eqx.nn.Linear, kind="int8")
    qlora = _random_b(
        adapters.add_lora(q, eqx.nn.Linear, rank=2, key=getkey()), getkey()
    )
    weight = qlora.layers.linear.weight
    assert isinstance(weight.base, Quantized) and weight.orientation == "W@x"
    x = jr.normal(getkey(), (64,))
    np.testing.assert_allclose(
        qlora(x), quant.dequantize(qlora)(x), rtol=1e-5, atol=1e-5
    )
    # Merging into a quantized base is refused; the base alone is the Quantized.
    _raises(
        ValueError,
        r"merge: the LoRA at `.*weight` has a quantized base \(int8",
        lambda: adapters.merge(qlora),
    )
    assert adapters.merge(qlora, -1).layers.linear.weight is weight.base
    merged = adapters.merge(quant.dequantize(qlora))
    np.testing.assert_allclose(merged(x), qlora(x), rtol=1e-5, atol=1e-5)


def test_decoding_with_caches(getkey):
    from .test_adapters_decode import _generate, Decoder, L, T
    from .test_buffers import cache_of

    model = Decoder(key=getkey())
    q = quant.quantize(model, ["blocks.*.wqkv", "blocks.*.wo"], kind="int8")
    assert isinstance(q.blocks.layers.wqkv, Quantized)
    step = eqx.filter_jit(
        lambda m, _, t, c, pos: m(t, c, pos), donate="all-except-first"
    )
    prompts = jr.randint(getkey(), (3,), 0, 16, jnp.int32)
    got = _generate(step, q, None, prompts, cache_of(T, (L,)), 3)
    on_float = quant.dequantize(q)
    on_float = eqx.tree_at(
        lambda m: m.blocks, on_float, on_float.blocks.with_options(mode="loop")
    )
    expected = _generate(step, on_float, None, prompts, cache_of(T, (L,)), 3)
    for ours, theirs in zip(got[0], expected[0], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(got[1], expected[1], strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_report_numbers_layers_as_the_state_dict(getkey):
    # A Chain's groups, and a stack in stage order, each numbered their layers
    # from 0 in their stored order: two rows said layer 0.
    from eqxscan.sharding import pipeline_order

    ws = [jr.normal(getkey(), (32, 32)) * (i + 1) for i in range(4)]
    two = TwoDense(jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 32)))
    chain = eqxscan.Chain([Dense(ws[0]), Dense(ws[1]), two, Dense(ws[2])])
    stack = pipeline_order(
        eqxscan.Stacked.from_layers([Holder(w) for w in ws]), stages=2, repeats=2
    )
    for model, by_layer in [(chain, [ws[0], ws[1], two.w, ws[2]]), (stack, ws)]:
        rows = quant.report(model, quant.quantize(model, "*.w"))
        assert sorted(r.layer for r in rows) == [(i,) for i in range(len(by_layer))]
        for r in rows:
            w = np.asarray(by_layer[r.layer[0]])
            scale = np.abs(w).max(axis=0) / 127
            expected = np.abs(np.round(w / scale) * scale - w).max()
            np.testing.assert_allclose(r.max_abs, expected, rtol=1e-4)
    # A stack of stacks: each row names its layer in both, as the state dict
    # does (the inner index alone named two rows the same).
    ws = jr.normal(getkey(), (2, 2, 32, 32)) * jnp.arange(1.0, 5.0).reshape(2, 2, 1, 1)
    nested = eqxscan.Stacked.from_layers(
        [eqxscan.Stacked.from_layers([Holder(w) for w in row]) for row in ws]
    )
    rows = quant.report(nested, quant.quantize(nested, "*.w"))
    assert [r.layer for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        w = np.asarray(ws[r.layer])
        scale = np.abs(w).max(axis=0) / 127
        expected = np.abs(np.round(w / scale) * scale - w).max()
        np.testing.assert_allclose(r.max_abs, expected, rtol=1e-4)


def test_a_nonfinite_weight_is_named_by_its_layer_or_dequantizes_to_nan(getkey):
    # In a Chain's later group, and in a stack in stage order, layer i is not
    # at index i of the arrays: the error named another layer.
    from eqxscan.sharding import pipeline_order

    ones = jnp.ones((32, 32))
    layers = [Dense(ones), Dense(ones), TwoDense(ones, ones)]
    layers += [Dense(ones), Dense(ones.at[3, 1].set(jnp.nan))]
    _raises(
        ValueError,
        r"`\*\.w` \(float32\[2,32,32\], 1 layer axes\) holds NaN or inf in `4\.w`",
        lambda: quant.quantize(eqxscan.Chain(layers), "*.w"),
    )
    ws = [ones.at[0, 0].set(jnp.inf if i == 1 else 1.0) for i in range(4)]
    stack = eqxscan.Stacked.from_layers([Holder(w) for w in ws])
    _raises(
        ValueError,
        "NaN or inf in `1.w`",
        lambda: quant.quantize(pipeline_order(stack, stages=2, repeats=2), "*.w"),
    )
    # Traced, a weight cannot be checked: XLA's max skipped the NaN, stored as 0
    # (int8, int4) or as fp8's NaN code. Its group now dequantizes to NaN.
    w = jnp.ones((2, 32, 64)).at[1, 3, 5].set(jnp.nan)
    stack = eqxscan.Stacked.from_layers([Holder(wi) for wi in w])
    traced = eqx.filter_jit(
        lambda s, kind: quant.quantize(s, "*.w", kind=kind, group_size=32)
    )
    expected = np.zeros(w.shape, bool)
    expected[1, :, 5] = True  # the column its scale multiplies
    for kind in ["int8", "int4", "fp8"]:
        got = traced(stack, kind).layers.w.dequantize()
        np.testing.assert_array_equal(np.isnan(got), expected)


def test_a_float_layer_into_a_quantized_stack_is_named_by_its_type(getkey):
    # The quantized weight's repr spans lines and was cut short, with no hint.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(8, 8, key=k), 3, key=getkey())
    q = quant.quantize(stack, "*.weight")
    with pytest.raises(ValueError) as info:
        q.with_layer(1, eqx.nn.Linear(8, 8, key=getkey()))
    headline, hint = str(info.value).split("\n")
    assert "at `.weight` layer 1 has type Quantized but the new layer has " in headline
    assert "float32[8,8]" in headline and hint.startswith("Hint: ")


def test_both_fp8_conversions_agree_on_every_code():
    # Off CPU the XLA path converts fp8 with XLA's conversion, on CPU by integer
    # work: the two must read every one of the 256 codes alike (NaN codes too).
    from eqxscan.quant._products import e4m3_by_xla, e4m3_to_float32

    codes = jnp.arange(256, dtype=jnp.uint8)
    np.testing.assert_array_equal(
        e4m3_by_xla(codes, jnp.float32), e4m3_to_float32(codes)
    )


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_product_batched_over_groups_matches_the_dequantized_weight(
    getkey, group_size
):
    # The int4 product accelerators run (one matmul batched over the groups,
    # scaled per group), here in float32 on CPU against the dequantized weight.
    from eqxscan.quant._products import grouped_int4_product

    w = jr.normal(getkey(), (256, 48))
    q = quant.quantize(Holder(w), "w", kind="int4", group_size=group_size).w
    x = jr.normal(getkey(), (2, 3, 256))
    got = grouped_int4_product(x, q.values, q.scales, jnp.float32)
    want = x @ q.dequantize()
    # float32 sums in another order: within a few ulps of the largest output.
    np.testing.assert_allclose(got, want, atol=1e-6 * float(jnp.abs(want).max()))
    assert got.shape == (2, 3, 48)


def test_a_lora_and_a_quantized_weight_sharing_a_name_keep_their_records(
    getkey, tmp_path
):
    # Their records differ in kind: the name was dropped whole, and with it
    # the check of the LoRA's alpha.
    ws = [jr.normal(getkey(), (32, 32)) for _ in range(4)]
    chain = eqxscan.Chain([Dense(ws[0]), Dense(ws[1]), TwoDense(ws[2], ws[3])])

    def mixed(alpha):
        lora = adapters.add_lora(chain, "*.w", rank=2, alpha=alpha, key=jr.key(1))
        q = quant.quantize(chain, "*.w", kind="int8")
        return eqx.tree_at(lambda c: c.groups[1], lora, q.groups[1])

    eqxscan.save(tmp_path / "m.safetensors", mixed(4.0))
    assert eqx.tree_equal(
        eqxscan.load(tmp_path / "m.safetensors", mixed(4.0)), mixed(4.0)
    )
    with pytest.raises(ValueError, match=r"LoRA at `\*\.w` was saved with alpha=4"):
        eqxscan.load(tmp_path / "m.safetensors", mixed(8.0))
