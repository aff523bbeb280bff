"""`Chain`: heterogeneous depth. Runs of like layers and repeating patterns of
layers are scanned; the remaining layers are called directly."""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray, PyTree

from ._checks import can_stack, check_takes_key, describe, first_difference
from ._engine import check_options
from ._stacked import _MISSING, check_per_layer, PerLayer, Stacked


class Span(NamedTuple):
    """Where a group of a [`eqxscan.Chain`][] sits: layers `start` to
    `start + size - 1`. `period` is `0` for a lone layer, `1` for a scanned run
    of like layers, and `K >= 2` for `size // K` repeats of a unit of `K` layers
    scanned one unit per step."""

    start: int
    size: int
    period: int


# A plan is a tuple of (size, period, plan of the unit) entries, one per group.
_Plan = tuple[tuple[int, int, Any], ...]


@functools.cache
def _plan(classes: tuple[int, ...], periodic: bool) -> tuple[_Plan, int, int]:
    """The grouping of a sequence of layer classes with the smallest program.

    Cost of a grouping, compared lexicographically: (1) the number of layer
    bodies traced (a lone layer or a scanned run traces one body; a periodic
    group traces the bodies of its unit's own best grouping, once for all
    repeats), then (2) the number of groups, counting those inside units. Ties go
    to the grouping whose first group covers the most layers, so the choice is
    deterministic and a remainder comes last. Returns `(plan, bodies, groups)`.
    """
    n = len(classes)
    # best[i] = (bodies, groups, first group) for classes[i:].
    best: list[tuple[int, int, Any]] = [(0, 0, None)] * (n + 1)
    for i in range(n - 1, -1, -1):
        options = [(1, 1, (1, 0, ()))]  # (bodies, groups, entry): a lone layer
        run = 1
        while i + run < n and classes[i + run] == classes[i]:
            run += 1
        options.extend((1, 1, (m, 1, ())) for m in range(2, run + 1))
        if periodic:
            # A unit inside the run would be one class repeated: the run does better.
            for k in range(max(2, run + 1), (n - i) // 2 + 1):
                unit = classes[i : i + k]
                repeats = 1
                while classes[i + repeats * k : i + (repeats + 1) * k] == unit:
                    repeats += 1
                if repeats < 2 or not _primitive(unit):
                    continue  # a power of a shorter unit: that unit does better
                inner, inner_bodies, inner_groups = _plan(unit, periodic)
                options.extend(
                    (inner_bodies, 1 + inner_groups, (p * k, k, inner))
                    for p in range(2, repeats + 1)
                )
        total_bodies, total_groups, _, entry = min(
            (
                (bodies + best[i + e[0]][0], groups + best[i + e[0]][1], -e[0], e)
                for bodies, groups, e in options
            ),
            key=lambda t: t[:3],
        )
        best[i] = (total_bodies, total_groups, entry)
    plan, i = [], 0
    while i < n:
        plan.append(best[i][2])
        i += best[i][2][0]
    return tuple(plan), best[0][0], best[0][1]


def _primitive(unit: tuple[int, ...]) -> bool:
    """Whether `unit` is not a repeat of a shorter unit."""
    k = len(unit)
    return not any(
        k % d == 0 and unit == unit[:d] * (k // d) for d in range(1, k // 2 + 1)
    )


def _classes(layers: Sequence[Any]) -> tuple[int, ...]:
    """Label layers so that two share a label iff they can be stacked together."""
    reps: list[Any] = []
    labels = []
    for layer in layers:
        label = next((j for j, rep in enumerate(reps) if can_stack(rep, layer)), None)
        if label is None:
            label = len(reps)
            reps.append(layer)
        labels.append(label)
    return tuple(labels)


def _assemble(
    layers: Sequence[Any], plan: _Plan, options: dict[str, Any]
) -> tuple[tuple[Any, ...], tuple[Span, ...]]:
    groups, layout, start = [], [], 0
    for size, period, inner in plan:
        chunk = list(layers[start : start + size])
        if period == 0:
            groups.append(chunk[0])
        elif period == 1:
            groups.append(Stacked.from_layers(chunk, **options))
        else:
            units = [
                Period._make(chunk[p : p + period], inner, options)
                for p in range(0, size, period)
            ]
            groups.append(Stacked.from_layers(units, **options))
        layout.append(Span(start, size, period))
        start += size
    return tuple(groups), tuple(layout)


def _unstack(groups: tuple[Any, ...], layout: tuple[Span, ...]) -> list[Any]:
    layers: list[Any] = []
    for group, span in zip(groups, layout):
        if span.period == 0:
            layers.append(group)
        elif span.period == 1:
            layers.extend(group.unstack())
        else:
            for unit in group.unstack():
                layers.extend(unit.unstack())
    return layers


def _set_options(
    groups: tuple[Any, ...], layout: tuple[Span, ...], options: dict[str, Any]
) -> tuple[Any, ...]:
    """`groups` with `options` set on every scanned group, those inside repeated
    units included; other fields (e.g. `layer_sharding`) and lone layers are kept."""
    new = []
    for group, span in zip(groups, layout):
        if span.period > 1:
            unit = group.layers
            inner = _set_options(unit.groups, unit.layout, options)
            group = group._replace(
                layers=Period(inner, unit.layout, unit.num_layers, unit.collect)
            )
        new.append(group if span.period == 0 else group._replace(**options))
    return tuple(new)


def _take(tree: Any, span: Span) -> Any:
    """The part of a per-layer `tree` (leading axis: layers) that `span` needs."""
    if span.period == 0:
        return jtu.tree_map(lambda a: a[span.start] if eqx.is_array(a) else a, tree)
    part = jtu.tree_map(
        lambda a: a[span.start : span.start + span.size] if eqx.is_array(a) else a,
        tree,
    )
    if span.period == 1:
        return part
    # [repeats * K, ...] -> [repeats, K, ...]: the scan slices repeats, the unit K.
    return jtu.tree_map(
        lambda a: (
            a.reshape(span.size // span.period, span.period, *a.shape[1:])
            if eqx.is_array(a)
            else a
        ),
        part,
    )


def _route(value: Any, span: Span) -> Any:
    """What a group receives for one argument of the whole sequence."""
    if not isinstance(value, PerLayer):
        return value  # broadcast
    part = _take(value.tree, span)
    if span.period == 0:
        return part
    if span.period == 1:
        return PerLayer(part)
    # The outer PerLayer is sliced per repeat; the inner one reaches the unit.
    return PerLayer(PerLayer(part))


def _group_name(group: Any, span: Span) -> str:
    if span.period == 0:
        return f"layer {span.start} ({type(group).__name__})"
    last = span.start + span.size - 1
    if span.period == 1:
        return f"layers {span.start}-{last} ({type(group.layers).__name__}, scanned)"
    unit = ", ".join(group.layers._class_names())
    return (
        f"layers {span.start}-{last} ({span.size // span.period} repeats of "
        f"[{unit}], scanned)"
    )


def _call_group(
    group: Any,
    span: Span,
    x: Any,
    args: tuple,
    kwargs: dict,
    keys: Any,
    collect: bool,
) -> tuple[Any, Any]:
    """Run one group; `ys` (when collecting) has a leading axis of `span.size`."""
    args = tuple(_route(a, span) for a in args)
    kwargs = {name: _route(v, span) for name, v in kwargs.items()}
    group_keys = None if keys is None else _take(keys, span)
    if span.period == 0:
        if group_keys is not None:
            check_takes_key(group, "Chain", "layer i gets key=keys[i]")
            kwargs["key"] = group_keys
        out = group(x, *args, **kwargs)
        if not collect:
            return out, None
        if not (isinstance(out, tuple) and len(out) == 2):
            got = describe(out) if eqx.is_array(out) else type(out).__name__
            raise TypeError(
                f"Chain.scan expects each layer to return a (carry, y) pair, but "
                f"{_group_name(group, span)} returned {got}. Use "
                "`chain(x)` for layers that return only the carry."
            )
        x, y = out
        return x, jtu.tree_map(lambda a: a[None] if eqx.is_array(a) else a, y)
    if span.period > 1 and collect:
        group = group._replace(layers=group.layers._collecting())
    x, ys = group._run(x, args, kwargs, None, collect, keys=group_keys)
    if span.period > 1 and ys is not None:
        ys = jtu.tree_map(
            lambda a: a.reshape(span.size, *a.shape[2:]) if eqx.is_array(a) else a,
            ys,
        )
    return x, ys


def _join(pieces: list[tuple[Any, Span, Any]]) -> Any:
    """Concatenate the groups' `ys` along the layer axis."""
    if all(ys is None for _, _, ys in pieces):
        return None
    first_group, first_span, first = pieces[0]
    for group, span, ys in pieces[1:]:
        a = jtu.tree_map(lambda a: a[0] if eqx.is_array(a) else a, first)
        b = jtu.tree_map(lambda a: a[0] if eqx.is_array(a) else a, ys)
        diff = first_difference(a, b) if ys is not None and first is not None else None
        if ys is None or first is None or diff is not None:
            path, da, db = diff or ("", describe(first), describe(ys))
            raise TypeError(
                f"Chain.scan stacks every layer's y, so they must agree, but at "
                f"`y{path}` {_group_name(first_group, first_span)} gave {da} and "
                f"{_group_name(group, span)} gave {db}."
            )
    if len(pieces) == 1:
        return first
    return jtu.tree_map(
        lambda *a: jnp.concatenate(a) if eqx.is_array(a[0]) else a[0],
        *(ys for _, _, ys in pieces),
    )


def _run_groups(
    groups: tuple[Any, ...],
    layout: tuple[Span, ...],
    x: Any,
    args: tuple,
    kwargs: dict,
    keys: Any,
    collect: bool,
    explain: bool,
) -> tuple[Any, Any]:
    """Fold `x` through the groups. With `explain`, an error raised by a group is
    reported with the layer index, and, when an earlier lone layer changed the
    carry, as a `TypeError` naming where and how it changed."""
    pieces = []
    changed = None  # (layer name, path, before, after) of the last carry change
    for group, span in zip(groups, layout):
        try:
            new_x, ys = _call_group(group, span, x, args, kwargs, keys, collect)
        except (TypeError, ValueError) as e:
            if not explain:
                raise
            name = _group_name(group, span)
            if changed is not None:
                by, path, before, after = changed
                raise TypeError(
                    f"Chain {name} cannot take the carry it receives: "
                    f"`carry{path}` is {after}, changed from {before} by {by}. "
                    f"It raised {type(e).__name__}: {e}"
                ) from e
            e.add_note(f"(raised by eqxscan.Chain {name})")
            raise
        if explain and span.period == 0:
            diff = first_difference(x, new_x)
            if diff is not None:
                changed = (_group_name(group, span), *diff)
        x = new_x
        pieces.append((group, span, ys))
    return x, (_join(pieces) if collect else None)


class Period(eqx.Module):
    """One repeat of a periodic pattern inside a [`eqxscan.Chain`][]: `K` layers
    run in order. The unit's own runs of like layers are scanned too, so a
    pattern like `local x5, global` traces two layer bodies.

    A `Chain` stacks the repeats as a `Stacked` of `Period`s and scans over them,
    one repeat per step. Called by the chain with `key` holding `K` keys (one per
    layer) and `per_layer` arguments whose leading axis is `K`.
    """

    groups: tuple[Any, ...]
    layout: tuple[Span, ...] = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    collect: bool = eqx.field(static=True, default=False)

    @classmethod
    def _make(
        cls, layers: Sequence[Any], plan: _Plan, options: dict[str, Any]
    ) -> "Period":
        groups, layout = _assemble(layers, plan, options)
        return cls(groups, layout, len(layers))

    def _collecting(self) -> "Period":
        return Period(self.groups, self.layout, self.num_layers, True)

    def _class_names(self) -> list[str]:
        # Also right for a stacked `Period` (arrays with a repeat axis).
        return [
            type(group if span.period == 0 else group.layers).__name__
            for group, span in zip(self.groups, self.layout)
            for _ in range(1 if span.period == 0 else span.size)
        ]

    def unstack(self) -> list[Any]:
        """The `K` layers of this repeat."""
        return _unstack(self.groups, self.layout)

    def __call__(self, x: PyTree, *args: Any, key: Any = None, **kwargs: Any) -> PyTree:
        x, ys = _run_groups(
            self.groups, self.layout, x, args, kwargs, key, self.collect, False
        )
        return (x, ys) if self.collect else x


def _tracing(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jtu.tree_leaves(tree))


class Chain(eqx.Module):
    """A sequence of layers that are not all alike, run as a fold with as few
    traced layer bodies as possible.

    - Runs of consecutive layers with identical structure, static fields,
      non-array leaves, shapes and dtypes become one [`eqxscan.Stacked`][]
      (one scanned body).
    - A repeating pattern of layers (`A, B, A, B, ...`, or `local, local, global`
      repeated) becomes a `Stacked` of [`eqxscan.Period`][]s: one scan step runs
      one repeat of the unit, so the program does not grow with the number of
      repeats. Layers left over before or after the repeats are grouped the same
      way.
    - Any other layer is called directly.

    Among all groupings the chain picks the one that traces the fewest layer
    bodies, then the one with the fewest groups (counting groups inside a unit);
    ties go to the grouping whose earliest group covers the most layers. The
    result is in `chain.groups` (a scanned run or pattern appears as a
    `Stacked`, a lone layer as itself) and `chain.layout` (one
    [`eqxscan.Span`][] per group).

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        keys = jax.random.split(jax.random.key(0), 8)
        mlp = lambda k: eqx.nn.MLP(16, 16, 32, 1, key=k)
        lin = lambda k: eqx.nn.Linear(16, 16, key=k)
        layers = [mlp(k) if i % 2 == 0 else lin(k) for i, k in enumerate(keys)]
        chain = eqxscan.Chain(layers)          # MLP, Linear, MLP, Linear, ...
        assert len(chain.groups) == 1          # one scan over 4 repeats of 2
        x = jnp.ones(16)
        y = x
        for layer in layers:
            y = layer(y)
        assert jnp.allclose(chain(x), y, atol=1e-5)
        ```
    """

    groups: tuple[Any, ...]
    layout: tuple[Span, ...] = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    mode: str = eqx.field(static=True)
    checkpoint: Any = eqx.field(static=True)
    unroll: int | bool | Literal["auto"] = eqx.field(static=True)
    periodic: bool = eqx.field(static=True)

    def __init__(
        self,
        layers: Sequence[Any],
        *,
        mode: str = "scan",
        checkpoint: Any = "auto",
        unroll: int | bool | Literal["auto"] = "auto",
        periodic: bool = True,
    ):
        """**Arguments:**

        - `layers`: a non-empty list (or tuple) of layers, each called as
          `layer(x, *args, **kwargs)` and returning the new carry.
        - `mode`, `checkpoint`, `unroll`: as for [`eqxscan.Stacked`][], used for
          every scanned group.
        - `periodic`: also detect repeating patterns of different layers
          (default). With `False`, only runs of like layers are scanned.

        **Raises:**

        `ValueError` for an empty sequence; `TypeError` if `layers` is not a
        list or tuple.
        """
        if not isinstance(layers, (list, tuple)):
            raise TypeError(
                f"Chain takes a list or tuple of layers, got {type(layers).__name__}."
            )
        if len(layers) == 0:
            raise ValueError("Chain needs at least one layer, got an empty sequence.")
        check_options(mode, checkpoint, unroll)
        if not isinstance(periodic, bool):
            raise TypeError(f"periodic must be a bool, got {type(periodic).__name__}.")
        plan, _, _ = _plan(_classes(layers), periodic)
        options = dict(mode=mode, checkpoint=checkpoint, unroll=unroll)
        self.groups, self.layout = _assemble(layers, plan, options)
        self.num_layers = len(layers)
        self.mode = mode
        self.checkpoint = checkpoint
        self.unroll = unroll
        self.periodic = periodic

    def __len__(self) -> int:
        return self.num_layers

    def unstack(self) -> list[Any]:
        """The layers as the list the chain was built from."""
        return _unstack(self.groups, self.layout)

    def with_options(
        self,
        *,
        mode: str = _MISSING,
        checkpoint: Any = _MISSING,
        unroll: int | bool | Literal["auto"] = _MISSING,
    ) -> "Chain":
        """A copy with the same weights and grouping and new options for every
        scanned group; options not given are kept.

        **Arguments:**

        - `mode`, `checkpoint`, `unroll`: as for `__init__`.

        **Returns:**

        A `Chain` sharing this one's arrays. Each scanned group keeps its
        `layer_sharding` (as set by [`eqxscan.sharding.shard`][]).
        """
        options = dict(
            mode=self.mode if mode is _MISSING else mode,
            checkpoint=self.checkpoint if checkpoint is _MISSING else checkpoint,
            unroll=self.unroll if unroll is _MISSING else unroll,
        )
        check_options(**options)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(options, groups=_set_options(self.groups, self.layout, options))
        # The grouping does not depend on the options: skip `__init__`'s planning.
        chain = object.__new__(Chain)
        for name, value in fields.items():
            object.__setattr__(chain, name, value)
        return chain

    def __call__(
        self, x: PyTree, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> PyTree:
        """Fold `x` through the layers: `x = layer_i(x, *args, **kwargs)`.

        **Arguments:**

        - `x`: the carry, any pytree. A lone layer may change its structure,
          shapes or dtypes (e.g. an input projection); a scanned group must
          return a carry like the one it receives.
        - `*args`, `**kwargs`: passed to every layer (broadcast), except values
          wrapped in [`eqxscan.per_layer`][]: every array leaf of those has a
          leading axis of length `len(chain)` and layer `i` receives slice `i`.
        - `key`: if given, split with `jax.random.split(key, len(chain))` and
          layer `i` is called with `key=keys[i]`, whatever the grouping.

        **Returns:**

        The final carry.

        **Raises:**

        `TypeError` naming the layer, the leaf path and both shapes/dtypes when a
        layer cannot take the carry an earlier layer changed. Checked with
        `jax.eval_shape` before anything runs.
        """
        return self._run(x, args, kwargs, key, collect=False)[0]

    def scan(
        self, x: PyTree, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> tuple[PyTree, PyTree]:
        """Like `__call__`, but each layer returns `(new_x, y_i)`.

        **Returns:**

        `(final carry, ys)` with the `y_i` of all `len(chain)` layers stacked
        leaf by leaf on axis 0 (`None` if layers return `(x, None)`); every
        layer's `y_i` must have the same structure, shapes and dtypes.
        """
        return self._run(x, args, kwargs, key, collect=True)

    def _run(
        self, x: Any, args: tuple, kwargs: dict, key: Any, collect: bool
    ) -> tuple[Any, Any]:
        check_per_layer(args, kwargs, self.num_layers)
        keys = None if key is None else jr.split(key, self.num_layers)
        if not _tracing((self, x, args, kwargs, keys)):
            # Outside jit the groups would run one by one: find a misfit first.
            eqx.filter_eval_shape(
                _run_groups,
                self.groups,
                self.layout,
                x,
                args,
                kwargs,
                keys,
                collect,
                True,
            )
        return _run_groups(
            self.groups, self.layout, x, args, kwargs, keys, collect, True
        )
