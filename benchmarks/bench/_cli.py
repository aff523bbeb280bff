"""`python -m benchmarks.bench`: compile time, step time and memory against depth.

Measures `StackedMLP`'s train step (`value_and_grad` of a loss) written with
eqxscan and with its peers. First every implementation is checked to give the
unrolled loop's loss and gradients. Then each (implementation, depth) is
traced, lowered and compiled in a fresh subprocess with the persistent
compilation cache off, and at each depth one subprocess times all
implementations interleaved in shuffled order. Results go to `--out` as
`results.json`, `results.md` and three PNG plots.
"""

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._impls import IMPLS, LOOP
from ._machine import describe_machine, load_average


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
        help="dtype (default float32; bfloat16 on a GPU)",
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
        type=float,
        help="the device's peak FLOP/s for the MFU column (default: looked up "
        "from the GPU/TPU name; none on a CPU)",
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; explicit arguments override the `--quick` preset."""
    p = parser()
    args = p.parse_args(argv)
    from ._measure import registry

    impls, _ = registry(args.model)
    if args.model == "transformer":
        preset = TRANSFORMER_QUICK if args.quick else TRANSFORMER
        quick_impls = tuple(n for n in QUICK_IMPLS if n in impls)
    else:
        preset, quick_impls = (QUICK if args.quick else FULL), QUICK_IMPLS
    if _backend() == "gpu" and not args.quick:
        preset = {**preset, **GPU, "dtype": "bfloat16"}
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


def _backend() -> str:
    import jax

    return jax.default_backend()


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

        return main_grid(parser().parse_args(argv))
    args = parse_args(argv)
    from tqdm import tqdm

    from eqxscan.remat import peak_of

    from ._measure import check_agreement, MismatchError, model_flops, registry
    from ._report import markdown, plots, targets
    from ._transformer import transformer_flops
    from ._worker import run_worker, WorkerError

    impls, _ = registry(args.model)

    if args.skipped:
        print(
            f"Skipping {', '.join(args.skipped)}: their libraries are not installed "
            "(`pip install -e '.[bench]'` adds them).",
            file=sys.stderr,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    shape = dict(dim=args.dim, batch=args.batch, seq=args.seq)
    machine = describe_machine()
    peak = args.peak_flops
    if peak is None and not machine["device"].startswith("cpu"):
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
    command = resolved_command(args)
    print(f"Running: {command}", file=sys.stderr)
    results: dict[str, Any] = {
        "command": ("python -m benchmarks.bench " + shlex.join(argv)).strip(),
        "resolved_command": command,
        "config": {
            "model": args.model,
            "layers": args.layers,
            **shape,
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
        "errors": [],
    }

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    check_layers = args.layers[0]
    print(
        f"Checking that {len(args.impls)} implementations agree "
        f"(L={check_layers}, D={args.dim}, float32)...",
        file=sys.stderr,
    )
    try:
        results["agreement"] = check_agreement(
            [impls[n] for n in args.impls],
            num_layers=check_layers,
            dim=args.dim,
            batch=args.batch,
            seq=args.seq,
            model=args.model,
        )
    except MismatchError as e:
        raise SystemExit(f"benchmarks.bench: aborted: {e}") from None

    total = len(args.layers) * (len(args.impls) + args.repeats)
    with tqdm(total=total, desc="benchmarks.bench", file=sys.stderr) as bar:
        for layers in args.layers:
            common = dict(
                num_layers=layers, **shape, dtype=args.dtype, model=args.model
            )
            for name in args.impls:
                bar.set_postfix_str(f"compile {name} L={layers}")
                spec = {"task": "compile", "impl": name, **common}
                repeats = args.compile_repeats
                if name == LOOP and args.loop_compile_repeats is not None:
                    repeats = args.loop_compile_repeats
                try:
                    results["compile"].append(
                        run_worker({**spec, "compile_repeats": repeats})
                    )
                except WorkerError as e:
                    results["errors"].append(str(e).splitlines()[0])
                    tqdm.write(str(e), file=sys.stderr)
                bar.update()
                save()
            bar.set_postfix_str(f"steps L={layers}")
            try:
                results["steps"][str(layers)] = run_worker(
                    {
                        "task": "steps",
                        "impls": args.impls,
                        **common,
                        "repeats": args.repeats,
                    },
                    on_progress=bar.update,
                )
            except WorkerError as e:
                results["errors"].append(str(e).splitlines()[0])
                tqdm.write(str(e), file=sys.stderr)
            save()

    results["machine"]["load_average_end"] = load_average()
    results["targets"] = targets(results)
    save()
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
