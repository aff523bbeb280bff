"""Drop rates under the pipeline on 8 simulated CPU devices, run by
`pipeline_checks.py one` (in the same process as its other checks) or alone:

    python tests/scripts/pipeline_drop_checks.py

prints one JSON object: for each schedule, layer order and microbatch count,
on a (stage=2, data=4) mesh with each microbatch's rows split over "data", how
far `pipeline(stack, x, key=k)` and its gradients (with respect to the stack's
arrays and `x`) are from `stack(x, key=k)`'s, for several keys, and how far
apart the results of different keys are.
"""

import json
import os
import sys

import jax


jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import eqxscan  # noqa: E402
from eqxscan import sharding  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
from tests.helpers import max_rel_err  # noqa: E402


DIM, LAYERS, BATCH, STAGES, KEYS = 4, 8, 16, 2, 3
MESH = jax.make_mesh((STAGES, 4), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
X = jax.random.normal(jax.random.key(1), (BATCH, DIM))
RATES = {
    "both": dict(drop_path=eqxscan.linear_rates(0.6), layer_drop=0.3),
    "path": dict(drop_path=0.4),
    "layer": dict(layer_drop=0.4),
}


def loss(y):
    # Weighs every output differently, so a wrong row or column shows.
    return jnp.sum(jnp.sin(y) * jnp.arange(1.0, y.size + 1.0).reshape(y.shape))


def value_and_grads(fn):
    """`fn(stack, x, key)`'s loss, output and gradients with respect to the
    stack's arrays and `x`, as one jitted function."""

    @eqx.filter_jit
    def run(stack, x, key):
        def of(inputs):
            y = fn(*inputs, key)
            return loss(y), y

        (value, y), grads = eqx.filter_value_and_grad(of, has_aux=True)((stack, x))
        return value, y, grads

    return run


# The unpipelined call, compiled once per stack structure.
REF = value_and_grads(lambda s, x, k: s(x, key=k))


def check(name: str, rates: str, microbatches: int, **pipe) -> dict:
    stack = eqxscan.StackedMLP(DIM, LAYERS, key=jax.random.key(0), **RATES[rates])
    stack = stack.blocks
    order = dict(stages=STAGES, repeats=pipe.get("repeats", 1))
    staged = pipe.get("layer_order") == "stage"
    piped_stack = sharding.pipeline_order(stack, **order) if staged else stack
    piped = value_and_grads(
        lambda s, x, k: sharding.pipeline(
            s,
            x,
            key=k,
            mesh=MESH,
            microbatches=microbatches,
            batch_axes="data",
            **pipe,
        )
    )
    errs, outputs = [], []
    for seed in range(KEYS):
        key = jax.random.key(100 + seed)
        value, y, (g_stack, g_x) = piped(piped_stack, X, key)
        if staged:  # compared in the natural order
            g_stack = sharding.pipeline_order(g_stack, **order, inverse=True)
        ref_value, ref_y, ref_grads = REF(stack, X, key)
        got = eqx.filter((value, y, g_stack, g_x), eqx.is_array)
        want = eqx.filter((ref_value, ref_y, *ref_grads), eqx.is_array)
        errs.append(max_rel_err(got, want))
        outputs.append(ref_y)
    quiet = eqx.nn.inference_mode(stack)(X)
    return {
        "name": name,
        "err": max(errs),
        # Apart from each other and from running every layer: what the test
        # above could miss if every key dropped the same.
        "key_gap": min(
            max_rel_err(outputs[i], outputs[j])
            for i in range(KEYS)
            for j in range(i + 1, KEYS)
        ),
        "quiet_gap": min(max_rel_err(y, quiet) for y in outputs),
    }


def checks() -> list[dict]:
    circular = dict(schedule="circular", repeats=2)
    # Each schedule with each layer order once, and each microbatch count with
    # each schedule once (4 of the 8 combinations, one compile each).
    cases = [
        ("gpipe", "natural", 2, {}),
        ("gpipe", "stage", 4, {}),
        ("circular", "natural", 4, circular),
        ("circular", "stage", 2, circular),
    ]
    out = [
        check(f"{schedule}_{order}_{m}", "both", m, layer_order=order, **pipe)
        for schedule, order, m, pipe in cases
    ]
    # Each kind of drop alone (the other's inputs left out of the program).
    out.append(check("path_only", "path", 4, layer_order="stage", **circular))
    out.append(check("layer_only", "layer", 4, layer_order="stage", **circular))
    return out


if __name__ == "__main__":
    json.dump({"runs": checks()}, sys.stdout)
