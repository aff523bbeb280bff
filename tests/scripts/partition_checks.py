"""Tensor parallelism next to FSDP on 8 simulated CPU devices, run in a fresh
process by test_sharding_tp.py (the device count is fixed when JAX starts).

Prints one JSON object of measurements; the test asserts on it.
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import sys  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

from eqxscan import sharding  # noqa: E402
from tests.helpers import collectives  # noqa: E402
from tests.scripts.partition_model import (  # noqa: E402
    AXES,
    make_problem,
    max_rel,
    RULES,
)


optimizer = optax.sgd(0.1, momentum=0.9)


def make_step(place):
    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        model, opt_state = place(model, opt_state)
        return model, opt_state, loss, grads

    return step


def run(model, x, y, ref, mesh, gather):
    """One step on `mesh`, the model placed by logical names; `gather` is
    `gather_layers`' `keep` (`None`: not called). Errors against `ref` and the
    compiled program's collectives."""
    specs = sharding.logical_shardings(model, mesh, AXES, RULES)
    if gather is not None:
        # Shardings computed before gather_layers still place the model after.
        model = sharding.gather_layers(model, mesh, specs, keep=gather)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    opt_specs = sharding.opt_state_shardings(
        opt_state, model, mesh, param_shardings=specs
    )

    def place(m, s):
        return sharding.constrain(m, specs), sharding.constrain(s, opt_specs)

    s_model, s_opt = place(model, opt_state)
    batch = NamedSharding(mesh, PartitionSpec("fsdp"))
    s_x, s_y = jax.device_put((x, y), batch)
    step = make_step(place)
    out = step(s_model, s_opt, s_x, s_y)
    hlo = step.lower(s_model, s_opt, s_x, s_y).compile().compiled.as_text()
    w1 = out[0].blocks.layers.w1
    return {
        "err_loss": abs(float(out[2]) - float(ref[2])) / abs(float(ref[2])),
        "err_grads": max_rel(out[3], ref[3]),
        "err_params": max_rel(out[0], ref[0]),
        "err_opt_state": max_rel(out[1], ref[1]),
        "w1_spec": str(w1.sharding.spec),
        "w1_shard": list(w1.addressable_shards[0].data.shape),
        "mu_w1_spec": str(out[1][0].trace.blocks.layers.w1.sharding.spec),
        "layer_sharding": str(getattr(out[0].blocks.layer_sharding, "w1", None)),
        "all_reduces": collectives(hlo, "all-reduce"),
        "all_gathers": collectives(hlo, "all-gather"),
        "reduce_scatters": collectives(hlo, "reduce-scatter"),
    }


def main():
    assert jax.device_count() == 8, jax.devices()
    model, x, y = make_problem()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    ref = make_step(lambda m, s: (m, s))(model, opt_state, x, y)
    mesh = jax.make_mesh((2, 4), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    runs = {"plain": None, "kept": "model", "whole": ()}
    json.dump({k: run(model, x, y, ref, mesh, g) for k, g in runs.items()}, sys.stdout)


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")
    main()
