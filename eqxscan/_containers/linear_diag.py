"""The diagonal linear recurrence `h_t = a_t * h_{t-1} + b_t` over time, in three
forms (a sequential `lax.scan`, `lax.associative_scan`, or chunks), and the
rule `method="auto"` chooses by."""

import math
from typing import Literal

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree


Method = Literal["sequential", "associative", "chunked"]
METHODS = ("sequential", "associative", "chunked")
# The largest carry (elements per example) for which an accelerator runs the
# chunked form: on a TPU v5e (docs/recurrent.md) a MinGRU's carry of 256 ran
# 1.4-1.9x faster chunked than sequentially (the associative form 3.4-4.2x
# slower), and a bare recurrence's 8 x 1024 fastest sequentially.
ACCELERATOR_CHUNKED_MAX_STATE = 512


CPU_MATRIX_CHUNKED_MIN_STATE = 64 * 64
"""On CPU, a matrix state's head of at least this many elements runs chunked."""


def choose_method(
    backend: str, length: int, state_size: int, kind: Literal["diagonal", "matrix"]
) -> Method:
    """The form `method="auto"` runs, from the backend, the number of steps and
    the carry's size per example (under `jax.vmap` the batch is not visible).

    - CPU: `"sequential"`. Measured by `benchmarks/linear_recurrence.py` on 2
      cores: the sequential scan was the fastest form at every point.
    - TPU and GPU, diagonal: `"chunked"` when the carry has at most
      `ACCELERATOR_CHUNKED_MAX_STATE` elements and `length > 1`, else
      `"sequential"` (measured on a TPU v5e; GPU is not measured).
    - Matrix state (`state_size` is one head's `dk * dv`): `"chunked"` on an
      accelerator; on CPU when a head's state has at least
      `CPU_MATRIX_CHUNKED_MIN_STATE` elements (64 x 64: chunked measured
      1.4-2.5x faster by `benchmarks/linear_matrix.py`; 32 x 32 about even,
      16 x 16 slower), else `"sequential"`.
    """
    if length <= 1:
        return "sequential"
    if kind == "matrix":
        if backend != "cpu" or state_size >= CPU_MATRIX_CHUNKED_MIN_STATE:
            return "chunked"
        return "sequential"
    if backend == "cpu":
        return "sequential"
    if state_size <= ACCELERATOR_CHUNKED_MAX_STATE:
        return "chunked"
    return "sequential"


def diagonal_scan(
    a: PyTree[Array],
    b: PyTree[Array],
    h0: PyTree[Array],
    *,
    method: Method,
    chunk_size: int = 64,
    reverse: bool = False,
) -> tuple[PyTree[Array], PyTree[Array]]:
    """Run `h_t = a_t * h_{t-1} + b_t` from `h_0 = h0` over axis 0 of `a` and `b`.

    **Arguments:**

    - `a`, `b`: pytrees with `h0`'s structure, each leaf `[T, *leaf_shape]`,
      computed in `h0`'s dtype (`a` may be real where `h0` is complex). With
      `reverse=True` step `T - 1` is consumed first.
    - `h0`: the initial carry.
    - `method`: `"sequential"` (`lax.scan`), `"associative"`
      (`lax.associative_scan`, depth `log2 T`) or `"chunked"` (an associative
      scan inside each chunk of `chunk_size` steps, all chunks at once, then a
      sequential scan over the `ceil(T / chunk_size)` chunk boundaries).
    - `chunk_size`: the chunk length of `"chunked"`; `T` need not be a multiple.
    - `reverse`: consume the steps last to first.

    **Returns:**

    `(h_T, hs)`: the final carry and every step's carry, `hs[t]` the carry
    right after consuming step `t` (also with `reverse=True`, where `h_T` is
    `hs[0]`). Each leaf has `h0`'s dtype.
    """
    h_leaves, tree = jtu.tree_flatten(h0)
    # In the carry's dtype: a real `a` with a complex carry, a bfloat16 `b`.
    a_leaves = [x.astype(h.dtype) for x, h in zip(tree.flatten_up_to(a), h_leaves)]
    b_leaves = [x.astype(h.dtype) for x, h in zip(tree.flatten_up_to(b), h_leaves)]
    if method == "sequential":
        h_T, hs = _sequential(a_leaves, b_leaves, h_leaves, reverse)
    else:
        h_T, hs = _parallel(a_leaves, b_leaves, h_leaves, method, chunk_size, reverse)
    return jtu.tree_unflatten(tree, h_T), jtu.tree_unflatten(tree, hs)


Leaves = list[Array]


def _sequential(
    a: Leaves, b: Leaves, h0: Leaves, reverse: bool
) -> tuple[Leaves, Leaves]:
    def step(h: Leaves, ab: tuple[Leaves, Leaves]) -> tuple[Leaves, Leaves]:
        a_t, b_t = ab
        new = [(x * y + z).astype(y.dtype) for x, y, z in zip(a_t, h, b_t)]
        return new, new

    return jax.lax.scan(step, h0, (a, b), reverse=reverse)


def _combine(
    earlier: tuple[Leaves, Leaves], later: tuple[Leaves, Leaves]
) -> tuple[Leaves, Leaves]:
    # Composing h -> a1 h + b1 then h -> a2 h + b2.
    (a1, b1), (a2, b2) = earlier, later
    a = [x * y for x, y in zip(a1, a2)]
    b = [x2 * y1 + y2 for x2, y1, y2 in zip(a2, b1, b2)]
    return a, b


def _parallel(
    a: Leaves,
    b: Leaves,
    h0: Leaves,
    method: Method,
    chunk_size: int,
    reverse: bool,
) -> tuple[Leaves, Leaves]:
    if reverse:  # consumption order first
        a, b = [x[::-1] for x in a], [x[::-1] for x in b]
    dtypes = [h.dtype for h in h0]
    # `b` in the carry's dtype (a complex carry with real inputs), and `h0`
    # folded into the first step: `h_0' = a_0 * h0 + b_0`, so `hs` is the
    # scan's `B` alone.
    b = [
        x.astype(d).at[0].set((y[0] * h + x[0]).astype(d))
        for x, y, h, d in zip(b, a, h0, dtypes)
    ]
    if method == "associative":
        _, hs = jax.lax.associative_scan(_combine, (a, b))
    else:
        hs = _chunked(a, b, chunk_size)
    hs = [x.astype(d) for x, d in zip(hs, dtypes)]
    if reverse:
        hs = [x[::-1] for x in hs]
        return [x[0] for x in hs], hs
    return [x[-1] for x in hs], hs


def _chunked(a: Leaves, b: Leaves, chunk_size: int) -> Leaves:
    """`hs` from `h_{-1} = 0`, the associative scan run inside chunks."""
    length = a[0].shape[0]
    size = min(chunk_size, length)
    n = math.ceil(length / size)
    pad = n * size - length

    def chunks(x: Array, fill: int) -> Array:
        # The padded steps (`a = 1`, `b = 0`) come last and change nothing.
        x = jnp.concatenate([x, jnp.full((pad, *x.shape[1:]), fill, x.dtype)])
        return x.reshape(n, size, *x.shape[1:])

    a_c, b_c = [chunks(x, 1) for x in a], [chunks(x, 0) for x in b]
    # Within each chunk, from a zero carry: `h = A * h_in + B`.
    A, B = jax.lax.associative_scan(_combine, (a_c, b_c), axis=1)

    def across(h: Leaves, ends: tuple[Leaves, Leaves]) -> tuple[Leaves, Leaves]:
        new = [x * y + z for x, y, z in zip(ends[0], h, ends[1])]
        return new, h  # each chunk's incoming carry

    zeros = [jnp.zeros(x.shape[2:], x.dtype) for x in B]
    _, h_in = jax.lax.scan(
        across, zeros, ([x[:, -1] for x in A], [x[:, -1] for x in B])
    )
    hs = [x * y[:, None] + z for x, y, z in zip(A, h_in, B)]
    return [x.reshape(n * size, *x.shape[2:])[:length] for x in hs]
