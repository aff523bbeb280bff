"""`Chain`: heterogeneous depth. Stacks of like layers and repeated patterns of
layers are scanned; the remaining layers are called directly. The grouping is
chosen by `_grouping.py`."""

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, overload, SupportsIndex, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray, PyTree

from ..._helpers.checks import (
    CarryError,
    check_bool,
    check_index,
    Checked,
    describe,
    first_difference,
    noted,
    split_key,
)
from ..._helpers.stateful import find_state, get_arg, replace_arg, state_pair
from ..._scan.buffers import (
    find_buffer,
    LayerBuffers,
    Place,
    view_of,
    with_view,
)
from ..._scan.drop_rates import DropRates, new_drop_rates, Rates, rates_of
from ..._scan.eager_compile import compiled_when_eager

# Chain hands its layers their inputs through the layer-call seam: a lone
# layer is run as layer `start` of the chain's call, a scanned group gets the
# call of its layers (`LayerCall.part`), and a repeated pattern's layers the
# inner call of their repeat (`LayerCall.inner`).
from ..._scan.layer_call import (
    carry_only,
    check_method,
    check_per_layer,
    LayerCall,
    Method,
    OneLayer,
    pairs,
    run_one,
    Unit,
)
from ..._scan.options import OwnOptions, ScanArgs, Scanning, ScanOptions
from ..stacked import (
    dropping_call,
    LayerNumbering,
    scan_layers,
    Stacked,
    StateDictFn,
)
from .explain import explain, warn_identity
from .grouping import Plan, plan, stack_classes


class Placement(NamedTuple):
    """Where a group of a [`eqxscan.Chain`][] sits: layers `start` to
    `start + size - 1`, and how it is scanned: `per_step` layers per scan step,
    `0` for a lone layer (not scanned), `1` for a stack of like layers, and
    `K >= 2` for a pattern of `K` layers repeated `size // K` times."""

    start: int
    size: int
    per_step: int


def _assemble(
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
            repeats = []
            for p in range(0, size, per_step):
                repeat = chunk[p : p + per_step]
                inner, inner_layout = _assemble(repeat, pattern, options)
                repeats.append(Pattern(inner, inner_layout, per_step))
            groups.append(Stacked.from_layers(repeats, **options.as_args()))
        layout.append(Placement(start, size, per_step))
        start += size
    return tuple(groups), tuple(layout)


def _unstack(groups: tuple[Any, ...], layout: tuple[Placement, ...]) -> list[Any]:
    layers: list[Any] = []
    for group, place in zip(groups, layout):
        if place.per_step == 0:
            layers.append(group)
        elif place.per_step == 1:
            layers.extend(group.unstack())
        else:
            for repeat in group.unstack():
                layers.extend(repeat.unstack())
    return layers


def _set_options(
    groups: tuple[Any, ...], layout: tuple[Placement, ...], options: ScanOptions
) -> tuple[Any, ...]:
    """`groups` with `options` set on every scanned group, those inside repeated
    patterns included; other fields (e.g. `layer_sharding`) and lone layers are
    kept."""
    new = []
    for group, place in zip(groups, layout):
        if place.per_step > 1:
            pattern = group.layers
            inner = _set_options(pattern.groups, pattern.layout, options)
            group = eqx.tree_at(lambda s: s.layers.groups, group, inner)
        if place.per_step > 0:
            group = group.with_options(**options.as_args())
        new.append(group)
    return tuple(new)


def _group_name(group: Any, place: Placement) -> str:
    if place.per_step == 0:
        return f"layer {place.start} ({type(group).__name__})"
    last = place.start + place.size - 1
    if place.per_step == 1:
        name = type(group.layers).__name__
        return f"layers {place.start}-{last} (stack of {name}, scanned)"
    pattern = ", ".join(group.layers.class_names())
    return (
        f"layers {place.start}-{last} ({place.size // place.per_step} repeats of "
        f"pattern [{pattern}], scanned)"
    )


#: How `Chain.scan` reads each layer's output.
CHAIN_PAIRS = pairs("Chain.scan")


def _run_repeat(call: LayerCall) -> Unit:
    """How one repeat of a pattern runs, within the chain's `call`: its
    layers in the chain's direction, with the chain's method, each given its
    slice of the repeat's inputs (its key, drop inputs and `per_layer`
    slices). Returns what a layer would: the carry, or `(carry, ys)`."""
    reads_pairs = call.read_out is not carry_only

    def run(repeat: object, x: PyTree, one: OneLayer) -> PyTree:
        assert isinstance(repeat, Pattern)
        inner = call.inner(one)
        x, ys = run_groups(repeat.groups, repeat.layout, x, inner, "Pattern")
        return (x, ys) if reads_pairs else x

    return run


def _call_group(
    group: Any, place: Placement, x: PyTree, call: LayerCall
) -> tuple[PyTree, PyTree]:
    """Run one group; `ys` (when reading pairs) has a leading axis of `place.size`."""
    if place.per_step == 0:
        who = _group_name(group, place)
        x, y = run_one(group, call, call.at(place.start), x, who)
        return x, jtu.tree_map(lambda a: a[None] if eqx.is_array(a) else a, y)
    group_call = call.part(place.start, place.size, place.per_step)
    if place.per_step > 1:
        group_call = group_call._replace(unit=_run_repeat(call))
    last = place.start + place.size - 1
    with jax.named_scope(f"layers_{place.start}-{last}"):  # the group, in profiles
        x, ys = scan_layers(group, x, group_call)
    if place.per_step > 1 and ys is not None:
        ys = jtu.tree_map(
            lambda a: a.reshape(place.size, *a.shape[2:]) if eqx.is_array(a) else a,
            ys,
        )
    return x, ys


def _bodies(layout: tuple[Placement, ...], groups: tuple[Any, ...]) -> int:
    """How many layer bodies a grouping traces (a pattern's own, once)."""
    return sum(
        _bodies(g.layers.layout, g.layers.groups) if s.per_step > 1 else 1
        for g, s in zip(groups, layout)
    )


def _join(pieces: list[tuple[Any, Placement, PyTree]]) -> PyTree:
    """Concatenate the groups' `ys` along the layer axis."""
    if all(ys is None for _, _, ys in pieces):
        return None
    first_group, first_place, first = pieces[0]
    for group, place, ys in pieces[1:]:
        a = jtu.tree_map(lambda a: a[0] if eqx.is_array(a) else a, first)
        b = jtu.tree_map(lambda a: a[0] if eqx.is_array(a) else a, ys)
        diff = first_difference(a, b) if ys is not None and first is not None else None
        if ys is None or first is None or diff is not None:
            path, da, db = diff or ("", describe(first), describe(ys))
            raise TypeError(
                f"Chain.scan stacks every layer's y, so they must agree, but at "
                f"`y{path}` {_group_name(first_group, first_place)} gave {da} and "
                f"{_group_name(group, place)} gave {db}."
            )
    if len(pieces) == 1:
        return first
    return jtu.tree_map(
        lambda *a: jnp.concatenate(a) if eqx.is_array(a[0]) else a[0],
        *(ys for _, _, ys in pieces),
    )


def check_chain_buffers(tree: PyTree, chain: "Chain") -> LayerBuffers:
    """`tree` (a `Chain`'s buffer), checked to hold one buffer per group."""
    if not isinstance(tree, LayerBuffers) or tree.layout != places(
        chain.groups, chain.layout
    ):
        got = (
            f"LayerBuffers of another chain's {len(tree.groups)} groups"
            if isinstance(tree, LayerBuffers)
            else describe(tree)
        )
        raise TypeError(
            f"A Chain's eqxscan.buffer holds each of its {len(chain.groups)} "
            f"groups' buffers, but it wraps {got}.\nBuild it with "
            "eqxscan.layer_buffers(chain, make) for this chain."
        )
    return tree


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
    if isinstance(method, str):
        for layer in _kinds(groups, layout):
            check_method(method, layer)
    else:
        check_method(method, None)


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
        where = f"{owner} {_group_name(group, place)}{changed}"
        group_call = call
        if view is not None and at is not None and trees is not None:
            args, kwargs = with_view(call.args, call.kwargs, at, view.of(trees[k]))
            group_call = call._replace(args=args, kwargs=kwargs)
        try:
            new_x, ys = noted(_call_group, where, group, place, x, group_call)
            if trees is not None:
                new_x, trees[k] = new_x
        except CarryError as e:
            # The group changed the carry itself: its headline names it (by the
            # layer's index in the chain when the loop knows which one).
            name = _group_name(group, place)
            if place.per_step == 1 and e.step is not None:
                name = f"layer {place.start + e.step} ({type(group.layers).__name__})"
            e.args = (f"{owner} {name} {e.what}",)
            raise
        if state_at is not None:
            # A stateful fold: every group returns `(x, state)`, and the next
            # one is called with the new state.
            new_x, state = state_pair(new_x, _group_name(group, place))
            args, kwargs = replace_arg(call.args, call.kwargs, state_at, state)
            call = call._replace(args=args, kwargs=kwargs)
        if place.per_step == 0:
            diff = first_difference(x, new_x)
            if diff is not None:
                path, before, after = diff
                changed = (
                    f", whose carry `carry{path}` is {after}, changed from {before} "
                    f"by {_group_name(group, place)}"
                )
        x = new_x
        pieces.append((group, place, ys))
    if state_at is not None:
        return (x, get_arg(call.args, call.kwargs, state_at)), None
    if call.reverse:
        pieces.reverse()  # ys in layer order, whatever the direction
    ys = _join(pieces) if call.read_out is not carry_only else None
    return (x if trees is None else (x, tuple(trees))), ys


def _name_groups(
    groups: tuple[Any, ...],
    layout: tuple[Placement, ...],
    fn: StateDictFn,
    offset: LayerNumbering,
    axes: tuple[int, ...],
) -> tuple[Any, ...]:
    """`groups` (of a chain, or of one repeat of a pattern) with `fn`
    applied to what each holds, each layer named by its index in the chain.
    `offset` numbers this sequence's layers (its first layer's index, and the
    strides of the repeat axes `axes` in front of its arrays)."""
    new = []
    for group, place in zip(groups, layout):
        first = offset.start + place.start
        if place.per_step == 0:
            new.append(fn(group, LayerNumbering(first, offset.strides), axes))
        elif place.per_step == 1:
            index = LayerNumbering(first, offset.strides + (1,))
            layers = fn(group.layers, index, axes + (place.size,))
            new.append(eqx.tree_at(lambda s: s.layers, group, layers))
        else:
            pattern = group.layers
            repeats = LayerNumbering(first, offset.strides + (place.per_step,))
            inner = axes + (place.size // place.per_step,)
            named = _name_groups(pattern.groups, pattern.layout, fn, repeats, inner)
            new.append(eqx.tree_at(lambda s: s.layers.groups, group, named))
    return tuple(new)


def _kinds(groups: tuple[Any, ...], layout: tuple[Placement, ...]) -> list[Any]:
    """One layer (or stacked layers) of each kind in the groups."""
    kinds = []
    for group, place in zip(groups, layout):
        if place.per_step == 0:
            kinds.append(group)
        elif place.per_step == 1:
            kinds.append(group.layers)
        else:
            kinds.extend(_kinds(group.layers.groups, group.layers.layout))
    return kinds


class Pattern(eqx.Module):
    """One repeat of a pattern inside a [`eqxscan.Chain`][]: `K` layers run in
    order. Stacks of like layers within the pattern are scanned too, so a
    pattern like `local x5, global` traces two layer bodies.

    A `Chain` stacks the repeats as a `Stacked` of `Pattern`s and scans over them,
    one repeat per step, calling the stack with a `method=` that runs a repeat's
    layers with the chain's per-call options (direction, method, keys and
    whether layers return `(carry, y)` pairs).
    """

    groups: tuple[Any, ...]
    layout: tuple[Placement, ...] = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)

    def class_names(self) -> list[str]:
        """The class name of each of the `K` layers (also right for a stacked
        `Pattern`, whose arrays have a repeat axis)."""
        return [
            type(group if place.per_step == 0 else group.layers).__name__
            for group, place in zip(self.groups, self.layout)
            for _ in range(1 if place.per_step == 0 else place.size)
        ]

    def unstack(self) -> list[Any]:
        """The `K` layers of this repeat."""
        return _unstack(self.groups, self.layout)

    def __call__(
        self,
        x: PyTree,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        **kwargs: PyTree,
    ) -> PyTree:
        """Run the `K` layers in order, as a `Chain` of them runs (`key` split
        into `K`, `per_layer` arguments with leading axis `K`)."""
        keys = (
            None
            if key is None
            else split_key(key, self.num_layers, type(self).__name__)
        )
        call = LayerCall(args, kwargs, keys, caller="Chain")
        return run_groups(self.groups, self.layout, x, call, "Pattern")[0]


class Chain(Scanning):
    """A sequence of layers that are not all alike, run as a fold with as few
    traced layer bodies as possible.

    The layers are cut into groups, each handled as one:

    - A stack: consecutive layers with identical structure, static fields,
      non-array leaves, shapes and dtypes become one [`eqxscan.Stacked`][]
      (one scanned body, one layer per step).
    - A repeated pattern of different layers (`A, B, A, B, ...`, or
      `local, local, global` repeated) becomes a `Stacked` of `Pattern`s: one
      scan step runs one repeat of the pattern, so the program does not grow
      with the number of repeats. Layers left over before or after the repeats
      are grouped the same way.
    - A lone layer: any other layer, called directly.

    Among all groupings the chain picks the one that traces the fewest layer
    bodies, then the one with the fewest groups (counting groups inside a
    pattern); ties go to the grouping whose earliest group covers the most
    layers. The result is in `chain.groups` (a stack or a repeated pattern
    appears as a `Stacked`, a lone layer as itself) and `chain.layout` (one
    `Placement(start, size, per_step)` per group).

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
    layout: tuple[Placement, ...] = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    options: ScanOptions
    patterns: bool = eqx.field(static=True)
    drop_rates: DropRates | None

    def __init__(
        self,
        layers: Sequence[Any],
        *,
        patterns: bool = True,
        drop_path: Checked[Rates] = 0.0,
        layer_drop: Checked[Rates] = 0.0,
        **options: Unpack[ScanArgs],
    ):
        """**Arguments:**

        - `layers`: a non-empty list (or tuple) of layers, each called as
          `layer(x, *args, **kwargs)` and returning the new carry.
        - `mode`, `remat`, `unroll`: as for [`eqxscan.Stacked`][], used for
          every scanned group.
        - `patterns`: also find repeated patterns of different layers
          (default). With `False`, only stacks of like layers are scanned.
        - `drop_path`, `layer_drop`: stochastic depth and LayerDrop while
          training, as for [`eqxscan.Stacked`][], with one rate per layer of the
          chain (`eqxscan.linear_rates` rises over all `len(chain)` layers);
          lone layers and scanned groups drop alike. Changed afterwards with
          `chain.with_options(drop_path=..., layer_drop=...)`, which keeps
          `eqx.nn.inference_mode` as set.

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
        self.options = ScanOptions(**options)
        patterns = check_bool("patterns", patterns)
        labels = stack_classes(layers)
        warn_identity(layers, labels)
        groups_plan = plan(labels, patterns)
        self.groups, self.layout = _assemble(layers, groups_plan, self.options)
        self.num_layers = len(layers)
        self.patterns = patterns
        self.drop_rates = new_drop_rates(len(layers), drop_path, layer_drop)

    def __len__(self) -> int:
        return self.num_layers

    def __iter__(self) -> Iterator[Any]:
        """The layers in order, as `eqx.nn.Sequential` iterates."""
        return iter(self.unstack())

    @overload
    def __getitem__(self, index: slice) -> "Chain": ...

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...

    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        """`chain[i]` is layer `i` of the list the chain was built from (negative
        allowed), whatever group holds it; `chain[i:j]` (any slice) is a `Chain`
        of those layers with the same options, grouped afresh (its scanned
        groups are new stacks, and `layer_sharding` is not carried over)."""
        if isinstance(index, slice):
            layers = self.unstack()[index]
            if not layers:
                raise ValueError(
                    f"Slice {index} selects no layers of a Chain with "
                    f"{self.num_layers} layers; a Chain needs at least one."
                )
            if self.drop_rates is None:
                return Chain(layers, patterns=self.patterns, **self.options.as_args())
            drop = self.drop_rates.sliced(index)
            chain = Chain(
                layers,
                patterns=self.patterns,
                drop_path=drop.drop_path,
                layer_drop=drop.layer_drop,
                **self.options.as_args(),
            )
            if chain.drop_rates is None:
                return chain
            inference = self.drop_rates.inference
            return eqx.tree_at(lambda c: c.drop_rates.inference, chain, inference)
        i = check_index(
            index,
            self.num_layers,
            "Chain",
            "mark it static, or index `chain.unstack()`.",
        )
        for group, place in zip(self.groups, self.layout):
            offset = i - place.start
            if not 0 <= offset < place.size:
                continue
            if place.per_step == 0:
                return group
            if place.per_step == 1:
                return group[offset]
            repeat = group[offset // place.per_step]
            return repeat.unstack()[offset % place.per_step]
        raise AssertionError("unreachable: the layout covers every layer")

    def unstack(self) -> list[Any]:
        """The layers as the list the chain was built from."""
        return _unstack(self.groups, self.layout)

    def state_dict_layers(self, fn: StateDictFn) -> "Chain":
        """How [`eqxscan.to_state_dict`][] names this chain's arrays: by each
        layer's index in the chain, whatever its grouping, so layer 3's `weight`
        is `"<prefix>.3.weight"`, as for a list or a `Stacked` of the layers.

        **Arguments:**

        - `fn`: applied to each lone layer as `fn(layer, LayerNumbering(i, ()), ())`,
          to a stack's stacked layers as
          `fn(layers, LayerNumbering(start, (1,)), (size,))`, and to the layers of
          a repeated pattern with the repeat axis in front (stride `K`).

        **Returns:**

        This chain, grouped as it is, with those subtrees replaced by what `fn`
        returned.
        """
        groups = _name_groups(self.groups, self.layout, fn, LayerNumbering(0, ()), ())
        return eqx.tree_at(lambda c: c.groups, self, groups)

    def explain(self) -> str:
        """How the layers were grouped, and why each lone layer was not scanned
        with a neighbour (the leaf path where they differ, and both values).

        **Returns:**

        Text with one line per group, e.g. ``layer 3 (Linear): alone, unlike
        layer 2 (Linear) at `.weight`: it has float16[8,8], layer 2 has
        float32[8,8]``.
        """
        layers = self.unstack()
        names = [_group_name(g, s) for g, s in zip(self.groups, self.layout)]
        return explain(layers, self.layout, names, _bodies(self.layout, self.groups))

    def own_options(self) -> tuple[str, ...]:
        return ("drop_path", "layer_drop")

    def replace_options(
        self, options: ScanOptions, **own: Unpack[OwnOptions]
    ) -> "Chain":
        # The same grouping, with `options` on every scanned group; each keeps its
        # `layer_sharding` (as set by `eqxscan.sharding.shard`).
        groups = _set_options(self.groups, self.layout, options)
        chain = eqx.tree_at(lambda c: (c.groups, c.options), self, (groups, options))
        if not own:
            return chain
        drop_path, layer_drop = rates_of(self.drop_rates)
        drop = new_drop_rates(
            self.num_layers,
            own.get("drop_path", drop_path),
            own.get("layer_drop", layer_drop),
        )
        if drop is not None and self.drop_rates is not None:
            # Kept as slicing keeps it: `eqx.nn.inference_mode` still holds.
            drop = eqx.tree_at(lambda d: d.inference, drop, self.drop_rates.inference)
        return eqx.tree_at(
            lambda c: c.drop_rates, chain, drop, is_leaf=lambda n: n is None
        )

    @compiled_when_eager
    def __call__(
        self,
        x: PyTree,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        method: Method | None = None,
        reverse: bool = False,
        **kwargs: PyTree,
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
        - `method`: run this instead of each layer's `__call__`, as for
          [`eqxscan.Stacked.__call__`][]: a function `fn(layer, x, ...)` or a
          method name every layer has.
        - `reverse`: run the last layer first and layer `0` last; scanned groups
          read their weights backwards (no copy), and layer `i` keeps `keys[i]`
          and its `per_layer` slice.

        **Returns:**

        The final carry.

        **Raises:**

        An error raised by a layer carries a note naming the layer and, when an
        earlier layer changed the carry, the leaf path and both shapes/dtypes.
        """
        reverse = check_bool("reverse", reverse)
        return self._fold(x, args, kwargs, key, False, reverse, method)[0]

    @compiled_when_eager
    def scan(
        self,
        x: PyTree,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        method: Method | None = None,
        reverse: bool = False,
        **kwargs: PyTree,
    ) -> tuple[PyTree, PyTree]:
        """Like `__call__`, but each layer returns `(new_x, y_i)`.

        **Returns:**

        `(final carry, ys)` with the `y_i` of all `len(chain)` layers stacked
        leaf by leaf on axis 0 (`None` if layers return `(x, None)`); every
        layer's `y_i` must have the same structure, shapes and dtypes. `ys[i]`
        is layer `i`'s, also with `reverse=True`.
        """
        reverse = check_bool("reverse", reverse)
        return self._fold(x, args, kwargs, key, True, reverse, method)

    def _fold(
        self,
        x: PyTree,
        args: tuple,
        kwargs: dict[str, object],
        key: PRNGKeyArray | None,
        pairs: bool,
        reverse: bool,
        method: Method | None,
    ) -> tuple[PyTree, PyTree]:
        check_per_layer(args, kwargs, self.num_layers)
        at = find_buffer(args, kwargs)
        tree = None
        if at is not None:
            if find_state(args, kwargs) is not None:
                raise TypeError(
                    "A Chain call takes an eqx.nn.State or an eqxscan.buffer, "
                    "not both.\nKeep per-layer state in the buffer."
                )
            # Group `k`'s buffer is `groups[k]` (see layer_buffers).
            given = view_of(args, kwargs, at)
            tree = check_chain_buffers(given.tree, self)
            args, kwargs = with_view(args, kwargs, at, given.of(tree.groups))
        if pairs and find_state(args, kwargs):
            raise TypeError(
                "Chain.scan does not take an eqx.nn.State; call the chain instead: "
                "`x, state = chain(x, state)`."
            )
        check_chain_method(self.groups, self.layout, method)
        keys = (
            None
            if key is None
            else split_key(key, self.num_layers, type(self).__name__)
        )
        read_out = CHAIN_PAIRS if pairs else carry_only
        call = LayerCall(args, kwargs, keys, read_out, reverse, method, caller="Chain")
        # Drop inputs are per layer (global layer indices), routed to the groups
        # with everything else per layer.
        call = dropping_call(self.drop_rates, call, key, "Chain")
        out, ys = run_groups(self.groups, self.layout, x, call, "Chain")
        if tree is not None:
            out = (out[0], LayerBuffers(out[1], tree.layout))
        return out, ys
