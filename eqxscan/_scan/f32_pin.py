"""Keep a scan's float32 per-step inputs (stacked weights) float32 on TPU.

XLA:TPU's `bfloat16-propagation` narrows a float32 value whose every use is a
(default-precision) matmul; inside `lax.scan` that value is the whole stack,
converted before the loop: a temporary half its size, written on every call.
A live float32 use of each step's slice stops the pass: `pin` lets a NaN test
of one element per leaf, which can never pass, choose between a carry leaf and
its negation (values and gradients unchanged; a scalar read per leaf and one
select per step). A backward pass that saves everything still reads bfloat16.
"""

import dataclasses

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .scan_remat import Traced


def pin(x: PyTree, carry: PyTree) -> PyTree:
    """`carry` with one inexact leaf made to depend, never changing it, on one
    element of each float32 leaf of `x`; unchanged if either has none."""
    probed = [
        a
        for a in jtu.tree_leaves(x)
        if eqx.is_array(a) and a.dtype == jnp.float32 and a.size > 0
    ]
    leaves, tree = jtu.tree_flatten(carry)
    inexact = [k for k, a in enumerate(leaves) if eqx.is_inexact_array(a)]
    if not probed or not inexact:
        return carry
    k = inexact[0]
    # Each first element as a slice of the flattened leaf, which XLA reads as a
    # one-element slice of the stack (`a[0, 0]` made it copy each step's slice).
    first = lax.concatenate([lax.slice(a.reshape(-1), (0,), (1,)) for a in probed], 0)
    nans = jnp.sum(lax.ne(first, first), dtype=jnp.int32)
    leaves[k] = lax.select(nans > len(probed), -leaves[k], leaves[k])
    return jtu.tree_unflatten(tree, leaves)


def pinned(traced: Traced, types: tuple[PyTree, PyTree]) -> Traced:
    """`traced` (a step on `types`) with its new carry pinned to its float32
    inputs; the jaxpr is evaluated, the step's code does not run again."""

    def step(c: PyTree, x: PyTree) -> list:
        new, y = traced(c, x)
        return jtu.tree_leaves((pin(x, new), y))

    return dataclasses.replace(traced, jaxpr=jax.make_jaxpr(step)(*types))
