"""One process times the train steps of a few of the bench's implementations at
one size, with the phases of compiling apart: the quickest look at MFU on an
accelerator, where `python -m benchmarks.bench` spends a worker process (10-15
s to open a TPU) on each measurement.

    python -m benchmarks.train_step                       # the TPU preset, L=16
    python -m benchmarks.train_step --model transformer --dim 2048 --batch 8 --seq 1024
    python -m benchmarks.train_step --tiny                # a smoke test

Each implementation is built, traced, lowered and compiled (each timed), run
once, then timed over `--repeats` steps (median); an implementation that does
not fit is reported so, and the next is measured. MFU is the model's matmul
FLOPs (the bench's `model_flops` / `transformer_flops`) over the step's time and
`--peak-flops` (default: looked up from the device kind).
"""

import argparse
import time

import jax
import numpy as np

from benchmarks.bench._measure import model_flops, out_of_memory, registry
from benchmarks.bench._transformer import transformer_flops
from eqxscan.remat import peak_of


def measure(impl, module, x, y, repeats):
    t0 = time.perf_counter()
    built = impl.build(module)
    jax.block_until_ready(built.params)
    t1 = time.perf_counter()
    traced = jax.jit(jax.value_and_grad(built.loss)).trace(built.params, x, y)
    t2 = time.perf_counter()
    lowered = traced.lower()
    t3 = time.perf_counter()
    compiled = lowered.compile()
    t4 = time.perf_counter()
    jax.block_until_ready(compiled(built.params, x, y))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(built.params, x, y))
        times.append(time.perf_counter() - start)
    memory = compiled.memory_analysis()
    return {
        "build_s": t1 - t0,
        "trace_s": t2 - t1,
        "lower_s": t3 - t2,
        "compile_s": t4 - t3,
        "step_s": float(np.median(times)),
        "temp_bytes": None if memory is None else memory.temp_size_in_bytes,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--impls", default="eqxscan,eqxscan-loop,eqxscan-remat,flax-linen")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-flops", type=float, default=None)
    p.add_argument("--tiny", action="store_true", help="a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.dim, args.batch, args.seq, args.repeats = 2, 32, 2, 8, 2
    impls, make = registry(args.model)
    names = [n.strip() for n in args.impls.split(",") if n.strip()]
    unknown = [n for n in names if n not in impls]
    if unknown:
        p.error(f"unknown implementation(s) {', '.join(unknown)}: {', '.join(impls)}")
    device = jax.devices()[0]
    peak = args.peak_flops
    if peak is None and device.platform != "cpu":
        found = peak_of(f"{device.platform}:{device.device_kind}")
        peak = None if found is None else found.flops
    tokens = args.batch * args.seq
    flops = (
        transformer_flops(args.layers, args.dim, tokens, args.seq)
        if args.model == "transformer"
        else model_flops(args.layers, args.dim, tokens)
    )
    module, x, y = make(args.layers, args.dim, args.batch, args.seq, args.dtype)
    print(
        f"{args.model} L={args.layers} D={args.dim} batch {args.batch} x seq "
        f"{args.seq} {args.dtype} on {device.platform}:{device.device_kind}, "
        f"JAX {jax.__version__}; median of {args.repeats} steps"
    )
    print(
        f"{'implementation':16s}{'step ms':>9s}{'MFU':>7s}{'temp MiB':>10s}"
        f"{'build s':>9s}{'trace s':>9s}{'lower s':>9s}{'compile s':>11s}"
    )
    for name in names:
        if not impls[name].available():
            print(f"{name:16s} not installed ({impls[name].requires})")
            continue
        try:
            r = measure(impls[name], module, x, y, args.repeats)
        except Exception as e:
            if (message := out_of_memory(e)) is None:
                raise
            print(f"{name:16s} does not fit: {message}")
            continue
        mfu = "" if peak is None else f"{100 * flops / r['step_s'] / peak:.1f}%"
        temp = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.0f}"
        print(
            f"{name:16s}{1e3 * r['step_s']:9.1f}{mfu:>7s}{temp:>10s}"
            f"{r['build_s']:9.1f}{r['trace_s']:9.1f}{r['lower_s']:9.1f}"
            f"{r['compile_s']:11.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
