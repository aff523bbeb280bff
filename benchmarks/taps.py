"""Taps and the non-finite finder: train-step time against the same step
without them.

    python benchmarks/taps.py [REPEATS] [BATCH]

The blocks of a `StackedMLP` (L=16, D=256, hidden 1024) on a batch (default
32); one train step is `eqx.filter_value_and_grad` of a squared loss plus an
SGD update, jitted once. Compared: the step without taps; with carry taps of
`rms` and `max_abs` (`eqxscan.tap`, returned as aux); with gradient taps of
the same two statistics (an `eqxscan.Probe` differentiated in the same call);
and `eqxscan.find_nonfinite` on the same loss (value and gradients with
non-finite counts, read back on the host). Each is warmed up, then they are
timed interleaved, REPEATS times (default 20), with `block_until_ready`; the
table gives medians and the ratio to the step without taps.
"""

import statistics
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxscan
from eqxscan.stats import max_abs, rms


L, D = 16, 256


def stats(x):
    return {"rms": rms(x), "max_abs": max_abs(x)}


def loss_fn(blocks, x):
    return jnp.mean(blocks(x) ** 2)


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -1e-3 * g, grads))


@eqx.filter_jit
def plain(blocks, x):
    value, grads = eqx.filter_value_and_grad(loss_fn)(blocks, x)
    return value, sgd(blocks, grads)


@eqx.filter_jit
def carry_taps(blocks, x):
    def loss(b):
        y, taps = eqxscan.tap(b, stats)(x)
        return jnp.mean(y**2), taps

    (value, taps), grads = eqx.filter_value_and_grad(loss, has_aux=True)(blocks)
    return value, taps, sgd(blocks, grads)


@eqx.filter_jit
def grad_taps(blocks, probe, x):
    def loss(bp):
        b, p = bp
        y, _ = eqxscan.tap(b, probe=p)(x)
        return jnp.mean(y**2)

    value, (grads, g_probe) = eqx.filter_value_and_grad(loss)((blocks, probe))
    return value, g_probe.values, sgd(blocks, grads)


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    blocks = eqxscan.StackedMLP(D, L, key=jax.random.key(0)).blocks
    x = jax.random.normal(jax.random.key(1), (batch, D))
    probe = eqxscan.probe(stats, x, L)
    runs = {
        "no taps": lambda: plain(blocks, x),
        "carry taps (rms, max_abs)": lambda: carry_taps(blocks, x),
        "gradient taps (rms, max_abs)": lambda: grad_taps(blocks, probe, x),
        "find_nonfinite": lambda: eqxscan.find_nonfinite(blocks, loss_fn, x),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        jax.block_until_ready(fn())  # compile
        jax.block_until_ready(fn())
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["no taps"])
    print(
        f"L={L}, D={D}, batch={batch}, {repeats} repeats, {jax.devices()[0].platform}"
    )
    print("| step | median ms | ratio |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {1e3 * m:.2f} | {m / base:.3f} |")


if __name__ == "__main__":
    main()
