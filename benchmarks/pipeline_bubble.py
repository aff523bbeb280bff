"""The pipeline bubble, counted and timed: GPipe (R = 1) and the circular schedule
(R = 2, 4) at S = 4 stages over M = 4, 8, 16 microbatches, on 8 simulated CPU
devices (a (stage=4, data=2) mesh).

    python benchmarks/pipeline_bubble.py [--dim 128] [--rows 32] [--repeat 5]
        [--plot bench_out/pipeline_bubble.png]

For each (M, R) it prints the idle stage-ticks counted in the schedule's table
(`eqxscan.sharding.pipeline_schedule`), the formula (S-1)/(R*M+S-1), the time
of a training step (forward and backward; the fastest of `--repeat`, the settings
taken in turns) and the idle fraction measured from step times, and the
per-device memory of the compiled step (`memory_analysis()`), as a Markdown
table. The timed step passes the stack as it is built (natural layer order,
placed by XLA: replicated for R > 1); the last column is the argument memory of
the same step with the stack in stage order (`eqxscan.sharding.pipeline_order`)
split over "stage" along its layer axis, `layer_order="stage"`.

The measured idle fraction is `1 - busy / step`: `busy` is the time of the same
work without the bubble (every device runs its chunk of layers, forward and
backward, on `R * M` microbatches back to back, with no fill, drain or transfers
between stages), `step` the pipelined step's. The simulated devices share the
machine's cores, so the timings are rough; the table's count is exact.
"""

import argparse
import os


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import eqxscan  # noqa: E402
from eqxscan import sharding  # noqa: E402


STAGES, LAYERS = 4, 16  # 16 layers: 1, 2 or 4 chunks per stage
MICROBATCHES = (4, 8, 16)
REPEATS = (1, 2, 4)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=32, help="rows per microbatch")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps")
    parser.add_argument("--plot", default="bench_out/pipeline_bubble.png")
    return parser.parse_args()


def prepare(mesh, blocks, microbatches: int, repeats: int, args) -> dict:
    schedule = "gpipe" if repeats == 1 else "circular"
    x = jax.random.normal(jax.random.key(1), (microbatches * args.rows, args.dim))
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))

    def step(blocks, x, layer_order):
        def loss(blocks):
            y = sharding.pipeline(
                blocks,
                x,
                mesh=mesh,
                microbatches=microbatches,
                schedule=schedule,
                repeats=repeats,
                batch_axes="data",
                layer_order=layer_order,
            )
            return jnp.mean(y**2)

        return eqx.filter_value_and_grad(loss)(blocks)

    step = eqx.filter_jit(step)
    compiled = step.lower(blocks, x, "natural").compile()
    memory = compiled.compiled.memory_analysis()
    # The stack in stage order, each device holding its stage's layers.
    ordered = sharding.pipeline_order(blocks, stages=STAGES, repeats=repeats)
    dyn, static = eqx.partition(ordered, eqx.is_array)
    dyn = jax.device_put(dyn, NamedSharding(mesh, PartitionSpec("stage")))
    ordered = eqx.combine(dyn, static)
    staged = step.lower(ordered, x, "stage").compile().compiled.memory_analysis()
    jax.block_until_ready(compiled(blocks, x, "natural"))
    run_busy = busy(mesh, blocks, microbatches, repeats, args)
    table = sharding.pipeline_schedule(
        stages=STAGES, microbatches=microbatches, repeats=repeats, schedule=schedule
    )
    return {
        "M": microbatches,
        "R": repeats,
        "ticks": table.ticks,
        "idle": table.idle,
        "counted": table.bubble,
        "formula": (STAGES - 1) / (repeats * microbatches + STAGES - 1),
        "run": lambda: jax.block_until_ready(compiled(blocks, x, "natural")),
        "run_busy": run_busy,
        "times": [],
        "busy_times": [],
        "args_mib": memory.argument_size_in_bytes / 2**20,
        "temp_mib": memory.temp_size_in_bytes / 2**20,
        "staged_args_mib": staged.argument_size_in_bytes / 2**20,
    }


def busy(mesh, blocks, microbatches: int, repeats: int, args):
    """The same work without the bubble: every device runs its chunk (forward and
    backward) on `repeats * microbatches` microbatches back to back, with no
    fill, drain or transfers. Returns a function that runs it once."""
    per = LAYERS // (STAGES * repeats)
    dyn, static = eqx.partition(blocks[:per], eqx.is_array)
    rows = NamedSharding(mesh, PartitionSpec(None, "data"))
    xs = jax.random.normal(
        jax.random.key(2), (repeats * microbatches, args.rows, args.dim)
    )
    xs = jax.device_put(xs, rows)

    def on_device(dyn, xs):
        chunk = eqx.combine(dyn, static)
        _, ys = jax.lax.scan(lambda _, x: (None, chunk(x)), None, xs)
        return jnp.sum(ys**2)[None]

    @eqx.filter_jit
    def step(dyn, xs):
        def loss(dyn):
            out = jax.shard_map(
                on_device,
                mesh=mesh,
                in_specs=(PartitionSpec(), PartitionSpec(None, "data")),
                out_specs=PartitionSpec(("stage", "data")),
            )(dyn, xs)
            return jnp.sum(out)

        return jax.value_and_grad(loss)(dyn)

    compiled = step.lower(dyn, xs).compile()
    jax.block_until_ready(compiled(dyn, xs))
    return lambda: jax.block_until_ready(compiled(dyn, xs))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=80)
    grid = np.linspace(min(MICROBATCHES), max(MICROBATCHES), 50)
    for repeats, color in zip(REPEATS, ("C0", "C1", "C2")):
        some = [r for r in rows if r["R"] == repeats]
        formula = (STAGES - 1) / (repeats * grid + STAGES - 1)
        ax.plot(grid, formula, color=color, label=f"(S-1)/(R·M+S-1), R={repeats}")
        ax.plot(
            [r["M"] for r in some],
            [r["counted"] for r in some],
            "x",
            color=color,
            label=f"counted in the schedule, R={repeats}",
        )
        ax.plot(
            [r["M"] for r in some],
            [r["measured"] for r in some],
            "o",
            color=color,
            label=f"1 - busy/step (timed), R={repeats}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(MICROBATCHES, [str(m) for m in MICROBATCHES])
    ax.set_xlabel("microbatches M")
    ax.set_ylabel("idle fraction")
    ax.set_title(f"Pipeline bubble, S={STAGES} stages (8 CPU devices)", fontsize=10)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, ncol=3, loc="upper center")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    print(f"\nplot: {path}")


def main() -> None:
    args = parse()
    mesh = jax.make_mesh(
        (STAGES, 2), ("stage", "data"), axis_types=(AxisType.Auto,) * 2
    )
    blocks = eqxscan.StackedMLP(args.dim, LAYERS, key=jax.random.key(0)).blocks
    rows = [prepare(mesh, blocks, m, r, args) for r in REPEATS for m in MICROBATCHES]
    # Round robin, so that a slow spell of the machine touches every setting.
    for _ in range(args.repeat):
        for r in rows:
            for run, times in (
                (r["run"], r["times"]),
                (r["run_busy"], r["busy_times"]),
            ):
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
    for r in rows:
        # The fastest, the least disturbed by other processes.
        r["time"], r["busy"] = min(r["times"]), min(r["busy_times"])
        r["measured"] = 1 - r["busy"] / r["time"]
    print(
        f"S={STAGES}, L={LAYERS}, D={args.dim}, {args.rows} rows per microbatch, "
        f"{jax.device_count()} devices, jax {jax.__version__}\n"
    )
    print(
        "| R | M | ticks | idle stage-ticks | counted | (S-1)/(R·M+S-1) | "
        "step (ms) | busy work (ms) | measured 1 - busy/step | args (MiB) | "
        "temp (MiB) | args, stage order (MiB) |"
    )
    print("|" + " --- |" * 12)
    for r in rows:
        print(
            f"| {r['R']} | {r['M']} | {r['ticks']} | {r['idle']} / "
            f"{r['ticks'] * STAGES} | {r['counted']:.3f} | {r['formula']:.3f} | "
            f"{r['time'] * 1e3:.1f} | {r['busy'] * 1e3:.1f} | {r['measured']:.3f} | "
            f"{r['args_mib']:.2f} | {r['temp_mib']:.2f} | "
            f"{r['staged_args_mib']:.2f} |"
        )
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
