"""The GPipe and circular pipeline schedules: the tick table against its formula,
equality with the unpipelined model (2 devices here; 8 devices and 2 processes x
4 devices in tests/scripts/pipeline_checks.py), and the errors."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxscan
from eqxscan import sharding
from eqxscan.sharding._pipeline import (
    _check_layer_order,
    _check_pipeline,
    _check_schedule,
)

from .helpers import free_port, max_rel_err, processes, ROOT, run_script, script_path


TIMEOUT = 240


@pytest.mark.parametrize(
    "stages, microbatches, repeats",
    [(1, 3, 1), (2, 2, 1), (4, 1, 1), (4, 4, 2), (4, 8, 4), (3, 5, 3), (8, 16, 2)],
)
def test_schedule_table(stages, microbatches, repeats):
    kind = "gpipe" if repeats == 1 and microbatches < stages else "circular"
    table = sharding.pipeline_schedule(
        stages=stages, microbatches=microbatches, repeats=repeats, schedule=kind
    )
    S, M, R = stages, microbatches, repeats
    assert table.ticks == R * M + S - 1
    assert table.idle == S * (S - 1)
    assert table.bubble == pytest.approx((S - 1) / (R * M + S - 1), abs=1e-12)
    tick = {}
    for t in range(table.ticks):
        for s in range(S):
            m, r = int(table.microbatch[t, s]), int(table.repeat[t, s])
            assert (m < 0) == (r < 0)
            if m >= 0:
                assert (m, r, s) not in tick  # each chunk runs each microbatch once
                tick[m, r, s] = t
    assert len(tick) == M * R * S
    for (m, r, s), t in tick.items():
        if s > 0:  # from the stage before, one tick earlier
            assert tick[m, r, s - 1] == t - 1
        elif r > 0:  # back from the last stage, after it has left it
            assert tick[m, r - 1, S - 1] < t


def test_schedule_gpipe_is_circular_of_one_round():
    a = sharding.pipeline_schedule(stages=4, microbatches=6)
    b = sharding.pipeline_schedule(stages=4, microbatches=6, schedule="circular")
    assert np.array_equal(a.microbatch, b.microbatch)
    assert np.array_equal(a.repeat, b.repeat)


def test_circular_two_stages_equals_scan(getkey):
    # An Explicit axis here; Auto axes in tests/scripts/pipeline_checks.py.
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Explicit,))
    stack = eqxscan.StackedMLP(8, 24, key=getkey()).blocks
    x = jax.random.normal(getkey(), (10, 8))

    def loss(stack, x, pipe):
        y = sharding.pipeline(stack, x, mesh=mesh, **pipe) if pipe else stack(x)
        return jnp.sum(jnp.sin(y))

    grad = eqx.filter_value_and_grad(loss)
    ref_value, ref_grads = grad(stack, x, None)
    # 6 chunks of 4 layers on 2 stages x 3 repeats, 5 microbatches of 2 rows:
    # stages and repeats differ, so a mix-up of the two cannot pass.
    pipe = dict(microbatches=5, schedule="circular", repeats=3)
    value, grads = eqx.filter_jit(grad)(stack, x, pipe)
    assert abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value))
    arrays = [eqx.filter(g, eqx.is_array) for g in (grads, ref_grads)]
    assert max_rel_err(*arrays) < 1e-5


class _Numbered(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x * self.w[None] + jnp.float32(eqxscan.layer_index())  # x: [rows, 4]


@pytest.mark.parametrize("pipe", [{}, {"schedule": "circular", "repeats": 3}])
def test_layers_in_a_pipeline_know_their_numbers(pipe, getkey):
    # Each stage scans its chunk: layer_index() gave the place in the chunk.
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Explicit,))
    layers = 12 if pipe else 6
    stack = eqxscan.Stacked(
        lambda k: _Numbered(1.0 + 0.1 * jax.random.normal(k, (4,))),
        layers,
        key=getkey(),
    )
    x = jax.random.normal(getkey(), (4, 4))
    want = x
    for i, layer in enumerate(stack.unstack()):
        want = want * layer.w[None] + i
    run = eqx.filter_jit(
        lambda s, x: sharding.pipeline(s, x, mesh=mesh, microbatches=2, **pipe)
    )
    np.testing.assert_allclose(run(stack, x), want, rtol=1e-5)


def test_explicit_batch_axes(getkey):
    # Explicit axes are in the arrays' types: cutting a batch split over "data"
    # into 3 microbatches, and merging their rows split over it back.
    mesh = jax.make_mesh((1, 2), ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)
    stack = eqxscan.StackedMLP(4, 2, key=getkey()).blocks
    x = jax.random.normal(getkey(), (12, 4))
    placed = jax.device_put(x, NamedSharding(mesh, P("data")))
    for axes in ("data", ()):
        y = sharding.pipeline(stack, placed, mesh=mesh, microbatches=3, batch_axes=axes)
        assert max_rel_err(y, stack(x)) <= 1e-5
        assert jax.typeof(y).sharding.spec == P(axes or None, None)


def test_drop_rates_need_a_key_and_are_off_in_inference(getkey):
    # Training-mode drop rates need a key; inference mode runs every layer and
    # ignores one.
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Explicit,))
    key = getkey()
    plain = eqxscan.StackedMLP(8, 4, key=key).blocks
    dropping = eqxscan.StackedMLP(8, 4, key=key, drop_path=0.5, layer_drop=0.5).blocks
    x = jax.random.normal(getkey(), (4, 8))
    pipe = dict(mesh=mesh, microbatches=2, schedule="circular", repeats=2)
    with pytest.raises(ValueError, match=r"sharding.pipeline drops layers") as info:
        sharding.pipeline(dropping, x, **pipe)
    assert "needs a `key`" in str(info.value)
    assert "\nHint: " in str(info.value)
    quiet = eqx.nn.inference_mode(dropping)
    run = eqx.filter_jit(lambda s, x, k: sharding.pipeline(s, x, key=k, **pipe))
    assert max_rel_err(run(quiet, x, getkey()), plain(x)) < 1e-5
    # The same key in training drops: the comparison above can fail.
    assert max_rel_err(run(dropping, x, getkey()), plain(x)) > 1e-2


def test_layer_drop_is_skipped_inside_the_stages(getkey):
    # A skipped layer is not computed: each stage's scan runs its chunk through
    # the engine's skip (a `cond` on LayerDrop's choice), absent without it.
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Explicit,))
    x = jnp.ones((4, 8))

    def program(**rates):
        stack = eqxscan.StackedMLP(8, 4, key=getkey(), **rates).blocks
        run = lambda s, x, k: sharding.pipeline(s, x, key=k, mesh=mesh, microbatches=2)
        return str(eqx.filter_make_jaxpr(run)(stack, x, getkey())[0])

    # One `cond` is the stage's own: an idle stage runs nothing.
    assert program(layer_drop=0.5).count(" cond[") > 1
    assert program(drop_path=0.5).count(" cond[") == 1
    assert program().count(" cond[") == 1


class _Unit(eqx.Module):
    # Normalises its input without an eps: its derivative at zero is NaN.
    w: jax.Array

    def __call__(self, x):
        n = jnp.linalg.norm(x, axis=-1, keepdims=True)
        return x + jnp.tanh(x @ self.w) * jnp.tanh(n)


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2)])
def test_an_idle_stage_adds_nothing_to_the_gradients(getkey, schedule, repeats):
    # Idle stages ran their layers on zeros, masked: the mask's zero times a
    # NaN derivative there made later stages' weight gradients NaN, with finite
    # values and the unpipelined gradients finite.
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Explicit,))
    make = lambda k: _Unit(0.3 * jax.random.normal(k, (8, 8)))
    stack = eqxscan.Stacked(make, 4, key=getkey())
    x = jax.random.normal(getkey(), (8, 8))
    pipe = dict(mesh=mesh, microbatches=4, schedule=schedule, repeats=repeats)
    loss = lambda s, piped: jnp.sum(  # noqa: E731
        (sharding.pipeline(s, x, **pipe) if piped else s(x)) ** 2
    )
    grads = eqx.filter_jit(eqx.filter_grad(loss))(stack, True)
    want = eqx.filter_grad(loss)(stack, False)
    np.testing.assert_allclose(grads.layers.w, want.layers.w, rtol=1e-4, atol=1e-5)


class _Wobble(eqx.Module):
    # An elementwise layer: a batch of scalars, axis 0 the batch.
    w: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(self.w * x)


def test_drop_rates_on_a_batch_of_scalars(getkey):
    # A carry of one axis draws one drop-path bit per layer for the whole call
    # (not one per row), which every microbatch then shares.
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Explicit,))
    make = lambda k: _Wobble(jax.random.normal(k, ()))
    rates = dict(drop_path=0.5, layer_drop=0.3)
    stack = eqxscan.Stacked(make, 8, key=getkey(), **rates)
    x = jax.random.normal(getkey(), (8,))
    pipe = dict(mesh=mesh, microbatches=4, schedule="circular", repeats=2)

    @eqx.filter_jit
    def value_and_grads(stack, x, key, piped):
        def loss(inputs):
            s, x = inputs
            y = sharding.pipeline(s, x, key=key, **pipe) if piped else s(x, key=key)
            return jnp.sum(jnp.sin(y) * jnp.arange(1.0, 9.0))

        return eqx.filter_value_and_grad(loss)((stack, x))

    values = []
    for _ in range(3):
        key = getkey()
        value, grads = value_and_grads(stack, x, key, True)
        ref, ref_grads = value_and_grads(stack, x, key, False)
        assert abs(float(value) - float(ref)) <= 1e-5 * abs(float(ref))
        arrays = [eqx.filter(g, eqx.is_array) for g in (grads, ref_grads)]
        assert max_rel_err(*arrays) < 1e-5
        values.append(float(ref))
    assert len(set(values)) == 3  # the keys drop differently


@pytest.fixture(scope="module")
def one_process() -> dict:
    # The checks on 1 process x 8 devices, in one fresh process: JAX starts once.
    return json.loads(run_script("pipeline_checks.py", "one", timeout=2 * TIMEOUT))


def test_drop_rates_equal_the_unpipelined_call(one_process):
    # 8 devices as (stage=2, data=4): gpipe and circular (repeats=2), natural
    # and stage order, 2 and 4 microbatches, 3 keys each.
    runs = {r["name"]: r for r in one_process["drop_runs"]}
    expected = {
        "gpipe_natural_2",
        "gpipe_stage_4",
        "circular_natural_4",
        "circular_stage_2",
    }
    assert set(runs) == expected | {"path_only", "layer_only"}
    for r in runs.values():
        # Loss, output and gradients (stack and x) of every key.
        assert r["err"] <= 1e-5, r
        # The keys drop differently, and differently from running every layer.
        assert r["key_gap"] > 1e-2 and r["quiet_gap"] > 1e-2, r


def test_stage_order(getkey):
    # The pipeline on a stage-ordered stack: tests/scripts/pipeline_checks.py.
    rates = [0.01 * i for i in range(8)]
    stack = eqxscan.StackedMLP(4, 8, key=getkey(), drop_path=rates).blocks
    order = dict(stages=2, repeats=2)
    staged = sharding.pipeline_order(stack, **order)
    # 4 chunks of 2 layers: stage 0 runs chunks 0 and 2, stage 1 chunks 1 and 3.
    layer = [0, 1, 4, 5, 2, 3, 6, 7]
    assert np.array_equal(staged.layers.w1, stack.layers.w1[np.array(layer)])
    assert staged.drop_rates.drop_path == tuple(rates[i] for i in layer)
    back = sharding.pipeline_order(staged, **order, inverse=True)
    assert np.array_equal(back.layers.w2, stack.layers.w2)
    assert back.drop_rates.drop_path == stack.drop_rates.drop_path
    # The stack records its order: kept by its gradients and a whole slice.
    assert (stack.stage_order, staged.stage_order, back.stage_order) == (
        None,
        (2, 2),
        None,
    )
    loss = lambda s: jnp.sum(s(jnp.ones(4), key=jax.random.key(0)))
    grads = eqx.filter_grad(loss)(staged)
    back = sharding.pipeline_order(grads, stages=2, repeats=2, inverse=True)
    assert back.stage_order is None
    assert staged[:].stage_order == (2, 2)
    # A part of it would be labelled natural with its layers out of order.
    with pytest.raises(ValueError, match=r"Cannot take slice\(None, 4, None\) of"):
        staged[:4]
    assert (
        sharding.pipeline_order(staged, stages=2, repeats=2, inverse=True)[
            :4
        ].stage_order
        is None
    )


def test_stage_order_of_a_stack_split_over_an_explicit_axis(getkey):
    # An Explicit layer axis is in the arrays' types: a reshape of it that moves
    # weights was refused (ShardingTypeError), eagerly and under jit.
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Explicit,))
    stack = eqxscan.StackedMLP(4, 8, key=getkey()).blocks
    order = dict(stages=2, repeats=2)
    want = sharding.pipeline_order(stack, **order)
    split = NamedSharding(mesh, P("stage"))
    natural = eqx.combine(jax.device_put(eqx.filter(stack, eqx.is_array), split), stack)
    permute = lambda s, inverse: sharding.pipeline_order(s, **order, inverse=inverse)
    jitted = eqx.filter_jit(permute)
    for run in (permute, jitted):
        staged = run(natural, False)
        assert staged.layers.w1.sharding.spec[0] == "stage"
        assert np.array_equal(staged.layers.w1, want.layers.w1)
        back = run(staged, True)
        assert back.layers.w2.sharding.spec[0] == "stage"
        assert np.array_equal(back.layers.w2, stack.layers.w2)


def test_a_stage_ordered_stack_called_directly_runs_its_layers_in_order(getkey):
    # It ran them in the order stored (layer 4 third), without a word.
    rates = [0.1 * i for i in range(8)]
    stack = eqxscan.StackedMLP(4, 8, key=getkey(), drop_path=rates).blocks
    staged = sharding.pipeline_order(stack, stages=2, repeats=2)
    x, key = jax.random.normal(getkey(), (4,)), jax.random.key(1)
    for mode in ["scan", "loop"]:
        a, b = (s.with_options(mode=mode) for s in (stack, staged))
        np.testing.assert_array_equal(b(x, key=key), a(x, key=key))
        np.testing.assert_array_equal(b.vmap(x), a.vmap(x))
    # Its gradients still come in its own (stage) order.
    loss = lambda s: jnp.sum(s(x, key=key) ** 2)
    grads = eqx.filter_grad(loss)(staged)
    assert grads.stage_order == (2, 2)
    back = sharding.pipeline_order(grads, stages=2, repeats=2, inverse=True)
    want = eqx.filter_grad(loss)(stack)
    for g, w in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    # run_until and run_layers number layers, not positions: refused.
    for run in [
        lambda: eqxscan.run_until(staged, x, lambda c: jnp.array(False)),
        lambda: eqxscan.run_layers(staged, x, [0, 1]),
    ]:
        with pytest.raises(
            ValueError, match=r"(?s)stage order of pipeline_order.*\nHint"
        ):
            run()


def test_a_stage_ordered_stack_indexes_its_layers_by_number(getkey):
    # `staged[1]` was the layer stored second (layer 3 here), `unstack()` the
    # stored order and `with_layer(1, ...)` replaced layer 3, all without a word.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 6, key=getkey())
    staged = sharding.pipeline_order(stack, stages=3, repeats=2)
    for i in range(-6, 6):
        assert eqx.tree_equal(staged[i], stack[i])
    assert eqx.tree_equal(staged.unstack(), stack.unstack())
    new = eqx.nn.Linear(4, 4, key=getkey())
    x = jnp.ones(4)
    np.testing.assert_array_equal(
        staged.with_layer(1, new)(x), stack.with_layer(1, new)(x)
    )
    # A traced index: the hint's recipe takes rows, so it names the order.
    with pytest.raises(TypeError, match=r"put back in order \(pipeline_order"):
        eqx.filter_jit(lambda s, i: s[i])(staged, jnp.int32(1))


def test_a_chains_stage_ordered_stack_runs_its_layers_in_order(getkey):
    # Called in a Chain (and by run_until, run_layers), such a stack ran its
    # layers in the order stored, without a word.
    first = eqx.nn.MLP(4, 4, 4, 1, key=getkey())
    chain = eqxscan.Chain(
        [first, *[eqx.nn.Linear(4, 4, key=getkey()) for _ in range(4)]]
    )
    order = sharding.pipeline_order(chain.groups[1], stages=2, repeats=2)
    staged = eqx.tree_at(lambda c: c.groups[1], chain, order)
    x, never = jnp.linspace(-1.0, 1.0, 4), lambda c: jnp.array(False)
    for mode in ["scan", "loop"]:
        a, b = (c.with_options(mode=mode) for c in (chain, staged))
        np.testing.assert_allclose(b(x), a(x), rtol=1e-6)
        got, want = (eqxscan.run_until(c, x, never, max_layers=3)[0] for c in (b, a))
        np.testing.assert_allclose(got, want, rtol=1e-6)
        layers = jnp.array([2, 0, 3])
        got, want = (eqxscan.run_layers(c, x, layers) for c in (b, a))
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_stage_ordered_stack_takes_new_drop_rates_by_layer(getkey):
    # `with_options(drop_path=rates)` gave rates[p] to the layer stored at p
    # (layer 3 got layer 1's rate), without a word.
    rates = [0.1 * i for i in range(6)]
    mlp = eqxscan.StackedMLP(4, 6, key=getkey())
    staged = eqx.tree_at(
        lambda m: m.blocks,
        mlp,
        sharding.pipeline_order(mlp.blocks, stages=3, repeats=2),
    )
    x, key = jax.random.normal(getkey(), (8, 4)), jax.random.key(1)
    for name in ["drop_path", "layer_drop"]:
        want = mlp.with_options(**{name: rates})(x, key=key)
        np.testing.assert_array_equal(
            staged.with_options(**{name: rates})(x, key=key), want
        )
        blocks = staged.blocks.with_options(**{name: rates})
        np.testing.assert_array_equal(blocks(x, key=key), want)


def test_a_non_square_stage_order_called_directly_runs_layers_in_order(getkey):
    # With stages != repeats the stage order is not its own inverse: read back
    # the wrong way, a direct call would run layer 4 second, dropped at the
    # wrong layer's rate.
    rates = [0.1 * i for i in range(6)]
    stack = eqxscan.StackedMLP(4, 6, key=getkey(), drop_path=rates).blocks
    staged = sharding.pipeline_order(stack, stages=3, repeats=2)
    assert staged.drop_rates.drop_path == tuple(rates[i] for i in [0, 3, 1, 4, 2, 5])
    x, key = jax.random.normal(getkey(), (4,)), jax.random.key(1)
    np.testing.assert_array_equal(staged(x, key=key), stack(x, key=key))
    np.testing.assert_array_equal(staged.vmap(x), stack.vmap(x))


def test_layer_order_must_match_the_stack(getkey):
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Auto,))
    stack = eqxscan.StackedMLP(4, 8, key=getkey()).blocks
    x = jnp.ones((4, 4))
    staged = sharding.pipeline_order(stack, stages=2, repeats=2)

    def error(match, f, *args):
        with pytest.raises(ValueError, match=match) as info:
            f(*args)
        assert "\nHint: " in str(info.value)

    def circular(stack, layer_order, repeats=2):
        kind = "circular" if repeats > 1 else "gpipe"
        return sharding.pipeline(
            stack,
            x,
            mesh=mesh,
            microbatches=2,
            schedule=kind,
            repeats=repeats,
            layer_order=layer_order,
        )

    def order(stack, inverse):
        return sharding.pipeline_order(stack, stages=2, repeats=2, inverse=inverse)

    natural, of = "in their natural order", r"in the stage order of .*stages=2, "
    # Each of these ran the layers in another order, without a word.
    error(f"{natural}, not {of}repeats=2", circular, stack, "stage")
    error(f"{of}repeats=2\\), not {natural}", circular, staged, "natural")
    error(f"{of}repeats=2\\), not {natural}", circular, staged, "natural", 1)
    other = sharding.pipeline_order(stack, stages=2, repeats=4)
    error(f"{of}repeats=4\\), not {of}repeats=2", circular, other, "stage")
    unlabelled = eqxscan.Stacked(layers=staged.layers, num_layers=len(staged))
    error(f"{natural}, not {of}repeats=2", circular, unlabelled, "stage")
    error(f"into stage order .*: .*repeats=2\\), not {natural}", order, staged, False)
    error(f"back from stage order .*: .*{natural}, not", order, stack, True)
    error(r"back from stage order .*: .*repeats=4\), not", order, other, True)
    # With one round (GPipe) both orders are the same.
    assert max_rel_err(circular(stack, "stage", 1), stack(x)) <= 1e-5


def test_pipeline_errors(getkey):
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Auto,))
    stack = eqxscan.StackedMLP(4, 6, key=getkey()).blocks
    x = jnp.ones((4, 4))

    def piped(x):
        return sharding.pipeline(stack, x, mesh=mesh, microbatches=2)

    with pytest.raises(TypeError, match="tap does not reach sharding.pipeline"):
        eqxscan.tap(piped, eqxscan.stats.rms)(x)

    def error(match, **kwargs):
        kwargs = dict(mesh=mesh, microbatches=2) | kwargs
        with pytest.raises(ValueError, match=match) as info:
            sharding.pipeline(kwargs.pop("stack", stack), x, **kwargs)
        assert "\nHint: " in str(info.value)

    circular = dict(schedule="circular")
    error(
        r"6 layers of a Stacked into 2 pipeline stages .* x 2 repeats = 4 chunks",
        repeats=2,
        **circular,
    )
    error(r"needs at least as many microbatches as stages", microbatches=1, **circular)
    error(r"shape \(4, 4\) into 3 microbatches", microbatches=3)
    error(r"stage_axis names mesh axis 'pipe'", stage_axis="pipe")
    error(r"batch_axes names mesh axis 'data'", batch_axes="data")
    error(r"repeats=2 needs schedule='circular'", repeats=2)
    error(r"repeats must be >= 1, got 0", repeats=0, **circular)
    # A bad schedule name (under the suite's runtime type checking, beartype
    # speaks first; the message of the check itself below).
    with pytest.raises(Exception, match=r"schedule must be one of|'schedule'"):
        sharding.pipeline(stack, x, mesh=mesh, microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match=r"(?s)'gpipe', 'circular'.*'1f1b'.*Hint:"):
        _check_schedule("1f1b", 1)
    with pytest.raises(Exception, match=r"layer_order must be one of|'layer_order'"):
        sharding.pipeline(stack, x, mesh=mesh, microbatches=2, layer_order="stages")
    with pytest.raises(ValueError, match=r"(?s)'natural', 'stage'.*'stages'.*Hint:"):
        _check_layer_order("stages")
    with pytest.raises(ValueError, match=r"(?s)6 layers .* 4 chunks.*\nHint: "):
        sharding.pipeline_order(stack, stages=2, repeats=2)
    # A batch of stacks (an ensemble) runs inside `eqx.filter_vmap`, not as is.
    stacks = eqx.filter_vmap(lambda _: stack)(jnp.arange(2))
    with pytest.raises(ValueError, match=r"pipeline this Stacked: it has 6 layers"):
        sharding.pipeline(stacks, x, mesh=mesh, microbatches=2)
    with pytest.raises(TypeError, match=r"one array x .* got a tuple\.\nHint: "):
        _check_pipeline(stack, (x, x), mesh, 2, "stage", "gpipe", 1, (), "natural")
    # Under jax.jit Dropout's `p` is a 0-d array among the stacked ones.
    with pytest.raises(ValueError, match=r"(?s)`layers.dropout.p`.*eqx.filter_jit"):
        jax.jit(lambda s: sharding.pipeline(s, x, mesh=mesh, microbatches=2))(stack)


def test_microbatch_rows_must_divide_over_the_batch_axes(getkey):
    # 6 rows in 2 microbatches of 3, split 2 ways over "data": once JAX's
    # IndivisibleError about an internal (2, 3, 4) array.
    mesh = jax.make_mesh((1, 2), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    stack = eqxscan.StackedMLP(4, 2, key=getkey()).blocks
    with pytest.raises(
        ValueError,
        match=r"shape \(6, 4\) into 2 microbatches of rows split over \('data',\) "
        r"\(2 ways\): axis 0 must be a positive multiple of 4",
    ):
        sharding.pipeline(
            stack, jnp.ones((6, 4)), mesh=mesh, microbatches=2, batch_axes="data"
        )


def check_runs(runs: list[dict], expected: set[str]) -> None:
    names = {r["name"]: r for r in runs}
    assert set(names) == expected
    for r in runs:
        assert r["err_loss"] <= 1e-5, r
        assert r["err_grads"] <= 1e-5 and r["err_params"] <= 1e-5, r
        # Each stage indexes its own weights: nothing is gathered in the ticks.
        assert r["body_all_gathers"] == [], r
    # One microbatch moves per tick (4 rows; 2 per device when its rows are split
    # over "data"), forwards and backwards; GPipe's line of 4 stages x 2 data
    # replicas has 6 links, the circular ring 8.
    assert names["circular_data"]["body_permutes"].count("f32[2,8]") >= 2
    assert set(names["circular_data"]["body_permute_pairs"]) == {8}
    if "circular" in names:
        assert names["gpipe_data"]["body_permutes"].count("f32[4,8]") >= 2
        assert names["circular"]["body_permutes"].count("f32[4,8]") >= 2
        assert set(names["gpipe_data"]["body_permute_pairs"]) == {6}
        assert set(names["circular"]["body_permute_pairs"]) == {8}


def test_eight_devices(one_process):
    assert one_process["processes"] == 1
    check_runs(one_process["runs"], {"gpipe_data", "circular", "circular_data"})


def test_stage_order_moves_no_weights(one_process):
    # A stack whose layer axis is split over "stage" (L/S layers per device);
    # R = 2, M = 4 microbatches of 4 rows split over "data".
    runs = {r["name"]: r for r in one_process["stage_runs"]}
    assert set(runs) == {"stage_order", "natural_order"}
    for r in runs.values():
        # Grads and updated params of the stage order mapped back to natural.
        assert r["err_loss"] <= 1e-5, r
        assert r["err_grads"] <= 1e-5 and r["err_params"] <= 1e-5, r
        # Each device holds a quarter of the stack, before and after the step.
        assert r["device_stack_bytes"] * 4 == r["stack_bytes"], r
        assert r["device_new_stack_bytes"] == r["device_stack_bytes"], r
    stage, natural = runs["stage_order"], runs["natural_order"]
    # In stage order each device's shard is its stage's block: the program
    # permutes only microbatches ([2, 8] per device); its all-to-alls reshape
    # the batch's rows and the outputs ([.., 8]), as the natural order's do.
    assert stage["weight_moves"] == [], stage
    assert stage["permutes"] and set(stage["permutes"]) == {"f32[2,8]"}, stage
    assert set(stage["all_to_alls"]) <= set(natural["all_to_alls"]), stage
    # In natural order the same split holds other stages' chunks, which the
    # program exchanges (w1 and w2 with all-to-alls and permutes).
    moved = {m.split()[0] for m in natural["weight_moves"]}
    assert moved == {"all-to-all", "collective-permute"}, natural
    assert len(natural["all_to_alls"]) > len(stage["all_to_alls"]), natural
    assert stage["device_argument_bytes"] == natural["device_argument_bytes"]


def test_two_processes_stage_axis_across_them():
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    # Each script adds its own device count to the tests' compile flags.
    env["XLA_FLAGS"] = os.environ.get("EQXSCAN_TEST_XLA_FLAGS", "")
    paths = [str(ROOT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    port = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        logs = [out / f"two_{i}.log" for i in range(2)]
        procs = []
        for i, log in enumerate(logs):
            with log.open("w") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script_path("pipeline_checks.py"))]
                        + ["two", "--process-id", str(i), "--port", port]
                        + ["--out", str(out)],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=ROOT,
                    )
                )
        with processes(*procs):
            deadline = time.monotonic() + TIMEOUT
            codes = [
                p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs
            ]
        assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
        results = [json.loads((out / f"two_{i}.json").read_text()) for i in range(2)]
    for result in results:
        assert result["processes"] == 2
        # Stages 0-1 on process 0, stages 2-3 on process 1.
        assert result["stage_processes"] == [[0], [0], [1], [1]]
        check_runs(result["runs"], {"circular_data"})


def test_example_final_loss_unchanged_by_the_pipeline():
    common = ["--devices-per-process", "8", "--dim", "16", "--layers", "8"]
    common += ["--batch", "16", "--steps", "2"]
    losses = []
    for extra in ([], ["--pipeline-stages", "4", "--repeats", "2"]):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "sharded_training.py")]
            + common
            + extra,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            cwd=ROOT,
            timeout=TIMEOUT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        last = proc.stdout.strip().splitlines()[-1]
        m = re.fullmatch(
            r"final loss: (\S+) after 2 steps on 1 processes x 8 devices", last
        )
        assert m, last
        losses.append(float(m.group(1)))
    assert "schedule 'circular', repeats 2, 8 microbatches" in proc.stdout
    assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0]), losses


def test_layer_drop_with_an_explicit_data_axis(getkey):
    # A skipped step's zeros were unsharded where the running step's outputs
    # are split over the explicit data axis: `cond` refused the branches.
    axes = ("stage", "data")
    mesh = jax.make_mesh((1, 2), axes, axis_types=(AxisType.Explicit,) * 2)
    make = lambda k: _Unit(0.3 * jax.random.normal(k, (8, 8)))
    stack = eqxscan.Stacked(make, 4, key=getkey(), layer_drop=0.3)
    x, key = jax.random.normal(getkey(), (16, 8)), getkey()
    pipe = dict(mesh=mesh, microbatches=4, batch_axes=("data",), key=key)
    loss = lambda s, piped: jnp.sum(  # noqa: E731
        (sharding.pipeline(s, x, **pipe) if piped else s(x, key=key)) ** 2
    )
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(stack, True)
    want, want_grads = eqx.filter_value_and_grad(loss)(stack, False)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(
        grads.layers.w, want_grads.layers.w, rtol=1e-4, atol=1e-5
    )


def test_an_identity_inverse_of_a_stage_ordered_stack_is_refused(getkey):
    # stages=1 or repeats=1 permute nothing: asked to take a stack in another
    # stage order back, it returned it unchanged, still in that order.
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 8, key=getkey())
    staged = sharding.pipeline_order(stack, stages=2, repeats=2)
    for stages, repeats in [(4, 1), (1, 2), (8, 1)]:
        with pytest.raises(
            ValueError,
            match=rf"(?s)back from stage order for stages={stages}, "
            rf"repeats={repeats}: .*pipeline_order\(stack, stages=2, repeats=2\)",
        ):
            sharding.pipeline_order(
                staged, stages=stages, repeats=repeats, inverse=True
            )
    # On a natural-order stack they are the identity, either way.
    for inverse in (False, True):
        same = sharding.pipeline_order(stack, stages=4, repeats=1, inverse=inverse)
        assert same.stage_order is None and eqx.tree_equal(same, stack)
