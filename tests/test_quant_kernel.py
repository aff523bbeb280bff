"""The Pallas kernel for `x @ q`, run in Pallas's interpreter on CPU
(`kernel="interpret"`), against the XLA path (`kernel="xla"`) and against
`x @ q.dequantize()`: each kind, a few row counts, float32 and bfloat16, shapes
of several blocks; the shapes and orientation it leaves to the XLA path; which
program `kernel="pallas"` lowers for a TPU and for the CPU; a scanned
StackedMLP decode; gradients (the XLA path's); files unchanged."""

import json
import os
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqxscan
from eqxscan import quant
from eqxscan.quant import _kernel


def _weight(shape, kind, dtype=jnp.float32, kernel="interpret"):
    # Columns of very different sizes, so that a wrong scale shows.
    k1, k2 = jr.split(jr.key(sum(shape)))
    w = jr.normal(k1, shape) * jnp.exp(jr.normal(k2, (1, shape[-1])))
    tree = {"w": w.astype(dtype)}
    return quant.quantize(tree, "w", kind=kind, group_size=32, kernel=kernel)["w"]


def _assert_close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    # One rounding of the output apart (bfloat16: 2^-8 of its scale).
    tolerance = (1e-5 if dtype == jnp.float32 else 2.0**-7) * jnp.abs(want).max()
    assert jnp.abs(got - want).max() <= tolerance


def _uses_kernel(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def _contents(path):
    """A safetensors file's header and bytes, less the save's random id."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        data = f.read()
    del header["__metadata__"]["eqxscan.save"]
    return header, data


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("rows, dtype", [(1, jnp.float32), (13, jnp.bfloat16)])
def test_blocks_against_xla_and_dequantized(kind, rows, dtype):
    # [512, 256] in blocks of 128 (int4: 256) inputs by 128 outputs: a grid
    # of 2 by 4 (int4: 2 by 2), each output summed over input blocks.
    q = _weight((512, 256), kind, dtype)
    x = jr.normal(jr.key(1), (rows, 512), dtype)
    block = _kernel.Blocks(16, 256 if kind == "int4" else 128, 128)
    got = _kernel.product(
        x,
        q.values,
        q.scales,
        kind=kind,
        group_size=q.group_size,
        block=block,
        interpret=True,
    )
    _assert_close(got, x @ quant.with_kernel(q, "xla"), dtype)
    _assert_close(got, x @ q.dequantize(), dtype)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_matmul_uses_the_kernel(kind):
    # `x @ q` through `Quantized`, with leading axes: 8 rows of bfloat16.
    q = _weight((256, 384), kind, jnp.bfloat16)
    x = jr.normal(jr.key(2), (2, 4, 256), jnp.bfloat16)
    assert _uses_kernel(lambda x: x @ q, x)
    _assert_close(x @ q, x @ quant.with_kernel(q, "xla"), jnp.bfloat16)


def test_fp8_specials_decoded():
    # Every fp8 code (subnormals, the largest, NaN, both signs) as one output
    # column, by the kernel's two decodings, against the XLA path's.
    codes = jnp.arange(256, dtype=jnp.uint8)[None]
    values = jnp.zeros((8, 256), jnp.uint8).at[0].set(codes[0])
    q = quant.Quantized(values, jnp.ones((1, 256)), "fp8", "x@W", None, "float32")
    x = jnp.zeros((1, 8)).at[0, 0].set(1.0)
    want = x @ quant.with_kernel(q, "xla")
    assert jnp.isnan(want).sum() == 2 and jnp.nanmax(jnp.abs(want)) == 448
    for how in ("bits", "native"):
        got = _kernel.product(
            x,
            q.values,
            q.scales,
            kind="fp8",
            group_size=None,
            block=_kernel.Blocks(8, 8, 256),
            interpret=True,
            fp8=how,
        )
        assert jnp.array_equal(got, want, equal_nan=True), how


def test_what_the_kernel_leaves_to_xla():
    # An output size not a multiple of 128, an input size over 4096 with no
    # aligned divisor, float16, and `q @ x`: the XLA path.
    assert _kernel.blocks("int8", None, 8, 512, 100, jnp.float32) is None
    assert _kernel.blocks("int8", None, 8, 4160 + 32, 128, jnp.float32) is None
    assert _kernel.blocks("int8", None, 8, 512, 128, jnp.float16) is None
    assert _kernel.blocks("int8", None, 8, 96, 128, jnp.float32) is not None
    q = _weight((64, 100), "int4")
    x = jr.normal(jr.key(3), (3, 64))
    assert not _uses_kernel(lambda x: x @ q, x)
    assert jnp.array_equal(x @ q, x @ quant.with_kernel(q, "xla"))
    t = _weight((128, 256), "int8")
    t = quant.Quantized(t.values.T, t.scales.T, "int8", "W@x", None, "float32")
    t = quant.with_kernel(t, "interpret")
    xt = jr.normal(jr.key(4), (128, 3))
    assert not _uses_kernel(lambda x: t @ x, xt)
    assert jnp.array_equal(t @ xt, quant.with_kernel(t, "xla") @ xt)


def test_pallas_lowers_the_kernel_for_tpu_only():
    # "pallas" picks the kernel when lowering for a TPU, the XLA path for the
    # CPU (no TPU needed to lower for one).
    q = _weight((256, 256), "int4", kernel="pallas")
    x = jnp.ones((3, 256))
    step = jax.jit(lambda x: x @ q)
    assert "tpu_custom_call" not in step.lower(x).as_text()
    tpu = step.trace(x).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in tpu
    assert jnp.array_equal(step(x), x @ quant.with_kernel(q, "xla"))
    # A training step too: the kernel forward, the XLA path's backward.
    grad = jax.jit(jax.grad(lambda x, q: jnp.sum(jnp.sin(x @ q))))
    assert jnp.array_equal(grad(x, q), grad(x, quant.with_kernel(q, "xla")))
    tpu = grad.trace(x, q).lower(lowering_platforms=("tpu",)).as_text()
    assert tpu.count("tpu_custom_call") == 1


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_scanned_decode_and_gradients(kind):
    model = eqxscan.StackedMLP(128, 2, key=jr.key(0))
    targets = ["blocks.*.w1", "blocks.*.w2"]
    xla = quant.quantize(model, targets, kind=kind, group_size=32)
    kernel = quant.with_kernel(xla, "interpret")
    x = jr.normal(jr.key(4), (3, 128))
    step = eqx.filter_jit(lambda m, x: m(x))
    assert _uses_kernel(lambda x: kernel(x), x)
    _assert_close(step(kernel, x), step(xla, x), jnp.float32)

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(mx):
        return jnp.sum(jnp.sin(mx[0](mx[1])))

    got, want = grads((kernel, x)), grads((xla, x))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _assert_close(g, w, jnp.float32)
    assert got[0].blocks.layers.w1.scales is not None


def test_kernel_option_and_files():
    model = eqxscan.StackedMLP(64, 2, key=jr.key(0))
    q = quant.quantize(model, "blocks.*.w1", kind="int8", kernel="pallas")
    assert q.blocks.layers.w1.kernel == "pallas"
    xla = quant.with_kernel(q, "xla")
    assert xla.blocks.layers.w1.kernel == "xla"
    with pytest.raises(ValueError, match="with_kernel: kernel must be one of"):
        quant.with_kernel(q, "mosaic")
    with pytest.raises(ValueError, match="quantize: kernel must be one of"):
        quant.quantize(model, "blocks.*.w2", kernel="mosaic")
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "a.safetensors"), os.path.join(tmp, "b.safetensors")
        quant.save(a, q)
        quant.save(b, xla)
        assert _contents(a) == _contents(b)  # the kernel is not saved
        assert eqx.tree_equal(quant.load(a, xla), xla)
        assert eqx.tree_equal(quant.load(b, q), q)


@pytest.mark.parametrize("how", ["bits", "native"])
def test_fp8_decodings_lower_for_tpu(how):
    # Both fp8 decodings pass Pallas's lowering to Mosaic for a TPU (the
    # TPU's own compile is benchmarks/quant_kernel_compile.py's, with libtpu).
    q = _weight((256, 256), "fp8")
    product = jax.jit(
        lambda x, v, s: _kernel.product(
            x,
            v,
            s,
            kind="fp8",
            group_size=None,
            block=_kernel.Blocks(8, 128, 128),
            fp8=how,
        )
    )
    lowered = product.trace(jnp.ones((8, 256)), q.values, q.scales).lower(
        lowering_platforms=("tpu",)
    )
    assert "tpu_custom_call" in lowered.as_text()
