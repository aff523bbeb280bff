"""Scanned bodies are named for profiles: the ops of a layer carry its class,
a Chain's scanned run its layer range, a Recurrent's step its cell's class."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array

import eqxscan


class MyBlock(eqx.Module):
    w: Array

    def __call__(self, x):
        return jnp.tanh(self.w @ x)


class Other(eqx.Module):
    s: Array

    def __call__(self, x):
        return x * self.s


def op_names(model, *args):
    text = jax.jit(lambda m, *a: m(*a)).lower(model, *args).as_text(debug_info=True)
    return [line for line in text.splitlines() if 'loc("jit(' in line]


def test_stacked_ops_carry_the_layer_class(getkey):
    stack = eqxscan.Stacked(lambda k: MyBlock(jr.normal(k, (4, 4))), 3, key=getkey())
    for model in (stack, stack.with_options(mode="loop")):
        names = op_names(model, jnp.ones(4))
        assert any("/MyBlock/dot_general" in n for n in names)
        assert any("/MyBlock/tanh" in n for n in names)


def test_chain_runs_and_lone_layers_are_named(getkey):
    chain = eqxscan.Chain(
        [MyBlock(jr.normal(getkey(), (4, 4))) for _ in range(3)] + [Other(jnp.ones(4))]
    )
    names = op_names(chain, jnp.ones(4))
    assert any("/layers_0-2/" in n and "/MyBlock/dot_general" in n for n in names)
    assert any("/Other/mul" in n and "layers_" not in n for n in names)


def test_scanned_groups_are_named_in_the_compiled_program(getkey):
    # Twelve layers are scanned, not unrolled: the names go through the loop.
    blocks = [MyBlock(jr.normal(getkey(), (4, 4))) for _ in range(12)]
    chain = eqxscan.Chain([*blocks, Other(jnp.ones(4))], remat=False)
    stack = eqxscan.Stacked.from_layers(blocks)
    for model, head in ((chain, "layers_0-11/"), (stack, "")):
        hlo = jax.jit(lambda m, x: m(x)).lower(model, jnp.ones(4)).compile().as_text()
        assert f"/{head}while/body/closed_call/" in hlo
        assert "/MyBlock/dot_general" in hlo


def test_recurrent_step_carries_the_cell_class(getkey):
    rnn = eqxscan.Recurrent(eqxscan.ElmanCell(3, 4, key=getkey()))
    names = op_names(rnn, jnp.zeros(4), jnp.ones((5, 3)))
    assert any("/ElmanCell/" in n for n in names)
