"""Sharding constraints that work for both kinds of mesh axes JAX offers."""

from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding


def is_explicit(sharding: Any) -> bool:
    """Whether `sharding` lives on a mesh with `Explicit` axes (sharding in types)."""
    return isinstance(sharding, NamedSharding) and any(
        t == AxisType.Explicit for t in sharding.mesh.axis_types
    )


def constrain(tree: Any, shardings: Any) -> Any:
    """Constrain the array leaves of `tree` to `shardings` (one `Sharding` or a
    pytree prefix of `tree`; `None` entries leave their subtree alone).

    This is `jax.lax.with_sharding_constraint` on `Auto` mesh axes and
    `jax.sharding.reshard` on `Explicit` ones; both also place concrete arrays
    outside `jit`. Non-array leaves pass through.
    """
    dyn, static = eqx.partition(tree, eqx.is_array)

    def one(sharding: Any, sub: Any) -> Any:
        if sharding is None or not jtu.tree_leaves(sub):
            return sub
        if not isinstance(sharding, Sharding):
            raise TypeError(
                "shardings must be jax.sharding.Sharding objects (or None), got "
                f"{type(sharding).__name__}."
            )
        if is_explicit(sharding):
            return jax.sharding.reshard(sub, sharding)
        return jax.lax.with_sharding_constraint(sub, sharding)

    dyn = jtu.tree_map(one, shardings, dyn, is_leaf=lambda x: x is None)
    return eqx.combine(dyn, static)


def layers_may_be_sharded(tree: Any) -> bool:
    """Whether the weights in `tree` may be split over devices, as far as a traced
    value shows: an `Explicit` mesh axis of size > 1 in a leaf's type, or an
    `Auto` mesh axis of size > 1 in the mesh set with `jax.set_mesh` (`Auto`
    shardings are not part of a traced value's type, so such a mesh may shard
    anything)."""
    mesh = jax.sharding.get_abstract_mesh()
    if any(
        size > 1 and kind == AxisType.Auto
        for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True)
    ):
        return True
    for leaf in jtu.tree_leaves(tree):
        if not eqx.is_array(leaf):
            continue
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        spec = getattr(sharding, "spec", None)
        if spec is None:
            continue
        sizes = dict(sharding.mesh.shape)
        for entry in spec:
            names = entry if isinstance(entry, tuple) else (entry,)
            if any(sizes.get(name, 1) > 1 for name in names if name is not None):
                return True
    return False


def check_layer_sharding(layer_sharding: Any) -> None:
    """Raise unless `layer_sharding` is `None` or a `jax.sharding.Sharding`."""
    if layer_sharding is None or isinstance(layer_sharding, Sharding):
        return
    hint = (
        "; a PartitionSpec needs its mesh: NamedSharding(mesh, spec)"
        if isinstance(layer_sharding, PartitionSpec)
        else ""
    )
    raise TypeError(
        "layer_sharding must be a jax.sharding.Sharding (e.g. a replicated "
        f"NamedSharding) or None, got {layer_sharding!r}{hint}."
    )
