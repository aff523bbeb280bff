"""`matrix_scan`: the matrix-state linear recurrence of linear attention, gated
linear attention (GLA) and Mamba-2's SSD, step by step or in chunks.

The chunked form (after Yang et al. 2023 and Dao & Gu 2024's SSD) computes all
that does not depend on the state carried between chunks batched over chunks,
as matrix products (rematerialised in reverse mode, a few groups of chunks at a
time); only `S_{n+1} = decay_n * S_n + update_n` is a scan, one elementwise line
per chunk (per-step latency, not the matrix products, bounds a scan on an
accelerator). Every decay factor is `exp` of a sum of `log a_r` accumulated
directly over the steps it covers (never a difference of two long prefix sums),
so it lies in `[0, 1]`. A chunk is cut into sub-chunks of `c ~ sqrt(C)` steps:
earlier sub-chunks meet through factored decays, and only the `c x c` diagonal
blocks form the decay tensor `exp(sum over (s, t])` elementwise.
"""

import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._helpers.checks import check_bool, check_option, check_size, describe


Method = Literal["sequential", "chunked"]
# The state-independent work of the chunked form runs on CPU in `_GROUPS` groups
# of chunks (and the rest), whose temp memory is one group's; on an accelerator
# all chunks in one batch (faster), up to `_ACCELERATOR_GROUP_BYTES` of a group's
# float32 decay tensors. Both measured: docs/recurrent.md#matrix-state-cells.
_GROUPS = 8
_ACCELERATOR_GROUP_BYTES = 256 * 2**20
_SUB = 8  # sub-chunks of at least this many steps where the chunk allows


def matrix_scan(
    a: Float[Array, "T H dk"],
    k: Float[Array, "T H dk"],
    v: Float[Array, "T H dv"],
    q: Float[Array, "T H dk"],
    s0: Float[Array, "H dk dv"],
    *,
    method: Method,
    chunk_size: int,
    reverse: bool,
) -> tuple[Float[Array, "H dk dv"], Float[Array, "T H dv"]]:
    """Run the matrix-state recurrence
    `S_t = a_t[:, :, None] * S_{t-1} + k_t[:, :, None] * v_t[:, None, :]` over
    time, with the output `o_t = einsum("hk,hkv->hv", q_t, S_t)` at every step.

    One sequence, time on axis 0; batch with `jax.vmap`. Both forms compute in
    float32 (float64 if any input is float64) whatever the inputs' dtypes, and
    return `o` in the dtype of the values `v` and `s_T` in `s0`'s.

    !!! example

        ```python
        import jax, jax.numpy as jnp, eqxscan

        T, H, dk, dv = 100, 2, 8, 4
        ks = jax.random.split(jax.random.key(0), 4)
        a = jax.nn.sigmoid(jax.random.normal(ks[0], (T, H, dk)) + 4)
        k, q = jax.random.normal(ks[1], (2, T, H, dk))
        v = jax.random.normal(ks[2], (T, H, dv))
        s0 = jnp.zeros((H, dk, dv))
        run = lambda m: eqxscan.matrix_scan(
            a, k, v, q, s0, method=m, chunk_size=32, reverse=False
        )
        (s_seq, o_seq), (s_chk, o_chk) = run("sequential"), run("chunked")
        assert o_chk.shape == (T, H, dv)
        assert jnp.allclose(o_chk, o_seq, rtol=1e-4, atol=1e-4)
        ```

    **Arguments:**

    - `a`: the decays, `[T, H, dk]`, in `(0, 1]`. A decay below the smallest
      normal float32 (`1.2e-38`; 0 included) counts as that value in the
      chunked form, a reset up to a factor `1e-38`, and gets no gradient; below
      about `1e-36` its gradient loses precision there (`1e-37`: 2e-3 of the
      largest, its intermediates subnormal). A negative decay is refused by
      the chunked form (`ValueError` where `a` is concrete; traced, its
      chunk's outputs and the states after it are NaN). The sequential form is
      exact for any decay.
    - `k`, `q`: keys and queries, `[T, H, dk]`.
    - `v`: values, `[T, H, dv]`.
    - `s0`: the initial state, `[H, dk, dv]`.
    - `method`: `"sequential"`, a `jax.lax.scan` over the `T` steps; or
      `"chunked"`, matrix products within chunks of `chunk_size` steps,
      batched over chunks, and a scan of one elementwise state update per
      chunk over the `ceil(T / chunk_size)` chunks (see docs/recurrent.md,
      "Matrix-state cells", for which to pick).
    - `chunk_size`: the chunk length `C` of the chunked form (ignored by the
      sequential one). `T` need not be a multiple: the last chunk is padded
      with steps that change nothing. Sub-chunks are the largest divisor of `C`
      up to `max(8, sqrt(C))` steps, so pick `C` a multiple of 8.
    - `reverse`: consume the sequence last to first; `o` stays aligned with the
      inputs, and `s_T` is the state after consuming step 0.

    **Returns:**

    `(s_T, o)`: the final state `[H, dk, dv]` and the outputs `[T, H, dv]`.
    """
    _check(a, k, v, q, s0)
    check_option("method", method, ("sequential", "chunked"))
    reverse = check_bool("reverse", reverse)
    chunk_size = check_size("chunk_size", chunk_size)
    if method == "chunked" and not isinstance(a, jax.core.Tracer):
        if (negative := np.argwhere(np.asarray(a) < 0)).size:
            at = [int(i) for i in negative[0]]
            raise ValueError(
                f"matrix_scan's chunked form needs decays a >= 0, but a{at} is "
                f"{float(np.asarray(a)[tuple(at)]):.4g} ({len(negative)} negative)."
                "\nHint: method='sequential' computes any decay."
            )
    return _run(a, k, v, q, s0, method, chunk_size, reverse)


# Compiled as one program (an eager call would otherwise run op by op).
@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _run(
    a: Array,
    k: Array,
    v: Array,
    q: Array,
    s0: Array,
    method: Method,
    chunk_size: int,
    reverse: bool,
) -> tuple[Array, Array]:
    # float64 if any input is, else float32: no promotion (which strict
    # promotion refuses between bfloat16 and float32).
    wide = any(x.dtype == jnp.float64 for x in (a, k, v, q, s0))
    work = jnp.float64 if wide else jnp.float32
    out_dtype = v.dtype
    a, k, v, q = (x.astype(work) for x in (a, k, v, q))
    if reverse:
        a, k, v, q = (jnp.flip(x, 0) for x in (a, k, v, q))
    if a.shape[0] == 0:
        s_T, o = s0.astype(work), jnp.zeros(v.shape, work)
    elif method == "sequential":
        s_T, o = _sequential(a, k, v, q, s0.astype(work))
    else:
        s_T, o = _chunked(a, k, v, q, s0.astype(work), chunk_size)
    o = jnp.flip(o, 0) if reverse else o
    return s_T.astype(s0.dtype), o.astype(out_dtype)


def _check(a: object, k: object, v: object, q: object, s0: object) -> None:
    arrays = {"a": a, "k": k, "v": v, "q": q, "s0": s0}
    hint = "\nHint: a, k, q are [T, H, dk], v is [T, H, dv], s0 is [H, dk, dv]"
    shapes: dict[str, tuple[int, ...]] = {}
    for name, x in arrays.items():
        if not (
            isinstance(x, (jax.Array, np.ndarray))
            and jnp.issubdtype(x.dtype, jnp.floating)
            and x.ndim == 3
        ):
            raise TypeError(
                f"matrix_scan's {name} must be a float array with 3 axes, got "
                f"{describe(x)}.{hint}; batch with jax.vmap."
            )
        shapes[name] = x.shape
    T, H, dk = shapes["a"]
    dv = shapes["v"][2]
    expected = {"k": (T, H, dk), "q": (T, H, dk), "v": (T, H, dv), "s0": (H, dk, dv)}
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ValueError(
                f"matrix_scan's {name} has shape {describe(arrays[name])}, but a "
                f"{describe(a)} and v {describe(v)} make it {list(shape)}.{hint} "
                "(time on axis 0)."
            )


def _sequential(
    a: Array, k: Array, v: Array, q: Array, s0: Array
) -> tuple[Array, Array]:
    def step(s: Array, x: tuple[Array, Array, Array, Array]) -> tuple[Array, Array]:
        a_t, k_t, v_t, q_t = x
        s = a_t[:, :, None] * s + k_t[:, :, None] * v_t[:, None, :]
        return s, jnp.einsum("hk,hkv->hv", q_t, s)

    return jax.lax.scan(step, s0, (a, k, v, q))


def _chunked(
    a: Array, k: Array, v: Array, q: Array, s0: Array, chunk: int
) -> tuple[Array, Array]:
    T, H, dk = k.shape
    chunk = min(chunk, T)
    # Sub-chunks of `c`, the largest divisor of `chunk` up to `max(8,
    # sqrt(chunk))`: the diagonal blocks cost `c` per step and the factored
    # pairs `chunk / c`, so `c ~ sqrt(chunk)` balances them.
    bound = min(chunk, max(_SUB, math.isqrt(chunk)))
    c = max(d for d in range(1, bound + 1) if chunk % d == 0)
    n = chunk // c
    pad = -T % chunk
    if pad:  # steps that change nothing: a = 1, k = v = q = 0
        widths = ((0, pad), (0, 0), (0, 0))
        a = jnp.pad(a, widths, constant_values=1)
        k, v, q = (jnp.pad(x, widths) for x in (k, v, q))
    N = (T + pad) // chunk
    split = lambda x: x.reshape(N, n, c, H, x.shape[-1])
    # Clamped so that a decay of 0 gives a finite log (no `inf - inf`); a
    # negative one, which sums of logs cannot hold, makes NaN (not the smallest
    # decay: a wrong number without a word).
    clamped = jnp.maximum(a, jnp.finfo(a.dtype).tiny)
    la = jnp.log(jnp.where(a < 0, jnp.nan, clamped))
    xs = (split(la), split(k), split(v), split(q))
    # Rematerialised: reverse mode keeps the inputs, and the `[N, n, n, c, H,
    # dk]` decay tensors of one group at a time.
    local = jax.checkpoint(_chunk_local, prevent_cse=False)
    o, q_in, decay, update = _in_groups(local, xs, _group_size(N, n, c, H, dk))

    def step(s: Array, x: tuple[Array, Array]) -> tuple[Array, Array]:
        d, u = x
        return d[:, :, None] * s + u, s

    s_T, starts = jax.lax.scan(step, s0, (decay, update))  # starts: [N, H, dk, dv]
    o = o + jnp.einsum("Nthk,Nhkv->Nthv", q_in, starts)
    return s_T, o.reshape(N * chunk, H, -1)[:T]


def _group_size(N: int, n: int, c: int, H: int, dk: int) -> int:
    if jax.default_backend() == "cpu":
        return -(-N // _GROUPS)
    per_chunk = n * n * c * H * dk * 4
    return max(1, min(N, _ACCELERATOR_GROUP_BYTES // per_chunk))


def _in_groups(
    fn: Callable[..., tuple[Array, ...]], xs: tuple[Array, ...], group: int
) -> tuple[Array, ...]:
    """`fn(*xs)` over the leading (chunk) axis, `group` chunks at a time (a
    `lax.map` over the groups, the rest in one call)."""
    N = xs[0].shape[0]
    whole = N // group * group
    if whole <= group:
        return fn(*xs)
    grouped = tuple(x[:whole].reshape(N // group, group, *x.shape[1:]) for x in xs)
    outs = jax.lax.map(lambda g: fn(*g), grouped)
    outs = tuple(y.reshape(whole, *y.shape[2:]) for y in outs)
    if whole == N:
        return outs
    rest = fn(*(x[whole:] for x in xs))
    return tuple(jnp.concatenate(pair) for pair in zip(outs, rest, strict=True))


def _chunk_local(
    la: Array, k: Array, v: Array, q: Array
) -> tuple[Array, Array, Array, Array]:
    """What chunks `la, k, v, q: [N, n, c, H, .]` give independently of their
    start states `S_n`: `(o_intra, q_in, decay, update)`, so that a chunk's
    outputs are `o_intra + q_in @ S_n` and its end state `decay * S_n + update`."""
    N, n, c, H, dk = k.shape
    # Log-decay sums, each over the steps it covers (all terms <= 0): `head`
    # over (sub-chunk start, t], `tail` over (s, sub-chunk end], `before` and
    # `after` over the sub-chunks before and after one in its chunk.
    head = jnp.cumsum(la, axis=2)
    rev = jnp.flip(jnp.cumsum(jnp.flip(la, 2), axis=2), 2)  # over [s, end]
    tail = jnp.concatenate([rev[:, :, 1:], jnp.zeros_like(rev[:, :, :1])], axis=2)
    total = head[:, :, -1]  # [N, n, H, dk]
    idx = jnp.arange(n)
    earlier = idx[None, :] < idx[:, None]  # [i, m]: m < i
    before = _sum_over(earlier, "im,Nmhk->Nihk", total)
    after = _sum_over(earlier.T, "im,Nmhk->Nihk", total)
    q_in = (q * jnp.exp(head + before[:, :, None])).reshape(N, n * c, H, dk)
    k_out = (k * jnp.exp(tail + after[:, :, None])).reshape(N, n * c, H, dk)
    decay = jnp.exp(jnp.sum(total, axis=1))  # [N, H, dk]
    update = jnp.einsum("Nshk,Nshv->Nhkv", k_out, v.reshape(N, n * c, H, -1))
    return _intra_chunk(la, k, v, q, head, tail), q_in, decay, update


def _intra_chunk(
    la: Array, k: Array, v: Array, q: Array, head: Array, tail: Array
) -> Array:
    """The outputs from keys of the same chunk, `[N, C, H, dv]`: earlier
    sub-chunks through factored decays, the diagonal blocks through their
    decay tensor."""
    N, n, c, H, dk = k.shape
    idx = jnp.arange(n)
    # between[N, i, j]: over the sub-chunks strictly between j and i (j < i).
    strictly = (idx[None, :, None] < idx[None, None, :]) & (
        idx[None, None, :] < idx[:, None, None]
    )  # [i, j, m]: j < m < i
    between = _sum_over(strictly, "ijm,Nmhk->Nijhk", head[:, :, -1])
    later = (idx[:, None] > idx[None, :]).astype(la.dtype)  # [i, j]: j < i
    # For j >= i `between` is an empty sum, so the masked entries are finite.
    expo = between[:, :, :, None] + tail[:, None]  # [N, i, j, s, H, dk]
    k_off = k[:, None] * jnp.exp(expo) * later[None, :, :, None, None, None]
    scores = jnp.einsum("Nithk,Nijshk->Nhitjs", q * jnp.exp(head), k_off)
    # The diagonal blocks, `s <= t` in one sub-chunk: each sum over (s, t]
    # accumulated directly (the segment sums of Mamba-2's reference code).
    t, s, r = (
        jnp.arange(c).reshape(shape) for shape in ((c, 1, 1), (1, c, 1), (1, 1, c))
    )
    seg = _sum_over((s < r) & (r <= t), "tsr,Nnrhk->Nntshk", la)
    causal = (t[:, :, 0] >= s[:, :, 0]).astype(la.dtype)  # [t, s]: s <= t
    diag = jnp.exp(seg) * causal[None, None, :, :, None, None]
    diag = jnp.einsum("Nithk,Nishk,Nitshk->Nhits", q, k, diag)
    scores = scores + jnp.einsum("ij,Nhits->Nhitjs", jnp.eye(n, dtype=la.dtype), diag)
    scores = scores.reshape(N, H, n * c, n * c)
    return jnp.einsum("Nhts,Nshv->Nthv", scores, v.reshape(N, n * c, H, -1))


def _sum_over(select: Array, spec: str, x: Array) -> Array:
    """Sums of the log-decays `x` that the boolean `select` picks, one
    contraction with a 0/1 matrix at full precision (a reduced-precision matmul
    would round the log-decays)."""
    weights = select.astype(x.dtype)
    return jnp.einsum(spec, weights, x, precision=jax.lax.Precision.HIGHEST)
