"""Property tests: random depths, widths, dtypes and pytree carries; generated
bad input to every public entry point."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from hypothesis import given, settings, strategies as st

import eqxscan

from .helpers import run_script, tree_allclose


class PerLeaf(eqx.Module):
    """Updates every leaf of a pytree carry with its own weights."""

    ws: dict

    def __call__(self, carry):
        return jtu.tree_map(
            lambda c, w: jnp.tanh(c * w["a"] + w["b"]).astype(c.dtype), carry, self.ws
        )


carry_shapes = st.sampled_from(
    [
        lambda d: {"x": (d,)},
        lambda d: {"x": (d,), "y": (2, d)},
        lambda d: {"x": (d,), "h": {"c": (1,), "z": (d, 1)}},
    ]
)


@settings(max_examples=8, deadline=None)
@given(
    L=st.integers(1, 6),
    d=st.integers(1, 5),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    shapes=carry_shapes,
    remat=st.sampled_from([False, True, "auto", "nested"]),
    seed=st.integers(0, 2**16),
)
def test_scan_equals_loop_and_python(L, d, dtype, shapes, remat, seed):
    spec = shapes(d)
    is_shape = lambda s: isinstance(s, tuple)  # noqa: E731

    def make(key):
        keys = iter(jr.split(key, 64))
        return PerLeaf(
            jtu.tree_map(
                lambda s: {
                    "a": jr.normal(next(keys), s).astype(dtype),
                    "b": jr.normal(next(keys), s).astype(dtype),
                },
                spec,
                is_leaf=is_shape,
            )
        )

    key = jr.key(seed)
    stack = eqxscan.Stacked(make, L, key=key, remat=remat)
    carry = jtu.tree_map(
        lambda s: (
            jnp.linspace(-1, 1, max(1, int(jnp.prod(jnp.array(s)))))
            .reshape(s)
            .astype(dtype)
        ),
        spec,
        is_leaf=is_shape,
    )

    @eqx.filter_jit
    def run(stack, carry):
        loss = lambda c: sum(  # noqa: E731
            jnp.sum(leaf.astype(jnp.float32)) for leaf in jtu.tree_leaves(stack(c))
        )
        return stack(carry), jax.grad(loss)(carry)

    out, grad = run(stack, carry)
    loop_out, loop_grad = run(stack.with_options(mode="loop"), carry)
    expected = carry
    for i, k in enumerate(jr.split(key, L)):
        layer = make(k)
        assert eqx.tree_equal(layer, stack[i])
        expected = layer(expected)
    tol = (
        dict(rtol=1e-5, atol=1e-6)
        if dtype == jnp.float32
        else dict(rtol=0.05, atol=0.05)
    )
    assert tree_allclose(out, loop_out, **tol)
    assert tree_allclose(out, expected, **tol)
    assert tree_allclose(grad, loop_grad, **tol)
    assert jtu.tree_structure(out) == jtu.tree_structure(carry)
    assert all(leaf.dtype == dtype for leaf in jtu.tree_leaves(out))


def test_generated_bad_input_is_refused_clearly_or_works_as_the_loop():
    # In a fresh process, as a user runs it: without the tests' runtime type
    # checks of annotations, which would refuse most of it first.
    found = json.loads(run_script("fault_properties.py", "20", timeout=600))
    assert found["raw"] == {}, json.dumps(found, indent=1)
    tally = found["tally"]
    assert set(tally) == {
        "Stacked",
        "Chain",
        "Recurrent",
        "StackedMLP",
        "save/load",
        "CheckpointManager",
    }
    for entry, counts in tally.items():
        assert counts.get("clear", 0) >= 10, (entry, counts)
        assert set(counts) <= {"clear", "works"}, (entry, counts)
