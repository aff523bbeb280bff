"""`replace_weights`: the weights that targets (state-dict name patterns or module
types) name, each replaced by what a function builds from it: how
`eqxscan.adapters.add_lora` and `eqxscan.quant.quantize` find their weights."""

import fnmatch
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal, NoReturn, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from .._helpers.checks import Checked, describe, is_arraylike
from .walk import for_each, pattern, Site, walk


Target = str | type[eqx.Module]
"""A weight to replace: a state-dict name pattern (`"blocks.*.w1"`, `fnmatch`
syntax, layer indices shown as `*`), or a module type whose `weight` is replaced
(e.g. `eqx.nn.Linear`)."""

Orientation = Literal["x@W", "W@x"]
"""How a layer uses its weight (a [`eqxscan.adapters.LoRA`][]'s base, or the
float weight): `x @ W` (`[in, out]`, as `StackedMLP`'s `w1`) or `W @ x`
(`[out, in]`, as `eqx.nn.Linear`'s `weight` and PyTorch)."""


class MatmulOnly:
    """Mixed into a module standing where a weight was: it computes `x @ self`
    (orientation `"x@W"`) and `self @ x` (`"W@x"`), and no other array operation."""

    # The module's own fields and words for its errors ("The LoRA at ...",
    # `x @ lora`, made by add_lora, else use ...).
    name: str
    orientation: Orientation
    _label: ClassVar[str]
    _symbol: ClassVar[str]
    _maker: ClassVar[str]
    _instead: ClassVar[str]

    # NumPy's operators then return NotImplemented, so `np_array @ w` reaches
    # `__rmatmul__` too.
    __array_ufunc__ = None

    @property
    def shape(self) -> tuple[int, ...]: ...

    def _weight(self) -> str: ...  # the weight as the errors describe it

    def _where(self) -> str:
        return f"The {self._label} at `{self.name or '<unnamed>'}`"

    def _record(self) -> dict[str, float | int | str | None]:
        # Static fields it computes with that a checkpoint records beside its
        # arrays, and checks when loading (a LoRA's alpha); none by default.
        return {}

    def _rebuild(self, saved: str) -> str:
        # How to build one as saved, `saved` the recorded fields that differ.
        return f"{self._maker}(..., {saved})"

    def _check(self, used_as: Orientation, x: object) -> None:
        # One layer's weight, used as it computes, and x's size along the
        # contracted axis.
        op = f"x @ {self._symbol}" if used_as == "x@W" else f"{self._symbol} @ x"
        shape, where = self.shape, self._where()
        got = jnp.shape(x)  # pyright: ignore[reportArgumentType]
        x_axis, w_axis = (
            (-1, 0) if used_as == "x@W" else (-2 if len(got) > 1 else -1, 1)
        )
        if self.orientation != used_as:
            other = " @ ".join(reversed(op.split(" @ ")))
            # A module type's weights are 'W@x' whatever orientation= says.
            by = "a name pattern" if used_as == "x@W" else "a module type or pattern"
            raise TypeError(
                f"{where} has orientation {self.orientation!r} but was used "
                f"as `{op}`; it computes `{other}` only.\nHint: for a layer that "
                f"computes `{op}`, pass {self._maker} {by} and orientation="
                f"{used_as!r}."
            )
        if len(shape) != 2:
            raise TypeError(
                f"{where} ({self._weight()}) has {len(shape) - 2} layer axes "
                f"in front; `{op}` takes one layer's weight.\nHint: it is used "
                "inside its Stacked's layers, which the scan hands one layer each; "
                "or index the stack first."
            )
        if len(got) == 0 or got[x_axis] != shape[w_axis]:
            raise TypeError(
                f"{where}: `{op}` got x of shape {tuple(got)}, but it is "
                f"{self._weight()} ({used_as}), so x's axis {x_axis} must have size "
                f"{shape[w_axis]}.\nHint: check the layer's input shape."
            )

    def _unsupported(self, *_: object, **__: object) -> NoReturn:
        ops = f"`x @ {self._symbol}` and `{self._symbol} @ x`"
        raise TypeError(
            f"{self._where()} ({self._weight()}) supports only {ops}, not this "
            f"operation.\nHint: a {type(self).__name__} computes only {ops}; for "
            f"anything else, use {self._instead}."
        )

    __add__ = __radd__ = __sub__ = __rsub__ = _unsupported
    __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _unsupported
    __pow__ = __neg__ = __getitem__ = __array__ = _unsupported
    astype = reshape = transpose = _unsupported  # not an AttributeError naming none

    @property
    def T(self) -> NoReturn:  # noqa: N802  # the array attribute's name
        self._unsupported()


@runtime_checkable
class StandsForWeight(Protocol):
    """A module keeping a weight in other arrays (`eqxscan.quant.Quantized`),
    recognised by `stored_arrays` so that the core need not import it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def ndim(self) -> int: ...

    def stored_arrays(self) -> tuple[Array, ...]: ...


Weight = Array | StandsForWeight
Make = Callable[[Weight, int, str, Orientation], PyTree]
"""`make(weight, depth, name, orientation)`: the replacement of one weight with
`depth` layer axes in front, named `name` (layer indices as `*`)."""


def stands_for_weight(node: object) -> bool:
    return isinstance(node, eqx.Module) and callable(
        getattr(type(node), "stored_arrays", None)
    )


def stored_sharding(
    array: Array | jax.ShapeDtypeStruct,
    ndim: int,
    spec: PartitionSpec,
    mesh: Mesh | AbstractMesh,
) -> NamedSharding:
    """Where to place an array that stores part of a float weight of `ndim`
    axes sharded as `spec` (a `Quantized`'s `values` or `scales`): along the
    same axes, if each axis of `array` divides (else replicated). An array of
    one axis more holds the input axis split in two (native int4
    `[..., groups, g, out]`): the groups take its spec."""
    axes = list(spec)
    if array.ndim == ndim + 1:
        axes += [None] * (ndim - len(axes))
        axes.insert(-1, None)
    fits = all(
        n is None or array.shape[i] % mesh.shape[n] == 0 for i, n in enumerate(axes)
    )
    return NamedSharding(mesh, PartitionSpec(*axes) if fits else PartitionSpec())


def weight_at(leaf: object) -> Weight | None:
    """What can be replaced at a leaf: an array, or a stand-in."""
    if stands_for_weight(leaf) or is_arraylike(leaf):
        return leaf  # pyright: ignore[reportReturnType]
    return None


def replace_weights(
    model: PyTree,
    targets: object,
    make: Make,
    *,
    orientation: Checked[Orientation],
    who: str,
    verb: tuple[str, str],
) -> PyTree:
    """`model` with each weight that `targets` name replaced by `make`'s result: a
    pattern's matches in `orientation`, a module type's `weight`s in `"W@x"`.
    `who` and `verb` (e.g. `("adapt", "adapted")`) word the errors."""
    if orientation not in ("x@W", "W@x"):
        raise ValueError(f"orientation must be 'x@W' or 'W@x', got {orientation!r}.")
    found = _targets(targets, who)
    patterns = [t for t in found if isinstance(t, str)]
    matched: set[str] = set()

    def replace(leaf: object, site: Site) -> object:
        name = pattern(site.path)
        hits = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
        weight = weight_at(leaf)
        if not hits or weight is None:
            return leaf
        matched.update(hits)
        return make(weight, site.depth, name, orientation)

    out = model
    if patterns:
        out = walk(replace, model, names=True, is_leaf=stands_for_weight)
    for kind in (t for t in found if not isinstance(t, str)):
        out = _replace_modules(out, kind, make, who, verb)
    missing = [p for p in patterns if p not in matched]
    if missing:
        named = _named_weights(model)
        matrices = sorted({n for n, w, depth in named if w.ndim - depth == 2})
        raise ValueError(
            f"{who}: the target pattern(s) {missing} match no array of the "
            f"model. Its 2-D weights are named {matrices[:12]}.\n"
            "Hint: names are eqxscan.to_state_dict's, with each layer index shown "
            f"as `*` (every layer of a stack is {verb[1]} together)."
        )
    return out


def _replace_modules(
    model: PyTree, kind: type[eqx.Module], make: Make, who: str, verb: tuple[str, str]
) -> PyTree:
    count = 0
    # Each weight's state-dict name, as a pattern's match has (a key path such
    # as `.groups[3].weight` would name a Chain's group, not its layer).
    names = {id(weight): name for name, weight, _ in _named_weights(model)}

    def replace(path: tuple, node: object) -> object:
        nonlocal count
        if not isinstance(node, kind):
            return node
        held = getattr(node, "weight", None)
        weight = weight_at(held)
        where = f"{who}: the {type(node).__name__} at `{jtu.keystr(path)}`"
        if isinstance(held, MatmulOnly) and weight is None:  # e.g. named twice
            raise TypeError(
                f"{where} holds a {type(held).__name__} as its weight, not an "
                f"array.\nHint: target each weight once (by name pattern or by "
                "module type), and the arrays inside it by name (`<weight>.base`)."
            )
        if weight is None:
            raise TypeError(
                f"{where} has no array `weight` to {verb[0]}.\nHint: target its "
                "weight by name instead."
            )
        if isinstance(node, eqx.nn.Conv | eqx.nn.ConvTranspose):
            # Its kernel has more axes than a matrix: the axes in front of a
            # module's weight would be taken for layers.
            raise TypeError(
                f"{where} holds a convolution kernel (weight "
                f"{describe(weight)}), not a matrix: only weights used as "
                f"`x @ W` or `W @ x` can be {verb[1]}.\nHint: target the "
                "model's Linear modules, or its matrices by name pattern."
            )
        count += 1
        name = names.get(id(weight), jtu.keystr(path) + ".weight")
        new = make(weight, max(weight.ndim - 2, 0), name, "W@x")
        return eqx.tree_at(lambda mod: mod.weight, node, new)

    is_kind = lambda x: isinstance(x, kind)  # noqa: E731
    out = jtu.tree_map_with_path(replace, model, is_leaf=is_kind)
    if count == 0:
        raise ValueError(
            f"{who}: the target {kind.__name__} matches no module of the "
            "model.\nHint: pass the type of the modules that hold the weights "
            "(e.g. eqx.nn.Linear), or a name pattern such as 'blocks.*.w1'."
        )
    return out


def _targets(targets: object, who: str) -> list[Target]:
    items = [targets] if isinstance(targets, (str, type)) else targets
    if not isinstance(items, Sequence) or not items:
        raise TypeError(
            f"{who}: targets must be a name pattern, a module type, or a "
            f"non-empty list of them, got {describe(targets)}.\nHint: e.g. "
            "targets=['blocks.*.w1', 'blocks.*.w2'] or targets=eqx.nn.Linear."
        )
    for t in items:
        if not (
            isinstance(t, str) or (isinstance(t, type) and issubclass(t, eqx.Module))
        ):
            raise TypeError(
                f"{who}: each target must be a name pattern (str) or an "
                f"eqx.Module type, got {describe(t)}.\nHint: e.g. 'blocks.*.w1' or "
                "eqx.nn.Linear."
            )
    return list(items)


def _named_weights(model: PyTree) -> list[tuple[str, Weight, int]]:
    # Every weight's name pattern, and the number of layer axes in front of it.
    found: list[tuple[str, Weight, int]] = []

    def visit(leaf: object, site: Site) -> None:
        if (weight := weight_at(leaf)) is not None:
            found.append((pattern(site.path), weight, site.depth))

    for_each(visit, model, names=True, is_leaf=stands_for_weight)
    return found
