"""Layer-wise learning rates: each layer's update scaled by a function of its
index, as one constant per stacked array broadcast over its per-layer axes."""

from collections.abc import Callable

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import ArrayLike, PyTree

from .._internal import (
    check_axes,
    check_callable,
    docs,
    LayerNumbering,
    noted,
    pattern,
    Site,
    walk,
)
from ._arrays import is_array, layer_numbers
from ._layerwise import one_layer


def _scalar(fn: Callable[[int], ArrayLike], index: int, where: str) -> ArrayLike:
    """`fn(index)`, checked to be one real number, finite and not negative
    (where it is concrete)."""
    value = noted(fn, f"layerwise_scale's fn, called for layer {index}", index)
    try:
        array = value if is_array(value) else np.asarray(value)
        ok = array.shape == () and np.dtype(array.dtype).kind in "iuf"
    except (TypeError, ValueError):  # e.g. a ragged list
        array, ok = None, False
    if array is not None and ok and not isinstance(array, jax.core.Tracer):
        # A NaN would reach every parameter of the layer; a negative factor
        # turns its descent into ascent.
        factor = float(array)
        if not (np.isfinite(factor) and factor >= 0):
            raise ValueError(
                f"layerwise_scale: fn({index}) returned {factor} for layer "
                f"{index} (at `{where}`), but a layer's factor must be finite "
                "and at least 0.\nHint: 0 stops a layer's updates; see "
                f"{docs('optimisers_layerwise.md')}."
            )
    if not ok:
        shape = None if array is None else array.shape
        got = repr(value) if shape in (None, ()) else f"shape {shape}"
        raise ValueError(
            f"layerwise_scale: fn({index}) returned {got[:60]} for layer {index} "
            f"(at `{where}`), but each layer's scale must be one real number.\n"
            "Hint: fn is called with one global layer index (an int) at a time "
            "and returns that layer's factor, e.g. `lambda i: 0.8 ** (11 - i)`."
        )
    return value


def layerwise_scale(
    fn: Callable[[int], ArrayLike], *, unstacked: float = 1.0
) -> optax.GradientTransformation:
    """Multiply each layer's update by `fn(layer_index)`: layer-wise learning
    rates on stacked parameters, e.g. layer-wise learning-rate decay for
    fine-tuning.

    The same as `optax.multi_transform` with one label per layer, each label's
    transform `optax.scale(fn(i))`, on the model with its layers in a list.

    Layer indices are the numbers of the state-dict names
    ([`eqxscan.to_state_dict`][]): a [`eqxscan.Stacked`][]'s from 0, an
    [`eqxscan.Chain`][]'s by index in the chain, across stacks, lone layers and
    repeated patterns (`"layers.7.weight"` is scaled by `fn(7)`). A `Stacked`
    nested inside a layer gets that layer's factor. Separate stacks (an
    encoder's and a decoder's) each count from 0; give each its own
    `layerwise_scale` with `optax.partition` to scale them differently.

    **Arguments:**

    - `fn`: called with each layer's index (an `int`) when the update is
      traced; returns that layer's factor (a real number, finite and `>= 0`).
    - `unstacked`: the factor for arrays outside any `Stacked` or `Chain`
      (embeddings, heads, final norms).

    **Returns:**

    A stateless `optax.GradientTransformation` that scales updates: chained
    after the optimiser, `optax.chain(optax.adamw(lr), layerwise_scale(fn))`
    gives each layer the learning rate `lr * fn(i)`.
    """
    check_callable("layerwise_scale's fn", fn)
    if isinstance(unstacked, bool) or not isinstance(unstacked, (int, float)):
        raise TypeError(
            f"layerwise_scale: unstacked must be a number, got {unstacked!r}."
        )

    def update(
        updates: PyTree, state: PyTree, params: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        del params
        if (inside := one_layer()) is not None:
            raise ValueError(
                "layerwise_scale runs inside eqxscan.optim.layerwise, which gives "
                f"it one layer of the Stacked at `{inside}` at a time, without the "
                "layer's index: every layer would get the factor `unstacked`.\n"
                "Hint: chain it outside, `optax.chain(layerwise(tx), "
                f"layerwise_scale(fn))`; see {docs('optimisers_layerwise.md')}."
            )
        # One call of fn per layer and trace, whatever the number of arrays.
        called: dict[int, ArrayLike] = {}

        def factor(index: int, where: str) -> ArrayLike:
            if index not in called:
                called[index] = _scalar(fn, index, where)
            return called[index]

        def scale(leaf: object, site: Site) -> object:
            if not is_array(leaf):
                return leaf
            check_axes("layerwise_scale", leaf, site)
            outer = next((p for p in site.path if isinstance(p, LayerNumbering)), None)
            if outer is None:
                return leaf if unstacked == 1.0 else leaf * unstacked
            # One factor per index along the outermost stack's (or Chain's) axes.
            skip = len(site.axes) - len(outer.strides)
            index = layer_numbers(site)[0][(...,) + (0,) * skip]
            where = pattern(site.path)
            values = [
                jnp.asarray(factor(int(i), where), leaf.dtype) for i in index.flat
            ]
            shape = index.shape + (1,) * (leaf.ndim - index.ndim)
            return leaf * jnp.stack(values).reshape(shape)

        return walk(scale, updates, names=True), state

    return optax.GradientTransformation(optax.init_empty_state, update)
