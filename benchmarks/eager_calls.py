"""Eager calls of the scanning modules: time per call against the jitted call,
compiles after the first call, and memory growth.

    python benchmarks/eager_calls.py [CALLS]

Prints a Markdown table.
"""

import resource
import sys
import time

import equinox as eqx
import jax
import jax.monitoring
import jax.numpy as jnp

import eqxscan


COMPILES: list[str] = []


def _listen(name: str, _secs: float, **_kw: object) -> None:
    if name.endswith("backend_compile_duration"):
        COMPILES.append(name)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def models():
    key = jax.random.key(0)
    linears = [eqx.nn.Linear(64, 64, key=k) for k in jax.random.split(key, 6)]
    h0 = jnp.zeros(32)
    return {
        "Stacked": (
            eqxscan.Stacked(lambda k: eqx.nn.Linear(64, 64, key=k), 12, key=key),
            lambda m, x: m(x),
            jnp.ones(64),
        ),
        "StackedMLP": (
            eqxscan.StackedMLP(64, 12, key=key),
            lambda m, x: m(x),
            jnp.ones((4, 64)),
        ),
        "Recurrent": (
            eqxscan.Recurrent(eqx.nn.GRUCell(16, 32, key=key)),
            lambda m, x: m(h0, x),
            jnp.ones((30, 16)),
        ),
        "Chain": (
            eqxscan.Chain([*linears, eqx.nn.Lambda(jnp.tanh)]),
            lambda m, x: m(x),
            jnp.ones(64),
        ),
    }


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    jax.monitoring.register_event_duration_secs_listener(_listen)
    print("| model | eager ms/call | jitted ms/call | ratio | compiles | RSS MiB |")
    print("|---|---|---|---|---|---|")
    for name, (model, call, x) in models().items():
        jitted = eqx.filter_jit(call)
        jax.block_until_ready((jitted(model, x), call(model, x)))
        rss = _rss_mib()
        COMPILES.clear()
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(call(model, x))
        eager = (time.perf_counter() - start) / calls * 1e3
        compiles, grown = len(COMPILES), _rss_mib() - rss
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(jitted(model, x))
        jit = (time.perf_counter() - start) / calls * 1e3
        row = [f"{eager:.2f}", f"{jit:.2f}", f"{eager / jit:.2f}", str(compiles)]
        print(f"| {name} | " + " | ".join(row) + f" | {grown:+.0f} |", flush=True)


if __name__ == "__main__":
    main()
