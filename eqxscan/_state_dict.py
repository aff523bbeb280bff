"""Per-layer checkpoint layouts: a stacked model as a flat, torch/HF-style state dict.

Names are dotted attribute paths. Inside a `Stacked` the layer index replaces the
stacked axis (and the `Stacked`'s own `layers` field is left out), so the first
layer's `w1` of a `StackedMLP` is `"blocks.0.w1"`, exactly as if the layers had
been kept in a list. List and tuple elements are named by their index and dict
entries by their key: `"heads.3.weight"`, `"norms.final.scale"`.
"""

import re
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._checks import describe, is_arraylike
from ._stacked import restack, Stacked


# A name is a tuple of parts; `_AXIS` marks where a layer index goes (one per
# enclosing `Stacked`, outermost first).
_AXIS: Any = object()
_MAX_LISTED = 10


def key_name(entry: Any, where: tuple) -> str:
    """The name of one path entry in a state dict (an attribute, index or key);
    `where` is the path so far, for the error message."""
    if isinstance(entry, jtu.GetAttrKey):
        return entry.name
    if isinstance(entry, jtu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, (jtu.DictKey, jtu.FlattenedIndexKey)):
        name = str(entry.key)
    else:
        name = str(entry)
    if "." in name or name == "":
        raise ValueError(
            f"Cannot name the entry {entry} under `{_pattern(where) or '<root>'}` "
            "in a state dict: names are joined with '.', so dict keys must be "
            "non-empty and contain no '.'."
        )
    return name


def _pattern(parts: tuple, fill: str = "*") -> str:
    return ".".join(fill if p is _AXIS else p for p in parts)


def _regex(parts: tuple) -> str:
    return r"\.".join(r"\d+" if p is _AXIS else re.escape(p) for p in parts)


def _fill(parts: tuple, index: tuple[int, ...]) -> str:
    it = iter(index)
    return ".".join(str(next(it)) if p is _AXIS else p for p in parts)


class _Leaf:
    """An array leaf of the model: its name pattern and the layer axes in front."""

    def __init__(self, parts: tuple, depths: tuple[int, ...], leaf: Any):
        self.parts, self.depths, self.leaf = parts, depths, leaf
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"`{_pattern(parts)}` holds typed PRNG keys ({leaf.dtype}), which "
                "have no NumPy dtype; keep `jax.random.key_data(key)` in the model "
                "instead, or leave keys out of checkpoints."
            )
        if tuple(leaf.shape[: len(depths)]) != depths:
            raise ValueError(
                f"`{_pattern(parts)}` has shape {tuple(leaf.shape)}, but it sits "
                f"inside Stacked layers of depth {depths}, so its leading axes "
                f"must be {depths}."
            )
        self.shape = tuple(leaf.shape[len(depths) :])
        self.dtype = np.dtype(leaf.dtype)

    def names(self) -> list[str]:
        return [_fill(self.parts, i) for i in np.ndindex(*self.depths)]


class _Stack:
    """A `Stacked` inside the model: where it is, its depth, its leaves' suffixes."""

    def __init__(self, parts: tuple, depth: int):
        self.parts, self.depth = parts, depth
        self.suffixes: set[str] = set()


def _walk(
    node: Any,
    parts: tuple,
    depths: tuple[int, ...],
    visit: Callable[[_Leaf], Any],
    stacks: list[_Stack],
) -> Any:
    """Rebuild `node`, replacing each array leaf by `visit(_Leaf(...))`."""
    if is_arraylike(node):
        return visit(_Leaf(parts, depths, node))
    if isinstance(node, Stacked):
        stack = _Stack(parts, node.num_layers)
        stacks.append(stack)
        inner = parts + (_AXIS,)

        def record(leaf: _Leaf) -> Any:
            # Every leaf below this Stacked, nested Stacked's included.
            stack.suffixes.add(_regex(leaf.parts[len(inner) :]))
            return visit(leaf)

        layers = _walk(node.layers, inner, depths + (node.num_layers,), record, stacks)
        return restack(node, layers=layers)
    children, treedef = jtu.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    if jtu.treedef_is_leaf(treedef):  # a non-array leaf, e.g. a float or None
        return node
    new = [
        _walk(child, parts + (key_name(path[0], parts),), depths, visit, stacks)
        for path, child in children
    ]
    return jtu.tree_unflatten(treedef, new)


def _layout(model: Any) -> tuple[list[_Leaf], list[_Stack]]:
    leaves: list[_Leaf] = []
    stacks: list[_Stack] = []
    _walk(model, (), (), lambda leaf: leaves.append(leaf), stacks)
    return leaves, stacks


def to_state_dict(model: Any) -> dict[str, np.ndarray]:
    """Flatten `model` into a per-layer state dict of NumPy arrays.

    Every array leaf gets a dotted attribute path. Inside an
    [`eqxscan.Stacked`][] the layer index replaces the stacked axis and the
    `Stacked`'s own `layers` field is left out, torch/HF style: the first layer's
    `w1` of a [`eqxscan.StackedMLP`][] is `"blocks.0.w1"` with shape `[D, 4*D]`.
    List and tuple elements are named by index, dict entries by key
    (`"heads.3.weight"`); nested `Stacked`s give one index each
    (`"groups.1.2.weight"`). Non-array leaves (floats, activation functions,
    static fields) are not saved: they come from the model you load into.

    **Arguments:**

    - `model`: any pytree (usually an `eqx.Module`) possibly containing
      `Stacked`s, also nested or inside lists.

    **Returns:**

    A `dict[str, numpy.ndarray]` in the model's leaf order.
    """
    leaves, _ = _layout(model)
    # Layer-major order, as a list of layers would give: "blocks.0.w1",
    # "blocks.0.w2", ..., "blocks.1.w1". Each attribute prefix sorts by where it
    # first appears in the model, each layer axis by its index.
    first_seen: dict[tuple, int] = {}
    for leaf in leaves:
        for j in range(1, len(leaf.parts) + 1):
            first_seen.setdefault(leaf.parts[:j], len(first_seen))
    entries = []
    for leaf in leaves:
        if isinstance(leaf.leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"`{_pattern(leaf.parts)}` is an abstract {describe(leaf.leaf)}; "
                "to_state_dict needs concrete arrays."
            )
        array = np.asarray(leaf.leaf)
        for index, name in zip(np.ndindex(*leaf.depths), leaf.names()):
            it = iter(index)
            order = tuple(
                next(it) if p is _AXIS else first_seen[leaf.parts[: j + 1]]
                for j, p in enumerate(leaf.parts)
            )
            entries.append((order, name, np.asarray(array[index])))
    entries.sort(key=lambda e: e[0])
    return {name: value for _, name, value in entries}


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def _check_depths(stacks: list[_Stack], state_dict: Mapping[str, Any]) -> None:
    for stack in stacks:
        if not stack.suffixes:
            continue
        prefix = _regex(stack.parts) + r"\." if stack.parts else ""
        suffixes = "|".join(sorted(stack.suffixes))
        regex = re.compile(rf"{prefix}(\d+)\.(?:{suffixes})")
        found = {int(m.group(1)) for k in state_dict if (m := regex.fullmatch(k))}
        if found and max(found) + 1 != stack.depth:
            where = _pattern(stack.parts) or "the top-level Stacked"
            raise ValueError(
                f"Depth mismatch: model has L={stack.depth} layers in {where}, "
                f"checkpoint has {max(found) + 1}."
            )


def _restore(like: Any, value: np.ndarray) -> Any:
    if isinstance(like, np.ndarray):
        return value
    sharding = getattr(like, "sharding", None)
    if sharding is not None:
        return jax.device_put(value, sharding)
    return jnp.asarray(value)


def from_state_dict(like: Any, state_dict: Mapping[str, Any]) -> Any:
    """Load a per-layer state dict (as made by [`eqxscan.to_state_dict`][]) into a
    model of the same layout.

    The per-layer arrays are re-stacked along each `Stacked`'s layer axis. After
    loading, the `__check_init__` of every module that defines one is run again
    (for modules inside a `Stacked`, once per layer), so a
    [`eqxscan.StackedMLP`][] re-validates its `[L, D, 4*D]` layout.

    **Arguments:**

    - `like`: a model with the wanted structure: its arrays (or
      `jax.ShapeDtypeStruct`s, e.g. from `eqx.filter_eval_shape`) give the
      expected shapes and dtypes, and their shardings are kept. Everything that
      is not an array is taken from `like`.
    - `state_dict`: a mapping from names to NumPy (or JAX) arrays.

    **Returns:**

    `like` with every array replaced.

    **Raises:**

    `ValueError` for a different number of layers in a `Stacked` (naming both
    depths), missing or unexpected keys (naming them), or arrays of the wrong
    shape or dtype (naming the key and both shapes/dtypes).
    """
    leaves, stacks = _layout(like)
    _check_depths(stacks, state_dict)
    expected = {name: leaf for leaf in leaves for name in leaf.names()}
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        lines = []
        if missing:
            lines.append(f"missing keys: {_listed(missing)}")
        if unexpected:
            lines.append(f"unexpected keys: {_listed(unexpected)}")
        raise ValueError(
            "The state dict does not match the model: " + "; ".join(lines) + "."
        )
    wrong = []
    for name, leaf in expected.items():
        value = state_dict[name]
        if not hasattr(value, "dtype"):
            value = np.asarray(value)
        shape, dtype = tuple(np.shape(value)), np.dtype(value.dtype)
        if shape != leaf.shape or dtype != leaf.dtype:
            wrong.append(
                f"'{name}': model has {leaf.dtype.name}{list(leaf.shape)}, "
                f"checkpoint has {dtype.name}{list(shape)}"
            )
    if wrong:
        raise ValueError(
            "The state dict has arrays of the wrong shape or dtype: "
            + "; ".join(wrong[:_MAX_LISTED])
            + (
                f" and {len(wrong) - _MAX_LISTED} more"
                if len(wrong) > _MAX_LISTED
                else ""
            )
            + "."
        )

    def load(leaf: _Leaf) -> Any:
        parts = [np.asarray(state_dict[name]) for name in leaf.names()]
        value = (
            np.stack(parts).reshape(leaf.depths + leaf.shape)
            if leaf.depths
            else parts[0]
        )
        return _restore(leaf.leaf, value)

    model = _walk(like, (), (), load, [])
    _recheck(model)
    return model


def _run_check_init(module: eqx.Module) -> None:
    # What equinox runs after __init__: every class's own __check_init__.
    for cls in type(module).__mro__:
        check = cls.__dict__.get("__check_init__")
        if check is not None:
            check(module)


def _has_check_init(node: Any) -> bool:
    if isinstance(node, eqx.Module) and any(
        "__check_init__" in cls.__dict__ for cls in type(node).__mro__
    ):
        return True
    if is_arraylike(node):
        return False
    children, treedef = jtu.tree_flatten(node, is_leaf=lambda x: x is not node)
    return not jtu.treedef_is_leaf(treedef) and any(map(_has_check_init, children))


def _recheck(node: Any) -> None:
    if isinstance(node, Stacked):
        # A layer's checks expect one layer's shapes: run them layer by layer.
        if _has_check_init(node.layers):
            for i in range(node.num_layers):
                _recheck(node[i])
        return
    if is_arraylike(node):
        return
    children, treedef = jtu.tree_flatten(node, is_leaf=lambda x: x is not node)
    if not jtu.treedef_is_leaf(treedef):
        for child in children:
            _recheck(child)
    if isinstance(node, eqx.Module):
        _run_check_init(node)
