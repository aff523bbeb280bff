"""`plan`: its arguments checked, every candidate compiled (here, or in a fresh
process where this one lacks the devices), and the fastest that fits chosen."""

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import jax
from jaxtyping import PyTree

from .. import ScanOptions
from .._internal import check_size, parse_bytes, Remat
from ..sharding import MIN_SIZE
from ._candidates import compile_all, mesh_shapes, Progress, Rules
from ._child import compile_in_child
from ._report import Accelerator, ACCELERATORS, MeshPlan, MeshShape
from ._spec import encode, make_job, Optimizer


def _accelerator(
    name: str, peak_flops: float | None, link_bytes_per_s: float | None
) -> Accelerator:
    if name not in ACCELERATORS:
        raise ValueError(
            f"plan: unknown accelerator {name!r}.\nHint: one of "
            f"{sorted(ACCELERATORS)}, with peak_flops= and link_bytes_per_s= to "
            "override its figures."
        )
    base = ACCELERATORS[name]
    return Accelerator(
        _figure("peak_flops", peak_flops, base.flops),
        _figure("link_bytes_per_s", link_bytes_per_s, base.link_bytes_per_s),
    )


def _figure(name: str, value: float | None, default: float) -> float:
    # Divided by in every estimate: zero, negative or NaN would rank nonsense.
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"plan: {name} must be a positive number, got {value!r}.\nHint: "
            "per device, e.g. peak_flops=989e12 (FLOP/s), link_bytes_per_s=450e9."
        )
    return default if value is None else float(value)


def _check_model_axis(sizes: Sequence[int], axes: object) -> None:
    if any(m > 1 for m in sizes) and axes is None:
        raise ValueError(
            "plan: a model axis larger than 1 needs axes= and rules= naming "
            "which parameter axes it splits.\nHint: see "
            "eqxscan.sharding.logical_shardings."
        )


def _given_meshes(
    meshes: Sequence[Sequence[int]], devices: int | None
) -> tuple[list[MeshShape], int]:
    """`meshes` checked, and the number of devices they need."""
    try:  # ints only: int(1.5) or a string's digits would plan another mesh
        triples = [tuple(check_size("size", s) for s in m) for m in meshes]
    except (TypeError, ValueError):
        triples = []
    sizes = {math.prod(m) for m in triples}
    if any(len(m) != 3 for m in triples) or len(sizes) != 1:
        raise ValueError(
            f"plan: meshes must be (data, fsdp, model) triples of positive sizes "
            f"with one product, got {list(meshes)}.\nHint: e.g. [(8, 1, 1), "
            "(1, 8, 1)] for 8 devices."
        )
    n = sizes.pop()
    if devices is not None and devices != n:
        raise ValueError(
            f"plan: the meshes need {n} devices, but devices={devices}.\nHint: "
            "leave devices out when giving meshes."
        )
    return [(d, f, m) for d, f, m in triples], n


def _candidate_meshes(
    devices: int | None,
    meshes: Sequence[Sequence[int]] | None,
    model_axis: Sequence[int],
    axes: object,
    remat: Sequence[Remat],
) -> tuple[list[MeshShape], int]:
    """The meshes to try and the number of devices."""
    for name, given, e in (
        ("remat", remat, "False, True"),
        ("model_axis", model_axis, "1, 2"),
    ):
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise TypeError(  # one setting: its letters or a TypeError, else
                f"plan: {name} is the settings to try, a sequence, got {given!r}."
                f"\nHint: e.g. {name}=({given!r},), or {name}=({e})."
            )
        if not given:  # else a plan of no candidates
            raise ValueError(f"plan: {name} is empty.\nHint: e.g. {name}=({e}).")
    for setting in remat:  # checked here, not as a failed compile of each mesh
        ScanOptions(remat=setting)
    if devices is not None:
        devices = check_size("devices", devices)
    if meshes is not None:
        shapes, devices = _given_meshes(meshes, devices)
        _check_model_axis([m for _, _, m in shapes], axes)
        return shapes, devices
    if devices is None:
        raise ValueError(
            "plan: give devices=N or meshes=[(data, fsdp, model), ...].\nHint: "
            "devices=8 tries every factorisation of 8."
        )
    _check_model_axis(model_axis, axes)
    return mesh_shapes(devices, model_axis), devices


def _check_simulate(simulate: object) -> None:
    if simulate not in ("auto", "always"):
        raise ValueError(
            f"plan: simulate must be 'auto' or 'always', got {simulate!r}.\nHint: "
            "'always' compiles in a fresh process even when this one has the devices."
        )


def plan(
    make_model: Callable[..., PyTree] | str,
    step: Callable[..., Sequence[PyTree]] | str,
    *,
    batch: PyTree[jax.ShapeDtypeStruct],
    budget: int | str,
    optimizer: Optimizer = None,
    devices: int | None = None,
    meshes: Sequence[MeshShape] | None = None,
    model_axis: Sequence[int] = (1,),
    remat: Sequence[Remat] = (False, True),
    axes: Mapping[str, tuple[str | None, ...]] | None = None,
    rules: Rules | None = None,
    model_kwargs: Mapping[str, object] | None = None,
    min_size: int = MIN_SIZE,
    accelerator: str = "H100",
    peak_flops: float | None = None,
    link_bytes_per_s: float | None = None,
    progress: Progress | None = None,
    simulate: Literal["auto", "always"] = "auto",
) -> MeshPlan:
    """Compile a training step ahead of time for every mesh and remat setting on
    `N` devices, and choose the fastest that fits a per-device memory budget.

    The model is never allocated (`make_model(key, **model_kwargs)` runs under
    `eqx.filter_eval_shape`). For each mesh `(data, fsdp, model)` and remat
    setting, the parameters are placed by [`eqxscan.sharding.model_shardings`][]
    over `"fsdp"` (or, with `axes`, by [`eqxscan.sharding.logical_shardings`][]),
    every `Stacked` gathers one layer per scan step
    ([`eqxscan.sharding.gather_layers`][], keeping `"model"` split), the
    optimiser state follows its parameters, the batch is split over `"data"` and
    `"fsdp"`, and `step` is `jax.jit(...).lower(...).compile()`d with the
    parameters and optimiser state donated. A candidate whose axis sizes do not
    divide the arrays is listed with the reason, not compiled.

    If this process has fewer than `N` devices, the candidates are compiled in
    a fresh process with `N` simulated CPU devices; `make_model`, `step` and
    `optimizer` must then be importable (`"module:attribute"` strings, or
    top-level functions of an importable module). CPU compiles give the
    per-device figures of a target whose memory layout matches: argument and
    output sizes exactly, temporaries as XLA's CPU backend schedules them.

    **Arguments:**

    - `make_model`: `make_model(key, **model_kwargs) -> model`.
    - `step`: `step(model, opt_state, batch) -> (model, opt_state, *rest)`, one
      training step returning the updated model and optimiser state first.
    - `batch`: the batch as `jax.ShapeDtypeStruct`s (in tuples, lists or dicts),
      axis 0 the global batch.
    - `budget`: bytes per device, an int or a string such as `"80GB"`.
    - `optimizer`: an `optax.GradientTransformation`, a function returning one,
      or a reference to either; `None` gives `opt_state=None`.
    - `devices`: `N` (may be left out with `meshes`).
    - `meshes`: the `(data, fsdp, model)` shapes to try; default every
      factorisation of `N` with a model axis from `model_axis`.
    - `model_axis`: model-axis sizes tried by default (more than 1 needs `axes`).
    - `remat`: the `remat=` settings to try on every scan.
    - `axes`, `rules`: logical axis names and rules, as for `logical_shardings`
      (mesh axes `"data"`, `"fsdp"`, `"model"`).
    - `model_kwargs`: JSON-compatible keyword arguments of `make_model`.
    - `min_size`: leaves with fewer elements are replicated.
    - `accelerator`: a key of `ACCELERATORS` (`"H100"`, `"TPU v5p"`, ...) whose
      figures the estimate assumes; `peak_flops`, `link_bytes_per_s` override
      them.
    - `progress`: called as `progress(done, total, what)` before each compile.
    - `simulate`: `"always"` compiles in a fresh process even if this one has
      the devices.

    **Returns:**

    An [`eqxscan.planning.MeshPlan`][]. If nothing fits, `chosen` is `None` and
    `plan.message` says by how much the smallest misses.
    """
    limit = parse_bytes(budget)
    min_size = check_size("plan: min_size", min_size, minimum=0)
    _check_simulate(simulate)
    acc = _accelerator(accelerator, peak_flops, link_bytes_per_s)
    shapes, devices = _candidate_meshes(devices, meshes, model_axis, axes, remat)
    start = time.perf_counter()
    kwargs = dict(model_kwargs or {})
    job = (make_model, step, optimizer, batch, axes, rules, kwargs, min_size)
    progress = progress or (lambda i, n, what: None)
    if len(jax.devices()) >= devices and simulate == "auto":
        here = jax.devices()[:devices]
        compiled = compile_all(make_job(*job), shapes, remat, here, acc, progress)
        simulated = f"this process's {here[0].platform} devices"
    else:  # the arguments travel as JSON
        compiled = compile_in_child(encode(devices, shapes, remat, acc, job), progress)
        simulated = "simulated CPU devices in a fresh process"
    fitting = [c for c in compiled if c.error is None and c.device_bytes <= limit]
    return MeshPlan(
        devices=devices,
        budget=limit,
        candidates=tuple(compiled),
        chosen=min(fitting, key=lambda c: c.estimated_s, default=None),
        accelerator_name=accelerator,
        accelerator=acc,
        simulated=simulated,
        seconds=time.perf_counter() - start,
    )
