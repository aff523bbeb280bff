"""Per-layer norms of stacked arrays, for logging gradients, parameters or
updates: one reduction per array, no unstacking, under `jax.jit` too."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree

from .._internal import check_axes, for_each, pattern, Site
from ._arrays import is_array, layer_numbers


def _per_layer_norms(leaf: Array | np.ndarray, depth: int, ord: int | float) -> Array:
    """The `ord`-norm of each layer's slice of `leaf`, in at least float32."""
    inexact = jnp.issubdtype(leaf.dtype, jnp.inexact)
    dtype = jnp.promote_types(leaf.dtype, jnp.float32) if inexact else jnp.float32
    flat = leaf.astype(dtype).reshape(leaf.shape[:depth] + (-1,))
    if flat.shape[-1] == 0:  # no entries per layer: norm 0, as for an empty vector
        return jnp.zeros(flat.shape[:-1], jnp.real(flat).dtype)
    return jnp.linalg.norm(flat, ord=ord, axis=-1)


def layer_norms(tree: PyTree, ord: int | float = 2) -> dict[str, Float[Array, "..."]]:
    """The norm of each layer's slice of every array, keyed by state-dict names
    with the layer number shown as `*`.

    For logging gradients, parameters or updates of a model with
    [`eqxscan.Stacked`][] layers: one reduction over each stacked array's
    per-layer axes, no unstacking, also inside `jax.jit`.

    Keys are [`eqxscan.to_state_dict`][]'s names with each layer number as `*`:
    the `"blocks.0.w1"`, `"blocks.1.w1"`, ... of a [`eqxscan.StackedMLP`][] give
    `"blocks.*.w1"`, of shape `[L]`, entry `i` the norm of layer `i`'s `w1`. An
    [`eqxscan.Chain`][]'s stacks, lone layers and repeated patterns that share a
    name fill one array of length `len(chain)` (layers numbered by their index
    in the chain), `nan` for a layer without that array (e.g. a lone layer with
    no bias). A `Stacked` nested inside a layer adds one `*` and one axis
    (`"blocks.*.heads.*.weight"`, `[L, H]`). Arrays outside any `Stacked` or
    `Chain` keep their plain name, with a scalar norm.

    **Arguments:**

    - `tree`: a model, its gradients or its updates (non-array leaves and
      `None`s are skipped).
    - `ord`: the vector norm of each layer's slice, flattened: `2` (Euclidean,
      the Frobenius norm of a matrix), `1`, `float("inf")` (largest absolute
      value), or any order `jnp.linalg.norm` takes for vectors.

    **Returns:**

    A `dict` from names to arrays of norms (shape one axis per `*`), in the
    order the arrays first appear in `tree`, in at least float32.
    """
    if isinstance(ord, bool) or not isinstance(ord, (int, float)):
        raise TypeError(
            f"layer_norms: ord must be a number (2, 1, float('inf'), ...), got "
            f"{ord!r}.\nHint: each layer's slice is flattened and given a vector "
            "norm, so matrix norms such as 'fro' are not taken ('fro' is ord=2)."
        )
    found: dict[str, list[tuple[Array, list[np.ndarray], tuple[int, ...]]]] = {}

    def visit(leaf: object, site: Site) -> None:
        if is_array(leaf):
            check_axes("layer_norms", leaf, site)
            norms = _per_layer_norms(leaf, site.depth, ord)
            sizes = tuple(num_layers for _, num_layers in site.enclosing)
            parts = found.setdefault(pattern(site.path), [])
            parts.append((norms, layer_numbers(site), sizes))

    for_each(visit, tree, names=True)
    return {name: _assemble(parts) for name, parts in found.items()}


def _assemble(parts: list[tuple[Array, list[np.ndarray], tuple[int, ...]]]) -> Array:
    """One name's norms by layer number, from the arrays that carry it (several
    for a `Chain`'s groups); `nan` where none has that layer."""
    shape = tuple(max(s) for s in zip(*(sizes for _, _, sizes in parts)))
    norms, numbers, _ = parts[0]
    flat = np.ravel_multi_index(numbers, shape) if shape else np.zeros((), int)
    in_order = np.array_equal(flat.ravel(), np.arange(int(np.prod(shape))))
    if len(parts) == 1 and in_order:  # the usual Stacked
        return norms.reshape(shape)
    dtype = jnp.result_type(*(n.dtype for n, _, _ in parts))
    out = jnp.full(shape, jnp.nan, dtype)
    for norms, numbers, _ in parts:
        out = out.at[tuple(numbers)].set(norms.astype(dtype))
    return out
