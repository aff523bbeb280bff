"""`ElmanCell`: the simple recurrent cell `h' = tanh(W x + U h + b)`."""

import math
from typing import ClassVar, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from .._helpers.checks import check_bool, check_size, describe
from .mlp import check_float_dtype


class ElmanCell(eqx.Module):
    """The Elman (vanilla) recurrent cell, `h' = tanh(W x + U h + b)`.

    Follows the `eqx.nn.GRUCell` conventions: `cell(x, h) -> h'` on one time
    step of one example (batch with `jax.vmap`, run over time with
    [`eqxscan.Recurrent`][]), weights and bias drawn from
    `U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))`.

    !!! example

        ```python
        import jax, jax.numpy as jnp, eqxscan

        cell = eqxscan.ElmanCell(3, 8, key=jax.random.key(0))
        h = cell(jnp.ones(3), jnp.zeros(8))
        assert h.shape == (8,)
        ```
    """

    weight_ih: Array
    weight_hh: Array
    bias: Array | None
    input_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    # `input_size` and `hidden_size` say what one step takes, so `Recurrent`
    # checks `h0` and `xs` against them up front.
    known_shapes: ClassVar[bool] = True

    def __init__(
        self,
        input_size: SupportsIndex,
        hidden_size: SupportsIndex,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: size of the input `x` at one time step.
        - `hidden_size`: size of the hidden state `h`.
        - `use_bias`: whether to add the bias `b`.
        - `dtype`: dtype of the weights; defaults to float32 (float64 when JAX's
          64-bit mode is on), as for `eqx.nn` layers.
        - `key`: a JAX PRNG key for the initialisation.
        """
        if dtype is None:
            dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
        dtype = check_float_dtype(dtype)
        input_size = check_size("input_size", input_size)
        hidden_size = check_size("hidden_size", hidden_size)
        use_bias = check_bool("use_bias", use_bias)  # "no" would be true
        ikey, hkey, bkey = jr.split(key, 3)
        lim = 1 / math.sqrt(hidden_size)
        init = lambda k, shape: jr.uniform(k, shape, dtype, -lim, lim)
        self.weight_ih = init(ikey, (hidden_size, input_size))
        self.weight_hh = init(hkey, (hidden_size, hidden_size))
        self.bias = init(bkey, (hidden_size,)) if use_bias else None
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.use_bias = use_bias

    def __call__(
        self,
        input: Float[Array, " input_size"],
        hidden: Float[Array, " hidden_size"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " hidden_size"]:
        """**Arguments:**

        - `input`: the input at this time step, shape `(input_size,)`.
        - `hidden`: the previous hidden state, shape `(hidden_size,)`.
        - `key`: ignored; accepted for compatibility with the `eqx.nn` cells.

        **Returns:**

        The next hidden state, shape `(hidden_size,)`.
        """
        n, h = self.input_size, self.hidden_size
        if jnp.shape(input) != (n,) or jnp.shape(hidden) != (h,):
            # Else a cryptic dot_general error, or a silent broadcast to [h, h].
            raise ValueError(
                f"ElmanCell({n}, {h}) takes one time step of one example, input "
                f"[{n}] and hidden [{h}], got input {describe(input)} and hidden "
                f"{describe(hidden)}.\nHint: batch with jax.vmap; run over time "
                "with eqxscan.Recurrent."
            )
        pre = self.weight_ih @ input + self.weight_hh @ hidden
        if self.bias is not None:
            pre = pre + self.bias
        return jnp.tanh(pre)
