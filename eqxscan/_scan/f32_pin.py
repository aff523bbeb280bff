"""Keep a scan's float32 per-step inputs (stacked weights) float32 on TPU.

At default precision XLA:TPU runs a float32 matmul in bfloat16, and its
`bfloat16-propagation` pass narrows any float32 value whose every use is such
a matmul. Inside `lax.scan` the value each step slices is the loop's copy of
the whole stack, so XLA converts the whole stack to bfloat16 before the loop:
a temporary half the stack's size (1 GiB for a 2 GiB float32 stack), written
and read again on every call. The unrolled loop converts each layer inside the
fusion that reads it. A live float32 use of each step's slice stops the pass:
`pin` tests one element of every float32 leaf for NaN and lets that test
choose between a carry leaf and its negation. The test can never pass (it asks
for more NaNs than elements tested), so values and gradients are unchanged;
each step costs a scalar read per leaf and a select on one carry leaf.
A backward pass re-reads the slices in float32 where remat recomputes the
test (`remat=True`, or `"auto"` when it recomputes); with everything saved
(`remat=False`) its loop still reads a bfloat16 copy, as before.
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
    """`carry` (a step's new carry) with one inexact array leaf made to depend,
    never changing it, on one element of each float32 array leaf of `x` (the
    step's slice of the scanned inputs); unchanged if either has none."""
    probed = [
        a
        for a in jtu.tree_leaves(x)
        if eqx.is_array(a) and a.dtype == jnp.float32 and a.size > 0
    ]
    leaves, tree = jtu.tree_flatten(carry)
    k = next(
        (
            n
            for n, a in enumerate(leaves)
            if eqx.is_array(a) and jnp.issubdtype(a.dtype, jnp.inexact)
        ),
        None,
    )
    if not probed or k is None:
        return carry
    # Each first element as a slice of the flattened leaf, which XLA reads as a
    # one-element slice of the stack (`a[0, 0]` made it copy each step's slice).
    firsts = [lax.slice(a.reshape(-1), (0,), (1,)) for a in probed]
    first = firsts[0] if len(firsts) == 1 else lax.concatenate(firsts, 0)
    nans = jnp.sum(lax.ne(first, first), dtype=jnp.int32)
    leaves[k] = lax.select(nans > len(probed), -leaves[k], leaves[k])
    return jtu.tree_unflatten(tree, leaves)


def pinned(traced: Traced, types: tuple[PyTree, PyTree]) -> Traced:
    """`traced` (a step on `types`, its carry's and one step's inputs') with
    its new carry pinned to its float32 inputs; the step's own code does not
    run again, its jaxpr is evaluated."""

    def step(c: PyTree, x: PyTree) -> list:
        new, y = traced(c, x)
        return jtu.tree_leaves((pin(x, new), y))

    return dataclasses.replace(traced, jaxpr=jax.make_jaxpr(step)(*types))
