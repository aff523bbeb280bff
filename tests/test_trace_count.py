"""Each layer (cell) is traced once per trace of the enclosing `jit`, whatever
the options, except `mode="loop"` (a Python loop: once per layer or step)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqxscan


WIDTH = 3
LENGTHS = (4, 16, 64)
REMATS = (None, False, True, "nested", "offload")  # None: the default

calls: dict[str, int] = {}


def _count(name: str) -> None:
    calls[name] = calls.get(name, 0) + 1


class Layer(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, *, key):
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=key)

    def __call__(self, x):
        _count(type(self).__name__)
        return jnp.tanh(self.linear(x))


class Other(Layer):
    """Another class, so that a `Chain` scans its run apart from `Layer`'s."""


def lone(x):
    _count("lone")
    return 2.0 * x


class Cell(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, *, key):
        self.linear = eqx.nn.Linear(2 * WIDTH, WIDTH, key=key)

    def __call__(self, x, h):
        _count("Cell")
        return jnp.tanh(self.linear(jnp.concatenate([x, h])))


def case(kind, length, remat, mode="scan"):
    options = {"mode": mode}
    if remat is not None:
        options["remat"] = remat
    key, x = jr.key(0), jnp.ones(WIDTH)
    if kind == "Stacked":
        model = eqxscan.Stacked(lambda k: Layer(key=k), length, key=key, **options)
        return (lambda m, x: m(x)), model, x
    if kind == "Chain":
        keys, half = jr.split(key, length), length // 2
        layers = [Layer(key=k) for k in keys[:half]]
        layers += [Other(key=k) for k in keys[half:]]
        model = eqxscan.Chain([*layers, eqx.nn.Lambda(lone)], **options)
        return (lambda m, x: m(x)), model, x
    model = eqxscan.Recurrent(Cell(key=key), **options)
    return (lambda m, xs: m(jnp.zeros(WIDTH), xs)[0]), model, jnp.ones((length, 3))


def traced_calls(kind, length, remat, grad, mode="scan"):
    fn, model, x = case(kind, length, remat, mode)
    if grad:
        inner = fn
        fn = eqx.filter_grad(lambda m, x: jnp.sum(inner(m, x)))
    calls.clear()
    eqx.filter_jit(fn).lower(model, x)
    return dict(calls)


def expected(kind, times):
    if kind == "Stacked":
        return {"Layer": times}
    if kind == "Chain":
        return {"Layer": times // 2, "Other": times - times // 2, "lone": 1}
    return {"Cell": times}


@pytest.mark.parametrize("kind", ["Stacked", "Chain", "Recurrent"])
@pytest.mark.parametrize("remat", REMATS)
@pytest.mark.parametrize("grad", [False, True])
def test_each_layer_is_traced_once(kind, remat, grad):
    for length in LENGTHS:
        got = traced_calls(kind, length, remat, grad)
        want = {name: 1 for name in expected(kind, length)}
        assert got == want, (kind, length, remat, grad)


@pytest.mark.parametrize("kind", ["Stacked", "Chain", "Recurrent"])
def test_the_loop_traces_every_layer(kind):
    # The counter itself works: a Python loop calls each layer once.
    for grad in (False, True):
        got = traced_calls(kind, 4, None, grad, mode="loop")
        assert got == expected(kind, 4), (kind, grad)


@pytest.mark.parametrize(
    "options",
    [
        dict(unroll=True),
        dict(unroll=2),
        dict(remat="nested", unroll=True),
        dict(remat=eqxscan.ScanRemat(nested=(2, 2))),
        dict(remat=eqxscan.ScanRemat(save_carries="offload")),
        dict(remat=jax.checkpoint_policies.dots_saveable, unroll=True),
    ],
)
def test_once_with_other_options(options):
    stack = eqxscan.Stacked(lambda k: Layer(key=k), 4, key=jr.key(0), **options)
    x = jnp.ones(WIDTH)
    for fn in (lambda m: m(x), eqx.filter_grad(lambda m: jnp.sum(m(x)))):
        calls.clear()
        eqx.filter_jit(fn).lower(stack)
        assert calls == {"Layer": 1}, options


def test_once_under_vmap_and_with_explain_auto():
    stack = eqxscan.Stacked(lambda k: Layer(key=k), 16, key=jr.key(0))
    xs = jnp.ones((5, WIDTH))
    calls.clear()
    eqx.filter_jit(jax.vmap(lambda x: stack(x))).lower(xs)
    assert calls == {"Layer": 1}
    calls.clear()
    (choice,) = eqxscan.explain_auto(jax.vmap(stack), xs)
    assert calls == {"Layer": 1} and choice.cost.flops > 0


@pytest.mark.parametrize("kind", ["Stacked", "Chain"])
@pytest.mark.parametrize("remat", (None, True, "nested"))
def test_once_while_dropping(kind, remat):
    # LayerDrop's skip (the whole-scan form, the per-step form inside a nested
    # remat, and a Chain's lone layer) and drop-path evaluate the one
    # traced layer; the loop mode still calls each layer once.
    drops = dict(layer_drop=0.5, drop_path=0.2)
    x, key = jnp.ones(WIDTH), jr.key(1)
    for mode, times in (("scan", 1), ("loop", 4)):
        options = {"mode": mode} | ({} if remat is None else {"remat": remat})
        if kind == "Stacked":
            model = eqxscan.Stacked(
                lambda k: Layer(key=k), 4, key=jr.key(0), **drops, **options
            )
            want = {"Layer": times}
        else:
            keys = jr.split(jr.key(0), 4)
            layers = [Layer(key=k) for k in keys[:2]] + [Other(key=k) for k in keys[2:]]
            model = eqxscan.Chain([*layers, eqx.nn.Lambda(lone)], **drops, **options)
            want = {"Layer": min(times, 2), "Other": min(times, 2), "lone": 1}
        for fn in (
            lambda m: m(x, key=key),
            eqx.filter_grad(lambda m: jnp.sum(m(x, key=key))),
        ):
            calls.clear()
            eqx.filter_jit(fn).lower(model)
            assert calls == want, (kind, remat, mode)
