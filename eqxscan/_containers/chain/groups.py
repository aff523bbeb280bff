"""A `Chain`'s groups (`Placement`, `Pattern`): built from layers, named, and run
in order through the layer-call seam (a lone layer as layer `start` of the
chain's call, a stack with `LayerCall.placed`, a pattern step with
`LayerCall.inner`), or one layer at a time (`lone_fn` for early exit,
`chain_layer_fn` for traced subsets)."""

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ..._helpers.checks import (
    CarryError,
    check_carry,
    first_difference,
    noting,
    split_key,
)
from ..._helpers.constrain import constrain
from ..._helpers.stateful import find_state, get_arg, replace_arg, state_pair
from ..._scan.buffers import find_buffer, Place, view_of
from ..._scan.layer_call import (
    carry_only,
    check_method,
    index,
    LayerCall,
    Method,
    OneLayer,
    run_one,
)
from ..._scan.options import ScanOptions
from ..._scan.taps import add, held
from ..stack_calls import scan_layers
from ..stacked import in_natural_order, LayerNumbering, Stacked, StateDictFn
from ..stage_order import layers_in_stage_order
from .grouping import Plan


class Placement(NamedTuple):
    """Where a group of a [`eqxscan.Chain`][] sits: layers `start` to
    `start + size - 1`, and how it is scanned: `per_step` layers per scan step,
    `0` for a lone layer (not scanned), `1` for a stack of like layers, and
    `K >= 2` for a pattern of `K` layers repeated `size // K` times."""

    start: int
    size: int
    per_step: int


def assemble(
    layers: Sequence[Any], groups_plan: Plan, options: ScanOptions
) -> tuple[tuple[Any, ...], tuple[Placement, ...]]:
    """Build the groups that `groups_plan` describes from `layers`."""
    groups, layout, start = [], [], 0
    for size, per_step, pattern in groups_plan:
        chunk = list(layers[start : start + size])
        if per_step == 0:
            groups.append(chunk[0])
        elif per_step == 1:
            groups.append(Stacked.from_layers(chunk, **options.as_args()))
        else:
            repeats = [
                Pattern(*assemble(chunk[p : p + per_step], pattern, options), per_step)
                for p in range(0, size, per_step)
            ]
            groups.append(Stacked.from_layers(repeats, **options.as_args()))
        layout.append(Placement(start, size, per_step))
        start += size
    return tuple(groups), tuple(layout)


def unstack_groups(groups: tuple[Any, ...], layout: tuple[Placement, ...]) -> list[Any]:
    layers: list[Any] = []
    for group, place in zip(groups, layout):
        if place.per_step == 0:
            layers.append(group)
        else:  # a stack's layers, or each repeat's
            for item in group.unstack():
                layers.extend(item.unstack() if place.per_step > 1 else [item])
    return layers


def set_options(
    groups: tuple[Any, ...], layout: tuple[Placement, ...], options: ScanOptions
) -> tuple[Any, ...]:
    """`groups` with `options` set on every scanned group, those inside repeated
    patterns included; all else is kept (e.g. `layer_sharding`)."""
    new = []
    for group, place in zip(groups, layout):
        if place.per_step > 1:
            pattern = group.layers
            inner = set_options(pattern.groups, pattern.layout, options)
            group = eqx.tree_at(lambda s: s.layers.groups, group, inner)
        if place.per_step > 0:
            group = group.with_options(**options.as_args())
        new.append(group)
    return tuple(new)


def group_name(group: Any, place: Placement) -> str:
    if place.per_step == 0:
        return f"layer {place.start} ({type(group).__name__})"
    last = place.start + place.size - 1
    if place.per_step == 1:
        name = type(group.layers).__name__
        return f"layers {place.start}-{last} (stack of {name}, scanned)"
    pattern = ", ".join(  # of one repeat, read from the stacked repeats
        type(g.layers if stacked else g).__name__
        for _, g, stacked, _ in layer_bodies(group.layers.groups, group.layers.layout)
    )
    return (
        f"layers {place.start}-{last} ({place.size // place.per_step} repeats of "
        f"pattern [{pattern}], scanned)"
    )


def _scanned_call(call: LayerCall, place: Placement) -> LayerCall:
    """`call` cut to a scanned group at `place`: a stack, or a pattern's repeats,
    each repeat's layers given their slices of its inputs (`LayerCall.inner`)."""
    group_call = call.placed(place.start, place.size, place.per_step)
    if place.per_step == 1:
        return group_call

    def run(repeat: Pattern, x: PyTree, one: OneLayer) -> PyTree:
        inner = call.inner(one)
        x, ys = run_groups(repeat.groups, repeat.layout, x, inner, "Pattern")
        return x if call.read_out is carry_only else (x, ys)

    return group_call._replace(pattern_step=run)


def _on_layer_axis(ys: PyTree, place: Placement) -> PyTree:
    # A group's `ys` with one leading layer axis of `place.size`: a lone layer's
    # gets one, a pattern's repeat and layer axes become one.
    cut = min(place.per_step, 2)
    return jtu.tree_map(
        lambda a: a.reshape(place.size, *a.shape[cut:]) if eqx.is_array(a) else a, ys
    )


def _join(pieces: list[tuple[str, PyTree]]) -> PyTree:
    """Concatenate the groups' `ys` (each named) along the layer axis."""
    if all(ys is None for _, ys in pieces):
        return None
    first_name, first = pieces[0]
    for name, ys in pieces[1:]:
        if (diff := first_difference(index(first, 0), index(ys, 0))) is not None:
            path, da, db = diff
            raise TypeError(
                f"Chain.scan stacks every layer's y, so they must agree, but at "
                f"`y{path}` {first_name} gave {da} and {name} gave {db}."
            )
    if len(pieces) == 1:
        return first
    return jtu.tree_map(
        lambda *a: jnp.concatenate(a) if eqx.is_array(a[0]) else a[0],
        *(ys for _, ys in pieces),
    )


def places(groups: tuple[Any, ...], layout: tuple[Placement, ...]) -> tuple[Place, ...]:
    """Where each group sits, as a `LayerBuffers` records it (with a repeated
    pattern's own layout)."""
    return tuple(
        (
            place.start,
            place.size,
            place.per_step,
            places(g.layers.groups, g.layers.layout) if place.per_step > 1 else (),
        )
        for g, place in zip(groups, layout)
    )


def check_chain_method(
    groups: tuple[Any, ...], layout: tuple[Placement, ...], method: Method | None
) -> None:
    """Check `method` against every kind of layer the groups hold (a name must
    be a method of each)."""
    for layer in bodies(groups, layout) if isinstance(method, str) else [None]:
        check_method(method, layer)


def run_groups(
    groups: tuple[Any, ...],
    layout: tuple[Placement, ...],
    x: PyTree,
    call: LayerCall,
    owner: str,
) -> tuple[PyTree, PyTree]:
    """Fold `x` through the groups. An error raised by a group gets one note
    naming the group (within `owner`, e.g. `"Chain"`) and, when an earlier lone
    layer changed the carry, where and how it changed."""
    pieces = []
    changed = ""  # how the last lone layer that changed the carry changed it
    state_at = find_state(call.args, call.kwargs)
    at = find_buffer(call.args, call.kwargs)
    # With a buffer, group `k` gets the view of its own buffer `tree[k]` (fixed
    # at the same enclosing steps) and returns it updated.
    view = None if at is None else view_of(call.args, call.kwargs, at)
    trees = None if view is None else list(view.tree)
    order = list(enumerate(zip(groups, layout)))
    for k, (group, place) in reversed(order) if call.reverse else order:
        name = group_name(group, place)
        group_call = call
        if view is not None and at is not None and trees is not None:
            args, kwargs = replace_arg(call.args, call.kwargs, at, view.of(trees[k]))
            group_call = call._replace(args=args, kwargs=kwargs)
        try:
            # The group run here rather than in a helper: fewer frames between
            # `Chain.__call__` and a layer in a traceback.
            with noting(f"{owner} {name}{changed}", group):
                if place.per_step == 0:
                    one = group_call.at(place.start)
                    new_x, ys = run_one(group, group_call, one, x, name)
                else:
                    last = place.start + place.size - 1
                    placed = _scanned_call(group_call, place)
                    with jax.named_scope(f"layers_{place.start}-{last}"):  # profiles
                        new_x, ys = scan_layers(in_natural_order(group), x, placed)
                ys = _on_layer_axis(ys, place)
            if trees is not None:
                new_x, trees[k] = new_x
        except CarryError as e:
            # The group changed the carry itself: its headline names it (by the
            # layer's number when the loop knows which one).
            if place.per_step == 1 and e.step is not None:
                name = f"layer {place.start + e.step} ({type(group.layers).__name__})"
            e.args = (f"{owner} {name} {e.what}",)
            raise
        if state_at is not None:
            # A stateful fold: every group returns `(x, state)`, and the next
            # one is called with the new state.
            new_x, state = state_pair(new_x, name)
            args, kwargs = replace_arg(call.args, call.kwargs, state_at, state)
            call = call._replace(args=args, kwargs=kwargs)
        if place.per_step == 0 and (diff := first_difference(x, new_x)):
            path, before, after = diff
            changed = (
                f", whose carry `carry{path}` is {after}, changed from {before} "
                f"by {name}"
            )
        x = new_x
        pieces.append((name, ys))
    if state_at is not None:
        return (x, get_arg(call.args, call.kwargs, state_at)), None
    if call.reverse:
        pieces.reverse()  # ys in layer order, whatever the direction
    ys = _join(pieces) if call.read_out is not carry_only else None
    return (x if trees is None else (x, tuple(trees))), ys


def name_groups(
    groups: tuple[Any, ...],
    layout: tuple[Placement, ...],
    fn: StateDictFn,
    offset: LayerNumbering,
    axes: tuple[int, ...],
) -> tuple[Any, ...]:
    """`groups` (of a chain, or of one repeat of a pattern) with `fn` applied to
    what each holds; `offset` numbers their layers (with the strides of the
    repeat axes `axes` in front of their arrays)."""
    new = []
    for group, place in zip(groups, layout):
        start = offset.start + place.start
        if place.per_step == 0:
            new.append(fn(group, LayerNumbering(start, offset.strides), axes))
        elif place.per_step == 1:
            order = layers_in_stage_order(place.size, group.stage_order)
            numbering = LayerNumbering(start, offset.strides + (1,), order)
            layers = fn(group.layers, numbering, axes + (place.size,))
            new.append(eqx.tree_at(lambda s: s.layers, group, layers))
        else:
            pattern = group.layers
            repeats = LayerNumbering(start, offset.strides + (place.per_step,))
            inner = axes + (place.size // place.per_step,)
            named = name_groups(pattern.groups, pattern.layout, fn, repeats, inner)
            new.append(eqx.tree_at(lambda s: s.layers.groups, group, named))
    return tuple(new)


def layer_bodies(
    groups: tuple[Any, ...],
    layout: tuple[Placement, ...],
    path: tuple[int, ...] = (),
    reps: tuple[int, ...] = (),
) -> Iterator[tuple[tuple[int, ...], Any, bool, tuple[int, ...]]]:
    """For each layer of `groups`, in order: the path to the group whose body
    runs it (a group index per level, one level per repeated pattern), that
    group (a lone layer, or a stack), whether it is a stack, and the indices of
    the layer's weights in it (repeats, then within a stack)."""
    for j, (group, place) in enumerate(zip(groups, layout)):
        here = path + (j,)
        if place.per_step == 0:
            yield here, group, False, reps
        elif place.per_step == 1:
            for o in range(place.size):
                yield here, group, True, reps + (o,)
        else:
            pattern: Pattern = group.layers
            for r in range(place.size // place.per_step):
                yield from layer_bodies(
                    pattern.groups, pattern.layout, here, reps + (r,)
                )


def bodies(groups: tuple[Any, ...], layout: tuple[Placement, ...]) -> list[Any]:
    """The layer bodies a grouping traces (a pattern's own, once), in order: a
    lone layer, or a stack's layers."""
    found = {p: g.layers if s else g for p, g, s, _ in layer_bodies(groups, layout)}
    return list(found.values())


class Pattern(eqx.Module):
    """One repeat of a pattern inside a [`eqxscan.Chain`][]: `K` layers run in
    order, stacks of like layers among them scanned too (`local x5, global`
    traces two layer bodies). A `Chain` scans a `Stacked` of `Pattern`s, one
    repeat per scan step."""

    groups: tuple[Any, ...]
    layout: tuple[Placement, ...] = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)

    def unstack(self) -> list[Any]:
        """The `K` layers of this repeat."""
        return unstack_groups(self.groups, self.layout)

    def __call__(
        self,
        x: PyTree,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        **kwargs: PyTree,
    ) -> PyTree:
        """Run the `K` layers in order, as a `Chain` of them runs."""
        keys = key if key is None else split_key(key, self.num_layers, "Pattern")
        call = LayerCall(args, kwargs, keys, caller="Chain")
        return run_groups(self.groups, self.layout, x, call, "Pattern")[0]


def lone_fn(
    layer: object, call: LayerCall, one: OneLayer, name: str, c: PyTree
) -> PyTree:
    """A lone layer as a function of the carry, as `call` runs it."""
    return run_one(layer, call, one, c, name)[0]


def _describe_layers(layers: list[int], name: str) -> str:
    if len(layers) == 1:
        return f"Layer {layers[0]} ({name})"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"Layers {layers[0]}-{layers[-1]} ({name}, one body)"
    shown = ", ".join(map(str, layers[:6])) + (", ..." if len(layers) > 6 else "")
    return f"Layers {shown} ({name}, one body)"


def chain_layer_fn(
    groups: tuple[Any, ...],
    layout: tuple[Placement, ...],
    call: LayerCall,
    name_inputs: Callable[[PyTree], PyTree],
    carry_static: PyTree,
    hint: str,
) -> Callable[[Int[Array, ""], PyTree], PyTree]:
    """Layer number `g` (traced) of a chain's `groups` as `fn(g, carry)`: a
    `lax.switch` on the body that holds the layer, which reads its one layer from
    its group's stacked weights. Every body must return a carry like the one it
    receives (else a `TypeError` naming the layer, with `hint`). `name_inputs`
    names what a body reads as the step's inputs."""
    walked = list(layer_bodies(groups, layout))
    # Per body: its group, whether a stack, and the layer numbers it runs.
    branches: dict[tuple[int, ...], tuple[Any, bool, list[int]]] = {}
    for g, (path, group, stacked, _) in enumerate(walked):
        branches.setdefault(path, (group, stacked, []))[2].append(g)
    # Per layer number: its body, then the indices of its weights (zero-padded).
    width = max(len(reps) for _, _, _, reps in walked)
    paths = list(branches)
    table = [(paths.index(p), *r, *[0] * (width - len(r))) for p, _, _, r in walked]
    rows = jnp.asarray(table, jnp.int32)

    def body(
        group: Any, stacked: bool, layers: list[int], row: Array, one: OneLayer
    ) -> Callable[[PyTree], PyTree]:
        name = type(group.layers if stacked else group).__name__
        where, depth = _describe_layers(layers, name), len(walked[layers[0]][3])

        # Only the carry's arrays pass through the `switch`; the rest (broadcast
        # arguments may be any Python value) is closed over.
        def fn(c_dyn: PyTree) -> PyTree:
            natural = in_natural_order(group)
            tree = natural.layers if stacked else natural
            for i in range(depth):
                tree = index(tree, row[1 + i])
            if stacked and natural.layer_sharding is not None:
                tree = constrain(tree, natural.layer_sharding)
            layer, old = name_inputs(tree), eqx.combine(c_dyn, carry_static)
            # taps' records leave the switch as outputs; a layer failing on the
            # carry (an input projection) is named with the carry and the hint
            with held() as records, noting(where, old, hint=hint):
                new = lone_fn(layer, call, one, where, old)
            try:
                check_carry(old, new, where)
            except CarryError as e:
                raise TypeError(f"{call.caller}: {where} {e.what}\n{hint}") from None
            return eqx.filter(new, eqx.is_array), tuple(records)

        return fn

    def layer(g: Int[Array, ""], carry: PyTree) -> PyTree:
        row = rows[g]
        one = name_inputs(call.at(g))
        fns = [body(*branch, row, one) for branch in branches.values()]
        new, records = jax.lax.switch(row[0], fns, eqx.filter(carry, eqx.is_array))
        add(records)
        return eqx.combine(new, carry_static)

    return layer
