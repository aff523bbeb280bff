"""`quantize`: targeted weights replaced by `Quantized`s; `dequantize`: back."""

import dataclasses
from collections.abc import Sequence
from typing import cast, Literal, NoReturn

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jaxtyping import Array, PyTree

from .. import Target
from .._internal import (
    Checked,
    describe,
    for_each,
    layer_names,
    replace_weights,
    Site,
    stored_sharding,
)
from ._quantized import (
    GROUP_SIZES,
    INT4_STORAGES,
    Int4Storage,
    Kernel,
    KERNELS,
    Kind,
    KINDS,
    Orientation,
    quantize_array,
    Quantized,
    with_storage,
)


# Compiled, so that XLA fuses the elementwise steps: no float32 copies of the
# whole stack besides the one read.
_quantize_array = jax.jit(
    quantize_array,
    static_argnames=("kind", "orientation", "group_size", "name", "storage"),
)


def is_quantized(x: object) -> bool:
    return isinstance(x, Quantized)


def quantize(
    model: PyTree,
    targets: Checked[Target | Sequence[Target]],
    *,
    kind: Checked[Kind] = "int8",
    group_size: Checked[int | None] = 128,
    orientation: Checked[Orientation] = "x@W",
    kernel: Checked[Kernel] = "xla",
    int4_storage: Checked[Int4Storage | Literal["auto"]] = "auto",
) -> PyTree:
    """`model` with each targeted weight replaced by a [`eqxscan.quant.Quantized`][].

    Inside an [`eqxscan.Stacked`][] (or an [`eqxscan.Chain`][]'s stacks) every
    layer is quantized with its own scales, and a scan dequantizes one at a time.

    **Arguments:**

    - `model`: any pytree, usually a model containing `Stacked`s or `Chain`s.
    - `targets`: a name pattern or a module type, or a list of them. A pattern is
      matched (`fnmatch`) against the names of [`eqxscan.to_state_dict`][], with
      every layer index shown as `*`: `"blocks.*.w1"`, `"*.w2"`. A module type
      (e.g. `eqx.nn.Linear`) quantizes the `weight` of every module of that type,
      in orientation `"W@x"`.
    - `kind`: `"int8"`, `"int4"` or `"fp8"` (see [`eqxscan.quant.Quantized`][]).
    - `group_size`: for `"int4"`, the inputs sharing a scale: 32, 64 or 128, each
      weight's input size a multiple of it; or `None`, one scale per output
      channel (the fastest product, the least accurate: see
      docs/quantization.md). Ignored for other kinds.
    - `orientation`: how the layers use the weights a pattern matches: `"x@W"`
      (weight `[in, out]`) or `"W@x"` (`[out, in]`).
    - `kernel`: what computes the products, `"xla"` or `"pallas"` (see
      [`eqxscan.quant.with_kernel`][]).
    - `int4_storage`: how `"int4"` values are held, `"packed"` or `"native"`
      (see [`eqxscan.quant.with_int4_storage`][]); the default `"auto"` is
      `"native"` where `jax.default_backend()` is a TPU, `"packed"` elsewhere.

    **Returns:**

    `model` with the targets replaced; nothing else changes. An abstract model
    (of `jax.ShapeDtypeStruct`s) gives an abstract one, as
    `eqx.filter_eval_shape` would.
    """
    if kind not in KINDS:
        raise ValueError(
            f"quantize: kind must be one of {list(KINDS)}, got {kind!r}.\nHint: "
            "'int8' and 'fp8' keep a scale per output channel, 'int4' per group."
        )
    sizes = (*GROUP_SIZES, None)  # None: a scale per output channel
    if kind == "int4" and (
        not isinstance(group_size, int | np.integer | None) or group_size not in sizes
    ):
        raise ValueError(
            f"quantize: group_size must be one of {list(GROUP_SIZES)} or None for "
            f"'int4', got {group_size!r}.\nHint: a smaller group is more accurate and "
            "stores more scales."
        )
    _check_kernel("quantize", kernel)
    storage = _storage("quantize", int4_storage)
    size = int(group_size) if kind == "int4" and group_size is not None else None
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jtu.tree_leaves(model)):
        # An abstract model (`like` for a file): traced, as for its arrays.
        return eqx.filter_eval_shape(
            quantize,
            model,
            targets,
            kind=kind,
            group_size=group_size,
            orientation=orientation,
            kernel=kernel,
            int4_storage=storage,
        )

    def make(w: object, depth: int, name: str, o: Orientation) -> Quantized:
        if isinstance(w, Quantized):
            raise ValueError(
                f"quantize: the target `{name}` is quantized already "
                f"({w.kind!r}).\nHint: dequantize it first "
                "(eqxscan.quant.dequantize), or leave it out of the targets."
            )
        w = cast(Array, w)
        q = _quantized(w, depth, name, kind, o, size, storage)
        # A NaN or inf gives its group an inf scale (`quantize_array`): the
        # scales say which layer, without a pass over the float weight.
        if not isinstance(q.scales, jax.core.Tracer):
            finite = np.asarray(jnp.isfinite(q.scales).all(axis=(-2, -1)))
            if not finite.all():
                _nonfinite(model, w, int(np.argmin(finite)), name, depth)
        return q

    quantized = replace_weights(
        model,
        targets,
        make,
        orientation=orientation,
        who="quantize",
        verb=("quantize", "quantized"),
    )
    return with_kernel(quantized, kernel)


def with_kernel(model: PyTree, kernel: Checked[Kernel]) -> PyTree:
    """`model` with every [`eqxscan.quant.Quantized`][] computing `x @ q` by
    `kernel`; nothing else changes, and files are the same (the kernel is not
    saved: set it again after `quant.load`, or on the `like` given to it).

    **Arguments:**

    - `model`: a quantized model.
    - `kernel`: `"xla"` (the default: dequantize, then XLA's matmul),
      `"pallas"` (a Pallas TPU kernel that dequantizes block by block inside
      the matmul; on other platforms, and for shapes it does not take, the
      XLA path) or `"interpret"` (the kernel in Pallas's interpreter, on any
      backend: slow, for tests). The kernel reads packed bytes in groups:
      int4 held native or with a scale per channel runs the XLA path, which
      is the faster one for them on a TPU v5e.

    **Returns:**

    `model` with its `Quantized`s' `kernel` set.
    """
    _check_kernel("with_kernel", kernel)

    def set_kernel(x: object) -> object:
        if isinstance(x, Quantized) and x.kernel != kernel:
            return dataclasses.replace(x, kernel=kernel)
        return x

    return jtu.tree_map(set_kernel, model, is_leaf=is_quantized)


def with_int4_storage(
    model: PyTree, storage: Checked[Int4Storage | Literal["auto"]]
) -> PyTree:
    """`model` with the values of every `"int4"` [`eqxscan.quant.Quantized`][]
    held as `storage`; the numbers, and files, are the same.

    **Arguments:**

    - `model`: a quantized model (arrays or `jax.ShapeDtypeStruct`s).
    - `storage`: `"packed"` (two values a byte in uint8 `[in // 2, out]`, as
      files hold them), `"native"` (XLA's `jnp.int4`, `[in // g, g, out]` for
      `"x@W"` in groups, else the float weight's shape: on a TPU two
      a byte as well, and read by the matrix unit without unpacking, the
      faster step; on a CPU one a byte) or `"auto"` (`"native"` where
      `jax.default_backend()` is a TPU, else `"packed"`).

    **Returns:**

    `model` with its int4 `Quantized`s' values converted where they differ.
    """
    to = _storage("with_int4_storage", storage)

    def convert(x: object) -> object:
        if not isinstance(x, Quantized):
            return x
        if isinstance(x.values, jax.ShapeDtypeStruct):  # an abstract model's
            return _described(jax.eval_shape(lambda q: with_storage(q, to), x), x)
        return _converted(x, to)

    return jtu.tree_map(convert, model, is_leaf=is_quantized)


def _described(out: Quantized, q: Quantized) -> Quantized:
    """`out`, abstract `q` converted, placed as `q` is (`eval_shape` drops the
    placement): its scales as `q`'s, its values along the float weight's axes
    that `q`'s values are sharded along, where they divide."""
    sharding = getattr(q.values, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = (*sharding.spec, *(None,) * (q.values.ndim - len(sharding.spec)))
        spec = PartitionSpec(*spec[:-2], spec[-1]) if q.split else PartitionSpec(*spec)
        sharding = stored_sharding(out.values, out.ndim, spec, sharding.mesh)
    elif not isinstance(sharding, SingleDeviceSharding):
        sharding = None  # another kind may name the old axes
    values = jax.ShapeDtypeStruct(out.values.shape, out.values.dtype, sharding=sharding)
    return eqx.tree_at(lambda o: (o.values, o.scales), out, (values, q.scales))


@eqx.filter_jit
def _converted(q: Quantized, storage: Int4Storage) -> Quantized:
    # Compiled: the unpacking's steps fuse, no int8 copy of the whole stack.
    return with_storage(q, storage)


def _storage(who: str, storage: object) -> Int4Storage:
    """`storage` checked, `"auto"` resolved for the default backend."""
    if storage == "auto":
        return "native" if jax.default_backend() == "tpu" else "packed"
    if storage not in INT4_STORAGES:
        raise ValueError(
            f"{who}: int4 storage must be 'auto' or one of {list(INT4_STORAGES)}, "
            f"got {storage!r}.\nHint: 'native' is the TPU's own 4-bit type; "
            "'packed' two values a byte in uint8."
        )
    return cast(Int4Storage, storage)


def _check_kernel(who: str, kernel: object) -> None:
    if kernel not in KERNELS:
        raise ValueError(
            f"{who}: kernel must be one of {list(KERNELS)}, got {kernel!r}."
            "\nHint: 'pallas' is the TPU kernel; 'xla' the default path."
        )


def _quantized(
    w: Array,
    depth: int,
    name: str,
    kind: Kind,
    orientation: Orientation,
    group_size: int | None,
    storage: Int4Storage,
) -> Quantized:
    """`w` quantized, once floating, 2-D per layer and divisible."""
    where = f"quantize: the target `{name}` ({describe(w)}, {depth} layer axes)"
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(
            f"{where} is not a floating array; only float weights are quantized."
            "\nHint: narrow the pattern to the model's float weight matrices."
        )
    shape = tuple(w.shape[depth:])
    if len(shape) != 2:
        raise ValueError(
            f"{where} has {len(shape)} axes per layer, but quantize takes 2-D "
            "weights.\nHint: narrow the pattern to matrices."
        )
    size_in = shape[0] if orientation == "x@W" else shape[1]
    if group_size is not None and size_in % group_size:
        fits = [g for g in GROUP_SIZES if size_in % g == 0]
        hint = (
            f"pass group_size={fits[-1]}, which divides it, or quantize"
            if fits
            else f"no group size in {list(GROUP_SIZES)} divides it: "
            + ("" if size_in % 2 else "pass group_size=None (a scale per channel), or ")
            + "quantize"
        )
        raise ValueError(
            f"{where}: its input size {size_in} (orientation {orientation!r}) is "
            f"not a multiple of group_size={group_size}, as 'int4' needs.\nHint: "
            f"{hint} this weight with kind='int8' or 'fp8'."
        )
    if kind == "int4" and size_in % 2:
        raise ValueError(
            f"{where}: its input size {size_in} (orientation {orientation!r}) is "
            "odd, but 'int4' stores two inputs a byte (packed, and in files)."
            "\nHint: quantize this weight with kind='int8' or 'fp8'."
        )
    return _quantize_array(w, kind, orientation, group_size, name, storage)


def _nonfinite(model: PyTree, w: Array, index: int, name: str, depth: int) -> NoReturn:
    """Raise for `w`, whose layer `index` (flat) holds NaN or inf, naming the
    layer as the state dict does: a `Chain`'s groups and a stack in stage order
    do not hold layer `i` at index `i`."""
    names: list[str] = []

    def visit(leaf: object, site: Site) -> None:
        if leaf is w and not names:
            names.extend(layer_names(site.path, site.axes))

    for_each(visit, model, names=True)
    layers = int(np.prod(w.shape[:depth]))
    at = f"`{names[index]}`" if len(names) == layers else f"layer {index}"
    raise ValueError(
        f"quantize: the target `{name}` ({describe(w)}, {depth} layer axes) holds "
        f"NaN or inf in {at}; its scales would be meaningless.\nHint: find where "
        "it came from with eqxscan.find_nonfinite, or fix the weight before "
        "quantizing."
    )


def dequantize(model: PyTree) -> PyTree:
    """`model` with every [`eqxscan.quant.Quantized`][] replaced by its float
    weight (of the dtype it was quantized from, layer axes kept).

    **Arguments:**

    - `model`: a model returned by [`eqxscan.quant.quantize`][] (LoRAs over its
      quantized weights get float bases).

    **Returns:**

    `model` with float arrays where its `Quantized`s were.
    """

    def dequantized(x: object) -> object:
        if not isinstance(x, Quantized):
            return x
        if isinstance(x.values, jax.ShapeDtypeStruct):  # an abstract model's
            return jax.eval_shape(Quantized.dequantize, x)
        return x.dequantize()

    return jtu.tree_map(dequantized, model, is_leaf=is_quantized)
