"""Forward mode and higher derivatives through every scan.

`jax.jvp`, `jax.jacfwd` and `jax.hessian` (forward over reverse) must give the
loop's values for every remat option, and agree with finite differences:
scanned models are ordinary JAX functions, with no custom derivative rules that
would block forward mode.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxscan

from .helpers import once_per_values, stable_id, tree_allclose


D, L, T = 4, 6, 7  # more than four layers/steps, so "auto" keeps a scan

OPTIONS = [
    {},
    {"remat": False, "unroll": 1},
    {"remat": True, "unroll": 1},
    {"remat": "nested"},
    {"remat": "offload", "unroll": 1},
    {"remat": jax.checkpoint_policies.dots_saveable, "unroll": 2},
    {"remat": eqxscan.ScanRemat(nested=2, save_inputs=True)},
    {"unroll": True},
]


class Block(eqx.Module):
    lin1: eqx.nn.Linear
    lin2: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2 = jr.split(key)
        self.lin1 = eqx.nn.Linear(D, 2 * D, key=k1)
        self.lin2 = eqx.nn.Linear(2 * D, D, key=k2)

    def __call__(self, x, *, key=None):
        return x + self.lin2(jnp.tanh(self.lin1(x)))


def random_like(params, key):
    leaves, treedef = jtu.tree_flatten(params)
    keys = jr.split(key, len(leaves))
    return jtu.tree_unflatten(
        treedef, [jr.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )


def derivatives(model, f_of_model, x, tangent, reference):
    """In one compiled program: the jvp of `f_of_model(model, x)` in the model's
    arrays along `tangent`, its central difference, its Hessian in `x`, and its
    gradient in the arrays. The `reference` way is reverse mode only: jvp as
    the gradient's inner product with the tangent, Hessian as jacrev(jacrev)."""
    params, static = eqx.partition(model, eqx.is_array)
    f = lambda p, x: f_of_model(eqx.combine(p, static), x)

    @jax.jit
    def run(params, x, tangent):
        if reference:
            grad = jax.grad(f)(params, x)
            dots = jtu.tree_map(jnp.vdot, grad, tangent)
            jvp = sum(jtu.tree_leaves(dots))
            return (
                jvp,
                None,
                jax.jacrev(jax.jacrev(f, argnums=1), argnums=1)(params, x),
                grad,
            )
        jvp = jax.jvp(lambda p: f(p, x), (params,), (tangent,))[1]
        eps = 1e-3
        moved = lambda sign: jtu.tree_map(
            lambda p, t: p + sign * eps * t, params, tangent
        )
        fd = (f(moved(1.0), x) - f(moved(-1.0), x)) / (2 * eps)
        # Forward over reverse (`remat="offload"` cannot be differentiated
        # in reverse twice: docs/remat.md#offload).
        hess = jax.hessian(f, argnums=1)(params, x)
        return jvp, fd, hess, jax.jacfwd(f)(params, x)

    return run(params, x, tangent)


# The reference of every case below (the loop without remat, in reverse mode)
# computed once per model, function and inputs: cases that differ only in the
# options of the model checked share it.
reference_derivatives = once_per_values(derivatives)


def sum_sin(m, x):
    return jnp.sum(jnp.sin(m(x)))


@functools.cache
def masked_loss(truncate):
    mask = jnp.arange(T) < T - 2  # two padded steps

    def f(m, xs):
        h, hs = m(jnp.zeros(3), xs, mask=mask, truncate=truncate)
        return jnp.sum(jnp.sin(hs)) + jnp.sum(h**2)

    return f


def check(model, f_of_model, x, getkey, *, exact=True):
    """The forward-mode derivatives of `model` equal those of its loop without
    remat in reverse mode, and finite differences; its Hessian in `x` is
    symmetric. `exact=False` skips finite differences, for a loss whose
    gradient is truncated on purpose."""
    loop = model.with_options(mode="loop", remat=False, unroll=1)
    tangent = random_like(eqx.filter(model, eqx.is_array), getkey())
    # The same tangent, in the loop's structure (their options differ).
    loop_tangent = jtu.tree_unflatten(
        jtu.tree_structure(eqx.filter(loop, eqx.is_array)), jtu.tree_leaves(tangent)
    )
    jvp, fd, hess, jac = derivatives(model, f_of_model, x, tangent, False)
    jvp_ref, _, hess_ref, grad_ref = reference_derivatives(
        loop, f_of_model, x, loop_tangent, True
    )
    assert np.allclose(jvp, jvp_ref, rtol=1e-4, atol=1e-5), (jvp, jvp_ref)
    if exact:
        assert np.allclose(jvp, fd, rtol=1e-2, atol=1e-3), (jvp, fd)
    assert np.allclose(hess, hess_ref, rtol=1e-4, atol=1e-5)
    flat = jnp.reshape(hess, (x.size, x.size))
    assert np.allclose(flat, flat.T, rtol=1e-4, atol=1e-5)
    assert not np.allclose(flat, 0.0)  # a Hessian that could fail to match
    assert tree_allclose(jtu.tree_leaves(jac), jtu.tree_leaves(grad_ref), rtol=1e-4)


@pytest.mark.parametrize("options", OPTIONS, ids=stable_id)
def test_stacked(options, getkey):
    stack = eqxscan.Stacked(lambda k: Block(key=k), L, key=getkey(), **options)
    check(stack, sum_sin, jr.normal(getkey(), (D,)), getkey)


@pytest.mark.parametrize("options", [OPTIONS[0], OPTIONS[3]], ids=stable_id)
def test_chain(options, getkey):
    # Runs of Blocks around a lone Linear: two scanned groups and a direct call.
    layers = [Block(key=getkey()) for _ in range(5)]
    layers += [eqx.nn.Linear(D, D, key=getkey())]
    layers += [Block(key=getkey()) for _ in range(5)]
    chain = eqxscan.Chain(layers, **options)
    assert sum(isinstance(g, eqxscan.Stacked) for g in chain.groups) == 2
    check(chain, sum_sin, jr.normal(getkey(), (D,)), getkey)


@pytest.mark.parametrize(
    "options, truncate",
    [({}, None), ({}, 3), (OPTIONS[2], None), (OPTIONS[4], 3)],
    ids=stable_id,
)
def test_recurrent_with_mask(options, truncate, getkey):
    rnn = eqxscan.Recurrent(eqx.nn.GRUCell(D, 3, key=getkey()), **options)
    # Truncated BPTT stops the carry's gradient, in forward mode too, which
    # finite differences cannot know.
    f = masked_loss(truncate)
    check(rnn, f, jr.normal(getkey(), (T, D)), getkey, exact=truncate is None)


def test_stacked_mlp_batched(getkey):
    model = eqxscan.StackedMLP(D, L, key=getkey())
    f = lambda m, x: jnp.sum(jnp.sin(jax.vmap(m)(x)))
    check(model, f, jr.normal(getkey(), (2, D)), getkey)
