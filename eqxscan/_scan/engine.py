"""The one scan engine behind `Stacked`, `Chain` and `Recurrent`: it runs
`step(carry, x_i) -> (carry, y_i)` over the leading axis of `xs` with
`jax.lax.scan` or a Python loop (the reference path), with the remat asked for,
and checks the carry contract while the step is traced. Outside the loop the
step is traced once, to a closed jaxpr (`Traced`) that the `"auto"` rule
measures and every scan form evaluates: a layer's Python runs once per trace."""

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Literal

import equinox as eqx
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, PyTree

from .._helpers.checks import check_carry, describe, noting, same_leaf
from .._helpers.stateful import clone
from .auto import resolve
from .call_state import call_state, changed_call_state
from .f32_pin import pinned
from .layer_io import Index, index
from .options import ScanOptions
from .scan_remat import (
    CARRY,
    kept_on_device,
    name_inputs,
    name_tree,
    nested_scan,
    OFFLOAD_POLICY,
    ScanRemat,
    Step,
    Traced,
)
from .skip import arrays_only, can_skip_scan, skip_layer, skip_scan, skip_step
from .taps import step_taps, StepTaps
from .vmap_batch import vmapped_size


def wrap_remat(fn: Step, remat: ScanRemat, *, in_scan: bool) -> Step:
    """`fn` (one scan step) wrapped in `jax.checkpoint` as `remat` asks."""
    if not remat.named and remat.policy is False:
        return fn
    # The carry named for `ScanRemat(save_carries=...)`.
    body = fn if remat.save_carries is None else lambda c, x: fn(name_tree(c, CARRY), x)
    # Inside a scan the loop boundary already stops XLA from CSE-ing the
    # recomputation away, so `prevent_cse=False` avoids needless barriers.
    return jax.checkpoint(body, policy=remat.step_policy(), prevent_cse=not in_scan)


def _opened(
    taps: StepTaps | None, i: Index
) -> tuple[tuple[int, list | None], AbstractContextManager[object]]:
    """Before step `i`: where its records start while tapped (for `taps.close`),
    and the block around it that sets the step index (no layer yet): a block, so
    a traceback through it shows no frame of its own."""
    opened, records, scope = (0, None, {}) if taps is None else taps.open()
    return (opened, records), changed_call_state(step=i, layer=None, **scope)


def step_types(c_dyn: PyTree, xs: PyTree, length: int) -> tuple[PyTree, PyTree]:
    """The types `lax.scan` gives its body: the carry's as they are (weak types,
    shardings, varying manual axes included), the inputs' without axis 0."""
    c_types = jtu.tree_map(jax.typeof, c_dyn)
    x_types = jtu.tree_map(lambda a: jcore.mapped_aval(length, 0, jax.typeof(a)), xs)
    return c_types, x_types


def _unstack(xs: PyTree, length: int) -> list[PyTree]:
    # One `split` per leaf rather than `length` slices: its transpose is a single
    # concatenate, so the loop's gradient does not add up `length` padded copies.
    if length == 1:
        return [index(xs, 0)]
    leaves, treedef = jtu.tree_flatten(xs)
    pieces = [jax.lax.split(a, [1] * length) for a in leaves]
    return [
        jtu.tree_unflatten(treedef, [p[i][0] for p in pieces]) for i in range(length)
    ]


def run(
    step: Step,
    carry: PyTree,
    xs: PyTree,
    *,
    length: int,
    options: ScanOptions,
    reverse: bool = False,
    where: Callable[[int | None], str] = lambda i: "step" if i is None else f"step {i}",
    gathered: bool = False,
    over: Literal["layers", "time"] = "layers",
    runs: Bool[Array, " L"] | None = None,
    read: Callable[[PyTree], PyTree] | None = None,
) -> tuple[PyTree, PyTree]:
    """Run `step(carry, x_i) -> (carry, y_i)` over the leading axis (of length
    `length`) of the array pytree `xs`: `(final carry, ys)`, `ys` stacked on
    axis 0 (`None` if steps return `None`). The carry's other leaves than arrays
    must come back unchanged.

    `options`: mode, remat (`options.scan_remat`) and unroll; `reverse`: `xs`
    consumed last to first (`ys` aligned with `xs`); `where`: names step `i`
    (every step for `None`) in errors; `gathered`: steps may gather their slice
    of sharded `xs` (FSDP), so `unroll="auto"` keeps the scan; `over`: `"layers"`
    (weights in `xs`) or `"time"` (weights closed over), for `"auto"`; `runs`:
    LayerDrop's choice, one bool per step (`skip.py`); `read`: what a step reads
    of its slice (FSDP's gather), named as its inputs for
    `ScanRemat(save_inputs=...)`.
    """
    remat = options.scan_remat
    # While tapped, a step's records leave it beside its `y` (`taps.py`).
    taps = step_taps()
    inputs = lambda x: name_inputs(x if read is None else read(x), remat)  # noqa: E731

    if options.mode == "loop":
        parts = (step, inputs, taps)
        remat = kept_on_device(remat)
        c, ys = _run_loop(parts, carry, xs, length, remat, reverse, where, runs, over)
        return c, ys if taps is None else taps.finish(ys)
    # The step traced once, here (closed-over tracers become consts), on the
    # carry's array leaves and `(x_i, i)`: one frame less in a traceback.
    xs, name = (xs, jnp.arange(length, dtype=jnp.int32)), where(None)
    c_dyn, c_static = eqx.partition(carry, eqx.is_array)
    statics: list[tuple[PyTree, PyTree]] = []  # each trace's other output leaves

    def checked(c_dyn: PyTree, x_i: tuple[PyTree, Index]) -> PyTree:
        x, i = x_i
        c = eqx.combine(c_dyn, c_static)
        old = clone(c)  # the step may invalidate `c` (an `eqx.nn.State`)
        opened, scope = _opened(taps, i)
        with noting(name, c, over=over), scope:
            new, y = step(c, inputs(x))
        y = y if taps is None else taps.close(y, *opened)
        check_carry(old, new, name, over=over)
        dyn, static = eqx.partition((new, y), eqx.is_array)
        statics.append(static)
        return dyn

    types = step_types(c_dyn, xs, length)
    # Traced per example: the scans inside a step (a `Recurrent` in a layer)
    # read the `jax.vmap` batch of the carry from the call state.
    first = next(iter(jtu.tree_leaves(c_dyn)), None)
    batch = call_state().vmapped * (1 if first is None else vmapped_size(first))
    with changed_call_state(vmapped=batch):
        jaxpr, out_shape = jax.make_jaxpr(checked, return_shape=True)(*types)
    n_carry = len(jtu.tree_leaves(c_dyn))
    traced = Traced(jaxpr, jtu.tree_structure(out_shape), statics[0][1], n_carry)
    c_dyn, ys = _run_scan(
        traced, c_dyn, xs, length, options, reverse, name, gathered, over, runs
    )
    return eqx.combine(c_dyn, c_static), ys if taps is None else taps.finish(ys)


def _run_scan(
    traced: Traced,
    c_dyn: PyTree,
    xs: PyTree,
    length: int,
    options: ScanOptions,
    reverse: bool,
    name: str,
    gathered: bool,
    over: Literal["layers", "time"],
    runs: Bool[Array, " L"] | None,
) -> tuple[PyTree, PyTree]:
    # The carry's array leaves and the `ys` of the traced step run as asked.
    remat = options.scan_remat
    remat, unroll = resolve(
        traced, (c_dyn, xs), length, remat, options.unroll, name, gathered, over
    )
    remat = kept_on_device(remat)
    # Unrolled fully: the loop's own program (one slice per step, the outputs
    # stacked), each step the one traced step evaluated.
    unrolled = unroll is True and not remat.named
    # Stacked float32 weights stay float32 on TPU inside a loop (`f32_pin.py`),
    # but not FSDP's gathered layers (bfloat16 halves what a step gathers).
    if over == "layers" and not gathered and not unrolled:
        traced = pinned(traced, step_types(c_dyn, xs, length))
    # A skipping scan runs as one `skip_scan` when its remat does not name or
    # nest (the scan saves the carries whatever it says) and the step's carry
    # and outputs all take cotangents. A layer that runs saves what a plain
    # `remat=` policy says; only the carry for `True` and for `"offload"`,
    # whose host copies a branch of a `cond` would not keep.
    if runs is not None and not remat.named and can_skip_scan(traced.jaxpr):
        plain = not (remat.policy is True or remat.policy is OFFLOAD_POLICY)
        c_flat, y_flat = skip_scan(
            traced,
            jtu.tree_leaves(c_dyn),
            jtu.tree_leaves(xs),
            runs,
            length=length,
            reverse=reverse,
            unroll=unroll,
            policy=remat.base_policy() if plain else None,
        )
        c_dyn, ys = jtu.tree_unflatten(traced.out_tree, c_flat + y_flat)
    else:
        # Otherwise each step is skipped on its own, inside the remat asked for.
        scanned: Step = traced
        if runs is not None:
            scanned = skip_step(traced)
            xs = (xs, runs)
        fn = wrap_remat(scanned, remat, in_scan=not unrolled)
        if unrolled:
            slices = _unstack(xs, length)
            ys = [None] * length
            for i in range(length - 1, -1, -1) if reverse else range(length):
                c_dyn, ys[i] = fn(c_dyn, slices[i])
            ys = jtu.tree_map(lambda *a: jnp.stack(a), *ys)
        else:
            c_dyn, ys = nested_scan(
                fn, c_dyn, xs, length, remat, unroll, reverse, where=name
            )
    return c_dyn, eqx.combine(ys, traced.y_static)


def _run_loop(
    parts: tuple[Step, Callable[[PyTree], PyTree], StepTaps | None],
    carry: PyTree,
    xs: PyTree,
    length: int,
    remat: ScanRemat,
    reverse: bool,
    where: Callable[[int | None], str],
    runs: Bool[Array, " L"] | None = None,
    over: Literal["layers", "time"] = "layers",
) -> tuple[PyTree, PyTree]:
    # The reference path. The "auto" rule is a scan-specific optimisation, so the
    # loop saves everything unless remat was asked for explicitly.
    explicit = not remat.is_rule and not (remat.policy is False and not remat.named)
    remat.levels(length, where(None))  # a nesting the scan refuses, refused here too
    step, inputs, taps = parts

    def body(c: PyTree, x: PyTree, i: int) -> tuple[PyTree, PyTree]:
        opened, scope = _opened(taps, i)
        with scope:
            new, y = step(c, inputs(x))
        return new, (y if taps is None else taps.close(y, *opened))

    ys = [None] * length
    slices = _unstack(xs if runs is None else (xs, runs), length) if length > 0 else []
    carry = clone(carry)  # the caller's stays valid (an `eqx.nn.State`)
    # NumPy leaves as JAX takes them (float64 is float32 without x64), as the scan.
    numpy = np.ndarray | np.number | np.bool_
    carry = jtu.tree_map(lambda a: jnp.asarray(a) if isinstance(a, numpy) else a, carry)
    for i in range(length - 1, -1, -1) if reverse else range(length):
        old, x = clone(carry), slices[i]  # the step may invalidate `carry`
        with noting(where(i), carry, over=over):
            if runs is not None:  # traced on this step's values, run where it runs
                new, y = skip_layer(functools.partial(body, x=x[0], i=i), carry, x[1])
            elif explicit:  # jax.checkpoint takes arrays only: close over the rest
                c_dyn, c_static = eqx.partition(carry, eqx.is_array)
                fn, statics = arrays_only(functools.partial(body, i=i), c_static)
                out = wrap_remat(fn, remat, in_scan=False)(c_dyn, x)
                new, y = eqx.combine(out, statics[0])
            else:  # called here: one frame less
                opened, scope = _opened(taps, i)
                with scope:
                    new, y = step(carry, inputs(x))
                y = y if taps is None else taps.close(y, *opened)
        check_carry(old, new, where(i), i, over)
        # Kept apart from the next step's carry, which that step may invalidate.
        carry, ys[i] = new, clone(y)
    return carry, (None if all(y is None for y in ys) else stacked(ys, where))


def stacked(outputs: Sequence[PyTree], where: Callable[[int], str]) -> PyTree:
    """Every step's output (`outputs[i]`: step `i`'s) as one traced body gives
    them: the arrays stacked, the rest kept once. A number that differs from step
    to step (e.g. `eqxscan.layer_index()`), which a scan would have traced, is
    stacked into an array; anything else must agree (`where(i)` names step `i`)."""
    dyn, static = zip(*(eqx.partition(out, eqx.is_array) for out in outputs))

    def merge(path: tuple, *vs: object) -> object:
        if all(same_leaf(v, vs[0]) for v in vs):
            return vs[0]
        if all(isinstance(v, (bool, int, float, complex)) for v in vs):
            return jnp.asarray(vs)
        i = next(i for i, v in enumerate(vs) if not same_leaf(v, vs[0]))
        raise TypeError(
            f"{where(i)} gave `{jtu.keystr(path)}` = {describe(vs[i])}, but step 0 "
            f"gave {describe(vs[0])}: an output that is not an array is kept once, "
            "so every step must give the same.\nHint: return it as an array "
            "(jnp.asarray) to have it stacked."
        )

    rest = jtu.tree_map_with_path(merge, *static)
    return eqx.combine(jtu.tree_map(lambda *a: jnp.stack(a), *dyn), rest)
