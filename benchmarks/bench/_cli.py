"""`python -m benchmarks.bench`: compile time, step time and memory against depth.

Measures `StackedMLP`'s train step (`value_and_grad` of a loss) written with
eqxscan and with its peers. This process never opens the device: a worker
subprocess first describes the machine (which chooses the presets), a second
checks that every implementation gives the unrolled loop's loss and gradients at
a small size, and then each (implementation, depth) is traced, lowered and
compiled in a fresh subprocess with the persistent compilation cache off, and at
each depth one subprocess times all implementations interleaved in shuffled
order; one subprocess at a time. Whatever runs out of device memory is reported
as not fitting, and the rest is still measured. Results go to `--out` as
`results.json`, `results.md` and three PNG plots.
"""

import argparse
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._impls import IMPLS, LOOP
from ._machine import load_average


FULL = {
    "layers": [4, 16, 64, 256],
    "dim": 256,
    "batch": 8,
    "seq": 64,
    "repeats": 10,
}
#: `--quick`: small enough to finish in under three minutes on two CPU cores. Its
#: default implementations are the ones the targets name.
QUICK = {"layers": [4, 16], "dim": 64, "batch": 4, "seq": 16, "repeats": 10}
QUICK_IMPLS = (
    "eqxscan",
    "eqxscan-loop",
    "eqxscan-nested",
    "eqx-recipe",
    "flax-linen",
    "flax-nnx",
    "matmul-floor",
)
#: `--model transformer`: the pre-norm block at D=128, T=32 (the sizes of the
#: compile-time targets); `--quick` shrinks it.
TRANSFORMER = {"layers": [4, 16, 64], "dim": 128, "batch": 8, "seq": 32, "repeats": 10}
TRANSFORMER_QUICK = {"layers": [2, 4], "dim": 32, "batch": 2, "seq": 8, "repeats": 5}
#: On a GPU: bfloat16, D=4096 and 8192 tokens per step, enough to be compute bound.
GPU = {"layers": [4, 16, 32], "dim": 4096, "batch": 16, "seq": 512}
#: On a TPU: bfloat16, the MLP at D=4096 and 8192 tokens per step; its parameters
#: and their gradients take 512 MiB a layer, so that 16 layers fill most of a TPU
#: v5e's 16 GiB (deeper stacks do not fit there). The Transformer at D=2048,
#: batch 8 x seq 1024.
#: A step takes about a second at L=16 there: five interleaved rounds suffice.
TPU = {"layers": [4, 16], "dim": 4096, "batch": 16, "seq": 512, "repeats": 5}
TPU_TRANSFORMER = {
    "layers": [4, 16],
    "dim": 2048,
    "batch": 8,
    "seq": 1024,
    "repeats": 5,
}
#: The presets of an accelerator, by backend and model (`--quick` keeps its own).
PRESETS = {
    ("gpu", "mlp"): GPU,
    ("gpu", "transformer"): GPU,
    ("tpu", "mlp"): TPU,
    ("tpu", "transformer"): TPU_TRANSFORMER,
}
#: The agreement check's largest size: it runs beside nothing else, at the
#: shallowest depth of the run, in float32 and in the run's dtype; bigger models
#: add nothing to it but memory (the Equinox recipe's float32 step at D=4096 needs
#: 18.5 GiB of temporaries).
CHECK_SIZE = {"dim": 256, "batch": 2, "seq": 64}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):  # NaN included
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _layer_list(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 4,16,64, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"every depth must be a positive integer, got {text!r}"
        )
    return sorted(set(values))


def _impl_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description=(
            "Compile time, step time and memory of a StackedMLP train step against "
            "depth, for eqxscan's options and for the hand-written Equinox recipe, "
            "plain JAX, Flax linen and Flax NNX."
        ),
    )
    p.add_argument(
        "--layers",
        type=_layer_list,
        help="comma-separated depths (default 4,16,64,256; --quick: 4,16)",
    )
    p.add_argument("--dim", type=_positive_int, help="model width D (default 256)")
    p.add_argument("--batch", type=_positive_int, help="batch size (default 8)")
    p.add_argument("--seq", type=_positive_int, help="sequence length (default 64)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="dtype (default float32; bfloat16 on a GPU or TPU)",
    )
    p.add_argument(
        "--impls",
        type=_impl_list,
        help="comma-separated implementations (default: all available): "
        + ", ".join(IMPLS)
        + " (the Transformer has no matmul-floor and no eqxscan-save-all)",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        help="timed steps per implementation and depth (default 10)",
    )
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder")
    p.add_argument(
        "--model",
        choices=["mlp", "transformer"],
        default="mlp",
        help="StackedMLP (default) or a pre-norm Transformer block "
        "(LayerNorm, causal attention, MLP)",
    )
    p.add_argument(
        "--compile-repeats",
        type=_positive_int,
        default=1,
        help="fresh compiles per implementation and depth (JAX's caches cleared "
        "in between); the table shows the median (default 1)",
    )
    p.add_argument(
        "--loop-compile-repeats",
        type=_positive_int,
        help="fresh compiles of the unrolled loop (default: --compile-repeats); "
        "at L=64 one compile of the Transformer's loop takes minutes",
    )
    p.add_argument(
        "--peak-flops",
        type=_positive_float,
        help="the device's peak FLOP/s for the MFU column (default: looked up "
        "from the GPU/TPU kind, bfloat16 dense; none on a CPU)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small preset for a fast look: layers 4,16, D=64, batch 4, seq 16, "
        "and only " + ", ".join(QUICK_IMPLS) + " unless --impls is given",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="instead: the default's step time and temp memory against the loop and "
        "every explicit setting, over MLP widths and depths and GRU/LSTM sizes "
        "(--repeats rounds, default 7); writes grid.json, grid.md, grid.png",
    )
    return p


def parse_args(
    argv: Sequence[str] | None = None, backend: str = "cpu"
) -> argparse.Namespace:
    """Parse and validate; explicit arguments override the presets: `--quick`'s,
    else `backend`'s (`"cpu"`, `"gpu"` or `"tpu"`, as a worker reports it)."""
    p = parser()
    args = p.parse_args(argv)
    from ._measure import registry

    impls, _ = registry(args.model)
    if args.model == "transformer":
        preset = TRANSFORMER_QUICK if args.quick else TRANSFORMER
        quick_impls = tuple(n for n in QUICK_IMPLS if n in impls)
    else:
        preset, quick_impls = (QUICK if args.quick else FULL), QUICK_IMPLS
    if (backend, args.model) in PRESETS and not args.quick:
        preset = {**preset, **PRESETS[backend, args.model], "dtype": "bfloat16"}
    for name, value in {"dtype": "float32", **preset}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.skipped = []
    if args.impls is None:
        names = quick_impls if args.quick else impls
        args.impls = [name for name in names if impls[name].available()]
        args.skipped = [name for name in names if not impls[name].available()]
    else:
        unknown = [n for n in args.impls if n not in impls]
        if unknown:
            p.error(
                f"unknown implementation(s) {', '.join(unknown)}; valid names are: "
                + ", ".join(impls)
            )
        missing = [n for n in args.impls if not impls[n].available()]
        if missing:
            p.error(
                f"{', '.join(missing)} need(s) the optional dependency "
                f"{impls[missing[0]].requires!r}; install it with "
                "`pip install -e '.[bench]'`"
            )
        if not args.impls:
            p.error("--impls names no implementation")
        args.impls = list(dict.fromkeys(args.impls))
    return args


def check_size(args: argparse.Namespace) -> dict[str, Any]:
    """The agreement check's size: the run's shallowest depth, at most
    `CHECK_SIZE`."""
    return {
        "num_layers": args.layers[0],
        **{k: min(getattr(args, k), cap) for k, cap in CHECK_SIZE.items()},
        "model": args.model,
    }


def resolved_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run with every default spelled out."""
    parts = [
        "python -m benchmarks.bench",
        f"--model {args.model}",
        "--layers " + ",".join(map(str, args.layers)),
        f"--dim {args.dim} --batch {args.batch} --seq {args.seq}",
        f"--dtype {args.dtype} --repeats {args.repeats}",
        f"--compile-repeats {args.compile_repeats}",
    ]
    if args.loop_compile_repeats is not None:
        parts.append(f"--loop-compile-repeats {args.loop_compile_repeats}")
    parts.append("--impls " + ",".join(args.impls))
    if args.peak_flops is not None:
        parts.append(f"--peak-flops {args.peak_flops:g}")
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--grid" in argv:
        from ._grid import main_grid

        # The grid has its own sizes and implementations: other options would
        # be ignored without a word.
        p = parser()
        args = p.parse_args(argv)
        given = {k for k, v in vars(args).items() if v != p.get_default(k)}
        if given - {"grid", "out", "repeats"}:
            p.error("--grid takes only --out and --repeats")
        return main_grid(args)
    args = parse_args(argv)  # checked before any worker starts
    from ._worker import run_worker, WorkerError

    try:
        machine = run_worker({"task": "describe"})
    except WorkerError as e:
        raise SystemExit(f"benchmarks.bench: aborted: {e}") from None
    if machine["backend"] != "cpu":
        args = parse_args(argv, backend=machine["backend"])
    if args.skipped:
        print(
            f"Skipping {', '.join(args.skipped)}: their libraries are not installed "
            "(`pip install -e '.[bench]'` adds them).",
            file=sys.stderr,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    results = _header(args, argv, machine)
    print(f"Running: {results['resolved_command']}", file=sys.stderr)
    results["agreement"] = _agreement(args)
    _measure_all(args, results)
    results["machine"]["load_average_end"] = load_average()
    return _finish(args, results)


def _header(
    args: argparse.Namespace, argv: Sequence[str], machine: dict[str, Any]
) -> dict[str, Any]:
    """The run's results before any measurement: its configuration, the machine
    (as a worker described it), the peak FLOP/s and the model FLOPs per step."""
    from eqxscan.remat import peak_of

    from ._measure import model_flops, registry
    from ._transformer import transformer_flops

    impls, _ = registry(args.model)
    peak = args.peak_flops
    if peak is None and machine["backend"] != "cpu":
        found = peak_of(machine["device"])
        peak = None if found is None else found.flops
    tokens = args.batch * args.seq
    flops = {
        str(L): (
            transformer_flops(L, args.dim, tokens, args.seq)
            if args.model == "transformer"
            else model_flops(L, args.dim, tokens)
        )
        for L in args.layers
    }
    return {
        "command": ("python -m benchmarks.bench " + shlex.join(argv)).strip(),
        "resolved_command": resolved_command(args),
        "config": {
            "model": args.model,
            "layers": args.layers,
            "dim": args.dim,
            "batch": args.batch,
            "seq": args.seq,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "compile_repeats": args.compile_repeats,
            "loop_compile_repeats": args.loop_compile_repeats,
            "impls": args.impls,
        },
        "machine": machine,
        "peak_flops": peak,
        "impls": {n: impls[n].description for n in args.impls},
        "flops_per_step": flops,
        "agreement": {},
        "compile": [],
        "steps": {},
        "does_not_fit": [],
        "errors": [],
    }


def _agreement(args: argparse.Namespace) -> dict[str, Any]:
    """The agreement check, in a worker: float32 and the run's dtype, at
    `check_size`, every matmul at `CHECK_PRECISION`. A mismatch stops the run."""
    from ._impls import TOLERANCES
    from ._measure import CHECK_PRECISION
    from ._worker import run_worker, WorkerError

    size = check_size(args)
    dtypes = list(dict.fromkeys(["float32", args.dtype]))
    print(
        f"Checking that {len(args.impls)} implementations agree "
        f"(L={size['num_layers']}, D={size['dim']}, batch {size['batch']}, "
        f"seq {size['seq']}; "
        f"{', '.join(dtypes)}; matmul precision {CHECK_PRECISION})...",
        file=sys.stderr,
    )
    spec = {"task": "agree", "impls": args.impls, "size": size, "dtypes": dtypes}
    try:
        found = run_worker(spec)
    except WorkerError as e:
        raise SystemExit(f"benchmarks.bench: aborted: {e}") from None
    if "mismatch" in found:
        raise SystemExit(f"benchmarks.bench: aborted: {found['mismatch']}")
    return {
        "size": size,
        "precision": CHECK_PRECISION,
        "tolerances": {d: TOLERANCES[d] for d in dtypes},
        "errors": found["errors"],
    }


def _measure_all(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Every compile and every depth's timed steps, in fresh workers; what
    does not fit is recorded in `results["does_not_fit"]`, what fails otherwise
    in `results["errors"]`."""
    from tqdm import tqdm

    from ._worker import run_worker, WorkerError

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    def too_big(name: str, layers: int, stage: str, error: str) -> None:
        results["does_not_fit"].append(
            {"impl": name, "layers": layers, "stage": stage, "error": error}
        )
        tqdm.write(f"{name} at L={layers} does not fit ({stage}): {error}", sys.stderr)

    def run(spec: dict[str, Any], **kwargs: Any) -> dict[str, Any] | None:
        try:
            return run_worker(spec, **kwargs)
        except WorkerError as e:
            results["errors"].append(str(e).splitlines()[0])
            tqdm.write(str(e), file=sys.stderr)
            return None

    # On an accelerator one worker a depth compiles each implementation and
    # times its steps on that program: opening the device takes seconds a process
    # (10 to 15 on a TPU v5e) and a deep step seconds to compile. On a CPU each
    # compile has a process of its own, and its peak RSS is reported.
    shared = results["machine"]["backend"] != "cpu"
    total = len(args.layers) * (len(args.impls) + (0 if shared else args.repeats))
    shape = dict(dim=args.dim, batch=args.batch, seq=args.seq)
    with tqdm(total=total, desc="benchmarks.bench", file=sys.stderr) as bar:
        for layers in args.layers:
            common = dict(
                num_layers=layers, **shape, dtype=args.dtype, model=args.model
            )
            if shared:
                bar.set_postfix_str(f"L={layers}")
                spec = {"task": "depth", "impls": args.impls, **common}
                spec |= {"compile_repeats": args.compile_repeats}
                spec |= {"loop_compile_repeats": args.loop_compile_repeats}
                found = run({**spec, "repeats": args.repeats}, on_progress=bar.update)
                if found is not None and "rows" not in found:
                    for name in args.impls:
                        too_big(name, layers, "compile", found["does_not_fit"])
                elif found is not None:
                    results["compile"].extend(found["rows"])
                    results["steps"][str(layers)] = found["times"]
                    for name, error in found["does_not_fit"].items():
                        too_big(name, layers, "compile", error)
                    for name, error in found["steps_do_not_fit"].items():
                        too_big(name, layers, "steps", error)
                save()
                continue
            for name in args.impls:
                bar.set_postfix_str(f"compile {name} L={layers}")
                repeats = args.compile_repeats
                if name == LOOP and args.loop_compile_repeats is not None:
                    repeats = args.loop_compile_repeats
                spec = {"task": "compile", "impl": name, **common}
                row = run({**spec, "compile_repeats": repeats})
                if row is not None and "does_not_fit" in row:
                    too_big(name, layers, "compile", row["does_not_fit"])
                elif row is not None:
                    results["compile"].append(row)
                bar.update()
                save()
            bar.set_postfix_str(f"steps L={layers}")
            spec = {"task": "steps", "impls": args.impls, **common}
            found = run({**spec, "repeats": args.repeats}, on_progress=bar.update)
            if found is not None and "does_not_fit" in found and "times" not in found:
                for name in args.impls:
                    too_big(name, layers, "steps", found["does_not_fit"])
            elif found is not None:
                results["steps"][str(layers)] = found["times"]
                for name, error in found["does_not_fit"].items():
                    too_big(name, layers, "steps", error)
            save()


def _finish(args: argparse.Namespace, results: dict[str, Any]) -> int:
    """Write and print the report; 1 when a measurement failed (other than by not
    fitting), else 0."""
    from ._report import markdown, plots, targets

    results["targets"] = targets(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (args.out / "results.md").write_text(text)
    written = plots(results, args.out)
    print(text)
    print(
        f"Wrote {args.out / 'results.json'}, {args.out / 'results.md'}"
        + "".join(f", {p}" for p in written),
        file=sys.stderr,
    )
    return 1 if results["errors"] else 0
