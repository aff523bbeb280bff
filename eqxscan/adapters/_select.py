"""Which adapter each call uses (`select`), and the adapters' dropout keys."""

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._internal import Checked, describe, is_none, split_key
from ._lora import check_adapter, LoRA, loras, loras_in


def select(
    model: PyTree, ids: Checked[int | Int[Array, ""]], *, check: Checked[bool] = False
) -> PyTree:
    """`model` with every [`eqxscan.adapters.LoRA`][] set to use adapter `ids`
    (`-1`: the base alone).

    Under `jax.vmap` each row uses its own adapter and the base is read once
    (`jax.vmap(lambda x, i: adapters.select(model, i)(x))(xs, ids)`), each
    row's adapters gathered layer by layer inside the scan's step.

    **Arguments:**

    - `model`: a model returned by [`eqxscan.adapters.add_lora`][].
    - `ids`: an `int` or an integer scalar array, possibly traced. A concrete id
      must be in `[-1, K)`; a traced id outside `[0, K)` gives the base alone,
      silently (it cannot be checked before it is known), unless `check`.
    - `check`: for a traced id, check it when the program runs
      (`eqx.error_if`): an id outside `[-1, K)` raises, naming the LoRA and
      `K` (under `eqx.filter_jit` an `EquinoxRuntimeError`, under `jax.jit` a
      `JaxRuntimeError` holding the message). Off by default: it adds a
      branch and a host callback to the program. A concrete id is always
      checked.

    **Returns:**

    `model` with the `active` field of each `LoRA` set: a concrete id as an
    `int` (under `eqx.filter_jit`, a new id compiles anew), a traced one as an
    integer array broadcast to the layer axes.
    """
    if isinstance(ids, bool) or not (
        isinstance(ids, (int, np.integer, jax.Array, np.ndarray))
        and np.ndim(ids) == 0
        and jnp.issubdtype(getattr(ids, "dtype", int), jnp.integer)
    ):
        raise TypeError(
            f"select: ids must be an int or an integer scalar array, got "
            f"{describe(ids)}.\nHint: for one adapter per row, vmap over rows: "
            "jax.vmap(lambda x, i: adapters.select(model, i)(x))(xs, ids)."
        )
    found = loras_in(model, "select")
    if isinstance(ids, jax.core.Tracer):
        # One id per layer, so that a scan hands each layer its own.
        chosen = jnp.asarray(ids, jnp.int32)
        if check:
            chosen = _checked(chosen, found)
        active = [jnp.broadcast_to(chosen, lo.layer_axes) for lo in found]
    else:
        # A Python int: not an array leaf, so that `eqx.filter(model,
        # eqx.is_array)` and `eqx.filter_grad` agree (a new id recompiles).
        for lora in found:
            check_adapter(lora, int(ids), "select", "ids", "selects the base alone")
        active = [int(ids)] * len(found)
    return eqx.tree_at(lambda m: [lo.active for lo in loras(m)], model, active)


def _checked(ids: Array, found: list[LoRA]) -> Array:
    """`ids`, raising when the program runs if it is outside `[-1, K)`."""
    fewest = min(found, key=lambda lo: lo.num_adapters)
    k = fewest.num_adapters
    return eqx.error_if(
        ids,
        (ids < -1) | (ids >= k),
        f"adapters.select: an adapter id is outside [-1, {k}): the LoRA at "
        f"`{fewest.name}` holds {k} adapter(s), and -1 selects the base alone "
        "(checked as select(..., check=True) was asked to).",
    )


def with_dropout_key(model: PyTree, key: Checked[PRNGKeyArray]) -> PyTree:
    """`model` with a dropout key in every [`eqxscan.adapters.LoRA`][] that has
    dropout, one per adapted weight and layer. Call it with a fresh key at
    every training step; without a key, a `LoRA` with dropout raises when
    called outside `eqx.nn.inference_mode`.

    **Arguments:**

    - `model`: a model returned by [`eqxscan.adapters.add_lora`][].
    - `key`: a JAX PRNG key.

    **Returns:**

    `model` with the keys set.
    """
    split_key(key, 1, "with_dropout_key")  # one PRNG key, or an error naming it
    keys = [
        jr.split(jr.fold_in(key, n), lo.layer_axes) if lo.dropout > 0 else None
        for n, lo in enumerate(loras(model))
    ]
    return eqx.tree_at(
        lambda m: [lo.key for lo in loras(m)],
        model,
        keys,
        is_leaf=is_none,
    )
