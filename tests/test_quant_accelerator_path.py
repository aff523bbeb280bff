"""The products an accelerator runs, run here: every quantized product picks its
branch with `jax.lax.platform_dependent` (CPU: dequantize or integer decoding;
elsewhere: the stored values in the matmul, fp8 by XLA's conversion, int4
batched over its groups). Forcing the non-CPU branch checks on a CPU what a
TPU or GPU computes: scanned models, their gradients, against the
CPU branch and against a finite difference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan
from eqxscan import quant


TARGETS = ["blocks.*.w1", "blocks.*.w2"]
FORMATS = {
    "int8": dict(kind="int8"),
    "fp8": dict(kind="fp8"),
    "int4-packed": dict(kind="int4", group_size=32, int4_storage="packed"),
    "int4-native": dict(kind="int4", group_size=32, int4_storage="native"),
    "int4-channel-native": dict(kind="int4", group_size=None, int4_storage="native"),
}


def _accelerator_branch(*args, default, **branches):
    # What `platform_dependent` lowers on a GPU (and on a TPU where it is given
    # no `tpu=` branch, as these products are not).
    return default(*args)


def _loss(model, x):
    return jnp.mean(model(x) ** 2)


def _run(model, x):
    call = eqx.filter_jit(lambda m, x: (m(x), eqx.filter_grad(_loss)(m, x)))
    gx = jax.jit(jax.grad(lambda x: _loss(model, x)))(x)
    return (*call(model, x), gx)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_accelerator_products_match_the_cpu_ones(monkeypatch, fmt):
    model = eqxscan.StackedMLP(64, 3, key=jr.key(0)).with_options(mode="scan")
    model = quant.quantize(model, TARGETS, **FORMATS[fmt])
    x = jr.normal(jr.key(1), (5, 64))
    want_y, want_g, want_gx = _run(model, x)
    monkeypatch.setattr(jax.lax, "platform_dependent", _accelerator_branch)
    # Scanned, and unrolled fully, as `"auto"` runs a decode step off CPU
    # (unless the product unpacks bits: packed int4).
    y, g, gx = _run(model, x)
    scale = float(jnp.abs(want_y).max())
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5 * scale)
    unrolled = eqx.filter_jit(lambda m, x: m(x))(model.with_options(unroll=True), x)
    np.testing.assert_allclose(unrolled, want_y, rtol=1e-5, atol=1e-5 * scale)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gx, want_gx, rtol=1e-4, atol=1e-7)
    # The accelerator branch's input gradient against a finite difference.
    # (A step of 1e-2: at 1e-3 float32's rounding alone is a 3e-3 error.)
    d = jr.normal(jr.key(2), x.shape)
    eps = 1e-2
    fd = (_loss(model, x + eps * d) - _loss(model, x - eps * d)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(gx, d), fd, rtol=1e-3)


def test_accelerator_fp8_conversion_reads_every_code_as_the_cpu_one(monkeypatch):
    # All 256 codes, NaNs included, through both branches of the conversion.
    from eqxscan.quant._products import fp8_as

    bits = jnp.arange(256, dtype=jnp.uint8)
    want = np.asarray(fp8_as(bits, jnp.float32))
    monkeypatch.setattr(jax.lax, "platform_dependent", _accelerator_branch)
    got = np.asarray(fp8_as(bits, jnp.float32))
    np.testing.assert_array_equal(got, want)
    exact = np.asarray(bits).view(jnp.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, exact)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_one_input_vector_takes_either_branch(monkeypatch, fmt):
    # `x` of shape [in], as a decode step of one sequence calls a layer: both
    # branches give [out]. Native int4 with a scale per channel gave [1, out]
    # off CPU, so under `jit` (both branches traced) the call failed.
    model = eqxscan.StackedMLP(64, 2, key=jr.key(0)).with_options(mode="scan")
    model = quant.quantize(model, TARGETS, **FORMATS[fmt])
    x = jr.normal(jr.key(1), (64,))
    want = eqx.filter_jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(want, model(x[None])[0], rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(jax.lax, "platform_dependent", _accelerator_branch)
    got = eqx.filter_jit(lambda m, x: m(x))(model, x)
    assert got.shape == (64,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
