"""LayerDrop and stochastic depth: train-step time against the same model
without dropping.

    python benchmarks/depth_drop.py [REPEATS] [BATCH ...]

A `StackedMLP` with L=32, D=256 (hidden 1024); one train step is
`eqx.filter_value_and_grad` of a squared loss plus an SGD update, jitted once
per model and batch size (default 32 and 128). Each step is warmed up, then
the models are timed interleaved, REPEATS times (default 24), repeat `r` with
key `100 + r` for
every model (so LayerDrop's pattern changes between repeats, and the models
see the same patterns), with `block_until_ready`; the table gives the median,
the ratio to `p = 0`, how many layers LayerDrop ran on average over the
repeats' keys (by the documented key derivation) and how many programs each
model compiled after its warm-up step (0: every drop pattern reuses one
executable). Prints a Markdown table.

On CPU, glibc serves each buffer of 32 MiB or more (here every stacked
gradient) with fresh `mmap`ed pages, and the kernel's page faults on them cost
about as much as this model's whole forward pass: a fixed cost of every step,
dropping or not, that has nothing to do with the layers. The table names the
allocator setting; `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` backs those buffers
with huge pages (2 MiB), which removes most of that cost.

`layer_drop=1e-9` keeps every layer (in practice) and so measures what the
`cond` itself costs; `layer_drop=0.99` skips almost every layer and so measures
the floor: what a skipped layer still costs (slicing its weights for the
`cond`, writing its zero gradient into the stacked gradient, its SGD update).
"""

import os
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.monitoring
import jax.numpy as jnp

import eqxscan


L, D = 32, 256
COMPILES: list[str] = []


def _listen(name: str, _secs: float, **_kw: object) -> None:
    if name.endswith("backend_compile_duration"):
        COMPILES.append(name)


def models() -> dict[str, eqxscan.StackedMLP]:
    key = jax.random.key(0)
    return {
        "p = 0 (no dropping)": eqxscan.StackedMLP(D, L, key=key),
        "layer_drop=0.5": eqxscan.StackedMLP(D, L, key=key, layer_drop=0.5),
        "layer_drop=0.2": eqxscan.StackedMLP(D, L, key=key, layer_drop=0.2),
        # The cost of the `cond` alone (every layer kept, in practice), and the
        # floor (almost every layer skipped: what a skipped layer still costs).
        "layer_drop=1e-9": eqxscan.StackedMLP(D, L, key=key, layer_drop=1e-9),
        "layer_drop=0.99": eqxscan.StackedMLP(D, L, key=key, layer_drop=0.99),
        "drop_path=0.1": eqxscan.StackedMLP(D, L, key=key, drop_path=0.1),
        "drop_path=linear_rates(0.2)": eqxscan.StackedMLP(
            D, L, key=key, drop_path=eqxscan.linear_rates(0.2)
        ),
    }


def train_step():
    def step(x, model, key):
        def loss(m):
            return jnp.mean(m(x, key=key) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -1e-3 * g, grads))
        return value, model

    return eqx.filter_jit(step)


def layers_run(model: eqxscan.StackedMLP, keys: list[jax.Array]) -> float:
    """The mean number of layers LayerDrop runs for these keys, drawn as
    docs/depth.md documents: per layer `k_layer = split(drop_keys[i])[0]`."""
    rates = jnp.asarray(_rates(model))
    runs = []
    for key in keys:
        drop_keys = jax.random.split(jax.random.fold_in(key, 0x5D0), L)
        k_layer = jax.vmap(lambda k: jax.random.split(k)[0])(drop_keys)
        runs.append(int(jnp.sum(jax.vmap(jax.random.bernoulli)(k_layer, 1 - rates))))
    return statistics.mean(runs)


def _rates(model: eqxscan.StackedMLP) -> tuple[float, ...]:
    drop = model.blocks.drop_rates
    return (0.0,) * L if drop is None else drop.layer_drop


def measure(repeats: int, batch: int) -> list[str]:
    x = jax.random.normal(jax.random.key(1), (batch, D))
    keys = [jax.random.key(100 + r) for r in range(repeats)]
    steps = {}
    for name, model in models().items():
        step = train_step()
        jax.block_until_ready(step(x, model, jax.random.key(0)))  # compile, run
        steps[name] = model, step
    times: dict[str, list[float]] = {name: [] for name in steps}
    compiles = dict.fromkeys(steps, 0)
    for key in keys:  # a new drop pattern each repeat, the same for every model
        for name, (model, step) in steps.items():
            before = len(COMPILES)
            start = time.perf_counter()
            jax.block_until_ready(step(x, model, key))
            times[name].append(time.perf_counter() - start)
            compiles[name] += len(COMPILES) - before
    base = statistics.median(times["p = 0 (no dropping)"])
    rows = []
    for name, (model, _) in steps.items():
        median = statistics.median(times[name])
        rows.append(
            f"| {batch} | {name} | {median * 1e3:.1f} | {median / base:.2f}x | "
            f"{layers_run(model, keys):.1f} | {compiles[name]} |"
        )
    return rows


def main(repeats: int = 24, *batches: int) -> None:
    jax.monitoring.register_event_duration_secs_listener(_listen)
    rows = [row for batch in batches or (32, 128) for row in measure(repeats, batch)]
    tunables = os.environ.get("GLIBC_TUNABLES", "none (glibc's defaults)")
    print(
        f"StackedMLP L={L}, D={D}, {jax.devices()[0].platform}, median of "
        f"{repeats} interleaved train steps (one key each); GLIBC_TUNABLES: "
        f"{tunables}\n"
    )
    print(
        "| batch | model | train step (ms) | vs p = 0 | layers run (mean) "
        "| compiles after warm-up |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
