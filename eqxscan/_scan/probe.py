"""`Probe`: the zero argument of [`eqxscan.tap`][] whose gradient holds the
statistics of the cotangents reaching each layer's output, and `probe`, which
builds one. `taps.py` attaches its rows to the layers' outputs."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Float, PyTree

from .._helpers.checks import describe


class Probe(eqx.Module):
    """A zero argument whose gradient holds the statistics of the cotangents
    reaching each layer's output (gradient taps). Build it with
    [`eqxscan.probe`][] and pass it to [`eqxscan.tap`][] inside the function
    being differentiated; the gradient with respect to it is a `Probe` whose
    `values[i]` is `stat(cotangent of layer i's output)`.

    The forward values do not depend on it (it is added as zero through a
    `jax.custom_vjp`), so a training step gets the gradient taps from its one
    `eqx.filter_value_and_grad` call.
    """

    values: PyTree[Float[Array, "_L ..."]]  # per call, of its own length
    stat: Callable[[PyTree], PyTree] = eqx.field(static=True)
    per_call: bool = eqx.field(static=True, default=False)
    """`values` is a dict of such rows keyed by the names [`eqxscan.tap`][]
    gives the container calls of a function that calls several."""


def probe(stat: Callable[[PyTree], PyTree], carry: PyTree, length: int) -> Probe:
    """A [`eqxscan.Probe`][] for `length` layers (or time steps) whose carry
    looks like `carry`.

    **Arguments:**

    - `stat`: a statistic of one layer's output cotangent (a pytree like the
      floating-point part of the carry), returning a pytree of float arrays,
      e.g. [`eqxscan.stats.rms`][].
    - `carry`: the carry, or `jax.ShapeDtypeStruct`s with its shapes.
    - `length`: the number of layers of the container (`len(model)`), or of
      time steps for an [`eqxscan.Recurrent`][]; [`eqxscan.tap`][] raises a
      `ValueError` naming both numbers when the call runs another number.

    **Returns:**

    A `Probe` of zeros, `values` with leading axis `length`.
    """
    if not callable(stat):
        raise TypeError(
            f"eqxscan.probe needs a statistic (a function), got {describe(stat)}.\n"
            "Hint: pass e.g. eqxscan.stats.rms, then the carry and the length."
        )
    shapes = jax.eval_shape(stat, eqx.filter(carry, eqx.is_inexact_array))

    def zeros(s: jax.ShapeDtypeStruct) -> Array:
        if not jnp.issubdtype(s.dtype, jnp.inexact):
            raise TypeError(
                f"eqxscan.probe needs a statistic that returns floating-point "
                f"arrays (a gradient holds it), but {stat!r} returned {s.dtype}.\n"
                "Return e.g. a count as float32."
            )
        return jnp.zeros((length, *s.shape), s.dtype)

    return Probe(jtu.tree_map(zeros, shapes), stat)
