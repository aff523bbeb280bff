"""Train a `StackedMLP` with FSDP (and optional data parallelism) on all devices.

    python examples/sharded_training.py                     # whatever devices exist
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python examples/sharded_training.py --data 2         # 8 simulated CPU devices

The model learns to imitate a fixed random "teacher" `StackedMLP`. The script
prints the mesh, the layout of the weights, the loss, and per-device memory (from
XLA's `memory_analysis` of the compiled step) and step time.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxscan
from eqxscan import sharding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--data", type=int, default=1, help="data-parallel replicas (rest: fsdp)"
    )
    parser.add_argument(
        "--min-size", type=int, default=sharding.MIN_SIZE, help="replicate below"
    )
    args = parser.parse_args()

    mesh = sharding.make_mesh(data=args.data)
    print(f"{jax.device_count()} devices, mesh {dict(mesh.shape)}")

    key_model, key_teacher, key_data = jax.random.split(jax.random.key(0), 3)
    model = eqxscan.StackedMLP(args.dim, args.layers, key=key_model)
    teacher = eqxscan.StackedMLP(args.dim, args.layers, key=key_teacher)
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def batch_at(step: int) -> tuple[jax.Array, jax.Array]:
        x = jax.random.normal(
            jax.random.fold_in(key_data, step), (args.batch, args.dim)
        )
        return x, teacher(x)

    def loss_fn(model: eqxscan.StackedMLP, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    @eqx.filter_jit(donate="all-except-first")
    def train_step(batch, model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        model = eqx.apply_updates(model, updates)
        # Inside jit, `shard` pins the layout of the results (a constraint).
        model, opt_state, _ = sharding.shard(
            model, opt_state, mesh=mesh, min_size=args.min_size
        )
        return model, opt_state, loss

    # One call places the model, the optimizer state and the batch.
    model, opt_state, batch = sharding.shard(
        model, opt_state, batch_at(0), mesh=mesh, min_size=args.min_size
    )
    w1 = model.blocks.layers.w1
    local = w1.addressable_shards[0].data.shape
    print(f"w1 {w1.shape}: spec {w1.sharding.spec}, {local} per device")
    batch_shardings = sharding.batch_shardings(batch, mesh)

    stats = (
        train_step.lower(batch, model, opt_state).compile().compiled.memory_analysis()
    )
    times, losses = [], []
    for step in range(args.steps):
        if step:
            batch = jax.device_put(batch_at(step), batch_shardings)
        start = time.perf_counter()
        model, opt_state, loss = train_step(batch, model, opt_state)
        losses.append(float(loss))  # float() waits for the step to finish
        times.append(time.perf_counter() - start)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.5f}")

    assert losses[-1] < 0.5 * losses[0], losses
    mib = 2.0**-20
    steady = sorted(times[1:])[len(times[1:]) // 2]  # median, compile excluded
    print(
        f"per device: arguments {stats.argument_size_in_bytes * mib:.2f} MiB, "
        f"temporaries {stats.temp_size_in_bytes * mib:.2f} MiB, "
        f"outputs {stats.output_size_in_bytes * mib:.2f} MiB; "
        f"step {steady * 1e3:.1f} ms (median)"
    )


if __name__ == "__main__":
    main()
