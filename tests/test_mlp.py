import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from jaxtyping import TypeCheckError

import eqxscan
from eqxscan._models.mlp import rms_norm

from .helpers import tree_allclose, untyped


def hand_written(w1, w2, scale, x):
    """The StackedMLP formula in plain JAX, layer by layer."""
    for i in range(w1.shape[0]):
        x32 = x.astype(jnp.float32)
        h = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        h = h.astype(x.dtype) * scale[i][None]
        h = jax.nn.gelu(h @ w1[i])
        x = x + h @ w2[i]
    return x


def test_layout_and_forward_matches_hand_written(getkey):
    model = eqxscan.StackedMLP(8, 3, key=getkey())
    layers = model.blocks.layers
    assert layers.w1.shape == (3, 8, 32)
    assert layers.w2.shape == (3, 32, 8)
    assert layers.scale.shape == (3, 8)
    assert (model.dim, model.num_layers, model.dtype) == (8, 3, jnp.float32)
    x = jr.normal(getkey(), (5, 8))
    expected = hand_written(layers.w1, layers.w2, layers.scale, x)
    assert jnp.allclose(model(x), expected, rtol=1e-5, atol=1e-5)
    # Unbatched and multi-batch inputs.
    assert jnp.allclose(model(x[0]), expected[0], rtol=1e-5, atol=1e-5)
    assert model(jnp.ones((2, 3, 8))).shape == (2, 3, 8)
    # NumPy inputs are accepted, as by `eqx.nn` layers.
    assert jnp.allclose(model(np.asarray(x)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(mode="loop"), dict(remat=False)])
def test_default_matches_loop_and_no_remat_grads(kw, getkey):
    model = eqxscan.StackedMLP(8, 4, key=getkey())
    other = eqx.tree_at(lambda m: m.blocks, model, model.blocks.with_options(**kw))
    x = jr.normal(getkey(), (6, 8))

    @eqx.filter_jit
    def vg(m):
        return eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)

    (v1, g1), (v2, g2) = vg(model), vg(other)
    assert jnp.allclose(v1, v2, rtol=1e-6)
    assert tree_allclose(g1.blocks.layers, g2.blocks.layers, rtol=1e-5, atol=1e-7)


def test_bfloat16_end_to_end(getkey):
    # unroll=1: the scan itself (so short a stack is unrolled by default).
    model = eqxscan.StackedMLP(8, 3, key=getkey(), dtype=jnp.bfloat16, unroll=1)
    assert model.blocks.layers.w1.dtype == jnp.bfloat16
    x = jr.normal(getkey(), (4, 8)).astype(jnp.bfloat16)
    y = model(x)
    assert y.dtype == jnp.bfloat16
    layers = model.blocks.layers
    ref = hand_written(layers.w1, layers.w2, layers.scale, x)
    assert np.allclose(
        np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2
    )
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x).astype(jnp.float32)))(model)
    assert grads.blocks.layers.w1.dtype == jnp.bfloat16
    # The carry inside the scan stays bf16: no f32 copy of x is ever scanned.
    jaxpr = str(jax.make_jaxpr(lambda x: model(x))(x))
    assert "scan" in jaxpr
    with pytest.raises(TypeError, match="dtype float32.*bfloat16"):
        model(x.astype(jnp.float32))


def test_stacked_shapes_are_type_checked(getkey):
    good = eqxscan.MLPBlock(4, key=getkey())
    bad = eqx.tree_at(lambda b: b.w2, good, jnp.ones((16, 5)))
    with pytest.raises(TypeCheckError) as info:
        eqxscan.StackedMLP.from_layers([bad, bad])
    msg = str(info.value)
    assert "w2" in msg and "f32[2,16,5]" in msg.replace("float32", "f32")
    assert "[L, 4*D, D]" in msg
    # A built model passes and round-trips through from_layers.
    model = eqxscan.StackedMLP(4, 2, key=getkey())
    again = eqxscan.StackedMLP.from_layers(model.blocks.unstack())
    assert eqx.tree_equal(again, model)
    # An edit that skips construction is checked at the call, eager or jitted.
    edited = eqx.tree_at(lambda m: m.blocks.layers.scale, model, jnp.ones((2, 1)))
    for call in (lambda m: m(jnp.ones(4)), eqx.filter_jit(lambda m: m(jnp.ones(4)))):
        with pytest.raises(TypeCheckError, match=r"scale float32\[2,1\]"):
            call(edited)


def test_wrong_input_shape_names_the_dimension(getkey):
    model = eqxscan.StackedMLP(8, 2, key=getkey())
    with pytest.raises(TypeCheckError) as info:
        model(jnp.ones((3, 7)))
    msg = str(info.value)
    assert "input x is float32[3,7]" in msg and "[..., D] with D=8" in msg
    assert len(msg.splitlines()) == 2  # a headline and a hint
    with pytest.raises(TypeCheckError, match="D=8"):
        model(np.ones((3, 7), np.float32))


def test_dropout_keys(getkey):
    model = eqxscan.StackedMLP(8, 3, key=getkey(), dropout=0.5)
    x = jr.normal(getkey(), (4, 8))
    with pytest.raises(ValueError, match="needs a `key`"):
        model(x)
    key = getkey()
    y_scan = model(x, key=key)
    loop = eqx.tree_at(
        lambda m: m.blocks, model, model.blocks.with_options(mode="loop")
    )
    assert jnp.allclose(y_scan, loop(x, key=key), rtol=1e-5, atol=1e-6)
    # Each layer gets its own key, split(key, L)[i]: the dropout written out.
    ref, layers = x, model.blocks.layers
    for i, k in enumerate(jr.split(key, 3)):
        h = jax.nn.gelu(rms_norm(layers.scale[i], ref) @ layers.w1[i])
        h = jnp.where(jr.bernoulli(k, 0.5, h.shape), h / 0.5, 0.0)
        ref = ref + h @ layers.w2[i]
    assert jnp.allclose(y_scan, ref, rtol=1e-5, atol=1e-6)
    # Inference mode needs no key and equals the dropout-free computation.
    inference = eqx.nn.inference_mode(model)
    layers = model.blocks.layers
    expected = hand_written(layers.w1, layers.w2, layers.scale, x)
    assert jnp.allclose(inference(x), expected, rtol=1e-5, atol=1e-5)
    assert not jnp.allclose(y_scan, expected, rtol=1e-3)


def test_constructor_errors(getkey):
    with pytest.raises(ValueError, match="dropout"):
        eqxscan.StackedMLP(4, 2, key=getkey(), dropout=1.0)
    with pytest.raises((ValueError, TypeCheckError), match="dim"):
        eqxscan.StackedMLP(0, 2, key=getkey())
    with pytest.raises(ValueError, match="num_layers"):
        eqxscan.StackedMLP(4, 0, key=getkey())
    # Named before anything is built (under the test suite's type checker,
    # a str rate is refused by the annotation, also naming `dropout`).
    with pytest.raises(TypeError, match="dropout"):
        eqxscan.StackedMLP(4, 2, key=getkey(), dropout="0.1")
    for dtype in ("foo", jnp.int32):
        with pytest.raises(TypeError, match="dtype must be a floating dtype"):
            eqxscan.StackedMLP(4, 2, key=getkey(), dtype=dtype)
    with pytest.raises(TypeError, match="blocks"):
        eqxscan.StackedMLP(blocks=3)


@pytest.mark.parametrize(
    "extra",
    [
        dict(dtype=jnp.bfloat16),
        dict(dropout=0.5),
        dict(drop_path=0.1),
        dict(layer_drop=(0.0, 0.2)),
        dict(remat=True),
        dict(num_layers=2),
    ],
)
def test_blocks_with_arguments_they_would_ignore_is_an_error(extra, getkey):
    # Once silently ignored: a float32 model without the asked-for drop rates.
    blocks = eqxscan.StackedMLP(4, 2, key=getkey()).blocks
    assert eqxscan.StackedMLP(blocks=blocks).blocks is blocks
    (name,) = extra
    with untyped(), pytest.raises(TypeError, match=rf"also got {name}, which would"):
        eqxscan.StackedMLP(blocks=blocks, **extra)


def test_with_options_like_every_scanning_module(getkey):
    model = eqxscan.StackedMLP(8, 3, key=getkey(), unroll=2)
    loop = model.with_options(mode="loop")
    assert type(loop) is eqxscan.StackedMLP
    assert loop.options == eqxscan.ScanOptions("loop", "auto", 2)
    assert model.options == eqxscan.ScanOptions("scan", "auto", 2)
    # Same arrays, not copies.
    pairs = zip(jtu.tree_leaves(loop), jtu.tree_leaves(model), strict=True)
    assert all(a is b for a, b in pairs)
    x = jr.normal(getkey(), (2, 8))
    assert jnp.allclose(model(x), loop(x), rtol=1e-5, atol=1e-6)
    again = eqxscan.StackedMLP.from_layers(model.blocks.unstack(), mode="loop")
    assert again.options == eqxscan.ScanOptions("loop")


def test_elman_cell_refuses_inputs_that_are_not_one_step(getkey):
    cell = eqxscan.ElmanCell(3, 5, key=getkey())
    x, h = jr.normal(getkey(), (3,)), jr.normal(getkey(), (5,))
    want = jnp.tanh(cell.weight_ih @ x + cell.weight_hh @ h + cell.bias)
    assert jnp.allclose(cell(x, h), want, rtol=1e-6, atol=1e-6)
    # [3, 5] once broadcast silently to a [5, 5] "hidden state"; the others
    # were dot_general errors naming no argument.
    for bad_x, bad_h in [(jnp.ones((3, 5)), h), (jnp.ones(4), h), (x, jnp.ones(4))]:
        with untyped(), pytest.raises(ValueError, match=r"ElmanCell\(3, 5\) takes one"):
            cell(bad_x, bad_h)
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        eqxscan.ElmanCell(3, 5, dtype=jnp.int32, key=getkey())
    # A string once counted as true: a bias for use_bias="False".
    with untyped(), pytest.raises(TypeError, match=r"use_bias must be a bool"):
        eqxscan.ElmanCell(3, 5, use_bias="False", key=getkey())


def test_rms_norm_returns_the_dtype_of_x(getkey):
    # A float32 scale on a bfloat16 x: once float32 (or a promotion error).
    x = jr.normal(getkey(), (2, 4)).astype(jnp.bfloat16)
    scale = jr.normal(getkey(), (4,))
    y = rms_norm(scale, x)
    x32 = x.astype(jnp.float32)
    want = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    assert y.dtype == jnp.bfloat16
    assert jnp.allclose(y.astype(jnp.float32), want * scale[None], rtol=2e-2)
