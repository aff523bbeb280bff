"""Linear recurrences in `Recurrent`: `diagonal_scan`'s three forms against a
step-by-step float64 reference and each other (values and gradients, float32
and bfloat16, decays near 0 and 1 over long sequences), the cells `LRU` and
`MinGRU` against their own steps, `Recurrent`'s options (mask, reverse,
truncation, h0, keys, cell arguments, vmap, jit) in the parallel forms against
the sequential one, finite differences, and the errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxscan
from eqxscan._containers.linear_diag import choose_method

from .helpers import untyped


PARALLEL = ("associative", "chunked")
METHODS = ("sequential", *PARALLEL)
# bfloat16 (8-bit mantissa): the relative error (norm over all steps) of the
# associative and chunked forms against a float64 run on the same inputs, for
# T <= 4096 and decays near 0 or 1 (docs/recurrent.md#linear-recurrences).
BF16_RTOL = 4e-2


scan = jax.jit(
    eqxscan.diagonal_scan, static_argnames=("method", "chunk_size", "reverse")
)


def rel(x, y):
    x, y = np.asarray(x, np.complex128), np.asarray(y, np.complex128)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def reference(a, b, h0, reverse=False):
    """`h_t = a_t h_{t-1} + b_t` in float64 (complex128), one step at a time."""
    a, b = np.asarray(a, np.complex128), np.asarray(b, np.complex128)
    h, hs = np.asarray(h0, np.complex128), np.zeros_like(b)
    for t in range(len(a))[:: -1 if reverse else 1]:
        h = a[t] * h + b[t]
        hs[t] = h
    return h, hs


def gates(key, T, D, low, high, dtype=jnp.float32, complex_=False):
    ka, kb, kh, kp = jr.split(key, 4)
    a = jr.uniform(ka, (T, D), jnp.float32, low, high)
    b, h0 = jr.normal(kb, (T, D)), jr.normal(kh, (D,))
    if complex_:
        phase = jr.uniform(kp, (T, D), jnp.float32, 0, 2 * np.pi)
        a = jax.lax.complex(a * jnp.cos(phase), a * jnp.sin(phase))
        b, h0 = jax.lax.complex(b, -b), jax.lax.complex(h0, h0)
        return a, b, h0
    return a.astype(dtype), b.astype(dtype), h0.astype(dtype)


# ------------------------------------------------------------- diagonal_scan


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("complex_", [False, True])
def test_forms_match_step_by_step_reference(method, reverse, complex_, getkey):
    a, b, h0 = gates(getkey(), 37, 5, 0.5, 1.0, complex_=complex_)
    h_T, hs = scan(a, b, h0, method=method, chunk_size=8, reverse=reverse)
    ref_T, ref = reference(a, b, h0, reverse)
    assert hs.dtype == h0.dtype and hs.shape == b.shape
    assert rel(hs, ref) <= 1e-5 and rel(h_T, ref_T) <= 1e-5


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_any_chunk_size(chunk_size, getkey):
    # 16 divides T; 5 does not (padding); 64 is longer than T.
    a, b, h0 = gates(getkey(), 32, 3, 0.0, 1.0)
    _, hs = scan(a, b, h0, method="chunked", chunk_size=chunk_size)
    assert rel(hs, reference(a, b, h0)[1]) <= 1e-5


def test_pytree_carry(getkey):
    (a1, b1, h1), (a2, b2, h2) = (gates(getkey(), 9, d, 0.2, 0.9) for d in (2, 3))
    a, b, h0 = {"x": a1, "y": a2}, {"x": b1, "y": b2}, {"x": h1, "y": h2}
    for method in PARALLEL:
        h_T, hs = scan(a, b, h0, method=method, chunk_size=4)
        assert rel(hs["y"], reference(a2, b2, h2)[1]) <= 1e-5
        assert rel(h_T["x"], reference(a1, b1, h1)[0]) <= 1e-5


def _outputs_and_grads(method, a, b, h0, w, reverse=False):
    """`hs` and the gradient of a loss of `(h_T, hs)` with respect to
    `(a, b, h0)`, in one compiled program."""

    def loss(a, b, h0):
        h_T, hs = eqxscan.diagonal_scan(
            a, b, h0, method=method, chunk_size=64, reverse=reverse
        )
        parts = jnp.real(hs) * w + jnp.imag(hs) * w[::-1]
        return jnp.sum(parts) + jnp.sum(jnp.real(h_T)), hs

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    grads, hs = jax.jit(grad)(a, b, h0)
    return hs, grads


@pytest.mark.parametrize("decay", ["near0", "near1", "mixed"])
def test_long_sequences_agree_in_float32(decay, getkey):
    # T = 4096: products of a_t underflow to 0 (near0) or stay near 1 (near1).
    low, high = {"near0": (1e-3, 1e-2), "near1": (1 - 1e-4, 1.0), "mixed": (0, 1)}[
        decay
    ]
    a, b, h0 = gates(getkey(), 4096, 4, low, high)
    w = jr.normal(getkey(), b.shape)
    ref = reference(a, b, h0)[1]
    out = {m: _outputs_and_grads(m, a, b, h0, w) for m in METHODS}
    for m in METHODS:
        assert rel(out[m][0], ref) <= 1e-5, m
    for m in PARALLEL:
        for g, s in zip(out[m][1], out["sequential"][1]):
            assert rel(g, s) <= 1e-5, m


def test_complex_long_gradients_agree(getkey):
    a, b, h0 = gates(getkey(), 1024, 4, 0.99, 1.0, complex_=True)
    w = jr.normal(getkey(), b.shape)
    ref = reference(a, b, h0, reverse=True)[1]
    out = {m: _outputs_and_grads(m, a, b, h0, w, reverse=True) for m in METHODS}
    for m in PARALLEL:
        assert rel(out[m][0], ref) <= 1e-5
        for g, s in zip(out[m][1], out["sequential"][1]):
            assert rel(g, s) <= 1e-5, m


@pytest.mark.parametrize("decay", [(1e-3, 1e-2), (0.99, 1.0)])
def test_bfloat16_within_documented_tolerance(decay, getkey):
    a, b, h0 = gates(getkey(), 1024, 4, *decay, dtype=jnp.bfloat16)
    ref = reference(a.astype(jnp.float32), b.astype(jnp.float32), h0)[1]
    step = jax.jit(eqxscan.diagonal_scan, static_argnames=("method", "chunk_size"))
    err = {}
    for m in METHODS:
        hs = step(a, b, h0, method=m, chunk_size=64)[1]
        assert hs.dtype == jnp.bfloat16
        err[m] = rel(hs.astype(jnp.float32), ref)
    # Near 1 the sequential scan's rounding accumulates over T (about 7e-2
    # here); the parallel forms add in a tree and stay below the tolerance.
    assert err["sequential"] <= 2 * BF16_RTOL
    assert all(err[m] <= BF16_RTOL for m in PARALLEL), err


def test_finite_differences_float64(getkey):
    with jax.enable_x64(True):
        k1, k2, k3 = jr.split(getkey(), 3)
        a = jr.uniform(k1, (13, 3), jnp.float64, 0.3, 1.0)
        b, h0 = jr.normal(k2, (13, 3), jnp.float64), jr.normal(k3, (3,), jnp.float64)
        w = jnp.linspace(-1, 1, 39).reshape(13, 3)
        for method in METHODS:
            loss = lambda a, b, h0, m=method: jnp.sum(
                jnp.sin(scan(a, b, h0, method=m, chunk_size=4)[1]) * w
            )
            loss = jax.jit(loss)
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a, b, h0)
            for v in jr.split(getkey(), 2):
                d = tuple(
                    jr.normal(k, x.shape, x.dtype)
                    for k, x in zip(jr.split(v, 3), (a, b, h0))
                )
                eps = 1e-6
                plus = loss(*(x + eps * dx for x, dx in zip((a, b, h0), d)))
                minus = loss(*(x - eps * dx for x, dx in zip((a, b, h0), d)))
                fd = (plus - minus) / (2 * eps)
                exact = sum(jnp.vdot(g, dx) for g, dx in zip(grads, d))
                assert abs(fd - exact) <= 1e-7 * max(1.0, abs(exact)), method


# ------------------------------------------------------------------ the cells


def cells(key):
    k1, k2, k3 = jr.split(key, 3)
    return {
        "lru": (eqxscan.LRU(3, 6, r_min=0.9, r_max=0.999, key=k1), jnp.complex64),
        "lru_real": (eqxscan.LRU(3, 6, real=True, key=k2), jnp.float32),
        "mingru": (eqxscan.MinGRU(3, 6, key=k3), jnp.float32),
    }


@pytest.mark.parametrize("name", ["lru", "lru_real", "mingru"])
def test_cells_match_their_steps(name, getkey):
    cell, dtype = cells(getkey())[name]
    xs, h0 = jr.normal(getkey(), (21, 3)), jr.normal(getkey(), (6,)).astype(dtype)
    h, ref = h0, []
    for x in xs:  # one-step decoding: the cell's own `__call__`
        h = cell(x, h)
        ref.append(h)
    for method in (*METHODS, "auto"):
        h_T, hs = eqxscan.Recurrent(cell, method=method, chunk_size=8)(h0, xs)
        assert hs.dtype == dtype
        assert rel(hs, jnp.stack(ref)) <= 1e-5 and rel(h_T, h) <= 1e-5, method


def test_lru_matches_the_paper_formulas(getkey):
    lru = eqxscan.LRU(2, 4, key=getkey())
    x = jr.normal(getkey(), (2,))
    lam = np.exp(-np.exp(lru.nu_log) + 1j * np.exp(lru.theta_log))
    gamma = np.sqrt(1 - np.abs(lam) ** 2)
    B = np.asarray(lru.B_re) + 1j * np.asarray(lru.B_im)
    a, b = lru.gates(x)
    want = gamma * (B @ np.asarray(x))
    assert np.allclose(a, lam, rtol=1e-6) and np.allclose(b, want, rtol=1e-5)
    ring = eqxscan.LRU(2, 64, r_min=0.9, r_max=0.99, key=getkey())
    modulus = np.abs(ring.gates(x)[0])
    assert modulus.min() >= 0.9 - 1e-6 and modulus.max() <= 0.99 + 1e-6


def test_mingru_matches_the_paper_formulas(getkey):
    cell = eqxscan.MinGRU(3, 4, key=getkey())
    x, h = jr.normal(getkey(), (3,)), jr.normal(getkey(), (4,))
    pre = cell.weight @ x + cell.bias
    z, cand = jax.nn.sigmoid(pre[:4]), pre[4:]
    assert jnp.allclose(cell(x, h), (1 - z) * h + z * cand, atol=1e-6)


# -------------------------------------------- Recurrent's options, in parallel


def _run(cell, method, h0, xs, *args, **kw):
    """`method="cell"`: the cell step by step through the scan engine (which an
    explicit `remat` asks for), the reference for `Recurrent`'s options."""
    reverse = kw.pop("reverse", False)
    if method == "cell":
        rnn = eqxscan.Recurrent(cell, method="sequential", reverse=reverse, remat=False)
    else:
        rnn = eqxscan.Recurrent(cell, method=method, chunk_size=4, reverse=reverse)
    return rnn(h0, xs, *args, **kw)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("truncate", [None, 3])
def test_options_and_gradients_match_sequential(reverse, truncate, getkey):
    cell, _ = cells(getkey())["mingru"]
    xs, h0 = jr.normal(getkey(), (11, 3)), jr.normal(getkey(), (6,))
    mask = jnp.array(
        [True, False, True, True, False, True, True, True, True, False, True]
    )
    # NaN padding on skipped steps changes neither values nor gradients.
    xs = jnp.where(mask[:, None], xs, jnp.nan)

    def loss(cell, h0, method):
        h_T, hs = _run(
            cell, method, h0, xs, mask=mask, truncate=truncate, reverse=reverse
        )
        return jnp.sum(jnp.sin(hs)) + jnp.sum(h_T**2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    want, want_g = grad(cell, h0, "cell")
    for m in METHODS:
        got, got_g = grad(cell, h0, m)
        assert rel(got, want) <= 1e-5, m
        for g, w in zip(jtu.tree_leaves(got_g), jtu.tree_leaves(want_g)):
            assert np.all(np.isfinite(g)) and rel(g, w) <= 1e-5, m


def test_truncation_stops_the_gradient(getkey):
    # A broken truncation (no cut) gives h0 a gradient through all 8 steps.
    cell, _ = cells(getkey())["mingru"]
    xs, h0 = jr.normal(getkey(), (8, 3)), jr.normal(getkey(), (6,))
    for m in ("cell", *METHODS):
        g = jax.jit(
            jax.grad(lambda h, m=m: jnp.sum(_run(cell, m, h, xs, truncate=3)[0]))
        )(h0)
        assert jnp.all(g == 0), m


def test_vmap_jit_grad_and_batch_major(getkey):
    cell, dtype = cells(getkey())["lru"]
    xs = jr.normal(getkey(), (2, 9, 3))
    h0 = jnp.zeros((2, 6), dtype)

    def loss(cell, method):
        rnn = eqxscan.Recurrent(cell, method=method, chunk_size=4)
        h_T, hs = jax.vmap(rnn)(h0, xs)
        return jnp.sum(jnp.abs(hs) ** 2)

    grads = {m: jax.jit(jax.grad(loss), static_argnums=1)(cell, m) for m in METHODS}
    for m in PARALLEL:
        for g, w in zip(
            jtu.tree_leaves(grads[m]), jtu.tree_leaves(grads["sequential"])
        ):
            assert rel(g, w) <= 1e-5
    # time_axis=1 on one example's [F, T] inputs gives the same carries.
    rnn = eqxscan.Recurrent(cell, method="associative")
    _, hs = rnn(h0[0], xs[0].T, time_axis=1)
    assert rel(hs.T, rnn(h0[0], xs[0])[1]) <= 1e-6


class Dropped(eqxscan.DiagonalLinearCell):
    """Gates with a key, an extra argument and a keyword of the cell's own."""

    cell: eqxscan.MinGRU

    def gates(self, x, scale, *, shift, key=None):
        a, b = self.cell.gates(x * scale + shift)
        if key is not None:
            b = jnp.where(jr.bernoulli(key, 0.5, b.shape), b, 0.0)
        return a, b


@pytest.mark.parametrize("broadcast_key", [False, True])
def test_keys_and_cell_arguments(broadcast_key, getkey):
    cell = Dropped(cells(getkey())["mingru"][0])
    xs, h0, key = jr.normal(getkey(), (7, 3)), jnp.zeros(6), getkey()
    kw = dict(key=key, broadcast_key=broadcast_key, cell_kwargs={"shift": 0.5})
    ref = _run(cell, "cell", h0, xs, 2.0, **kw)[1]
    for m in METHODS:
        got = eqxscan.Recurrent(cell, method=m, chunk_size=4)(h0, xs, 2.0, **kw)[1]
        assert rel(got, ref) <= 1e-6, m
    # The key and the arguments reach the gates.
    other = eqxscan.Recurrent(cell, method="associative")(h0, xs, 1.0, **kw)[1]
    unkeyed = eqxscan.Recurrent(cell, method="associative")(
        h0, xs, 2.0, cell_kwargs={"shift": 0.5}
    )[1]
    assert rel(other, ref) > 1e-2 and rel(unkeyed, ref) > 1e-2


def test_bidirectional_and_with_options(getkey):
    k1, k2 = jr.split(getkey())
    fwd, bwd = eqxscan.MinGRU(3, 4, key=k1), eqxscan.MinGRU(3, 4, key=k2)
    xs, h0 = jr.normal(getkey(), (6, 3)), (jnp.zeros(4), jnp.zeros(4))
    mask = jnp.arange(6) < 4
    outs = {}
    for m in METHODS:
        bi = eqxscan.Bidirectional(
            eqxscan.Recurrent(fwd, method=m),
            eqxscan.Recurrent(bwd, reverse=True, method=m),
        )
        outs[m] = bi(h0, xs, mask=mask)
    for m in PARALLEL:
        for g, w in zip(jtu.tree_leaves(outs[m]), jtu.tree_leaves(outs["sequential"])):
            assert rel(g, w) <= 1e-5
    rnn = eqxscan.Recurrent(fwd).with_options(method="chunked", chunk_size=2)
    assert (rnn.method, rnn.chunk_size) == ("chunked", 2)
    assert rel(rnn(h0[0], xs, mask=mask)[1], outs["sequential"][1][0]) <= 1e-5


def test_empty_sequence(getkey):
    cell = cells(getkey())["mingru"][0]
    for m in METHODS:
        h_T, hs = eqxscan.Recurrent(cell, method=m)(jnp.ones(6), jnp.zeros((0, 3)))
        assert hs.shape == (0, 6) and jnp.array_equal(h_T, jnp.ones(6))


def test_taps_record_every_step(getkey):
    # Tapped, a linear cell runs step by step in the engine (whatever the
    # method), so each time step has its row, as for any cell.
    cell = cells(getkey())["mingru"][0]
    xs = jr.normal(getkey(), (6, 3))
    for m in ("auto", "associative", "chunked"):
        rnn = eqxscan.Recurrent(cell, method=m)
        (_, hs), got = eqxscan.tap(rnn, lambda h: jnp.max(jnp.abs(h)))(jnp.zeros(6), xs)
        assert rel(got, jnp.max(jnp.abs(hs), axis=1)) <= 1e-6


# ---------------------------------------------------------------- matrix state


class TinyGLA(eqxscan.MatrixLinearCell):
    w: jax.Array  # [4 * H * dk, F] for a, k, q (dk = dv)

    def gates(self, x):
        a, k, v, q = jnp.split(self.w @ x, 4)
        shape = (2, 3)  # H = 2, dk = dv = 3
        return (
            jax.nn.sigmoid(a).reshape(shape),
            k.reshape(shape),
            v.reshape(shape),
            q.reshape(shape),
        )


def _matrix_steps(cell, s0, xs):
    """The final state and every step's read-out, the cell step by step."""
    s, outs = s0, []
    for x in xs:
        s = cell(x, s)
        outs.append(cell.output(s, x))
    return s, jnp.stack(outs)


def test_matrix_cell_returns_outputs_not_states(getkey):
    cell = TinyGLA(jr.normal(getkey(), (24, 5)))
    xs, s0 = jr.normal(getkey(), (7, 5)), jr.normal(getkey(), (2, 3, 3))
    s, ref = _matrix_steps(cell, s0, xs)
    s_T, os = eqxscan.Recurrent(cell, method="sequential")(s0, xs)
    assert os.shape == (7, 2, 3) and rel(os, ref) <= 1e-5 and rel(s_T, s) <= 1e-5
    assert eqxscan.Recurrent(cell)(s0, xs[:0])[1].shape == (0, 2, 3)
    chunked = eqxscan.Recurrent(cell, method="chunked", chunk_size=4)
    s_c, os_c = chunked(s0, xs)
    assert rel(os_c, os) <= 1e-5 and rel(s_c, s_T) <= 1e-5


def test_auto_runs_a_wide_matrix_state_chunked_on_cpu(getkey):
    # One head of 64 x 64: `auto` picks the chunked form on every backend, and
    # agrees with the cell run step by step.
    cell = eqxscan.GatedLinearAttention(
        8, num_heads=1, key_size=64, value_size=64, key=getkey()
    )
    xs, s0 = jr.normal(getkey(), (40, 8)), jnp.zeros((1, 64, 64))
    rnn = eqxscan.Recurrent(cell, chunk_size=16)
    s_T, os = rnn(s0, xs)
    s_seq, os_seq = eqxscan.Recurrent(cell, method="sequential")(s0, xs)
    assert rel(os, os_seq) <= 1e-5 and rel(s_T, s_seq) <= 1e-5
    jaxpr = str(jax.make_jaxpr(rnn)(s0, xs))
    # The chunked form's scan runs over ceil(40 / 16) = 3 chunks.
    assert "length=3" in jaxpr


# ------------------------------------------------------------- auto and errors


def test_auto_rule():
    assert choose_method("cpu", 4096, 256, "diagonal") == "sequential"
    assert choose_method("cpu", 4096, 256, "diagonal", batch=8) == "sequential"
    # On a TPU v5e one sequence ran fastest (or within 1.41x) in chunks; a
    # batch of them associatively, whatever the carry's size.
    for size in (8, 256, 1024, 8192):
        assert choose_method("tpu", 4096, size, "diagonal") == "chunked"
        assert choose_method("tpu", 4096, size, "diagonal", batch=2) == "associative"
    assert choose_method("gpu", 1, 8, "diagonal", batch=8) == "sequential"
    assert choose_method("tpu", 4096, 8, "matrix") == "chunked"
    assert choose_method("tpu", 4096, 8, "matrix", batch=8) == "chunked"
    # On CPU a matrix state runs chunked from 64 x 64 a head (measured faster).
    assert choose_method("cpu", 4096, 64 * 64, "matrix") == "chunked"
    assert choose_method("cpu", 4096, 32 * 32, "matrix") == "sequential"
    assert choose_method("cpu", 1, 64 * 64, "matrix") == "sequential"


class _RnnBlock(eqx.Module):
    rnn: eqxscan.Recurrent

    def __init__(self, cell, key):
        del key
        self.rnn = eqxscan.Recurrent(cell, chunk_size=4)

    def __call__(self, xs):
        return jnp.tanh(self.rnn(jnp.zeros(4), xs)[1][:, :3])


def test_auto_sees_the_vmap_batch(monkeypatch, getkey):
    # `method="auto"` on an accelerator: the program of "associative" for a
    # `jax.vmap` over sequences (of the carry, or of the inputs alone) under
    # `jit`, and "chunked" for one sequence; eager `vmap` (a cached program
    # traced per example) tells the rule its batch too.
    import collections

    from eqxscan._containers import recurrent_linear as rl

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    cell = eqxscan.MinGRU(3, 4, key=getkey())
    h0, xs = jnp.zeros((5, 4)), jr.normal(getkey(), (5, 12, 3))
    rnn = {m: eqxscan.Recurrent(cell, method=m, chunk_size=4) for m in
           ("auto", "associative", "chunked")}  # fmt: skip

    def program(m, fn, *args):  # its operations, but the rule's dead probes
        jaxpr = jax.make_jaxpr(lambda *a: fn(rnn[m], *a))(*args)
        probes = ("custom_vmap_call", "stop_gradient")
        eqns = [e for e in jaxpr.eqns if e.primitive.name not in probes]
        inner = [str(e.params["jaxpr"]) for e in eqns if "jaxpr" in e.params]
        return collections.Counter(e.primitive.name for e in eqns), inner

    batched = lambda r, h, x: jax.vmap(r)(h, x)
    inputs_only = lambda r, x: jax.vmap(r, in_axes=(None, 0))(h0[0], x)
    one = lambda r, h, x: r(h, x)
    assert program("auto", batched, h0, xs) == program("associative", batched, h0, xs)
    assert program("auto", inputs_only, xs) == program("associative", inputs_only, xs)
    args = h0[0], xs[0]
    assert program("auto", one, *args) == program("chunked", one, *args)
    assert program("chunked", one, *args) != program("associative", one, *args)
    batches = []

    def spy(*args):
        batches.append(args[4])
        return choose_method(*args)

    monkeypatch.setattr(rl, "choose_method", spy)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # eager: cached
    out = jax.vmap(rnn["auto"])(h0, xs)
    assert batches == [5]
    # Inside the layers of a stack, whose step is traced per example: the
    # engine passes the batch on (it saw 1, and ran one sequence's form).
    stack = eqxscan.Stacked(lambda k: _RnnBlock(cell, k), 2, key=jr.key(0))
    for call, want in [
        (jax.jit(jax.vmap(stack)), 5),
        (jax.vmap(stack), 5),
        (jax.jit(jax.vmap(jax.vmap(stack))), 10),
        (stack, 1),
    ]:
        batches.clear()
        call(xs if want == 5 else xs[0] if want == 1 else jnp.stack([xs, xs]))
        assert batches == [want], (batches, want)
    ref = [rnn["auto"](h, x) for h, x in zip(h0, xs)]
    assert jnp.allclose(out[1], jnp.stack([r[1] for r in ref]), atol=1e-5)


def test_bad_options_are_named(getkey):
    cell = eqxscan.MinGRU(3, 4, key=getkey())
    # (the runtime type checker may refuse it first, naming `method` too)
    with pytest.raises((ValueError, TypeError), match="method"):
        eqxscan.Recurrent(cell, method="parallel")
    with pytest.raises((ValueError, TypeError), match="chunk_size"):
        eqxscan.Recurrent(cell, chunk_size=0)
    with pytest.raises(
        ValueError, match="DiagonalLinearCell or eqxscan.MatrixLinearCell"
    ):
        eqxscan.Recurrent(eqxscan.ElmanCell(3, 4, key=getkey()), method="associative")
    with pytest.raises(ValueError, match="method='chunked'"):
        eqxscan.Recurrent(TinyGLA(jnp.zeros((24, 5))), method="associative")


class Widening(eqxscan.DiagonalLinearCell):
    def gates(self, x):
        return jnp.ones(4), x[:4]


def test_gates_of_the_wrong_shape_are_named():
    rnn = eqxscan.Recurrent(Widening(), method="associative")
    with pytest.raises(ValueError, match=r"Widening.gates returned a of shape \(4,\)"):
        rnn(jnp.zeros(5), jnp.ones((6, 5)))


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_benchmark_smoke(monkeypatch, capsys, backend):
    # benchmarks/linear_recurrence.py --tiny, in this process: every form is
    # timed, `auto` lowered to the program of the form it picks, and auto/best
    # is that form's time over the fastest. As traced for a TPU, `auto` runs
    # chunks of 64 steps, a size the grid lacks: it is timed as itself (the run
    # stopped there on a TPU).
    import re

    from benchmarks import linear_recurrence as bench

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr("sys.argv", ["linear_recurrence", "--tiny"])
    bench.main()
    out = capsys.readouterr().out
    (row,) = [r for r in out.splitlines() if r.startswith("float32")]
    ms = {n: float(t) for n, t in re.findall(r"([\w-]+) ([0-9.]+) \(", row)}
    forms = ["associative", "cell", "chunked-8", "sequential"]
    picked, ratio = re.search(r"auto=(\w+) auto/best ([0-9.]+)", row).groups()
    method = choose_method(backend, 32, 8, "diagonal", batch=2)  # the grid's B
    if backend == "cpu":
        assert picked == method == "sequential" and sorted(ms) == forms
    else:
        assert picked == method == "associative" and sorted(ms) == forms
    # The times are printed to 0.001 ms, the ratio to 0.01: it must lie within
    # what those roundings allow (at --tiny sizes a time is under 1 ms).
    fastest = min(ms.values())
    low = (ms[picked] - 5e-4) / (fastest + 5e-4)
    high = (ms[picked] + 5e-4) / max(fastest - 5e-4, 1e-9)
    assert low - 0.005 <= float(ratio) <= high + 0.005, (ratio, ms)


def test_chunk_size_auto(monkeypatch, getkey):
    # `chunk_size="auto"` (the default): 64 steps; 32 for a matrix state off CPU.
    from eqxscan._containers import recurrent_linear as rl

    rnn = eqxscan.Recurrent(eqxscan.MinGRU(3, 4, key=getkey()))
    assert rnn.chunk_size == "auto"
    assert rl.chunk_for("auto", matrix=False) == rl.chunk_for("auto", True) == 64
    assert rl.chunk_for(16, matrix=True) == 16
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert rl.chunk_for("auto", matrix=True) == rl.AUTO_MATRIX_CHUNK_ACCELERATOR
    assert rl.chunk_for("auto", matrix=False) == rl.AUTO_CHUNK
    assert rnn.with_options(chunk_size=8).chunk_size == 8
    with pytest.raises((ValueError, TypeError), match="chunk_size"):
        eqxscan.Recurrent(eqxscan.MinGRU(3, 4, key=getkey()), chunk_size="big")


class GatedOutput(TinyGLA):
    # A read-out of its own (an output gate, as gated linear attention models add).
    def output(self, S_t, x_t):
        return jax.nn.sigmoid(x_t[None, :3]) * jnp.einsum(
            "hk,hkv->hv", self.gates(x_t)[3], S_t
        )


def test_a_matrix_cell_with_its_own_output_runs_it(monkeypatch, getkey):
    cell = GatedOutput(jr.normal(getkey(), (24, 5)))
    xs, s0 = jr.normal(getkey(), (9, 5)), jr.normal(getkey(), (2, 3, 3))
    s, ref = _matrix_steps(cell, s0, xs)
    with pytest.raises(ValueError, match="overrides `output`"):
        eqxscan.Recurrent(cell, method="chunked")
    # "auto" would pick the chunked form off CPU: it runs the cell's steps.
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    s_T, os = eqxscan.Recurrent(cell, chunk_size=4)(s0, xs)
    assert rel(os, ref) <= 1e-5 and rel(s_T, s) <= 1e-5
    plain = TinyGLA(cell.w)  # for contrast, the plain cell runs chunked there
    assert "length=3" in str(
        jax.make_jaxpr(eqxscan.Recurrent(plain, chunk_size=4))(s0, xs)
    )


def test_matrix_outputs_take_the_engines_dtype_in_every_form(getkey):
    # bfloat16 weights, a float32 state: `os` is the read-out `q_t . S_t`'s dtype.
    cell = TinyGLA(jr.normal(getkey(), (24, 5)).astype(jnp.bfloat16))
    xs, s0 = jr.normal(getkey(), (9, 5)).astype(jnp.bfloat16), jnp.zeros((2, 3, 3))
    with jax.numpy_dtype_promotion("standard"):  # the engine's einsum promotes
        outs = {
            m: eqxscan.Recurrent(cell, method=m, chunk_size=4)(s0, xs)
            for m in ("sequential", "chunked")
        }
    assert {o.dtype for _, o in outs.values()} == {jnp.dtype(jnp.float32)}
    assert rel(outs["chunked"][1], outs["sequential"][1]) <= 1e-5


def test_complex_gates_for_a_real_carry_are_refused(getkey):
    lru = eqxscan.LRU(3, 4, key=getkey())
    xs, real = jr.normal(getkey(), (5, 3)), jnp.zeros(4)
    for method in (*METHODS, "auto"):
        with pytest.raises(TypeError, match="a from LRU.gates is complex"):
            eqxscan.Recurrent(lru, method=method)(real, xs)
    with pytest.raises(TypeError, match="imaginary part would be dropped"):
        lru(xs[0], real)  # one decoding step
    a, b, _ = gates(getkey(), 5, 2, 0.5, 0.9, complex_=True)
    for method in METHODS:
        with pytest.raises(TypeError, match="diagonal_scan's a is complex"):
            eqxscan.diagonal_scan(a, b, jnp.zeros(2), method=method)
    # A real `a` with a complex carry stays allowed.
    h_T, _ = eqxscan.diagonal_scan(
        a.real, b, jnp.zeros(2, jnp.complex64), method="chunked"
    )
    assert jnp.iscomplexobj(h_T)


def test_no_inputs_and_empty_sequences_in_every_form(getkey):
    class Constant(eqxscan.DiagonalLinearCell):
        def gates(self, x):
            return jnp.full(4, 0.5), jnp.ones(4)

    h_T, hs = eqxscan.Recurrent(Constant(), mode="loop")(jnp.zeros(4), length=5)
    for method in (*METHODS, "auto"):
        got = eqxscan.Recurrent(Constant(), method=method, chunk_size=2)(
            jnp.zeros(4), length=5
        )
        assert jnp.allclose(got[0], h_T) and jnp.allclose(got[1], hs), method
    assert jnp.allclose(h_T, 2 - 2.0**-4)
    for method in METHODS:  # T = 0: the carry as it was
        a = b = jnp.zeros((0, 3))
        h_T, hs = eqxscan.diagonal_scan(a, b, jnp.ones(3), method=method)
        assert hs.shape == (0, 3) and jnp.array_equal(h_T, jnp.ones(3)), method


def test_a_key_for_gates_that_take_none_is_named(getkey):
    cell = eqxscan.MinGRU(3, 4, key=getkey())
    with pytest.raises(TypeError, match=r"MinGRU.gates\(x_t\) takes no `key`"):
        eqxscan.Recurrent(cell)(jnp.zeros(4), jnp.ones((5, 3)), key=getkey())


def test_a_masked_steps_read_out_is_the_same_in_every_form(getkey):
    # docs/recurrent.md: the carried state read out by the first kept input.
    cell = TinyGLA(jr.normal(getkey(), (24, 5)))
    xs, s0 = jr.normal(getkey(), (6, 5)), jr.normal(getkey(), (2, 3, 3))
    mask = jnp.array([False, True, True, False, True, True])
    s = cell(xs[2], cell(xs[1], s0))  # steps 1 and 2; step 0 is skipped
    for method in ("sequential", "chunked"):
        _, os = eqxscan.Recurrent(cell, method=method, chunk_size=4)(s0, xs, mask=mask)
        assert rel(os[3], cell.output(s, xs[1])) <= 1e-5, method
        assert rel(os[0], cell.output(s0, xs[1])) <= 1e-5, method


def test_an_integer_carry_is_refused_not_rounded(getkey):
    # Each step cast back to the carry's int dtype gave all-zero states.
    xs = jr.normal(getkey(), (6, 3))
    zeros = jnp.zeros(4, jnp.int32)
    cell = eqxscan.MinGRU(3, 4, key=getkey())
    for method in (*METHODS, "auto"):
        with pytest.raises(
            TypeError, match=r"(?s)MinGRU.gates updates a carry of int32.*floats"
        ):
            eqxscan.Recurrent(cell, method=method)(zeros, xs)
    with pytest.raises(TypeError, match="carry of int32"):
        cell(xs[0], zeros)  # one decoding step
    a, b = jnp.full((6, 4), 0.5), jnp.ones((6, 4))
    for method in METHODS:
        with pytest.raises(
            TypeError, match="diagonal_scan's a updates a carry of int32"
        ):
            eqxscan.diagonal_scan(a, b, zeros, method=method)
    gla = eqxscan.GatedLinearAttention(
        3, num_heads=1, key_size=2, value_size=2, gate_rank=2, key=getkey()
    )
    for method in ("sequential", "chunked"):  # as a user runs it: no annotations
        with (
            untyped(),
            pytest.raises(
                TypeError, match="GatedLinearAttention.gates updates a carry of"
            ),
        ):
            eqxscan.Recurrent(gla, method=method)(jnp.zeros((1, 2, 2), int), xs)


def test_diagonal_scan_names_a_bad_method_shape_or_chunk():
    T, H = 7, 3
    a, b, h0 = jnp.full((T, H), 0.5), jnp.ones((T, H)), jnp.zeros(H)
    scan = eqxscan.diagonal_scan
    for method in ("auto", "parallel", "sequentail"):  # each ran as "chunked"
        with untyped(), pytest.raises(ValueError, match="method must be one of"):
            scan(a, b, h0, method=method)
    with pytest.raises(
        ValueError, match=r"(?s)a has shape \(3,\).*\[T, 3\].*step axis"
    ):
        scan(a[0], b[0], h0, method="associative")  # was scanned over features
    with pytest.raises(ValueError, match=r"(?s)shape \(1,\).*one step of a and b"):
        scan(a, b, jnp.zeros(1), method="associative")  # was broadcast to (3,)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        scan(a, b, h0, method="chunked", chunk_size=0)
    with pytest.raises(ValueError, match=r"different numbers of steps, \[3, 7\]"):
        scan(a, b[:3], h0, method="chunked")
    # A gate broadcast over the carry's axes stays allowed, in every form (a
    # broadcast `b` failed inside JAX in the parallel ones); NumPy's str too.
    want = scan(a, b, h0, method="sequential")[0]
    for method in METHODS:
        for a_, b_ in ((a[:, :1], b), (a, b[:, :1])):
            h_T, _ = scan(a_, b_, h0, method=np.str_(method))
            np.testing.assert_allclose(h_T, want, rtol=1e-6)


class Clipped(eqxscan.DiagonalLinearCell):
    # A step of its own around the recurrence its gates describe.
    cell: eqxscan.MinGRU

    def gates(self, x):
        return self.cell.gates(x)

    def __call__(self, x, h):
        return jnp.clip(super().__call__(x, h), -0.1, 0.1)


class ClippedGLA(TinyGLA):
    def __call__(self, x, S):
        return super().__call__(x, S) / (1 + jnp.abs(S).max())


def test_a_cell_that_overrides_its_step_is_run_step_by_step(monkeypatch, getkey):
    # The parallel forms computed the gates' recurrence, not the cell's step.
    cell = Clipped(cells(getkey())["mingru"][0])
    xs, h = jr.normal(getkey(), (12, 3)) * 3, jnp.zeros(6)
    for x in xs:
        h = cell(x, h)
    for method in ("associative", "chunked"):
        with pytest.raises(ValueError, match=r"overrides `__call__`.*\n.*'sequential'"):
            eqxscan.Recurrent(cell, method=method)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # "auto": parallel
    h_T, _ = eqxscan.Recurrent(cell, chunk_size=4)(jnp.zeros(6), xs)
    np.testing.assert_allclose(h_T, h, rtol=1e-6)
    gla = ClippedGLA(jr.normal(getkey(), (24, 5)))
    xs, S = jr.normal(getkey(), (9, 5)), jr.normal(getkey(), (2, 3, 3))
    s_T, _ = eqxscan.Recurrent(gla, chunk_size=4)(S, xs)
    for x in xs:
        S = gla(x, S)
    np.testing.assert_allclose(s_T, S, rtol=1e-5, atol=1e-6)


class StackedGates(eqxscan.DiagonalLinearCell):
    def gates(self, x):
        return jnp.stack([jnp.full_like(x, 0.5), x])  # not a tuple


@pytest.mark.parametrize("method", ["sequential", "associative"])
def test_gates_stacked_in_one_array_are_refused(method):
    # Unpacked along time by the parallel forms: other values at T=2.
    rnn = eqxscan.Recurrent(StackedGates(), method=method)
    with pytest.raises(
        TypeError,
        match=r"StackedGates\.gates returned an array of shape \[2, 3\], where a "
        r"tuple \(a_t, b_t\) was expected",
    ):
        rnn(jnp.ones(3), jnp.ones((2, 3)))


def test_gates_of_another_structure_than_the_carry_are_named():
    # A dict `a` for an array carry failed in `astype` ('dict' object has no
    # attribute), a list for a tuple printed the whole array.
    h0, a = jnp.ones(3), jnp.full((4, 3), 0.5)
    with pytest.raises(ValueError, match=r"diagonal_scan: a has structure .*h0"):
        eqxscan.diagonal_scan({"a": a}, a, h0, method="sequential")
    with pytest.raises(ValueError, match=r"diagonal_scan: b has structure"):
        eqxscan.diagonal_scan((a, a), [a, a], (h0, h0), method="associative")


class Documented(eqxscan.MinGRU):
    parallel_safe = True  # the step is the gates' own

    def __call__(self, x, h):
        """A step with a docstring of its own."""
        return super().__call__(x, h)


def test_an_override_that_keeps_the_step_may_say_so():
    cell = Documented(3, 6, key=jr.key(0))
    xs = jr.normal(jr.key(1), (12, 3))
    plain = eqxscan.MinGRU(3, 6, key=jr.key(0))
    for method in ("associative", "chunked"):
        h_T, hs = eqxscan.Recurrent(cell, method=method, chunk_size=4)(jnp.zeros(6), xs)
        want = eqxscan.Recurrent(plain, method=method, chunk_size=4)(jnp.zeros(6), xs)
        np.testing.assert_array_equal(hs, want[1])
