"""`eqxscan.matrix_scan` (the matrix-state recurrence of gated linear attention,
step by step and chunked) and the `GatedLinearAttention` cell, against a float64
step-by-step reference with its hand-written backward pass."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan

from .helpers import untyped


H, DK, DV = 2, 8, 4
# Normwise relative error max|x - y| / max|y| of a float32 run against the
# float64 reference, both forms; measured up to ~1e-6.
F32_TOL = 1e-5
# bfloat16 inputs and outputs (both forms compute in float32 inside): against the
# exact result on the same bfloat16 inputs, the error is that of rounding o and
# s_T to bfloat16 once (measured 1.7e-3 to 3.0e-3), within bfloat16's unit
# roundoff 2^-8.
BF16_TOL = 2**-8


def reference(a, k, v, q, s0):
    """`(s_T, o, S)` in float64, step by step; `S[t]` is the state after step t."""
    a, k, v, q, s = (np.asarray(x, np.float64) for x in (a, k, v, q, s0))
    states, outs = [], []
    for t in range(a.shape[0]):
        s = a[t][:, :, None] * s + k[t][:, :, None] * v[t][:, None, :]
        states.append(s)
        outs.append(np.einsum("hk,hkv->hv", q[t], s))
    return s, np.stack(outs), np.stack(states)


def reference_grads(a, k, v, q, s0, do, ds):
    """The gradients of `sum(o * do) + sum(s_T * ds)` w.r.t. `(a, k, v, q, s0)`,
    by the adjoint recurrence, in float64."""
    a, k, v, q, s0, do, ds = (
        np.asarray(x, np.float64) for x in (a, k, v, q, s0, do, ds)
    )
    _, _, S = reference(a, k, v, q, s0)
    prev = np.concatenate([s0[None], S[:-1]])
    da, dk, dv, dq = (np.zeros_like(x) for x in (a, k, v, q))
    g = ds.copy()  # the cotangent of S_t
    for t in reversed(range(a.shape[0])):
        dq[t] = np.einsum("hkv,hv->hk", S[t], do[t])
        g = g + q[t][:, :, None] * do[t][:, None, :]
        da[t] = np.einsum("hkv,hkv->hk", g, prev[t])
        dk[t] = np.einsum("hkv,hv->hk", g, v[t])
        dv[t] = np.einsum("hkv,hk->hv", g, k[t])
        g = a[t][:, :, None] * g
    return da, dk, dv, dq, g


def rel(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def decays(regime, shape, key):
    u = jr.uniform(key, shape)
    if regime == "mixed":  # mostly near 1, one in ten near 0
        return jnp.where(u < 0.1, 1e-6, 1 - 1e-3 * u)
    if regime == "near_zero":
        return jnp.full(shape, 1e-4)
    if regime == "near_one":
        return jnp.full(shape, 1 - 1e-6)
    return 10.0 ** (-6 * u)  # "spread": log-uniform in [1e-6, 1]


def inputs(T, regime="spread", seed=0, batch=()):
    ka, kk, kv, kq, ks = jr.split(jr.key(seed), 5)
    a = decays(regime, (*batch, T, H, DK), ka)
    k = jr.normal(kk, (*batch, T, H, DK))
    v = jr.normal(kv, (*batch, T, H, DV))
    q = jr.normal(kq, (*batch, T, H, DK))
    s0 = jr.normal(ks, (*batch, H, DK, DV))
    return a, k, v, q, s0


def run(args, method, chunk=32, reverse=False):
    return eqxscan.matrix_scan(*args, method=method, chunk_size=chunk, reverse=reverse)


FORMS = [("sequential", 32), ("chunked", 32), ("chunked", 64), ("chunked", 12)]
REGIMES = ["spread", "mixed", "near_zero", "near_one"]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize(("method", "chunk"), FORMS)
def test_outputs_and_state_match_the_reference(regime, method, chunk):
    # T = 300: several chunks, and not a multiple of any chunk size.
    args = inputs(300, regime)
    s_T, o = run(args, method, chunk)
    s_ref, o_ref, _ = reference(*args)
    assert o.dtype == s_T.dtype == jnp.float32
    assert rel(o, o_ref) <= F32_TOL and rel(s_T, s_ref) <= F32_TOL


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize(("method", "chunk"), [FORMS[0], FORMS[2], FORMS[3]])
def test_gradients_match_the_reference(regime, method, chunk):
    args = inputs(200, regime)
    kd, ks = jr.split(jr.key(1))
    do, ds = jr.normal(kd, (200, H, DV)), jr.normal(ks, (H, DK, DV))

    def loss(*args):
        s_T, o = run(args, method, chunk)
        return jnp.sum(o * do) + jnp.sum(s_T * ds)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    expected = reference_grads(*args, do, ds)
    for name, g, e in zip("akvqs", grads, expected, strict=True):
        assert rel(g, e) <= F32_TOL, name


def test_chunked_gradients_match_the_sequential_form():
    args = inputs(130, "mixed", seed=3)
    loss = lambda method: lambda *x: jnp.sum(jnp.sin(run(x, method, 16)[1]))
    seq = jax.grad(loss("sequential"), argnums=(0, 1, 2, 3, 4))(*args)
    chunked = jax.grad(loss("chunked"), argnums=(0, 1, 2, 3, 4))(*args)
    for g, e in zip(chunked, seq, strict=True):
        assert rel(g, e) <= F32_TOL


def test_finite_differences():
    # A tiny case in float64 arithmetic for the differences: T = 5 with chunks of 2
    # (three chunks, the last padded), along one random direction.
    args = inputs(5, "spread", seed=4)
    kd, ks, kdir = jr.split(jr.key(5), 3)
    do, ds = (
        np.asarray(jr.normal(kd, (5, H, DV))),
        np.asarray(jr.normal(ks, (H, DK, DV))),
    )
    dirs = [
        np.asarray(jr.normal(kk, x.shape)) for kk, x in zip(jr.split(kdir, 5), args)
    ]

    def loss64(*x):
        s_T, o, _ = reference(*x)
        return np.sum(o * do) + np.sum(s_T * ds)

    def loss(*x):
        s_T, o = run(x, "chunked", 2)
        return jnp.sum(o * do) + jnp.sum(s_T * ds)

    eps = 1e-6
    x64 = [np.asarray(x, np.float64) for x in args]
    up = loss64(*(x + eps * d for x, d in zip(x64, dirs)))
    down = loss64(*(x - eps * d for x, d in zip(x64, dirs)))
    numeric = (up - down) / (2 * eps)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*args)
    analytic = sum(np.sum(np.asarray(g, np.float64) * d) for g, d in zip(grads, dirs))
    assert abs(analytic - numeric) <= 1e-4 * max(1.0, abs(numeric))


@pytest.mark.parametrize("method", ["sequential", "chunked"])
def test_reverse_consumes_last_to_first(method):
    args = inputs(70, "mixed", seed=6)
    s_T, o = run(args, method, 32, reverse=True)
    flipped = [jnp.flip(x, 0) for x in args[:4]]
    s_ref, o_ref, _ = reference(*flipped, args[4])
    assert rel(s_T, s_ref) <= F32_TOL
    assert rel(o, np.flip(o_ref, 0)) <= F32_TOL  # aligned with the inputs


@pytest.mark.parametrize("method", ["sequential", "chunked"])
def test_vmap_and_jit_grad_vmap(method):
    args = inputs(40, "spread", seed=7, batch=(3,))
    f = lambda *x: run(x, method, 16)
    s_T, o = jax.vmap(f)(*args)
    loss = lambda *x: jnp.sum(jax.vmap(f)(*x)[1] ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    for b in range(3):
        one = [x[b] for x in args]
        s_ref, o_ref, _ = reference(*one)
        assert rel(o[b], o_ref) <= F32_TOL and rel(s_T[b], s_ref) <= F32_TOL
        do = 2 * np.asarray(o_ref)
        expected = reference_grads(*one, do, np.zeros_like(s_ref))
        for g, e in zip(grads, expected, strict=True):
            assert rel(g[b], e) <= F32_TOL


@pytest.mark.parametrize("method", ["sequential", "chunked"])
def test_bfloat16(method):
    args = [x.astype(jnp.bfloat16) for x in inputs(100, "mixed", seed=8)]
    s_T, o = run(args, method, 32)
    assert o.dtype == s_T.dtype == jnp.bfloat16
    s_ref, o_ref, _ = reference(*(np.asarray(x, np.float32) for x in args))
    assert rel(o, o_ref) <= BF16_TOL and rel(s_T, s_ref) <= BF16_TOL


def test_zero_decay_resets_the_state():
    # A decay of 0 (below float32's smallest normal) resets the state.
    a, k, v, q, s0 = inputs(50, "spread", seed=9)
    a = a.at[::7].set(0.0)
    s_ref, o_ref, _ = reference(a, k, v, q, s0)
    s_T, o = run((a, k, v, q, s0), "chunked", 16)
    assert rel(o, o_ref) <= F32_TOL and rel(s_T, s_ref) <= F32_TOL


@pytest.mark.parametrize("T", [1, 37])
def test_a_chunk_longer_than_the_sequence(T):
    args = inputs(T, "mixed", seed=14)
    s_T, o = run(args, "chunked", 64)
    s_ref, o_ref, _ = reference(*args)
    assert rel(o, o_ref) <= F32_TOL and rel(s_T, s_ref) <= F32_TOL


@pytest.mark.parametrize("method", ["sequential", "chunked"])
def test_no_steps(method):
    a, k, v, q, s0 = inputs(0, seed=10)
    s_T, o = run((a, k, v, q, s0), method)
    assert o.shape == (0, H, DV) and jnp.array_equal(s_T, s0)


def test_bad_inputs_are_named():
    a, k, v, q, s0 = inputs(10)
    with untyped():
        with pytest.raises(
            ValueError, match=r"matrix_scan's q has shape float32\[10,2,4\]"
        ):
            run((a, k, v, q[..., :4], s0), "chunked")
        with pytest.raises(ValueError, match=r"s0 .* make it \[2, 8, 4\]"):
            run((a, k, v, q, s0[:, :, :3]), "sequential")
        with pytest.raises(TypeError, match="k must be a float array with 3 axes"):
            run((a, k[0], v, q, s0), "chunked")
        with pytest.raises(ValueError, match="method must be one of"):
            run((a, k, v, q, s0), "parallel")  # pyright: ignore[reportArgumentType]
        with pytest.raises(ValueError, match="chunk_size"):
            run((a, k, v, q, s0), "chunked", 0)
        # "False" would read as true.
        with pytest.raises(TypeError, match=r"reverse must be a bool, got str"):
            run((a, k, v, q, s0), "chunked", reverse="False")


def test_gated_linear_attention_matches_the_hand_recurrence():
    D = 6
    cell = eqxscan.GatedLinearAttention(
        D, num_heads=H, key_size=DK, value_size=DV, key=jr.key(11)
    )
    xs = jr.normal(jr.key(12), (37, D))
    s0 = jr.normal(jr.key(13), (H, DK, DV))
    # By hand, from the cell's own weights: a = sigmoid(x W1 W2 + b) ** (1/16).
    W1, W2 = cell.gate_down.weight, cell.gate_up.weight
    b = cell.gate_up.bias
    assert b is not None
    S, outs = np.asarray(s0, np.float64), []
    for x in np.asarray(xs, np.float64):
        a = (1 / (1 + np.exp(-(W2 @ (W1 @ x) + b)))) ** (1 / 16)
        k = (cell.k_proj.weight @ x).reshape(H, DK)
        v = (cell.v_proj.weight @ x).reshape(H, DV)
        q = (cell.q_proj.weight @ x).reshape(H, DK) / np.sqrt(DK)
        S = a.reshape(H, DK)[:, :, None] * S + k[:, :, None] * v[:, None, :]
        outs.append(np.einsum("hk,hkv->hv", q, S))
    gates = jax.vmap(cell.gates)(xs)
    s_T, o = eqxscan.matrix_scan(
        *gates, s0, method="chunked", chunk_size=16, reverse=False
    )
    assert rel(o, np.stack(outs)) <= F32_TOL and rel(s_T, S) <= F32_TOL
    # One step of the cell, and its read-out.
    one = cell(xs[0], s0)
    assert rel(one, reference(*(g[:1] for g in gates), s0)[0]) <= F32_TOL
    assert rel(cell.output(one, xs[0]), np.asarray(o[0]) * 0 + outs[0]) <= F32_TOL


def test_gated_linear_attention_names_a_wrong_input():
    cell = eqxscan.GatedLinearAttention(
        6, num_heads=H, key_size=DK, value_size=DV, key=jr.key(0)
    )
    with untyped(), pytest.raises(ValueError, match=r"input_size=6.*float32\[3,6\]"):
        cell.gates(jnp.ones((3, 6)))


def test_chunked_training_memory_is_a_fraction_of_the_sequential_forms():
    # Reverse mode through the sequential scan keeps every step's state, T x H x dk
    # x dv; the chunked form keeps a state per chunk and recomputes the chunk's
    # decay tensors (its body is rematerialised). XLA's temp memory, exact.
    T, h, d = 1024, 1, 64
    args = (jnp.full((T, h, d), 0.9), *jnp.ones((2, T, h, d)), jnp.ones((T, h, d)))
    args = (args[0], args[1], args[3], args[2], jnp.zeros((h, d, d)))

    def temp(method):
        loss = lambda *x: jnp.sum(run(x, method, 64)[1])
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    states = T * h * d * d * 4
    assert temp("sequential") >= states
    assert temp("chunked") <= states / 4


def test_benchmark_smoke(monkeypatch, capsys):
    # benchmarks/linear_matrix.py --tiny, in this process: every form has a row
    # with a time and XLA temp sizes, and the chunked outputs agree.
    from benchmarks import linear_matrix as bench

    monkeypatch.setattr("sys.argv", ["linear_matrix", "--tiny"])
    bench.main()
    out = capsys.readouterr().out
    rows = [
        r.rsplit(maxsplit=4)
        for r in out.splitlines()
        if r.startswith(("sequential ", "chunked C="))
    ]
    assert [r[0].strip() for r in rows] == [
        "sequential",
        "chunked C=16",
        "chunked C=32",
    ]
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows)
    assert float(out.rsplit("difference", 1)[1]) <= F32_TOL


def test_groups_of_chunks_on_an_accelerator_are_bounded_by_bytes(monkeypatch):
    # Off CPU the state-independent work is one batch of all chunks unless one
    # group's decay tensors would pass the byte bound; on CPU, a few groups.
    from eqxscan._containers import linear_matrix as lm

    assert lm._group_size(128, 4, 8, 4, 64) == -(-128 // lm._GROUPS)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert lm._group_size(128, 4, 8, 4, 64) == 128
    per_chunk = 4 * 4 * 8 * 64 * 64 * 4
    fits = lm._ACCELERATOR_GROUP_BYTES // per_chunk
    assert lm._group_size(10 * fits, 4, 8, 64, 64) == fits


def test_a_negative_decay_is_refused_by_the_chunked_form():
    # Sums of logs cannot hold a sign: the decay counted as ~0, outputs off by
    # as much as the outputs, without a word.
    a, k, v, q, s0 = inputs(20)
    a = a.at[6, 1, 2].set(-0.5)
    seq = run((a, k, v, q, s0), "sequential", chunk=4)
    assert np.isfinite(seq[1]).all()  # the sequential form computes it
    with pytest.raises(
        ValueError,
        match=r"chunked form needs decays a >= 0, but a\[6, 1, 2\] is -0\.5 \(1 "
        r"negative\)\.\nHint: method='sequential'",
    ):
        run((a, k, v, q, s0), "chunked", chunk=4)
    # Traced, as in a Recurrent: its state row NaN from its chunk on, and the
    # outputs reading it; the rest as the sequential form computes it.
    s_T, o = jax.jit(lambda a: run((a, k, v, q, s0), "chunked", chunk=4))(a)
    assert np.isnan(s_T[1, 2]).all() and np.isnan(o[8:, 1]).all()
    np.testing.assert_allclose(o[:, 0], seq[1][:, 0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(o[:4], seq[1][:4], rtol=1e-4, atol=1e-4)
