"""Read and write a stacked tree (array leaves with a leading layer axis) at
layer `i`: the one definition of each, re-exported by the layer-call seam, below
it because the features the seam imports (taps, buffers, skipping) cut trees at
a layer too. No other module slices or updates a stack at a layer itself."""

import equinox as eqx
import jax
import jax.numpy as jnp
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
    every `i`) for an array; a tuple (a buffer view's prefix, a nested stack's
    layer) cuts the leading axes one after the other, in one static slice if
    all its indices are ints."""
    static = isinstance(i, int) or (
        isinstance(i, tuple) and all(isinstance(j, int) for j in i)
    )
    if static:
        cut = (slice(None),) * axis + (i if isinstance(i, tuple) else (i,))
        return jtu.tree_map(lambda a: a[cut] if eqx.is_array(a) else a, tree)
    if isinstance(i, tuple):
        for j in i:
            tree = index(tree, j, axis)
        return tree
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


def write(
    tree: PyTree, i: Index, value: PyTree, *, axis: int = 0, add: bool = False
) -> PyTree:
    """`tree` with slice `i` along `axis` of every array leaf replaced by (or,
    with `add`, increased by) the matching leaf of `value`.

    **Arguments:**

    - `tree`: the stacked tree; its non-array leaves are kept as they are.
    - `i`: the layer: a Python int (a static update) or an integer scalar array
      (a `dynamic_update_index_in_dim`: one program for every `i`).
    - `value`: a tree of `tree`'s structure, each array leaf of one slice's
      shape (its leaf at a non-array leaf of `tree` is ignored).
    - `axis`: the layer axis.
    - `add`: add `value` to the slice instead of replacing it, in place (a
      scatter-add: no copy of the slice). A floating leaf narrower than 32 bits
      (bfloat16) adds in float32 instead, the exact sum rounded once to its
      dtype rather than a rounded `value` added with a second rounding.

    **Returns:**

    `tree` with every array leaf of its dtype, slice `i` written.
    """
    cut = (slice(None),) * axis + (i,)

    def one(a: object, v: object) -> object:
        if not eqx.is_array(a):
            return a
        a = jnp.asarray(a)
        if add:
            if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype.itemsize >= 4:
                return a.at[cut].add(jnp.asarray(v).astype(a.dtype))
            # Cast by hand: strict dtype promotion has no bfloat16 + float32.
            v = jnp.asarray(v)
            wide = jnp.float64 if v.dtype == jnp.float64 else jnp.float32
            v = index(a, i, axis).astype(wide) + v.astype(wide)
        v = jnp.asarray(v).astype(a.dtype)
        if isinstance(i, int):
            return a.at[cut].set(v)
        return jax.lax.dynamic_update_index_in_dim(a, v, i, axis)

    return jtu.tree_map(one, tree, value)
