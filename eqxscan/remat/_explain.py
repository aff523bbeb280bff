"""`explain_auto`: what the core's `"auto"` rule (`eqxscan/_scan/auto.py`) picks for
every scan a function runs, and why."""

from collections.abc import Callable

import equinox as eqx
from jaxtyping import PyTree

from .._internal import AutoChoice, recording


def explain_auto(
    fn: Callable[..., object], *args: PyTree, **kwargs: PyTree
) -> list[AutoChoice]:
    """What `remat="auto"` and `unroll="auto"` pick for every scan that
    `fn(*args, **kwargs)` runs, and why.

    `fn` is traced abstractly (`jax.eval_shape`): nothing is computed. The choice
    depends only on shapes and dtypes, so it is the one a jitted train step makes.

    **Arguments:**

    - `fn`: a module (`Stacked`, `Chain`, `Recurrent`, `StackedMLP`, ...) or any
      function that calls one.
    - `*args`, `**kwargs`: example inputs (arrays or `jax.ShapeDtypeStruct`s).

    **Returns:**

    A list of [`AutoChoice`][eqxscan.remat.AutoChoice], one per scan in call order (one
    for a `Stacked`, one per scanned group of a `Chain`, two for a
    `Bidirectional`); empty when no scan used `"auto"`.
    """
    with recording() as record:
        eqx.filter_eval_shape(fn, *args, **kwargs)
    return list(record)
