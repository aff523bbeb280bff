"""LoRA adapters: the product from the stored base and adapters, against
hand-written references."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqxscan.adapters import LoRA


def _lora(getkey, orientation="x@W", m=6, n=5, r=2, k=3, active=1, alpha=4.0):
    base = jr.normal(getkey(), (m, n))
    if orientation == "x@W":
        a, b = jr.normal(getkey(), (k, m, r)), jr.normal(getkey(), (k, r, n))
    else:
        a, b = jr.normal(getkey(), (k, r, n)), jr.normal(getkey(), (k, m, r))
    return LoRA(base, a, b, jnp.asarray(active), alpha, r, orientation, name="w")


@pytest.mark.parametrize("active", [0, 2, -1])
def test_x_at_lora_is_the_low_rank_product(getkey, active):
    lora = _lora(getkey, active=active)
    x = jr.normal(getkey(), (2, 3, 6))  # any leading shape
    expected = x @ lora.base
    if active >= 0:
        expected = expected + 2.0 * (x @ lora.a[active]) @ lora.b[active]
    np.testing.assert_allclose(x @ lora, expected, rtol=1e-5, atol=1e-5)
    # NumPy inputs and a jitted call give the same.
    np.testing.assert_allclose(np.asarray(x) @ lora, expected, rtol=1e-5, atol=1e-5)
    jitted = eqx.filter_jit(lambda lo, x: x @ lo)(lora, x)
    np.testing.assert_allclose(jitted, expected, rtol=1e-5, atol=1e-5)
    assert (lora.shape, lora.dtype, lora.ndim) == ((6, 5), jnp.float32, 2)


@pytest.mark.parametrize("active", [1, -1])
def test_lora_at_x_is_the_mirror(getkey, active):
    lora = _lora(getkey, "W@x", active=active)
    for x in (jr.normal(getkey(), (5,)), jr.normal(getkey(), (4, 5, 2))):
        expected = lora.base @ x
        if active >= 0:
            expected = expected + 2.0 * lora.b[active] @ (lora.a[active] @ x)
        np.testing.assert_allclose(lora @ x, expected, rtol=1e-5, atol=1e-5)


def test_base_alone_ignores_a_non_finite_adapter(getkey):
    lora = _lora(getkey, active=-1)
    lora = eqx.tree_at(lambda lo: lo.a, lora, lora.a.at[0].set(jnp.nan))
    x = jr.normal(getkey(), (6,))
    np.testing.assert_allclose(x @ lora, x @ lora.base, rtol=1e-6)


def test_base_alone_gives_adapters_no_gradient(getkey):
    lora = _lora(getkey, active=-1)
    x = jr.normal(getkey(), (6,))
    grads = eqx.filter_grad(lambda lo: jnp.sum(x @ lo))(lora)
    assert not jnp.any(grads.a) and not jnp.any(grads.b) and jnp.all(grads.base)


def test_a_traced_active_selects_per_row(getkey):
    lora = _lora(getkey)
    xs, ids = jr.normal(getkey(), (4, 6)), jnp.array([0, 2, -1, 1])
    rows = jax.vmap(lambda x, i: x @ eqx.tree_at(lambda lo: lo.active, lora, i))
    expected = [
        x @ lora.base + (2.0 * (x @ lora.a[i]) @ lora.b[i] if i >= 0 else 0)
        for x, i in zip(xs, ids.tolist())
    ]
    np.testing.assert_allclose(rows(xs, ids), jnp.stack(expected), rtol=1e-5)


def test_other_operations_raise(getkey):
    lora = _lora(getkey)
    x = jnp.ones((2, 6))
    for op in (
        lambda: x + lora,
        lambda: lora * 2,
        lambda: lora[0],
        lambda: jnp.asarray(lora),
        lambda: np.asarray(lora),
        lambda: lora.T,
    ):
        with pytest.raises(TypeError, match=r"The LoRA at `w`.*\n.*merge"):
            op()
    # jax.numpy functions refuse it as an operand (never silently use the base).
    for op in (jnp.matmul, jnp.dot, lambda x, w: jnp.einsum("bi,io->bo", x, w)):
        with pytest.raises(TypeError, match="requires ndarray or scalar"):
            op(x, lora)


def test_wrong_use_raises(getkey):
    lora = _lora(getkey)
    with pytest.raises(TypeError, match=r"'x@W' but was used as `lora @ x`"):
        lora @ jnp.ones(5)
    with pytest.raises(TypeError, match=r"got x of shape \(2, 5\).*size 6"):
        jnp.ones((2, 5)) @ lora
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), lora)
    with pytest.raises(TypeError, match=r"base float32\[2,6,5\] with 1 layer axes"):
        jnp.ones(6) @ stacked
