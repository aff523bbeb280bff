"""`GatedLinearAttention`: the gated linear attention cell (Yang et al. 2023), a
matrix-state linear recurrence."""

from typing import SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from .._containers.linear_cells import MatrixLinearCell
from .._helpers.checks import check_size, describe
from .mlp import check_float_dtype


class GatedLinearAttention(MatrixLinearCell):
    """Gated linear attention (GLA; Yang et al. 2023, "Gated Linear Attention
    Transformers with Hardware-Efficient Training"), one step of one example.

    Per head `h`, from the input `x` (`[input_size]`): the query, key and value
    are linear projections without bias (the query scaled by
    `1/sqrt(key_size)`), and the decay is the paper's low-rank gate
    `a = sigmoid(x W1 W2 + b) ** (1 / tau)` (`W1` of rank `gate_rank`,
    `tau = 16`), in `(0, 1)` and close to 1, computed as
    `exp(log_sigmoid(.) / tau)`. The state `S` is `[num_heads, key_size,
    value_size]`: `cell(x, S)` is the next state and `cell.output(S, x)` the
    output `[num_heads, value_size]`.

    For a whole sequence, [`eqxscan.matrix_scan`][] runs the recurrence on the
    gates of every step, stepwise or in chunks of matrix products.

    !!! example

        ```python
        import jax, jax.numpy as jnp, eqxscan

        cell = eqxscan.GatedLinearAttention(
            16, num_heads=2, key_size=8, value_size=4, key=jax.random.key(0)
        )
        xs = jnp.ones((10, 16))
        S = jnp.zeros((2, 8, 4))
        a, k, v, q = jax.vmap(cell.gates)(xs)                 # every step's gates
        S_T, os = eqxscan.matrix_scan(
            a, k, v, q, S, method="chunked", chunk_size=8, reverse=False
        )
        for x in xs:                                          # the same, by hand
            S = cell(x, S)
        assert jnp.allclose(S, S_T, atol=1e-5)
        assert jnp.allclose(cell.output(S, xs[-1]), os[-1], atol=1e-5)
        ```
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    gate_down: eqx.nn.Linear
    gate_up: eqx.nn.Linear
    input_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    gate_rank: int = eqx.field(static=True)
    tau: float = eqx.field(static=True)

    def __init__(
        self,
        input_size: SupportsIndex,
        *,
        num_heads: SupportsIndex,
        key_size: SupportsIndex,
        value_size: SupportsIndex,
        gate_rank: SupportsIndex = 16,
        tau: float = 16.0,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: size of the input `x` at one time step.
        - `num_heads`, `key_size`, `value_size`: the state is
          `[num_heads, key_size, value_size]`.
        - `gate_rank`: the rank of the decay's projection `W1 W2` (16 in GLA).
        - `tau`: the gate's temperature: `a = sigmoid(.) ** (1 / tau)`; larger
          keeps decays closer to 1.
        - `dtype`: dtype of the weights; defaults to float32 (float64 when JAX's
          64-bit mode is on), as for `eqx.nn` layers.
        - `key`: a JAX PRNG key for the initialisation (`eqx.nn.Linear`'s).
        """
        if dtype is None:
            dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
        dtype = check_float_dtype(dtype)
        d = self.input_size = check_size("input_size", input_size)
        h = self.num_heads = check_size("num_heads", num_heads)
        dk = self.key_size = check_size("key_size", key_size)
        dv = self.value_size = check_size("value_size", value_size)
        r = self.gate_rank = check_size("gate_rank", gate_rank)
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or tau <= 0:
            raise ValueError(f"tau must be a positive number, got {tau!r}.")
        self.tau = float(tau)
        kq, kk, kv, kd, ku = jr.split(key, 5)
        linear = lambda n_in, n_out, bias, k: eqx.nn.Linear(
            n_in, n_out, use_bias=bias, dtype=dtype, key=k
        )
        self.q_proj = linear(d, h * dk, False, kq)
        self.k_proj = linear(d, h * dk, False, kk)
        self.v_proj = linear(d, h * dv, False, kv)
        self.gate_down = linear(d, r, False, kd)
        self.gate_up = linear(r, h * dk, True, ku)

    def gates(
        self, x_t: Float[Array, " input_size"], *, key: PRNGKeyArray | None = None
    ) -> tuple[
        Float[Array, "H dk"],
        Float[Array, "H dk"],
        Float[Array, "H dv"],
        Float[Array, "H dk"],
    ]:
        """**Arguments:**

        - `x_t`: the input at one time step, `[input_size]`.
        - `key`: ignored (the cell draws nothing).

        **Returns:**

        `(a_t, k_t, v_t, q_t)`: the decay `[num_heads, key_size]` in `(0, 1)`,
        the key `[num_heads, key_size]`, the value `[num_heads, value_size]`
        and the query `[num_heads, key_size]`.
        """
        d, h, dk, dv = self.input_size, self.num_heads, self.key_size, self.value_size
        if jnp.shape(x_t) != (d,):
            raise ValueError(
                f"GatedLinearAttention(input_size={d}) takes one time step of one "
                f"example, x [{d}], got {describe(x_t)}.\nHint: batch with "
                "jax.vmap; for every step's gates, `jax.vmap(cell.gates)(xs)`."
            )
        logit = self.gate_up(self.gate_down(x_t)).reshape(h, dk)
        a = jnp.exp(jax.nn.log_sigmoid(logit) / self.tau)
        q = self.q_proj(x_t).reshape(h, dk) * dk**-0.5
        return a, self.k_proj(x_t).reshape(h, dk), self.v_proj(x_t).reshape(h, dv), q
