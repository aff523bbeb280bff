"""The recurrent cells: `ElmanCell`, and cells with a linear recurrence that
[`eqxscan.Recurrent`][] runs step by step or in parallel over time: `LRU` and
`MinGRU` (diagonal), `GatedLinearAttention` (a matrix state)."""

import math
from typing import ClassVar, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Inexact, PRNGKeyArray

from .._containers.linear_cells import DiagonalLinearCell, MatrixLinearCell
from .._helpers.checks import check_bool, check_size, describe
from .mlp import check_float_dtype


def _check_step(
    cell: "ElmanCell | LRU | MinGRU | GatedLinearAttention", **given: Array
) -> None:
    """One time step of one example: `input [input_size]` (and `hidden
    [hidden_size]`), else a cryptic dot_general error or a silent broadcast."""
    n, h = cell.input_size, getattr(cell, "hidden_size", None)
    sizes = {"input": n, "hidden": h}
    if any(jnp.shape(x) != (sizes[name],) for name, x in given.items()):
        takes = " and ".join(f"{name} [{sizes[name]}]" for name in given)
        got = " and ".join(f"{name} {describe(x)}" for name, x in given.items())
        shown = f"input_size={n}" if h is None else f"{n}, {h}"
        raise ValueError(
            f"{type(cell).__name__}({shown}) takes one time step of one example, "
            f"{takes}, got {got}.\nHint: batch with jax.vmap; run over time with "
            "eqxscan.Recurrent."
        )


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
        _check_step(self, input=input, hidden=hidden)
        pre = self.weight_ih @ input + self.weight_hh @ hidden
        if self.bias is not None:
            pre = pre + self.bias
        return jnp.tanh(pre)


class LRU(DiagonalLinearCell):
    """The Linear Recurrent Unit's recurrence (Orvieto et al., 2023,
    "Resurrecting Recurrent Neural Networks for Long Sequences"):
    `h_t = lambda * h_{t-1} + gamma * (B x_t)`, with the diagonal
    `lambda = exp(-exp(nu) + i exp(theta))` drawn uniformly on a ring
    `r_min <= |lambda| <= r_max`, phases in `[0, max_phase]`, and the
    normalisation `gamma = sqrt(1 - |lambda|^2)`.

    The carry is complex (`complex64` for float32 weights); `real=True`
    gives the real form, `lambda = exp(-exp(nu))`, with a real carry. The
    read-out (`Re(C h) + D x` in the paper) belongs to the model around the
    cell: `Recurrent` returns the carries.

    !!! example

        ```python
        import jax, jax.numpy as jnp, eqxscan

        lru = eqxscan.LRU(3, 16, key=jax.random.key(0))
        xs = jax.random.normal(jax.random.key(1), (100, 3))
        h0 = jnp.zeros(16, jnp.complex64)
        h_T, hs = eqxscan.Recurrent(lru, method="associative")(h0, xs)
        h_T2, _ = eqxscan.Recurrent(lru, method="sequential")(h0, xs)
        assert hs.shape == (100, 16) and jnp.allclose(h_T, h_T2, atol=1e-5)
        ```
    """

    nu_log: Float[Array, " hidden_size"]
    theta_log: Float[Array, " hidden_size"] | None
    gamma_log: Float[Array, " hidden_size"]
    B_re: Float[Array, "hidden_size input_size"]
    B_im: Float[Array, "hidden_size input_size"] | None
    input_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    real: bool = eqx.field(static=True)
    # `input_size` and `hidden_size` say what one step takes (see ElmanCell).
    known_shapes: ClassVar[bool] = True

    def __init__(
        self,
        input_size: SupportsIndex,
        hidden_size: SupportsIndex,
        *,
        r_min: float = 0.0,
        r_max: float = 1.0,
        max_phase: float = 2 * math.pi,
        real: bool = False,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: size of the input `x` at one time step.
        - `hidden_size`: size of the (complex) state `h`.
        - `r_min`, `r_max`: the ring `|lambda|` is drawn on, `0 <= r_min < r_max
          <= 1` (the paper's long-range tasks use `r_min=0.9, r_max=0.999`).
        - `max_phase`: phases `arg(lambda)` are drawn in `[0, max_phase]`.
        - `real`: `True` for the real form (no phases, a real carry).
        - `dtype`: dtype of the (real) weights; float32 by default.
        - `key`: a JAX PRNG key for the initialisation.
        """
        dtype = check_float_dtype(dtype)
        n_in = check_size("input_size", input_size)
        n = check_size("hidden_size", hidden_size)
        real = check_bool("real", real)
        if not 0 <= r_min < r_max <= 1:
            raise ValueError(
                f"LRU needs 0 <= r_min < r_max <= 1, got r_min={r_min}, "
                f"r_max={r_max}: |lambda| is drawn between them."
            )
        k_r, k_phase, k_re, k_im = jr.split(key, 4)
        u = jr.uniform(k_r, (n,), jnp.float32)
        # |lambda| uniform on the ring's area, as in the paper.
        nu = -0.5 * jnp.log(u * (r_max**2 - r_min**2) + r_min**2)
        nu_log = jnp.log(jnp.maximum(nu, 1e-30))
        theta = max_phase * jr.uniform(k_phase, (n,), jnp.float32)
        modulus = jnp.exp(-jnp.exp(nu_log))
        self.nu_log = nu_log.astype(dtype)
        self.gamma_log = (0.5 * jnp.log1p(-(modulus**2) + 1e-30)).astype(dtype)
        scale = 1 / math.sqrt((1 if real else 2) * n_in)
        self.B_re = (jr.normal(k_re, (n, n_in), jnp.float32) * scale).astype(dtype)
        b_im = jr.normal(k_im, (n, n_in), jnp.float32) * scale
        self.B_im = None if real else b_im.astype(dtype)
        theta_log = jnp.log(jnp.maximum(theta, 1e-30)).astype(dtype)
        self.theta_log = None if real else theta_log
        self.input_size, self.hidden_size, self.real = n_in, n, real

    def gates(
        self, x_t: Float[Array, " input_size"]
    ) -> tuple[Inexact[Array, " hidden_size"], Inexact[Array, " hidden_size"]]:
        """**Arguments:**

        - `x_t`: the input at one time step, shape `(input_size,)`.

        **Returns:**

        `(lambda, gamma * (B x_t))`, complex (real for `real=True`), shape
        `(hidden_size,)`.
        """
        _check_step(self, input=x_t)
        gamma = jnp.exp(self.gamma_log)
        if self.theta_log is None or self.B_im is None:
            return jnp.exp(-jnp.exp(self.nu_log)), gamma * (self.B_re @ x_t)
        log_a = jax.lax.complex(-jnp.exp(self.nu_log), jnp.exp(self.theta_log))
        bx = jax.lax.complex(self.B_re @ x_t, self.B_im @ x_t)
        return jnp.exp(log_a), gamma.astype(bx.dtype) * bx


class MinGRU(DiagonalLinearCell):
    """minGRU (Feng et al., 2024, "Were RNNs All We Needed?"): a GRU whose gates
    read the input only, so its recurrence is linear:
    `z_t = sigmoid(W_z x_t + b_z)`, `h~_t = W_h x_t + b_h`,
    `h_t = (1 - z_t) * h_{t-1} + z_t * h~_t`.

    !!! example

        ```python
        import jax, jax.numpy as jnp, eqxscan

        cell = eqxscan.MinGRU(3, 8, key=jax.random.key(0))
        xs = jax.random.normal(jax.random.key(1), (50, 3))
        h_T, hs = eqxscan.Recurrent(cell, method="chunked", chunk_size=16)(
            jnp.zeros(8), xs
        )
        h = jnp.zeros(8)
        for x in xs:
            h = cell(x, h)  # one step: decoding
        assert jnp.allclose(h_T, h, atol=1e-5)
        ```
    """

    weight: Float[Array, "2*hidden_size input_size"]
    bias: Float[Array, " 2*hidden_size"]
    input_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    known_shapes: ClassVar[bool] = True

    def __init__(
        self,
        input_size: SupportsIndex,
        hidden_size: SupportsIndex,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: size of the input `x` at one time step.
        - `hidden_size`: size of the hidden state `h`.
        - `dtype`: dtype of the weights; float32 by default.
        - `key`: a JAX PRNG key for the initialisation (`U(-1/sqrt(input_size),
          1/sqrt(input_size))`, as `eqx.nn.Linear`).
        """
        dtype = check_float_dtype(dtype)
        n_in = check_size("input_size", input_size)
        n = check_size("hidden_size", hidden_size)
        wkey, bkey = jr.split(key)
        lim = 1 / math.sqrt(n_in)
        self.weight = jr.uniform(wkey, (2 * n, n_in), dtype, -lim, lim)
        self.bias = jr.uniform(bkey, (2 * n,), dtype, -lim, lim)
        self.input_size, self.hidden_size = n_in, n

    def gates(
        self, x_t: Float[Array, " input_size"]
    ) -> tuple[Float[Array, " hidden_size"], Float[Array, " hidden_size"]]:
        """**Arguments:**

        - `x_t`: the input at one time step, shape `(input_size,)`.

        **Returns:**

        `(1 - z_t, z_t * h~_t)`, each of shape `(hidden_size,)`.
        """
        n = self.hidden_size
        _check_step(self, input=x_t)
        pre = self.weight @ x_t + self.bias
        z = jax.nn.sigmoid(pre[:n])
        return 1 - z, z * pre[n:]


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
        h, dk, dv = self.num_heads, self.key_size, self.value_size
        _check_step(self, input=x_t)
        logit = self.gate_up(self.gate_down(x_t)).reshape(h, dk)
        a = jnp.exp(jax.nn.log_sigmoid(logit) / self.tau)
        q = self.q_proj(x_t).reshape(h, dk) * dk**-0.5
        return a, self.k_proj(x_t).reshape(h, dk), self.v_proj(x_t).reshape(h, dv), q
