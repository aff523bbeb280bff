"""Index a tree at layer `i`: the one definition, re-exported by the layer-call
seam (`eqxscan/_scan/layer_call.py`).

It sits below the seam because the features the seam applies (taps, buffers,
LayerDrop's skipping, `eqxscan.layer_index`) cut trees at a layer too, and the
seam imports them.
"""

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Int, PyTree


Index = int | Int[Array, ""]
"""A layer index: a Python int, or an integer scalar array (traced or not)."""


Indices = slice | np.ndarray | Array
"""Several layers, in order: a slice, or an index array (NumPy, or JAX traced or
not)."""


def index(tree: PyTree, i: Index | tuple[Index, ...], axis: int = 0) -> PyTree:
    """Slice `i` of every array leaf of `tree` along `axis` (non-array leaves
    unchanged).

    An int is a static slice; an array index is a `dynamic_index_in_dim`: one
    program for every `i`. A tuple of indices (a buffer view's prefix, see
    `eqxscan/_scan/buffers.py`) cuts the leading axes one after the other."""
    if isinstance(i, tuple):
        for j in i:
            tree = index(tree, j, axis)
        return tree
    if isinstance(i, int):
        cut = (slice(None),) * axis + (i,)
        return jtu.tree_map(lambda a: a[cut] if eqx.is_array(a) else a, tree)
    return jtu.tree_map(
        lambda a: (
            jax.lax.dynamic_index_in_dim(a, i, axis, keepdims=False)
            if eqx.is_array(a)
            else a
        ),
        tree,
    )


def take(tree: PyTree, idx: Indices) -> PyTree:
    """The layers `idx` (a slice or an index array) of every array leaf, in that
    order, on the leading axis (non-array leaves unchanged)."""
    return jtu.tree_map(lambda a: a[idx] if eqx.is_array(a) else a, tree)
