"""Sharding constraints that work for both kinds of mesh axes JAX offers."""

from typing import TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding
from jaxtyping import PyTree

from .checks import Checked


T = TypeVar("T")


def align(shardings: object, tree: PyTree) -> PyTree:
    """`shardings` (one `Sharding`, `None`, or a pytree prefix of `tree`) as a
    pytree of `tree`'s structure. Matched by key path, so static fields may differ
    (a `Stacked`'s `layer_sharding`, set after the shardings were computed)."""
    if shardings is None or isinstance(shardings, Sharding):
        return jtu.tree_map(lambda _: shardings, tree)
    table = dict(jtu.tree_leaves_with_path(shardings, is_leaf=is_none))

    def one(path: tuple, leaf: object) -> object:
        for n in range(len(path), -1, -1):
            if path[:n] in table:
                return table[path[:n]]
        raise ValueError(
            f"shardings has no entry for `tree{jtu.keystr(path)}` (nor for any "
            "subtree holding it).\nHint: shardings must have the structure of "
            "the tree it places, or be a prefix of it."
        )

    return jtu.tree_map_with_path(one, tree)


def constrain(
    tree: T, shardings: Checked[Sharding | PyTree[Sharding | None] | None]
) -> T:
    """The array leaves of `tree` constrained to `shardings` (`None`: left
    alone), matched as `align` matches them: `with_sharding_constraint` on `Auto`
    mesh axes, `reshard` on `Explicit` ones."""
    dyn, static = eqx.partition(tree, eqx.is_array)

    def one(path: tuple, sharding: object, leaf: object) -> object:
        if sharding is None:
            return leaf
        if not isinstance(sharding, Sharding):
            hint = (
                "\nHint: a PartitionSpec needs its mesh: NamedSharding(mesh, spec)."
                if isinstance(sharding, PartitionSpec)
                else ""
            )
            raise TypeError(
                "shardings must be jax.sharding.Sharding objects (or None), got "
                f"{type(sharding).__name__} for `tree{jtu.keystr(path)}`.{hint}"
            )
        if isinstance(sharding, NamedSharding) and any(
            t == AxisType.Explicit for t in sharding.mesh.axis_types
        ):
            return jax.sharding.reshard(leaf, sharding)
        return jax.lax.with_sharding_constraint(leaf, sharding)

    dyn = jtu.tree_map_with_path(one, align(shardings, dyn), dyn, is_leaf=is_none)
    return eqx.combine(dyn, static)


def spans_devices(sharding: PyTree) -> bool:
    """Whether a `layer_sharding` (a `Sharding` or a pytree of them) is over
    more than one device: only then may a step gather its layer from others (a
    gathered layer's sharding is often replicated, `P()`, its storage split);
    on one device an FSDP layout gathers nothing, and the step is the plain one."""
    is_sharding = lambda x: isinstance(x, Sharding)  # noqa: E731
    return any(
        len(leaf.device_set) > 1
        for leaf in jtu.tree_leaves(sharding, is_leaf=is_sharding)
        if isinstance(leaf, Sharding)
    )


def layers_may_be_sharded(tree: PyTree) -> bool:
    """Whether the weights in `tree` may be split over devices: an `Explicit`
    mesh axis of size > 1 in a leaf's type, or an `Auto` one in the mesh set
    with `jax.set_mesh` (not in a traced value's type: it may shard anything)."""
    mesh = jax.sharding.get_abstract_mesh()
    if any(
        size > 1 and kind == AxisType.Auto
        for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True)
    ):
        return True
    for leaf in filter(eqx.is_array, jtu.tree_leaves(tree)):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        if isinstance(sharding, NamedSharding):
            sizes = dict(sharding.mesh.shape)
            names = [
                n for e in sharding.spec for n in (e if isinstance(e, tuple) else (e,))
            ]
            if any(sizes.get(n, 1) > 1 for n in names if n is not None):
                return True
    return False


def check_layer_sharding(layer_sharding: object, layers: PyTree) -> None:
    """Raise unless `layer_sharding` is `None`, a `Sharding`, or a pytree of them
    prefixing one layer's arrays in `layers`."""
    if layer_sharding is None or isinstance(layer_sharding, Sharding):
        return
    leaves = jtu.tree_leaves(layer_sharding)
    bad = next((x for x in leaves if not isinstance(x, Sharding)), None)
    if bad is not None or not leaves:
        hint = (
            "; a PartitionSpec needs its mesh: NamedSharding(mesh, spec)"
            if isinstance(bad if bad is not None else layer_sharding, PartitionSpec)
            else ""
        )
        raise TypeError(
            "layer_sharding must be a jax.sharding.Sharding (e.g. a replicated "
            "NamedSharding), a pytree of them matching one layer's arrays, or None, "
            f"got {layer_sharding!r}{hint}."
        )
    try:
        hash(layer_sharding)
    except TypeError:
        raise TypeError(
            "layer_sharding is a static field, so it must be hashable, but it is "
            f"a {type(layer_sharding).__name__} of shardings.\nHint: use the "
            "layer's own structure, e.g. jax.tree.map(f, eqx.filter(stack.layers, "
            "eqx.is_array)), or a tuple."
        ) from None
    arrays = eqx.filter(layers, eqx.is_array)
    try:
        jtu.tree_map(lambda s, x: None, layer_sharding, arrays, is_leaf=is_none)
    except ValueError:
        raise ValueError(
            "layer_sharding is a pytree that does not match the layers' arrays: "
            f"expected a prefix of {jtu.tree_structure(arrays)}, got "
            f"{jtu.tree_structure(layer_sharding)}.\nHint: build it from "
            "eqx.filter(stack.layers, eqx.is_array), or use "
            "eqxscan.sharding.gather_layers(..., keep=...)."
        ) from None


def is_none(x: object) -> bool:
    """As `is_leaf`: keeps `None` entries as leaves."""
    return x is None


def is_placeholder(x: object) -> bool:
    """`None` (`eqx.filter`) or optax's `MaskedNode`, by name: no optax import."""
    return x is None or type(x).__name__ == "MaskedNode"
