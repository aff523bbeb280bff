"""Does `fit_remat` pick a fast program? On the models of `python -m benchmarks.bench`.

    python benchmarks/remat_budget.py --model mlp [--out DIR]
    python benchmarks/remat_budget.py --model transformer

Compiles one train step per candidate remat setting (through
`eqxscan.remat.remat_table`), times every candidate interleaved in
one process, and then, at four budgets from the smallest candidate's bytes to
the largest's, compares the program `fit_remat` chooses from XLA's estimates
with the fastest fitting one by measurement.
"""

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
from bench import make_problem, mse
from jaxtyping import Array

from eqxscan import StackedMLP
from eqxscan.remat import choose, remat_table, RematCandidate, time_candidates


def _step(model: eqx.Module, x: Array, y: Array) -> tuple[Array, eqx.Module]:
    return eqx.filter_value_and_grad(lambda m: mse(m(x), y))(model)


def _seconds(c: RematCandidate) -> float:
    assert c.measured_s is not None  # every candidate is timed below
    return c.measured_s


def run(
    model_name: str, num_layers: int, dim: int, batch: int, seq: int, rounds: int
) -> dict[str, Any]:
    module, x, y = make_problem(model_name, num_layers, dim, batch, seq, "float32")
    if isinstance(module, StackedMLP):
        module = module.blocks  # the Stacked inside the StackedMLP
    t0 = time.perf_counter()
    table = remat_table(module, _step, 2**50, x, y)
    compile_s = time.perf_counter() - t0
    leaves = jax.tree.leaves(eqx.filter((module, (x, y)), eqx.is_array))
    measured = time_candidates(table.candidates, leaves, rounds)

    cands = [
        dataclasses.replace(c, measured_s=measured[id(c.compiled)])
        for c in table.candidates
    ]
    sizes = sorted({c.device_bytes for c in cands})
    picks = [sizes[round(i * (len(sizes) - 1) / 3)] for i in range(4)]
    rows = []
    for budget in picks:
        chosen = choose(cands, budget)
        fastest = choose(cands, budget, measured=True)
        rows.append(
            {
                "budget_bytes": budget,
                "chosen": chosen.label,
                "chosen_bytes": chosen.device_bytes,
                "chosen_ms": _seconds(chosen) * 1e3,
                "fastest": fastest.label,
                "fastest_ms": _seconds(fastest) * 1e3,
                "ratio": _seconds(chosen) / _seconds(fastest),
            }
        )
    # remat_table itself agrees with `choose` (same function) at the largest budget.
    assert table.chosen.label == choose(cands, 2**50).label
    return {
        "model": model_name,
        "size": dict(layers=num_layers, dim=dim, batch=batch, seq=seq),
        "compile_all_s": compile_s,
        "programs": table.compiles,
        "candidates": [
            {
                "remat": c.label,
                "kind": c.kind,
                "device_bytes": c.device_bytes,
                "temp_bytes": c.temp_bytes,
                "gflop": c.flops / 1e9,
                "gb_accessed": c.bytes_accessed / 1e9,
                "estimated_ms": c.estimated_s * 1e3,
                "measured_ms": _seconds(c) * 1e3,
            }
            for c in cands
        ],
        "budgets": rows,
    }


def markdown(r: dict[str, Any]) -> str:
    mib = 2**20
    s = r["size"]
    out = [
        f"### {r['model']}: L={s['layers']}, D={s['dim']}, batch {s['batch']} x "
        f"seq {s['seq']}, float32",
        "",
        f"{len(r['candidates'])} candidates, {r['programs']} distinct programs "
        f"compiled in {r['compile_all_s']:.1f} s.",
        "",
        "| remat | temp MiB | total MiB | GFLOP | GB accessed | estimated ms "
        "| measured ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r["candidates"]:
        out.append(
            f"| {c['remat']} | {c['temp_bytes'] / mib:.1f} | "
            f"{c['device_bytes'] / mib:.1f} | {c['gflop']:.2f} | "
            f"{c['gb_accessed']:.3f} | {c['estimated_ms']:.2f} | "
            f"{c['measured_ms']:.1f} |"
        )
    out += [
        "",
        "| budget MiB | chosen | its MiB | its ms | fastest fitting (measured) "
        "| its ms | chosen / fastest |",
        "|---:|---|---:|---:|---|---:|---:|",
    ]
    for b in r["budgets"]:
        out.append(
            f"| {b['budget_bytes'] / mib:.1f} | {b['chosen']} | "
            f"{b['chosen_bytes'] / mib:.1f} | {b['chosen_ms']:.1f} | {b['fastest']} | "
            f"{b['fastest_ms']:.1f} | {b['ratio']:.2f} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Does fit_remat pick a fast program?")
    p.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int)
    p.add_argument("--rounds", type=int, default=21, help="timed rounds")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    dim = a.dim or (256 if a.model == "mlp" else 128)
    seq = a.seq or (64 if a.model == "mlp" else 32)
    r = run(a.model, a.layers, dim, a.batch, seq, a.rounds)
    text = markdown(r)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"budget_{a.model}.json").write_text(json.dumps(r, indent=1))
        (a.out / f"budget_{a.model}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
