"""Checks on 8 simulated CPU devices, run in a fresh process by test_sharding.py.

The device count is fixed when JAX starts, so these cannot run in the test process
(which has 2 devices). Prints one JSON object of measurements; the test asserts on it.
"""

import os


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import eqxscan  # noqa: E402
from eqxscan import sharding  # noqa: E402
from tests.helpers import collectives, max_rel_err  # noqa: E402
from tests.scripts.training import make_train_step  # noqa: E402


# Strict rank promotion as in the test process; dtype promotion stays standard
# because optax's Adam mixes Python floats with its int32 step count.
jax.config.update("jax_numpy_rank_promotion", "raise")

DIM, LAYERS, BATCH = 16, 3, 16
# `unroll=1` where the loop body is inspected: by default so short a stack of
# small layers is unrolled fully.
optimizer = optax.adam(1e-2)


REF_STEP = make_train_step(optimizer, None)


def arrays(*trees):
    return [eqx.filter(t, eqx.is_array) for t in trees]


def loop_bodies(hlo: str) -> dict[str, str]:
    """The text of every computation used as a while loop's body."""
    names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"%?([\w.\-]+) ", block)
        if m and m.group(1) in names:
            comps[m.group(1)] = block
    return comps


def run(name, mesh_shape, fsdp_axis):
    key = jax.random.key(0)
    model = eqxscan.StackedMLP(DIM, LAYERS, key=key, unroll=1)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, DIM))
    y = jax.random.normal(ky, (BATCH, DIM))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    ref_step = REF_STEP  # one compilation shared by all runs
    ref = ref_step(model, opt_state, x, y)
    ref_mem = (
        ref_step.lower(model, opt_state, x, y).compile().compiled.memory_analysis()
    ).argument_size_in_bytes

    mesh = sharding.make_mesh(*mesh_shape)
    s_model, s_opt, (s_x, s_y) = sharding.shard(
        model, opt_state, (x, y), mesh=mesh, fsdp_axis=fsdp_axis, min_size=0
    )
    step = make_train_step(optimizer, mesh, fsdp_axis)
    compiled = step.lower(s_model, s_opt, s_x, s_y).compile()
    out = step(s_model, s_opt, s_x, s_y)
    new_model, new_opt, loss, grads = out
    hlo = compiled.compiled.as_text()
    bodies = "\n".join(loop_bodies(hlo).values())
    args = (s_model, s_opt, s_x, s_y)
    shard_bytes = sum(
        math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
        for a in jtu.tree_leaves(eqx.filter(args, eqx.is_array))
    )
    weights = eqx.filter(model, eqx.is_array)
    return {
        "name": name,
        "loss": float(loss),
        "ref_loss": float(ref[2]),
        "err_loss": abs(float(loss) - float(ref[2])) / abs(float(ref[2])),
        "err_grads": max_rel_err(*arrays(grads, ref[3])),
        "err_params": max_rel_err(*arrays(new_model, ref[0])),
        "err_opt_state": max_rel_err(*arrays(new_opt, ref[1])),
        "out_specs": [
            str(a.sharding.spec)
            for a in jtu.tree_leaves(eqx.filter(new_model, eqx.is_array))
        ],
        "in_specs": [
            str(a.sharding.spec)
            for a in jtu.tree_leaves(eqx.filter(s_model, eqx.is_array))
        ],
        "body_all_gathers": collectives(bodies, "all-gather"),
        "body_all_reduces": collectives(bodies, "all-reduce"),
        "body_reduce_scatters": collectives(bodies, "reduce-scatter"),
        "all_reduces": collectives(hlo, "all-reduce"),
        "reduce_scatters": collectives(hlo, "reduce-scatter"),
        "arg_bytes": compiled.compiled.memory_analysis().argument_size_in_bytes,
        "ref_arg_bytes": ref_mem,
        "expected_shard_bytes": shard_bytes,
        "weight_bytes": sum(a.nbytes for a in jtu.tree_leaves(weights)),
    }


def without_gather():
    """All-gathers in the loop bodies when the weights are FSDP-sharded but the
    Stacked does not gather its layer (`layer_sharding=None`)."""
    mesh = sharding.make_mesh(1, 8)
    model = eqxscan.StackedMLP(DIM, LAYERS, key=jax.random.key(0), unroll=1)
    model, _, x = sharding.shard(
        model, batch=jnp.ones((BATCH, DIM)), mesh=mesh, min_size=0
    )
    model = eqx.tree_at(
        lambda m: m.blocks, model, model.blocks.with_options(layer_sharding=None)
    )
    grad = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.mean(m(x) ** 2)))
    hlo = grad.lower(model, x).compile().compiled.as_text()
    return collectives("\n".join(loop_bodies(hlo).values()), "all-gather")


def pipeline_run():
    """A 4-stage pipeline (2 layers per stage) against the plain scan."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    stack = eqxscan.StackedMLP(DIM, 8, key=jax.random.key(2)).blocks
    x = jax.random.normal(jax.random.key(3), (BATCH, DIM))

    def loss(stack, x, piped):
        if piped:
            return jnp.sum(
                jnp.sin(sharding.pipeline(stack, x, mesh=mesh, microbatches=4))
            )
        return jnp.sum(jnp.sin(stack(x)))

    ref = eqx.filter_value_and_grad(loss)(stack, x, False)
    fn = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value, grads = fn(stack, x, True)
    hlo = fn.lower(stack, x, True).compile().compiled.as_text()
    return {
        "err_value": abs(float(value) - float(ref[0])) / abs(float(ref[0])),
        "err_grads": max_rel_err(*arrays(grads, ref[1])),
        "body_permutes": collectives(
            "\n".join(loop_bodies(hlo).values()), "collective-permute"
        ),
    }


def errors():
    """Messages of the errors that depend on the 8-device mesh."""
    mesh = sharding.make_mesh(2, 4)
    model = eqxscan.StackedMLP(6, 2, key=jax.random.key(0))  # w1 [2, 6, 24]
    msgs = {}
    try:
        sharding.shard(model, mesh=mesh, min_size=0)
    except ValueError as e:
        msgs["indivisible"] = str(e)
    try:
        sharding.shard(model, batch=jnp.ones((12, 6)), mesh=mesh, min_size=10**9)
    except ValueError as e:
        msgs["batch"] = str(e)
    try:
        sharding.make_mesh(2, 2)
    except ValueError as e:
        msgs["mesh"] = str(e)
    return msgs


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    results = {
        "runs": [
            run("data", (8, 1), None),
            run("fsdp", (1, 8), "fsdp"),
            run("hybrid", (2, 4), "fsdp"),
        ],
        "without_gather": without_gather(),
        "pipeline": pipeline_run(),
        "errors": errors(),
        "shapes": {
            "layer_w1": f"f32[{DIM},{4 * DIM}]",
            "layer_w2": f"f32[{4 * DIM},{DIM}]",
        },
    }
    json.dump(results, sys.stdout)
