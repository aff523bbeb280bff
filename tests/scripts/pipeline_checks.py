"""Pipeline checks on 8 simulated CPU devices, run in fresh processes by
test_pipeline_circular.py.

    python tests/scripts/pipeline_checks.py one
        (1 process x 8 devices) prints one JSON object of measurements: `runs`
        (both schedules on a (stage=4, data=2) mesh), `stage_runs` (the circular
        schedule on a stack whose layer axis is split over "stage", in stage
        order and in natural order) and `drop_runs` (drop rates under the
        pipeline: tests/scripts/pipeline_drop_checks.py), in one process so
        that JAX starts once.
    python tests/scripts/pipeline_checks.py two --process-id I --port P --out DIR
        (2 processes x 4 devices, the stage axis spanning both) writes
        DIR/two_<I>.json.

Each run trains the blocks of a `StackedMLP` for one Adam step on a
(stage=4, data=2) mesh, pipelined, and compares the loss, the gradients and the
updated parameters with the same step unpipelined on one device.
"""

import argparse
import json
import os
import re
import sys


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["one", "two"])
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--out", default=".")
    return parser.parse_args()


args = parse()

import jax  # noqa: E402


jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4 if args.role == "two" else 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

from eqxscan import distributed, sharding  # noqa: E402


if args.role == "two":
    distributed.initialize(
        f"127.0.0.1:{args.port}", 2, args.process_id, timeout=args.timeout
    )

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import eqxscan  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
from tests.helpers import collectives, max_rel_err  # noqa: E402
from tests.scripts.sharding_checks import loop_bodies  # noqa: E402


if args.role == "one":  # the same 8 devices
    from tests.scripts.pipeline_drop_checks import checks as drop_checks


DIM, LAYERS, BATCH, STAGES = 8, 8, 16, 4
optimizer = optax.adam(1e-2)


def make_step(pipe: dict | None):
    def loss_fn(blocks, x, y):
        out = blocks(x) if pipe is None else sharding.pipeline(blocks, x, **pipe)
        return jnp.mean((out - y) ** 2)

    @eqx.filter_jit
    def step(blocks, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(blocks, x, y)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(
                grads, opt_state, eqx.filter(blocks, eqx.is_array)
            )
        return eqx.apply_updates(blocks, updates), loss, grads

    return step


def gathered(tree):
    """Array leaves as host NumPy arrays (on several processes: all-gathered)."""
    return [
        jax.device_get(a)
        if a.is_fully_addressable
        else multihost_utils.process_allgather(a, tiled=True)
        for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    ]


BLOCKS = eqxscan.StackedMLP(DIM, LAYERS, key=jax.random.key(0)).blocks
X, Y = jax.random.normal(jax.random.key(1), (2, BATCH, DIM))
OPT_STATE = optimizer.init(eqx.filter(BLOCKS, eqx.is_array))
# The unpipelined step on one device (remat does not change its results).
REF = make_step(None)(BLOCKS, OPT_STATE, X, Y)


# The weights' own shapes ([.., DIM, 4 * DIM] and [.., 4 * DIM, DIM]): what a
# collective that moves weights (not microbatches of [.., DIM]) returns.
WEIGHT_SHAPE = re.compile(rf"\b{DIM},{4 * DIM}\]|\b{4 * DIM},{DIM}\]")


def weight_moves(hlo: str) -> list[str]:
    """Results of the collectives anywhere in `hlo` that move weights."""
    ops = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    return [
        f"{op} {shape}"
        for op in ops
        for shape in collectives(hlo, op)
        if WEIGHT_SHAPE.search(shape)
    ]


def run(mesh, name: str, remat, split_layers: bool = False, **pipe) -> dict:
    blocks = BLOCKS.with_options(remat=remat)
    stage_order = pipe.get("layer_order") == "stage"
    order = dict(stages=STAGES, repeats=pipe.get("repeats", 1))
    if stage_order:
        blocks = sharding.pipeline_order(blocks, **order)
    x, y = X, Y
    # Adam's state mirrors the module, options included.
    opt_state = optimizer.init(eqx.filter(blocks, eqx.is_array))
    ref_blocks, ref_loss, ref_grads = REF

    rows = NamedSharding(mesh, PartitionSpec(pipe.get("batch_axes") or None))
    replicated = NamedSharding(mesh, PartitionSpec())
    # The layer axis split over "stage" (each device holds L / S layers), or
    # every layer on every device.
    params = NamedSharding(mesh, PartitionSpec("stage")) if split_layers else replicated
    place = lambda tree, s: jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, s, lambda i: a[i]),
        tree,
    )
    s_blocks = eqx.combine(
        place(eqx.filter(blocks, eqx.is_array), params),
        eqx.filter(blocks, eqx.is_array, inverse=True),
    )
    # Adam's moments like their parameters, its step count replicated.
    s_opt = jax.tree.map(
        lambda a: place(a, params if a.ndim else replicated), opt_state
    )
    s_x, s_y = place(x, rows), place(y, rows)
    step = make_step(dict(mesh=mesh, **pipe))
    compiled = step.lower(s_blocks, s_opt, s_x, s_y).compile()
    new_blocks, loss, grads = compiled(s_blocks, s_opt, s_x, s_y)
    hlo = compiled.compiled.as_text()
    bodies = "\n".join(loop_bodies(hlo).values())
    weights = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    on_device = lambda tree: sum(a.addressable_shards[0].data.nbytes for a in tree)
    memory = compiled.compiled.memory_analysis()
    extra = {
        "weight_moves": weight_moves(hlo),
        "permutes": collectives(hlo, "collective-permute"),
        "all_to_alls": collectives(hlo, "all-to-all"),
        # Bytes of the stack, whole and on one device, before and after the step.
        "stack_bytes": sum(a.nbytes for a in weights(s_blocks)),
        "device_stack_bytes": on_device(weights(s_blocks)),
        "device_new_stack_bytes": on_device(weights(new_blocks)),
        "device_argument_bytes": memory.argument_size_in_bytes,
    }
    if stage_order:  # compared in the natural order
        grads = sharding.pipeline_order(grads, **order, inverse=True)
        new_blocks = sharding.pipeline_order(new_blocks, **order, inverse=True)
    return extra | {
        "name": name,
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "err_loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
        "err_grads": max_rel_err(gathered(grads), gathered(ref_grads)),
        "err_params": max_rel_err(gathered(new_blocks), gathered(ref_blocks)),
        "body_permutes": collectives(bodies, "collective-permute"),
        "body_all_gathers": collectives(bodies, "all-gather"),
        # (source, target) device pairs of each permute in the loop bodies.
        "body_permute_pairs": [
            len(re.findall(r"\{\d+,\d+\}", m))
            for m in re.findall(r"collective-permute(?:-start)?\(.*", bodies)
        ],
    }


def runs(mesh, role: str) -> list[dict]:
    # Both schedules, with and without data parallelism over "data", under two
    # remat settings of the stages' scans; across processes one of them.
    circular = dict(schedule="circular", repeats=2, microbatches=4)
    if role == "stage":  # part of `one`
        split = dict(split_layers=True, batch_axes="data", **circular)
        return [
            run(mesh, "stage_order", True, layer_order="stage", **split),
            run(mesh, "natural_order", True, **split),
        ]
    if role == "two":
        return [run(mesh, "circular_data", True, batch_axes="data", **circular)]
    return [
        run(mesh, "gpipe_data", True, microbatches=2, batch_axes="data"),
        run(mesh, "circular", True, **circular),
        run(mesh, "circular_data", "auto", batch_axes="data", **circular),
    ]


if __name__ == "__main__":
    types = (AxisType.Auto,) * 2
    # Devices in process order: stages 0-1 on process 0, stages 2-3 on process 1.
    mesh = jax.make_mesh((STAGES, 2), ("stage", "data"), axis_types=types)
    result = {
        "processes": jax.process_count(),
        "stage_processes": [
            sorted({d.process_index for d in row}) for row in mesh.devices
        ],
        "runs": runs(mesh, args.role),
    }
    if args.role == "one":
        result["stage_runs"] = runs(mesh, "stage")
        result["drop_runs"] = drop_checks()
        json.dump(result, sys.stdout)
    else:
        with open(os.path.join(args.out, f"two_{args.process_id}.json"), "w") as f:
            json.dump(result, f)
