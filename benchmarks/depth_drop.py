"""LayerDrop and stochastic depth: train-step time against the same model
without dropping.

    python benchmarks/depth_drop.py [REPEATS] [BATCH ...]

A `StackedMLP` with L=32, D=256 (hidden 1024); one train step is
`eqx.filter_value_and_grad` of a squared loss plus an SGD update, jitted once
per model and batch size (default 32 and 128). Each step is warmed up, then
the models are timed interleaved, REPEATS times (default 7), each repeat with a
new key (so LayerDrop's pattern changes and the time averages over patterns),
with `block_until_ready`; the table gives the median, the ratio to
`p = 0` and how many programs each model compiled after its warm-up step (0:
every drop pattern reuses one executable). Prints a Markdown table.

`layer_drop=1e-9` keeps every layer (in practice) and so measures what the
`cond` itself costs; `layer_drop=0.99` skips almost every layer and so measures
the floor: what a skipped layer still costs (slicing its weights for the
`cond`, writing its zero gradient into the stacked gradient, its SGD update).
"""

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
    @eqx.filter_jit
    def step(model, x, key):
        def loss(m):
            return jnp.mean(m(x, key=key) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -1e-3 * g, grads))
        return value, model

    return step


def measure(repeats: int, batch: int) -> list[str]:
    x = jax.random.normal(jax.random.key(1), (batch, D))
    steps = {name: (model, train_step()) for name, model in models().items()}
    for model, step in steps.values():  # warm up: compile and run once
        jax.block_until_ready(step(model, x, jax.random.key(0)))
    times: dict[str, list[float]] = {name: [] for name in steps}
    compiles = dict.fromkeys(steps, 0)
    for r in range(repeats):
        key = jax.random.key(100 + r)  # a new drop pattern each repeat
        for name, (model, step) in steps.items():
            before = len(COMPILES)
            start = time.perf_counter()
            jax.block_until_ready(step(model, x, key))
            times[name].append(time.perf_counter() - start)
            compiles[name] += len(COMPILES) - before
    base = statistics.median(times["p = 0 (no dropping)"])
    rows = []
    for name in steps:
        median = statistics.median(times[name])
        rows.append(
            f"| {batch} | {name} | {median * 1e3:.1f} | {median / base:.2f}x | "
            f"{compiles[name]} |"
        )
    return rows


def main(repeats: int = 7, *batches: int) -> None:
    jax.monitoring.register_event_duration_secs_listener(_listen)
    rows = [row for batch in batches or (32, 128) for row in measure(repeats, batch)]
    print(
        f"StackedMLP L={L}, D={D}, {jax.devices()[0].platform}, median of "
        f"{repeats} interleaved train steps (one key each)\n"
    )
    print("| batch | model | train step (ms) | vs p = 0 | compiles after warm-up |")
    print("|---:|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
