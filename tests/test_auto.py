"""`remat="auto"` and `unroll="auto"`: the rule's choices, explicit options
winning, and equal values and gradients whatever the rule picks."""

import contextlib
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxscan
from eqxscan._scan import auto as _auto


def _thresholds(monkeypatch, **changes):
    """Run "auto" with other thresholds."""
    new = dataclasses.replace(_auto.THRESHOLDS, **changes)
    monkeypatch.setattr(_auto, "THRESHOLDS", new)


def cost(**changes):
    base = dict(
        length=8,
        flops=10_000,
        carry_bytes=256,
        saved_bytes=1000,
        policy_saved_bytes=900,
    )
    return eqxscan.remat.StepCost(**{**base, **changes})


POLICY = eqxscan.remat.matmul_policy
T = _auto.THRESHOLDS


def pick(c, remat="auto", unroll="auto", platform="cpu", **kwargs):
    """`(remat, unroll, remat rule, unroll rule)` that `decide` gives."""
    d = _auto.decide(c, remat, unroll, platform, **kwargs)
    assert isinstance(d.rule, _auto.AutoRule)
    return d.remat, d.unroll, d.rule.remat, d.rule.unroll


# --- the rule on synthetic costs: both sides of every threshold ---------------


def test_small_and_matmul_dominated_saves_everything():
    small = T.small_residuals // 8  # x length 8: exactly the threshold
    c = cost(saved_bytes=small, policy_saved_bytes=small)
    assert pick(c, unroll=1) == (False, 1, "small", "given")
    assert pick(c, unroll=1, platform="gpu") == (False, 1, "small", "given")


def test_a_carry_larger_than_the_residuals_saves_everything():
    # A remat'd step saves its carry: a KV cache carried whole would be saved
    # once a layer (L x the cache), where a plain scan saves slices of it.
    over = T.small_residuals // 8 + 1
    at = cost(saved_bytes=over, policy_saved_bytes=over, carry_bytes=2 * over)
    under = cost(saved_bytes=over, policy_saved_bytes=over, carry_bytes=2 * over - 1)
    for platform in ("cpu", "tpu"):
        assert pick(at, unroll=1, platform=platform)[::2] == (False, "carry")
    assert pick(under, unroll=1)[::2] == (True, "small-step")
    assert pick(under, unroll=1, platform="tpu")[::2] == (POLICY, "policy")
    assert "carry (16.00 MiB)" in repr(
        _auto.decide(cost(saved_bytes=over, carry_bytes=16 * 2**20), "auto", 1, "cpu")
    )


def test_over_the_size_threshold_recomputes():
    over = T.small_residuals // 8 + 1
    c = cost(saved_bytes=over, policy_saved_bytes=over)
    assert pick(c, unroll=1) == (True, 1, "small-step", "given")
    assert pick(c, unroll=1, platform="gpu") == (POLICY, 1, "policy", "given")


def test_big_steps_keep_matmul_outputs_on_cpu_too():
    over = T.small_residuals
    small = cost(saved_bytes=over, flops=T.full_remat_flops - 1)
    big = cost(saved_bytes=over, flops=T.full_remat_flops)
    assert pick(small, unroll=1)[:3] == (True, 1, "small-step")
    assert pick(big, unroll=1)[:3] == (POLICY, 1, "policy")
    assert pick(small, unroll=1, platform="gpu")[:3] == (POLICY, 1, "policy")


def test_large_matmul_outputs_recompute_on_cpu():
    # Big steps (so not the FLOPs rule), length 8: the policy's total is
    # 8 x policy_saved_bytes, compared with full_remat_residuals.
    limit = T.full_remat_residuals // 8
    big = dict(flops=T.full_remat_flops, saved_bytes=2 * limit)
    at = cost(policy_saved_bytes=limit, **big)
    over = cost(policy_saved_bytes=limit + 1, **big)
    assert pick(at, unroll=1)[2] == "policy"
    assert pick(over, unroll=1)[::2] == (True, "large-matmuls")
    assert pick(over, unroll=1, platform="gpu")[::2] == (POLICY, "policy")


def test_nearly_all_matmul_outputs_save_everything_on_cpu():
    # Big steps, more than small_residuals, matmul outputs under
    # full_remat_residuals: the ratio decides between saving all and the policy.
    policy = T.small_residuals // 8
    big = dict(flops=T.full_remat_flops, policy_saved_bytes=policy)
    at = cost(saved_bytes=int(policy * T.nearly_all_matmul), **big)
    over = cost(saved_bytes=int(policy * T.nearly_all_matmul) + 1, **big)
    assert at.saved_total > T.small_residuals
    assert pick(at, unroll=1)[::2] == (False, "nearly-all-matmul")
    assert pick(over, unroll=1)[::2] == (POLICY, "policy")
    assert pick(at, unroll=1, platform="gpu")[::2] == (POLICY, "policy")
    # Full remat still wins for small steps and for large matmul outputs.
    small = cost(saved_bytes=at.saved_bytes, policy_saved_bytes=policy)
    assert pick(small, unroll=1)[::2] == (True, "small-step")
    limit = T.full_remat_residuals // 8 + 1
    large = cost(flops=T.full_remat_flops, saved_bytes=limit, policy_saved_bytes=limit)
    assert pick(large, unroll=1)[::2] == (True, "large-matmuls")


def test_over_the_elementwise_ratio_recomputes():
    ratio = T.matmul_dominated
    at = cost(saved_bytes=int(1000 * ratio), policy_saved_bytes=1000)
    over = cost(saved_bytes=int(1000 * ratio) + 1, policy_saved_bytes=1000)
    assert pick(at, unroll=1)[::2] == (False, "small")
    assert pick(over, unroll=1)[::2] == (True, "small-step")
    assert pick(over, unroll=1, platform="tpu")[::2] == (POLICY, "policy")


def test_short_small_scans_unroll_fully_and_save_what_the_loop_saves():
    short = cost(length=T.short_scan, saved_bytes=10**9)
    unrolled = (False, True, "unrolled", "short")
    assert pick(short) == unrolled
    assert pick(short, platform="gpu") == unrolled
    # An explicit remat is kept, by a scan (unrolled, XLA:CPU recomputed
    # nothing: more temp than remat=False); `False` unrolls as "auto" would; an
    # explicit full unroll saves as the loop does.
    assert pick(short, remat=True) == (True, 1, "given", "remat")
    assert pick(short, remat=False) == (False, True, "given", "short")
    assert pick(short, remat=True, platform="tpu") == (True, 1, "given", "remat")
    assert pick(cost(), unroll=True) == (False, True, "unrolled", "given")
    longer = cost(length=T.short_scan + 1, saved_bytes=10**9)
    assert pick(longer) == (True, 1, "small-step", "scan")
    # The FLOPs bound is on the whole scan: steps times FLOPs per step.
    per_step = T.unroll_flops // T.short_scan
    under = cost(length=T.short_scan, flops=per_step - 1, saved_bytes=10**9)
    assert pick(under) == unrolled
    at = cost(length=T.short_scan, flops=per_step, saved_bytes=10**9)
    assert pick(at) == (POLICY, 1, "policy", "scan")
    two = cost(length=2, flops=T.unroll_flops // 2, saved_bytes=10**9)
    assert pick(two) == (POLICY, 1, "policy", "scan")
    fewer = cost(length=2, flops=T.unroll_flops // 2 - 1, saved_bytes=10**9)
    assert pick(fewer) == unrolled


def test_full_unroll_is_the_loops_program():
    stack = eqxscan.StackedMLP(8, 3, key=jr.key(0))
    x = jr.normal(jr.key(1), (2, 8))
    (choice,) = eqxscan.explain_auto(stack, x)
    assert (choice.remat, choice.unroll) == (False, True)

    def lowered(m):
        dyn, static = eqx.partition(m, eqx.is_inexact_array)
        loss = lambda d: jnp.mean(eqx.combine(d, static)(x) ** 2)
        return jax.jit(jax.value_and_grad(loss)).lower(dyn).as_text()

    loop = lowered(_mlp_options(stack, mode="loop"))
    assert lowered(stack) == loop
    assert lowered(_mlp_options(stack, remat=False, unroll=True)) == loop
    assert "while" not in loop
    assert "while" in lowered(_mlp_options(stack, unroll=1))


def test_an_explanation_names_offload_as_it_was_given():
    stack = eqxscan.StackedMLP(8, 3, key=jr.key(0), remat="offload")
    (choice,) = eqxscan.explain_auto(stack, jr.normal(jr.key(1), (2, 8)))
    assert "remat='offload'" in repr(choice), choice  # not the policy's "policy"


def _scanned(unroll):
    # `True == 1` in Python: a full unroll must not pass for `unroll=1`.
    return unroll is not True and unroll == 1


def test_what_is_unrolled_depends_on_depth_and_the_whole_scans_flops(monkeypatch):
    def picked(width, depth, tokens=64):
        stack = eqxscan.StackedMLP(width, depth, key=jr.key(0))
        x = jax.ShapeDtypeStruct((tokens, width), jnp.float32)
        (choice,) = eqxscan.explain_auto(stack, x)
        return choice

    # 8 small layers: the loop's program; 9: scanned.
    assert picked(8, T.short_scan).unroll is True
    assert _scanned(picked(8, T.short_scan + 1).unroll)
    # Width 64: 128 KiB of weights a layer, which unrolled would be copied at once.
    assert picked(64, 4).rule.unroll == "copies" and _scanned(picked(64, 4).unroll)
    # Width 64 over 2304 tokens: 1.5e8 FLOPs a layer, unrolled at 4 layers (6e8
    # in all) but not at 8 (1.2e9), when copies are allowed.
    _thresholds(monkeypatch, unroll_copies=2**30)
    four, eight = picked(64, 4, tokens=2304), picked(64, 8, tokens=2304)
    assert 4 * four.cost.flops < T.unroll_flops < 8 * eight.cost.flops
    assert four.unroll is True and _scanned(eight.unroll)
    assert (four.rule.unroll, eight.rule.unroll) == ("short", "scan")


def test_unrolled_only_when_the_weights_copied_at_once_are_few():
    # Unrolled, every layer's weights are sliced out of the stack at once; a
    # scan holds one layer's. Over time the cell's weights are not sliced.
    small = cost(length=T.short_scan, xs_bytes=T.unroll_copies // (T.short_scan - 1))
    big = cost(length=T.short_scan, xs_bytes=small.xs_bytes + 1)
    assert pick(small)[1::2] == (True, "short")
    assert pick(big)[1::2] == (1, "copies")
    assert pick(big, over="time")[1::2] == (True, "short")
    assert pick(cost(length=1, xs_bytes=2**30))[1::2] == (True, "short")
    assert "copied at once" in _auto.decide(big, "auto", "auto", "cpu").reason


def _temp(fn, *args, donate=()):
    dyn, static = eqx.partition(args, eqx.is_array)
    run = jax.jit(lambda *d: fn(*eqx.combine(d, static)), donate_argnums=donate)
    return run.lower(*dyn).compile().memory_analysis().temp_size_in_bytes


def _nbytes(tree):
    return sum(a.nbytes for a in jtu.tree_leaves(eqx.filter(tree, eqx.is_array)))


class Decode(eqx.Module):
    """A decode layer writing its key and value at `pos` into its cache."""

    wkv: jax.Array
    wo: jax.Array

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.wkv = 0.1 * jr.normal(k1, (64, 128))
        self.wo = 0.1 * jr.normal(k2, (64, 64))

    def __call__(self, x, cache, pos):
        k, v = jnp.split(x @ self.wkv, 2, -1)
        kc = jax.lax.dynamic_update_slice(cache[0], k, (pos, 0))
        vc = jax.lax.dynamic_update_slice(cache[1], v, (pos, 0))
        o = jax.nn.softmax(x @ kc.T, -1) @ vc
        return x + jnp.tanh(o @ self.wo), (kc, vc)


@pytest.mark.parametrize("depth", [2, 4, 8])
def test_default_temp_at_most_the_loops_for_short_stacks(depth):
    # XLA's own memory analysis of the default against `mode="loop"` and
    # against a Python loop over separate layers (each layer's weights read in
    # place). The slack over the latter is what a scan step holds: one layer's
    # weights (and, decoding, one layer's cache slice). Unrolled, XLA sliced
    # every layer's weights out of the stack at once (temp 8x the loop's).
    stack = eqxscan.StackedMLP(64, depth, key=jr.key(0)).blocks
    loop = stack.with_options(mode="loop")
    layers = stack.unstack()
    x = jnp.ones((8, 64))
    one_layer = _nbytes(layers[0])

    def call(m, x):
        if isinstance(m, list):
            for layer in m:
                x = layer(x)
            return x
        return m(x)

    def train(m, x):
        return eqx.filter_grad(lambda m: jnp.mean(call(m, x) ** 2))(m)

    for fn in (call, train):
        temp, hand = _temp(fn, stack, x), _temp(fn, layers, x)
        assert temp <= _temp(fn, loop, x)
        assert temp <= hand + one_layer, (fn.__name__, temp, hand, one_layer)

    t = 1024
    dec = eqxscan.Stacked(Decode, depth, key=jr.key(1))
    cache = (jnp.zeros((depth, t, 64)), jnp.zeros((depth, t, 64)))
    caches = [(cache[0][i], cache[1][i]) for i in range(depth)]
    y = jnp.ones((1, 64))

    def step(m, y, c):
        return m(y, eqxscan.buffer(c), pos=7)

    def step_by_hand(ls, y, cs):
        out = []
        for layer, c in zip(ls, cs):
            y, c = layer(y, c, 7)
            out.append(c)
        return y, out

    temp = _temp(step, dec, y, cache, donate=2)
    hand = _temp(step_by_hand, dec.unstack(), y, caches, donate=2)
    assert temp <= _temp(step, dec.with_options(mode="loop"), y, cache, donate=2)
    slack = _nbytes(dec.unstack()[0]) + 2 * t * 64 * 4
    assert temp <= hand + slack, (temp, hand, slack)


def test_a_stack_that_gathers_its_layers_stays_scanned():
    # FSDP: each step all-gathers one layer. Unrolled, XLA may gather all of them
    # at once, so "auto" keeps the scan even where it would unroll.
    short = cost(length=2, saved_bytes=10**9)
    assert pick(short)[1] is True
    _, unroll, _, rule = pick(short, gathered=True)
    assert _scanned(unroll) and rule == "sharded"
    assert pick(short, unroll=True, gathered=True)[1::2] == (True, "given")
    stack = eqxscan.StackedMLP(8, 3, key=jr.key(0))
    x = jnp.ones((2, 8))
    (plain,) = eqxscan.explain_auto(stack, x)
    assert plain.unroll is True
    for devices in (2, 1):  # over one device nothing is gathered: the plain step
        mesh = jax.make_mesh((devices,), ("fsdp",), devices=jax.devices()[:devices])
        sharded = eqxscan.sharding.gather_layers(stack, mesh)
        (gathered,) = eqxscan.explain_auto(sharded, x)
        assert _scanned(gathered.unroll) if devices > 1 else gathered.unroll is True


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
        assert (got.rule.unroll == "sharded") is scanned
        np.testing.assert_allclose(out, stack(x), rtol=1e-5, atol=1e-6)


def test_decide_leaves_explicit_values_alone():
    c = cost(saved_bytes=10**9)
    for remat in (False, True, POLICY, "nested"):
        for unroll in (1, 3, True):
            assert pick(c, remat, unroll) == (remat, unroll, "given", "given")


def test_reason_names_the_numbers():
    # The one test of the prose: it is derived from the rule and the cost.
    mib = 2**20
    c = cost(length=12, flops=10**7, saved_bytes=24 * mib, policy_saved_bytes=8 * mib)
    d = _auto.decide(c, "auto", "auto", "cpu")
    assert isinstance(d, eqxscan.remat.AutoChoice)
    reason = d.reason
    assert (d.rule.remat, d.rule.unroll) == ("large-matmuls", "scan")
    for number in ("12 steps", "1e+07 FLOPs", "288.00 MiB", "3.00x", "96.00 MiB"):
        assert number in reason, (number, reason)
    assert "64.00 MiB of matmul outputs" in reason


def test_reason_names_which_small_condition_failed():
    # A step is not "small" for too many residual bytes or too high a ratio to
    # the matmul outputs; the reason names the one that failed.
    too_big = f"more than {T.small_residuals / 2**20:.2f} MiB"
    too_elementwise = f"more than {T.matmul_dominated}x"
    ratio = T.matmul_dominated
    bytes_over = T.small_residuals // cost().length + 1  # in all; a ratio of 1
    for c, want, not_want in (
        (
            cost(saved_bytes=bytes_over, policy_saved_bytes=bytes_over),
            too_big,
            too_elementwise,
        ),
        (
            cost(saved_bytes=int(1000 * ratio) + 1, policy_saved_bytes=1000),
            too_elementwise,
            too_big,
        ),
    ):
        d = _auto.decide(c, "auto", 1, "cpu")
        assert d.rule.remat not in ("small", "given"), d.rule
        assert want in d.reason and not_want not in d.reason, d.reason


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
    jaxpr = jax.make_jaxpr(step)(c, xs[0])
    got = _auto.measure_traced(jaxpr, 1, (c, xs), 5, "cpu")
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
    # The inputs a `vmap` maps count once per example, the weights it does not
    # once (they were counted 64 times, and "copies" kept the stack scanned).
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(16, 16, key=k), 4, key=jr.key(0))
    (alone,) = eqxscan.explain_auto(stack, jnp.ones(16))
    (mapped,) = eqxscan.explain_auto(jax.vmap(stack), jnp.ones((64, 16)))
    assert alone.cost.xs_bytes >= (16 * 16 + 16) * 4
    assert mapped.cost.xs_bytes == alone.cost.xs_bytes
    assert mapped.cost.carry_bytes == 64 * alone.cost.carry_bytes
    assert (mapped.unroll, mapped.rule.unroll) == (alone.unroll, alone.rule.unroll)


def test_an_eager_vmap_measures_the_whole_batch(monkeypatch):
    # Under an eager `vmap` the cached eager program is traced for one example:
    # the rule measured one (and could save everything of a large batch).
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(12, 12, key=k), 3, key=jr.key(0))
    seen = []
    real = _auto.measure_traced
    monkeypatch.setattr(
        _auto, "measure_traced", lambda *a: seen.append(real(*a)) or seen[-1]
    )
    for batch in (40, 7):
        x = jnp.ones((batch, 12))
        (want,) = eqxscan.explain_auto(jax.vmap(stack), x)
        seen.clear()
        jax.vmap(stack)(x)
        eqx.filter_grad(lambda s, x: jnp.sum(jax.vmap(s)(x)))(stack, x)
        assert seen and all(cost == want.cost for cost in seen)
        assert want.cost.carry_bytes == batch * 12 * 4


# --- what the modules pick ------------------------------------------------------


def small_gru():
    return eqxscan.Recurrent(eqx.nn.GRUCell(2, 4, key=jr.key(1)))


def test_small_gru_saves_everything_and_big_one_recomputes(monkeypatch):
    rnn, h0, xs = small_gru(), jnp.zeros(4), jnp.ones((12, 2))
    (choice,) = eqxscan.explain_auto(rnn, h0, xs)
    assert (choice.remat, choice.unroll) == (False, 1)
    assert "GRUCell" in choice.where
    # The same cell over the threshold (lowered, rather than a large model).
    total = choice.cost.saved_bytes * choice.cost.length
    _thresholds(monkeypatch, small_residuals=total - 1)
    (choice,) = eqxscan.explain_auto(rnn, h0, xs)
    assert choice.remat is True
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    (choice,) = eqxscan.explain_auto(rnn, h0, xs)
    assert choice.remat is POLICY


def test_small_lstm_recomputes():
    # Small too, but its plain scan saves 1.22x what the policy keeps (cell state
    # intermediates), and took 1.5x the loop's temp memory: over the ratio.
    rnn = eqxscan.Recurrent(eqx.nn.LSTMCell(2, 4, key=jr.key(1)))
    h0 = (jnp.zeros(4), jnp.zeros(4))
    (choice,) = eqxscan.explain_auto(rnn, h0, jnp.ones((12, 2)))
    assert choice.cost.ratio > T.matmul_dominated
    assert choice.cost.saved_total < T.small_residuals
    assert (choice.remat, choice.rule.remat) == (True, "small-step")


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
        assert c.saved_total > T.small_residuals
        assert c.flops >= T.full_remat_flops
        assert c.ratio <= T.nearly_all_matmul
        assert c.carry_arrays == len(jtu.tree_leaves(h0))
        assert (choice.remat, choice.unroll) == (False, unroll)
        assert choice.rule.remat == "nearly-all-matmul"
        assert choice.rule.unroll == ("time" if unroll == 2 else "scan")
        # An explicit unroll wins.
        (fixed,) = eqxscan.explain_auto(jax.vmap(model.with_options(unroll=1)), h0, xs)
        assert (fixed.remat, fixed.unroll) == (False, 1)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        (choice,) = eqxscan.explain_auto(rnn, h0, xs)
        assert (choice.remat, choice.unroll) == (POLICY, 1)


def test_time_scans_unroll_by_two_on_cpu():
    # One carried array, at least time_unroll_flops, nearly all matmul outputs.
    ok = dict(
        length=30,
        flops=T.time_unroll_flops,
        saved_bytes=int(1000 * T.nearly_all_matmul),
        policy_saved_bytes=1000,
    )
    time = dict(over="time")
    assert pick(cost(**ok), **time)[1::2] == (2, "time")
    assert pick(cost(**ok), False, **time)[1::2] == (2, "time")
    # Each condition, just missed: unroll 1, and the reason says which.
    for changes, why in (
        (dict(flops=T.time_unroll_flops - 1), "(< 1e+07)"),
        (dict(saved_bytes=ok["saved_bytes"] + 1), "not nearly all matmul"),
        (dict(carry_arrays=2), "2 carried arrays"),
    ):
        c = cost(**{**ok, **changes})
        assert pick(c, False, **time)[1::2] == (1, "scan"), changes
        d = _auto.decide(c, False, "auto", "cpu", **time)
        assert why in d.reason, (changes, d)
    # Not over layers, not on accelerators, not for short scans, and never over an
    # explicit unroll.
    assert pick(cost(**ok))[1::2] == (1, "scan")
    assert pick(cost(**ok), platform="gpu", **time)[1::2] == (1, "scan")
    short = cost(**{**ok, "length": T.short_scan})
    assert pick(short, **time)[1::2] == (True, "short")
    assert pick(cost(**ok), unroll=3, **time)[1::2] == (3, "given")


@pytest.fixture(scope="module")
def mlp():
    return eqxscan.StackedMLP(8, 12, key=jr.key(0))


def test_mlp_recomputes_its_elementwise_work(mlp):
    # Small, but a plain scan saves ~5x what the policy keeps (GELU, norm).
    model = mlp
    (choice,) = eqxscan.explain_auto(model, jnp.ones((3, 8)))
    assert choice.cost.ratio > T.matmul_dominated
    assert (choice.remat, choice.unroll) == (True, 1)
    assert (choice.rule.remat, choice.rule.unroll) == ("small-step", "scan")


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
    assert eqxscan.explain_auto(rnn.with_options(remat=True, unroll=1), h0, xs) == []
    (c,) = eqxscan.explain_auto(rnn.with_options(remat=True), h0, xs)
    assert (c.remat, c.unroll, c.rule.remat) == (True, 1, "given")
    (c,) = eqxscan.explain_auto(rnn.with_options(unroll=3), h0, xs)
    assert (c.remat, c.unroll, c.rule.unroll) == (False, 3, "given")

    # ... and in the traced program: an explicit remat is there, "auto" has none.
    def remats(m):
        text = str(jax.make_jaxpr(jax.grad(lambda h: m(h, xs)[0].sum()))(h0))
        return text.count("checkpoint") + text.count("remat")

    assert remats(rnn) == 0
    assert remats(rnn.with_options(remat=True)) > 0
    assert remats(rnn.with_options(remat=POLICY)) > 0


def test_a_step_that_cannot_be_differentiated_still_runs():
    # A pure_callback has no derivative: "auto" must not be what raises.
    def layer(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(lambda a: np.cos(a).astype(a.dtype), shape, x)

    stack = eqxscan.Stacked(lambda k: eqx.nn.Lambda(layer), 2, key=jr.key(0))
    (choice,) = eqxscan.explain_auto(stack, jnp.ones(3))
    assert choice.cost.saved_bytes == 0 and choice.remat is False
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
        _thresholds(monkeypatch, small_residuals=2**62, matmul_dominated=float("inf"))
    elif choice == "remat":
        _thresholds(monkeypatch, small_residuals=-1)
    else:
        # As on an accelerator, without its unrolling of memory-bound layers.
        _thresholds(
            monkeypatch, small_residuals=-1, cpu_platforms=(), memory_bound_layers=0
        )


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
            _value_and_grad(opts(model, remat=False, unroll=1), *args),
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
        assert picked.remat is expected
        got = _value_and_grad(model, *args)
        _close(got, loop)
        _close(got, plain)


def test_unroll_by_two_matches_the_loop(monkeypatch):
    # The time-scan unroll, forced on a small GRU over an odd number of steps
    # (13: six pairs and one step), against the loop and the plain scan.
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    _thresholds(monkeypatch, time_unroll_flops=0)
    rnn = small_gru()
    args = (jr.normal(jr.key(2), (4,)), jr.normal(jr.key(3), (13, 2)))
    (picked,) = eqxscan.explain_auto(rnn, *args)
    assert picked.unroll == 2
    assert "scan" in str(jax.make_jaxpr(lambda h, x: rnn(h, x))(*args))
    got = _value_and_grad(rnn, *args)
    _close(got, _value_and_grad(rnn.with_options(mode="loop"), *args))
    _close(got, _value_and_grad(rnn.with_options(remat=False, unroll=1), *args))


def test_memory_bound_layers_are_unrolled_fully_off_cpu_only():
    # A decode-sized step (few FLOPs per byte of its layer's weights) over at
    # most `memory_bound_layers` layers: unrolled fully on an accelerator, where
    # the scan's per-step cost is not hidden; kept a scan on CPU and over time.
    weights = 64 * 2**20
    bound = cost(length=16, flops=T.memory_bound_intensity * weights, xs_bytes=weights)
    heavier = cost(length=16, flops=bound.flops + 1, xs_bytes=weights)
    longer = cost(length=T.memory_bound_layers + 1, flops=bound.flops, xs_bytes=weights)
    assert pick(bound, platform="tpu") == (False, True, "unrolled", "memory-bound")
    assert pick(bound, platform="gpu")[1::2] == (True, "memory-bound")
    assert pick(heavier, platform="tpu")[1::2] == (1, "scan")
    assert pick(longer, platform="tpu")[1::2] == (1, "scan")
    assert pick(bound, platform="cpu")[1::2] == (1, "scan")
    assert pick(bound, platform="tpu", over="time")[1::2] == (1, "scan")
    assert pick(bound, platform="tpu", gathered=True)[1::2] == (1, "sharded")
    few = cost(length=16, flops=bound.flops, xs_bytes=weights, xs_copied_bytes=1)
    assert pick(few, platform="tpu")[1::2] == (True, "memory-bound")
    edge = cost(
        length=16, flops=bound.flops, xs_bytes=weights, xs_copied_bytes=weights // 100
    )
    assert pick(edge, platform="tpu")[1::2] == (True, "memory-bound")
    packed = cost(
        length=16,
        flops=bound.flops,
        xs_bytes=weights,
        xs_copied_bytes=weights // 100 + 1,
    )
    assert pick(packed, platform="tpu")[1::2] == (1, "scan")
    assert "FLOPs per byte" in _auto.decide(bound, "auto", "auto", "tpu").reason


def test_copied_inputs_follow_the_platforms_branch_and_kept_bits():
    # An input counts where its bits (cast, masked, reshaped: not computed on)
    # reach a shift on the platform's own branch; "gpu" takes `cuda=` branches.
    def shift_on(**where):
        def f(b, n, w):
            def shifted(b):
                return ((b.astype(jnp.uint32) & 15).reshape(2, 2) << 1).astype(w.dtype)

            branches = {k: shifted for k in where} | dict(
                default=lambda b: b.reshape(2, 2).astype(w.dtype)
            )
            # `n` is shifted after a sum: a new value, not its bits.
            product = jax.lax.platform_dependent(b, **branches) @ w
            return product + ((n + 1) << 2).astype(w.dtype)

        args = jnp.zeros(4, jnp.uint8), jnp.int32(0), jnp.ones((2, 2))
        jaxpr = jax.make_jaxpr(f)(*args).jaxpr
        return {p: _auto._copied_inputs(jaxpr, p) for p in ("cpu", "gpu", "tpu")}

    assert shift_on(cpu=True) == dict(cpu={0}, gpu=set(), tpu=set())
    assert shift_on(cuda=True) == dict(cpu=set(), gpu={0}, tpu=set())
    assert shift_on(tpu=True, cpu=True) == dict(cpu={0}, gpu=set(), tpu={0})


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_a_quantized_stack_counts_the_bytes_it_unpacks(monkeypatch, platform):
    # The memory-bound unroll keeps a stack scanned when its step unpacks
    # integer weights bit by bit (unrolled, XLA:TPU unpacked packed int4 for
    # every layer at once) or hands them to a kernel (copied out of the stack),
    # on the platform's own branch of the quantized product: fp8 is decoded so
    # on CPU only; int8 and native int4 never are.
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    model = eqxscan.StackedMLP(256, 16, key=jr.key(0))
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    (plain,) = eqxscan.explain_auto(model, x)
    assert plain.cost.xs_copied_bytes == 0
    # One layer's w1 and w2 values at one byte a weight, and at half a byte.
    byte, nibble = 2 * 256 * 1024, 256 * 1024
    where = ["blocks.*.w1", "blocks.*.w2"]
    int4 = eqxscan.quant.quantize(model, where, kind="int4")
    stacks = {
        "int8": (eqxscan.quant.quantize(model, where, kind="int8"), 0),
        "fp8": (
            eqxscan.quant.quantize(model, where, kind="fp8"),
            byte if platform == "cpu" else 0,
        ),
        "packed": (eqxscan.quant.with_int4_storage(int4, "packed"), nibble),
        "native": (eqxscan.quant.with_int4_storage(int4, "native"), 0),
        # The Pallas kernel (in its interpreter: a `pallas_call` all the same)
        # is handed the values and their scales.
        "kernel": (
            eqxscan.quant.quantize(model, where, kind="int8", kernel="interpret"),
            byte + 4 * (1024 + 256),
        ),
    }

    # A float decode step (8 rows) is bound by its weights; 2048 rows (2048
    # FLOPs a float32 byte) are not, and stay a scan.
    def rule_for(rows):
        (choice,) = eqxscan.explain_auto(model, x.update(shape=(rows, 256)))
        return choice.rule.unroll

    assert rule_for(8) == ("scan" if platform == "cpu" else "memory-bound")
    assert rule_for(2048) == "scan"
    for name, (q, unpacked) in stacks.items():
        (choice,) = eqxscan.explain_auto(q, x)
        values = byte if name in ("int8", "fp8", "kernel") else nibble
        assert choice.cost.xs_bytes >= values, name
        assert choice.cost.xs_copied_bytes == unpacked, name
        # A decode step of 16 layers: unrolled fully off CPU unless unpacked.
        unrolled = platform != "cpu" and not unpacked
        assert (choice.rule.unroll == "memory-bound") is unrolled, name
        assert (choice.unroll is True) is unrolled, name
        if platform != "cpu" and unpacked:
            assert "handed to a kernel" in choice.reason, name


def test_auto_policy_saves_products_in_their_readers_layout():
    # `eqx.nn.Linear` under `vmap` is `W @ x` then a transpose moving the batch
    # axes to the front: the policy keeps that transpose (not the product in
    # the other layout, nor the 2-D transpose of a weight), or the split into
    # heads that follows it (4 axes; not a weight's 3-axis reshape), and
    # recomputes the elementwise rest.
    from jax._src.ad_checkpoint import saved_residuals

    lin = jax.vmap(jax.vmap(eqx.nn.Linear(8, 16, key=jr.key(0))))
    x, w = jnp.ones((2, 3, 8)), jnp.ones((16, 8))

    def kept(f):
        saved = saved_residuals(jax.checkpoint(f, policy=POLICY), x, w)
        return sorted(
            (aval.shape, why.split(" from")[0])
            for aval, why in saved
            if "argument" not in why and "constant" not in why
        )

    def products(x, w):
        return jnp.sin(lin(x)).sum() + jnp.cos(w.T @ w).sum()

    def heads(x, w):
        return (
            jnp.sin(lin(x).reshape(2, 3, 2, 8)).sum()
            + jnp.cos(w.reshape(2, 8, 8)).sum()
        )

    assert kept(products) == [
        ((2, 3, 16), "output of transpose"),
        ((8, 8), "output of dot_general"),
    ]
    assert kept(heads) == [((2, 3, 2, 8), "output of reshape")]


def test_explain_auto_sees_a_jitted_step_that_already_ran():
    # The step's jit served its cached program, so no scan was traced and
    # explain_auto returned [] ("no scan used auto").
    model = eqxscan.StackedMLP(16, 12, key=jr.key(0))
    x = jnp.ones((8, 16))
    step = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.mean(m(x) ** 2)))
    before = eqxscan.explain_auto(step, model, x)
    step(model, x)
    after = eqxscan.explain_auto(step, model, x)
    assert len(before) == 1 and after == before
    assert eqxscan.explain_auto(lambda x: x + 1, x) == []  # no scan: still empty
