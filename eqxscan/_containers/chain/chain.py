"""`Chain`: heterogeneous depth, its layers grouped by `grouping.py` into groups
that `groups.py` builds and runs."""

from collections.abc import Iterator, Sequence
from typing import Any, overload, SupportsIndex, Unpack

import equinox as eqx
from jaxtyping import PRNGKeyArray, PyTree

from ..._helpers.checks import check_bool, check_index, Checked, describe, split_key
from ..._helpers.constrain import is_none
from ..._helpers.stackable import check_state_order, holds_state
from ..._helpers.stateful import find_state, replace_arg
from ..._scan.buffers import check_keeps_writes, find_buffer, LayerBuffers, view_of
from ..._scan.drop_rates import DropRates, new_drop_rates, Rates, rates_of, with_mode_of
from ..._scan.eager_compile import compiled_when_eager
from ..._scan.layer_call import (
    carry_only,
    check_per_layer,
    check_reverse_free,
    LayerCall,
    Method,
    pairs,
)
from ..._scan.options import OwnOptions, ScanArgs, Scanning, ScanOptions
from ..stack_calls import dropping_call
from ..stacked import LayerNumbering, StateDictFn
from .grouping import plan, stack_classes, warn_identity, why_alone
from .groups import (
    assemble,
    bodies,
    check_chain_method,
    group_name,
    name_groups,
    Placement,
    places,
    run_groups,
    set_options,
    unstack_groups,
)


class Chain(Scanning):
    """A sequence of layers that are not all alike, run as a fold with as few
    traced layer bodies as possible.

    The layers are cut into groups, each handled as one:

    - A stack: consecutive layers with identical structure, static fields,
      non-array leaves, shapes and dtypes (weak types included) become one
      [`eqxscan.Stacked`][] (one scanned body, one layer per step).
    - A repeated pattern of different layers (`A, B, A, B, ...`, or
      `local, local, global` repeated) becomes a `Stacked` of `Pattern`s, one
      repeat per scan step, so the program does not grow with the repeats.
      Layers left over before or after are grouped the same way.
    - A lone layer: any other layer, called directly.

    The chain picks the grouping that traces the fewest layer bodies, then the
    fewest groups (counting those inside a pattern), then the one whose earliest
    group covers the most layers. `chain.groups` holds the groups (a stack or
    pattern as a `Stacked`, a lone layer as itself) and `chain.layout` one
    `Placement(start, size, per_step)` per group.

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
        assert jnp.allclose(chain(x), eqx.nn.Sequential(layers)(x), atol=1e-5)
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
          `layer(x, *args, **kwargs)` and returning the new carry (an empty
          sequence is a `ValueError`, any other type a `TypeError`).
        - `mode`, `remat`, `unroll`: as for [`eqxscan.Stacked`][], used for
          every scanned group.
        - `patterns`: also find repeated patterns of different layers
          (default). With `False`, only stacks of like layers are scanned.
        - `drop_path`, `layer_drop`: as for [`eqxscan.Stacked`][], one rate per
          layer of the chain (`eqxscan.linear_rates` rises over all `len(chain)`
          layers), lone layers and scanned groups alike; `with_options` changes
          them and keeps `eqx.nn.inference_mode` as set.
        """
        if not isinstance(layers, (list, tuple)):
            raise TypeError(
                f"Chain takes a list or tuple of layers, got {type(layers).__name__}."
            )
        if len(layers) == 0:
            raise ValueError("Chain needs at least one layer, got an empty sequence.")
        own = ("patterns", "drop_path", "layer_drop")
        self.options = ScanOptions.given("Chain", options, own)
        self.patterns = check_bool("patterns", patterns)
        labels = stack_classes(layers)
        warn_identity(layers, labels)
        groups_plan = plan(labels, self.patterns)
        self.groups, self.layout = assemble(layers, groups_plan, self.options)
        self.num_layers = len(layers)
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
            # A lone layer's state is its own; a scanned group's is in its order.
            scanned = [g for g, p in zip(self.groups, self.layout) if p.per_step]
            check_state_order(scanned, index, self.num_layers, "Chain")
            if len(layers) < self.num_layers and holds_state(scanned):
                raise ValueError(
                    f"Cannot take {index} of a Chain whose scanned groups hold "
                    "stateful layers (an eqx.nn.StateIndex): the slice groups its "
                    "layers afresh, but their eqx.nn.State keeps the whole Chain's "
                    "groups, so no state fits it.\nHint: take single layers "
                    "(`chain[i]`) with their slice of the state, or make the "
                    "sub-chain from new layers with `eqx.nn.make_with_state`."
                )
            drop = None if self.drop_rates is None else self.drop_rates.sliced(index)
            chain = Chain(layers, patterns=self.patterns, **self.options.as_args())
            return chain._with_rates(*rates_of(drop), like=self.drop_rates)
        i = check_index(
            index,
            self.num_layers,
            "Chain",
            "mark it static, or index `chain.unstack()`.",
        )
        k = max(j for j, p in enumerate(self.layout) if p.start <= i)
        group, place = self.groups[k], self.layout[k]
        offset = i - place.start
        if place.per_step == 0:
            return group
        if place.per_step == 1:
            return group[offset]
        return group[offset // place.per_step].unstack()[offset % place.per_step]

    def unstack(self) -> list[Any]:
        """The layers as the list the chain was built from."""
        return unstack_groups(self.groups, self.layout)

    def state_dict_layers(self, fn: StateDictFn) -> "Chain":
        """Names layer 3's `weight` `"<prefix>.3.weight"` in a state dict, as for a
        list of the layers, whatever the grouping: `fn` replaces each lone layer,
        stack's layers and pattern's layers (repeat axis in front, stride `K`)."""
        groups = name_groups(self.groups, self.layout, fn, LayerNumbering(0, ()), ())
        return eqx.tree_at(lambda c: c.groups, self, groups)

    def explain(self) -> str:
        """How the layers were grouped, and why each lone layer was not scanned
        with a neighbour: text with one line per group, e.g. ``layer 3 (Linear):
        alone, unlike layer 2 (Linear) at `.weight`: it has float16[8,8], layer
        2 has float32[8,8]`` (the leaf path where they differ, and both values).
        """
        layers, n, count = self.unstack(), self.num_layers, len(self.layout)
        traced = len(bodies(self.groups, self.layout))
        lines = [
            f"Chain of {n} layer{'s' * (n != 1)} in {count} group{'s' * (count != 1)}, "
            f"tracing {traced} layer bod{'ies' if traced != 1 else 'y'}:"
        ]
        for group, place in zip(self.groups, self.layout):
            name, i = group_name(group, place), place.start
            if place.per_step == 0:
                js = [j for j in (i - 1, i + 1) if 0 <= j < n]
                why = "; ".join(why_alone(layers, j, i) for j in js) or "the only layer"
                name += f": alone, {why}"
            lines.append(f"  {name}")
        return "\n".join(lines)

    def own_options(self) -> tuple[str, ...]:
        return ("drop_path", "layer_drop")

    def replace_options(
        self, options: ScanOptions, **own: Unpack[OwnOptions]
    ) -> "Chain":
        # The same grouping, with `options` on every scanned group; each keeps its
        # `layer_sharding` (as set by `eqxscan.sharding.shard`).
        groups = set_options(self.groups, self.layout, options)
        chain = eqx.tree_at(lambda c: (c.groups, c.options), self, (groups, options))
        if not own:
            return chain
        path, drop = rates_of(self.drop_rates)
        path, drop = own.get("drop_path", path), own.get("layer_drop", drop)
        return chain._with_rates(path, drop, like=self.drop_rates)

    def _with_rates(
        self,
        drop_path: Checked[Rates],
        layer_drop: Checked[Rates],
        like: DropRates | None,
    ) -> "Chain":
        # This chain with these rates, in the inference mode of `like`.
        drop = new_drop_rates(self.num_layers, drop_path, layer_drop)
        drop = with_mode_of(drop, like)
        return eqx.tree_at(lambda c: c.drop_rates, self, drop, is_leaf=is_none)

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
        - `*args`, `**kwargs`, `key`, `method`, `reverse`: as for
          [`eqxscan.Stacked.__call__`][], over all `len(chain)` layers whatever
          the grouping: layer `i` gets slice `i` of each [`eqxscan.per_layer`][]
          value and `key=keys[i]`; a `method` name must be a method of every
          layer; with `reverse`, scanned groups read their weights backwards.

        **Returns:**

        The final carry. An error raised by a layer carries a note naming the
        layer and, when an earlier layer changed the carry, the leaf path and
        both shapes/dtypes.
        """
        call, tree = self._layer_call(args, kwargs, key, False, reverse, method)
        # The groups run from here: one frame less between this call and a layer.
        out, _ = run_groups(self.groups, self.layout, x, call, "Chain")
        return _with_buffers(out, tree)

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
        call, tree = self._layer_call(args, kwargs, key, True, reverse, method)
        out, ys = run_groups(self.groups, self.layout, x, call, "Chain")
        return _with_buffers(out, tree), ys

    def _layer_call(
        self,
        args: tuple,
        kwargs: dict[str, object],
        key: PRNGKeyArray | None,
        scan: bool,
        reverse: object,  # checked here, with a clear error
        method: Method | None,
    ) -> tuple[LayerCall, LayerBuffers | None]:
        """The call of the layers that a fold with these arguments makes, after
        checking them, and the chain's buffer if one is given (its groups'
        buffers in the call, for `_with_buffers` to wrap again)."""
        if reverse := check_bool("reverse", reverse):
            for layer in bodies(self.groups, self.layout):
                check_reverse_free(method, layer, "Chain")
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
            tree = given.tree
            if not isinstance(tree, LayerBuffers) or tree.layout != places(
                self.groups, self.layout
            ):
                got = (
                    f"LayerBuffers of another chain's {len(tree.groups)} groups"
                    if isinstance(tree, LayerBuffers)
                    else describe(tree)
                )
                raise TypeError(
                    f"A Chain's eqxscan.buffer holds each of its {len(self.groups)} "
                    f"groups' buffers, but it wraps {got}.\nBuild it with "
                    "eqxscan.layer_buffers(chain, make) for this chain."
                )
            args, kwargs = replace_arg(args, kwargs, at, given.of(tree.groups))
        if scan and find_state(args, kwargs) is not None:
            raise TypeError(
                "Chain.scan does not take an eqx.nn.State; call the chain instead: "
                "`x, state = chain(x, state)`."
            )
        check_chain_method(self.groups, self.layout, method)
        keys = key if key is None else split_key(key, self.num_layers, "Chain")
        read_out = pairs("Chain.scan") if scan else carry_only
        call = LayerCall(args, kwargs, keys, read_out, reverse, method, caller="Chain")
        # Drop inputs are per layer (by layer number), routed to the groups
        # with everything else per layer.
        call = dropping_call(self.drop_rates, call, key, "Chain")
        if tree is not None:
            check_keeps_writes(
                "This Chain", call.drop is not None or call.runs is not None
            )
        return call, tree


def _with_buffers(out: PyTree, tree: LayerBuffers | None) -> PyTree:
    """A fold's final carry; with a buffer, `(carry, the chain's buffer)` from
    the groups' updated buffers."""
    if tree is None:
        return out
    return (out[0], LayerBuffers(out[1], tree.layout, tree.ndims))
