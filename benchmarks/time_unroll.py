"""Train-step time of `unroll=2` against `unroll=1` for `eqxscan.Recurrent` cells,
in interleaved rounds (ratios within a round, median over rounds), each with the
`remat` that `"auto"` picks; and what `unroll="auto"` picks.

    python benchmarks/time_unroll.py [--rounds 41] [gru:256:8:30:64 ...]

A point is `cell:hidden:inputs:steps:batch`, with `cell` one of gru, lstm, elman.
"""

import argparse
import functools

import jax
import numpy as np
from bench import compile_step, rnn_problem

import eqxscan
from eqxscan.remat import time_interleaved


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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("points", nargs="*", default=POINTS)
    p.add_argument("--rounds", type=int, default=41)
    args = p.parse_args()
    print(f"backend {jax.default_backend()}, {args.rounds} rounds")
    for point in args.points:
        cell, hidden, inputs, steps, batch = point.split(":")
        hidden, inputs, steps, batch = map(int, (hidden, inputs, steps, batch))
        model, loss, data, _ = rnn_problem(cell, hidden, steps, inputs, batch)
        (choice,) = eqxscan.explain_auto(loss, model, *data)
        runs = {}
        for u in (1, 2):
            options = dict(remat=choice.remat, unroll=u)
            scan = model.with_options(**options)
            _, (fn, params), _ = compile_step(loss, scan, data)
            runs[f"u{u}"] = functools.partial(fn, params, *data)
        for run in runs.values():
            jax.block_until_ready(run())
        times = time_interleaved(runs, args.rounds, seed=5)
        ratio = np.median(np.asarray(times["u2"]) / np.asarray(times["u1"]))
        print(
            f"{point:20s} remat={choice.checkpoint_name:10s} "
            f"auto unroll={choice.unroll!r:5s} {choice.cost.flops:.2g} FLOPs/step  "
            f"unroll=1 {np.median(times['u1']) * 1e3:8.2f} ms  unroll=2/1 {ratio:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
