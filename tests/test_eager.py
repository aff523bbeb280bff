"""Eager calls of the scanning modules reuse one compiled program."""

import equinox as eqx
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan


KEY = jax.random.key(0)
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


W = jnp.eye(3) * 0.5  # read by a cell below; rebound by the test


def _by_hand(cell, h, xs):
    for x in xs:
        h = cell(x, h)
    return h


def test_a_cell_reading_state_the_key_cannot_see_is_not_served_stale():
    global W
    xs = jnp.ones((4, 3))
    rnn = eqxscan.Recurrent(lambda x, h: jnp.tanh(W @ h) + x)
    first = rnn(jnp.ones(3), xs)[0]
    W = jnp.eye(3) * 2.0
    try:
        got = rnn(jnp.ones(3), xs)[0]
        want = _by_hand(lambda x, h: jnp.tanh(W @ h) + x, jnp.ones(3), xs)
    finally:
        W = jnp.eye(3) * 0.5
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not np.allclose(got, first)

    class Scaled:  # an object whose attribute may be set between calls
        gain = 1.0

        def __call__(self, x, h):
            return self.gain * jnp.tanh(h + x)

    cell = Scaled()
    rnn = eqxscan.Recurrent(cell)
    rnn(jnp.zeros(3), xs)
    cell.gain = 3.0
    np.testing.assert_allclose(
        rnn(jnp.zeros(3), xs)[0], _by_hand(cell, jnp.zeros(3), xs), rtol=1e-6
    )


SCALE = 1.0  # read by Scaled below; rebound by the test


class ScaledLayer(eqx.Module):
    w: jax.Array
    gain = 1.0  # a class attribute, not a field

    def __call__(self, x):
        return x * self.w * SCALE * self.gain


def test_a_layer_reading_a_global_or_class_attribute_is_keyed_by_its_value():
    global SCALE
    stack = eqxscan.Stacked(lambda k: ScaledLayer(jnp.ones(())), 3, key=KEY)
    x = jnp.float32(1.0)
    count, out = _compiles(lambda: stack(x))
    assert count == 0 and float(out) == 1.0  # unchanged values: one program
    try:
        SCALE = 2.0
        assert float(stack(x)) == 8.0
        ScaledLayer.gain = 0.5
        assert float(stack(x)) == 1.0
    finally:
        SCALE, ScaledLayer.gain = 1.0, 1.0
    assert float(stack(x)) == 1.0


def test_what_code_reads_is_keyed_by_value_or_not_cached():
    from eqxscan._scan.eager_compile import _key

    key = lambda f: _key(f, set())  # noqa: E731
    scale = 2.0
    for code in [jax.nn.relu, jnp.tanh, lambda x: jax.nn.gelu(jnp.tanh(x)) * 2]:
        assert key(code) is not None
    assert (
        key(jax.jit(lambda x: x * scale))
        == key(lambda x: x * scale)
        != key(lambda x: x * 3.0 * SCALE)
    )
    # Arrays, mutable objects and objects of identity cannot be keyed.
    for moving in [
        lambda x: W @ x,  # a global array
        lambda x: (lambda y: W @ y)(x),  # read by a nested function
        np.zeros(3).__add__,  # a method of a mutable object
        object(),
    ]:
        assert key(moving) is None
