"""Read and write a stacked tree (array leaves with a leading layer axis) at
layer `i`: the one definition of each, re-exported by the layer-call seam, below
it because the features the seam imports (taps, buffers, skipping) cut trees at
a layer too. No other module slices or updates a stack at a layer itself."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Int, PyTree


Index = int | Int[Array, ""]
"""A layer index: a Python int, or an integer scalar array (traced or not)."""


Indices = slice | np.ndarray | Array
"""Several layers, in order: a slice or an index array (NumPy or JAX, traced or not)."""


def index(tree: PyTree, i: Index | tuple[Index, ...], axis: int = 0) -> PyTree:
    """Slice `i` of every array leaf along `axis` (other leaves unchanged): static
    for ints, else one program for every `i`; a tuple (a buffer view's prefix)
    cuts the leading axes in turn."""
    if isinstance(i, tuple) and not all(isinstance(j, int) for j in i):
        for j in i:
            tree = index(tree, j, axis)
        return tree
    if isinstance(i, (int, tuple)):
        cut = (slice(None),) * axis + (i if isinstance(i, tuple) else (i,))
        return _arrays(lambda a: a[cut], tree)
    return _arrays(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis, False), tree)


def take(tree: PyTree, idx: Indices) -> PyTree:
    """The layers `idx` (a slice or an index array) of every array leaf, in that
    order, on the leading axis (non-array leaves unchanged)."""
    return _arrays(lambda a: a[idx], tree)


def _arrays(fn: Callable[[Array], Array], tree: PyTree) -> PyTree:
    return jtu.tree_map(lambda a: fn(a) if eqx.is_array(a) else a, tree)


def write(
    tree: PyTree, i: Index, value: PyTree, *, axis: int = 0, add: bool = False
) -> PyTree:
    """`tree` with slice `i` along `axis` of every array leaf replaced by (with
    `add`, increased in place by) the leaf of `value`, cast to the leaf's dtype.
    A floating leaf narrower than 32 bits adds in float32: the exact sum rounded
    once, not a rounded `value` added with a second rounding."""
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
        v = jnp.asarray(v)
        # Typed PRNG keys (a layer's fixed seed) take no `astype`: like for like.
        if not jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            v = v.astype(a.dtype)
        if isinstance(i, int):
            return a.at[cut].set(v)
        return jax.lax.dynamic_update_index_in_dim(a, v, i, axis)

    return jtu.tree_map(one, tree, value)
