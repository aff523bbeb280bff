"""Train-step time of `unroll=2` against `unroll=1` for `eqxscan.Recurrent` cells,
in interleaved rounds (ratios within a round, median over rounds), each with the
`checkpoint` that `"auto"` picks; and what `unroll="auto"` picks.

    python benchmarks/time_unroll.py [--rounds 41] [gru:256:8:30:64 ...]

A point is `cell:hidden:inputs:steps:batch`, with `cell` one of gru, lstm, elman.
"""

import argparse
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxscan
from eqxscan.remat import time_interleaved


CELLS = {"gru": eqx.nn.GRUCell, "lstm": eqx.nn.LSTMCell, "elman": eqxscan.ElmanCell}
POINTS = [
    "gru:256:8:30:64",
    "gru:256:8:300:64",
    "gru:256:8:30:256",
    "gru:256:256:30:64",
    "gru:256:256:300:64",
    "gru:512:8:30:64",
    "gru:512:256:30:64",
    "gru:128:256:30:64",
    "elman:512:8:30:64",
    "elman:512:8:30:256",
    "elman:512:8:300:64",
    "elman:1024:8:30:64",
    "elman:256:256:30:64",
    "gru:256:8:30:16",
    "gru:128:8:30:64",
    "lstm:256:8:30:64",
]


def loss(model, h0, xs):
    _, hs = jax.vmap(model)(h0, xs)
    return jnp.mean(jax.tree.leaves(hs)[0] ** 2)


def compiled(model, h0, xs):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    step = jax.value_and_grad(lambda p, *a: loss(eqx.combine(p, static), *a))
    fn = jax.jit(step).lower(params, h0, xs).compile()
    return functools.partial(fn, params, h0, xs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("points", nargs="*", default=POINTS)
    p.add_argument("--rounds", type=int, default=41)
    args = p.parse_args()
    print(f"backend {jax.default_backend()}, {args.rounds} rounds")
    for point in args.points:
        cell, hidden, inputs, steps, batch = point.split(":")
        hidden, inputs, steps, batch = map(int, (hidden, inputs, steps, batch))
        model = eqxscan.Recurrent(CELLS[cell](inputs, hidden, key=jax.random.key(0)))
        rng = np.random.default_rng(0)
        xs = jnp.asarray(rng.standard_normal((batch, steps, inputs)), jnp.float32)
        zeros = jnp.zeros((batch, hidden), jnp.float32)
        h0 = (zeros, zeros) if cell == "lstm" else zeros
        (choice,) = eqxscan.explain_auto(loss, model, h0, xs)
        runs = {
            f"u{u}": compiled(
                model.with_options(checkpoint=choice.checkpoint, unroll=u), h0, xs
            )
            for u in (1, 2)
        }
        for run in runs.values():
            jax.block_until_ready(run())
        times = time_interleaved(runs, args.rounds, seed=5)
        ratio = np.median(np.asarray(times["u2"]) / np.asarray(times["u1"]))
        print(
            f"{point:20s} checkpoint={choice.checkpoint_name:10s} "
            f"auto unroll={choice.unroll!r:5s} {choice.cost.flops:.2g} FLOPs/step  "
            f"unroll=1 {np.median(times['u1']) * 1e3:8.2f} ms  unroll=2/1 {ratio:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
