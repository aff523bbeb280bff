"""The batch of the `jax.vmap`s around a value, read while tracing: for the
choices made from a step's size (`remat="auto"`, a `Recurrent`'s method)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from .._helpers.checks import is_array


def vmapped_size(x: object) -> int:
    """How many copies of `x` `jax.vmap` runs at once (1 outside `vmap`, or
    behind a `jit` inside it, the traced step's shapes being per example)."""
    if not is_array(x) or jnp.issubdtype(x.dtype, jax.dtypes.extended):
        return 1
    sizes: list[int] = []

    # The identity, whose batching rule (run once per enclosing `vmap`) records
    # the batch size; outside `vmap` it is dead code.
    @custom_vmap
    def probe(a: jax.Array) -> jax.Array:
        return a

    @probe.def_vmap
    def rule(
        axis_size: int, in_batched: list[bool], a: jax.Array
    ) -> tuple[jax.Array, bool]:
        sizes.append(axis_size)
        return probe(a), in_batched[0]

    # Without gradients: a derivative trace would wrap the value the rule sees.
    probe(jax.lax.stop_gradient(x))
    return int(np.prod(sizes, dtype=np.int64))
