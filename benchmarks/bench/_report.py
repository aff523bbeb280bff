"""Turning measurements into a Markdown table, a target check and PNG plots."""

import math
import statistics
from pathlib import Path
from typing import Any

from ._impls import LOOP, RECIPE


MiB = 2**20
#: Depths from which the step-time targets apply.
TARGET_MIN_LAYERS = 16
#: The (dim, batch, seq, dtype) the targets were set for.
DEFAULT_SIZE = (256, 8, 64, "float32")
TRANSFORMER_SIZE = (128, 8, 32, "float32")


def _median_steps(results: dict[str, Any]) -> dict[int, dict[str, float]]:
    return {
        int(layers): {name: statistics.median(ts) for name, ts in per_impl.items()}
        for layers, per_impl in results["steps"].items()
    }


def _compile_rows(results: dict[str, Any]) -> dict[int, dict[str, dict[str, Any]]]:
    rows: dict[int, dict[str, dict[str, Any]]] = {}
    for row in results["compile"]:
        rows.setdefault(int(row["layers"]), {})[row["impl"]] = row
    return rows


#: The table's word for a measurement that ran out of device memory.
DOES_NOT_FIT = "does not fit"


def _too_big(results: dict[str, Any]) -> set[tuple[int, str, str]]:
    """`(layers, impl, stage)` of every measurement that did not fit."""
    return {
        (int(r["layers"]), r["impl"], r["stage"])
        for r in results.get("does_not_fit", [])
    }


def _ratio(a: float | int | None, b: float | int | None) -> str:
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}"


def _fmt(x: float | int | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(results: dict[str, Any]) -> str:
    """One Markdown table per depth: step time, compile time, program size and XLA
    temp memory of every implementation, with ratios against the unrolled loop
    and the hand-written Equinox recipe."""
    steps = _median_steps(results)
    compiles = _compile_rows(results)
    too_big = _too_big(results)
    flops = {int(k): v for k, v in results["flops_per_step"].items()}
    peak = results.get("peak_flops")
    mfu_head, mfu_rule = (" MFU |", "---:|") if peak else ("", "")
    out = []
    depths = set(steps) | set(compiles) | {L for L, _, _ in too_big}
    for layers in sorted(depths):
        st = steps.get(layers, {})
        co = compiles.get(layers, {})
        out.append(f"### L = {layers}\n")
        out.append(
            "| implementation | step ms | vs loop | vs recipe | GFLOP/s |"
            + mfu_head
            + " compile s (trace / lower / XLA) | vs loop | vs recipe | "
            "StableHLO lines | temp MiB | vs loop |"
        )
        out.append(
            "|---|---:|---:|---:|---:|" + mfu_rule + "---:|---:|---:|---:|---:|---:|"
        )
        for name in results["impls"]:
            big = {stage for L, n, stage in too_big if (L, n) == (layers, name)}
            if name not in st and name not in co and not big:
                continue
            s = st.get(name)
            c = co.get(name, {})
            total = c.get("total_s")
            temp = c.get("temp_bytes")
            parts = (
                f"{total:.2f} ({c['trace_s']:.2f} / {c['lower_s']:.2f} / "
                f"{c['compile_s']:.2f})"
                if total is not None
                else (DOES_NOT_FIT if "compile" in big else "–")
            )
            step_ms = _fmt(None if s is None else s * 1e3, ".1f")
            step_ms = DOES_NOT_FIT if "steps" in big else step_ms
            gflops = None if s is None else flops[layers] / s / 1e9
            mfu = ""
            if peak:
                mfu = " " + _fmt(
                    None if gflops is None else 100 * gflops * 1e9 / peak, ".1f"
                )
                mfu += "% |"
            shown = f"{name} ({c['auto']})" if c.get("auto") else name
            out.append(
                f"| {shown} | {step_ms} | "
                f"{_ratio(s, st.get(LOOP))} | {_ratio(s, st.get(RECIPE))} | "
                f"{_fmt(gflops, '.1f')} |{mfu} {parts} | "
                f"{_ratio(total, co.get(LOOP, {}).get('total_s'))} | "
                f"{_ratio(total, co.get(RECIPE, {}).get('total_s'))} | "
                f"{c.get('hlo_lines', '–')} | "
                f"{_fmt(None if temp is None else temp / MiB, '.1f')} | "
                f"{_ratio(temp, co.get(LOOP, {}).get('temp_bytes'))} |"
            )
        out.append("")
    return "\n".join(out)


def transformer_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The Transformer's targets at its deepest depth: eqxscan compiles at least
    12x faster than the unrolled loop and at most 1.1x the recipe's time, and
    its step time and temp memory are at most the loop's."""
    steps = _median_steps(results)
    compiles = _compile_rows(results)
    found = []
    deepest = max(compiles, default=None)
    rows = compiles.get(deepest, {}) if deepest is not None else {}
    st = steps.get(deepest, {}) if deepest is not None else {}

    def add(target: str, value: float | None, limit: float, text: str = "") -> None:
        found.append(
            {
                "target": f"L={deepest}: {target}",
                "measured": "not measured" if value is None else text or f"{value:.2f}",
                "met": None if value is None else value <= limit,
            }
        )

    def get(table: dict, name: str, key: str | None) -> float | int | None:
        row = table.get(name)
        return None if row is None else (row if key is None else row.get(key))

    def ratio(a: float | int | None, b: float | int | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    c_eqx, c_loop = get(rows, "eqxscan", "total_s"), get(rows, LOOP, "total_s")
    c_recipe = get(rows, RECIPE, "total_s")
    speedup = ratio(c_loop, c_eqx)
    add(
        f"eqxscan compiles >= 12x faster than {LOOP}",
        None if speedup is None else 12 / speedup,
        1.0,
        "" if speedup is None else f"{speedup:.1f}x ({c_eqx:.2f} s vs {c_loop:.2f} s)",
    )
    add(f"eqxscan step <= 1.0x {LOOP}", ratio(st.get("eqxscan"), st.get(LOOP)), 1.0)
    add(
        f"eqxscan temp memory <= 1.0x {LOOP}",
        ratio(get(rows, "eqxscan", "temp_bytes"), get(rows, LOOP, "temp_bytes")),
        1.0,
    )
    add(f"eqxscan compile <= 1.1x {RECIPE}", ratio(c_eqx, c_recipe), 1.1)
    return found


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, checked against this run. Each entry has `target`,
    `measured` (text) and `met` (True, False, or None when the run lacks the
    depths or implementations needed)."""
    if results.get("config", {}).get("model") == "transformer":
        return transformer_targets(results)
    steps = _median_steps(results)
    compiles = _compile_rows(results)
    found = []

    def add(target: str, pairs: list[tuple[str, float]], limit: float) -> None:
        met = None if not pairs else all(v <= limit for _, v in pairs)
        measured = ", ".join(f"{k}: {v:.2f}" for k, v in pairs) or "not measured"
        found.append({"target": target, "measured": measured, "met": met})

    deep = [L for L in sorted(steps) if L >= TARGET_MIN_LAYERS]
    for other, limit in ((LOOP, 1.0), ("flax-linen", 0.6), ("flax-nnx", 0.6)):
        pairs = [
            (f"L={L}", steps[L]["eqxscan"] / steps[L][other])
            for L in deep
            if "eqxscan" in steps[L] and other in steps[L]
        ]
        add(
            f"eqxscan step <= {limit}x {other} (L >= {TARGET_MIN_LAYERS})",
            pairs,
            limit,
        )
    pairs = [
        (f"L={L}", rows["eqxscan"]["total_s"] / rows[RECIPE]["total_s"])
        for L, rows in sorted(compiles.items())
        if "eqxscan" in rows and RECIPE in rows
    ]
    add(f"eqxscan compile time <= 1.1x {RECIPE}", pairs, 1.1)

    # "auto" may resolve differently at different depths (e.g. the matmul-saving
    # policy when shallow, full remat when deep); each resolution's program must
    # not grow with depth.
    rows_eqx = {
        L: rows["eqxscan"] for L, rows in sorted(compiles.items()) if "eqxscan" in rows
    }
    if len(rows_eqx) >= 2:
        by_choice: dict[Any, list[int]] = {}
        for row in rows_eqx.values():
            by_choice.setdefault(row.get("auto"), []).append(row["hlo_lines"])
        # Only depths that resolved to one option compare: none met nothing.
        compared = [sizes for sizes in by_choice.values() if len(sizes) >= 2]
        found.append(
            {
                "target": "eqxscan lowered size independent of L (per resolved option)",
                "measured": ", ".join(
                    f"L={L}: {r['hlo_lines']}"
                    + (f" ({r['auto']})" if r.get("auto") else "")
                    for L, r in rows_eqx.items()
                )
                + ("" if compared else " (no two depths resolved alike)"),
                "met": all(len(set(s)) == 1 for s in compared) if compared else None,
            }
        )
    else:
        found.append(
            {
                "target": "eqxscan lowered size independent of L (per resolved option)",
                "measured": "needs two depths",
                "met": None,
            }
        )

    temps = {
        L: rows["eqxscan-nested"]["temp_bytes"]
        for L, rows in sorted(compiles.items())
        if "eqxscan-nested" in rows
    }
    if len(temps) >= 2:
        # temp(L=256)/temp(L=64) <= 2.5 is sqrt(4) = 2 with 25% slack; for other
        # depths the same slack on sqrt(L_b / L_a) is used.
        (la, ta), (lb, tb) = sorted(temps.items())[-2:]
        limit = 1.25 * math.sqrt(lb / la)
        found.append(
            {
                "target": f"'nested' temp(L={lb})/temp(L={la}) <= {limit:.2f} "
                "(grows like sqrt(L))",
                "measured": f"{tb / ta:.2f} ({tb / MiB:.1f} / {ta / MiB:.1f} MiB)",
                "met": tb / ta <= limit,
            }
        )
    return found


def targets_markdown(found: list[dict[str, Any]]) -> str:
    mark = {True: "met", False: "**missed**", None: "not measured"}
    rows = ["| target | measured | |", "|---|---|---|"]
    rows += [f"| {t['target']} | {t['measured']} | {mark[t['met']]} |" for t in found]
    return "\n".join(rows)


def markdown(results: dict[str, Any]) -> str:
    """The whole report: configuration, agreement check, tables and targets."""
    cfg = results["config"]
    m = results["machine"]
    transformer = cfg.get("model") == "transformer"
    what = (
        "Pre-norm Transformer block (LayerNorm, causal MultiheadAttention, "
        "LayerNorm, GELU MLP) train step"
        if transformer
        else "StackedMLP train step"
    )
    counted = (
        "N*(24*D^2 + 4*T*D) per layer forward"
        if transformer
        else "2*N*D*4D*2 per layer forward"
    )
    repeats = cfg.get("compile_repeats", 1)
    head = [
        "# benchmarks.bench",
        "",
        f"`{results['command']}`",
        "",
    ]
    if results.get("resolved_command"):
        head += [f"With every default spelled out: `{results['resolved_command']}`", ""]
    head += [
        f"{what} (`value_and_grad` of an MSE loss), D={cfg['dim']}, "
        f"batch {cfg['batch']} x seq {cfg['seq']}, {cfg['dtype']}; step times are "
        f"medians of {cfg['repeats']} interleaved runs"
        + (
            f", compile times medians of {repeats} fresh compiles"
            if repeats > 1
            else ""
        )
        + (
            f" ({cfg['loop_compile_repeats']} for the unrolled loop)"
            if cfg.get("loop_compile_repeats") not in (None, repeats)
            else ""
        )
        + f". Machine: {m['summary']}; "
        f"load average (1/5/15 min) {m.get('load_average_start')} at the start, "
        f"{m.get('load_average_end')} at the end.",
        "",
        f"GFLOP/s counts model FLOPs only: {counted} (N tokens), x3 for "
        "forward + backward (recomputation by rematerialisation is not counted)."
        + (
            f" MFU is that against a peak of {results['peak_flops'] / 1e12:.0f} "
            "TFLOP/s."
            if results.get("peak_flops")
            else ""
        ),
        "",
    ]
    if any(row.get("auto") for row in results["compile"]):
        head += [
            '`eqxscan (...)` is the default, `remat="auto"` and '
            '`unroll="auto"`, with what they resolved to at that depth '
            "(`remat/unroll`; `matmul` is `eqxscan.remat.matmul_policy`).",
            "",
        ]
    head += agreement_lines(results.get("agreement", {}))
    body = table(results)
    tail = ["## Targets", ""]
    default = TRANSFORMER_SIZE if transformer else DEFAULT_SIZE
    if (cfg["dim"], cfg["batch"], cfg["seq"], cfg["dtype"]) != default:
        tail += [
            "The targets were set for the default size (D={}, batch {}, seq {}, "
            "{}); at this size read them as indications only.".format(*default),
            "",
        ]
    tail += [targets_markdown(targets(results)), ""]
    if results.get("does_not_fit"):
        tail += [
            "## Does not fit",
            "",
            "These ran out of device memory (`RESOURCE_EXHAUSTED`): at this size "
            "the program, or its arguments, is bigger than the device.",
            "",
        ]
        tail += [
            f"- {r['impl']} at L={r['layers']} ({r['stage']}): {r['error']}"
            for r in results["does_not_fit"]
        ]
        tail.append("")
    if results.get("errors"):
        tail += ["## Failed measurements", ""]
        tail += [f"- {e}" for e in results["errors"]]
        tail.append("")
    return "\n".join(head) + "\n" + body + "\n" + "\n".join(tail)


def agreement_lines(agreement: dict[str, Any]) -> list[str]:
    """The agreement check in words: its size, precision, and each dtype's
    tolerance and errors."""
    if not agreement.get("errors"):
        return []
    size = agreement["size"]
    lines = [
        "Agreement with the unrolled loop (max relative error of loss and "
        f"gradients), checked at L={size['num_layers']}, D={size['dim']}, "
        f"batch {size['batch']} x seq {size['seq']}, matmul precision "
        f"{agreement['precision']}:",
        "",
    ]
    for dtype, errors in agreement["errors"].items():
        lines.append(
            f"- {dtype} (tolerance {agreement['tolerances'][dtype]:g}): "
            + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
        )
    return [*lines, ""]


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Compile time, step time and temp memory against depth (log-log), one line
    per implementation. Returns the written files (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    steps = _median_steps(results)
    compiles = _compile_rows(results)
    series = {
        "compile_time.png": (
            "compile time (trace + lower + XLA), s",
            {
                L: {n: r["total_s"] for n, r in rows.items()}
                for L, rows in compiles.items()
            },
        ),
        "step_time.png": (
            "train step time (median), ms",
            {L: {n: t * 1e3 for n, t in per.items()} for L, per in steps.items()},
        ),
        "temp_memory.png": (
            "XLA temp memory, MiB",
            {
                L: {
                    n: r["temp_bytes"] / MiB
                    for n, r in rows.items()
                    if r.get("temp_bytes")
                }
                for L, rows in compiles.items()
            },
        ),
    }
    written = []
    for filename, (ylabel, data) in series.items():
        if not any(data.values()):  # nothing measured (or nothing fit)
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=80)
        colors = plt.get_cmap("tab20")
        for i, name in enumerate(results["impls"]):
            points = sorted((L, v[name]) for L, v in data.items() if name in v)
            if not points:
                continue
            xs, ys = zip(*points)
            ax.plot(
                xs,
                ys,
                "-" if name.startswith("eqxscan") else "--",
                color=colors(i % 20),
                marker="o",
                markersize=3,
                lw=2.5 if name == "eqxscan" else 1.2,
                label=name,
            )
        depths = sorted(data)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(depths, [str(L) for L in depths])
        ax.minorticks_off()
        ax.set_xlabel("layers L")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        path = out / filename
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
