"""`checkpoint="auto"` and `unroll="auto"`: the rule's choices, explicit options
winning, and equal values and gradients whatever the rule picks."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxscan
from eqxscan import _auto


def cost(**changes):
    base = dict(
        length=8,
        flops=10_000,
        carry_bytes=256,
        saved_bytes=1000,
        policy_saved_bytes=900,
    )
    return eqxscan.StepCost(**{**base, **changes})


POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


# --- the rule on synthetic costs: both sides of every threshold ---------------


def test_small_and_matmul_dominated_saves_everything():
    small = _auto.SMALL_RESIDUALS // 8  # x length 8: exactly the threshold
    c = cost(saved_bytes=small, policy_saved_bytes=small)
    assert _auto.decide(c, "auto", "auto", POLICY, "cpu")[:2] == (False, 1)
    assert _auto.decide(c, "auto", "auto", POLICY, "gpu")[:2] == (False, 1)


def test_over_the_size_threshold_recomputes():
    over = _auto.SMALL_RESIDUALS // 8 + 1
    c = cost(saved_bytes=over, policy_saved_bytes=over)
    assert _auto.decide(c, "auto", 1, POLICY, "cpu")[0] is True
    assert _auto.decide(c, "auto", 1, POLICY, "gpu")[0] is POLICY


def test_big_steps_keep_matmul_outputs_on_cpu_too():
    over = _auto.SMALL_RESIDUALS
    small = cost(saved_bytes=over, flops=_auto.FULL_REMAT_FLOPS - 1)
    big = cost(saved_bytes=over, flops=_auto.FULL_REMAT_FLOPS)
    assert _auto.decide(small, "auto", 1, POLICY, "cpu")[0] is True
    assert _auto.decide(big, "auto", 1, POLICY, "cpu")[0] is POLICY
    assert _auto.decide(small, "auto", 1, POLICY, "gpu")[0] is POLICY


def test_large_matmul_outputs_recompute_on_cpu():
    # Big steps (so not the FLOPs rule), length 8: the policy's total is
    # 8 x policy_saved_bytes, compared with FULL_REMAT_RESIDUALS.
    limit = _auto.FULL_REMAT_RESIDUALS // 8
    big = dict(flops=_auto.FULL_REMAT_FLOPS, saved_bytes=2 * limit)
    at = cost(policy_saved_bytes=limit, **big)
    over = cost(policy_saved_bytes=limit + 1, **big)
    assert _auto.decide(at, "auto", 1, POLICY, "cpu")[0] is POLICY
    assert _auto.decide(over, "auto", 1, POLICY, "cpu")[0] is True
    assert _auto.decide(over, "auto", 1, POLICY, "gpu")[0] is POLICY
    assert (
        "64.00 MiB of matmul outputs" in _auto.decide(over, "auto", 1, POLICY, "cpu")[2]
    )


def test_nearly_all_matmul_outputs_save_everything_on_cpu():
    # Big steps, more than SMALL_RESIDUALS, matmul outputs under
    # FULL_REMAT_RESIDUALS: the ratio decides between saving all and the policy.
    policy = _auto.SMALL_RESIDUALS // 8
    big = dict(flops=_auto.FULL_REMAT_FLOPS, policy_saved_bytes=policy)
    at = cost(saved_bytes=int(policy * _auto.NEARLY_ALL_MATMUL), **big)
    over = cost(saved_bytes=int(policy * _auto.NEARLY_ALL_MATMUL) + 1, **big)
    assert at.saved_bytes * at.length > _auto.SMALL_RESIDUALS
    assert _auto.decide(at, "auto", 1, POLICY, "cpu")[0] is False
    assert "nearly all matmul outputs" in _auto.decide(at, "auto", 1, POLICY, "cpu")[2]
    assert _auto.decide(over, "auto", 1, POLICY, "cpu")[0] is POLICY
    assert _auto.decide(at, "auto", 1, POLICY, "gpu")[0] is POLICY
    # Full remat still wins for small steps and for large matmul outputs.
    small = cost(saved_bytes=at.saved_bytes, policy_saved_bytes=policy)
    assert _auto.decide(small, "auto", 1, POLICY, "cpu")[0] is True
    limit = _auto.FULL_REMAT_RESIDUALS // 8 + 1
    large = cost(
        flops=_auto.FULL_REMAT_FLOPS, saved_bytes=limit, policy_saved_bytes=limit
    )
    assert _auto.decide(large, "auto", 1, POLICY, "cpu")[0] is True


def test_over_the_elementwise_ratio_recomputes():
    ratio = _auto.MATMUL_DOMINATED
    at = cost(saved_bytes=int(1000 * ratio), policy_saved_bytes=1000)
    over = cost(saved_bytes=int(1000 * ratio) + 1, policy_saved_bytes=1000)
    assert _auto.decide(at, "auto", 1, POLICY, "cpu")[0] is False
    assert _auto.decide(over, "auto", 1, POLICY, "cpu")[0] is True
    assert _auto.decide(over, "auto", 1, POLICY, "tpu")[0] is POLICY


def test_short_small_scans_unroll_fully_and_save_what_the_loop_saves():
    short = cost(length=_auto.SHORT_SCAN, saved_bytes=10**9)
    assert _auto.decide(short, "auto", "auto", POLICY, "cpu")[:2] == (False, True)
    assert _auto.decide(short, "auto", "auto", POLICY, "gpu")[:2] == (False, True)
    # An explicit checkpoint is kept; an explicit full unroll saves as the loop does.
    assert _auto.decide(short, True, "auto", POLICY, "cpu")[:2] == (True, True)
    assert _auto.decide(cost(), "auto", True, POLICY, "cpu")[:2] == (False, True)
    longer = cost(length=_auto.SHORT_SCAN + 1, saved_bytes=10**9)
    assert _auto.decide(longer, "auto", "auto", POLICY, "cpu")[:2] == (True, 1)
    # The FLOPs bound is on the whole scan: steps times FLOPs per step.
    per_step = _auto.UNROLL_FLOPS // _auto.SHORT_SCAN
    under = cost(length=_auto.SHORT_SCAN, flops=per_step - 1, saved_bytes=10**9)
    assert _auto.decide(under, "auto", "auto", POLICY, "cpu")[:2] == (False, True)
    at = cost(length=_auto.SHORT_SCAN, flops=per_step, saved_bytes=10**9)
    assert _auto.decide(at, "auto", "auto", POLICY, "cpu")[:2] == (POLICY, 1)
    two = cost(length=2, flops=_auto.UNROLL_FLOPS // 2, saved_bytes=10**9)
    assert _auto.decide(two, "auto", "auto", POLICY, "cpu")[:2] == (POLICY, 1)
    fewer = cost(length=2, flops=_auto.UNROLL_FLOPS // 2 - 1, saved_bytes=10**9)
    assert _auto.decide(fewer, "auto", "auto", POLICY, "cpu")[:2] == (False, True)
    reason = _auto.decide(short, "auto", "auto", POLICY, "cpu")[2]
    assert "unroll fully" in reason and "loop" in reason


def test_full_unroll_is_the_loops_program():
    stack = eqxscan.StackedMLP(8, 3, key=jr.key(0))
    x = jr.normal(jr.key(1), (2, 8))
    (choice,) = eqxscan.explain_auto(stack, x)
    assert (choice.checkpoint, choice.unroll) == (False, True)

    def lowered(m):
        dyn, static = eqx.partition(m, eqx.is_inexact_array)
        loss = lambda d: jnp.mean(eqx.combine(d, static)(x) ** 2)
        return jax.jit(jax.value_and_grad(loss)).lower(dyn).as_text()

    loop = lowered(_mlp_options(stack, mode="loop"))
    assert lowered(stack) == loop
    assert lowered(_mlp_options(stack, checkpoint=False, unroll=True)) == loop
    assert "while" not in loop
    assert "while" in lowered(_mlp_options(stack, unroll=1))


def _scanned(unroll):
    # `True == 1` in Python: a full unroll must not pass for `unroll=1`.
    return unroll is not True and unroll == 1


def test_what_is_unrolled_depends_on_depth_and_the_whole_scans_flops():
    def picked(width, depth, tokens=64):
        stack = eqxscan.StackedMLP(width, depth, key=jr.key(0))
        x = jax.ShapeDtypeStruct((tokens, width), jnp.float32)
        (choice,) = eqxscan.explain_auto(stack, x)
        return choice

    # 8 small layers: the loop's program; 9: scanned.
    assert picked(16, _auto.SHORT_SCAN).unroll is True
    assert _scanned(picked(16, _auto.SHORT_SCAN + 1).unroll)
    # Width 64 over 2304 tokens: 1.5e8 FLOPs a layer, unrolled at 4 layers (6e8
    # in all) but not at 8 (1.2e9).
    four, eight = picked(64, 4, tokens=2304), picked(64, 8, tokens=2304)
    assert 4 * four.cost.flops < _auto.UNROLL_FLOPS < 8 * eight.cost.flops
    assert four.unroll is True and _scanned(eight.unroll)
    assert "in all" in four.reason


def test_a_stack_that_gathers_its_layers_stays_scanned():
    # FSDP: each step all-gathers one layer. Unrolled, XLA may gather all of them
    # at once, so "auto" keeps the scan even where it would unroll.
    short = cost(length=2, saved_bytes=10**9)
    assert _auto.decide(short, "auto", "auto", POLICY, "cpu")[1] is True
    got = _auto.decide(short, "auto", "auto", POLICY, "cpu", gathered=True)
    assert _scanned(got[1]) and "layer_sharding" in got[2]
    assert _auto.decide(short, "auto", True, POLICY, "cpu", gathered=True)[1] is True
    stack = eqxscan.StackedMLP(8, 3, key=jr.key(0))
    mesh = jax.make_mesh((1,), ("fsdp",))
    sharded = eqxscan.sharding.gather_layers(stack, mesh)
    x = jnp.ones((2, 8))
    (plain,) = eqxscan.explain_auto(stack, x)
    (gathered,) = eqxscan.explain_auto(sharded, x)
    assert plain.unroll is True and _scanned(gathered.unroll)


def test_layers_that_may_be_sharded_stay_scanned():
    # Weights split over an `Explicit` mesh axis say so in their types; under an
    # `Auto` mesh of several devices set with `jax.set_mesh` they may be split
    # without a trace of it. Replicated ones, size-1 axes and no mesh: unrolled.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    stack = eqxscan.StackedMLP(8, 3, key=jr.key(0))
    x = jnp.ones((2, 8))
    (plain,) = eqxscan.explain_auto(stack, x)
    assert plain.unroll is True

    def place(mesh, spec):
        def one(a):
            if not eqx.is_array(a):
                return a
            return jax.device_put(a, NamedSharding(mesh, spec if a.ndim == 3 else P()))

        return jtu.tree_map(one, stack)

    split, whole = P(None, None, "d"), P()
    cases = [
        (2, AxisType.Explicit, split, True, True),
        (2, AxisType.Explicit, whole, True, False),
        (1, AxisType.Explicit, split, True, False),
        (2, AxisType.Auto, split, True, True),
        (2, AxisType.Auto, whole, True, True),  # replicated, but nothing says so
        (2, AxisType.Auto, split, False, False),  # invisible without the mesh
        (1, AxisType.Auto, split, True, False),
    ]
    for n, kind, spec, in_mesh, scanned in cases:
        mesh = jax.make_mesh((n,), ("d",), (kind,), devices=jax.devices()[:n])
        sharded = place(mesh, spec)
        with jax.set_mesh(mesh) if in_mesh else contextlib.nullcontext():
            (got,) = eqxscan.explain_auto(sharded, x)
            out = eqx.filter_jit(lambda m, x: m(x))(sharded, x)
        assert _scanned(got.unroll) is scanned, (n, kind, spec, in_mesh, got)
        assert ("may be sharded" in got.reason) is scanned
        np.testing.assert_allclose(out, stack(x), rtol=1e-5, atol=1e-6)


def test_decide_leaves_explicit_values_alone():
    c = cost(saved_bytes=10**9)
    for checkpoint in (False, True, POLICY, "nested"):
        for unroll in (1, 3, True):
            got = _auto.decide(c, checkpoint, unroll, POLICY, "cpu")
            assert got[:2] == (checkpoint, unroll)


def test_reason_names_the_numbers():
    reason = _auto.decide(cost(length=12), "auto", "auto", POLICY, "cpu")[2]
    assert "save everything" in reason and "MiB" in reason and "unroll 1" in reason


# --- measuring a traced step ---------------------------------------------------


def test_measure_counts_flops_and_residuals():
    # step: c -> tanh(c @ w + x) with w closed over. `vjp` keeps w (a constant,
    # not stacked by a scan), tanh's output and 1 - output (float32[n] each; what
    # `jax.ad_checkpoint.print_saved_residuals` lists). The policy keeps only the
    # matmul output and recomputes tanh.
    n = 16
    w = jnp.ones((n, n))

    def step(c, x):
        out = jnp.tanh(c @ w + x)
        return out, None

    c = jnp.ones(n)
    xs = jnp.ones((5, n))
    got = _auto.measure(step, c, xs, 5, POLICY)
    assert got.length == 5
    assert got.flops == 2 * n * n + n + n  # matmul, add, tanh
    assert got.carry_bytes == 4 * n
    assert got.saved_bytes == 2 * 4 * n
    assert got.policy_saved_bytes == 4 * n


def test_measure_sees_the_vmapped_batch():
    cell = eqx.nn.GRUCell(3, 4, key=jr.key(0))
    rnn = eqxscan.Recurrent(cell)
    h0, xs = jnp.zeros(4), jnp.ones((6, 3))
    (one,) = eqxscan.explain_auto(rnn, h0, xs)
    batched = lambda h, x: jax.vmap(rnn)(h, x)
    (five,) = eqxscan.explain_auto(batched, jnp.zeros((5, 4)), jnp.ones((5, 6, 3)))
    assert one.cost.flops > 0 and one.cost.saved_bytes > 0
    assert five.cost.flops == 5 * one.cost.flops
    assert five.cost.saved_bytes == 5 * one.cost.saved_bytes
    assert five.cost.policy_saved_bytes == 5 * one.cost.policy_saved_bytes
    assert five.cost.carry_bytes == 5 * one.cost.carry_bytes == 5 * 16


# --- what the modules pick ------------------------------------------------------


def small_gru():
    return eqxscan.Recurrent(eqx.nn.GRUCell(2, 4, key=jr.key(1)))


def test_small_gru_saves_everything_and_big_one_recomputes(monkeypatch):
    rnn, h0, xs = small_gru(), jnp.zeros(4), jnp.ones((12, 2))
    (choice,) = eqxscan.explain_auto(rnn, h0, xs)
    assert (choice.checkpoint, choice.unroll) == (False, 1)
    assert "GRUCell" in choice.where
    # The same cell over the threshold (lowered, rather than a large model).
    total = choice.cost.saved_bytes * choice.cost.length
    monkeypatch.setattr(_auto, "SMALL_RESIDUALS", total - 1)
    (choice,) = eqxscan.explain_auto(rnn, h0, xs)
    assert choice.checkpoint is True
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    (choice,) = eqxscan.explain_auto(rnn, h0, xs)
    assert choice.checkpoint is POLICY


def test_small_lstm_recomputes():
    # Small too, but its plain scan saves 1.22x what the policy keeps (cell state
    # intermediates), and took 1.5x the loop's temp memory: over the ratio.
    rnn = eqxscan.Recurrent(eqx.nn.LSTMCell(2, 4, key=jr.key(1)))
    h0 = (jnp.zeros(4), jnp.zeros(4))
    (choice,) = eqxscan.explain_auto(rnn, h0, jnp.ones((12, 2)))
    ratio = choice.cost.saved_bytes / choice.cost.policy_saved_bytes
    assert ratio > _auto.MATMUL_DOMINATED
    assert choice.cost.saved_bytes * 12 < _auto.SMALL_RESIDUALS
    assert choice.checkpoint is True


def test_recurrent_cells_of_256_save_everything_on_cpu(monkeypatch):
    # Batch 64, 30 steps: 15-21 MiB of residuals, nearly all matmul outputs, and
    # steps of 2.6e7-3.5e7 FLOPs (so not the small-step remat). The GRU, whose
    # carry is one array, is unrolled by 2 on CPU; the LSTM (two) is not.
    for make, h0, unroll in (
        (eqx.nn.GRUCell, jnp.zeros((64, 256)), 2),
        (eqx.nn.LSTMCell, (jnp.zeros((64, 256)),) * 2, 1),
    ):
        model = eqxscan.Recurrent(make(8, 256, key=jr.key(0)))
        rnn = jax.vmap(model)
        xs = jnp.zeros((64, 30, 8))
        monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
        (choice,) = eqxscan.explain_auto(rnn, h0, xs)
        c = choice.cost
        assert c.saved_bytes * c.length > _auto.SMALL_RESIDUALS
        assert c.flops >= _auto.FULL_REMAT_FLOPS
        assert c.saved_bytes <= _auto.NEARLY_ALL_MATMUL * c.policy_saved_bytes
        assert c.carry_arrays == len(jtu.tree_leaves(h0))
        assert (choice.checkpoint, choice.unroll) == (False, unroll)
        # An explicit unroll wins.
        (fixed,) = eqxscan.explain_auto(jax.vmap(model.with_options(unroll=1)), h0, xs)
        assert (fixed.checkpoint, fixed.unroll) == (False, 1)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        (choice,) = eqxscan.explain_auto(rnn, h0, xs)
        assert (choice.checkpoint, choice.unroll) == (POLICY, 1)


def test_time_scans_unroll_by_two_on_cpu():
    # One carried array, at least TIME_UNROLL_FLOPS, nearly all matmul outputs.
    ok = dict(
        length=30,
        flops=_auto.TIME_UNROLL_FLOPS,
        saved_bytes=int(1000 * _auto.NEARLY_ALL_MATMUL),
        policy_saved_bytes=1000,
    )
    time = dict(over="time")
    assert _auto.decide(cost(**ok), "auto", "auto", POLICY, "cpu", **time)[1] == 2
    reason = _auto.decide(cost(**ok), False, "auto", POLICY, "cpu", **time)[2]
    assert "one carried array" in reason and "unroll 2" in reason
    # Each condition, just missed.
    for changes, why in (
        (dict(flops=_auto.TIME_UNROLL_FLOPS - 1), "(< 1e+07)"),
        (dict(saved_bytes=ok["saved_bytes"] + 1), "not nearly all matmul"),
        (dict(carry_arrays=2), "2 carried arrays"),
    ):
        got = _auto.decide(
            cost(**{**ok, **changes}), False, "auto", POLICY, "cpu", **time
        )
        assert got[1] == 1 and why in got[2], (changes, got)
    # Not over layers, not on accelerators, not for short scans, and never over an
    # explicit unroll.
    assert _auto.decide(cost(**ok), "auto", "auto", POLICY, "cpu")[1] == 1
    assert _auto.decide(cost(**ok), "auto", "auto", POLICY, "gpu", **time)[1] == 1
    short = cost(**{**ok, "length": _auto.SHORT_SCAN})
    assert _auto.decide(short, "auto", "auto", POLICY, "cpu", **time)[1] is True
    assert _auto.decide(cost(**ok), "auto", 3, POLICY, "cpu", **time)[1] == 3


@pytest.fixture(scope="module")
def mlp():
    return eqxscan.StackedMLP(8, 12, key=jr.key(0))


def test_mlp_recomputes_its_elementwise_work(mlp):
    # Small, but a plain scan saves ~5x what the policy keeps (GELU, norm).
    model = mlp
    (choice,) = eqxscan.explain_auto(model, jnp.ones((3, 8)))
    assert choice.cost.saved_bytes > _auto.MATMUL_DOMINATED * (
        choice.cost.policy_saved_bytes
    )
    assert choice.checkpoint is True
    assert choice.unroll == 1


def test_every_chain_group_and_direction_is_explained():
    layers = [eqx.nn.Linear(4, 4, key=k) for k in jr.split(jr.key(0), 3)]
    chain = eqxscan.Chain([*layers, eqx.nn.Lambda(jnp.tanh), *layers])
    choices = eqxscan.explain_auto(chain, jnp.ones(4))
    assert len(choices) == 2  # two scanned runs of three Linears
    cells = [eqx.nn.GRUCell(2, 4, key=k) for k in jr.split(jr.key(0), 2)]
    bi = eqxscan.Bidirectional(*cells)
    h0 = (jnp.zeros(4), jnp.zeros(4))
    assert len(eqxscan.explain_auto(bi, h0, jnp.ones((5, 2)))) == 2


def test_explicit_options_always_win():
    rnn, h0, xs = small_gru(), jnp.zeros(4), jnp.ones((12, 2))
    assert (
        eqxscan.explain_auto(rnn.with_options(checkpoint=True, unroll=1), h0, xs) == []
    )
    (c,) = eqxscan.explain_auto(rnn.with_options(checkpoint=True), h0, xs)
    assert (c.checkpoint, c.unroll) == (True, 1)
    (c,) = eqxscan.explain_auto(rnn.with_options(unroll=3), h0, xs)
    assert (c.checkpoint, c.unroll) == (False, 3)

    # ... and in the traced program: an explicit remat is there, "auto" has none.
    def remats(m):
        text = str(jax.make_jaxpr(jax.grad(lambda h: m(h, xs)[0].sum()))(h0))
        return text.count("checkpoint") + text.count("remat")

    assert remats(rnn) == 0
    assert remats(rnn.with_options(checkpoint=True)) > 0
    assert remats(rnn.with_options(checkpoint=POLICY)) > 0


def test_a_step_that_cannot_be_differentiated_still_runs():
    # A pure_callback has no derivative: "auto" must not be what raises.
    def layer(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(lambda a: np.cos(a).astype(a.dtype), shape, x)

    stack = eqxscan.Stacked(lambda k: eqx.nn.Lambda(layer), 2, key=jr.key(0))
    (choice,) = eqxscan.explain_auto(stack, jnp.ones(3))
    assert choice.cost.saved_bytes == 0 and choice.checkpoint is False
    np.testing.assert_allclose(stack(jnp.ones(3)), np.cos(np.cos(np.ones(3))))


def test_choice_is_deterministic(mlp):
    # Same shapes, other values: the same choice, every time.
    model = mlp
    other = jax.tree.map(lambda a: a + 1 if eqx.is_inexact_array(a) else a, mlp)
    x = jnp.ones((2, 8))
    a, b, c = (eqxscan.explain_auto(m, x) for m in (model, model, other))
    assert [repr(x) for x in a] == [repr(x) for x in b] == [repr(x) for x in c]
    assert a[0].cost == b[0].cost == c[0].cost


# --- equal values and gradients for every choice --------------------------------


def _forced(monkeypatch, choice):
    if choice == "save-all":
        monkeypatch.setattr(_auto, "SMALL_RESIDUALS", 2**62)
        monkeypatch.setattr(_auto, "MATMUL_DOMINATED", float("inf"))
    else:
        monkeypatch.setattr(_auto, "SMALL_RESIDUALS", -1)
        if choice == "policy":
            monkeypatch.setattr(_auto, "CPU_PLATFORMS", ())


def _value_and_grad(m, *args):
    dyn, static = eqx.partition(m, eqx.is_inexact_array)

    def loss(d):
        out = eqx.combine(d, static)(*args)
        return sum(jnp.sum(jnp.sin(a)) for a in jax.tree.leaves(out))

    return jax.jit(jax.value_and_grad(loss))(dyn)


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def _mlp_options(m, **options):
    return eqx.tree_at(lambda t: t.blocks, m, m.blocks.with_options(**options))


@pytest.fixture(scope="module")
def problems(mlp):
    """Two models with their inputs and reference results (loop, plain scan),
    computed once for every forced choice."""
    rnn = small_gru()
    cases = [
        (mlp, (jr.normal(jr.key(1), (2, 8)),), _mlp_options),
        (
            rnn,
            (jr.normal(jr.key(2), (4,)), jr.normal(jr.key(3), (12, 2))),
            lambda m, **o: m.with_options(**o),
        ),
    ]
    return [
        (
            model,
            args,
            _value_and_grad(opts(model, mode="loop"), *args),
            _value_and_grad(opts(model, checkpoint=False, unroll=1), *args),
        )
        for model, args, opts in cases
    ]


@pytest.mark.parametrize("choice", ["save-all", "remat", "policy"])
def test_every_choice_matches_the_loop_and_the_plain_scan(
    monkeypatch, problems, choice
):
    _forced(monkeypatch, choice)
    expected = {"save-all": False, "remat": True, "policy": POLICY}[choice]
    for model, args, loop, plain in problems:
        (picked,) = eqxscan.explain_auto(model, *args)
        assert picked.checkpoint is expected
        got = _value_and_grad(model, *args)
        _close(got, loop)
        _close(got, plain)


def test_unroll_by_two_matches_the_loop(monkeypatch):
    # The time-scan unroll, forced on a small GRU over an odd number of steps
    # (13: six pairs and one step), against the loop and the plain scan.
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(_auto, "TIME_UNROLL_FLOPS", 0)
    rnn = small_gru()
    args = (jr.normal(jr.key(2), (4,)), jr.normal(jr.key(3), (13, 2)))
    (picked,) = eqxscan.explain_auto(rnn, *args)
    assert picked.unroll == 2
    assert "scan" in str(jax.make_jaxpr(lambda h, x: rnn(h, x))(*args))
    got = _value_and_grad(rnn, *args)
    _close(got, _value_and_grad(rnn.with_options(mode="loop"), *args))
    _close(got, _value_and_grad(rnn.with_options(checkpoint=False, unroll=1), *args))
