"""The engine's LayerDrop skip (`run(..., runs=...)`): a step runs only where its
run bit is set. Every form (the whole-scan skip, the per-step skip inside a
named or nested remat, the loop, the plain-`cond` fallback for integer
carries) against a hand-written loop, in values and gradients (carry, scanned
inputs, closed-over values), and against finite differences."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan
from eqxscan._scan.engine import run
from eqxscan._scan.scan_remat import ScanRemat

from .helpers import run_script, sub_jaxprs


L, B, D = 5, 3, 4
KEEP = jnp.array([True, False, True, True, False])


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k[0], (L, D, D)) * 0.5
    b = jax.random.normal(k[1], (L, D))
    x = jax.random.normal(k[2], (B, D))
    scale = jnp.float32(0.7)  # closed over by the step: a const of its jaxpr
    return w, b, x, scale


def _layer(w, b, h, scale):
    new = h + scale * jnp.tanh(h @ w + b[None])
    return new, jnp.sum(new, axis=-1)  # a per-step output too


def _reference(w, b, x, scale, runs, reverse=False):
    ys = [None] * L
    order = range(L - 1, -1, -1) if reverse else range(L)
    for i in order:
        new, y = _layer(w[i], b[i], x, scale)
        x = jnp.where(runs[i], new, x)
        ys[i] = jnp.where(runs[i], y, jnp.zeros_like(y))
    return x, jnp.stack(ys)


def _engine(w, b, x, scale, runs, options, reverse=False):
    def step(h, inputs):
        w_i, b_i = inputs
        return _layer(w_i, b_i, h, scale)

    return run(step, x, (w, b), length=L, options=options, reverse=reverse, runs=runs)


def _loss(fn):
    def loss(w, b, x, scale):
        carry, ys = fn(w, b, x, scale)
        return jnp.sum(carry**2) + jnp.sum(jnp.sin(ys))

    return loss


REMATS = [
    False,
    True,
    "auto",
    "nested",
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    ScanRemat(save_carries=True),
]


# Every remat form in the scan (the whole-scan skip for plain values and
# policies, the per-step skip for named and nested ones); the loop and reverse
# order with one form of each kind.
CASES = [(c, "scan", False) for c in REMATS] + [
    (c, m, r) for c in (False, "nested") for m, r in (("loop", False), ("scan", True))
]


@pytest.mark.parametrize("remat, mode, reverse", CASES)
def test_skip_matches_a_hand_written_loop(remat, mode, reverse):
    options = eqxscan.ScanOptions(mode=mode, remat=remat, unroll=1)
    w, b, x, scale = _inputs()

    def got(w, b, x, scale):
        return _engine(w, b, x, scale, KEEP, options, reverse)

    def want(w, b, x, scale):
        return _reference(w, b, x, scale, KEEP, reverse)

    out, ref = jax.jit(got)(w, b, x, scale), want(w, b, x, scale)
    for a, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)
    grads = jax.jit(jax.grad(_loss(got), argnums=(0, 1, 2, 3)))(w, b, x, scale)
    ref_grads = jax.grad(_loss(want), argnums=(0, 1, 2, 3))(w, b, x, scale)
    for a, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6)
    # Skipped layers get exactly zero weight gradients.
    assert not np.any(grads[0][~np.asarray(KEEP)])
    assert np.all(np.any(grads[0][np.asarray(KEEP)] != 0, axis=(1, 2)))


@pytest.mark.parametrize("unroll", [2, True])
def test_skip_unrolled(unroll):
    options = eqxscan.ScanOptions(remat=False, unroll=unroll)
    w, b, x, scale = _inputs()
    got = jax.grad(_loss(lambda *a: _engine(*a, KEEP, options)), argnums=(0, 2))
    want = jax.grad(_loss(lambda *a: _reference(*a, KEEP)), argnums=(0, 2))
    for a, r in zip(got(w, b, x, scale), want(w, b, x, scale), strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6)


def test_skip_against_finite_differences():
    options = eqxscan.ScanOptions(remat="auto")
    w, b, x, scale = _inputs()
    loss = jax.jit(_loss(lambda *a: _engine(*a, KEEP, options)))
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(w, b, x, scale)
    args = [w, b, x, scale]
    for n, (arg, grad) in enumerate(zip(args, grads)):
        direction = jax.random.normal(jax.random.key(n), jnp.shape(arg))
        eps = 1e-2

        def at(t, n=n, direction=direction):
            moved = list(args)
            moved[n] = args[n] + t * direction
            return loss(*moved)

        numeric = (at(eps) - at(-eps)) / (2 * eps)
        analytic = jnp.sum(grad * direction)
        np.testing.assert_allclose(analytic, numeric, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("remat, computed", [(False, 1), (True, 2)])
def test_skip_saves_or_recomputes_as_remat_says(remat, computed):
    # A running layer of the whole-scan skip keeps its values for the backward
    # pass under `remat=False` (its tanh is computed once) and recomputes them
    # under `remat=True` (twice), as a scan without skips does.
    options = eqxscan.ScanOptions(remat=remat, unroll=1)
    w, b, x, scale = _inputs()
    jaxpr = jax.make_jaxpr(
        jax.grad(_loss(lambda *a: _engine(*a, KEEP, options)), argnums=(0, 2))
    )(w, b, x, scale)

    def count(jaxpr):
        return sum(
            (eqn.primitive.name == "tanh")
            + sum(count(s) for s in sub_jaxprs(eqn.params))
            for eqn in jaxpr.eqns
        )

    assert count(jaxpr.jaxpr) == computed


class Counting(eqx.Module):
    """A carry with an integer leaf: `(x, layers run)`. The whole-scan skip
    needs cotangents for every carry leaf, so this takes the per-step skip and
    its plain-`cond` fallback."""

    w: jax.Array

    def __init__(self, key):
        self.w = jax.random.normal(key, (D, D)) * 0.5

    def __call__(self, carry):
        x, n = carry
        return x + jnp.tanh(x @ self.w), n + 1


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_integer_carry_leaf(mode):
    stack = eqxscan.Stacked(
        Counting, L, key=jax.random.key(0), layer_drop=0.5, mode=mode
    )
    x = jax.random.normal(jax.random.key(1), (B, D))

    def loss(stack, key):
        out, n = stack((x, jnp.int32(0)), key=key)
        return jnp.sum(out**2), n

    def ref_loss(ws, key):
        drop_keys = jax.random.split(jax.random.fold_in(key, 0x5D0), L)
        h, n = x, 0
        for i in range(L):
            runs = jax.random.bernoulli(jax.random.split(drop_keys[i])[0], 0.5)
            h = jnp.where(runs, h + jnp.tanh(h @ ws[i]), h)
            n = n + runs.astype(jnp.int32)
        return jnp.sum(h**2), n

    runs = set()
    for seed in range(8):
        key = jax.random.key(seed)
        (v, n), g = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(
            stack, key
        )
        (v_ref, n_ref), g_ref = jax.value_and_grad(ref_loss, has_aux=True)(
            stack.layers.w, key
        )
        assert int(n) == int(n_ref)
        runs.add(int(n))
        np.testing.assert_allclose(v, v_ref, rtol=1e-5)
        np.testing.assert_allclose(g.layers.w, g_ref, rtol=1e-4, atol=1e-6)
    assert len(runs) > 1  # the keys ran different numbers of layers


class Tanh(Counting):
    def __call__(self, x):
        return x + jnp.tanh(x @ self.w)


def test_per_example_keys_under_vmap_and_jit_grad():
    # Batched run bits: the `cond`s become selects; values and gradients must
    # still equal the loop's, under jit(grad(vmap(...))).
    stack = eqxscan.Stacked(Tanh, L, key=jax.random.key(0), layer_drop=0.5)
    loop = stack.with_options(mode="loop")
    x = jax.random.normal(jax.random.key(1), (B, D))
    keys = jax.random.split(jax.random.key(2), B)

    def loss(stack):
        def one(row, key):
            return stack(row, key=key)

        return jnp.sum(jax.vmap(one)(x, keys) ** 2)

    got = eqx.filter_jit(eqx.filter_grad(loss))(stack)
    want = eqx.filter_jit(eqx.filter_grad(loss))(loop)
    np.testing.assert_allclose(got.layers.w, want.layers.w, rtol=1e-4, atol=1e-6)
    assert float(jnp.max(jnp.abs(got.layers.w))) > 0


def test_layer_drop_under_fsdp():
    """Sharded (8 devices, FSDP) equals one device for several keys, and a
    layer's weights are gathered only inside the branch that runs it."""
    out = run_script("drop_checks.py", timeout=300)
    assert "ok" in out.split()


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_forward_mode_through_layer_drop_names_it(mode):
    # JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function"
    # named no cause (scan), or came as a shape error with a shape hint (loop).
    # (Under `jit` JAX raises it after the call, where only its message is.)
    make = lambda k: eqx.nn.Linear(4, 4, key=k)  # noqa: E731
    stack = eqxscan.Stacked(make, 3, key=jax.random.key(0), layer_drop=0.5, mode=mode)
    x, key = jnp.ones(4), jax.random.key(1)
    jvp = lambda x: jax.jvp(lambda x: stack(x, key=key), (x,), (x,))  # noqa: E731
    with pytest.raises(
        TypeError, match=r"skips layers \(layer_drop=\).*\nHint: call eqx"
    ):
        jvp(x)
    # As the hint says: inference mode runs every layer, with forward mode.
    full = eqx.nn.inference_mode(stack)
    out, tangent = jax.jvp(lambda x: full(x, key=key), (x,), (x,))
    ref = jax.jvp(lambda x: full.with_options(mode="loop")(x), (x,), (x,))
    np.testing.assert_allclose(tangent, ref[1], rtol=1e-5)


class _WithAux(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        return self.linear(x), jnp.sum(x)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_a_layer_returning_a_pair_is_pointed_to_scan(mode):
    make = lambda k: _WithAux(eqx.nn.Linear(4, 4, key=k))  # noqa: E731
    stack = eqxscan.Stacked(make, 3, key=jax.random.key(0), mode=mode)
    with pytest.raises(
        TypeError, match=r"returning `\(carry, y\)` is run with `\.scan"
    ):
        stack(jnp.ones(4))
    y, aux = stack.scan(jnp.ones(4))  # as the message says
    assert aux.shape == (3,)
