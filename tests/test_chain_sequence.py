"""A Chain is a sequence: length, indexing, slicing and iteration."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqxscan

from .helpers import (
    Block,
    D,
    tree_allclose,
)


# ---- Chain is a sequence


def test_chain_is_a_sequence(getkey):
    lin = lambda: eqx.nn.Linear(D, D, key=getkey())
    layers = [
        lin(),
        Block(getkey()),
        lin(),
        Block(getkey()),
        lin(),
        Block(getkey()),
        eqx.nn.Linear(D, D, use_bias=False, key=getkey()),
    ]
    chain = eqxscan.Chain(layers)
    seq = eqx.nn.Sequential(layers)
    assert len(chain) == len(seq) == 7
    for i in range(-7, 7):
        assert tree_allclose(chain[i], seq[i]), i
    assert all(tree_allclose(a, b) for a, b in zip(chain, layers, strict=True))
    x = jr.normal(getkey(), (D,))
    for sl in (
        slice(1, 5),
        slice(None, None, 2),
        slice(-3, None),
        slice(None, None, -1),
    ):
        part = chain[sl]
        assert isinstance(part, eqxscan.Chain) and len(part) == len(layers[sl])
        assert jnp.allclose(part(x), seq[sl](x), atol=1e-5)
    with pytest.raises(
        IndexError, match="Layer index 7 is out of range for a Chain with 7 layers"
    ):
        chain[7]
    with pytest.raises(ValueError, match="selects no layers"):
        chain[3:3]
