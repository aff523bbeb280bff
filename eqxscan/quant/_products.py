"""The XLA path of `x @ q` and `q @ x`: the stored values go into the matmul as
floats (exactly: int8 and fp8 codes are bfloat16 numbers) and the scales
multiply its output, so that XLA fuses the conversion into the matmul's read of
the stored bytes and no weight-sized product is computed.

int8 and fp8 have one scale per output channel: `x @ (v * s) = (x @ v) * s`.
int4 has one per group of inputs: on accelerators its product is a matmul
batched over the groups, `sum_g (x_g @ v_g) * s_g`. Measured on a TPU v5e
(decode step of a 16-layer `StackedMLP`, B=8, D=2048, steps back to back):
int8 0.79 ms against 0.81 dequantizing first, int4 0.96 against 1.36, fp8
(converted by XLA) 0.85 against 2.27 (converted bit by bit). XLA:CPU converts
fp8 element by element in a slow loop and has no bfloat16 batched matmul with a
float32 result, so on CPU fp8 is decoded by integer arithmetic and int4 keeps
the product of each half of its inputs by its dequantized weight.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array

from .. import Orientation


def _wide(*dtypes: DTypeLike) -> np.dtype:
    # Accumulate in float32 or wider (float64, complex); NumPy's promotion, as
    # JAX's strict mode refuses bfloat16 with float32.
    return np.promote_types(jnp.result_type(*dtypes), np.float32)


def _leading(s: Array, ndim: int) -> Array:
    # Leading axes of size 1 (rank promotion is refused where configured so).
    return s.reshape((1,) * (ndim - s.ndim) + s.shape)


def e4m3_to_float32(bits: Array) -> Array:
    """float8_e4m3fn bits (uint8) as float32, exactly, by integer work that
    fuses into the multiply (XLA:CPU's float8 conversion is a slow loop)."""
    u = bits.astype(jnp.uint32)
    magnitude = u & jnp.uint32(0x7F)
    # A normal value's exponent (bias 7) rebiased to float32's (127); below,
    # subnormals are m * 2^-9.
    rebiased = (magnitude << 20) + jnp.uint32(120 << 23)
    normal = jax.lax.bitcast_convert_type(rebiased, jnp.float32)
    subnormal = (magnitude & jnp.uint32(7)).astype(jnp.float32) * (2.0**-9)
    v = jnp.where(magnitude < 8, subnormal, normal)
    # The NaN codes (S.1111.111), which `quantize` never stores but a file or
    # another tool's float8 array may hold: else read as 480.
    v = jnp.where(magnitude == 0x7F, jnp.nan, v)
    return jnp.where(u >= 0x80, -v, v)


def e4m3_by_xla(bits: Array, dtype: DTypeLike) -> Array:
    """float8_e4m3fn bits (uint8) as `dtype` by XLA's own conversion."""
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(dtype)


def fp8_as(bits: Array, dtype: DTypeLike) -> Array:
    """float8_e4m3fn bits (uint8) as `dtype`: XLA's conversion, except on CPU."""
    return jax.lax.platform_dependent(
        bits,
        cpu=lambda b: e4m3_to_float32(b).astype(dtype),
        default=lambda b: e4m3_by_xla(b, dtype),
    )


def channel_product(
    x: Array,
    values: Array,
    scales: Array,
    *,
    fp8: bool,
    dtype: DTypeLike,
    orientation: Orientation,
) -> Array:
    """`x @ W` (`"x@W"`) or `W @ x` (`"W@x"`) for a weight with one scale per
    output channel (int8, fp8): the stored `values` as floats of `dtype` in the
    matmul, accumulated in float32 (one matmul of a layer's weight) and scaled
    after it."""
    out = jnp.result_type(x.dtype, dtype)
    w = fp8_as(values, dtype) if fp8 else values.astype(dtype)
    # A stack's weight (layer axes) makes a batched matmul, which XLA:CPU has
    # no bfloat16-to-float32 form of: there the output's dtype accumulates.
    wide = _wide(x.dtype, dtype) if values.ndim == 2 else None
    if orientation == "x@W":
        y = jnp.matmul(x, w, preferred_element_type=wide)
        s = scales if x.ndim > 1 else jnp.squeeze(scales, -2)
    else:
        y = jnp.matmul(w, x, preferred_element_type=wide)
        s = scales if x.ndim > 1 else jnp.squeeze(scales, -1)
    return (y.astype(_wide(y.dtype)) * _leading(s, y.ndim)).astype(out)


def int4_nibbles(signed: Array) -> tuple[Array, Array]:
    """The low and high nibbles of int8 bytes, as int32 values in [-8, 7]:
    shifts of 32-bit integers (a TPU's vector unit has no 8-bit ones), the
    arithmetic right shift sign-extending each nibble."""
    v = signed.astype(jnp.int32)
    return jnp.right_shift(jnp.left_shift(v, 28), 28), jnp.right_shift(v, 4)


def grouped_int4_product(
    x: Array, packed: Array, scales: Array, dtype: DTypeLike
) -> Array:
    """`x @ W` for one layer's int4 weight (`"x@W"`): its `packed` bytes
    (uint8 `[in / 2, out]`, inputs `2i` and `2i + 1` in the low and high
    nibbles) and `scales` (`[groups, out]`), as one matmul batched over the
    groups of each half of `x`'s inputs, scaled per group and summed in
    float32."""
    out = jnp.result_type(x.dtype, dtype)
    wide = _wide(x.dtype, dtype)
    groups = scales.shape[-2]
    *lead, size_in = x.shape
    per_group = size_in // 2 // max(groups, 1)
    low, high = int4_nibbles(jax.lax.bitcast_convert_type(packed, jnp.int8))

    def half(x_half: Array, nibbles: Array) -> Array:
        return jnp.einsum(
            "...gk,gkn->...gn",
            x_half.reshape(*lead, groups, per_group),
            nibbles.astype(dtype).reshape(groups, per_group, nibbles.shape[-1]),
            preferred_element_type=wide,
        )

    y = half(x[..., 0::2], low) + half(x[..., 1::2], high)
    return jnp.sum(y * _leading(scales, y.ndim), axis=-2).astype(out)


def native_grouped_product(
    x: Array, values: Array, scales: Array, dtype: DTypeLike
) -> Array:
    """`x @ W` for one layer's `jnp.int4` `values`, `[groups, g, out]` (or
    `[in, out]` with a scale per output channel): a matmul of the values
    batched over the groups of inputs, each group's product scaled, summed in
    float32 (per channel: one matmul, scaled after). XLA:TPU feeds the 4-bit
    values to the matrix unit as they are: 0.851 ms against 1.117 for the
    packed bytes' product in the decode step of the module docstring."""
    out = jnp.result_type(x.dtype, dtype)
    wide = _wide(x.dtype, dtype)
    groups, size_out = scales.shape
    *lead, size_in = x.shape
    if groups == 0:  # a weight with no inputs
        return jnp.zeros((*lead, size_out), out)
    if values.ndim == 2:  # one group: a scale per output channel
        y = jnp.matmul(x, values.astype(dtype), preferred_element_type=wide)
        return (y * _leading(scales[0], y.ndim)).astype(out)  # y: [..., out]
    y = jnp.einsum(
        "...gk,gkn->...gn",
        x.reshape(*lead, groups, size_in // groups),
        values.astype(dtype),
        preferred_element_type=wide,
    )
    return jnp.sum(y * _leading(scales, y.ndim), axis=-2).astype(out)
