"""Train-step (forward and backward) time and XLA temp memory of
`eqxscan.matrix_scan`'s two forms on a gated-linear-attention state of
`heads x 64 x 64`: `"sequential"` (a scan over the T steps) against `"chunked"`
(matrix products within chunks of C steps), one sequence.

    python benchmarks/linear_matrix.py [--quick | --tiny] [--heads 4] [--rounds 7]
        [--size 64]

Times are medians over interleaved rounds (ratios to the sequential form within
a round); `--quick` (2 heads, 3 rounds) takes under 2 minutes on a 2-core CPU,
`--tiny` is a smoke run.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import eqxscan
from eqxscan.remat import time_interleaved


MiB = 2**20


def problem(T, H, dk, dv, seed=0):
    ka, kk, kv, kq = jax.random.split(jax.random.key(seed), 4)
    # GLA's gate: sigmoid(.) ** (1/16), decays mostly within 0.95 to 1.
    a = jnp.exp(jax.nn.log_sigmoid(jax.random.normal(ka, (T, H, dk))) / 16)
    k = jax.random.normal(kk, (T, H, dk)) / dk**0.5
    q = jax.random.normal(kq, (T, H, dk)) / dk**0.5
    v = jax.random.normal(kv, (T, H, dv))
    return a, k, v, q, jnp.zeros((H, dk, dv))


def train_step(method, chunk):
    def loss(a, k, v, q, s0):
        s_T, o = eqxscan.matrix_scan(
            a, k, v, q, s0, method=method, chunk_size=chunk, reverse=False
        )
        return jnp.sum(o**2) + jnp.sum(s_T**2), o

    # The outputs come back too, to compare the forms without another compile.
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def temp_mib(fn, args):
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / MiB


def forward_temp_mib(method, chunk, args):
    fwd = jax.jit(
        lambda *x: eqxscan.matrix_scan(
            *x, method=method, chunk_size=chunk, reverse=False
        )
    )
    return temp_mib(fwd, args)


def measure(T, H, dk, dv, chunks, rounds):
    """Rows `(form, median ms, sequential / this, train temp MiB, forward temp
    MiB)`, and the largest output difference of each chunked form from the
    sequential one, relative to the largest output."""
    args = problem(T, H, dk, dv)
    forms = [("sequential", 1)] + [("chunked", c) for c in chunks]
    steps, temps, outs = {}, {}, {}
    for method, chunk in forms:
        name = method if method == "sequential" else f"chunked C={chunk}"
        fn = train_step(method, chunk)
        compiled = fn.lower(*args).compile()
        steps[name] = lambda compiled=compiled: compiled(*args)
        temps[name] = (
            compiled.memory_analysis().temp_size_in_bytes / MiB,
            forward_temp_mib(method, chunk, args),
        )
    for name, run in steps.items():
        (_, outs[name]), _ = jax.block_until_ready(run())
    o_seq = outs.pop("sequential")
    scale = jnp.max(jnp.abs(o_seq))
    diffs = {n: float(jnp.max(jnp.abs(o - o_seq)) / scale) for n, o in outs.items()}
    times = {n: np.asarray(t) for n, t in time_interleaved(steps, rounds).items()}
    base = times["sequential"]
    rows = [
        (n, np.median(times[n]) * 1e3, np.median(base / times[n]), *temps[n])
        for n in steps  # in the order of `forms`
    ]
    return rows, diffs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 heads, 3 rounds")
    p.add_argument("--tiny", action="store_true", help="a smoke run, tiny sizes")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--size", type=int, default=None, help="dk = dv (default 64)")
    args = p.parse_args()
    if args.tiny:
        lengths, chunks, dk = [64], [16, 32], 16
        heads, rounds = 1, 2
    else:
        lengths, chunks, dk = [1024, 4096], [32, 64, 128], 64
        heads, rounds = (2, 3) if args.quick else (4, 7)
    heads = args.heads or heads
    dk = args.size or dk
    rounds = args.rounds or rounds
    print(
        f"backend {jax.default_backend()}, {heads} heads x {dk} x {dk} state, "
        f"fwd+bwd of one sequence, median of {rounds} rounds"
    )
    for T in lengths:
        rows, diffs = measure(T, heads, dk, dk, chunks, rounds)
        print(
            f"\nT={T}\n{'form':18s} {'ms':>9s} {'seq/this':>9s} "
            f"{'temp MiB':>9s} {'fwd temp':>9s}"
        )
        for name, ms, speedup, temp, fwd in rows:
            print(f"{name:18s} {ms:9.2f} {speedup:9.2f} {temp:9.2f} {fwd:9.2f}")
        worst = max(diffs.values())
        print(f"chunked vs sequential outputs: max relative difference {worst:.1e}")


if __name__ == "__main__":
    main()
