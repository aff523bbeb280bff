"""Cells with a diagonal linear recurrence, which [`eqxscan.Recurrent`][] runs
step by step or in parallel over time: `LRU` and `MinGRU`."""

import math
from typing import ClassVar, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Inexact, PRNGKeyArray

from .._containers.linear_cells import DiagonalLinearCell
from .._helpers.checks import check_bool, check_size, describe
from .mlp import check_float_dtype


def _check_input(cell: str, n: int, x: Array) -> None:
    if jnp.shape(x) != (n,):
        raise ValueError(
            f"{cell} takes one time step of one example, input [{n}], got "
            f"{describe(x)}.\nHint: batch with jax.vmap; run over time with "
            "eqxscan.Recurrent."
        )


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
        if dtype is None:
            dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
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
        _check_input(
            f"LRU({self.input_size}, {self.hidden_size})", self.input_size, x_t
        )
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
        if dtype is None:
            dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
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
        _check_input(f"MinGRU({self.input_size}, {n})", self.input_size, x_t)
        pre = self.weight @ x_t + self.bias
        z = jax.nn.sigmoid(pre[:n])
        return 1 - z, z * pre[n:]
