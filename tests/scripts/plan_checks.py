"""`eqxscan.planning.plan` on 8 simulated CPU devices, run in fresh processes (the
device count is fixed when JAX starts): the chosen candidate's model and optimiser
state are then really built on the 8 devices and trained.

    python tests/scripts/plan_checks.py
        one process x 8 devices, and the same steps on one device (run by
        test_plan_mesh.py)
    python tests/scripts/plan_checks.py two --process-id I --port P
        process I of a 2 x 4 job on 127.0.0.1 (run by
        benchmarks/plan_two_processes.py)

Prints one JSON object of measurements.
"""

import os
import sys


TWO = sys.argv[1:2] == ["two"]
if not TWO:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402


if TWO:
    jax.config.update("jax_num_cpu_devices", 4)
    from eqxscan import distributed  # noqa: E402

    distributed.initialize(f"127.0.0.1:{sys.argv[5]}", 2, int(sys.argv[3]), timeout=120)

from benchmarks.bench import meshes as bench  # noqa: E402
from eqxscan.planning import plan  # noqa: E402
from eqxscan.planning._candidates import (  # noqa: E402
    Job,
    make_plan_mesh,
    program,
)


CONFIG = dict(layers=2, dim=32, vocab=64, dtype="float32")
BATCH, SEQ, STEPS = 8, 8, 3


def live_bytes(trees) -> dict[str, int]:
    """Bytes of the arrays of `trees` held by each device."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(trees):
        for shard in leaf.addressable_shards:  # this process's devices
            key = str(shard.device.id)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out


def main() -> None:
    batch = bench.batch_shape(BATCH, SEQ)
    common = dict(
        batch=batch,
        optimizer=bench.adam,
        axes=bench.AXES,
        rules=bench.RULES,
        model_kwargs=CONFIG,
        min_size=0,
    )
    table = plan(
        bench.decoder,
        bench.train_step,
        budget="64MB",
        meshes=[(2, 4, 1), (1, 4, 2)],
        remat=(False,),
        **common,
    )
    chosen = table.chosen
    assert chosen is not None, table.message
    mesh = make_plan_mesh(chosen.mesh, jax.devices())
    job = Job(
        bench.decoder,
        CONFIG,
        bench.train_step,
        bench.adam(),
        batch,
        bench.AXES,
        bench.RULES,
        0,
    )
    jitted, (_, p_specs), (_, o_specs), b_specs, static = program(job, mesh, False)
    # Really build the model and optimiser state in their shards.
    key = jax.random.key(0)
    # (In the plan's structure: every Stacked gathering one layer per step.)
    leaves = jax.jit(
        lambda k: jax.tree.leaves(eqx.filter(bench.decoder(k, **CONFIG), eqx.is_array)),
        out_shardings=jax.tree.leaves(p_specs),
    )(key)
    params = jax.tree.unflatten(jax.tree.structure(p_specs), leaves)
    opt_state = jax.jit(bench.adam().init, out_shardings=o_specs)(params)
    live = live_bytes((params, opt_state))

    rng = np.random.default_rng(0)
    data = [
        tuple(
            rng.integers(0, CONFIG["vocab"], (BATCH, SEQ)).astype(np.int32)
            for _ in range(2)
        )
        for _ in range(STEPS)
    ]
    compiled = jitted.lower(params, opt_state, batch).compile()
    mem = compiled.memory_analysis()
    losses = []
    for tokens, targets in data:
        placed = tuple(
            jax.make_array_from_callback(a.shape, s, lambda i, a=a: np.asarray(a)[i])
            for a, s in zip((tokens, targets), b_specs)
        )
        params, opt_state, (loss,) = compiled(params, opt_state, placed)
        losses.append(float(np.asarray(loss.addressable_data(0))))
    if TWO:
        print(
            json.dumps(
                dict(
                    process=jax.process_index(),
                    chosen=list(chosen.mesh),
                    state_bytes=chosen.state_bytes,
                    live=live,
                    losses=losses,
                )
            )
        )
        return

    # The same steps on one device, without any sharding.
    model = bench.decoder(key, **CONFIG)  # on the default device
    state = bench.adam().init(eqx.filter(model, eqx.is_array))
    single = eqx.filter_jit(bench.train_step)
    ref = []
    for tokens, targets in data:
        model, state, loss = single(model, state, (tokens, targets))
        ref.append(float(loss))
    print(
        json.dumps(
            dict(
                chosen=list(chosen.mesh),
                state_bytes=chosen.state_bytes,
                argument_bytes=chosen.argument_bytes,
                run_argument_bytes=int(mem.argument_size_in_bytes),
                batch_bytes_per_device=2 * BATCH * SEQ * 4 // 8 * chosen.mesh[2],
                live=live,
                losses=losses,
                reference=ref,
                rows=[c.to_json() for c in table.candidates],
            )
        )
    )


if __name__ == "__main__":
    main()
