"""`eqxscan.find_nonfinite`: NaN and inf injected at every layer and time
step, in the forward and in the backward pass, are found where they were put,
by one compiled program."""

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jaxtyping import Array

import eqxscan


D, L = 4, 5


class Block(eqx.Module):
    w: Array
    s: Array  # scales the output: inf here overflows the forward pass
    h: Array  # 0 here: a finite forward whose backward pass is NaN

    def __call__(self, x):
        y = (jnp.tanh(self.w @ x) + x) * self.s
        return y + jnp.sqrt(jnp.sum(x**2) * self.h)


def make(key):
    w = 0.3 * jr.normal(key, (L, D, D))
    return eqxscan.Stacked(layers=Block(w, jnp.ones(L), jnp.ones(L)), num_layers=L)


def loss_fn(model, x, reverse=False):
    return jnp.mean(model(x, reverse=reverse) ** 2)


def injected(stack, field, k, value):
    arr = getattr(stack.layers, field)
    return eqx.tree_at(lambda s: getattr(s.layers, field), stack, arr.at[k].set(value))


def test_clean_step_reports_nothing(getkey):
    report = eqxscan.find_nonfinite(make(getkey()), loss_fn, jnp.ones(D))
    assert not report.found and report.where is None and report.index is None
    assert "No NaN or inf" in str(report)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_every_layer_forward_and_backward(mode, getkey):
    stack = make(getkey()).with_options(mode=mode)
    x = jr.normal(getkey(), (D,))
    for k in range(L):
        r = eqxscan.find_nonfinite(injected(stack, "w", k, jnp.nan), loss_fn, x)
        assert (r.where, r.index, r.leaf) == ("forward", k, "carry"), r
        r = eqxscan.find_nonfinite(injected(stack, "s", k, jnp.inf), loss_fn, x)
        assert (r.where, r.index, r.leaf) == ("forward", k, "carry"), r
        r = eqxscan.find_nonfinite(injected(stack, "h", k, 0.0), loss_fn, x)
        assert (r.where, r.index) == ("backward", k), r
        assert r.leaf in ("carry", "layer.h"), r
        assert f"at layer {k}" in r.message


def test_one_compile_for_any_data(getkey, caplog):
    stack, x = make(getkey()), jr.normal(getkey(), (D,))
    cases = [(injected(stack, "h", k, 0.0), x + k) for k in range(L)]
    cases += [(injected(stack, "w", k, jnp.nan), x) for k in range(L)]
    # A loss of this test's own (its code is part of the program's key), so
    # that no earlier test has compiled it.
    own_loss = lambda m, x: loss_fn(m, x)  # noqa: E731
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        eqxscan.find_nonfinite(stack, own_loss, x)
        for model, inputs in cases:
            assert eqxscan.find_nonfinite(model, own_loss, inputs).found
    # The one program that takes the stacked weights.
    stacked = f"float32[{L},{D},{D}]"
    compiled = [
        m for m in caplog.messages if m.startswith("Compiling") and stacked in m
    ]
    assert len(compiled) == 1, compiled  # one program for every value


class Pair(eqx.Module):
    w: Array
    bad: Array

    def __call__(self, c):
        a, b = c["a"], c["b"]
        return {"a": jnp.tanh(self.w @ a), "b": b * self.bad}


def pair_loss(model, c):
    out = model(c)
    return jnp.sum(out["a"]) + jnp.sum(out["b"])


def test_names_the_carry_leaf_in_a_chain(getkey):
    keys = jr.split(getkey(), 6)
    layers = [Pair(0.3 * jr.normal(k, (D, D)), jnp.ones(())) for k in keys]
    c = {"a": jnp.ones(D), "b": jnp.ones(D)}
    for k in range(6):
        bad = list(layers)
        bad[k] = Pair(bad[k].w, jnp.asarray(jnp.nan))
        r = eqxscan.find_nonfinite(eqxscan.Chain(bad), pair_loss, c)
        assert (r.where, r.index, r.leaf) == ("forward", k, "carry['b']"), r


def test_recurrent_every_time_step(getkey):
    cell = eqxscan.ElmanCell(3, D, key=getkey())
    rnn = eqxscan.Recurrent(cell)
    xs = jr.normal(getkey(), (6, 3))

    def loss(model, h0, xs):
        h, hs = model(h0, xs)
        return jnp.sum(hs**2)

    for t in range(6):
        r = eqxscan.find_nonfinite(rnn, loss, jnp.zeros(D), xs.at[t, 1].set(jnp.nan))
        assert (r.where, r.index) == ("forward", t), r
        assert "time step" in r.message


def test_loss_after_the_container(getkey):
    stack = make(getkey())
    r = eqxscan.find_nonfinite(
        stack, lambda m, x: jnp.log(-jnp.sum(m(x) ** 2)), jnp.ones(D)
    )
    assert r.where == "loss" and r.found


def test_a_whole_model_with_static_fields(getkey):
    # The container inside a model; its layers have non-array fields (dropout).
    model = eqxscan.StackedMLP(8, 4, key=getkey())
    for k in (0, 3):
        w1 = model.blocks.layers.w1.at[k].set(jnp.nan)
        bad = eqx.tree_at(lambda m: m.blocks.layers.w1, model, w1)
        r = eqxscan.find_nonfinite(bad, lambda m, x: jnp.mean(m(x) ** 2), jnp.ones(8))
        assert (r.where, r.index, r.leaf) == ("forward", k, "carry"), r


@jax.custom_vjp
def _poison(x, flag):
    return x


def _poison_fwd(x, flag):
    return x, flag


def _poison_bwd(flag, g):
    # Where `flag` is set, a NaN cotangent for the input; nothing else changes.
    return jnp.where(flag > 0, jnp.nan, g), jnp.zeros_like(flag)


_poison.defvjp(_poison_fwd, _poison_bwd)


def test_a_loss_fn_that_is_no_function_is_refused(getkey):
    stack = make(getkey())
    with pytest.raises(TypeError, match="loss_fn must be callable, got ArrayImpl"):
        # loss_fn forgotten
        eqxscan.find_nonfinite(stack, jnp.ones(D))  # pyright: ignore[reportArgumentType]
    # The function first, as for jax.grad: the stack was called with it.
    with pytest.raises(TypeError, match=r"got a function as model and a Stacked as"):
        eqxscan.find_nonfinite(lambda m, x: jnp.sum(m(x)), stack, jnp.ones(D))  # pyright: ignore[reportArgumentType]
    # A loss_fn that is a Module (an eqx.Partial) after the model is no such
    # swap: it runs, and finds the layer.
    loss = eqx.Partial(loss_fn, reverse=False)
    r = eqxscan.find_nonfinite(injected(stack, "w", 1, jnp.nan), loss, jnp.ones(D))
    assert (r.where, r.index) == ("forward", 1), r


def test_a_call_in_reverse_names_the_layer_that_ran_first(getkey):
    # `stack(x, reverse=True)` runs layer L-1 first: with layers 1 and 3
    # broken, layer 3's output is the first non-finite one, and in the backward
    # pass layer 0 is reached first. As the loop by hand says.
    stack = injected(injected(make(getkey()), "w", 1, jnp.nan), "w", 3, jnp.nan)
    x = jr.normal(getkey(), (D,))
    r = eqxscan.find_nonfinite(stack, lambda m, x: loss_fn(m, x, True), x)
    assert (r.where, r.index) == ("forward", 3), r
    y4 = stack[4](x)
    assert jnp.isfinite(y4).all() and not jnp.isfinite(stack[3](y4)).any()
    stack = injected(injected(make(getkey()), "h", 1, 0.0), "h", 3, 0.0)
    r = eqxscan.find_nonfinite(stack, lambda m, x: loss_fn(m, x, True), x)
    assert (r.where, r.index) == ("backward", 1), r


class Poisoned(eqx.Module):
    w: Array
    flag: Array  # 1: this layer passes a NaN cotangent to its input

    def __call__(self, x):
        return jnp.tanh(self.w @ _poison(x, self.flag))


def test_only_the_input_cotangent_goes_nonfinite(getkey):
    # Layer k's own parameter gradient is finite; only the cotangent it passes
    # down is NaN, so the layer below (whose gradients then go NaN) is not it.
    w = 0.3 * jr.normal(getkey(), (L, D, D))
    x = jr.normal(getkey(), (D,))
    for k in range(1, L):
        flag = jnp.zeros(L).at[k].set(1.0)
        stack = eqxscan.Stacked(layers=Poisoned(w, flag), num_layers=L)
        r = eqxscan.find_nonfinite(stack, loss_fn, x)
        assert (r.where, r.index, r.leaf) == ("backward", k, "carry"), r


class SqrtCell(eqx.Module):
    w: Array
    b: Array  # 0 here: a finite forward whose gradient for `b` is inf

    def __call__(self, h, x):
        return jnp.tanh(self.w * h + x) + jnp.sqrt(self.b)


def test_recurrent_cell_parameter_gradient(getkey):
    # Every carry and cotangent is finite; only the shared cell's own gradient
    # is not (it once reported "No NaN or inf").
    xs = jr.normal(getkey(), (4, D))

    def loss(model, h0, xs):
        return jnp.sum(model(h0, xs)[1] ** 2)

    good = eqxscan.Recurrent(SqrtCell(jnp.ones(D), jnp.ones(D)))
    assert not eqxscan.find_nonfinite(good, loss, jnp.zeros(D), xs).found
    bad = eqxscan.Recurrent(SqrtCell(jnp.ones(D), jnp.zeros(D)))
    r = eqxscan.find_nonfinite(bad, loss, jnp.zeros(D), xs)
    assert (r.found, r.where, r.index, r.leaf) == (True, "backward", None, "cell.b"), r


def test_two_containers_are_told_apart(getkey):
    # The second container's layer 2 was once reported as the first's.
    first, second = make(getkey()), make(getkey())
    rnn = eqxscan.Recurrent(eqxscan.ElmanCell(D, D, key=getkey()))
    x, xs = jr.normal(getkey(), (D,)), jr.normal(getkey(), (6, D))

    def both(m, x):
        return loss_fn(m[1], m[0](x))

    r = eqxscan.find_nonfinite((first, injected(second, "w", 2, jnp.nan)), both, x)
    assert (r.where, r.index, r.call) == ("forward", 2, "Stacked_1"), r
    assert "layer 2 of Stacked_1" in r.message
    r = eqxscan.find_nonfinite((injected(first, "w", 3, jnp.nan), second), both, x)
    assert (r.where, r.index, r.call) == ("forward", 3, "Stacked"), r

    def then_rnn(m, x, xs):
        return jnp.sum(m[1](m[0](x), xs)[1] ** 2)

    r = eqxscan.find_nonfinite((first, rnn), then_rnn, x, xs.at[4, 0].set(jnp.nan))
    assert (r.where, r.index, r.call) == ("forward", 4, "Recurrent"), r
    assert "time step 4 of Recurrent" in r.message


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("t", [0, 2, 5])
def test_recurrent_cotangent_from_the_loss_names_its_step(t, reverse, getkey):
    # Only hs[t]'s cotangent is NaN (sqrt at 0): once reported as step t + 1.
    cell = eqxscan.ElmanCell(3, D, key=getkey())
    rnn = eqxscan.Recurrent(cell, reverse=reverse)
    xs = jr.normal(getkey(), (6, 3))

    def loss(model, h0, xs):
        _, hs = model(h0, xs)
        return jnp.sum(hs**2) + jnp.sum(jnp.sqrt(hs[t] * 0.0))

    r = eqxscan.find_nonfinite(rnn, loss, jnp.zeros(D), xs)
    assert (r.where, r.index, r.leaf) == ("loss", t, "carry"), r
    assert f"time step {t}'s output" in r.message
    # A NaN input at step t: the first output in the order the steps ran.
    r = eqxscan.find_nonfinite(rnn, loss, jnp.zeros(D), xs.at[t, 0].set(jnp.nan))
    assert (r.where, r.index) == ("forward", t), r


@pytest.mark.parametrize("traced", [False, True])
def test_run_layers_out_of_order_names_the_layer_that_ran_first(traced, getkey):
    # Layers 3, 1, 2 run in that order; layers 1 and 3 are broken: layer 3's
    # output is the first non-finite one (once reported as layer 1, the lowest).
    sel = jnp.array([3, 1, 2]) if traced else [3, 1, 2]
    stack = injected(injected(make(getkey()), "w", 1, jnp.nan), "w", 3, jnp.nan)
    x = jr.normal(getkey(), (D,))

    def loss(m, x):
        return jnp.mean(eqxscan.run_layers(m, x, sel) ** 2)

    r = eqxscan.find_nonfinite(stack, loss, x)
    assert (r.where, r.index) == ("forward", 3), r
    assert not jnp.isfinite(stack[3](x)).any()
    # Layer 1 passes a NaN cotangent to its input, layer 3's output (once
    # reported as layer 4, which did not run).
    w = 0.3 * jr.normal(getkey(), (L, D, D))
    poisoned = Poisoned(w, jnp.zeros(L).at[1].set(1.0))
    r = eqxscan.find_nonfinite(eqxscan.Stacked(layers=poisoned, num_layers=L), loss, x)
    assert (r.where, r.index, r.leaf) == ("backward", 1, "carry"), r


def test_run_layers_parameter_gradient_of_the_first_layer_run(getkey):
    # Layer 2 runs first; only its own gradient (of `h`) is non-finite (once
    # reported as "No NaN or inf": the run's parameters were not looked at).
    stack = injected(make(getkey()), "h", 2, 0.0)
    x = jr.normal(getkey(), (D,))
    for sel in ([2, 3], [2, 0, 4], jnp.array([2, 4])):
        loss = lambda m, x, sel=sel: jnp.mean(eqxscan.run_layers(m, x, sel) ** 2)  # noqa: E731
        assert not jnp.isfinite(eqx.filter_grad(loss)(stack, x).layers.h[2])
        r = eqxscan.find_nonfinite(stack, loss, x)
        assert (r.where, r.index, r.leaf) == ("backward", 2, "layer.h"), r


class Root(eqx.Module):
    w: Array
    r: Array  # 0 here: a non-finite gradient of `r` alone, every cotangent finite

    def __call__(self, x):
        return jnp.tanh(self.w @ x) + jnp.sqrt(self.r)


class RootScale(eqx.Module):
    r: Array

    def __call__(self, x):
        return 0.9 * x + jnp.sqrt(self.r)


def test_parameter_gradient_in_a_repeated_pattern_names_its_layer(getkey):
    w = 0.3 * jr.normal(getkey(), (6, D, D))
    one = jnp.ones(D)
    layers = [Root(w[i], one) if i % 2 else RootScale(one) for i in range(6)]
    assert eqxscan.Chain(layers).layout[0].per_step == 2  # one pattern, 3 repeats
    for k in range(6):
        bad = list(layers)
        bad[k] = eqx.tree_at(lambda m: m.r, bad[k], jnp.zeros(D))
        r = eqxscan.find_nonfinite(eqxscan.Chain(bad), loss_fn, jnp.ones(D))
        assert (r.where, r.index, r.leaf) == ("backward", k, "layer.r"), r


def test_parameter_gradient_in_a_stage_ordered_stack_names_its_layer(getkey):
    keys = jr.split(getkey(), 8)
    stack = eqxscan.Stacked.from_layers(
        [Root(0.3 * jr.normal(k, (D, D)), jnp.ones(D)) for k in keys]
    )
    for k in (2, 5):  # stored at positions 4 and 3
        r = jnp.ones((8, D)).at[k].set(0.0)
        bad = eqx.tree_at(lambda s: s.layers.r, stack, r)
        staged = eqxscan.sharding.pipeline_order(bad, stages=2, repeats=2)
        r = eqxscan.find_nonfinite(staged, loss_fn, jnp.ones(D))
        assert (r.where, r.index, r.leaf) == ("backward", k, "layer.r"), r


class Scale(eqx.Module):
    s: Array
    h: Array  # as Block's

    def __call__(self, x):
        return x * self.s + jnp.sqrt(jnp.sum(x**2) * self.h)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_a_repeated_pattern_is_read_in_the_order_its_layers_ran(mode, getkey):
    w, one = 0.3 * jr.normal(getkey(), (6, D, D)), jnp.ones(())
    layers = [Block(w[i], one, one) if i % 2 else Scale(one, one) for i in range(6)]
    x = jr.normal(getkey(), (D,))
    cases = [(lambda m: m.s, jnp.inf, "forward"), (lambda m: m.h, 0.0, "backward")]
    for k in range(6):
        for field, value, where in cases:
            bad = list(layers)
            # Strongly typed, as the others: a Chain keeps weak types apart.
            bad[k] = eqx.tree_at(field, bad[k], jnp.asarray(value, one.dtype))
            chain = eqxscan.Chain(bad).with_options(mode=mode)
            assert chain.layout[0].per_step == 2  # one pattern, 3 repeats
            r = eqxscan.find_nonfinite(chain, loss_fn, x)
            assert (r.where, r.index) == (where, k), r


@pytest.mark.parametrize("swap", [False, True])
def test_parameter_gradient_of_two_stacks_names_the_stack_that_made_it(swap, getkey):
    # Two stacks of one length, held as `(enc, dec)`, called in that order or
    # swapped: each call's parameter counts are those of the stack it called.
    def stack(bad):
        r = jnp.ones((L, D)) if bad is None else jnp.ones((L, D)).at[bad].set(0.0)
        w = 0.3 * jr.normal(getkey(), (L, D, D))
        return eqxscan.Stacked(layers=Root(w, r), num_layers=L)

    def loss(m, x):
        first, second = m[::-1] if swap else m
        return loss_fn(second, first(x))

    for bad_enc in (True, False):
        enc, dec = (stack(1), stack(None)) if bad_enc else (stack(None), stack(4))
        r = eqxscan.find_nonfinite((enc, dec), loss, jnp.ones(D))
        call = "Stacked" if bad_enc != swap else "Stacked_1"  # the bad one's
        assert (r.where, r.index, r.call) == ("backward", 1 if bad_enc else 4, call), r


@pytest.mark.parametrize("reverse", [False, True])
def test_a_nonfinite_input_is_pointed_at_where_the_first_step_fails(reverse, getkey):
    stack = make(getkey())
    first = L - 1 if reverse else 0
    x = jnp.ones(D).at[0].set(jnp.nan)
    r = eqxscan.find_nonfinite(stack, loss_fn, x, reverse)
    assert (r.where, r.index) == ("forward", first), r
    assert "inputs given to loss_fn already hold NaN or inf" in r.message
    # A later layer's NaN from a finite input gets no such hint, nor does one
    # at the first step when the input is finite.
    for k in (first, 2):
        r = eqxscan.find_nonfinite(
            injected(stack, "w", k, jnp.nan), loss_fn, jnp.ones(D), reverse
        )
        assert r.index == k and "inputs given" not in r.message, r


OFFSET = 0.0  # read by `offset_loss`; rebound by the test


def offset_loss(model, x):
    return jnp.mean(model(x + OFFSET) ** 2)


def test_a_loss_reading_a_global_is_not_served_a_stale_program(getkey):
    global OFFSET
    stack, x = make(getkey()), jr.normal(getkey(), (D,))
    assert not eqxscan.find_nonfinite(stack, offset_loss, x).found
    try:
        OFFSET = float("nan")
        report = eqxscan.find_nonfinite(stack, offset_loss, x)
        assert report.found, report  # the old program said all was finite
    finally:
        OFFSET = 0.0


def test_a_loss_closing_over_an_array_is_compiled_once(getkey, caplog):
    # The usual `lambda m, x: mse(m(x), y)`: the array is keyed by identity
    # (JAX arrays cannot change), so each call's new lambda reuses one program.
    stack, x = make(getkey()), jr.normal(getkey(), (D,))
    y = jr.normal(getkey(), (D,))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        for _ in range(3):
            found = eqxscan.find_nonfinite(
                stack, lambda m, x: jnp.mean((m(x) - y) ** 2), x
            ).found
            assert not found
    stacked = f"float32[{L},{D},{D}]"
    compiled = [
        m for m in caplog.messages if m.startswith("Compiling") and stacked in m
    ]
    assert len(compiled) == 1, compiled


GRAD_SCALE = 1.0  # read by a custom derivative's backward rule


@jax.custom_vjp
def _scaled_identity(x):
    return x


_scaled_identity.defvjp(lambda x: (x, None), lambda _, g: (g * GRAD_SCALE,))


def test_a_custom_derivative_rule_reading_a_global_is_keyed(getkey):
    global GRAD_SCALE
    stack, x = make(getkey()), jr.normal(getkey(), (D,))
    loss = lambda m, x: jnp.mean(_scaled_identity(m(x)) ** 2)  # noqa: E731
    assert not eqxscan.find_nonfinite(stack, loss, x).found
    try:
        GRAD_SCALE = float("nan")  # only the backward pass sees it
        assert eqxscan.find_nonfinite(stack, loss, x).found
    finally:
        GRAD_SCALE = 1.0
