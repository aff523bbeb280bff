"""Train a `StackedMLP` with FSDP and data parallelism, on one process or several.

    python examples/sharded_training.py                     # whatever devices exist
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python examples/sharded_training.py --data 2         # 8 simulated CPU devices
    python examples/sharded_training.py --devices-per-process 8   # the same, 1 x 8
    python examples/sharded_training.py --processes 2 --devices-per-process 4
    python examples/sharded_training.py --devices-per-process 8 \\
        --pipeline-stages 4 --repeats 2 --microbatches 8    # circular pipeline

`--processes N` starts N local processes (coordinator on 127.0.0.1, a free port,
CPU collectives via gloo), each with K simulated CPU devices. On a cluster, start
one process per host with `--coordinator HOST:PORT --num-processes N --process-id I`,
or with `--distributed` where JAX detects the cluster (e.g. under SLURM's `srun`).

`--pipeline-stages S` runs the model's layers as a pipeline
(`eqxscan.sharding.pipeline`) over a `("stage", "data")` mesh of S stages, the
batch split over "data"; `--repeats R > 1` uses the circular schedule (each stage
holds R interleaved groups of layers), `--microbatches M` cuts the batch. The
stack's layer axis is split over "stage": each device holds only its stage's
layers (for R > 1 with the stack in stage order, `eqxscan.sharding.pipeline_order`,
unless `--checkpoint-dir` is given: checkpoints keep the natural order, and then
the stack is replicated).

The model learns to imitate a fixed random "teacher" `StackedMLP`. Both are built
in their shards (`eqxscan.sharding.create`); each process feeds its own rows of
every batch. With `--checkpoint-dir`, Orbax checkpoints are written every
`--save-every` steps, and `--resume` continues from the latest one, on any
topology. The last line process 0 prints is

    final loss: <8 significant digits> after <S> steps on <P> processes x <K> devices

and is the same (to float rounding) for any topology, any pipeline schedule and
for a resumed run.
"""

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data",
        type=int,
        default=None,
        help="data-parallel replicas (default: one per process; rest: fsdp)",
    )
    parser.add_argument("--min-size", type=int, default=None, help="replicate below")
    group = parser.add_argument_group("pipeline")
    group.add_argument(
        "--pipeline-stages", type=int, default=0, help="S stages (0: no pipeline)"
    )
    group.add_argument(
        "--repeats", type=int, default=1, help="R > 1: the circular schedule"
    )
    group.add_argument("--microbatches", type=int, help="M (default: 2 * S)")
    group = parser.add_argument_group("processes")
    group.add_argument("--processes", type=int, help="start N local processes")
    group.add_argument(
        "--devices-per-process", type=int, help="K simulated CPU devices per process"
    )
    group.add_argument(
        "--distributed",
        action="store_true",
        help="join a job whose cluster JAX detects (SLURM, MPI, Kubernetes, TPU)",
    )
    group.add_argument("--coordinator", help="HOST:PORT of process 0 (on a cluster)")
    group.add_argument("--num-processes", type=int)
    group.add_argument("--process-id", type=int)
    group.add_argument(
        "--init-timeout", type=float, default=300, help="seconds to wait to join"
    )
    group = parser.add_argument_group("checkpoints")
    group.add_argument("--checkpoint-dir", help="Orbax checkpoints go here")
    group.add_argument("--save-every", type=int, default=0, help="every K steps")
    group.add_argument("--keep", type=int, default=3, help="keep the last N")
    group.add_argument("--resume", action="store_true", help="from the latest")
    return parser.parse_args()


def launch(args: argparse.Namespace) -> int:
    """Start `args.processes` copies of this script on 127.0.0.1 and wait for them.

    Process 0's output is ours; the others' goes to standard error. If one fails,
    the rest are stopped and its exit status is returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv, skip = [], False
    for a in sys.argv[1:]:  # drop --processes N
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes="):
            argv.append(a)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv]
            + ["--coordinator", f"127.0.0.1:{port}"]
            + ["--num-processes", str(args.processes), "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(args.processes)
    ]

    def relay(i: int, proc: subprocess.Popen) -> None:
        out = sys.stdout if i == 0 else sys.stderr
        for line in proc.stdout:
            if "[Gloo]" in line or "peer ranks" in line:
                continue  # gloo reports every connection
            out.write(line if i == 0 else f"[process {i}] {line}")
            out.flush()

    relays = [
        threading.Thread(target=relay, args=(i, p), daemon=True)
        for i, p in enumerate(procs)
    ]
    for t in relays:
        t.start()
    status = 0
    try:
        pending = dict(enumerate(procs))
        while pending and not status:
            for i, p in list(pending.items()):
                code = p.poll()
                if code is not None:
                    del pending[i]
                    if code:
                        status = code
                        print(f"process {i} exited with status {code}", file=sys.stderr)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for t in relays:
            t.join(timeout=5)
    return status


def train(args: argparse.Namespace) -> None:
    import jax

    if args.devices_per_process:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices_per_process)

    from eqxscan import checkpoint, distributed, sharding

    explicit = args.coordinator, args.num_processes, args.process_id
    if args.distributed or any(a is not None for a in explicit):
        distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            timeout=args.init_timeout,
        )

    import equinox as eqx
    import jax.numpy as jnp
    import optax

    import eqxscan

    main = jax.process_index() == 0
    say = print if main else (lambda *a, **k: None)
    nproc, local = jax.process_count(), jax.local_device_count()
    # 2**14 is eqxscan.sharding's own default: smaller arrays stay replicated.
    min_size = 2**14 if args.min_size is None else args.min_size
    stages = args.pipeline_stages
    if stages:
        if jax.device_count() % stages:
            raise SystemExit(
                f"--pipeline-stages {stages} does not divide the "
                f"{jax.device_count()} devices. Pass a divisor of the device count."
            )
        # Stages over consecutive devices (across processes), data-parallel
        # replicas of each stage next to it.
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh(
            (stages, jax.device_count() // stages), ("stage", "data"), axis_types=auto
        )
        fsdp_axis, batch_axes = None, ("data",)
        pipe = dict(
            mesh=mesh,
            microbatches=args.microbatches or 2 * stages,
            schedule="circular" if args.repeats > 1 else "gpipe",
            repeats=args.repeats,
            batch_axes=batch_axes,
        )
        # For R > 1, the natural order would hold other stages' layers on each
        # device; checkpoints keep it, so that they load into any topology.
        if args.repeats > 1 and not args.checkpoint_dir:
            pipe["layer_order"] = "stage"
    else:
        mesh = sharding.make_mesh(data=args.data if args.data else nproc)
        fsdp_axis, batch_axes, pipe = "fsdp", None, None
    place = dict(mesh=mesh, fsdp_axis=fsdp_axis, min_size=min_size)
    say(f"{nproc} processes x {local} devices, mesh {dict(mesh.shape)}")
    if pipe is not None:
        say(
            f"pipeline: {stages} stages, schedule {pipe['schedule']!r}, "
            f"repeats {args.repeats}, {pipe['microbatches']} microbatches"
        )

    key_model, key_teacher, key_data = jax.random.split(jax.random.key(args.seed), 3)

    def make(key: jax.Array) -> eqxscan.StackedMLP:
        return eqxscan.StackedMLP(args.dim, args.layers, key=key)

    # Built in their shards: no process holds a whole model.
    model = sharding.create(make, key_model, **place)
    teacher = sharding.create(make, key_teacher, **place)
    if pipe is not None and pipe.get("layer_order") == "stage":
        order = dict(stages=stages, repeats=args.repeats)
        blocks = sharding.pipeline_order(model.blocks, **order)
        model = eqx.tree_at(lambda m: m.blocks, model, blocks)
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    if pipe is not None:
        model_sh = sharding.model_shardings(model, **place)
    if pipe is not None and (args.repeats == 1 or "layer_order" in pipe):
        # Each device keeps its stage's layers: the layer axis over "stage".
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("stage"))
        layers = jax.tree.map(lambda _: split, model_sh.blocks.layers)
        model_sh = eqx.tree_at(lambda m: m.blocks.layers, model_sh, layers)

    def place_state(model, opt_state):
        if pipe is None:
            return sharding.shard(model, opt_state, **place)[:2]
        opt_sh = sharding.opt_state_shardings(
            opt_state, model, param_shardings=model_sh, **place
        )
        return sharding.constrain(model, model_sh), sharding.constrain(
            opt_state, opt_sh
        )

    model, opt_state = place_state(model, opt_state)
    # Every process must hold the same model and mesh before the first collective.
    distributed.check_same_job(model, opt_state, mesh=mesh)
    rows = distributed.local_rows(
        args.batch, mesh, batch_axes=batch_axes or ("data", "fsdp")
    )

    def batch_at(step: int) -> jax.Array:
        # Every process draws the global batch and keeps its own rows, so the run
        # is the same on any topology; a real loader reads only its own part.
        x = jax.random.normal(
            jax.random.fold_in(key_data, step), (args.batch, args.dim)
        )
        return sharding.shard(None, batch=x[rows], batch_axes=batch_axes, **place)[2]

    def forward(model: eqxscan.StackedMLP, x: jax.Array) -> jax.Array:
        if pipe is None:
            return model(x)
        return sharding.pipeline(model.blocks, x, **pipe)

    def loss_fn(model, teacher, x: jax.Array) -> jax.Array:
        return jnp.mean((forward(model, x) - teacher(x)) ** 2)

    @eqx.filter_jit(donate="all-except-first")
    def train_step(inputs, model, opt_state):
        x, teacher = inputs
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, teacher, x)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        model = eqx.apply_updates(model, updates)
        # Inside jit this pins the layout of the results (a constraint).
        model, opt_state = place_state(model, opt_state)
        return model, opt_state, loss

    ckpt, start = None, 0
    if args.checkpoint_dir:
        ckpt = checkpoint.CheckpointManager(args.checkpoint_dir, max_to_keep=args.keep)
        if args.resume and ckpt.latest_step() is not None:
            t = time.perf_counter()
            model, opt_state, start = ckpt.restore(
                model, opt_state, mesh=mesh, fsdp_axis=fsdp_axis, min_size=min_size
            )
            say(f"restored step {start} in {time.perf_counter() - t:.3f} s")
    if start >= args.steps:
        raise SystemExit(
            f"The checkpoint is at step {start}, and --steps is {args.steps}: "
            "nothing to train. Pass a larger --steps."
        )

    w1 = model.blocks.layers.w1
    local_shape = w1.addressable_shards[0].data.shape
    say(f"w1 {w1.shape}: spec {w1.sharding.spec}, {local_shape} per device")
    x = batch_at(start)
    stats = train_step.lower((x, teacher), model, opt_state).compile()
    stats = stats.compiled.memory_analysis()

    times, loss, saves = [], float("nan"), []
    for step in range(start, args.steps):
        if step > start:
            x = batch_at(step)
        t = time.perf_counter()
        model, opt_state, loss = train_step((x, teacher), model, opt_state)
        loss = float(loss)  # float() waits for the step to finish
        times.append(time.perf_counter() - t)
        if step % 10 == 0 or step == args.steps - 1:
            say(f"step {step:3d}  loss {loss:.5f}")
        done = step + 1
        if ckpt is not None and args.save_every and done % args.save_every == 0:
            t = time.perf_counter()
            ckpt.save(done, model, opt_state)
            saves.append((done, t, time.perf_counter() - t))

    mib = 2.0**-20
    if times[1:]:
        steady = sorted(times[1:])[len(times[1:]) // 2]  # median, compile excluded
        say(
            f"per device: arguments {stats.argument_size_in_bytes * mib:.2f} MiB, "
            f"temporaries {stats.temp_size_in_bytes * mib:.2f} MiB, "
            f"outputs {stats.output_size_in_bytes * mib:.2f} MiB; "
            f"step {steady * 1e3:.1f} ms (median)"
        )
    if ckpt is not None:
        ckpt.wait()
        if saves:
            done, t, blocked = saves[-1]
            path = os.path.join(ckpt.directory, str(done))
            size = sum(
                os.path.getsize(os.path.join(d, f))
                for d, _, files in os.walk(path)
                for f in files
            )
            say(
                f"checkpoint of step {done}: save blocked {blocked:.3f} s, "
                f"complete after {time.perf_counter() - t:.3f} s, "
                f"{size * mib:.2f} MiB on disk"
            )
        ckpt.close()
    say(
        f"final loss: {loss:#.8g} after {args.steps} steps on {nproc} processes x "
        f"{local} devices"
    )


if __name__ == "__main__":
    arguments = parse()
    if arguments.processes and arguments.processes > 1:
        sys.exit(launch(arguments))
    train(arguments)
