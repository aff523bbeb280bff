"""Pipeline parallelism over the layer axis of a `Stacked`: the GPipe and the
circular (interleaved) schedules, as one `jax.shard_map` whose microbatches move
between stages with `jax.lax.ppermute`, following the table of
`pipeline_schedule`. Autodiff of that program is the backward pipeline."""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal, SupportsIndex, TypeAlias, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .. import DropRates, Stacked
from .._internal import (
    carry_examples,
    check_droppable,
    check_mesh,
    check_size,
    constrain,
    DropInputs,
    index,
    keep_bits,
    LayerCall,
    permute_stack,
    permute_stage_order,
    restack,
    scan_layers,
    split_key,
    tapping,
    write,
)
from ._shard import check_axes


Schedule: TypeAlias = Literal["gpipe", "circular"]
"""`"gpipe"`: stage `s` holds one chunk of `L / S` layers, passed once.
`"circular"`: it holds chunks `s, s + S, ...` of `L / (S * repeats)` layers, and
the microbatches go round the stages `repeats` times."""

SCHEDULES: tuple[Schedule, ...] = ("gpipe", "circular")

LayerOrder: TypeAlias = Literal["natural", "stage"]
"""`"natural"`: the layers in the order they run. `"stage"`: permuted by
[`pipeline_order`][eqxscan.sharding.pipeline_order]."""

LAYER_ORDERS: tuple[LayerOrder, ...] = ("natural", "stage")

StackT = TypeVar("StackT", bound=Stacked)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """What every stage does at every tick of a pipeline: the table that
    [`pipeline`][eqxscan.sharding.pipeline] runs. At tick `t`, stage `s` runs its
    repeat `repeat[t, s]` (layer chunk `repeat[t, s] * stages + s`) on microbatch
    `microbatch[t, s]`, or idles where both are `-1`.
    """

    stages: int
    microbatches: int
    repeats: int
    #: `[ticks, stages]` microbatch indices, `-1` where the stage idles.
    microbatch: np.ndarray
    #: `[ticks, stages]` repeat (round) indices, `-1` where the stage idles.
    repeat: np.ndarray

    @property
    def ticks(self) -> int:
        """The number of ticks, `repeats * microbatches + stages - 1`."""
        return int(self.microbatch.shape[0])

    @property
    def idle(self) -> int:
        """Idle stage-ticks, counted in the table."""
        return int(np.sum(self.microbatch < 0))

    @property
    def bubble(self) -> float:
        """The idle fraction of all stage-ticks, counted in the table; it equals
        `(stages - 1) / (repeats * microbatches + stages - 1)`."""
        return self.idle / self.microbatch.size


def _hint_error(headline: str, hint: str) -> ValueError:
    return ValueError(f"{headline}\nHint: {hint}")


def _check_stack(stack: object, what: str) -> Stacked:
    if not isinstance(stack, Stacked):
        raise TypeError(
            f"{what} an eqxscan.Stacked, got {type(stack).__name__}; for a model, "
            "pass its Stacked (e.g. `model.blocks`)."
        )
    return stack


def _check_schedule(schedule: object, repeats: object) -> tuple[Schedule, int]:
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise _hint_error(
            f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}.",
            "'gpipe' gives each stage one contiguous group of layers; 'circular' "
            "gives each stage `repeats` interleaved groups.",
        )
    # The type here; the range below, with a hint.
    repeats = check_size("repeats", repeats, minimum=-(2**31))
    if repeats < 1:
        raise _hint_error(
            f"repeats must be >= 1, got {repeats}.",
            "repeats is how many times the microbatches go round the stages.",
        )
    if schedule == "gpipe" and repeats != 1:
        raise _hint_error(
            f"repeats={repeats} needs schedule='circular': GPipe passes each "
            "microbatch through the stages once.",
            f"pass schedule='circular', repeats={repeats} (or repeats=1).",
        )
    return schedule, repeats  # pyright: ignore[reportReturnType]  # one of SCHEDULES


def _check_layer_order(layer_order: object) -> LayerOrder:
    if not isinstance(layer_order, str) or layer_order not in LAYER_ORDERS:
        raise _hint_error(
            f"layer_order must be one of {list(LAYER_ORDERS)}, got {layer_order!r}.",
            "'natural' for a stack in the order its layers run; 'stage' for one "
            "permuted by eqxscan.sharding.pipeline_order.",
        )
    return layer_order  # type: ignore[return-value]  # one of LAYER_ORDERS


def _check_chunks(num_layers: int, stages: int, repeats: int, where: str) -> int:
    # The chunk length K = L / (S * R).
    chunks = stages * repeats
    if num_layers % chunks:
        where = f"{stages} pipeline stages{where}"
        if repeats > 1:
            where += f" x {repeats} repeats = {chunks} chunks"
        raise _hint_error(
            f"Cannot split the {num_layers} layers of a Stacked into {where}: "
            f"the number of layers must be a multiple of {chunks}.",
            "change the number of layers, the size of the stage axis"
            + (" or repeats." if repeats > 1 else "."),
        )
    return num_layers // chunks


def _stage_order(stages: int, repeats: int) -> tuple[int, int] | None:
    # The `stage_order` of a stack permuted for these (`None`: no permutation).
    return (stages, repeats) if stages > 1 and repeats > 1 else None


def _order_call(order: tuple[int, int], inverse: str = "") -> str:
    return "pipeline_order(stack, stages={}, repeats={}{})".format(*order, inverse)


def _check_order(stack: Stacked, want: tuple[int, int] | None, what: str) -> None:
    have = stack.stage_order and _stage_order(*stack.stage_order)
    if have != want:
        says = lambda o: o and f"in the stage order of {_order_call(o)}"
        natural = "in their natural order"
        back = have and f"{_order_call(have, ', inverse=True')} restores that; "
        raise _hint_error(
            f"Cannot {what}: its layers are {says(have) or natural}, "
            f"not {says(want) or natural}.",
            f"{back or ''}pipeline_order permutes a Stacked into stage order once "
            "(and records it); pipeline's layer_order names the order it expects.",
        )


def pipeline_order(
    stack: StackT,
    *,
    stages: SupportsIndex,
    repeats: SupportsIndex,
    inverse: bool = False,
) -> StackT:
    """The layers of `stack` permuted into stage order (or, with `inverse=True`,
    back into their natural order).

    With `K = L / (stages * repeats)`, the circular schedule runs chunk `c`
    (layers `[c * K, (c + 1) * K)`) on stage `c mod stages`. In stage order,
    position `(s * repeats + r) * K + k` holds layer `(r * stages + s) * K + k`,
    so stage `s`'s chunks fill positions `[s * L/stages, (s + 1) * L/stages)`:
    split over the stage axis along its layer axis (`PartitionSpec("stage")`),
    each device holds exactly the weights its stage runs, and
    `pipeline(..., layer_order="stage")` (same `stages` and `repeats`) moves
    none. With `repeats=1` both orders are the same. Called directly, the
    permuted stack still runs layer 0, 1, ... (its weights read through the
    permutation, a copy of them), and `staged[i]`, `with_layer(i, ...)` and new
    drop rates take layer `i`; its fields, gradients, optimizer state and Orbax
    checkpoints follow the stored order (state dicts and safetensors files
    name layer `i` as `i` in either order): `inverse=True` on the stack (and on
    its optimizer buffers, such as Adam's moments) gives the natural order back.

    **Arguments:**

    - `stack`: a `Stacked` (or a pytree of its structure, such as a gradient).
    - `stages`: the number of pipeline stages `S` (the size of the stage axis).
    - `repeats`: the rounds `R` of the circular schedule (`1` for GPipe).
    - `inverse`: from stage order to natural order.

    **Returns:**

    `stack` with every array leaf of its layers, and its per-layer drop rates,
    permuted along the layer axis; its `stage_order` is `(stages, repeats)` (or,
    with `inverse=True`, `None`). A `ValueError` if it was not in the order this
    starts from (natural, or with `inverse=True` this stage order).
    """
    _check_stack(stack, "pipeline_order permutes")
    stages = check_size("stages", stages)
    repeats = check_size("repeats", repeats)
    stack.check_layer_axis("reorder")
    _check_chunks(stack.num_layers, stages, repeats, "")
    if staged := _stage_order(stages, repeats):  # else the permutation changes nothing
        what = f"{'back from' if inverse else 'into'} stage order for stages={stages}"
        want = staged if inverse else None
        _check_order(stack, want, f"permute this Stacked {what}, repeats={repeats}")
    elif inverse and stack.stage_order is not None:
        # Nothing to undo for these, but the stack is in another stage order,
        # which it would keep without a word.
        what = f"take this Stacked back from stage order for stages={stages}"
        _check_order(stack, None, f"{what}, repeats={repeats}")
    order = {"stage_order": None if inverse else staged} if staged else {}
    return permute_stack(stack, stages, repeats, inverse, **order)  # pyright: ignore[reportReturnType]  # rebuilds type(stack)


def pipeline_schedule(
    *,
    stages: SupportsIndex,
    microbatches: SupportsIndex,
    repeats: SupportsIndex = 1,
    schedule: Schedule = "gpipe",
) -> PipelineSchedule:
    """The tick-by-tick table of a GPipe or circular pipeline, in NumPy.

    Microbatch `m` on round `r` reaches stage `s` at tick
    `t = r * microbatches + m + s`: one tick after it left stage `s - 1`, and on
    stage 0 of round `r > 0`, `microbatches - stages + 1` ticks after it left the
    last stage (so `microbatches >= stages` when `repeats > 1`). Every stage is
    busy `repeats * microbatches` ticks of `repeats * microbatches + stages - 1`:
    the bubble is `(stages - 1) / (repeats * microbatches + stages - 1)`.

    **Arguments:**

    - `stages`: the number of pipeline stages `S`.
    - `microbatches`: the number of microbatches `M`.
    - `repeats`: rounds through the stages, `R` (`1` for GPipe).
    - `schedule`: `"gpipe"` or `"circular"`.

    **Returns:**

    A [`PipelineSchedule`][eqxscan.sharding.PipelineSchedule].
    """
    _, repeats = _check_schedule(schedule, repeats)
    stages = check_size("stages", stages)
    microbatches = check_size("microbatches", microbatches)
    if schedule == "circular" and microbatches < stages:
        raise _hint_error(
            f"The circular schedule needs at least as many microbatches as stages, "
            f"got microbatches={microbatches} for {stages} stages: a microbatch "
            "would re-enter stage 0 before it has left the last stage.",
            f"pass microbatches >= {stages} (e.g. {2 * stages}), or schedule='gpipe'.",
        )
    ticks = repeats * microbatches + stages - 1
    work = np.arange(ticks)[:, None] - np.arange(stages)[None, :]  # r * M + m
    busy = (work >= 0) & (work < repeats * microbatches)
    microbatch = np.where(busy, work % microbatches, -1).astype(np.int32)
    repeat = np.where(busy, work // microbatches, -1).astype(np.int32)
    return PipelineSchedule(stages, microbatches, repeats, microbatch, repeat)


@dataclasses.dataclass(frozen=True)
class _Pipeline:
    """A checked `pipeline` call."""

    stage_axis: str
    stages: int
    repeats: int
    per_chunk: int
    microbatches: int
    batch_axes: tuple[str, ...]
    layer_order: LayerOrder
    table: PipelineSchedule


def _blocks(a: jax.Array, p: _Pipeline, layer_order: LayerOrder) -> Array:
    # [L, ...] -> [S, R, K, ...]: chunk c = r * S + s goes to stage s, each stage's
    # R chunks one block. In stage order a reshape, keeping a split of L in place.
    if layer_order == "stage":
        return a.reshape(p.stages, p.repeats, p.per_chunk, *a.shape[1:])
    a = a.reshape(p.repeats, p.stages, p.per_chunk, *a.shape[1:])
    return jnp.swapaxes(a, 0, 1)


class _Drops(eqx.Module):
    """A call's drops per layer, in `[S, R, K]` blocks like the weights; drop-path's
    mask per microbatch's rows (`[M, B / M]`, or `[M]` for a batch of scalars)."""

    runs: Bool[Array, "*layers"] | None
    path_rate: Float[Array, "*layers"] | None
    path_mask: Bool[Array, "*layers_microbatches_rows"] | None


def _drops(
    p: _Pipeline, drop: DropRates | None, key: PRNGKeyArray | None, x: jax.Array
) -> _Drops | None:
    """What `stack(x, key=key)` draws for its drops (`None` if it drops nothing)."""
    if not check_droppable(drop, key, False, "sharding.pipeline"):
        return None
    assert drop is not None and key is not None
    split_key(key, 1, "sharding.pipeline")  # checks that it is one key
    rates = (np.asarray(drop.drop_path), np.asarray(drop.layer_drop))
    if p.layer_order == "stage":
        rates = tuple(
            permute_stage_order(r, p.stages, p.repeats, inverse=True) for r in rates
        )
    inputs = DropRates(drop.num_layers, rates[0], rates[1]).per_layer_inputs(key)
    runs, path_rate, path_mask = inputs.runs, inputs.path_rate, None
    if path_rate is not None:
        examples = carry_examples(x)
        draw = lambda k, rate: keep_bits(k, rate, 1, examples)  # noqa: E731
        path_mask = jax.vmap(draw)(inputs.key, path_rate)
        if examples is None:  # one mask entry per layer, the same for every row
            path_mask = jnp.broadcast_to(
                path_mask[:, None], (drop.num_layers, p.microbatches)
            )
        else:  # microbatch m is rows [m * B/M, (m + 1) * B/M)
            path_mask = path_mask.reshape(drop.num_layers, p.microbatches, -1)
    drops = _Drops(runs, path_rate, path_mask)
    return jtu.tree_map(lambda a: _blocks(a, p, "natural"), drops)


def pipeline(
    stack: Stacked,
    x: jax.Array,
    *,
    mesh: Mesh,
    microbatches: SupportsIndex,
    stage_axis: str = "stage",
    schedule: Schedule = "gpipe",
    repeats: SupportsIndex = 1,
    batch_axes: str | Sequence[str] = (),
    layer_order: LayerOrder = "natural",
    key: PRNGKeyArray | None = None,
) -> jax.Array:
    """Run `stack(x)` as a pipeline over the `stage_axis` of `mesh`.

    With `S` the size of `stage_axis` and `R = repeats`, the `L` layers are cut
    into `S * R` chunks of `L / (S * R)` layers; chunk `c` runs on stage `c mod S`
    (`"gpipe"`, `R = 1`: stage `s` runs layers `[s * L/S, (s+1) * L/S)`). The
    batch (axis 0 of `x`) is cut into `microbatches` equal parts which enter
    stage 0 one per tick and move on with `ppermute`; in the circular schedule
    the last stage sends them back to stage 0 for the next round. After
    `R * M + S - 1` ticks (the table of
    [`pipeline_schedule`][eqxscan.sharding.pipeline_schedule]) the last stage has
    every output, equal to `stack(x)`; the idle fraction (the "bubble") is
    `(S - 1) / (R * M + S - 1)`. `jax.grad` through it runs the pipeline
    backwards. Each stage scans its layers with the stack's own options
    (`remat=` included).

    A stack with drop rates (`drop_path=`, `layer_drop=`), outside inference
    mode, needs a `key`, and the result is then `stack(x, key=key)`, values and
    gradients, whatever the schedule, layer order and microbatches (for layers
    that take no key of their own: they get none, as without drop rates).
    LayerDrop chooses once per layer for the whole call (a stage does not
    compute a skipped layer), and drop-path's mask of layer `i` is the one drawn
    for the whole batch, each microbatch taking its rows; both from the
    natural-order layers' drop keys, as [`eqxscan.DropRates`][] documents.

    For `R > 1`, a natural-order stack split over `stage_axis` along its layer
    axis holds the wrong layers on each stage, exchanged at every call (a
    replicated one holds all of them everywhere). Permute it once with
    [`pipeline_order`][eqxscan.sharding.pipeline_order], split it so, and pass
    `layer_order="stage"`: each device then holds and reads only its stage's
    `[R, L/(S*R), ...]` block.

    **Arguments:**

    - `stack`: a `Stacked` of layers `layer(x) -> x` that accept a batch (e.g.
      `StackedMLP.blocks`); no layer arguments, keys or `per_layer` values.
    - `x`: the input, batch on axis 0.
    - `mesh`: a mesh with an axis `stage_axis`.
    - `microbatches`: how many parts `M` to cut the batch into (must divide it;
      at least `S` for the circular schedule).
    - `stage_axis`: the mesh axis of pipeline stages.
    - `schedule`: `"gpipe"` or `"circular"`.
    - `repeats`: rounds `R` through the stages (`1` for GPipe).
    - `batch_axes`: mesh axes over which each microbatch's rows are split (data
      parallelism next to the pipeline); by default they are replicated.
    - `layer_order`: `"natural"`, or `"stage"` for a stack permuted by
      `pipeline_order(stack, stages=S, repeats=R)` (its `stage_order` is
      checked). The result is `stack(x)` of the natural-order stack either way;
      gradients come in the stack's order.
    - `key`: the key of the stack's drop rates, needed when they are active,
      else ignored. The layers get no key: their own randomness (dropout) would
      be drawn per microbatch, not for the whole batch.

    **Returns:**

    `stack(x)` (with drop rates active, `stack(x, key=key)`).

    **Raises:**

    `ValueError` when the stack drops layers (training mode, a rate above 0)
    and no `key` is given, or when its layers are not in the order that
    `layer_order` names.
    """
    p = _check_pipeline(
        stack,
        x,
        mesh,
        microbatches,
        stage_axis,
        schedule,
        repeats,
        batch_axes,
        layer_order,
    )
    return _run(p, stack, x, mesh, _drops(p, stack.drop_rates, key, x))


def _run(
    p: _Pipeline, stack: Stacked, x: jax.Array, mesh: Mesh, drops: _Drops | None
) -> jax.Array:
    """The checked pipeline: every stage's program under one `shard_map`."""
    dyn, static = eqx.partition(stack.layers, eqx.is_array)
    dyn = jtu.tree_map(lambda a: _blocks(a, p, p.layer_order), dyn)
    # On Explicit axes a reshape of a split batch axis names its result's split.
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    rows = tuple(a for a in p.batch_axes if kinds[a] == AxisType.Explicit) or None
    named = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
    split = named if AxisType.Explicit in kinds.values() else lambda *_: None
    cut = (p.microbatches, -1, *x.shape[1:])
    xs = jnp.reshape(x, cut, out_sharding=split(None, rows))
    layer_spec = PartitionSpec(p.stage_axis)
    # Each stage's layers on its devices; the microbatches on every stage, their
    # rows split over `batch_axes`.
    dyn, drops = constrain((dyn, drops), named(p.stage_axis))
    xs = constrain(xs, named(None, p.batch_axes or None))
    out = jax.shard_map(
        functools.partial(_run_stage, p, stack, static),
        mesh=mesh,
        in_specs=(*jtu.tree_map(lambda _: layer_spec, (dyn, drops)), PartitionSpec()),
        out_specs=layer_spec,
        axis_names={p.stage_axis},
    )(dyn, drops, xs)
    # Only the last stage's buffer holds outputs.
    out = constrain(out, named(None, None, p.batch_axes or None))
    return jnp.reshape(out[p.stages - 1], x.shape, out_sharding=split(rows))


def _check_pipeline(
    stack: object,
    x: object,
    mesh: object,
    microbatches: object,
    stage_axis: str,
    schedule: object,
    repeats: object,
    batch_axes: str | Sequence[str],
    layer_order: object,
) -> _Pipeline:
    """Every argument of `pipeline` checked, with a clear error before tracing."""
    stack = _check_stack(stack, "pipeline runs")
    stack.check_layer_axis("pipeline")  # e.g. a batch of stacks, outside vmap
    if tapping():
        raise TypeError(
            "eqxscan.tap does not reach sharding.pipeline: its stages run inside "
            "shard_map.\nTap the stack without the pipeline (the same values), "
            "e.g. on a smaller batch."
        )
    microbatches = check_size("microbatches", microbatches)
    schedule, repeats = _check_schedule(schedule, repeats)
    order = _check_layer_order(layer_order)
    mesh = check_mesh(mesh)
    (stage_axis,) = check_axes(mesh, stage_axis, "stage_axis")
    batch_axes = check_axes(mesh, batch_axes, "batch_axes")
    if stage_axis in batch_axes:
        raise _hint_error(
            f"batch_axes {batch_axes} include the stage axis {stage_axis!r}.",
            "name only the other (data-parallel) mesh axes in batch_axes.",
        )
    stages = mesh.shape[stage_axis]
    where = f" (mesh axis {stage_axis!r})"
    per_chunk = _check_chunks(stack.num_layers, stages, repeats, where)
    staged = _stage_order(stages, repeats) if order == "stage" else None
    what = f"pipeline(..., layer_order={order!r}) over {stages} stages"
    _check_order(stack, staged, f"run this Stacked as {what}, repeats={repeats}")
    if not isinstance(x, (jax.Array, np.ndarray)):  # e.g. a pytree
        raise TypeError(
            f"pipeline cuts one array x (batch on axis 0) into microbatches, got "
            f"a {type(x).__name__}.\nHint: pass the batch as one array."
        )
    rows = int(np.prod([mesh.shape[a] for a in batch_axes]))
    if x.ndim == 0 or x.shape[0] % microbatches or (x.shape[0] // microbatches) % rows:
        raise _hint_error(
            f"Cannot cut a batch of shape {tuple(x.shape)} into {microbatches} "
            "microbatches"
            + (f" of rows split over {batch_axes} ({rows} ways)" if rows > 1 else "")
            + f": axis 0 must be a positive multiple of {microbatches * rows}.",
            "change the batch size or the number of microbatches.",
        )
    table = pipeline_schedule(
        stages=stages, microbatches=microbatches, repeats=repeats, schedule=schedule
    )
    return _Pipeline(
        stage_axis, stages, repeats, per_chunk, microbatches, batch_axes, order, table
    )


def _put(buf: jax.Array, i: Int[Array, ""], value: jax.Array) -> jax.Array:
    # Slot `i` of `buf` set to `value` where `i >= 0` (else left as it was).
    j = jnp.maximum(i, 0)
    return write(buf, j, jnp.where(i >= 0, value, index(buf, j)))


def _chunk_call(
    drops: _Drops | None, r: Int[Array, ""], m: Int[Array, ""], first: Int[Array, ""]
) -> LayerCall:
    """How chunk `r`'s layers (numbered from `first`) are called for
    microbatch `m`: with the chunk's LayerDrop choice and drop-path masks of the
    microbatch's rows."""
    if drops is None:
        return LayerCall((), {}, None, start=first)
    mine, path = index(drops, r), None
    if mine.path_mask is not None:
        assert mine.path_rate is not None
        mask = index(mine.path_mask, m, axis=1)
        path = DropInputs(None, None, mine.path_rate, None, path_mask=mask)
    return LayerCall((), {}, None, runs=mine.runs, drop=path, start=first)


def _run_stage(
    p: _Pipeline,
    stack: Stacked,
    static: PyTree,
    dyn: PyTree,
    drops: _Drops | None,
    xs: jax.Array,
) -> jax.Array:
    """One stage's program (under `shard_map`, every stage at once): a scan over
    the schedule's ticks. `dyn` and `drops` hold this stage's [1, R, K, ...]
    block."""
    dyn, drops = index((dyn, drops), 0)
    stage = jax.lax.axis_index(p.stage_axis)
    vary = lambda a: jax.lax.pcast(a, (p.stage_axis,), to="varying")
    table, stages, repeats = p.table, p.stages, p.repeats
    # Stage 0 of round r > 0 takes what the last stage sent at the tick before.
    arrived = np.concatenate([[-1], table.microbatch[:-1, -1]]).astype(np.int32)
    last = np.where(table.repeat[:, -1] == repeats - 1, table.microbatch[:, -1], -1)
    steps = (table.microbatch, table.repeat, arrived, last.astype(np.int32))
    # A ring when the microbatches go round again, a line otherwise.
    senders = stages if repeats > 1 else stages - 1
    shift = [(s, (s + 1) % stages) for s in range(senders)]

    def tick(carry: tuple, step: tuple) -> tuple[tuple, None]:
        # `state`: what this stage received; `inputs`: stage 0's microbatches,
        # each replaced by its output of the last round once it comes back.
        state, inputs, outputs = carry
        microbatch, repeat, arrived, last = step
        m = jnp.maximum(microbatch[stage], 0)
        r = jnp.maximum(repeat[stage], 0)
        if repeats > 1:
            inputs = _put(inputs, jnp.where(stage == 0, arrived, -1), state)
        local = restack(
            stack,
            layers=eqx.combine(index(dyn, r), static),
            num_layers=p.per_chunk,
            # A sharding of the whole mesh: not applied inside `shard_map`.
            layer_sharding=None,
            # The whole stack's drops, if any, are applied by `_chunk_call`.
            drop_path=0.0,
            layer_drop=0.0,
        )
        x = jnp.where(stage == 0, index(inputs, m), state)
        # Chunk `r * S + stage` of the stage order: its layers' numbers.
        first = (r * stages + stage) * p.per_chunk
        call = _chunk_call(drops, r, m, first)
        # An idle stage runs nothing: run on its stale input (zeros at first)
        # and masked, a layer with a non-finite derivative there (a norm
        # without eps at zero) made the weights' gradients NaN.
        busy = microbatch[stage] >= 0
        out = jax.lax.cond(
            busy, lambda x: scan_layers(local, x, call)[0], lambda x: x, x
        )
        outputs = _put(outputs, jnp.where(stage == stages - 1, last, -1), out)
        state = jax.lax.ppermute(out, p.stage_axis, shift)
        return (state, inputs, outputs), None

    start = (vary(jnp.zeros_like(xs[0])), vary(xs), vary(jnp.zeros_like(xs)))
    (_, _, outputs), _ = jax.lax.scan(tick, start, tuple(map(jnp.asarray, steps)))
    return outputs[None]
