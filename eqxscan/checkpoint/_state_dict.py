"""Per-layer checkpoint layouts: a stacked model as a flat, torch/HF-style state dict.

Names are dotted attribute paths, with the layer index in place of a `Stacked`'s
layer axis (its `layers` field left out): `"blocks.0.w1"`, as if the layers were
a list. A `Chain`'s layers are numbered in the chain, whatever its grouping;
list elements by index, dict entries by key (`"norms.final.scale"`).
"""

import dataclasses
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, cast, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree, TypeCheckError

from .. import Stacked
from .._internal import (
    describe,
    docs,
    index,
    is_arraylike,
    is_key,
    is_placeholder,
    key_data,
    keys_like,
    layer_names,
    LayerNumbering,
    pattern,
    placed_like,
    resolve,
    Site,
    walk,
)
from ._files import host_empty, Lazy, listed, shape_dtype


# A name is a tuple of parts: strings, and a `LayerNumbering` where a layer number
# goes (one per enclosing `Stacked` or `Chain`, outermost first).
Parts = tuple[str | LayerNumbering, ...]
T = TypeVar("T")


def _regex(parts: Parts) -> str:
    return r"\.".join(
        r"\d+" if isinstance(p, LayerNumbering) else re.escape(p) for p in parts
    )


_ArrayLeaf = jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct


class _Leaf:
    """An array leaf of the model: its name pattern and the layer axes in front."""

    def __init__(self, leaf: _ArrayLeaf, site: Site):
        self.parts, self.depths, self.leaf = site.path, site.axes, leaf
        self.enclosing = site.enclosing
        # Typed PRNG keys are stored as their data (a trailing axis more).
        self.key = is_key(leaf)
        data = key_data(leaf) if self.key else leaf
        if tuple(leaf.shape[: len(site.axes)]) != site.axes:
            raise ValueError(
                f"`{pattern(site.path)}` has shape {tuple(leaf.shape)}, but it sits "
                f"inside Stacked layers of depth {site.axes}, so its leading axes "
                f"must be {site.axes}.\nHint: an optimizer state shaped otherwise "
                "than the model (a factored one, as optax.adafactor's) saves per "
                "layer under eqxscan.optim.layerwise, or whole with "
                f"eqxscan.checkpoint.CheckpointManager; see {docs('checkpoints.md')}."
            )
        self.shape = tuple(data.shape[len(site.axes) :])
        self.dtype = np.dtype(data.dtype)

    def names(self) -> list[str]:
        return layer_names(self.parts, self.depths)


def _map_arrays(fn: Callable[[_Leaf], object], model: PyTree) -> PyTree:
    # `model` with each array leaf replaced by `fn(_Leaf(...))`.

    def one(leaf: object, site: Site) -> object:
        return fn(_Leaf(cast(_ArrayLeaf, leaf), site)) if is_arraylike(leaf) else leaf

    return walk(one, model, names=True)


def _layout(model: PyTree) -> list[_Leaf]:
    leaves: list[_Leaf] = []
    _map_arrays(leaves.append, model)
    return leaves


def to_state_dict(model: PyTree) -> dict[str, np.ndarray]:
    """Flatten `model` into a per-layer state dict of NumPy arrays.

    Every array leaf gets a dotted attribute path; inside an
    [`eqxscan.Stacked`][] the layer index replaces the stacked axis and its
    `layers` field is left out, torch/HF style: the first layer's `w1` of a
    [`eqxscan.StackedMLP`][] is `"blocks.0.w1"`, of shape `[D, 4*D]`. List and
    tuple elements are named by index, dict entries by key (`"heads.3.weight"`);
    nested `Stacked`s give one index each (`"groups.1.2.weight"`). Non-array
    leaves (floats, activations, static fields) are not saved: they come from
    the model you load into.

    **Arguments:**

    - `model`: any pytree (usually an `eqx.Module`), with `Stacked`s anywhere.

    **Returns:**

    A `dict[str, numpy.ndarray]` in the model's leaf order.
    """
    return {name: lazy.read() for name, lazy in host_entries(model, "to_state_dict")}


def host_entries(
    model: PyTree, who: str, *, sliced: bool = False
) -> list[tuple[str, Lazy]]:
    """`model`'s per-layer arrays in `to_state_dict`'s order, read when asked for:
    each leaf copied once, or, with `sliced`, one layer's slice at a time."""
    hosts: dict[int, np.ndarray] = {}

    def reader(leaf: _Leaf, at: tuple[int, ...]) -> Callable[[], np.ndarray]:
        def read() -> np.ndarray:
            x = key_data(leaf.leaf) if leaf.key else leaf.leaf
            if sliced and isinstance(x, jax.Array):
                if not all(d.platform == "cpu" for d in x.devices()):
                    return np.asarray(index(x, at))  # one slice off the device
            if id(leaf) not in hosts:  # on the host already: a view, no copy
                hosts[id(leaf)] = np.asarray(x)
            return np.asarray(index(hosts[id(leaf)], at))  # a 0-d leaf: not a scalar

        return read

    out = []
    for name, leaf, at in entries_of(model):
        if isinstance(leaf.leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"{who} needs concrete arrays, but '{name}' is an abstract "
                f"{describe(leaf.leaf)}."
            )
        out.append((name, Lazy(leaf.shape, leaf.dtype, reader(leaf, at))))
    return out


def entries_of(model: PyTree) -> list[tuple[str, "_Leaf", tuple[int, ...]]]:
    # `(name, leaf, layer index)` of each entry, in `to_state_dict`'s layer-major
    # order, as a list of layers would give: "blocks.0.w1", "blocks.0.w2", ...,
    # "blocks.1.w1". Each attribute prefix sorts by where it first appears in
    # the model, each layer axis by its index.
    leaves = _layout(model)
    first_seen: dict[tuple, int] = {}
    for leaf in leaves:
        for j in range(1, len(leaf.parts) + 1):
            first_seen.setdefault(leaf.parts[:j], len(first_seen))
    entries = []
    for leaf in leaves:
        for at, name in zip(np.ndindex(*leaf.depths), leaf.names()):
            resolved = resolve(leaf.parts, at)
            order = tuple(
                resolved[j]
                if isinstance(p, LayerNumbering)
                else first_seen[leaf.parts[: j + 1]]
                for j, p in enumerate(leaf.parts)
            )
            entries.append((order, name, leaf, at))
    entries.sort(key=lambda e: e[0])
    return [(name, leaf, at) for _, name, leaf, at in entries]


def _check_depths(
    leaves: list[_Leaf], state_dict: Mapping[str, object], top: str
) -> None:
    # Raise if the checkpoint has another number of layers in a `Stacked` or
    # `Chain` of the model (found from the names of that module's leaves); `top`:
    # the model's type, for one at the top level.
    stacks: dict[Parts, tuple[int, set[str]]] = {}
    for leaf in leaves:
        for at, num_layers in leaf.enclosing:
            _, suffixes = stacks.setdefault(leaf.parts[:at], (num_layers, set()))
            suffixes.add(_regex(leaf.parts[at + 1 :]))
    names = [name for leaf in leaves for name in leaf.names()]
    for parts, (depth, suffixes) in stacks.items():
        prefix = _regex(parts) + r"\." if parts else ""
        regex = re.compile(rf"{prefix}(\d+)\.(?:{'|'.join(sorted(suffixes))})")
        # The layers the model holds here: all, but for a tree holding some of
        # a Chain's layers (`layerwise`'s state for one of its stacks).
        found, held = _layers(regex, state_dict), _layers(regex, names)
        if found and found != held and max(found) + 1 != depth:
            where = pattern(parts) or f"the top-level {top}"
            raise ValueError(
                f"Depth mismatch: model has L={depth} layers in {where}, "
                f"checkpoint has {max(found) + 1}."
            )


def _layers(regex: re.Pattern[str], keys: Iterable[str]) -> set[int]:
    return {int(m.group(1)) for k in keys if (m := regex.fullmatch(k))}


def from_state_dict(like: T, state_dict: Mapping[str, object]) -> T:
    """Load a per-layer state dict (as made by [`eqxscan.to_state_dict`][]) into a
    model of the same layout, re-stacking each `Stacked`'s layers. Every
    `__check_init__` is run again (inside a `Stacked`, once per layer), so a
    [`eqxscan.StackedMLP`][] re-validates its `[L, D, 4*D]` layout; not that of
    a module holding `None` where its annotation allows none (a gradient or
    `eqx.filter` tree: a [`eqxscan.quant.Quantized`][]'s integer values).

    **Arguments:**

    - `like`: a model of the wanted structure: its arrays (or
      `jax.ShapeDtypeStruct`s, e.g. from `eqx.filter_eval_shape`) give the
      shapes and dtypes, and their shardings are kept; everything else is
      taken from `like`.
    - `state_dict`: a mapping from names to NumPy (or JAX) arrays.

    **Returns:**

    `like` with every array replaced.

    **Raises:**

    `ValueError` for a different number of layers in a `Stacked` (naming both
    depths), missing or unexpected keys (naming them), or arrays of the wrong
    shape or dtype (naming the key and both shapes/dtypes).
    """
    return load_state_dict_into(like, state_dict)


def load_state_dict_into(
    like: T, state_dict: Mapping[str, object], weak: Collection[str] | None = None
) -> T:
    """`from_state_dict(like, state_dict)`, each array weakly typed where its
    names are in `weak` (a file's record of how it was saved; `None`: as in
    `like`)."""
    if not isinstance(state_dict, Mapping) or not all(
        isinstance(k, str) for k in state_dict
    ):
        what = (
            "a mapping with keys of type "
            f"{sorted({type(k).__name__ for k in state_dict})}"
            if isinstance(state_dict, Mapping)
            else f"{type(state_dict).__name__} ({describe(state_dict)})"
        )
        raise TypeError(
            f"from_state_dict: state_dict must be a mapping from names (str) to "
            f"arrays, got {what}.\nHint: pass what eqxscan.to_state_dict returns, "
            "or a dict such as dict(numpy.load(path))."
        )
    leaves = _layout(like)
    expected = {name: leaf for leaf in leaves for name in leaf.names()}
    _check_depths(leaves, state_dict, type(like).__name__)
    lines = [
        f"{what} keys: {listed(keys, ', ')}"
        for what, keys in (
            ("missing", [f"'{k}'" for k in expected if k not in state_dict]),
            ("unexpected", [f"'{k}'" for k in state_dict if k not in expected]),
        )
        if keys
    ]
    if lines:
        raise ValueError(
            f"The state dict does not match the model: {'; '.join(lines)}."
        )
    wrong, casts = [], set()
    for name, leaf in expected.items():
        shape, dtype = shape_dtype(state_dict[name])
        if shape != leaf.shape or dtype != leaf.dtype:
            wrong.append(
                f"'{name}': model has {leaf.dtype.name}{list(leaf.shape)}, "
                f"checkpoint has {dtype.name}{list(shape)}"
            )
            floats = all(jnp.issubdtype(d, jnp.floating) for d in (dtype, leaf.dtype))
            casts.add(leaf.dtype.name if shape == leaf.shape and floats else None)
    if wrong and None not in casts:
        # Shapes fit, floating dtypes differ: bfloat16 weights for a float32
        # model, the usual case with pretrained files.
        cast_to = f"dtype=jnp.{casts.pop()}" if len(casts) == 1 else "dtype="
        raise ValueError(
            f"The state dict has arrays of the wrong dtype (their shapes fit): "
            f"{listed(wrong)}.\nHint: cast them to the model's dtypes; loading a "
            f"file, {cast_to} casts its floating-point arrays (see "
            f"{docs('checkpoints.md')})."
        )
    if wrong:
        raise ValueError(
            f"The state dict has arrays of the wrong shape or dtype: {listed(wrong)}."
        )

    model = _map_arrays(lambda leaf: _load(leaf, state_dict, weak), like)
    try:
        _recheck(model)
    except TypeCheckError as e:
        # A shape check that `like` fails the same way: a tree of the model's
        # structure of other shapes (an optimizer's factored moments), not a
        # model. Value checks, and abstract `like`s, are always enforced.
        leaves = jtu.tree_leaves(like)
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
        if abstract or _failure(like) != (type(e), str(e)):
            raise
    return model


def _failure(like: object) -> tuple[type, str] | None:
    try:
        _recheck(like)
    except Exception as e:
        return type(e), str(e)
    return None


def _load(
    leaf: _Leaf, state_dict: Mapping[str, object], weak: Collection[str] | None
) -> jax.Array | np.ndarray | np.generic:
    # `leaf` read from `state_dict`, placed as the leaf of `like` is.
    value = _stacked(leaf, state_dict)
    if leaf.key:
        value = keys_like(leaf.leaf, value)
    saved = None if weak is None else all(n in weak for n in leaf.names())
    return placed_like(leaf.leaf, value, saved)


def _stacked(leaf: _Leaf, state_dict: Mapping[str, object]) -> jax.Array | np.ndarray:
    names = leaf.names()
    if not leaf.depths:  # in native byte order, which JAX needs
        return np.asarray(state_dict[names[0]]).astype(leaf.dtype, copy=False)
    # Each layer read straight into the stacked array, one at a time: a
    # file read lazily holds one layer's slice beside it, not all of them.
    value = host_empty(leaf.depths + leaf.shape, leaf.dtype)
    flat = value.reshape((math.prod(leaf.depths), *leaf.shape))  # sizes 0 too
    for k, name in enumerate(names):
        flat[k] = np.asarray(state_dict[name])
    if not isinstance(leaf.leaf, np.ndarray):
        # Its own pages, which a JAX array on the CPU can use: no copy.
        value = jax.device_put(value)
    return value


def _check_inits(node: object) -> list[Callable[[object], None]]:
    # What equinox runs after __init__: every class's own __check_init__; none
    # for a module with `None` (or optax's `MaskedNode`) where its annotation
    # allows none, as `eqx.filter` and gradients leave it: its checks would
    # read arrays it does not hold.
    if not isinstance(node, eqx.Module) or any(
        _placeholder(getattr(node, f.name, None), f.type)
        for f in dataclasses.fields(node)
    ):
        return []
    classes = type(node).__mro__
    return [
        c.__dict__["__check_init__"] for c in classes if "__check_init__" in c.__dict__
    ]


def _placeholder(value: object, annotation: Any) -> bool:
    if value is not None:
        return is_placeholder(value)
    # Imported here, at the first such field: beartype is slow to import.
    from beartype.door import is_bearable
    from beartype.roar import BeartypeException

    try:
        return not is_bearable(None, annotation)
    except BeartypeException:  # an annotation it cannot read: check as before
        return False


def _children(node: object) -> list:
    if is_arraylike(node):
        return []
    children, treedef = jtu.tree_flatten(node, is_leaf=lambda x: x is not node)
    return [] if jtu.treedef_is_leaf(treedef) else children


def _has_check_init(node: object) -> bool:
    return bool(_check_inits(node)) or any(map(_has_check_init, _children(node)))


def _recheck(node: object) -> None:
    if isinstance(node, Stacked):
        # A layer's checks expect one layer's shapes: run them layer by layer.
        if _has_check_init(node.layers):
            for i in range(node.num_layers):
                _recheck(node[i])
        return
    for child in _children(node):
        _recheck(child)
    for check in _check_inits(node):
        check(node)
