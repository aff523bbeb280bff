"""Layer-wise learning rates: each layer's update scaled by a function of its index.

Layers are numbered as their state-dict names number them (see
[`eqxscan.to_state_dict`][]): a `Stacked`'s layers from 0, and a `Chain`'s by
their index in the chain, across its scanned runs, lone layers and repeated
units. Each stacked array gets its scales as one constant of the shape of its
layer axes, broadcast over the per-layer axes: one multiply per array, no
unstacking.
"""

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, PyTree

from .._internal import check_callable, LayerNumbering, pattern, Site, walk
from ._arrays import is_array


def _scalar(fn: Callable[[int], ArrayLike], index: int, where: str) -> ArrayLike:
    """`fn(index)`, checked to be one real number."""
    value = fn(index)
    try:
        array = value if is_array(value) else np.asarray(value)
        ok = array.shape == () and np.dtype(array.dtype).kind in "iuf"
    except (TypeError, ValueError):  # e.g. a ragged list
        array, ok = None, False
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
    transform `optax.scale(fn(i))`, on the model with its layers kept in a list.

    Layer indices are the numbers in the parameters' state-dict names (see
    [`eqxscan.to_state_dict`][]): a [`eqxscan.Stacked`][] numbers its layers
    from 0; an [`eqxscan.Chain`][] numbers its layers by their index in the
    chain, across stacks, lone layers and repeated patterns (so the layer
    called `"layers.7.weight"` is scaled by `fn(7)`). A `Stacked` nested inside
    a layer is part of that layer: all its arrays get the enclosing layer's
    factor. Separate stacks (e.g. an encoder's and a decoder's) each number
    their layers from 0; give each its own `layerwise_scale` with
    `optax.partition` to scale them differently.

    !!! example

        ```python
        import optax, eqxscan

        num_layers, decay = 12, 0.8
        # The top layer trains at the full rate, each one below at 0.8 times it.
        optimiser = optax.chain(
            optax.adamw(1e-4),
            eqxscan.optim.layerwise_scale(lambda i: decay ** (num_layers - 1 - i)),
        )
        ```

    **Arguments:**

    - `fn`: called with each layer's index (an `int`) when the update is traced,
      it returns that layer's factor (a real number).
    - `unstacked`: the factor for arrays outside any `Stacked` or `Chain`
      (embeddings, heads, final norms).

    **Returns:**

    A stateless `optax.GradientTransformation`; chain it after the optimiser
    (it scales updates, so `optax.chain(optax.adamw(lr), layerwise_scale(fn))`
    gives each layer the learning rate `lr * fn(i)`).
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
        # One call of fn per layer and trace, whatever the number of arrays.
        called: dict[int, ArrayLike] = {}

        def factor(index: int, where: str) -> ArrayLike:
            if index not in called:
                called[index] = _scalar(fn, index, where)
            return called[index]

        def scale(leaf: object, site: Site) -> object:
            if not is_array(leaf):
                return leaf
            first = next((p for p in site.path if isinstance(p, LayerNumbering)), None)
            if first is None:
                return leaf if unstacked == 1.0 else leaf * unstacked
            return leaf * _factors(leaf, site, first, factor)

        return walk(scale, updates, names=True), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _factors(
    leaf: Array | np.ndarray,
    site: Site,
    first: LayerNumbering,
    factor: Callable[[int, str], ArrayLike],
) -> Array:
    """The factors of `leaf`'s layers, shaped to broadcast against it: one per
    index along the layer axes of the outermost `Stacked` or `Chain`."""
    axes = site.axes[: len(first.strides)]
    index = np.full(axes, first.start, dtype=int)
    for k, stride in enumerate(first.strides):
        index = index + stride * np.indices(axes, dtype=int)[k]
    where = pattern(site.path)
    values = [jnp.asarray(factor(int(i), where), leaf.dtype) for i in index.ravel()]
    shape = axes + (1,) * (leaf.ndim - len(axes))
    return jnp.stack(values).reshape(shape)
