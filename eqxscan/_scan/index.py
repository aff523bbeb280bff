"""Index a tree at layer `i`: the one definition, re-exported by the layer-call
seam, below it because the features the seam imports (taps, buffers, skipping)
cut trees at a layer too."""

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
    unchanged): static for an int, a `dynamic_index_in_dim` (one program for
    every `i`) for an array; a tuple (a buffer view's prefix) cuts the leading
    axes one after the other."""
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
