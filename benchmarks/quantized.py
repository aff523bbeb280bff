"""Quantized stacked weights against float ones, for a decode step of a
StackedMLP (one token per row, the weights as arguments): the model's bytes,
XLA's temporaries (`memory_analysis()`) and bytes accessed (`cost_analysis()`),
compile time, and step time (median of interleaved repeats after a warm-up:
`step ms` waits for each step, `steady ms` is the rate of 8 steps dispatched back
to back, as a decode loop runs them; on an accelerator `of HBM` is the weights'
bytes over the steady step, as a fraction of the rate a sum reads at),
for float32, bfloat16, int8, int4 (groups of 128; `int4-channel`: a scale per
output channel) and fp8, each scanned
(`mode="scan"`, `unroll=1`), unrolled (`mode="loop"`) and as eqxscan's default
options choose, side by side. Then, for each size, the decode targets (the
default's steady step against the loop's and bfloat16's, and HBM's rate) met or
missed (a default compiled to the loop's own program meets "<= 1.0x the loop"
whatever the noise in their times), and each quantized kind's accuracy against
float32: the worst relative Frobenius error of a layer's weight
(`quant.report`) and the output's largest difference.

    python -m benchmarks.quantized            # B = 1 and 8, L = 16, D = 512
                                              # (on a GPU or TPU: B = 8, D = 2048)
    python -m benchmarks.quantized --full     # B = 1, 8; L = 16, 32; D = 512, 1024
    python -m benchmarks.quantized --tiny     # a smoke test
    python -m benchmarks.quantized --kernel xla pallas   # the Pallas kernel too
    python -m benchmarks.quantized --compute float32     # quantized models in float32

`--kernel pallas` runs the quantized formats with `kernel="pallas"` (the
Pallas TPU kernel; off a TPU the XLA path, so only a TPU's numbers say
anything), listed as `int8/pallas`; `--kernel xla pallas` measures both paths
in the same interleaved rounds.

One process: run it alone on an accelerator. A size that does not fit in the
device's memory is reported as such (`does not fit`) and the next one measured.
"""

import argparse
import hashlib
import itertools
import re
import statistics
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxscan
from benchmarks.bench._measure import out_of_memory
from eqxscan import quant


FORMATS = ("float32", "bfloat16", "int8", "int4", "int4-channel", "fp8")
STEPS = {
    "scan": dict(mode="scan", unroll=1),
    "unrolled": dict(mode="loop"),
    # eqxscan's default (`unroll="auto"`: off CPU, a decode step over at most
    # 32 layers is unrolled fully).
    "default": {},
}
TARGETS = ["blocks.*.w1", "blocks.*.w2"]


def _nbytes(tree) -> int:
    # `jnp.int4` reports a byte an element; a TPU holds two a byte.
    bits = lambda x: 4 if x.dtype == jnp.int4 else 8 * x.dtype.itemsize
    return sum(x.size * bits(x) // 8 for x in jax.tree.leaves(tree) if eqx.is_array(x))


def model_of(
    fmt: str,
    dim: int,
    layers: int,
    kernel: quant.Kernel = "xla",
    compute: str = "float32",
) -> eqxscan.StackedMLP:
    """The model in `fmt`: a float dtype, or the weights of a `compute`-dtype
    model quantized (which then computes in that dtype, its products by
    `kernel`)."""
    dtype = jnp.bfloat16 if "bfloat16" in (fmt, compute) else jnp.float32
    if fmt == "float32":
        dtype = jnp.float32
    model = eqxscan.StackedMLP(dim, layers, key=jax.random.key(0), dtype=dtype)
    if fmt in ("float32", "bfloat16"):
        return model
    kind, group = ("int4", None) if fmt == "int4-channel" else (fmt, 128)
    return quant.quantize(model, TARGETS, kind=kind, group_size=group, kernel=kernel)


def _accessed(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("bytes accessed", float("nan")))


def compile_step(model, batch: int, step: str) -> tuple[Callable[[], jax.Array], dict]:
    """The compiled step, ready to call, and what XLA says of it."""
    model = eqx.tree_at(
        lambda m: m.blocks, model, model.blocks.with_options(**STEPS[step])
    )
    params, static = eqx.partition(model, eqx.is_array)
    x = jnp.ones((batch, model.dim), model.dtype)
    start = time.perf_counter()
    compiled = (
        jax.jit(lambda p, x: eqx.combine(p, static)(x)).lower(params, x).compile()
    )
    seconds = time.perf_counter() - start
    facts = {
        "bytes": _nbytes(params),
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "accessed": _accessed(compiled),
        "compile_s": seconds,
        "program": _program(compiled.as_text()),
    }
    return (lambda: compiled(params, x)), facts


def _program(hlo: str) -> str:
    """A digest of a compiled program's instructions, without the source
    locations: two steps of one program time apart by noise alone."""
    hlo = re.sub(r",? metadata=\{[^}]*\}|, stack_frame_id=\d+", "", hlo)
    kept = (" ", "%", "ENTRY", "HloModule", "}", "ROOT")
    code = "\n".join(line for line in hlo.splitlines() if line.startswith(kept))
    return hashlib.sha256(code.encode()).hexdigest()


def measure(
    batch: int,
    layers: int,
    dim: int,
    repeats: int,
    kernels: tuple[quant.Kernel, ...] = ("xla",),
    compute: str = "float32",
) -> list[dict]:
    """Every format (a quantized one by each of `kernels`) and step at one
    size, timed in interleaved rounds."""
    runs = []
    for fmt in FORMATS:
        for kernel in kernels if fmt not in ("float32", "bfloat16") else ("xla",):
            model = model_of(fmt, dim, layers, kernel, compute)
            label = fmt if kernel == "xla" else f"{fmt}/{kernel}"
            for step in STEPS:
                call, facts = compile_step(model, batch, step)
                call().block_until_ready()  # warm-up
                runs.append((call, {"format": label, "step": step, **facts}, []))
    steady = {id(call): [] for call, _, _ in runs}
    for _ in range(repeats):
        for call, _, times in runs:
            start = time.perf_counter()
            call().block_until_ready()
            times.append(time.perf_counter() - start)
        for call, _, _ in runs:
            steady[id(call)].append(_back_to_back(call))
    return [
        {
            **facts,
            "step_ms": 1e3 * statistics.median(t),
            "steady_ms": 1e3 * statistics.median(steady[id(call)]),
        }
        for call, facts, t in runs
    ]


def _back_to_back(call: Callable[[], jax.Array], calls: int = 8) -> float:
    """Seconds per step of `calls` steps dispatched without waiting for each: a
    decode loop's rate, the host's dispatch hidden behind the device's work."""
    start = time.perf_counter()
    for _ in range(calls):
        out = call()
    out.block_until_ready()
    return (time.perf_counter() - start) / calls


def hbm_read_rate(nbytes: int = 2**30) -> float | None:
    """Bytes per second the device reads: the steady rate of a sum over a
    `nbytes` bfloat16 array (`None` on a CPU, where it says nothing of HBM)."""
    if jax.default_backend() == "cpu":
        return None
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    total(x).block_until_ready()
    return nbytes / statistics.median(_back_to_back(lambda: total(x)) for _ in range(5))


def decode_targets(
    rows: list[dict], layers: int, rate: float | None
) -> list[tuple[str, str, bool | None]]:
    """The decode targets of one size's `rows` (from `measure`), each as
    `(target, measured, met)`: ratios within the run, and fractions of the
    `rate` HBM reads at (`met` is `None` where not measured: no `rate` on a
    CPU, or a format missing)."""
    by = {(r["format"], r["step"]): r for r in rows}
    out: list[tuple[str, str, bool | None]] = []

    def steady(fmt: str, step: str = "default") -> float | None:
        return by[fmt, step]["steady_ms"] if (fmt, step) in by else None

    def ratio(name: str, a: float | None, b: float | None, bound: float) -> None:
        if a is None or b is None:
            out.append((name, "not measured", None))
        else:
            out.append((name, f"{a / b:.2f}x", a / b <= bound))

    scan, loop = by.get(("float32", "scan")), by.get(("float32", "unrolled"))
    if scan and loop:
        layer = scan["bytes"] / layers
        extra = (scan["temp"] - loop["temp"]) / 2**20
        out.append(
            (
                "float32 scan temp <= the loop's + one layer",
                f"{extra:+.2f} MiB (a layer {layer / 2**20:.1f})",
                scan["temp"] <= loop["temp"] + layer,
            )
        )
    name = "float32 default step <= 1.0x the loop"
    default = by.get(("float32", "default"))
    if default and loop and default.get("program") == loop.get("program") is not None:
        # The default compiled to the loop's own program: equal by construction.
        out.append(
            (
                name,
                f"same program ({default['steady_ms'] / loop['steady_ms']:.2f}x)",
                True,
            )
        )
    else:
        ratio(name, steady("float32"), steady("float32", "unrolled"), 1.0)
    for fmt, floor in (("bfloat16", 0.8), ("int8", 0.7)):
        ms = steady(fmt)
        if rate is None or ms is None:
            out.append((f"{fmt} >= {floor:.0%} of HBM", "not measured", None))
            continue
        read = by[fmt, "default"]["bytes"] / rate / (ms / 1e3)
        out.append((f"{fmt} >= {floor:.0%} of HBM", f"{read:.0%}", read >= floor))
    ratio("int8 <= 0.6x bfloat16", steady("int8"), steady("bfloat16"), 0.6)
    ratio("int4 <= 0.4x bfloat16", steady("int4"), steady("bfloat16"), 0.4)
    ratio("fp8 <= int8", steady("fp8"), steady("int8"), 1.0)
    return out


def accuracy(layers: int, dim: int) -> list[dict]:
    """Each quantized kind against the float32 model on 8 random rows."""
    float_model = model_of("float32", dim, layers)
    x = jax.random.normal(jax.random.key(1), (8, dim))
    reference = float_model(x)
    rows = []
    for fmt in FORMATS[2:]:
        model = model_of(fmt, dim, layers)
        rows.append(
            {
                "format": fmt,
                "weight_error": quant.report(float_model, model).worst().relative,
                "output_diff": float(jnp.abs(model(x) - reference).max()),
                "output_scale": float(jnp.abs(reference).max()),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, nargs="+", default=None)
    parser.add_argument("--dim", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--full", action="store_true", help="L = 16, 32; D = 512, 1024")
    parser.add_argument("--tiny", action="store_true", help="a smoke test")
    parser.add_argument(
        "--kernel",
        nargs="+",
        choices=["xla", "pallas"],
        default=["xla"],
        help="what computes the quantized products (pallas: the TPU kernel)",
    )
    parser.add_argument(
        "--compute",
        choices=["float32", "bfloat16"],
        default=None,
        help="the dtype the quantized models compute in (default: bfloat16 on a "
        "GPU or TPU, float32 on a CPU)",
    )
    args = parser.parse_args()
    # Sizes and counts of 0 or less ran into tracebacks deep in the step.
    for name, value in vars(args).items():
        if any(
            type(v) is int and v < 1
            for v in (value if isinstance(value, list) else [value])
        ):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    # A preset fills in what was not given (explicit options win). An
    # accelerator's default: 1 GiB of bfloat16 weights, enough to measure
    # HBM's bandwidth (a TPU v5e's table in docs/benchmarks.md).
    accelerator = jax.default_backend() != "cpu"
    preset = {
        "batch": [8] if accelerator else [1, 8],
        "layers": [16],
        "dim": [2048] if accelerator else [512],
        "repeats": 20,
    }
    if args.full:
        preset |= {"layers": [16, 32], "dim": [512, 1024]}
    if args.tiny:
        preset |= {"batch": [1], "layers": [2], "dim": [128], "repeats": 2}
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.compute is None:
        args.compute = "bfloat16" if accelerator else "float32"
    print(
        f"StackedMLP decode step, w1 and w2 quantized, {jax.default_backend()}; "
        f"the quantized models compute in {args.compute}"
    )
    rate = hbm_read_rate()
    if rate is not None:
        print(
            f"HBM read rate (sum of 1 GiB): {rate / 1e9:.0f} GB/s; 'of HBM': the "
            "weights' bytes read at that rate over the steady step"
        )
    mib = 2.0**20
    print(
        f"{'B':>2} {'L':>3} {'D':>5} {'format':<20}{'step':<9}{'weights MiB':>12}"
        f"{'temp MiB':>10}{'accessed MiB':>13}{'compile s':>10}{'step ms':>9}"
        f"{'steady ms':>10}{'of HBM':>7}"
    )
    sized = []
    for batch, layers, dim in itertools.product(args.batch, args.layers, args.dim):
        try:
            rows = measure(
                batch, layers, dim, args.repeats, tuple(args.kernel), args.compute
            )
            sized.append(((batch, layers, dim), rows))
        except Exception as e:
            if (message := out_of_memory(e)) is None:
                raise
            print(f"{batch:>2} {layers:>3} {dim:>5} does not fit: {message}")
            continue
        for r in rows:
            print(
                f"{batch:>2} {layers:>3} {dim:>5} {r['format']:<20}{r['step']:<9}"
                f"{r['bytes'] / mib:>12.2f}{r['temp'] / mib:>10.2f}"
                f"{r['accessed'] / mib:>13.2f}{r['compile_s']:>10.2f}"
                f"{r['step_ms']:>9.3f}{r['steady_ms']:>10.3f}"
                + (
                    ""
                    if rate is None
                    else f"{100 * r['bytes'] / rate / (r['steady_ms'] / 1e3):>6.0f}%"
                )
            )
    # The targets docs/benchmarks.md measures against (the default's steady
    # steps; set for B=8, L=16, D=2048 on an accelerator).
    for (batch, layers, dim), rows in sized:
        print(f"\nTargets at B={batch}, L={layers}, D={dim}")
        for target, measured, met in decode_targets(rows, layers, rate):
            verdict = {True: "met", False: "missed", None: "not measured"}[met]
            print(f"  {target:<44}{measured:>28}  {verdict}")
    print("\nAccuracy against float32 (8 random rows)")
    print(
        f"{'L':>3} {'D':>5} {'format':<13}{'worst rel. error':>17}"
        f"{'max |out diff|':>15}{'max |out|':>10}"
    )
    for layers, dim in itertools.product(args.layers, args.dim):
        try:
            rows = accuracy(layers, dim)
        except Exception as e:
            if (message := out_of_memory(e)) is None:
                raise
            print(f"{layers:>3} {dim:>5} does not fit: {message}")
            continue
        for r in rows:
            print(
                f"{layers:>3} {dim:>5} {r['format']:<13}{r['weight_error']:>17.2e}"
                f"{r['output_diff']:>15.2e}{r['output_scale']:>10.2f}"
            )


if __name__ == "__main__":
    main()
