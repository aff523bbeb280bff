"""Which step of a scan, and which layer of a container, is being traced: the
engine sets each step's index around the step (a traced int32 under `lax.scan`,
the loop's int with `mode="loop"`), and the layer-call seam the global index of
the layer it calls, for [`eqxscan.layer_index`][]."""

from .call_state import call_state
from .layer_io import Index


def step_index_or_none() -> Index | None:
    """The index of the engine step being traced, or `None` outside one (the
    shape-only trace of a run of length 0)."""
    return call_state().step


def layer_index() -> Index:
    """The index of the layer being called, read inside its `__call__` (or the
    method a container runs).

    Under `jax.lax.scan` (`mode="scan"`) a traced int32 scalar; with
    `mode="loop"`, and for a [`eqxscan.Chain`][]'s lone layers, a Python `int`.
    It counts the layers of the outermost container that runs the layer (a
    `Chain`'s `0 .. len(chain) - 1` across its groups, as `chain.unstack()`
    lists them; `reverse=True` keeps each layer's index); a container inside
    another's layer counts its own. For logging
    (`jax.debug.print("layer {}", eqxscan.layer_index())`), layer-dependent
    scaling, or choosing among per-layer values without threading
    `per_layer(jnp.arange(L))` through every call.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        class Scaled(eqx.Module):
            def __call__(self, x):
                i = eqxscan.layer_index()
                return x * (1.0 + jnp.asarray(i, x.dtype))  # layer i: times i + 1

        stack = eqxscan.Stacked(lambda k: Scaled(), 4, key=jax.random.key(0))
        assert stack(jnp.ones(())) == 1 * 2 * 3 * 4
        assert stack.with_options(mode="loop")(jnp.ones(())) == 24
        ```

    **Returns:**

    The layer's index: an int32 scalar array (traced) or a Python `int`.

    **Raises:**

    `RuntimeError` when called outside a layer run by a `Stacked` or `Chain`.
    """
    i = call_state().layer
    if i is None:
        raise RuntimeError(
            "eqxscan.layer_index() was called outside a layer: it reads the index "
            "of the layer that a Stacked or Chain is running.\nCall it inside a "
            "layer's __call__ (or the method the container runs), while the "
            "container calls it."
        )
    return i
