"""`eqxscan.planning.plan`: per-device figures of ahead-of-time compiled
candidates, checked against analytic counts, against the arrays really placed on
8 simulated devices, and against one device's training losses."""

import json
import runpy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks.bench import meshes as bench
from eqxscan import sharding
from eqxscan.planning import Accelerator, MeshPlan, plan
from eqxscan.planning._candidates import make_plan_mesh, mesh_shapes, program
from eqxscan.planning._hlo import hlo_costs
from eqxscan.planning._spec import decode, encode, make_job

from .helpers import run_script, untyped


CONFIG = dict(layers=2, dim=32, vocab=64, dtype="float32")
L, D, V = CONFIG["layers"], CONFIG["dim"], CONFIG["vocab"]
# float32 parameters and two float32 Adam moments, plus Adam's int32 step count.
BYTES_PER_PARAM, COUNT_BYTES = 12, 4


def analytic_state_bytes(fsdp: int, model: int) -> int:
    """Parameters + Adam bytes on one device under `bench.AXES` / `bench.RULES`
    with `min_size=0`: block matrices split over fsdp x model, the MLP's first
    bias over model, every other leaf over fsdp."""
    params = (
        L * (12 * D * D / (fsdp * model) + 4 * D / model + 5 * D / fsdp)
        + (2 * V * D + 2 * D) / fsdp
    )
    return int(params * BYTES_PER_PARAM) + COUNT_BYTES


def within(a: float, b: float, rel: float = 0.1) -> bool:
    return abs(a - b) <= rel * abs(b)


def test_plan_on_eight_devices_matches_live_bytes_and_one_device_loss():
    out = json.loads(run_script("plan_checks.py", timeout=900))
    for row in out["rows"]:
        _, fsdp, model = row["mesh"]
        assert row["error"] is None
        assert within(row["state_bytes"], analytic_state_bytes(fsdp, model)), row
        # The compiled program's arguments are the state and this device's batch.
        assert within(row["argument_bytes"], row["state_bytes"]), row
    live = out["live"]
    assert len(live) == 8
    for device, nbytes in live.items():
        assert within(nbytes, out["state_bytes"]), (device, nbytes)
    # XLA's analysis of the program actually run agrees with the plan's.
    assert within(out["run_argument_bytes"], out["argument_bytes"])
    assert within(
        max(live.values()) + out["batch_bytes_per_device"], out["run_argument_bytes"]
    )
    np.testing.assert_allclose(out["losses"], out["reference"], rtol=1e-5)


def test_plan_compiles_in_a_fresh_process_when_devices_are_missing():
    assert len(jax.devices()) < 8
    seen = []
    table = plan(
        "benchmarks.bench.meshes:decoder",
        bench.train_step,  # a top-level function: passed by its name
        optimizer="benchmarks.bench.meshes:adam",
        batch=bench.batch_shape(8, 4),
        budget="1GB",
        meshes=[(8, 1, 1)],
        remat=(False,),
        model_kwargs=CONFIG,
        min_size=0,
        progress=lambda i, n, what: seen.append((i, n)),
    )
    assert isinstance(table, MeshPlan)
    assert "fresh process" in table.simulated
    (row,) = table.candidates
    assert row.error is None
    assert row.state_bytes == analytic_state_bytes(1, 1)  # replicated: all of it
    assert table.chosen is row
    assert seen[0] == (0, 1) and seen[-1] == (1, 1)
    text = str(table)
    assert "| data | fsdp | model |" in text and "**chosen**" in text


def test_nothing_fits_still_returns_the_table():
    table = _nothing_fits()
    assert table.chosen is None
    assert len(table.candidates) == 1
    assert table.candidates[0].device_bytes > 1000
    assert "No candidate fits" in table.message and "Hint:" in table.message
    assert "No candidate fits" in str(table)
    # At a 1 kB budget the figures are read in bytes, not as "0.00 GiB".
    least = table.candidates[0].device_bytes
    assert "budget of 1,000 bytes" in table.message
    assert f"needs {least:,} bytes, {least - 1000:,} bytes more" in table.message


def _nothing_fits():
    return plan(
        bench.decoder,
        bench.train_step,
        optimizer=bench.adam,
        batch=bench.batch_shape(2, 4),
        budget="1kB",
        devices=1,
        remat=(False,),
        model_kwargs=dict(layers=1, dim=8, vocab=16, dtype="float32"),
    )


def _plan(**kwargs):
    args = dict(
        optimizer="benchmarks.bench.meshes:adam",
        batch=bench.batch_shape(8, 4),
        budget="1GB",
        devices=8,
        model_kwargs=CONFIG,
    )
    args.update(kwargs)
    return plan(
        "benchmarks.bench.meshes:decoder", "benchmarks.bench.meshes:train_step", **args
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budget="lots"), "budget must be"),
        (dict(model_axis=(3,), axes=bench.AXES), "does not divide 8 devices"),
        (dict(model_axis=(2,)), "needs axes="),
        (dict(meshes=[(2, 2, 1), (2, 2, 2)], devices=None), "one product"),
        (dict(optimizer=lambda: bench.adam()), "importable by reference"),
        (dict(optimizer="benchmarks.bench.nowhere:adam"), "cannot import"),
        (dict(accelerator="abacus"), "unknown accelerator"),
        (dict(peak_flops=0.0), "peak_flops must be a positive number"),
        (dict(link_bytes_per_s=-1.0), "link_bytes_per_s must be a positive"),
    ],
)
def test_bad_input_gets_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        _plan(**kwargs)
    assert "Hint:" in str(info.value)


def test_devices_and_remat_are_checked_before_any_compile():
    with pytest.raises(ValueError, match="devices must be >= 1, got 0"):
        _plan(devices=0)
    # (Under the test suite's runtime type checking, beartype speaks first.)
    with pytest.raises((TypeError, ValueError), match="must be one of|param.*remat"):
        _plan(remat=("nest",))
    with pytest.raises(ValueError, match="model_axis must be >= 1, got 0"):
        _plan(model_axis=(1, 0))
    with untyped(), pytest.raises(ValueError, match="simulate must be 'auto' or"):
        _plan(simulate="never")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # Neither truncated to (1, 1, 1) nor read as the digits of "121".
        (dict(meshes=[(1.5, 1, 1)], devices=None), r"triples .*\(1\.5, 1, 1\)"),
        (dict(meshes=["121"], devices=None), r"triples .*'121'"),
        (dict(model_axis=(), devices=1), r"model_axis is empty"),
        (dict(min_size=-1, devices=1), r"plan: min_size must be >= 0, got -1"),
    ],
)
def test_arguments_that_would_plan_something_else_are_refused(kwargs, match):
    # Each once an unasked-for mesh planned, no candidate at all, or every
    # candidate refused with the same error.
    with untyped(), pytest.raises(ValueError, match=match):
        _plan(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(remat="auto"), dict(remat=True), dict(model_axis=2)]
)
def test_one_setting_where_a_sequence_is_due_is_named(kwargs):
    # "remat must be one of [...], got 'a'" or "'bool' object is not iterable".
    ((name, value),) = kwargs.items()
    with untyped(), pytest.raises(TypeError, match=rf"plan: {name} is the settings"):
        _plan(devices=1, **kwargs)


def test_model_kwargs_that_are_not_json_are_refused_before_the_child_starts():
    # Four devices: this process has two, so the candidates would compile in a
    # fresh process, reached through JSON.
    kwargs = dict(CONFIG, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"model_kwargs cannot be passed as JSON"):
        _plan(devices=4, model_kwargs=kwargs)


def test_rules_reach_the_fresh_process_as_logical_spec_reads_them():
    # Pairs naming one name twice: the first wins in `logical_spec`, so it must
    # in the fresh process too (a dict of the pairs kept the last).
    rules = [("embed", "fsdp"), ("mlp", ("data", "model")), ("embed", None)]
    job = (bench.decoder, bench.train_step, None, bench.batch_shape(2, 4))
    one = Accelerator(1.0, 1.0)
    spec = encode(1, [(1, 1, 1)], [True], one, (*job, None, rules, {}, 0))
    got = decode(json.loads(json.dumps(spec)))[0].rules
    for names in [("embed", "mlp"), ("mlp", None)]:
        want = sharding.logical_spec(names, rules)
        assert sharding.logical_spec(names, got) == want, (names, got)


def test_an_optimiser_and_a_remat_policy_reach_the_job_as_given():
    # A GradientTransformation is the optimiser itself, not a factory to call;
    # a jax.checkpoint_policies policy comes back from JSON as that policy.
    tx, policy = optax.adam(1e-3), jax.checkpoint_policies.dots_saveable
    job = (bench.decoder, bench.train_step, tx, bench.batch_shape(2, 4))
    assert make_job(*job, None, None, {}, 0).optimizer is tx
    job = (*job[:2], None, *job[3:], None, None, {}, 0)
    spec = encode(1, [(1, 1, 1)], [False, policy], Accelerator(1.0, 1.0), job)
    assert decode(json.loads(json.dumps(spec)))[2] == [False, policy]


def test_a_batch_reaches_the_fresh_process_as_given():
    # Dict keys came back as strings and lists as tuples: a step indexing
    # `batch[0]` of `{0: ..., 1: ...}` raised a KeyError only when compiled in
    # a fresh process.
    s = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    batch = {0: s, 1: [s, (s, {"a": [s]})]}
    job = (bench.decoder, bench.train_step, None, batch, None, None, {}, 0)
    spec = encode(1, [(1, 1, 1)], [False], Accelerator(1.0, 1.0), job)
    got = decode(json.loads(json.dumps(spec)))[0].batch
    assert jax.tree.structure(got) == jax.tree.structure(batch)
    assert jax.tree.leaves(got) == jax.tree.leaves(batch)
    with pytest.raises(TypeError, match=r"batch dict key \(0, 1\) \(tuple\)"):
        encode(
            1,
            [(1, 1, 1)],
            [False],
            Accelerator(1.0, 1.0),
            (*job[:3], {(0, 1): s}, *job[4:]),
        )


def _loss_first(model, opt_state, batch):
    model, opt_state, loss = bench.train_step(model, opt_state, batch)
    return loss, model, opt_state


def test_a_step_that_returns_something_else_first_is_named():
    with pytest.raises(
        ValueError, match=r"step must return \(model, opt_state, \*rest\).* tuple of 3"
    ):
        plan(
            bench.decoder,
            _loss_first,
            optimizer=bench.adam,
            batch=bench.batch_shape(2, 4),
            budget="1GB",
            devices=1,
            remat=(False,),
            model_kwargs=dict(CONFIG, layers=1),
        )


def test_no_mesh_that_compiles_is_not_called_a_budget_miss():
    # Two devices and a batch of 3 rows: every mesh is refused, whatever the budget.
    table = _plan(devices=2, batch=bench.batch_shape(3, 4), remat=(False,))
    assert table.chosen is None
    assert all(c.error for c in table.candidates)
    assert "No candidate could be compiled" in table.message
    assert "batch[0]" in table.message and "Hint:" in table.message
    assert "fits the budget" not in table.message


def _adafactor():
    return optax.adafactor(1e-3, min_dim_size_to_factor=4)  # factors [L, 32, 32]


def test_optimiser_state_is_placed_with_min_size_as_shard_places_it():
    # Adafactor's factored moments have shapes of their own, to which min_size
    # applies: the plan's layout must be the one `shard` gives the live state.
    job = make_job(
        bench.decoder, bench.train_step, _adafactor, bench.batch_shape(2, 4),
        None, None, CONFIG, 0,
    )  # fmt: skip
    mesh = make_plan_mesh((1, 2, 1), jax.devices()[:2])
    _, _, (_, planned), _, _ = program(job, mesh, False)
    model = bench.decoder(jax.random.key(0), **CONFIG)
    opt_state = _adafactor().init(eqx.filter(model, eqx.is_array))
    _, live, _ = sharding.shard(model, opt_state, mesh=mesh, min_size=0)
    pairs = list(zip(jax.tree.leaves(planned), jax.tree.leaves(live), strict=True))
    assert any(a.spec != P() for a, _ in pairs)
    for spec, array in pairs:
        assert spec.is_equivalent_to(array.sharding, array.ndim)


def test_mesh_shapes_are_every_split_of_the_devices():
    # Every (data, fsdp, model) whose product is the device count, for each
    # model size asked for.
    want = [
        (d, f, m)
        for m in (1, 2)
        for d in range(1, 9)
        for f in range(1, 9)
        if d * f * m == 8
    ]
    assert sorted(mesh_shapes(8, (1, 2))) == sorted(want)


def test_hlo_costs_counts_loop_bodies_per_iteration():
    layers, batch, dim = 5, 16, 64

    def f(w, x):
        def body(h, wi):
            return jnp.tanh(h @ wi), None

        return jax.lax.scan(body, x, w)[0]

    w = jnp.zeros((layers, dim, dim))
    x = jnp.zeros((batch, dim))
    text = jax.jit(f).lower(w, x).compile().as_text()
    collectives, flops = hlo_costs(text)
    assert collectives == {}
    assert flops == layers * 2 * batch * dim * dim


def test_hlo_costs_counts_each_branch_of_a_conditional():
    # A LayerDrop layer runs in a `cond`: its dots were not counted at all (a
    # train step of 0 FLOPs, its FSDP gathers missing), which flipped the mesh.
    a = jnp.ones((16, 32))
    b = jnp.ones((32, 32))
    dot = 2 * 16 * 32 * 32

    def drop(w, x):
        def body(h, wi):
            return jax.lax.cond(h.sum() > 0, lambda: jnp.tanh(h @ wi), lambda: h), None

        return jax.lax.scan(body, x, w)[0]

    cases = [
        (
            lambda p, a, b: jax.lax.cond(p, lambda: a @ b, lambda: a + 1.0),
            (True, a, b),
            1,
        ),
        (
            lambda i, a, b: jax.lax.switch(i, [lambda: a @ b, lambda: a @ b @ b]),
            (0, a, b),
            3,
        ),
        (drop, (jnp.stack([b] * 3), a), 3),
    ]
    for f, args, dots in cases:
        text = jax.jit(f).lower(*args).compile().as_text()
        assert hlo_costs(text)[1] == dots * dot  # every branch, as if it ran


# One fused matmul (4x8 @ 8x16: 2 * 4 * 16 * 8 FLOPs) called from two places in
# the entry and from a loop body run 3 times, which also all-reduces 4 x 16
# floats per iteration: 5 matmuls and 3 all-reduces per run.
_CALLED_TWICE = """\
HloModule called_twice

%fused_dot (p0: f32[4,8], p1: f32[8,16]) -> f32[4,16] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  ROOT %d = f32[4,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %w = f32[8,16]{1,0} get-tuple-element(%t), index=2
  %y = f32[4,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %r = f32[4,16]{1,0} all-reduce(%y), replica_groups={}, to_apply=%add
  ROOT %out = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%i, %x, %w)
}

%cond (c: (s32[], f32[4,8], f32[8,16])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x: f32[4,8], w: f32[8,16]) -> f32[4,16] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,16]{1,0} parameter(1)
  %once = f32[4,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %twice = f32[4,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%zero, %x, %w)
  %loop = (s32[], f32[4,8], f32[8,16]) while(%init), condition=%cond, body=%body, %TRIP
  ROOT %sum = f32[4,16]{1,0} add(%once, %twice)
}
"""


def test_hlo_costs_counts_a_computation_once_per_call():
    trip = 'backend_config={"known_trip_count":{"n":"3"}}'
    collectives, flops = hlo_costs(_CALLED_TWICE.replace("%TRIP", trip))
    assert flops == (2 + 3) * 2 * 4 * 16 * 8
    assert collectives == {"all-reduce": 3 * 4 * 16 * 4}


# Async collectives as GPU programs have them: each `-start` returns a tuple of
# its operand and result (and context scalars), its `-done` the result alone.
_ASYNC = """\
HloModule async_collectives

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[2,16]) -> f32[16,16] {
  %x = f32[2,16]{1,0} parameter(0)
  %ags = (f32[2,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%x), dimensions={0}
  %agd = f32[16,16]{1,0} all-gather-done(%ags)
  %cps = (f32[2,16]{1,0}, f32[2,16]{1,0}, u32[], u32[]) collective-permute-start(%x)
  %cpd = f32[2,16]{1,0} collective-permute-done(%cps)
  %ars = f32[2,16]{1,0} all-reduce-start(%cpd), to_apply=%add
  %ard = f32[2,16]{1,0} all-reduce-done(%ars)
  ROOT %out = f32[16,16]{1,0} copy(%agd)
}
"""


def test_hlo_costs_counts_async_collectives_by_their_results():
    # Once (operand + result) / 2 for an all-gather: 576 bytes for 1024.
    collectives, _ = hlo_costs(_ASYNC)
    assert collectives == {
        "all-gather": 16 * 16 * 4,
        "collective-permute": 2 * 16 * 4,
        "all-reduce": 2 * 16 * 4,
    }


def test_the_child_entry_point_says_how_it_is_called(monkeypatch):
    # Run by hand without its two paths: a usage line, not a traceback.
    for args in ([], ["--help"]):
        monkeypatch.setattr("sys.argv", ["planning", *args])
        with pytest.raises(SystemExit) as info:
            runpy.run_module("eqxscan.planning", run_name="__main__")
        assert str(info.value).startswith("usage: python -m eqxscan.planning SPEC")
