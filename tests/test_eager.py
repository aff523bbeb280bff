"""Eager calls of the scanning modules reuse one compiled program."""

import dataclasses
import enum
import functools
import logging
import sys
import types
import typing
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxscan

from .helpers import compiles


KEY = jax.random.key(0)


def _compiles(fn, times=4):
    fn()  # the first call may compile
    outs: list = []
    return compiles(lambda: outs.extend(fn() for _ in range(times)) or outs), outs[-1]


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
    # Same structure, other values: nothing to compile.
    assert compiles(lambda: stack(other)) == 0
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

    key = lambda f: _key(f, {})  # noqa: E731
    scale = 2.0
    for code in [jax.nn.relu, jnp.tanh, lambda x: jax.nn.gelu(jnp.tanh(x)) * 2]:
        assert key(code) is not None
    scaled = lambda x: x * scale  # noqa: E731
    assert key(jax.jit(scaled)) == key(scaled) != key(lambda x: x * 3.0 * SCALE)
    # A JAX array (immutable) is keyed by identity: another array, another key.
    global W
    reads_w = [lambda x: W @ x, lambda x: (lambda y: W @ y)(x)]  # nested too
    before = [key(f) for f in reads_w]
    assert None not in before and before == [key(f) for f in reads_w]
    old = W
    try:
        W = jnp.eye(3) * 0.5  # equal values, another array
        assert all(key(f) != k for f, k in zip(reads_w, before))
    finally:
        W = old
    # NumPy arrays, mutable objects and objects of identity cannot be keyed.
    for moving in [
        lambda x: W_NP @ x,  # a global NumPy array (its values may be set)
        np.zeros(3).__add__,  # a method of a mutable object
        object(),
    ]:
        assert key(moving) is None


W_NP = np.eye(3)


# ---- what else the code run reads (each was served a stale program)

SIGN = 0.0  # read by a layer below; rebound by the test


def act(x):  # redefined by the test, as a notebook cell run again would
    return x * 2.0


class WithFn(eqx.Module):
    w: jax.Array
    fn: Callable = eqx.field(static=True)

    def __call__(self, x):
        return self.fn(x * self.w)


def _stack_of(fn):
    return eqxscan.Stacked(lambda k: WithFn(jnp.ones(()), fn), 2, key=KEY)


def test_what_static_fields_modules_and_redefined_functions_read_is_keyed():
    global SCALE, SIGN, act
    x = jnp.float32(1.0)
    # A static function field that reads a global; a partial around one.
    scaled = lambda x: x * SCALE  # noqa: E731
    for fn in (scaled, functools.partial(lambda x, k: scaled(x) * k, k=1)):
        stack = _stack_of(fn)
        assert float(stack(x)) == 1.0
        try:
            SCALE = 3.0
            assert float(stack(x)) == 9.0 == float(stack.with_options(mode="loop")(x))
        finally:
            SCALE = 1.0
    # A global function defined anew (its code), and its defaults changed.
    stack = _stack_of(lambda x: act(x))
    old = act
    assert float(stack(x)) == 4.0
    try:
        exec("def act(x):\n    return x * 3.0", globals())
        assert float(stack(x)) == 9.0
    finally:
        act = old
    stack = _stack_of(lambda x, k=2.0: x * k)
    assert float(stack(x)) == 4.0
    stack.layers.fn.__defaults__ = (3.0,)
    assert float(stack(x)) == 9.0
    # An attribute of a module of the user's (a config module).
    cfg = types.ModuleType("user_config")
    cfg.GAIN = 1.0
    globals()["user_config"] = cfg
    try:
        stack = _stack_of(lambda x: x * user_config.GAIN)  # noqa: F821
        assert float(stack(x)) == 1.0
        cfg.GAIN = 5.0
        assert float(stack(x)) == 25.0
    finally:
        del globals()["user_config"]
    # -0.0 is not 0.0 (its sign reaches the output).
    stack = _stack_of(lambda x: jnp.copysign(x, SIGN))
    assert float(stack(x)) == 1.0
    try:
        SIGN = -0.0
        assert float(stack(x)) == -1.0
    finally:
        SIGN = 0.0


def test_a_module_of_the_users_read_whole_or_imported_is_never_stale():
    # Which attributes `getattr(cfg, name)`, a module in a closure or a module
    # imported in the body reads is not known: such calls run uncached.
    cfg = types.ModuleType("user_settings")
    cfg.GAIN = 1.0
    x = jnp.float32(1.0)
    sys.modules["user_settings"], globals()["user_settings"] = cfg, cfg
    namespace: dict = {}
    exec(
        "def imported(x):\n    import user_settings\n    return x * user_settings.GAIN",
        namespace,
    )
    try:
        for fn in (
            lambda x: x * getattr(user_settings, "GAIN"),  # noqa: B009, F821
            lambda x: x * getattr(cfg, "GAIN"),  # noqa: B009
            namespace["imported"],
        ):
            stack = _stack_of(fn)
            for gain in (1.0, 3.0):
                cfg.GAIN = gain
                assert float(stack(x)) == gain**2
                assert float(stack.with_options(mode="loop")(x)) == gain**2
    finally:
        del sys.modules["user_settings"], globals()["user_settings"]


def test_keys_of_numbers_and_unhashable_frozen_values():
    from eqxscan._scan.eager_compile import _key

    key = lambda f: _key(f, {})  # noqa: E731
    assert key(np.float32(1.0)) != key(np.float64(1.0))
    assert key(0.0) != key(-0.0) and key(float("nan")) == key(float("nan"))

    @dataclasses.dataclass(frozen=True)
    class Config:
        sizes: list  # frozen, but its hash fails

    assert key(Config([1, 2])) is None  # not cached, rather than a crash


CONFIG = None  # a frozen dataclass holding a list, read by a layer


def test_an_unhashable_global_runs_uncached():
    global CONFIG
    CONFIG = _Sizes([2.0])
    try:
        stack = _stack_of(lambda x: x * CONFIG.sizes[0])
        assert float(stack(jnp.float32(1.0))) == 4.0
    finally:
        CONFIG = None


@dataclasses.dataclass(frozen=True)
class _Sizes:
    sizes: list


STEP = 0  # changed at every call, as a step counter would be


def test_a_value_changing_at_every_call_stops_the_cache_with_a_warning():
    global STEP
    from eqxscan._scan.eager_compile import MAX_PROGRAMS

    stack = _stack_of(lambda x: x + STEP)
    try:
        for STEP in range(MAX_PROGRAMS):  # a program each
            assert float(stack(jnp.float32(0.0))) == 2 * STEP
        STEP = MAX_PROGRAMS
        with pytest.warns(UserWarning, match=r"(?s)compiled a program.*\nHint: pass"):
            assert float(stack(jnp.float32(0.0))) == 2 * STEP
        for STEP in range(MAX_PROGRAMS + 1, MAX_PROGRAMS + 4):  # uncached, right
            assert float(stack(jnp.float32(0.0))) == 2 * STEP
    finally:
        STEP = 0


def test_a_function_argument_is_keyed_by_its_code_not_its_identity(caplog):
    stack = eqxscan.Stacked(lambda k: Twice(jnp.ones(2)), 12, key=KEY)
    x = jnp.ones(2)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        outs = [stack(x, method=lambda layer, x: layer.twice(x)) for _ in range(3)]
    compiled = [m for m in caplog.messages if m.startswith("Compiling jit(")]
    shaped = [m for m in compiled if "float32[12,2]" in m]
    assert len(shaped) == 1, shaped  # the same lambda at each call: one program
    np.testing.assert_allclose(outs[-1], x * 2**12)


class Twice(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x * self.w

    def twice(self, x):
        return 2 * x * self.w


@dataclasses.dataclass(frozen=True)
class _Act:
    f: Callable


class _Signed(eqx.Module):
    w: jax.Array
    s: float = eqx.field(static=True)

    def __call__(self, x, scale=1.0):
        return jnp.copysign(x * self.w, self.s) * scale


def test_functions_inside_values_and_structures_are_keyed():
    global SCALE
    x = jnp.float32(1.0)
    scaled = lambda x: x * SCALE  # noqa: E731
    # Inside a Module or a frozen dataclass held by a static field, or a
    # jax.tree_util.Partial passed as the method.
    stacks = [_stack_of(eqx.nn.Lambda(scaled)), _stack_of(_Act(scaled).f)]
    partial = jtu.Partial(lambda layer, x: scaled(layer(x)))
    try:
        for i, scale in enumerate((1.0, 3.0)):
            SCALE = scale
            for stack in stacks:
                assert float(stack(x)) == scale**2, (i, stack)
            assert float(stacks[0](x, method=partial)) == scale**4  # 2 layers
    finally:
        SCALE = 1.0
    # Static values that compare equal but differ: -0.0 and 0.0, 1 and 1.0.
    one = jnp.ones(())
    signs = [
        eqxscan.Stacked(layers=_Signed(one[None], s), num_layers=1) for s in (0.0, -0.0)
    ]
    assert [float(s(x)) for s in signs] == [1.0, -1.0]


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


class _Bounded(eqx.Module):
    w: jax.Array

    def __call__(self, x, scale=1.0):
        y = x * self.w * scale
        return eqx.error_if(y, y > 1e6, "too large")


def test_a_static_argument_that_varies_is_capped_and_holds_no_programs(monkeypatch):
    from eqxscan._scan import eager_compile

    monkeypatch.setattr(eager_compile, "MAX_VALUES", 4)
    stack = eqxscan.Stacked(lambda k: _Bounded(jnp.ones(())), 2, key=KEY)
    one = jnp.float32(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a program per value, as jit's own
        for i in range(4):
            assert float(stack(one, scale=float(i))) == i**2
        assert compiles(lambda: stack(one, scale=3.0)) == 0  # a value come back
        # Past the cap: warned (the warning, raised as an error here, was
        # swallowed by the cache's own error handling, and never shown).
        with pytest.raises(
            UserWarning, match=r"(?s)arguments that are not arrays.*Hint"
        ):
            stack(one, scale=100.0)
        assert float(stack(one, scale=100.0)) == 1e4  # warned once
        # Compiled alone, through Equinox's jit: its runtime errors as its own
        # (a plain `jax.jit` raised JAX's, with Equinox's note on filter_jit).
        with pytest.raises(eqx.EquinoxRuntimeError, match="too large"):
            stack(one, scale=1e4)
    # Each such program is freed: kept, each held memory maps, and thousands
    # of calls crashed the process.
    if sys.platform != "linux":
        return
    before = _maps()
    for i in range(60):
        assert float(stack(one, scale=i + 0.5)) == (i + 0.5) ** 2
    assert _maps() - before < 200, (before, _maps())


@pytest.mark.parametrize("kind", ["scan", "layer_drop", "nested", "Recurrent"])
def test_an_eager_gradient_or_vmap_reuses_one_program(kind):
    # Un-jitted `grad`/`vmap` (tracers, no staging trace) ran the scan as a
    # program of its own at every call, each kept by JAX: about 50 memory maps
    # a call (100 with LayerDrop), until the process crashed.
    x = jnp.linspace(-1, 1, 8)
    if kind == "Recurrent":
        model = eqxscan.Recurrent(eqx.nn.GRUCell(8, 8, key=KEY))
        call = lambda m, x, k: m(x, jnp.stack([x] * 6))  # noqa: E731
    else:
        options = {"layer_drop": 0.5} if kind == "layer_drop" else {}
        options |= {"remat": "nested"} if kind == "nested" else {}
        make = lambda k: eqx.nn.Linear(8, 8, key=k)  # noqa: E731
        model = eqxscan.Stacked(make, 32, key=KEY, unroll=1, **options)
        call = lambda m, x, k: m(x, key=k if kind == "layer_drop" else None)  # noqa: E731
    squares = lambda t: sum(jnp.sum(a**2) for a in jax.tree.leaves(t))  # noqa: E731
    grad = eqx.filter_grad(lambda m, x, k: squares(call(m, x, k)))
    batched = jax.vmap(lambda x: call(model, x, KEY))
    keys = list(jax.random.split(KEY, 5))  # sliced here, not while counting
    grad(model, x, keys[0]), batched(jnp.stack([x, -x]))
    count = compiles(
        lambda: [grad(model, x, k) for k in keys[1:]] + [batched(jnp.stack([x, x]))]
    )
    assert count == 0
    # The same gradient as the loop's, run as written.
    loop = model.with_options(mode="loop")
    for a, b in zip(
        jax.tree.leaves(grad(model, x, keys[2])),
        jax.tree.leaves(grad(loop, x, keys[2])),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


ACT = jax.nn.relu  # rebound by the test to another library function


@dataclasses.dataclass(unsafe_hash=True)
class _MutableConfig:  # hashable, but its fields may be set
    scale: float


CFG = _MutableConfig(1.0)


class _BadEq:  # an object whose comparison fails
    def __eq__(self, other):
        raise RuntimeError("no comparing")

    def __hash__(self):
        return 0


def test_library_functions_mutable_hashables_and_bad_objects():
    global ACT
    x = jnp.linspace(-1.0, 1.0, 4)
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 12, key=KEY)
    loop = stack.with_options(mode="loop")
    # A library function is keyed by identity: relu then tanh.
    try:
        for act in (jax.nn.relu, jnp.tanh):
            ACT = act
            method = lambda layer, h: ACT(layer(h))  # noqa: E731, B023
            np.testing.assert_allclose(
                stack(x, method=method), loop(x, method=method), rtol=1e-6
            )
    finally:
        ACT = jax.nn.relu
    # A hashable object whose fields may be set: not cached, never stale.
    method = lambda layer, h: layer(h) * CFG.scale  # noqa: E731
    try:
        for scale in (1.0, 0.5):
            CFG.scale = scale
            np.testing.assert_allclose(
                stack(x, method=method), loop(x, method=method), rtol=1e-6
            )
    finally:
        CFG.scale = 1.0
    # An object whose comparison raises: run uncached, not a crash.
    bad = _BadEq()
    method = lambda layer, h: layer(h) + 0 * hash(bad)  # noqa: E731
    for _ in range(2):
        np.testing.assert_allclose(stack(x, method=method), loop(x), rtol=1e-6)


def test_a_method_argument_reading_a_changing_global_is_capped():
    global STEP
    from eqxscan._scan.eager_compile import MAX_PROGRAMS

    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 12, key=KEY)
    x = jnp.ones(4)
    method = lambda layer, h: layer(h) + STEP  # noqa: E731
    try:
        with pytest.warns(UserWarning, match="compiled a program") as record:
            for STEP in range(MAX_PROGRAMS + 3):  # noqa: B007  (read by `method`)
                stack(x, method=method)
        assert len([w for w in record if "compiled a program" in str(w.message)]) == 1
    finally:
        STEP = 0


class _Dunder(eqx.Module):
    w: jax.Array

    def __matmul__(self, x):  # a special method reading a global
        return SCALE * (x @ self.w)

    def __call__(self, x):
        return x + (self @ x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _PytreeLayer:  # a layer that is a registered dataclass, not a Module
    w: jax.Array

    def __call__(self, x):
        return x + SCALE * (x @ self.w)


class _Pair(typing.NamedTuple):
    x: jax.Array
    y: jax.Array = jnp.zeros(())


def test_special_methods_and_pytree_layers_are_keyed():
    # Both were served the program of the old global.
    global SCALE
    x = jnp.ones(4)
    for cls in (_Dunder, _PytreeLayer):
        layers = [cls(jnp.eye(4) * 0.1 * (i + 1)) for i in range(3)]
        for model in (eqxscan.Chain(layers), eqxscan.Stacked.from_layers(layers)):
            try:
                for scale in (1.0, 0.0):
                    SCALE = scale
                    want = model.with_options(mode="loop")(x)
                    np.testing.assert_allclose(model(x), want, rtol=1e-6)
            finally:
                SCALE = 1.0
    # A NamedTuple argument (its class holds a dict) is still cached.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=KEY)
    method = lambda layer, h, pair: layer(h) + pair.x  # noqa: E731
    count, _ = _compiles(lambda: stack(x, _Pair(x), method=method))
    assert count == 0


class _Checkpointed(eqx.Module):
    w: jax.Array

    @eqx.filter_checkpoint  # a `__call__` an Equinox transform wraps
    def __call__(self, x):
        return x * self.w * SCALE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Batch:  # an argument class with a list class attribute (not keyable)
    x: jax.Array
    FIELDS = ["x"]


class _Activation(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


class _Reprs(eqx.Module):
    w: jax.Array
    act: _Activation = eqx.field(static=True, default=_Activation.TANH)

    def __repr__(self):  # reads a dict: never run by a call, so not keyed
        return str(_NAMES)

    def __call__(self, x):
        return jnp.tanh(x * self.w) if self.act is _Activation.TANH else x * self.w


_NAMES = {"w": "weight"}


def test_what_the_cache_keys_stays_what_a_call_runs():
    # A wrapped `__call__` was left out of the key (stale); a class attribute
    # that cannot be keyed, a `__repr__` reading a dict and an Enum static
    # field turned the cache off (a compile at every call).
    global SCALE
    x = jnp.ones(3)
    stack = eqxscan.Stacked(lambda k: _Checkpointed(jnp.ones(3)), 2, key=KEY)
    try:
        for scale in (1.0, 2.0):
            SCALE = scale
            np.testing.assert_allclose(stack(x), stack.with_options(mode="loop")(x))
    finally:
        SCALE = 1.0
    reprs = eqxscan.Stacked(lambda k: _Reprs(jnp.ones(3)), 2, key=KEY)
    method = lambda layer, h, batch: layer(h + batch.x)  # noqa: E731
    for call in (lambda: reprs(x), lambda: reprs(x, _Batch(x), method=method)):
        count, _ = _compiles(call)
        assert count == 0


LOG = logging.getLogger("eqxscan-test-layer")


class _Logging(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        LOG.debug("layer traced")  # at trace time only
        return jnp.tanh(self.w * x)


def test_a_layer_reading_a_logger_reuses_its_program():
    # A logger (a mutable object) made every eager call compile its own program,
    # about 0.3 s each, without a word.
    stack = eqxscan.Stacked(lambda k: _Logging(jax.random.normal(k, ())), 3, key=KEY)
    count, out = _compiles(lambda: stack(jnp.float32(0.5)))
    assert count == 0
    assert float(out) == float(stack.with_options(mode="loop")(jnp.float32(0.5)))


@dataclasses.dataclass
class _Config:  # eq=True: unhashable
    gain: float


class _Configured(eqx.Module):
    w: jax.Array

    def __call__(self, x, cfg):
        return jnp.tanh(self.w * x) * cfg.gain


def test_an_unhashable_argument_runs_compiled_alone():
    stack = eqxscan.Stacked(lambda k: _Configured(jax.random.normal(k, ())), 3, key=KEY)
    x = jnp.float32(0.5)
    loop = stack.with_options(mode="loop")
    for gain in (2.0, 3.0):
        got = stack(x, cfg=_Config(gain))
        np.testing.assert_allclose(got, loop(x, cfg=_Config(gain)), rtol=1e-6)


class _Verbose(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        if LOG.isEnabledFor(logging.DEBUG):  # read at trace time
            x = 2 * x
        return self.w * x


def test_a_loggers_level_joins_the_key():
    stack = eqxscan.Stacked(lambda k: _Verbose(jnp.ones(())), 2, key=KEY)
    level = LOG.level
    try:
        for debug, want in ((False, 1.0), (True, 4.0), (False, 1.0)):
            LOG.setLevel(logging.DEBUG if debug else logging.WARNING)
            assert float(stack(jnp.float32(1.0))) == want
    finally:
        LOG.setLevel(level)


def test_a_cap_warning_points_at_the_callers_line(monkeypatch):
    # Through a public function (`run_until`), the warning pointed into
    # eqxscan's own code, not at the line that called it.
    from eqxscan._scan import eager_compile

    monkeypatch.setattr(eager_compile, "MAX_VALUES", 2)
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(2, 2, key=k), 4, key=KEY)
    never = lambda c: jnp.zeros((), bool)  # noqa: E731
    x = jnp.ones(2)
    for depth in (1, 2):
        eqxscan.run_until(stack, x, never, max_layers=depth)
    with pytest.warns(UserWarning, match="arguments that are not arrays") as record:
        eqxscan.run_until(stack, x, never, max_layers=3)
    assert record[0].filename == __file__
    with pytest.warns(UserWarning, match="arguments that are not arrays") as record:
        for scale in (1.0, 2.0, 3.0):
            stack(x, scale, method=lambda layer, h, s: layer(h) * s)
    assert record[0].filename == __file__
