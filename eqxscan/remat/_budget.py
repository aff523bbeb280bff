"""Choosing rematerialisation for a memory budget: `remat_table` compiles a
training step per candidate `remat=` setting and reads XLA's memory and cost
analysis; `fit_remat` applies the fastest that fits."""

import dataclasses
import functools
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, TypeAlias, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._internal import (
    check_size,
    docs,
    is_arraylike,
    parse_bytes,
    Remat,
    remat_label,
    Scanning,
    size_label,
)
from ._devices import FALLBACK, Peak, peak_of
from ._timing import time_interleaved


Unroll: TypeAlias = int | bool | Literal["auto"]
Kind: TypeAlias = Literal["unrolled", "loop"]
M = TypeVar("M")
#: An input leaf of the compiled step: an array, or only its shape and dtype.
Leaf: TypeAlias = jax.Array | jax.ShapeDtypeStruct

#: The settings tried by default, from most saved to least (`False` saves
#: everything: fastest where it fits, on a GPU).
CANDIDATES: tuple[Remat, ...] = (
    "auto",
    jax.checkpoint_policies.dots_saveable,
    "offload",
    True,
    "nested",
    False,
)


@dataclasses.dataclass(frozen=True)
class RematCandidate:
    """One compiled candidate and XLA's figures for it.

    **Fields:**

    - `remat`, `unroll`: the setting (`unroll=None`: the model's own).
    - `label`: the setting in words.
    - `temp_bytes`, `argument_bytes`, `output_bytes`, `host_temp_bytes`: from
      `memory_analysis()`.
    - `flops`, `bytes_accessed`: from `cost_analysis()`.
    - `estimated_s`: `flops / peak.flops + bytes_accessed / peak.bytes_per_s`.
    - `kind`: `"unrolled"` (no loop in the program: XLA counts every step) or
      `"loop"` (XLA counts each loop body once); estimates rank programs of one
      kind.
    - `compiled`: the compiled program.
    - `measured_s`: the median measured seconds per step, with `time_steps`.
    """

    remat: Remat
    label: str
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    host_temp_bytes: int
    flops: float
    bytes_accessed: float
    estimated_s: float
    compiled: jax.stages.Compiled = dataclasses.field(repr=False, compare=False)
    measured_s: float | None = None
    unroll: Unroll | None = None
    kind: Kind = "loop"

    @property
    def device_bytes(self) -> int:
        """Temp + argument + output bytes: what must fit on the device."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes

    def apply(self, model: M) -> M:
        """`model` with this setting on all its scans."""
        return with_remat(model, self.remat, self.unroll)


@dataclasses.dataclass(frozen=True)
class RematTable:
    """Every candidate of a [`eqxscan.remat.remat_table`][] call, the budget and the
    choice. `str(table)` is a Markdown table."""

    budget: int
    candidates: tuple[RematCandidate, ...]
    chosen: RematCandidate
    compiles: int

    def markdown(self) -> str:
        mib = 2**20
        rows = [
            f"budget {self.budget / mib:.1f} MiB; {self.compiles} programs compiled "
            f"for {len(self.candidates)} candidates",
            "",
            "| remat | kind | temp MiB | args+out MiB | total MiB | host MiB | "
            "fits | GFLOP | GB accessed | estimated ms | measured ms | |",
            "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
        ]
        for c in self.candidates:
            measured = "–" if c.measured_s is None else f"{c.measured_s * 1e3:.1f}"
            rows.append(
                f"| {c.label} | {c.kind} | {c.temp_bytes / mib:.1f} | "
                f"{(c.argument_bytes + c.output_bytes) / mib:.1f} | "
                f"{c.device_bytes / mib:.1f} | {c.host_temp_bytes / mib:.1f} | "
                f"{'yes' if c.device_bytes <= self.budget else 'no'} | "
                f"{c.flops / 1e9:.2f} | {c.bytes_accessed / 1e9:.3f} | "
                f"{c.estimated_s * 1e3:.2f} | {measured} | "
                f"{'**chosen**' if c is self.chosen else ''} |"
            )
        rows += [
            "",
            "Estimated ms: FLOPs / peak FLOP/s + bytes accessed / bandwidth, from "
            "XLA's cost analysis, which counts a loop body once rather than once per "
            "iteration: the estimates rank programs of one kind (a loop's figures "
            "are per step), not step times; across kinds the unrolled program "
            "wins unless measured.",
        ]
        return "\n".join(rows)

    __str__ = markdown


def choose(
    candidates: Sequence[RematCandidate], budget: int, *, measured: bool = False
) -> RematCandidate:
    """The fitting candidate with the lowest measured (`measured=True`) or else
    estimated time, among the unrolled programs if any fits; `ValueError` listing
    every candidate's bytes if none fits."""
    fitting = [c for c in candidates if c.device_bytes <= budget]
    if not fitting:
        listed = "; ".join(
            f"{c.label}: {size_label(c.device_bytes)}" for c in candidates
        )
        raise ValueError(
            f"fit_remat: no remat setting fits the budget of {size_label(budget)}"
            + (f" ({budget} bytes)" if budget >= 2**10 else "")
            + ". Temp + argument + output bytes per candidate: "
            f"{listed}.\nHint: raise the budget, shrink the batch, or shard the "
            f"model; see {docs('remat.md')}."
        )
    if measured:
        timed = [c for c in fitting if c.measured_s is not None]
        if timed:
            return min(timed, key=lambda c: c.measured_s or 0.0)
    unrolled = [c for c in fitting if c.kind == "unrolled"]
    return min(unrolled or fitting, key=lambda c: c.estimated_s)


def _is_scan(x: object) -> bool:
    return isinstance(x, Scanning)


def with_remat(model: M, remat: Remat, unroll: Unroll | None = None) -> M:
    """`model` with `remat` (and `unroll`, unless `None`) set on every
    scanning module in it (`Stacked`, `Chain`, `Recurrent`, `StackedMLP`),
    those inside another's layers (a layer's own `Recurrent`) included."""
    options = {"remat": remat} if unroll is None else {"remat": remat, "unroll": unroll}

    def set_options(x: object) -> object:
        if not _is_scan(x):
            return x
        # Its own options pass on to the scans it builds, not to its layers'.
        inner = jtu.tree_map(
            set_options, x, is_leaf=lambda y: y is not x and _is_scan(y)
        )
        return inner.with_options(**options)

    return jtu.tree_map(set_options, model, is_leaf=_is_scan)


def _lower(
    step: Callable[..., PyTree], model: PyTree, args: tuple[PyTree, ...]
) -> tuple[jax.stages.Lowered, list[Leaf]]:
    # The compiled program takes the flat list of array leaves, the same for every
    # candidate (the remat setting lives in static fields).
    dynamic, static = eqx.partition((model, args), is_arraylike)
    leaves, treedef = jtu.tree_flatten(dynamic)

    def train_step(leaves: list[jax.Array]) -> PyTree:
        m, a = eqx.combine(jtu.tree_unflatten(treedef, leaves), static)
        return eqx.filter(step(m, *a), eqx.is_array)

    return jax.jit(train_step).lower(leaves), leaves


def time_candidates(
    candidates: Sequence[RematCandidate], leaves: list[jax.Array], repeats: int
) -> dict[int, float]:
    """Median seconds per run of each distinct compiled program among
    `candidates`, by `id(candidate.compiled)`, over `repeats` interleaved rounds
    after one warm-up run each."""
    programs = {id(c.compiled): c.compiled for c in candidates}
    for compiled in programs.values():
        jax.block_until_ready(compiled(leaves))
    steps = {str(k): functools.partial(c, leaves) for k, c in programs.items()}
    times = time_interleaved(steps, repeats)
    return {k: statistics.median(times[str(k)]) for k in programs}


def remat_table(
    model: PyTree,
    step: Callable[..., PyTree],
    budget: int | np.integer | str,
    *args: PyTree,
    candidates: Sequence[Remat] = CANDIDATES,
    unrolls: Sequence[Unroll] | None = None,
    peak: Peak | None = None,
    time_steps: int = 0,
) -> RematTable:
    """Every candidate `remat=` setting for a memory budget, compiled, with
    XLA's own figures, and the one [`eqxscan.remat.fit_remat`][] picks.

    Each candidate is set on all `Stacked`, `Chain` and `Recurrent` modules in
    `model` and `step(model, *args)` is compiled ahead of time (nothing is run;
    candidates that lower to the same program are compiled once). A candidate
    fits when its temp + argument + output bytes (`memory_analysis()`) are at
    most `budget`. Of those, the lowest estimated time wins: `flops / peak.flops
    + bytes accessed / peak.bytes_per_s` from `cost_analysis()`, which counts a
    loop's body once, so a fitting program without a loop (its scans unrolled
    fully) beats any that loops. With `time_steps`, the lowest measured time wins.

    **Arguments:**

    - `model`: any pytree holding one or more `Stacked`, `Chain` or `Recurrent`
      (a `StackedMLP` holds a `Stacked`).
    - `step`: `step(model, *args)`, one training step, e.g. returning the loss
      and gradients, or the updated model and optimiser state. It is traced
      under `jax.jit` with the array leaves of `model` and `args` as inputs.
    - `budget`: bytes, as an int or a string such as `"6GiB"` or `"512MB"`.
    - `*args`: the step's other inputs (a batch, optimiser state); arrays or
      `jax.ShapeDtypeStruct`s (the latter only with `time_steps=0`).
    - `candidates`: the `remat=` settings to try, default `"auto"`,
      `dots_saveable`, `"offload"`, `True`, `"nested"` and `False`.
    - `unrolls`: `unroll=` values to try with every candidate, e.g. `(1, 2)`;
      comparing several needs `time_steps` (XLA's cost analysis counts a loop
      body once, so it cannot rank them). Default `None`: keep the model's own.
    - `peak`: the device's FLOP/s and bytes/s for the estimate; default: from a
      small table of GPUs and TPUs, or a generic ratio on other devices.
    - `time_steps`: if positive, run every distinct fitting program this many
      times (after one warm-up run), in interleaved rounds, and choose by the
      median measured time instead.

    **Returns:**

    A [`eqxscan.remat.RematTable`][]: every candidate, the budget, and `chosen`
    (`table.chosen.apply(model)` is what `fit_remat` returns).

    **Raises:**

    `ValueError` if `model` holds no scan, or if no candidate fits, listing the
    bytes each one needs.
    """
    limit = parse_bytes(budget)
    _check_table(model, candidates, unrolls, time_steps)
    if peak is None:
        peak = peak_of(jax.devices()[0].device_kind) or FALLBACK
    peak = _checked_peak(peak)
    programs: dict[str, jax.stages.Compiled] = {}
    results, leaves = [], []
    for remat in candidates:
        for unroll in (None,) if unrolls is None else unrolls:
            # The arguments' modules too (an optimizer state holds the model's
            # structure, its options included).
            lowered, leaves = _lower(
                step, with_remat(model, remat, unroll), with_remat(args, remat, unroll)
            )
            text = lowered.as_text()
            if text not in programs:
                programs[text] = lowered.compile()
            results.append(_candidate(programs[text], remat, unroll, peak))
    if time_steps > 0:
        results = _timed(results, leaves, limit, time_steps)
    best = choose(results, limit, measured=time_steps > 0)
    return RematTable(limit, tuple(results), best, len(programs))


def _check_table(
    model: PyTree,
    candidates: Sequence[Remat],
    unrolls: Sequence[Unroll] | None,
    time_steps: object,
) -> None:
    time_steps = check_size("fit_remat: time_steps", time_steps, minimum=0)
    for name, values in (("candidates", candidates), ("unrolls", unrolls)):
        # A lone value would be iterated: "auto" as 'a', 'u', 't', 'o'.
        if isinstance(values, str) or not isinstance(values, Sequence | None):
            lone = isinstance(values, str) or not isinstance(values, Iterable)
            raise TypeError(
                f"fit_remat: {name} must be a tuple or list of settings, got "
                f"{values!r}.\nHint: "
                + (
                    f"for one setting, pass ({values!r},)."
                    if lone
                    else f"pass {name}=tuple(...) of the {type(values).__name__}."
                )
            )
    if not any(_is_scan(x) for x in jtu.tree_leaves(model, is_leaf=_is_scan)):
        raise ValueError(
            f"fit_remat: {type(model).__name__} holds no eqxscan.Stacked, Chain or "
            "Recurrent, so there is no remat setting to choose.\nHint: see "
            f"{docs('remat.md')}."
        )
    if not candidates:
        raise ValueError("fit_remat: candidates is empty.")
    if unrolls is not None and not unrolls:
        raise ValueError("fit_remat: unrolls is empty; pass None to keep the model's.")
    if unrolls is not None and len(set(map(repr, unrolls))) > 1 and time_steps <= 0:
        raise ValueError(
            f"fit_remat: comparing unrolls {tuple(unrolls)} needs time_steps > 0.\n"
            "Hint: XLA's cost analysis counts a loop body once, so an unrolled body "
            "would look more expensive than it is; time the candidates instead."
        )


def _checked_peak(peak: object) -> Peak:
    # A Peak, or any pair of positive FLOP/s and bytes/s (the estimate divides).
    try:
        flops, rate = (float(v) for v in peak)  # pyright: ignore[reportGeneralTypeIssues]
    except (TypeError, ValueError):
        flops = rate = float("nan")
    if not (0 < flops < float("inf") and 0 < rate < float("inf")):
        raise ValueError(
            f"remat_table: peak must be a Peak of positive FLOP/s and bytes/s, got "
            f"{peak!r}.\nHint: eqxscan.remat.Peak(flops=..., bytes_per_s=...), or "
            "leave it out to use the device's."
        )
    return Peak(flops, rate)


def _candidate(
    compiled: jax.stages.Compiled, remat: Remat, unroll: Unroll | None, peak: Peak
) -> RematCandidate:
    mem = compiled.memory_analysis()
    if mem is None:
        raise ValueError(
            f"fit_remat: XLA gives no memory analysis on {jax.default_backend()}, "
            "so the candidates' sizes are unknown."
        )
    cost = compiled.cost_analysis() or {}
    flops = float(cost.get("flops", 0.0))
    moved = float(cost.get("bytes accessed", 0.0))
    label = remat_label(remat)
    return RematCandidate(
        remat=remat,
        label=label if unroll is None else f"{label}, unroll={unroll!r}",
        temp_bytes=int(mem.temp_size_in_bytes),
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        host_temp_bytes=int(getattr(mem, "host_temp_size_in_bytes", 0)),
        flops=flops,
        bytes_accessed=moved,
        estimated_s=flops / peak.flops + moved / peak.bytes_per_s,
        compiled=compiled,
        unroll=unroll,
        kind="loop"
        if re.search(r"\bwhile\(", compiled.as_text() or "")
        else "unrolled",
    )


def _timed(
    results: list[RematCandidate], leaves: list[Leaf], limit: int, time_steps: int
) -> list[RematCandidate]:
    arrays = [x for x in leaves if not isinstance(x, jax.ShapeDtypeStruct)]
    if len(arrays) != len(leaves):
        raise ValueError(
            "fit_remat: time_steps > 0 runs the step, so the model and args "
            "must be arrays, not jax.ShapeDtypeStruct."
        )
    choose(results, limit)  # raises if nothing fits, before any timing
    fitting = [c for c in results if c.device_bytes <= limit]
    # Candidates of one program fit alike; those that do not stay untimed.
    seconds = time_candidates(fitting, arrays, time_steps)
    return [
        dataclasses.replace(c, measured_s=seconds.get(id(c.compiled))) for c in results
    ]


def fit_remat(
    model: M,
    step: Callable[..., PyTree],
    budget: int | np.integer | str,
    *args: PyTree,
    candidates: Sequence[Remat] = CANDIDATES,
    unrolls: Sequence[Unroll] | None = None,
    peak: Peak | None = None,
    time_steps: int = 0,
) -> M:
    """Pick the `remat=` setting for a memory budget, from XLA's own figures:
    `model` with the setting (and `unroll`, with `unrolls`) that
    [`eqxscan.remat.remat_table`][] chooses, on all its scans. The arguments are
    `remat_table`'s; call that for every candidate's figures.

    An optimizer state holds the model's structure, and so its `remat=`: make
    it from the returned model, or give it the chosen setting with
    [`eqxscan.remat.with_remat`][] (an optax update refuses a state of the old
    setting with "different pytree metadata")."""
    table = remat_table(
        model,
        step,
        budget,
        *args,
        candidates=candidates,
        unrolls=unrolls,
        peak=peak,
        time_steps=time_steps,
    )
    return table.chosen.apply(model)
