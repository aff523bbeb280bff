"""Muon on stacked layers: `optax.contrib.muon` gives a stacked weight (three
axes) its AdamW branch unless `MuonDimensionNumbers` name the per-layer matrix
axes; then the layer axes are batch axes of one batched Newton–Schulz iteration.
"""

from collections.abc import Callable
from typing import Any

import jax
import optax
from jaxtyping import PyTree

from .._internal import check_axes, Site, walk
from ._arrays import is_array


MuonDimensionNumbers = optax.contrib.MuonDimensionNumbers


def muon_dimension_numbers(params: PyTree) -> PyTree:
    """The `muon_weight_dimension_numbers` of `optax.contrib.muon` for a model
    with [`eqxscan.Stacked`][] layers: Muon for exactly the arrays optax's
    default would give Muon if the layers were kept in a list.

    An array with two axes per layer (after one axis per enclosing `Stacked`,
    an [`eqxscan.Chain`][]'s repeated patterns included) is a Muon matrix, its
    layer axes batch axes; per layer, axis 0 is the reduction axis and axis 1
    the output axis, as optax reads an unstacked matrix. Every other array gets
    `None`: optax's AdamW branch.

    **Arguments:**

    - `params`: the parameters (or updates) as `optax` sees them, e.g.
      `eqx.filter(model, eqx.is_inexact_array)`.

    **Returns:**

    A pytree like `params`, an `optax.contrib.MuonDimensionNumbers` for each
    Muon array and `None` elsewhere. Pass the function itself as
    `muon_weight_dimension_numbers`.
    """

    def dims(leaf: object, site: Site) -> MuonDimensionNumbers | None:
        if not is_array(leaf):
            return None
        check_axes("muon_dimension_numbers", leaf, site)
        if leaf.ndim - site.depth != 2:
            return None
        # Per layer as optax reads a matrix: axis 0 reduction, axis 1 output.
        return MuonDimensionNumbers(site.depth, site.depth + 1)

    return walk(dims, params)


def muon(
    learning_rate: optax.ScalarOrSchedule, **muon_kwargs: Any
) -> optax.GradientTransformation:
    """`optax.contrib.muon` for models with [`eqxscan.Stacked`][] layers: each
    layer's matrices are orthogonalised as if the layers were kept in a list,
    all layers in one batched Newton–Schulz iteration.

    The same as `optax.contrib.muon(learning_rate, ...,
    muon_weight_dimension_numbers=eqxscan.optim.muon_dimension_numbers)` (see
    there for which arrays get Muon; the others get optax's elementwise AdamW).

    **Arguments:**

    - `learning_rate`: as for `optax.contrib.muon`.
    - `**muon_kwargs`: any other argument of `optax.contrib.muon` (`beta`,
      `ns_steps`, `weight_decay`, `adam_learning_rate`, `consistent_rms`, ...),
      except `muon_weight_dimension_numbers` (set here) and `adaptive=True`,
      which scales each leaf by one inner product over all its layers; use
      `eqxscan.optim.layerwise(optax.contrib.muon(..., adaptive=True))` for it.

    **Returns:**

    An `optax.GradientTransformation`, run under JAX's standard dtype promotion
    (as optax's Muon needs) even where `jax_numpy_dtype_promotion="strict"`.
    """
    if "muon_weight_dimension_numbers" in muon_kwargs:
        raise TypeError(
            "eqxscan.optim.muon sets `muon_weight_dimension_numbers` itself (from "
            "the model's layer axes), so it cannot be given.\n"
            "Hint: call optax.contrib.muon directly to choose the dimension "
            "numbers yourself."
        )
    if muon_kwargs.get("adaptive", False):
        raise ValueError(
            "eqxscan.optim.muon does not support adaptive=True: optax scales each "
            "leaf by one inner product over the whole leaf, which on a stacked "
            "weight would mix all its layers.\n"
            "Hint: use eqxscan.optim.layerwise(optax.contrib.muon(..., "
            "adaptive=True)), which runs optax per layer."
        )
    inner = optax.contrib.muon(
        learning_rate,
        muon_weight_dimension_numbers=muon_dimension_numbers,
        **muon_kwargs,
    )

    # optax's bias correction raises a float to the int32 step count, which
    # `jax_numpy_dtype_promotion="strict"` rejects: optax runs under the standard.
    def standard(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with jax.numpy_dtype_promotion("standard"):
                return fn(*args, **kwargs)

        return run

    return optax.GradientTransformation(standard(inner.init), standard(inner.update))
