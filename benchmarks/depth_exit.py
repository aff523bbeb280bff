"""Early exit after k of L layers (`eqxscan.run_until` on a `StackedMLP`'s
blocks) against the full forward pass, and how many programs every exit depth
compiles.

    python benchmarks/depth_exit.py [--layers 32] [--dim 256] [--batch 32]
                                    [--repeats 41]

The predicate is a threshold on the carry's norm, passed to the compiled
function as an argument; the benchmark picks, for each k, a threshold between
the norms after k - 1 and k layers (the residual stream's norm grows with
depth), so the run exits after exactly k layers (checked). Prints a Markdown
table: the median wall time and CPU time (this process's, all threads) per
call over interleaved repeats, after warm-up; every run is checked to have
stopped after k layers.
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

import eqxscan


COMPILES: list[str] = []


def _listen(name: str, _secs: float, **_kw: object) -> None:
    if name.endswith("backend_compile_duration"):
        COMPILES.append(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_listen)
    L = args.layers
    model = eqxscan.StackedMLP(args.dim, L, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch, args.dim))

    full = eqx.filter_jit(lambda m, x: m(x))

    @eqx.filter_jit
    def early(m, x, threshold):
        return eqxscan.run_until(m.blocks, x, lambda c: jnp.linalg.norm(c) > threshold)

    @eqx.filter_jit
    def norms(m, x):
        # ||x|| after 0, 1, ..., L layers.
        step = lambda layer, c: (layer(c), jnp.linalg.norm(c))  # noqa: E731
        last, ys = m.blocks.scan(x, method=step)
        return jnp.append(ys, jnp.linalg.norm(last))

    depth_norms = np.asarray(norms(model, x))
    assert np.all(np.diff(depth_norms) > 0), "the norm must grow with depth"
    ks = [k for k in (4, 8, 16, 32) if k <= L]
    thresholds = {
        k: jnp.float32(
            (depth_norms[k - 1] + depth_norms[k]) / 2
            if k < L
            else depth_norms[L] + 1.0  # never holds: every layer runs
        )
        for k in ks
    }
    jax.block_until_ready(full(model, x))
    COMPILES.clear()
    for k in ks:
        _, ran = early(model, x, thresholds[k])
        assert int(ran) == k, (k, int(ran))
    compiled = len(COMPILES)
    y, _ = early(model, x, thresholds[ks[-1]])
    if ks[-1] == L:
        np.testing.assert_allclose(y, full(model, x), rtol=2e-4, atol=2e-4)

    calls = {"full": lambda: full(model, x)}
    calls.update({k: (lambda k=k: early(model, x, thresholds[k])) for k in ks})
    for fn in calls.values():  # warm-up
        jax.block_until_ready(fn())
    times: dict[object, list[float]] = {name: [] for name in calls}
    cpu: dict[object, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):  # interleaved
        for name, fn in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
            # This process's CPU time (XLA's threads included): on a shared
            # machine it leaves out the time spent waiting for a core.
            cpu[name].append(time.process_time() - start_cpu)
    wall = {name: statistics.median(t) for name, t in times.items()}
    used = {name: statistics.median(t) for name, t in cpu.items()}

    print(
        f"Early exit, StackedMLP L={L}, D={args.dim}, batch {args.batch}, "
        f"{jax.devices()[0].platform}; median of {args.repeats} interleaved "
        "repeats"
    )
    print()
    print(
        "| exit after k | wall (ms) | × full | CPU (ms) | × full (CPU) "
        "| target k/L + 0.1 |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| full forward ({L} layers) | {wall['full'] * 1e3:.2f} | 1.00 | "
        f"{used['full'] * 1e3:.2f} | 1.00 | |"
    )
    for k in ks:
        target = k / L + 0.1
        ratios = (wall[k] / wall["full"], used[k] / used["full"])
        marks = ["✓" if r <= target else "✗" for r in ratios]
        print(
            f"| {k} | {wall[k] * 1e3:.2f} | {ratios[0]:.2f} {marks[0]} | "
            f"{used[k] * 1e3:.2f} | {ratios[1]:.2f} {marks[1]} | {target:.3f} |"
        )
    print()
    print(f"Programs compiled for the {len(ks)} exit depths: {compiled}")


if __name__ == "__main__":
    main()
