"""Ready-made statistics for [`eqxscan.tap`][] and [`eqxscan.probe`][]: one
float32 scalar per floating-point leaf of a carry (or of its cotangent), other
leaves `None`, so the taps keep the carry's structure and name its leaves."""

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Float, PyTree


def _per_leaf(fn, tree: PyTree) -> PyTree[Float[Array, ""]]:
    return jtu.tree_map(lambda a: fn(a) if eqx.is_inexact_array(a) else None, tree)


def rms(tree: PyTree) -> PyTree[Float[Array, ""]]:
    """The root mean square of each floating-point leaf (of its modulus, for a
    complex one), computed in float32.

    **Arguments:**

    - `tree`: a carry (or a cotangent of one).

    **Returns:**

    `tree`'s structure, a float32 scalar per floating-point array, `None`
    elsewhere.
    """
    return _per_leaf(
        lambda a: jnp.sqrt(jnp.mean(jnp.square(jnp.abs(a).astype(jnp.float32)))), tree
    )


def max_abs(tree: PyTree) -> PyTree[Float[Array, ""]]:
    """The largest absolute value of each floating-point leaf, as float32
    (`nan` if the leaf holds one); `tree` and the result as for
    [`eqxscan.stats.rms`][]."""
    return _per_leaf(lambda a: jnp.max(jnp.abs(a)).astype(jnp.float32), tree)


def nonfinite_count(tree: PyTree) -> PyTree[Float[Array, ""]]:
    """How many entries of each floating-point leaf are `nan` or `inf`, as a
    float32 count (a gradient probe holds it; exact up to `2**24`); `tree` and
    the result as for [`eqxscan.stats.rms`][]."""
    return _per_leaf(lambda a: jnp.sum(~jnp.isfinite(a)).astype(jnp.float32), tree)
