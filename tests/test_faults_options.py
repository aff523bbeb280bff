"""Options that change the program but never the values: `unroll` and
`remat` must reach the program of `Recurrent` and `Chain` (a test that
compares values alone would pass if they were dropped)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqxscan


KEY = jax.random.key(0)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def _program(fn, *args):
    """`(unroll of each scan, number of remat regions)` of `grad(sum(fn))`."""
    loss = lambda *a: sum(jnp.sum(y) for y in jax.tree.leaves(fn(*a)))  # noqa: E731
    eqns = list(_eqns(jax.make_jaxpr(jax.grad(loss))(*args).jaxpr))
    scans = [e.params["unroll"] for e in eqns if e.primitive.name == "scan"]
    remats = sum(e.primitive.name in ("checkpoint", "remat", "remat2") for e in eqns)
    return scans, remats


def _recurrent(**options):
    cell = eqxscan.ElmanCell(3, 4, key=KEY)
    rnn = eqxscan.Recurrent(cell, **options)
    return lambda h: rnn(h, jnp.ones((6, 3)))


def _chain(**options):
    layers = [eqx.nn.Linear(4, 4, key=k) for k in jax.random.split(KEY, 3)]
    chain = eqxscan.Chain(layers, **options)
    return lambda x: chain(x)


@pytest.mark.parametrize("build", [_recurrent, _chain])
@pytest.mark.parametrize("unroll", [1, 3])
def test_unroll_reaches_the_scan(build, unroll):
    scans, _ = _program(build(unroll=unroll, remat=False), jnp.zeros(4))
    assert scans and set(scans) == {unroll}, scans


@pytest.mark.parametrize("build", [_recurrent, _chain])
def test_checkpoint_reaches_the_program(build):
    _, without = _program(build(remat=False), jnp.zeros(4))
    _, with_remat = _program(build(remat=True), jnp.zeros(4))
    assert without == 0 and with_remat >= 1, (without, with_remat)
