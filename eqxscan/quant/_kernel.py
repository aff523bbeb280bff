"""A Pallas TPU kernel for `x @ q` (orientation `"x@W"`): the quantized bytes
are read block by block and dequantized inside the kernel, next to the matmul
that uses them, so that no float copy of the weight is written to memory.

Grid `(row blocks, output blocks, input blocks)`, the input blocks last: each
output block sums its input blocks' products in a float32 scratch, and is
written, cast, after the last one. int4's even and odd input rows are
multiplied by the even and odd columns of `x` (split outside the kernel), so
that the two nibbles of a byte are never interleaved.

Shapes it does not take (`blocks` returns `None`) run on the XLA path."""

import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike
from jaxtyping import Array

from ._products import int4_nibbles


Kind = Literal["int8", "int4", "fp8"]
"""The stored kinds (those of `Quantized`)."""


Fp8Decode = Literal["bits", "native"]
"""How the kernel turns fp8's bits into floats: integer arithmetic on the bits
(`"bits"`, as the XLA path does), or a float8_e4m3fn bitcast and convert
(`"native"`)."""

# Output columns per block, the widest that divides the output size first.
_BLOCK_N = (1024, 512, 256, 128)
# Weights dequantized per step: the float32 block (2 MiB) and its inputs,
# double-buffered, stay well inside v5e's default scoped VMEM (16 MiB).
_BLOCK_ELEMENTS = 512 * 1024
# An input size with no aligned divisor is one block, up to this many inputs.
_WHOLE_K = 4096
# Rows of `x` per block: decode's few rows are one block.
_BLOCK_M = 256


class Blocks(NamedTuple):
    """Block sizes: `m` rows of `x`, `k` inputs (float weight rows), `n`
    outputs."""

    m: int
    k: int
    n: int


def _sublanes(dtype: DTypeLike) -> int:
    # A float32 vreg holds 8 rows, a bfloat16 one 16 (two a sublane).
    return 8 if jnp.dtype(dtype).itemsize == 4 else 16


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def blocks(
    kind: Kind,
    group_size: int | None,
    rows: int,
    size_in: int,
    size_out: int,
    dtype: DTypeLike,
) -> Blocks | None:
    """The kernel's blocks for a product of `rows` rows of `x` (of compute
    `dtype`) by a weight `[size_in, size_out]`, or `None` where the kernel does
    not take it (the caller then runs the XLA path).

    The rule: the compute dtype is float32 or bfloat16, there are rows and
    inputs, `size_out` is a multiple of 128, and `size_in` either has a divisor
    that is a multiple of 128 (int4: of `8 * group_size`, so that a block holds
    whole groups and its scales a multiple of 8 rows) or is at most 4096 (one
    block)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return None
    if rows == 0 or size_in == 0 or size_out % 128:
        return None
    if kind == "int4" and not group_size:  # a scale per channel: XLA's product
        return None
    n = next(b for b in _BLOCK_N if size_out % b == 0)
    step = 8 * group_size if kind == "int4" and group_size else 128
    aligned = [
        k
        for k in range(step, size_in + 1, step)
        if size_in % k == 0 and k <= max(step, _BLOCK_ELEMENTS // n)
    ]
    if aligned:
        k = aligned[-1]
    elif size_in <= _WHOLE_K:
        k = size_in
    else:
        return None
    while k * n > _BLOCK_ELEMENTS and n > 128 and size_out % (n // 2) == 0:
        n //= 2
    padded = _round_up(rows, _sublanes(dtype))
    return Blocks(padded if padded <= _BLOCK_M else _BLOCK_M, k, n)


def _int4_halves(packed: Array, scales: Array, dtype: DTypeLike) -> list[Array]:
    """The even and odd input rows of an int4 block (int8 bytes
    `[k // 2, n]`), each scaled by its group (`scales` `[k // g, n]`)."""
    low, high = int4_nibbles(packed)
    rows, cols = packed.shape
    groups = scales.shape[0]
    halves = []
    for h in (low, high):
        # Packed row i holds inputs 2i and 2i + 1, both of group i // (g / 2).
        h = h.astype(jnp.float32).reshape(groups, rows // groups, cols)
        halves.append((h * scales[:, None, :]).reshape(rows, cols).astype(dtype))
    return halves


def _fp8_to_float32(bits: Array, how: Fp8Decode) -> Array:
    """float8_e4m3fn bits (int8) as float32."""
    if how == "native":
        return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)
    u = bits.astype(jnp.int32) & 0xFF
    magnitude = u & 0x7F
    # Exponent bias 7 rebiased to float32's 127; subnormals are m * 2^-9.
    normal = jax.lax.bitcast_convert_type((magnitude << 20) + (120 << 23), jnp.float32)
    subnormal = (magnitude & 7).astype(jnp.float32) * (2.0**-9)
    v = jnp.where(magnitude < 8, subnormal, normal)
    v = jnp.where(magnitude == 0x7F, jnp.nan, v)  # S.1111.111 is NaN
    return jnp.where(u >= 0x80, -v, v)


def _body(kind: Kind, dtype: DTypeLike, fp8: Fp8Decode, *refs) -> None:
    """One grid step: this input block's product added to the output block's
    float32 sum, which is written after the last input block."""
    *inputs, values_ref, scales_ref, out_ref, sum_ref = refs
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _():
        sum_ref[...] = jnp.zeros_like(sum_ref)

    values, scales = values_ref[...], scales_ref[...]
    if kind == "int4":
        weights = _int4_halves(values, scales, dtype)
    elif kind == "fp8":
        weights = [(_fp8_to_float32(values, fp8) * scales).astype(dtype)]
    else:
        weights = [
            (values.astype(jnp.int32).astype(jnp.float32) * scales).astype(dtype)
        ]
    for x_ref, w in zip(inputs, weights, strict=True):
        sum_ref[...] += jnp.dot(x_ref[...], w, preferred_element_type=jnp.float32)

    @pl.when(step == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = sum_ref[...].astype(out_ref.dtype)


def product(
    x: Array,
    values: Array,
    scales: Array,
    *,
    kind: Kind,
    group_size: int | None,
    block: Blocks,
    interpret: bool = False,
    fp8: Fp8Decode = "bits",
) -> Array:
    """`x @ W` for `x` `[rows, in]` (of the compute dtype) and one layer's
    stored `values` and `scales` (orientation `"x@W"`), by the kernel, with
    `block` from `blocks`. `interpret=True` runs it in Pallas's interpreter
    (any backend)."""
    dtype = x.dtype
    rows, size_in = x.shape
    size_out = values.shape[-1]
    padded = _round_up(_round_up(rows, _sublanes(dtype)), block.m)
    x = jnp.pad(x, ((0, padded - rows), (0, 0)))
    # uint8 read as int8 (free): sign extension gives int4's high nibble.
    values = jax.lax.bitcast_convert_type(values, jnp.int8)
    m, k, n = block
    if kind == "int4":
        assert group_size is not None
        xs = [x[:, 0::2], x[:, 1::2]]
        x_spec = pl.BlockSpec((m, k // 2), lambda i, j, s: (i, s))
        v_spec = pl.BlockSpec((k // 2, n), lambda i, j, s: (s, j))
        s_spec = pl.BlockSpec((k // group_size, n), lambda i, j, s: (s, j))
    else:
        xs = [x]
        x_spec = pl.BlockSpec((m, k), lambda i, j, s: (i, s))
        v_spec = pl.BlockSpec((k, n), lambda i, j, s: (s, j))
        s_spec = pl.BlockSpec((1, n), lambda i, j, s: (0, j))
    call = pl.pallas_call(
        functools.partial(_body, kind, dtype, fp8),
        out_shape=jax.ShapeDtypeStruct((padded, size_out), dtype),
        grid=(padded // m, size_out // n, size_in // k),
        in_specs=[x_spec] * len(xs) + [v_spec, s_spec],
        out_specs=pl.BlockSpec((m, n), lambda i, j, s: (i, j)),
        scratch_shapes=[pltpu.VMEM((m, n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name=f"quantized_matmul_{kind}",
    )
    return call(*xs, values, scales)[:rows]


def differentiable(
    x: Array,
    values: Array,
    scales: Array,
    reference: Callable[[Array, Array, Array], Array],
    **options,
) -> Array:
    """`product(x, values, scales, **options)` whose gradients (for `x` and
    the scales; the integer values have none) are those of `reference`, the
    XLA path, which the backward pass runs."""

    @jax.custom_vjp
    def run(x: Array, values: Array, scales: Array) -> Array:
        return product(x, values, scales, **options)

    def forward(x: Array, values: Array, scales: Array):
        return run(x, values, scales), (x, values, scales)

    def backward(saved, cotangent):
        x, values, scales = saved
        _, pull = jax.vjp(lambda x, s: reference(x, values, s), x, scales)
        dx, dscales = pull(cotangent)
        return dx, None, dscales

    run.defvjp(forward, backward)
    return run(x, values, scales)


def rmatmul(
    x: Array,
    values: Array,
    scales: Array,
    *,
    kind: Kind,
    group_size: int | None,
    dtype: DTypeLike,
    kernel: Literal["pallas", "interpret"],
    reference: Callable[[Array, Array, Array], Array],
) -> Array | None:
    """`x @ q` by the kernel for a `Quantized` `q` of these stored arrays
    (orientation `"x@W"`) and float `dtype`, or `None` where the XLA path
    (`reference(x, values, scales)`) runs instead: shapes `blocks` refuses, a
    stack's arrays. `"interpret"` runs the kernel in Pallas's interpreter;
    `"pallas"` lowers the kernel for a TPU and `reference` for other platforms
    (decided when lowering, so that a program compiled ahead of time for a TPU
    gets the kernel)."""
    dtype = jnp.result_type(x.dtype, dtype)
    *lead, size_in = x.shape
    rows = math.prod(lead)
    size_out = values.shape[-1]
    block = blocks(kind, group_size, rows, size_in, size_out, dtype)
    if block is None or values.ndim != 2:
        return None

    def product_by_kernel(x: Array, values: Array, scales: Array) -> Array:
        options = dict(kind=kind, group_size=group_size, block=block)
        interpret = kernel == "interpret"
        return differentiable(
            x, values, scales, reference, interpret=interpret, **options
        )

    x = x.reshape(rows, size_in).astype(dtype)
    if kernel == "interpret":
        y = product_by_kernel(x, values, scales)
    else:
        y = jax.lax.platform_dependent(
            x, values, scales, tpu=product_by_kernel, default=reference
        )
    return y.reshape(*lead, size_out)
