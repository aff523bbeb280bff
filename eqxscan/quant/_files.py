"""Quantized models in safetensors files (`save`, `load`), and `quantize_file`,
which quantizes a float checkpoint one layer of one weight at a time. A
`Quantized` at `blocks.*.w1` is stored as `blocks.3.w1.values` and
`blocks.3.w1.scales` for layer 3; each file's metadata `"eqxscan.quant"` maps
each weight's name pattern to how it was quantized (docs/quantization.md#files).
"""

import ctypes
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import cast, Literal, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from .. import from_state_dict, save_safetensors
from .._internal import (
    check_like,
    docs,
    for_each,
    is_arraylike,
    layer_names,
    Lazy,
    listed,
    pattern as name_pattern,
    Site,
    stands_for_weight,
    stored_sharding,
)
from ..checkpoint import CorruptFileError, NameMap, open_safetensors, Opened
from ._quantize import (
    _quantize_array,
    is_quantized,
    quantize,
    Target,
    with_int4_storage,
)
from ._quantized import describe, Int4Storage, Kind, Orientation, Quantized


T = TypeVar("T")
METADATA = "eqxscan.quant"
_DOCS = f"see {docs('quantization.md#files')}"
_EXAMPLE = "eqxscan.quant.quantize, model, targets"


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How one weight is quantized: what the file records of it."""

    kind: str
    group_size: int | None
    orientation: str
    dtype: str

    def __str__(self) -> str:
        size = self.group_size
        group = f", group size {size}" if size else ", a scale per channel"
        group = group if self.kind == "int4" else ""
        return f"{self.kind}{group}, {self.orientation}, {self.dtype}"


def _spec(q: Quantized) -> _Spec:
    q._check_scales()  # a cast's scales, which the record would misstate
    return _Spec(q.kind, q.group_size, q.orientation, np.dtype(q.dtype).name)


@dataclasses.dataclass(frozen=True)
class Weight:
    """A `Quantized` of a model, where it sits by state-dict name, its name
    pattern (layer indices as `*`) and the names of its layers, in the order of
    its stacked arrays."""

    q: Quantized
    site: Site
    pattern: str
    names: list[str]


def weights(model: PyTree) -> tuple[list[Weight], dict[str, str]]:
    """The `Quantized`s of `model`, and what its other arrays hold by pattern."""
    quantized: list[Weight] = []
    floats: dict[str, str] = {}

    def visit(leaf: object, site: Site) -> None:
        if stands_for_weight(leaf):
            names = layer_names(site.path, site.axes)
            q = cast(Quantized, leaf)  # the package's only stand-in
            quantized.append(Weight(q, site, name_pattern(site.path), names))
        elif is_arraylike(leaf):
            shape = f"{jnp.dtype(leaf.dtype).name}{list(leaf.shape)}"
            floats[name_pattern(site.path)] = shape

    for_each(visit, model, names=True, is_leaf=stands_for_weight)
    return quantized, floats


def _by_pattern(held: list[Weight]) -> dict[str, Weight]:
    """`held` by name pattern, which a `Chain`'s stacks share: then quantized
    alike, as a file records one quantization per pattern."""
    found: dict[str, Weight] = {}
    for w in held:
        other = found.setdefault(w.pattern, w)
        if _spec(other.q) != _spec(w.q):
            raise ValueError(
                f"Two Quantized weights of the model are named `{w.pattern}` "
                f"(in the stacks of a Chain) and quantized differently: "
                f"{_spec(other.q)} and {_spec(w.q)}; a file records one "
                "quantization per name.\nHint: quantize them alike, or "
                "dequantize one of them."
            )
    return found


def save(
    path: str | os.PathLike,
    model: PyTree,
    *,
    max_shard_size: int | str | None = None,
) -> list[str]:
    """Save a quantized model as safetensors: each
    [`eqxscan.quant.Quantized`][]'s `<name>.values` and `<name>.scales` per
    layer, the other arrays as [`eqxscan.save`][] names them, and how each
    weight was quantized in the metadata. Written as
    [`eqxscan.save_safetensors`][] writes (one file or Hugging Face's sharded
    layout, through temporary files moved into place once all are written).

    **Arguments:**

    - `path`: a `.safetensors` file, or a directory.
    - `model`: a model returned by [`eqxscan.quant.quantize`][] (or
      [`eqxscan.quant.quantize_file`][]), with concrete arrays.
    - `max_shard_size`: bytes per file (an int, or `"5GB"`, `"500MiB"`); only
      with a directory.

    **Returns:**

    The paths written, the index last.
    """
    model = with_int4_storage(model, "packed")  # files hold int4 two a byte
    quantized = _by_pattern(weights(model)[0])
    record = {
        pattern: dataclasses.asdict(_spec(w.q)) for pattern, w in quantized.items()
    }
    return save_safetensors(
        path,
        model,
        max_shard_size=max_shard_size,
        metadata={METADATA: json.dumps(record, sort_keys=True)},
    )


def _recorded(opened: Opened) -> dict[str, _Spec]:
    """What the files' metadata records of each quantized weight (nothing for
    files of another writer)."""
    texts = {file: meta.get(METADATA) for file, meta in opened.metadata.items()}
    found = {text for text in texts.values() if text is not None}
    if not found:
        return {}
    # The files whose record differs from the one most files hold.
    common = max(found, key=list(texts.values()).count)
    odd = [f for f, text in texts.items() if text != common]
    if odd:
        raise CorruptFileError(
            f"The files of {opened.where!r} record different quantizations in "
            f"their metadata {METADATA!r}: {odd[0]!r} differs from "
            f"{next(f for f, t in texts.items() if t == common)!r}; files of two "
            "saves are mixed, or one is damaged.\nHint: save the model again, or "
            "restore the directory from a copy."
        )
    # Every file holds the record: the first is named if it cannot be read.
    file = os.path.join(os.path.dirname(opened.where), next(iter(texts)))
    try:
        entries = json.loads(common)
        assert isinstance(entries, dict)
        return {
            pattern: _Spec(
                str(e["kind"]),
                None if e["group_size"] is None else int(e["group_size"]),
                str(e["orientation"]),
                str(e["dtype"]),
            )
            for pattern, e in entries.items()
        }
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise CorruptFileError(
            f"Safetensors file {file!r} has a metadata entry {METADATA!r} "
            "that is not what eqxscan.quant.save "
            f"writes ({type(e).__name__}: {e}).\nHint: save the model again; "
            f"{_DOCS}."
        ) from None


def _problems(opened: Opened, like: PyTree) -> list[tuple[str, str]]:
    """What makes the files unfit for `like`, each a line and its hint."""
    held, floats = weights(like)
    quantized = _by_pattern(held)
    recorded = _recorded(opened)
    arrays = opened.arrays
    problems = []
    for pattern, w in quantized.items():
        found = [n for n in w.names if n in arrays]
        spec = recorded.get(pattern)
        if found:
            shape, dtype = arrays[found[0]].shape, arrays[found[0]].dtype
            problems.append(
                (
                    f"`{pattern}` is a float array in the file "
                    f"({np.dtype(dtype).name}{list(shape)} at '{found[0]}'), and "
                    f"quantized in the model ({describe(w.q)})",
                    "Hint: quantize a float file with eqxscan.quant.quantize_file("
                    "path, like, targets=...), or load it with eqxscan.load into "
                    "the float model.",
                )
            )
        elif spec is not None and spec != _spec(w.q):
            problems.append(
                (
                    f"`{pattern}` is quantized as {spec} in the file, as "
                    f"{_spec(w.q)} in the model",
                    "Hint: build like with eqxscan.quant.quantize(...) as the "
                    "file was quantized (its kind, group_size and orientation), "
                    "from a float model of the file's dtype.",
                )
            )
        elif spec is None and f"{w.names[0]}.values" in arrays:
            problems.append(
                (
                    f"`{pattern}` is quantized in the file ('{w.names[0]}.values') "
                    f"with no record of how (its metadata {METADATA!r})",
                    "Hint: eqxscan.load(path, like) reads it, checking shapes "
                    "only; eqxscan.quant.save records how.",
                )
            )
    for pattern, spec in recorded.items():
        if pattern in floats and pattern not in quantized:
            problems.append(
                (
                    f"`{pattern}` is quantized in the file ({spec}), and a float "
                    f"array in the model ({floats[pattern]})",
                    "Hint: pass like=eqxscan.quant.quantize(model, targets, ...) "
                    "as the file was quantized, and dequantize after loading if "
                    "float weights are wanted.",
                )
            )
    return problems


def _fit(
    opened: Opened,
    like: T,
    state: Mapping[str, object],
    build: str = "the saved model's configuration (depth, sizes, dtype), quantized "
    "as the file was.",
) -> T:
    """`from_state_dict`, its errors naming the files."""
    try:
        return from_state_dict(like, state)
    except (CorruptFileError, _NonFinite):
        raise
    except ValueError as e:
        first, *rest = str(e).splitlines()
        hint = rest or [f"Hint: build like with {build}"]
        raise ValueError(
            "\n".join([f"{opened.where!r} does not fit the model: {first}", *hint])
        ) from None


def load(path: str | os.PathLike, like: T) -> T:
    """Load a file written by [`eqxscan.quant.save`][] into a quantized model
    shaped like `like`.

    Before any array is read, each weight's recorded quantization (kind, group
    size, orientation, float dtype) is checked against `like`'s, and names,
    shapes and dtypes as [`eqxscan.load`][] checks them; each array is checked
    against its digest as it is read. The arrays load bit for bit.

    **Arguments:**

    - `path`: a `.safetensors` file, a `model.safetensors.index.json`, or a
      directory holding either (both: `model.safetensors`, as transformers
      reads it).
    - `like`: a quantized model of the saved layout (arrays or
      `jax.ShapeDtypeStruct`s), e.g.
      `eqx.filter_eval_shape(eqxscan.quant.quantize, float_model, targets)`.

    **Returns:**

    `like` with its arrays replaced by the saved ones; int4 values held as
    `like`'s are (files hold them packed, see
    [`eqxscan.quant.with_int4_storage`][]).

    **Raises:**

    `ValueError` naming each weight quantized otherwise in the file, or float
    on one side and quantized on the other, and the keys, layers and shapes
    that differ, or a LoRA saved with another `alpha`; `FileNotFoundError` and
    [`eqxscan.checkpoint.CorruptFileError`][] as [`eqxscan.load_safetensors`][]
    raises them.
    """
    check_like("eqxscan.quant.load", like, _EXAMPLE)
    given = like
    like = jtu.tree_map(_packed_like, like, is_leaf=is_quantized)
    # Each weight's quantization first, every one named; then, `like` given,
    # what any stand-in records (a LoRA's alpha), as `eqxscan.load` checks it.
    with open_safetensors(path) as opened:
        problems = _problems(opened, like)
        if problems:
            raise ValueError(
                f"{opened.where!r} does not fit the quantized model: "
                f"{listed([line for line, _ in problems])}.\n{problems[0][1]}"
            )
    with open_safetensors(path, like) as opened:
        # A float8 array of a file read as the `uint8` codes fp8 `values` are
        # held as (bit for bit): a file converted to safetensors' `F8_E4M3`
        # loads too.
        fp8 = np.dtype(jnp.float8_e4m3fn)
        state = {
            name: Lazy(a.shape, np.uint8, lambda a=a: np.asarray(a).view(np.uint8))
            if name.endswith(".values") and a.dtype == fp8
            else a
            for name, a in opened.arrays.items()
        }
        loaded = _fit(opened, like, state)
    return jtu.tree_map(_held_as, loaded, given, is_leaf=is_quantized)


def _packed_like(q: object) -> object:
    """A native int4 `Quantized` of `like` described packed, as files hold it
    (shapes and placement only: `like`'s arrays are not converted)."""
    if not isinstance(q, Quantized) or not q.native:
        return q
    v = q.values
    placed = getattr(v, "sharding", None)
    described = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=placed)
    return with_int4_storage(eqx.tree_at(lambda q: q.values, q, described), "packed")


def _held_as(loaded: object, like: object) -> object:
    """A loaded (packed) `Quantized` with its values held as `like`'s are, and
    where `like`'s values are placed."""
    if isinstance(loaded, Quantized) and isinstance(like, Quantized) and like.native:
        native = with_int4_storage(loaded, "native")
        sharding = getattr(like.values, "sharding", None)
        if sharding is None:
            return native
        values = jax.device_put(native.values, sharding)
        return eqx.tree_at(lambda q: q.values, native, values)
    return loaded


class _NonFinite(ValueError):
    """A float layer of the file holds NaN or inf: said as it is, not as a
    file that does not fit the model."""


def _quantized_layer(
    weight: Weight, name: str, array: object, where: str
) -> tuple[Lazy, Lazy]:
    """One layer's `values` and `scales`, quantized from its float array when
    NumPy asks for either (the other kept until asked for)."""
    q, kept = weight.q, {}

    def take(piece: int) -> np.ndarray:
        if piece in kept:
            return kept.pop(piece)
        # `device_put` uses the host array's pages where it can (no copy);
        # compiled, the steps fuse (eagerly each would allocate a float copy).
        w = jax.device_put(np.asarray(array))
        done = _quantize_array(w, q.kind, q.orientation, q.group_size, q.name)
        del w  # before the next layer is read
        pieces = (np.asarray(done.values), np.asarray(done.scales))
        del done
        give_back_freed()  # XLA's buffers of the layer, freed
        # A NaN or inf gives its column (or group) an inf scale.
        if not np.isfinite(pieces[1]).all():
            raise _NonFinite(
                f"quantize_file: '{name}' in {where!r} holds NaN or inf (the "
                f"weight `{weight.pattern}`); its scales would be meaningless."
                "\nHint: check the file (eqxscan.load it and run "
                "eqxscan.find_nonfinite), or leave this weight out of targets."
            )
        kept[1 - piece] = pieces[1 - piece]
        return pieces[piece]

    return (
        Lazy(q.values.shape[-2:], q.values.dtype, lambda: take(0)),
        Lazy(q.scales.shape[-2:], q.scales.dtype, lambda: take(1)),
    )


def _quantizing(opened: Opened, qlike: PyTree) -> dict[str, object]:
    """The quantized model's state dict, each quantized layer made from the
    file's float array (its shape and dtype checked) when asked for."""
    layers = {n: w for w in weights(qlike)[0] for n in w.names}
    state: dict[str, object] = {}
    wrong = []
    for name, array in opened.arrays.items():
        weight = layers.get(name)
        if weight is None:
            state[name] = array
            continue
        q = weight.q
        want = (tuple(q.shape[-2:]), np.dtype(q.dtype))
        have = (tuple(array.shape), np.dtype(array.dtype))
        if have != want:
            wrong.append(
                f"'{name}': model has {want[1].name}{list(want[0])}, checkpoint "
                f"has {have[1].name}{list(have[0])}"
            )
            continue
        layer = _quantized_layer(weight, name, array, opened.where)
        state[f"{name}.values"], state[f"{name}.scales"] = layer
    if wrong:
        raise ValueError(
            f"{opened.where!r} does not fit the model: the weights to quantize "
            f"have the wrong shape or dtype: {listed(wrong)}.\n"
            "Hint: build like with the file's configuration (sizes and dtype)."
        )
    return state


def quantize_file(
    path: str | os.PathLike,
    like: T,
    *,
    targets: Target | Sequence[Target],
    name_map: NameMap | None = None,
    kind: Kind = "int8",
    group_size: int | None = 128,
    orientation: Orientation = "x@W",
    int4_storage: Int4Storage | Literal["auto"] = "auto",
) -> T:
    """Quantize a float safetensors checkpoint as it is read: the same model as
    `eqxscan.quant.quantize(eqxscan.load_safetensors(path, like,
    names=name_map), targets, ...)`, bit for bit, holding about two layers of
    one float weight beside the quantized model (each targeted weight is read,
    quantized and placed one layer at a time, the layer before freed by JAX at
    the next transfer; other arrays load as `load_safetensors` loads them).
    Peak RSS measured in docs/quantization.md#files. Where `like`'s float
    weight is sharded (a `NamedSharding`), its quantized arrays are placed
    along the same axes, as [`eqxscan.sharding.model_shardings`][] would.

    **Arguments:**

    - `path`: a `.safetensors` file, a `model.safetensors.index.json`, or a
      directory holding either (both: `model.safetensors`, as transformers
      reads it).
    - `like`: the float model of the file's layout (arrays or
      `jax.ShapeDtypeStruct`s, e.g. from `eqx.filter_eval_shape`).
    - `targets`, `kind`, `group_size`, `orientation`, `int4_storage`: as for
      [`eqxscan.quant.quantize`][] (int4 is quantized packed, then converted
      one weight at a time).
    - `name_map`: a [`eqxscan.checkpoint.NameMap`][] from the file's names to
      eqxscan's (e.g. a Hugging Face Llama's); by default eqxscan's own.

    **Returns:**

    The quantized model, as [`eqxscan.quant.quantize`][] returns it.

    **Raises:**

    As [`eqxscan.load_safetensors`][] for the files and names, and as
    [`eqxscan.quant.quantize`][] for the targets; `ValueError` naming the
    array of a weight that holds NaN or inf, a weight of `like` quantized
    already, or a file holding quantized weights (load those with
    [`eqxscan.quant.load`][]).
    """
    check_like("eqxscan.quant.quantize_file", like)  # the float model
    done = weights(like)[0]
    if done:
        raise ValueError(
            "eqxscan.quant.quantize_file: like must be the float model of the "
            f"file's layout, but `{done[0].pattern}` is quantized in it "
            f"({describe(done[0].q)}).\nHint: pass the float model (e.g. "
            "eqx.filter_eval_shape of its constructor); a file written by "
            "eqxscan.quant.save loads with eqxscan.quant.load(path, like)."
        )
    qlike = eqx.filter_eval_shape(
        quantize,
        like,
        targets,
        kind=kind,
        group_size=group_size,
        orientation=orientation,
        int4_storage="packed",  # as `_quantized_layer` makes them
    )
    # `like`'s own arrays where nothing is quantized (their placement kept);
    # quantized ones placed as the float weights they stand for.
    qlike = jtu.tree_map(_placed_as, qlike, like, is_leaf=is_quantized)
    with open_safetensors(path, like, names=name_map) as opened:
        # A file of quantized weights (recorded by `save`, or stored as
        # `<name>.values`) is loaded, not quantized.
        recorded = _recorded(opened)
        stored = [
            f"'{n}.values'"
            for w in weights(qlike)[0]
            for n in w.names
            if f"{n}.values" in opened.arrays
        ]
        found = [f"`{p}` ({spec})" for p, spec in recorded.items()] or stored
        if found:
            raise ValueError(
                f"eqxscan.quant.quantize_file: {opened.where!r} holds quantized "
                f"weights already ({', '.join(found[:3])}); quantize_file reads "
                "float weights.\nHint: load it with eqxscan.quant.load(path, "
                "like), like quantized as the file was, which checks how: e.g. "
                "eqx.filter_eval_shape(eqxscan.quant.quantize, model, targets, ...)."
            )
        build = (
            "the file's configuration (depth, sizes, dtype); each targeted "
            "'<name>' of the file is quantized into '<name>.values' and '.scales'."
        )
        quantized = _fit(opened, qlike, _quantizing(opened, qlike), build)
    give_back_freed()
    # Converted where it lies (XLA keeps the placement through the unpacking).
    return with_int4_storage(quantized, int4_storage)


def _placed_as(q: object, x: object) -> object:
    """`x`, the float model's leaf, where `q` is not quantized; else `q`'s
    stored arrays described placed as `x`'s sharding implies, where that is a
    `NamedSharding` (as `from_state_dict` will place them)."""
    if not isinstance(q, Quantized):
        return x
    float_sharding = getattr(x, "sharding", None)
    if not isinstance(float_sharding, NamedSharding):
        return q
    spec, mesh = float_sharding.spec, float_sharding.mesh
    return jtu.tree_map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=stored_sharding(a, q.ndim, spec, mesh)
        ),
        q,
    )


@functools.cache
def _malloc_trim() -> Callable[[int], object] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (OSError, AttributeError, TypeError):  # none; Windows: no CDLL(None)
        return None


def give_back_freed() -> None:
    """Hand the memory freed on the heap back to the system (glibc's
    `malloc_trim`): a loop over large layers otherwise keeps some of each."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
