"""`Quantized`: a weight stored as 8-bit, 4-bit or fp8 values with float scales,
used where the weight was: the layer's own `x @ self.w1` dequantizes and
multiplies, and inside a scan the float weight exists for one layer at a time."""

import dataclasses
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

from .. import Orientation
from .._internal import describe as describe_array, MatmulOnly
from ._products import (
    channel_product,
    e4m3_to_float32,
    grouped_int4_product,
    native_grouped_product,
)


Kind = Literal["int8", "int4", "fp8"]
"""The storage format: `"int8"` (symmetric, a scale per output channel), `"int4"`
(symmetric, two values a byte, a scale per group of inputs) or `"fp8"`
(`float8_e4m3fn`, a scale per output channel)."""

KINDS: tuple[Kind, ...] = ("int8", "int4", "fp8")

Kernel = Literal["xla", "pallas", "interpret"]
"""What computes `x @ q`: `"xla"` (XLA's matmul of the stored values, see
`eqxscan/quant/_products.py`), `"pallas"`
(a Pallas TPU kernel on a TPU; the XLA path elsewhere) or `"interpret"` (the
kernel in Pallas's interpreter, on any backend: slow, for tests)."""

KERNELS: tuple[Kernel, ...] = ("xla", "pallas", "interpret")

Int4Storage = Literal["packed", "native"]
"""How `"int4"` values are held: `"packed"` (two a byte, uint8 `[in // 2, out]`:
what files hold, and half the memory of one a byte on a CPU) or `"native"`
(XLA's own 4-bit integers, `jnp.int4` `[in // g, g, out]` for `"x@W"` in groups
and the float weight's shape otherwise, see `Quantized.split`; a TPU stores two a
byte and feeds to its matrix unit without unpacking: 0.76x the packed
step's time in a decode step on a TPU v5e, see docs/benchmarks.md)."""

INT4_STORAGES: tuple[Int4Storage, ...] = ("packed", "native")
GROUP_SIZES = (32, 64, 128)

# The largest magnitude each kind stores: the scale maps max|w| onto it.
LIMIT = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def fp8_bits(values: Array) -> Array:
    """float8_e4m3fn values as the uint8 of their bits (other arrays as given)."""
    if values.dtype == jnp.float8_e4m3fn:
        return jax.lax.bitcast_convert_type(values, jnp.uint8)
    return values


def _plain_int(size: int | np.integer | None) -> int | None:
    """A NumPy integer as a Python `int` (a static field, written to JSON)."""
    return int(size) if isinstance(size, np.integer) else size


class Quantized(MatmulOnly, eqx.Module):
    """A weight stored quantized, standing where the float weight was.

    `x @ q` (orientation `"x@W"`) is `x @ q.dequantize()` and `q @ x` (orientation
    `"W@x"`) is `q.dequantize() @ x`: the float weight is formed from the stored
    values, for the one layer being run, and multiplied.

    Layouts, per layer, for orientation `"x@W"` (float weight `[in, out]`;
    `"W@x"` stores the transpose of every array):

    | `kind` | `values` | `scales` (float32) |
    | --- | --- | --- |
    | `"int8"` | int8 `[in, out]` | `[1, out]`: max abs over `in` / 127 |
    | `"fp8"` | uint8 `[in, out]` | `[1, out]`: max abs over `in` / 448 |
    | `"int4"` | uint8 `[in // 2, out]`, int4 (below) | `[in // g, out]`: max / 7 |

    (`g` is `group_size`; `None` for int4: one group, scales `[1, out]`.)
    Integers are symmetric: int8 in [-127, 127].
    `"fp8"` stores the bits of float8_e4m3fn values as uint8 (float8 values
    given are converted): XLA:CPU cannot slice a float8 array. `"int4"` values
    in [-7, 7] are held packed (uint8: input rows `2i` in the low nibble and
    `2i + 1` in the high one, each a two's-complement 4-bit integer) or native
    (`jnp.int4`: `[in // g, g, out]` for `"x@W"` in groups, each group its own
    slice, else the float weight's shape), see `Int4Storage` and
    [`eqxscan.quant.with_int4_storage`][]; files hold them packed. A column
    (or group) of zeros has scale 1. Inside an [`eqxscan.Stacked`][] each
    array has the layer axes in front.

    `dtype` is the float dtype the layer sees (a dtype or its name,
    `"bfloat16"`; kept as a `numpy.dtype`); `.shape` and `.ndim` are the float
    weight's; `name` is its state-dict name (`"blocks.*.w1"`), for errors.
    Other array operations (`+`, indexing, `jnp.asarray`) raise a `TypeError`
    pointing to [`eqxscan.quant.dequantize`][] (`jnp.matmul`, `jnp.einsum`,
    `jnp.dot` and `jax.lax` functions raise JAX's own). Build one with
    [`eqxscan.quant.quantize`][]; one built by hand is checked against these
    layouts.

    `kernel` says what computes `x @ q` (see `Kernel`; not saved in files):
    the default `"xla"`, or `"pallas"`, a Pallas kernel that dequantizes
    block by block inside the matmul, on a TPU, for the shapes it takes
    (`q @ x` and other shapes run the XLA path); set it with
    [`eqxscan.quant.with_kernel`][].
    """

    values: Shaped[Array, "*layers _ _"] = eqx.field(converter=fp8_bits)
    scales: Float[Array, "*layers _ _"]
    kind: Kind = eqx.field(static=True)
    orientation: Orientation = eqx.field(static=True)
    group_size: int | None = eqx.field(static=True, converter=_plain_int)
    dtype: np.dtype = eqx.field(static=True, converter=jnp.dtype)
    name: str = eqx.field(static=True, default="")
    kernel: Kernel = eqx.field(static=True, default="xla")

    _label = "Quantized weight"
    _symbol = "q"
    _maker = "quantize"
    _instead = "`eqxscan.quant.dequantize(model)` to get float weights"

    def __check_init__(self) -> None:
        where = f"Quantized weight `{self.name or '<unnamed>'}`"
        hint = (
            "\nHint: build one with eqxscan.quant.quantize; the layouts are in "
            "Quantized's docstring."
        )
        if self.kind not in KINDS or self.orientation not in ("x@W", "W@x"):
            raise ValueError(
                f"{where}: kind must be one of {list(KINDS)} and orientation 'x@W' "
                f"or 'W@x', got {self.kind!r} and {self.orientation!r}." + hint
            )
        if self.kernel not in KERNELS:
            raise ValueError(
                f"{where}: kernel must be one of {list(KERNELS)}, got "
                f"{self.kernel!r}." + hint
            )
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise ValueError(
                f"{where}: dtype is the float weight's, a floating dtype, got "
                f"{self.dtype.name}." + hint
            )
        stored = {"int8": ["int8"], "int4": ["uint8", "int4"]}.get(self.kind, ["uint8"])
        if jnp.dtype(self.values.dtype).name not in stored or self.values.ndim < 2:
            raise ValueError(
                f"{where}: {self.kind!r} values must be {' or '.join(stored)} "
                f"with 2 axes per layer, got {describe_array(self.values)}." + hint
            )
        allowed = (*GROUP_SIZES, None) if self.kind == "int4" else (None,)
        if self.group_size not in allowed:
            raise ValueError(
                f"{where}: group_size must be one of {list(GROUP_SIZES)} or None for "
                f"'int4' and None otherwise, got {self.group_size!r} for "
                f"{self.kind!r}." + hint
            )
        axes = self.scales.ndim + self.split  # one more when split
        # (Other kinds' scales of another rank: the scales' check below.)
        if self.native and (
            self.values.ndim != axes
            or (self.split and self.values.shape[-2] != self.group_size)
        ):
            raise ValueError(
                f"{where}: native int4 values are `[in // g, g, out]` for 'x@W' with "
                f"g = group_size ({self.group_size}), else 2-D per layer as the "
                f"scales are, got {describe_array(self.values)} and scales "
                f"{describe_array(self.scales)} ({self.orientation})." + hint
            )
        size_in = self.shape[-2 if self.orientation == "x@W" else -1]
        if self.group_size and size_in % self.group_size:
            raise ValueError(
                f"{where}: its input size {size_in} is not a multiple of "
                f"group_size={self.group_size}." + hint
            )
        *layers, rows, cols = self.shape
        groups = size_in // self.group_size if self.group_size else 1
        x_at_w = self.orientation == "x@W"
        expected = (*layers, groups, cols) if x_at_w else (*layers, rows, groups)
        if self.scales.shape != expected or self.scales.dtype != jnp.float32:
            raise ValueError(
                f"{where}: {self.kind!r} values {describe_array(self.values)} "
                f"({self.orientation}) need float32 scales of shape "
                f"{list(expected)}, got {describe_array(self.scales)}." + hint
            )

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.values.shape)
        if self.kind == "int4" and not self.native:  # two inputs a byte
            shape[-2 if self.orientation == "x@W" else -1] *= 2
        if self.split:  # [..., groups, g, out]: the inputs in groups
            shape[-3:-1] = [shape[-3] * shape[-2]]
        return tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def split(self) -> bool:
        """Whether the values are native int4 held `[..., in // g, g, out]`, as
        they are for `"x@W"` in groups: each group its own slice, which a TPU
        reads as it lies, where `[..., in, out]` is retiled every step."""
        x_at_w = self.orientation == "x@W"
        return self.native and x_at_w and self.group_size is not None

    @property
    def native(self) -> bool:
        """Whether int4 values are held as `jnp.int4` (see `Int4Storage`)."""
        return getattr(self.values, "dtype", None) == jnp.int4

    def stored_arrays(self) -> tuple[Array, Array]:
        """`(values, scales)`, which [`eqxscan.sharding`][] shards as the float
        weight; a `TypeError` if a cast of the model made the scales other than
        float32."""
        self._check_scales()
        return self.values, self.scales

    def dequantize(self) -> Array:
        """The float weight (of `dtype`), with the layer axes kept: per layer
        inside a scan's step, or the whole stack when called on the stack."""
        values, scales = self._in_out()
        if self.kind == "int4":
            values = self._values_2d() if self.native else unpack_int4(values)
            w = _grouped(values, scales)
        elif self.kind == "fp8":
            w = e4m3_to_float32(values) * scales
        else:
            w = values.astype(jnp.float32) * scales
        return self._in_out(w.astype(self.dtype))[0]

    def __rmatmul__(self, x: Array | np.ndarray) -> Array:
        """`x @ q`, for orientation `"x@W"`: `x` is `[..., in]`."""
        self._check("x@W", x)
        x = jnp.asarray(x)
        if self.kernel != "xla" and not self.native:
            from ._kernel import rmatmul  # Pallas, imported where used

            values, scales = self.stored_arrays()
            y = rmatmul(
                x,
                values,
                scales,
                kind=self.kind,
                group_size=self.group_size,
                dtype=self.dtype,
                kernel=self.kernel,
                # A function, not the bound method: JAX hashes a branch.
                reference=lambda *arrays: self._by_xla(*arrays),
            )
            if y is not None:
                return y
        if self.kind != "int4":
            return self._by_channel(x, "x@W")
        values, scales = self.stored_arrays()

        def dense(x: Array) -> Array:
            if self.native:  # the weight, dequantized
                return _summed((x, self.dequantize()))
            low, high = self._int4_halves()
            return _summed((x[..., 0::2], low), (x[..., 1::2], high))

        def grouped(x: Array) -> Array:
            product = native_grouped_product if self.native else grouped_int4_product
            return product(x, values, scales, self.dtype)

        if scales.ndim != 2:  # a stack's weight: every layer at once
            return dense(x)
        # See `_products`: XLA:CPU has no bfloat16 batched matmul to float32.
        return jax.lax.platform_dependent(x, cpu=dense, default=grouped)

    def __matmul__(self, x: Array | np.ndarray) -> Array:
        """`q @ x`, for orientation `"W@x"`: `x` is `[in]` or `[..., in, n]`."""
        self._check("W@x", x)
        x = jnp.asarray(x)
        if self.kind == "int4" and self.native:
            return _summed((self.dequantize(), x))
        if self.kind == "int4":
            low, high = self._int4_halves()
            if x.ndim == 1:
                return _summed((low, x[0::2]), (high, x[1::2]))
            return _summed((low, x[..., 0::2, :]), (high, x[..., 1::2, :]))
        return self._by_channel(x, "W@x")

    def _by_channel(self, x: Array, orientation: Orientation) -> Array:
        # int8 and fp8: the stored values in the matmul, scaled after it.
        values, scales = self.stored_arrays()
        fp8 = self.kind == "fp8"
        return channel_product(
            x, values, scales, fp8=fp8, dtype=self.dtype, orientation=orientation
        )

    def _by_xla(self, x: Array, values: Array, scales: Array) -> Array:
        # `x @ q` on the XLA path for these arrays: the kernel's reference,
        # which its backward pass differentiates.
        arrays = dict(values=values, scales=scales)
        return x @ dataclasses.replace(self, **arrays, kernel="xla")

    def _record(self) -> dict[str, float | int | str | None]:
        # What the arrays do not say: a file loaded into a weight quantized
        # otherwise (from a model of another dtype, a square weight in the
        # other orientation) is refused, not computed otherwise. A cast's
        # scales are refused here, where they are saved: a model's weight, which
        # holds its values (not an optimizer's moments of the scales alone,
        # which may be bfloat16).
        if self.values is not None:
            self._check_scales()
        return {
            "kind": self.kind,
            "group_size": self.group_size,
            "orientation": self.orientation,
            "dtype": self.dtype.name,
        }

    def _rebuild(self, saved: str) -> str:
        return f"quantize a model of the saved dtype with the saved options ({saved})"

    def _check_scales(self) -> None:
        # Casting a model's float arrays casts the scales but not the static
        # `dtype`: a half-cast weight, which a file would record as float32.
        got = getattr(self.scales, "dtype", jnp.float32)  # a filtered model: None
        if got != jnp.float32:
            raise TypeError(
                f"Quantized weight `{self.name or '<unnamed>'}` has "
                f"{jnp.dtype(got).name} scales, but its scales stay float32 and "
                f"it computes in its static dtype {self.dtype.name}, which a cast "
                "of the arrays does not change.\nHint: cast the float model "
                "before quantizing: a bfloat16 model's weights compute in "
                "bfloat16, with float32 scales."
            )

    def _in_out(self, *arrays: Array) -> tuple[Array, ...]:
        # `arrays` (by default the stored ones) between the `[in, out]` layout
        # and this orientation's: "W@x" stores the transpose.
        arrays = arrays or self.stored_arrays()
        if self.orientation == "x@W":
            return arrays
        return tuple(jnp.swapaxes(a, -1, -2) for a in arrays)

    def _values_2d(self) -> Array:
        # Native values as `[..., in, out]` (or `"W@x"`'s transpose).
        values = self._in_out()[0]
        if not self.split:
            return values
        *layers, groups, size, cols = values.shape
        return values.reshape(*layers, groups * size, cols)

    def _int4_halves(self) -> tuple[Array, ...]:
        # The float weights of the even and of the odd input rows, each in the
        # stored layout: multiplying by both halves of `x` needs no interleaving
        # of the two nibbles, which XLA:CPU runs as slow elementwise copies.
        values, scales = self._in_out()
        halves = (_grouped(h, scales).astype(self.dtype) for h in _nibbles(values))
        return self._in_out(*halves)

    def _weight(self) -> str:
        return describe(self)


def describe(q: Quantized) -> str:
    """`int8->float32[128,512]`: the stored kind and the float weight's shape."""
    return f"{q.kind}->{q.dtype}[{','.join(map(str, q.shape))}]"


def _summed(*products: tuple[Array, Array]) -> Array:
    """The sum of the products `a @ b`, kept in float32 (or wider: float64,
    complex, which float32 would truncate) and rounded once, as the product by
    the whole weight is: bfloat16 halves would round twice more."""
    dtype = jnp.result_type(*products[0])
    # NumPy's promotion: JAX's strict mode refuses bfloat16 with float32.
    wide = np.promote_types(dtype, np.float32)
    total = sum(jnp.matmul(a, b, preferred_element_type=wide) for a, b in products)
    return jnp.asarray(total).astype(dtype)


def _grouped(values: Array, scales: Array) -> Array:
    """`values` (`[..., in, out]`) times the scale of each input group."""
    *layers, rows, cols = values.shape
    groups = scales.shape[-2]
    size = rows // max(groups, 1)  # no groups: a weight with no inputs
    w = values.reshape(*layers, groups, size, cols).astype(jnp.float32)
    return (w * scales[..., :, None, :]).reshape(values.shape)


def pack_int4(q: Array) -> Array:
    """int8 values in [-8, 7], `[..., 2n, out]`, packed two a byte: `[..., n, out]`
    uint8, row `2i` in the low nibble and `2i + 1` in the high one."""
    low = q[..., 0::2, :].astype(jnp.uint8) & jnp.uint8(0xF)
    high = q[..., 1::2, :].astype(jnp.uint8) & jnp.uint8(0xF)
    return low | (high << jnp.uint8(4))


def _nibbles(packed: Array) -> tuple[Array, Array]:
    """The low and the high nibbles of uint8 `packed`, as int8."""
    signed = jax.lax.bitcast_convert_type(packed, jnp.int8)
    # Arithmetic shifts sign-extend each nibble.
    low = jnp.right_shift(jnp.left_shift(signed, jnp.int8(4)), jnp.int8(4))
    return low, jnp.right_shift(signed, jnp.int8(4))


def unpack_int4(packed: Array) -> Array:
    """`pack_int4` undone: uint8 `[..., n, out]` to int8 `[..., 2n, out]`."""
    both = jnp.stack(_nibbles(packed), axis=-2)  # [..., n, 2, out]
    *layers, n, _, cols = both.shape
    return both.reshape(*layers, 2 * n, cols)


def _scales(amax: Array, limit: float) -> Array:
    """`amax / limit` exactly (1 where that is 0: `amax` is 0, or so small that
    the quotient is subnormal, which XLA flushes to 0; a scale of 0 would make
    the values 0/0). XLA turns a division by a constant or a broadcast into a
    product by its rounded reciprocal: 1 ulp off, eagerly or compiled alike,
    were the divisor not hidden from it."""
    divisor = jax.lax.optimization_barrier(jnp.full(amax.shape, limit, jnp.float32))
    scale = amax / divisor
    return jnp.where(scale == 0, 1.0, scale)


def with_storage(q: Quantized, storage: Int4Storage) -> Quantized:
    """`q` with its int4 values held as `storage` (other kinds as they are)."""
    if q.kind != "int4" or q.native == (storage == "native"):
        return q
    x_at_w = q.orientation == "x@W"
    if storage == "native":
        values = q.values if x_at_w else jnp.swapaxes(q.values, -1, -2)
        values = unpack_int4(values).astype(jnp.int4)
        values = (
            _split(values, q.group_size) if x_at_w else jnp.swapaxes(values, -1, -2)
        )
    else:
        values = pack_int4(q._values_2d().astype(jnp.int8))
        values = values if x_at_w else jnp.swapaxes(values, -1, -2)
    return dataclasses.replace(q, values=values)


def _split(values: Array, group_size: int | None) -> Array:
    """Native `[..., in, out]` values held `[..., in // g, g, out]` (see
    `Quantized.split`); as they are with one scale per channel."""
    if not group_size:
        return values
    *layers, rows, cols = values.shape
    return values.reshape(*layers, rows // group_size, group_size, cols)


def quantize_array(
    w: Array,
    kind: Kind,
    orientation: Orientation,
    group_size: int | None,
    name: str = "",
    storage: Int4Storage = "packed",
) -> Quantized:
    """`w` quantized; the caller checks shapes and sizes."""
    dtype = w.dtype
    w = w.astype(jnp.float32)
    if orientation == "W@x":
        w = jnp.swapaxes(w, -1, -2)  # and the stored arrays back below
    limit = LIMIT[kind]
    # A NaN counts as inf (XLA's max may skip it): a group holding either gets
    # an inf scale and dequantizes to NaN, also where `quantize` is traced and
    # cannot check the weight.
    magnitude = jnp.where(jnp.isnan(w), jnp.inf, jnp.abs(w))
    if kind == "int4" and group_size:
        *layers, rows, cols = w.shape
        split = (*layers, rows // group_size, group_size, cols)
        groups = w.reshape(split)
        amax = jnp.max(magnitude.reshape(split), axis=-2)  # [..., groups, out]
        scales = _scales(amax, limit)
        q = jnp.clip(jnp.round(groups / scales[..., :, None, :]), -limit, limit)
        values = q.reshape(w.shape)
    else:
        # [..., 1, out]; 0 (so scale 1) for a weight with no inputs.
        amax = jnp.max(magnitude, axis=-2, keepdims=True, initial=0.0)
        scales = _scales(amax, limit)
        values = jnp.clip(w / scales, -limit, limit)
    if kind == "int4":
        q = jnp.round(values).astype(jnp.int8)
        if storage == "packed":
            values = pack_int4(q)
        elif orientation == "x@W":  # the grouped product's layout
            values = _split(q.astype(jnp.int4), group_size)
        else:
            values = q.astype(jnp.int4)
    elif kind == "int8":
        values = jnp.round(values).astype(jnp.int8)
    else:
        values = fp8_bits(values.astype(jnp.float8_e4m3fn))
    if orientation == "W@x":
        values, scales = jnp.swapaxes(values, -1, -2), jnp.swapaxes(scales, -1, -2)
    return Quantized(
        values, scales.astype(jnp.float32), kind, orientation, group_size, dtype, name
    )
