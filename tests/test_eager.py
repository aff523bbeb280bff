"""Eager calls of the scanning modules reuse one compiled program."""

import equinox as eqx
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan


_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, _secs, **_kw: (
        _COMPILES.append(name)
        if name == "/jax/core/compile/backend_compile_duration"
        else None
    )
)


def _compiles(fn, times=4):
    fn()  # the first call may compile
    _COMPILES.clear()
    outs = [fn() for _ in range(times)]
    jax.block_until_ready(outs)
    return len(_COMPILES), outs[-1]


def _models():
    key = jax.random.key(0)
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(8, 8, key=k), 12, key=key)
    chain = eqxscan.Chain(
        [eqx.nn.Linear(8, 8, key=k) for k in jax.random.split(key, 3)]
        + [eqx.nn.Lambda(jnp.tanh)]
    )
    rnn = eqxscan.Recurrent(eqx.nn.GRUCell(8, 8, key=key))
    mlp = eqxscan.StackedMLP(8, 12, key=key)
    x, xs = jnp.linspace(-1, 1, 8), jnp.ones((20, 8))
    return {
        "Stacked": (stack, lambda m: m(x)),
        "Chain": (chain, lambda m: m(x)),
        "Recurrent": (rnn, lambda m: m(jnp.zeros(8), xs)),
        "StackedMLP": (mlp, lambda m: m(x)),
    }


@pytest.mark.parametrize("name", ["Stacked", "Chain", "Recurrent", "StackedMLP"])
def test_eager_calls_compile_once(name):
    model, call = _models()[name]
    count, out = _compiles(lambda: call(model))
    assert count == 0
    # Same values as the loop (which runs eagerly, as written).
    ref = call(model.with_options(mode="loop"))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_other_values_compile_nothing_and_loop_stays_eager():
    stack = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(8, 8, key=k), 4, key=jax.random.key(0)
    )
    stack(jnp.ones(8))
    other = jnp.asarray(np.full(8, 2.0, np.float32))
    jax.block_until_ready(other)
    _COMPILES.clear()
    stack(other)  # same structure, other values: nothing to compile
    assert _COMPILES == []
    calls = []

    class Counted(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x):
            calls.append(1)
            return self.linear(x)

    loop = eqxscan.Stacked(
        lambda k: Counted(eqx.nn.Linear(8, 8, key=k)),
        3,
        key=jax.random.key(1),
        mode="loop",
    )
    loop(jnp.ones(8))
    loop(jnp.ones(8))
    # The debugging path runs each layer's Python at every call.
    assert len(calls) == 6


def test_values_equal_across_types_are_checked_again():
    # True == 1 under hashing: a refused value must not reuse an accepted one's
    # program.
    rnn = eqxscan.Recurrent(eqx.nn.GRUCell(2, 3, key=jax.random.key(0)))
    h0, xs = jnp.zeros(3), jnp.ones((4, 2))
    rnn(h0, xs, truncate=1)
    with pytest.raises(TypeError, match="truncate"):
        rnn(h0, xs, truncate=True)


def test_numpy_scalar_options_are_read_as_python_values():
    # Options given as NumPy scalars act as in the loop, not traced into the
    # program (where an integer or a bool option cannot be read).
    models = _models()
    rnn, stack = models["Recurrent"][0], models["Stacked"][0]
    h0, xs = jnp.zeros(8), jnp.linspace(-1, 1, 40).reshape(5, 8)
    for model, call, option in (
        (rnn, lambda m, **o: m(h0, xs, **o), dict(truncate=2, length=5)),
        (stack, lambda m, **o: m(xs[0], **o), dict(reverse=True)),
    ):
        ours = call(model, **{k: np.asarray(v)[()] for k, v in option.items()})
        ref = call(model.with_options(mode="loop"), **option)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
