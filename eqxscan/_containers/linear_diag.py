"""The diagonal linear recurrence `h_t = a_t * h_{t-1} + b_t` over time, in three
forms (a sequential `lax.scan`, `lax.associative_scan`, or chunks), and the
rule `method="auto"` chooses by."""

import math
from typing import Literal

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._helpers.checks import check_option, check_size


Method = Literal["sequential", "associative", "chunked"]
# The `auto` rule's threshold, as measured (docs/recurrent.md#the-auto-rule and
# #matrix-state-cells): see `choose_method`.
CPU_MATRIX_CHUNKED_MIN_STATE = 64 * 64


def choose_method(
    backend: str,
    length: int,
    state_size: int,
    kind: Literal["diagonal", "matrix"],
    batch: int = 1,
) -> Method:
    """The form `method="auto"` runs, from the backend, the number of steps,
    the carry's size per example (for a matrix state one head's `dk * dv`) and
    the number of sequences run at once (`batch`, the `jax.vmap`s' around the
    call)."""
    if length <= 1:
        return "sequential"
    if kind == "matrix":
        chunked = backend != "cpu" or state_size >= CPU_MATRIX_CHUNKED_MIN_STATE
        return "chunked" if chunked else "sequential"
    if backend == "cpu":
        return "sequential"
    # On a TPU v5e the associative scan was the fastest form for every batch of
    # two or more sequences measured, but erratic for one (3.9x chunks' time
    # at D=256, T=1024; 8-10x at T=4096), where chunks were never 1.5x the best.
    return "associative" if batch >= 2 else "chunked"


def check_gate_fits(gate: Array, carry: Array, what: str) -> None:
    """Refuse a gate the carry's dtype would cut: any for an integer carry
    (every step rounded to an integer), a complex one for a real carry (its
    imaginary part dropped)."""
    if not jnp.issubdtype(jnp.result_type(carry), jnp.inexact):
        kind = jnp.result_type(carry).name
        raise TypeError(
            f"{what} updates a carry of {kind}: each step would be rounded to "
            f"{kind}, so the states come out wrong.\nHint: start the carry in "
            "floats, e.g. jnp.zeros(shape, jnp.float32)."
        )
    if jnp.iscomplexobj(gate) and not jnp.iscomplexobj(carry):
        raise TypeError(
            f"{what} is complex ({jnp.result_type(gate)}) but the carry it updates "
            f"is real ({jnp.result_type(carry)}): its imaginary part would be "
            "dropped.\nHint: give the carry h0 a complex dtype, e.g. "
            "jnp.zeros(shape, jnp.complex64)."
        )


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
    h_leaves = [jnp.asarray(h) for h in h_leaves]  # a Python float, say
    method = str(method) if isinstance(method, str) else method  # pyright: ignore[reportAssignmentType]  # NumPy's str, checked next
    check_option(
        "diagonal_scan: method", method, ("sequential", "associative", "chunked")
    )
    chunk_size = check_size("diagonal_scan: chunk_size", chunk_size)
    lengths = set()
    for what, g in (("a", a), ("b", b)):
        if jtu.tree_structure(g) != tree:
            raise ValueError(
                f"diagonal_scan: {what} has structure {jtu.tree_structure(g)}, but "
                f"h0 has structure {tree}.\nHint: every leaf of a and b is [T, "
                "*carry leaf's shape], in a tree of h0's structure."
            )
        for (path, x), h in zip(jtu.tree_leaves_with_path(g), h_leaves):
            name = f"diagonal_scan's {what}{jtu.keystr(path)}"
            check_gate_fits(x, h, name)
            _check_steps(x, h, name)
            lengths.add(jnp.shape(x)[0])
    if len(lengths) > 1:
        raise ValueError(
            f"diagonal_scan: a and b have different numbers of steps, "
            f"{sorted(lengths)} (axis 0 of each leaf).\nHint: every leaf of a and "
            "b is [T, *carry leaf's shape], with one T."
        )

    # In the carry's dtype (a real `a` with a complex carry, a bfloat16 `b`),
    # each step of the carry's shape (a gate broadcast over its axes).
    def like(x: Array, h: Array) -> Array:
        return jnp.broadcast_to(x.astype(h.dtype), (x.shape[0], *h.shape))

    a_leaves = [like(x, h) for x, h in zip(tree.flatten_up_to(a), h_leaves)]
    b_leaves = [like(x, h) for x, h in zip(tree.flatten_up_to(b), h_leaves)]
    if method == "sequential" or not h_leaves or a_leaves[0].shape[0] == 0:
        h_T, hs = jax.lax.scan(_step, h_leaves, (a_leaves, b_leaves), reverse=reverse)
    else:
        h_T, hs = _parallel(a_leaves, b_leaves, h_leaves, method, chunk_size, reverse)
    return jtu.tree_unflatten(tree, h_T), jtu.tree_unflatten(tree, hs)


def _check_steps(x: Array, h: Array, name: str) -> None:
    # `[T, *h.shape]` (or broadcasting to it after the step axis).
    shape, carry = jnp.shape(x), jnp.shape(h)
    fits = len(shape) == len(carry) + 1
    try:
        fits = fits and jnp.broadcast_shapes(shape[1:], carry) == carry
    except ValueError:
        fits = False
    if not fits:
        hint = (
            "a gate shared by every step needs its step axis too, e.g. "
            "jnp.broadcast_to(a, (T, *a.shape))"
            if len(shape) == len(carry)
            else "the carry h0 has the shape of one step of a and b"
        )
        raise ValueError(
            f"{name} has shape {shape}, but the carry leaf it updates has shape "
            f"{carry}: expected [T, {', '.join(map(str, carry))}] (steps on axis 0)."
            f"\nHint: {hint}."
        )


Leaves = list[Array]


def _step(h: Leaves, ab: tuple[Leaves, Leaves]) -> tuple[Leaves, Leaves]:
    new = [x * y + z for x, y, z in zip(ab[0], h, ab[1])]
    return new, new


def _combine(
    earlier: tuple[Leaves, Leaves], later: tuple[Leaves, Leaves]
) -> tuple[Leaves, Leaves]:
    # Composing h -> a1 h + b1 then h -> a2 h + b2.
    (a1, b1), (a2, b2) = earlier, later
    b = [x2 * y1 + y2 for x2, y1, y2 in zip(a2, b1, b2)]
    return [x * y for x, y in zip(a1, a2)], b


def _parallel(
    a: Leaves, b: Leaves, h0: Leaves, method: Method, chunk_size: int, reverse: bool
) -> tuple[Leaves, Leaves]:
    if reverse:  # consumption order first
        a, b = [x[::-1] for x in a], [x[::-1] for x in b]
    # `h0` folded into the first step, `h_0' = a_0 * h0 + b_0`: `hs` is then the
    # scan's `B` alone.
    b = [x.at[0].set(y[0] * h + x[0]) for x, y, h in zip(b, a, h0)]
    if method == "associative":
        hs = jax.lax.associative_scan(_combine, (a, b))[1]
    else:
        hs = _chunked(a, b, chunk_size)
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
        return _step(h, ends)[0], h  # each chunk's incoming carry

    zeros = [jnp.zeros(x.shape[2:], x.dtype) for x in B]
    _, h_in = jax.lax.scan(
        across, zeros, ([x[:, -1] for x in A], [x[:, -1] for x in B])
    )
    hs = [x * y[:, None] + z for x, y, z in zip(A, h_in, B)]
    return [x.reshape(n * size, *x.shape[2:])[:length] for x in hs]
