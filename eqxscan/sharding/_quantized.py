"""Shardings of quantized weights: those of the float weights they stand for."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ..quant import Quantized


def follow_float_weights(
    model: PyTree,
    shardings: PyTree,
    mesh: Mesh,
    spec_of: Callable[[jax.ShapeDtypeStruct, int, tuple], PartitionSpec],
) -> PyTree:
    """`shardings` (of `model`'s arrays) with each `Quantized`'s `values` and
    `scales` sharded along the axis that `spec_of` shards its float weight along,
    each where that axis of its own divides (else replicated)."""

    def one(path: tuple, node: object, specs: PyTree) -> PyTree:
        if not isinstance(node, Quantized):
            return specs
        weight = jax.ShapeDtypeStruct(node.shape, node.dtype)
        spec = spec_of(weight, node.ndim - 2, path)
        return eqx.tree_at(
            lambda q: (q.values, q.scales),
            specs,
            tuple(
                NamedSharding(mesh, _along(spec, a.shape, mesh))
                for a in (node.values, node.scales)
            ),
        )

    is_q = lambda x: isinstance(x, Quantized)  # noqa: E731
    return jtu.tree_map_with_path(one, model, shardings, is_leaf=is_q)


def _along(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """`spec` for an array of `shape`, or replicated where an axis it shards
    does not divide."""
    for axis, name in enumerate(spec):
        if name is not None and shape[axis] % mesh.shape[name]:
            return PartitionSpec()
    return spec
