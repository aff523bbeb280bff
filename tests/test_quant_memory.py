"""Quantized stacks and memory: a scanned step forms one layer's float weights at
a time, never the stack's, and no whole-stack dtype conversion appears."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqxscan
from eqxscan import quant


L, D = 8, 128
TARGETS = ["blocks.*.w1", "blocks.*.w2"]
# One layer's w1 and w2 as float32.
ONE_LAYER = 2 * D * 4 * D * 4


def _step(model, x, *, hoist=False):
    """A decode-like step (B = 1, the weights as arguments), compiled: its temp
    bytes and its HLO. `hoist` dequantizes the whole stack before the scan."""
    params, static = eqx.partition(model, eqx.is_array)

    def step(params, x):
        m = eqx.combine(params, static)
        return (quant.dequantize(m) if hoist else m)(x)

    compiled = jax.jit(step).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


def _whole_stack_floats(hlo):
    # Any float array of a whole stacked weight's shape: [L, D, 4D] or [L, 4D, D].
    shapes = rf"\[{L},({D},{4 * D}|{4 * D},{D})\]"
    return sorted(set(re.findall(rf"\b(?:f32|bf16|f16){shapes}", hlo)))


@pytest.mark.optimized
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_layer_of_float_weights_at_a_time(getkey, dtype):
    model = eqxscan.StackedMLP(D, L, key=getkey(), dtype=dtype)
    x = jnp.ones((1, D), dtype)
    f32_temp, _ = _step(eqxscan.StackedMLP(D, L, key=getkey()), x.astype(jnp.float32))
    bound = f32_temp + ONE_LAYER
    for kind in ("int8", "int4", "fp8"):
        q = quant.quantize(model, TARGETS, kind=kind)
        temp, hlo = _step(q, x)
        assert temp <= bound, (kind, temp, bound)
        # Neither the stacked values converted (XLA:CPU converts a float8 or a
        # bf16 stack before the loop) nor the stack dequantized.
        assert _whole_stack_floats(hlo) == [], kind
    # The check can fail: dequantizing the whole stack before the scan.
    temp, hlo = _step(q, x, hoist=True)
    assert temp > bound and _whole_stack_floats(hlo) != []


def test_benchmark_smoke(monkeypatch, capsys):
    # benchmarks/quantized.py --tiny, in this process: it runs, and its weight
    # bytes are the models' own.
    from benchmarks import quantized as bench

    monkeypatch.setattr("sys.argv", ["quantized", "--tiny"])
    bench.main()
    rows = [r.split() for r in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[3], r[4]) for r in rows] == [
        (f, s) for f in bench.FORMATS for s in ("scan", "unrolled")
    ]
    mib = {(r[3], r[4]): float(r[5]) for r in rows}
    for fmt in bench.FORMATS:
        model = bench.model_of(fmt, 128, 2)
        nbytes = sum(a.nbytes for a in jax.tree.leaves(model) if eqx.is_array(a))
        assert mib[fmt, "scan"] == mib[fmt, "unrolled"] == round(nbytes / 2**20, 2)
    assert mib["int4", "scan"] < mib["int8", "scan"] < mib["bfloat16", "scan"]
