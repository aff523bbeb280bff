"""The stage order of `sharding.pipeline_order`: where a `Stacked` stored for a
circular pipeline holds each layer."""

from typing import TypeVar

import jax
import numpy as np

from .._helpers.checks import check_size, describe


_ArrayT = TypeVar("_ArrayT", jax.Array, np.ndarray)


def permute_stage_order(
    a: _ArrayT, stages: int, repeats: int, inverse: bool
) -> _ArrayT:
    """Axis 0 of a NumPy or JAX array from the natural layer order to the stage
    order of `pipeline_order` (or back): position `(s * R + r) * K + k` holds
    layer `(r * S + s) * K + k`. A reshape and a swap of axes, so a layer-sharded
    array moves no weights."""
    outer, inner = (stages, repeats) if inverse else (repeats, stages)
    num_layers = a.shape[0]
    if isinstance(a, jax.Array) and jax.typeof(a).sharding.spec[0] is not None:
        # Explicitly sharded layer axis: JAX refuses a reshape of it that would
        # move weights without being told where, so gather into the same spec.
        order = permute_stage_order(np.arange(num_layers), stages, repeats, inverse)
        return a.at[order].get(out_sharding=jax.typeof(a).sharding)
    b = a.reshape(outer, inner, num_layers // (stages * repeats), *a.shape[1:])
    return b.swapaxes(0, 1).reshape(num_layers, *a.shape[1:])


def layers_in_stage_order(
    num_layers: int, stage_order: tuple[int, int] | None
) -> tuple[int, ...] | None:
    """The layer held at each position of a stack stored in the stage order
    `stage_order` of `pipeline_order` (`None`: the natural order)."""
    if stage_order is None:
        return None
    return tuple(
        permute_stage_order(np.arange(num_layers), *stage_order, False).tolist()
    )


_HINT = (
    "Hint: leave it to sharding.pipeline_order, which permutes the layers and sets it."
)


def check_stage_order(order: object, num_layers: int) -> tuple[int, int] | None:
    """`order` checked as a `Stacked`'s `stage_order`: `None`, or a pair whose
    chunks fit the stack."""
    if order is None:
        return None
    if not isinstance(order, tuple) or len(order) != 2:
        raise TypeError(
            "Stacked: stage_order must be None or a (stages, repeats) pair, got "
            f"{describe(order)}.\n{_HINT}"
        )
    stages, repeats = (
        check_size(f"Stacked: stage_order[{i}]", v) for i, v in enumerate(order)
    )
    if num_layers % (chunks := stages * repeats):
        raise ValueError(
            f"Stacked: stage_order={order} cuts the layers into {stages} stages x "
            f"{repeats} repeats = {chunks} chunks, but the stack has {num_layers} "
            f"layers, not a multiple of {chunks}.\n{_HINT}"
        )
    return stages, repeats


def refuse_stage_order(stage_order: tuple[int, int] | None, what: str) -> None:
    """Refuse `what` (e.g. `"Cannot take 0:2 of a Stacked"`) of a stack stored in
    stage order, where positions are not layer numbers."""
    if stage_order is None:
        return
    order = "pipeline_order(stack, stages={}, repeats={}".format(*stage_order)
    raise ValueError(
        f"{what} in the stage order of {order}): its positions are not its layer "
        f"numbers.\nHint: use `eqxscan.sharding.{order}, inverse=True)`, the "
        "natural order."
    )
