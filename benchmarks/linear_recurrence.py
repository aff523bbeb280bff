"""Forward-plus-backward time and XLA temporary memory of the forms
`eqxscan.Recurrent` runs a diagonal linear recurrence in, and what
`method="auto"` picks, over batch B, width D, length T, chunk size and dtype.

    python benchmarks/linear_recurrence.py            # the grid in docs/recurrent.md
    python benchmarks/linear_recurrence.py --quick    # a smaller grid, under 2 minutes
    python benchmarks/linear_recurrence.py --tiny     # a smoke test, seconds
    python -m benchmarks.linear_recurrence --accelerator   # the TPU table's points

The layer is `jax.vmap(Recurrent(MinGRU(D, D), method=...))` over a batch of B
sequences; the loss is the sum of squares of every step's carry. Forms:
`cell` (the cell step by step through the scan engine, `remat=False`), and
with every step's gates computed at once: `sequential` (a `lax.scan` of
`a * h + b`), `associative` and `chunked-C` (chunks of C steps). Times are
medians over interleaved rounds (`eqxscan.remat.time_interleaved`, 3 calls a
round). `auto` is timed as the form whose program it lowers to, exactly (as
itself where no form has its program: a chunk size the grid lacks);
`auto/best` is that form's time over the fastest form's at the same point.
"""

import argparse
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxscan
from eqxscan.remat import time_interleaved


GRIDS = {
    # (B, D, T, chunk sizes, dtypes)
    "full": (
        [1, 8],
        [64, 256, 1024],
        [256, 1024, 4096],
        [16, 64],
        ["float32", "bfloat16"],
    ),
    "quick": ([1, 8], [64, 256], [256, 1024], [64], ["float32"]),
    "tiny": ([2], [8], [32], [8], ["float32"]),
}


# The points an accelerator is measured at (docs/recurrent.md's TPU table):
# (B, D, T, dtype). One sequence's associative form at T * D >= 2**20 is not
# run: on a TPU v5e it compiled for minutes and ran 8-10x the chunked form.
ACCELERATOR = [
    *[(1, d, t, "float32") for d, t in [(128, 4096), (256, 256), (256, 1024)]],
    *[(1, d, t, "float32") for d, t in [(256, 4096), (512, 1024), (512, 4096)]],
    *[(1, d, t, "float32") for d, t in [(1024, 1024), (1024, 4096), (2048, 1024)]],
    *[(b, d, t, "float32") for b, d, t in [(2, 256, 1024), (2, 512, 4096)]],
    *[(b, d, t, "float32") for b, d, t in [(2, 1024, 4096), (4, 256, 1024)]],
    *[(8, d, t, "float32") for d in (128, 256, 512, 1024) for t in (1024, 4096)],
    (8, 256, 256, "float32"),
    (16, 1024, 1024, "float32"),
    (32, 256, 1024, "float32"),
    *[(1, d, t, "bfloat16") for d, t in [(256, 1024), (256, 4096), (512, 1024)]],
    *[(b, d, t, "bfloat16") for b, d, t in [(2, 256, 1024), (8, 128, 4096)]],
    *[(8, d, t, "bfloat16") for d, t in [(256, 1024), (256, 4096), (512, 1024)]],
    *[(b, d, t, "bfloat16") for b, d, t in [(8, 1024, 4096), (16, 1024, 1024)]],
]


def step_fn(cell, method, chunk_size, remat):
    """`jit` of `(cell, xs) -> (loss, grads)`."""
    rnn = eqxscan.Recurrent(cell, method=method, chunk_size=chunk_size, remat=remat)

    def loss(cell, xs):
        rnn_ = eqx.tree_at(lambda r: r.cell, rnn, cell)
        h0 = jnp.zeros((xs.shape[0], cell.hidden_size), xs.dtype)
        _, hs = jax.vmap(rnn_)(h0, xs)
        return jnp.sum(hs.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss))


def point(B, D, T, chunks, dtype, rounds, accelerator=False):
    key1, key2 = jax.random.split(jax.random.key(0))
    cell = eqxscan.MinGRU(D, D, dtype=jnp.dtype(dtype), key=key1)
    xs = jax.random.normal(key2, (B, T, D), dtype)
    # "cell": the cell step by step through the scan engine (what a `remat`
    # other than "auto" asks for), gates computed inside the loop.
    forms = {"cell": ("sequential", 64, False), "sequential": ("sequential", 64)}
    if accelerator:  # the forms `auto` picks from, alone
        del forms["cell"]
    if not accelerator or B > 1 or T * D < 2**20:
        forms["associative"] = ("associative", 64)
    forms |= {f"chunked-{c}": ("chunked", c) for c in chunks if c < T}
    runs, temp, text = {}, {}, {}
    for name, (method, c, *remat) in forms.items():
        lowered = step_fn(cell, method, c, remat[0] if remat else "auto").lower(
            cell, xs
        )
        text[name] = lowered.as_text()
        compiled = lowered.compile()
        memory = compiled.memory_analysis()
        temp[name] = None if memory is None else memory.temp_size_in_bytes
        runs[name] = lambda compiled=compiled: compiled(cell, xs)
        jax.block_until_ready(runs[name]())
    # `auto` is timed as the form it picks: the one with the very same program;
    # a program none of them has (a chunk size outside the grid's) is timed too.
    lowered = step_fn(cell, "auto", "auto", "auto").lower(cell, xs)
    same = [name for name, program in text.items() if program == lowered.as_text()]
    picked = same[0] if same else "auto"
    if not same:
        compiled = lowered.compile()
        memory = compiled.memory_analysis()
        temp[picked] = None if memory is None else memory.temp_size_in_bytes
        runs[picked] = lambda: compiled(cell, xs)
        jax.block_until_ready(runs[picked]())
    times = time_interleaved(runs, rounds, seed=0, calls=3)
    ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    return ms, temp, picked


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the smaller grid")
    size.add_argument("--tiny", action="store_true", help="a smoke test")
    size.add_argument(
        "--accelerator", action="store_true", help="the TPU table's 34 points"
    )
    p.add_argument("--rounds", type=int, default=None)
    args = p.parse_args()
    grid = "tiny" if args.tiny else "quick" if args.quick else "full"
    grid = "accelerator" if args.accelerator else grid
    rounds = args.rounds or {"tiny": 3, "quick": 7, "full": 15, "accelerator": 5}[grid]
    if grid == "accelerator":
        points = [(dt, b, d, t, [64]) for b, d, t, dt in ACCELERATOR]
    else:
        Bs, Ds, Ts, chunks, dtypes = GRIDS[grid]
        points = [(*p, chunks) for p in itertools.product(dtypes, Bs, Ds, Ts)]
    backend = jax.default_backend()
    print(f"backend {backend}, {jax.device_count()} device(s), {rounds} rounds")
    print("fwd+bwd median ms (XLA temp MiB); auto/best: auto's time over the fastest")
    worst = 0.0
    for dtype, B, D, T, chunks in points:
        ms, temp, picked = point(B, D, T, chunks, dtype, rounds, grid == "accelerator")
        best = min((t, n) for n, t in ms.items())
        ratio = ms[picked] / best[0]
        worst = max(worst, ratio)
        cells = "  ".join(
            f"{n} {t:.3f}" + ("" if temp[n] is None else f" ({temp[n] / 2**20:.1f})")
            for n, t in ms.items()
        )
        print(
            f"{dtype:8s} B={B:<2d} D={D:<4d} T={T:<5d} {cells}  fastest {best[1]}, "
            f"auto={picked} auto/best {ratio:.2f}"
        )
    print(f"worst auto/best: {worst:.2f}")


if __name__ == "__main__":
    main()
