"""Multi-process checks, run by test_multihost.py in fresh processes on 127.0.0.1.

    python tests/scripts/multihost_checks.py two --process-id I --port P --out DIR
        (2 processes x 4 devices): create, 3 training steps, memory, checkpoints at
        steps 3 and 6, then a save of step 7 frozen just before Orbax commits it,
        so that the test can SIGKILL the job in the middle of a save.
    python tests/scripts/multihost_checks.py eight --out DIR
        (1 process x 8 devices): the same 3 steps; restores of what `two` saved.
    python tests/scripts/multihost_checks.py join --process-id I --port P --timeout T
        joins a job that no other process joins.

Each writes what it measured to DIR (JSON and `.npz` of gathered arrays); the test
compares them with the single-device run in the test process.
"""

import argparse
import json
import os
import sys
import time


DIM, LAYERS, BATCH = 16, 3, 16


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["two", "eight", "join"])
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--out", default=".")
    return parser.parse_args()


args = parse()

import jax  # noqa: E402


jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8 if args.role == "eight" else 4)
jax.config.update("jax_numpy_rank_promotion", "raise")

from eqxscan import checkpoint, distributed, sharding  # noqa: E402
from eqxscan.sharding._create import lower_create  # noqa: E402


if args.role != "eight":
    distributed.initialize(
        f"127.0.0.1:{args.port}", 2, args.process_id, timeout=args.timeout
    )

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import eqxscan  # noqa: E402
from tests.scripts.training import make_train_step  # noqa: E402


optimizer = optax.adam(1e-2)
MAIN = jax.process_index() == 0
CKPT = os.path.join(args.out, "ckpt")


def make_model(key):
    return eqxscan.StackedMLP(DIM, LAYERS, key=key)


def batch(step: int) -> tuple[jax.Array, jax.Array]:
    """The global batch of `step` (every process can draw it)."""
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
    return jax.random.normal(kx, (BATCH, DIM)), jax.random.normal(ky, (BATCH, DIM))


def local_batch(step: int, mesh):
    rows = distributed.local_rows(BATCH, mesh)
    x, y = batch(step)
    return sharding.shard(None, batch=(x[rows], y[rows]), mesh=mesh)[2]


def gathered(tree) -> dict[str, np.ndarray]:
    """Every array of `tree`, whole, on every process, by path."""
    tree = eqx.filter(tree, eqx.is_array)
    leaves = jtu.tree_leaves_with_path(tree)
    values = multihost_utils.process_allgather([x for _, x in leaves], tiled=True)
    return {jtu.keystr(p): np.asarray(v) for (p, _), v in zip(leaves, values)}


def dump(name: str, **trees) -> None:
    """Write every array of `trees`, gathered, as `<tree name>/<path>`."""
    arrays = {
        f"{k}/{p}": v for k, tree in trees.items() for p, v in gathered(tree).items()
    }
    if MAIN:
        np.savez(os.path.join(args.out, name), **arrays)


def shard_bytes(tree) -> int:
    """Bytes one device holds of `tree`'s arrays (the largest, over devices)."""
    per: dict = {}
    for x in jtu.tree_leaves(eqx.filter(tree, eqx.is_array)):
        for s in x.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values())


def train(mesh, model, opt_state, start: int, stop: int):
    step = make_train_step(optimizer, mesh)
    loss = grads = None
    for i in range(start, stop):
        model, opt_state, loss, grads = step(model, opt_state, *local_batch(i, mesh))
    return model, opt_state, float(loss), grads


def start(mesh):
    model = sharding.create(make_model, jax.random.key(0), mesh=mesh, min_size=0)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    model, opt_state, _ = sharding.shard(model, opt_state, mesh=mesh, min_size=0)
    return model, opt_state


def abstract():
    like = eqx.filter_eval_shape(make_model, jax.random.key(0))
    opt_like = eqx.filter_eval_shape(
        lambda m: optimizer.init(eqx.filter(m, eqx.is_array)), like
    )
    return like, opt_like


def two() -> dict:
    results: dict = {"processes": jax.process_count(), "devices": jax.device_count()}
    mesh = sharding.make_mesh(data=2)
    results["mesh_rows_processes"] = [
        sorted({d.process_index for d in row}) for row in mesh.devices
    ]
    rows = distributed.local_rows(BATCH, mesh)
    results["local_rows"] = multihost_utils.process_allgather(
        np.array([rows.start, rows.stop])
    ).tolist()

    # Sharded creation: the program's output per device, and the values.
    lowered = lower_create(make_model, jax.random.key(0), mesh=mesh, min_size=0)
    memory = lowered.compile().memory_analysis()
    model, opt_state = start(mesh)
    results["create_output_bytes"] = memory.output_size_in_bytes
    results["create_temp_bytes"] = memory.temp_size_in_bytes
    results["model_bytes"] = sum(
        x.nbytes for x in jtu.tree_leaves(eqx.filter(model, eqx.is_array))
    )
    results["model_shard_bytes"] = shard_bytes(model)
    results["spec_w1"] = str(model.blocks.layers.w1.sharding.spec)
    dump("created.npz", model=model)

    # FSDP memory of the training step's arguments, per device.
    step = make_train_step(optimizer, mesh)
    x, y = local_batch(0, mesh)
    compiled = step.lower(model, opt_state, x, y).compile()
    results["step_arg_bytes"] = (
        compiled.compiled.memory_analysis().argument_size_in_bytes
    )
    results["state_bytes"] = sum(
        x.nbytes for x in jtu.tree_leaves(eqx.filter((model, opt_state), eqx.is_array))
    )
    results["batch_bytes"] = x.nbytes + y.nbytes

    model, opt_state, loss, grads = train(mesh, model, opt_state, 0, 3)
    results["loss3"] = loss
    dump("two_after3.npz", model=model, opt_state=opt_state, grads=grads)

    # Checkpoints: step 3 written asynchronously while steps 4-6 run.
    ckpt = checkpoint.CheckpointManager(CKPT, max_to_keep=3)
    t = time.perf_counter()
    ckpt.save(3, model, opt_state)
    results["save_blocked_s"] = time.perf_counter() - t
    model, opt_state, loss, _ = train(mesh, model, opt_state, 3, 6)
    results["loss6"] = loss
    ckpt.save(6, model, opt_state, wait=True)
    results["steps_saved"] = ckpt.all_steps()
    dump("two_after6.npz", model=model, opt_state=opt_state)

    # Restoring onto another mesh of the same processes (data across, 1 x 8).
    other = sharding.make_mesh(data=1)
    like, opt_like = abstract()
    restored, _, step_no = ckpt.restore(like, opt_like, mesh=other, step=3, min_size=0)
    results["restored_step_other_mesh"] = step_no
    results["restored_spec_other_mesh"] = str(
        restored.blocks.layers.w1.sharding.spec
    ) + str(dict(restored.blocks.layers.w1.sharding.mesh.shape))
    dump("two_restored3.npz", model=restored)

    # A batch whose rows do not divide among this process's devices.
    try:
        sharding.shard(None, batch=jnp.ones((3, DIM)), mesh=mesh)
    except ValueError as e:
        results["batch_error"] = str(e)

    if MAIN:
        with open(os.path.join(args.out, "two.json"), "w") as f:
            json.dump(results, f)
    multihost_utils.sync_global_devices("results written")

    # Step 7: every shard written, then frozen just before the commit (the
    # rename of Orbax's temporary directory), where the test kills the job.
    real_rename = os.rename

    def frozen(src, dst, *a, **k):
        if "tmp" in os.path.basename(os.fspath(src)):
            open(os.path.join(args.out, "committing"), "w").close()
            time.sleep(3600)
        return real_rename(src, dst, *a, **k)

    os.rename = frozen
    ckpt.save(7, model, opt_state)
    time.sleep(3600)
    return results


def eight() -> dict:
    results: dict = {"processes": jax.process_count(), "devices": jax.device_count()}
    mesh = sharding.make_mesh(data=1)
    model, opt_state = start(mesh)
    model, opt_state, loss, grads = train(mesh, model, opt_state, 0, 3)
    results["loss3"] = loss
    dump("eight_after3.npz", model=model, opt_state=opt_state, grads=grads)
    # What the two processes saved, after one of their saves was killed.
    ckpt = checkpoint.CheckpointManager(CKPT)
    results["steps_after_kill"] = ckpt.all_steps()
    like, opt_like = abstract()
    model, opt_state, step_no = ckpt.restore(like, opt_like, mesh=mesh, min_size=0)
    results["latest_restored"] = step_no
    dump("eight_restored6.npz", model=model, opt_state=opt_state)
    # Resume from step 3 on this topology: the same loss at step 6.
    model, opt_state, _ = ckpt.restore(like, opt_like, mesh=mesh, step=3, min_size=0)
    results["spec_w1"] = str(model.blocks.layers.w1.sharding.spec)
    results["resumed_loss6"] = train(mesh, model, opt_state, 3, 6)[2]
    ckpt.close()
    with open(os.path.join(args.out, "eight.json"), "w") as f:
        json.dump(results, f)
    return results


if __name__ == "__main__":
    if args.role == "two":
        two()
    elif args.role == "eight":
        eight()
    else:
        print("joined", file=sys.stderr)  # not reached: no other process joins
