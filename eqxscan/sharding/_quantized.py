"""Shardings of weights stored in other arrays (`eqxscan.quant.Quantized`):
those of the float weights they stand for."""

from collections.abc import Callable
from typing import cast

import jax
import jax.tree_util as jtu
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._internal import stands_for_weight, StandsForWeight, stored_sharding


def follow_float_weights(
    model: PyTree,
    shardings: PyTree,
    mesh: Mesh,
    spec_of: Callable[[jax.ShapeDtypeStruct, int, tuple], PartitionSpec],
) -> PyTree:
    """`shardings` (of `model`'s arrays) with the stored arrays of each weight
    kept in other arrays (a `Quantized`'s `values` and `scales`) sharded along
    the axis that `spec_of` shards its float weight along, each where that axis
    of its own divides (else replicated)."""

    def one(path: tuple, node: object, specs: PyTree) -> PyTree:
        # A filtered one (`eqx.filter(model, eqx.is_inexact_array)`: values
        # None) has no float shape: its arrays keep the rule for any array.
        if not stands_for_weight(node) or getattr(node, "shape", None) is None:
            return specs
        w = cast(StandsForWeight, node)
        spec = spec_of(jax.ShapeDtypeStruct(w.shape, w.dtype), w.ndim - 2, path)
        # Its array leaves are the stored arrays; `stored_arrays()` itself is
        # typed to return arrays, not shardings nor `eval_shape`'s structs.
        return jtu.tree_map(lambda a: stored_sharding(a, w.ndim, spec, mesh), node)

    return jtu.tree_map_with_path(one, model, shardings, is_leaf=stands_for_weight)
