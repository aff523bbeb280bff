"""`Stacked`: L layers of one kind stored as one module with a leading layer axis."""

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex

import equinox as eqx
import jax
import jax.random as jr
import jax.tree_util as jtu
from jax.sharding import Sharding
from jaxtyping import PRNGKeyArray, PyTree

from ._alike import check_alike, stack_alike
from ._checks import (
    check_callable,
    check_leading_axis,
    check_size,
    check_takes_key,
    describe,
)
from ._constrain import check_layer_sharding, constrain
from ._engine import check_options, run
from ._stateful import find_state, get_arg, layer_state, replace_arg, state_pair


class PerLayer(eqx.Module):
    """An argument sliced along the layer axis: layer `i` receives slice `i` of
    every array leaf. Build it with [`eqxscan.per_layer`][]."""

    tree: PyTree


def per_layer(tree: PyTree) -> PerLayer:
    """Mark `tree` as a per-layer argument of a [`eqxscan.Stacked`][] call.

    Every array leaf must have the layer axis (length `L`) first; layer `i` is
    called with slice `i`. Non-array leaves are passed to every layer unchanged.
    Use it positionally or as a keyword value, e.g. for per-layer KV caches:
    `stack(x, cache=eqxscan.per_layer(caches))`.

    **Arguments:**

    - `tree`: any pytree whose array leaves have shape `(L, ...)`.

    **Returns:**

    A marker wrapping `tree`.
    """
    return PerLayer(tree)


_MISSING: Any = object()


def _arg_name(index_or_name: int | str) -> str:
    if isinstance(index_or_name, int):
        return f"args[{index_or_name}]"
    return f"kwargs[{index_or_name!r}]"


def check_per_layer(args: tuple, kwargs: dict, length: int) -> dict[str, PerLayer]:
    """The [`eqxscan.per_layer`][] arguments of a call, by name (`args[0]`,
    `kwargs['cache']`), after checking that their array leaves have leading axis
    `length`."""
    named = [(_arg_name(i), a) for i, a in enumerate(args)]
    named += [(_arg_name(n), v) for n, v in kwargs.items()]
    found = {}
    for name, value in named:
        if isinstance(value, PerLayer):
            check_leading_axis(value.tree, length, f"per_layer {name}", "layer")
            found[name] = value
    return found


def stack_layers(layers: Sequence[Any], what: str = "Stacked.from_layers") -> Any:
    """Stack layers that can share one body leaf by leaf on a new axis 0 (layers
    that differ only by identity share the first one's objects)."""
    layers = list(layers)
    check_alike(layers, what)
    return stack_alike(layers)


def _check_make_layer(make_layer: Any) -> None:
    if isinstance(make_layer, eqx.Module):
        raise TypeError(
            f"make_layer must be a function that builds one layer from a key, but "
            f"got a {type(make_layer).__name__} instance (a layer, not a way to "
            f"make one). Pass e.g. `lambda k: {type(make_layer).__name__}(..., "
            "key=k)`."
        )
    check_callable("make_layer", make_layer)


def _check_made(layers: Any) -> None:
    if eqx.is_array(layers):
        one = jax.ShapeDtypeStruct(layers.shape[1:], layers.dtype)
        raise TypeError(
            f"make_layer returned an array ({describe(one)}), not a layer. It must "
            "return a module (e.g. an `eqx.Module`) that is called as `layer(x)`."
        )


class Stacked(eqx.Module):
    """`L` layers of one kind, stored as one module whose array leaves have a
    leading layer axis, and run with `jax.lax.scan` (or a Python loop).

    Stacking is a storage layout, not weight sharing: layer `i` has its own
    weights, `stack.layers.weight[i]`.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(8, 8, key=k), 4, key=jax.random.key(0)
        )
        y = stack(jnp.ones(8))          # layer(x) -> new x, four times
        assert stack.layers.weight.shape == (4, 8, 8)
        ```
    """

    layers: Any
    num_layers: int = eqx.field(static=True)
    mode: str = eqx.field(static=True)
    checkpoint: Any = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True)
    layer_sharding: Sharding | None = eqx.field(static=True)

    def __init__(
        self,
        make_layer: Callable[[PRNGKeyArray], Any],
        num_layers: SupportsIndex,
        *,
        key: PRNGKeyArray,
        mode: str = "scan",
        checkpoint: Any = "auto",
        unroll: int | bool = 1,
    ):
        """**Arguments:**

        - `make_layer`: builds one layer from a key. It is run once under
          `eqx.filter_vmap`, so layer `i` is exactly
          `make_layer(jax.random.split(key, num_layers)[i])`.
        - `num_layers`: `L >= 1`.
        - `key`: a JAX PRNG key.
        - `mode`: `"scan"` (`jax.lax.scan`, one traced body) or `"loop"` (a Python
          loop over the same weights: the reference and debugging path).
        - `checkpoint`: rematerialisation. `"auto"` (default: save matmul outputs,
          recompute elementwise work; fastest for training), `False` (save
          everything), `True` (`jax.checkpoint` around each layer), a
          `jax.checkpoint_policies` policy, or `"nested"` (two-level scan whose
          saved carries grow like `sqrt(L)`). All give the same values and
          gradients.
        - `unroll`: passed to `jax.lax.scan`.
        """
        num_layers = check_size("num_layers", num_layers)
        _check_make_layer(make_layer)
        check_options(mode, checkpoint, unroll)
        keys = jr.split(key, num_layers)
        self.layers = eqx.filter_vmap(make_layer)(keys)
        _check_made(self.layers)
        self.num_layers = num_layers
        self.mode = mode
        self.checkpoint = checkpoint
        self.unroll = unroll
        self.layer_sharding = None

    @classmethod
    def _build(
        cls,
        layers: Any,
        num_layers: int,
        mode: str,
        checkpoint: Any,
        unroll: Any,
        layer_sharding: Sharding | None = None,
    ) -> "Stacked":
        # Alternative constructor that bypasses `make_layer`.
        check_options(mode, checkpoint, unroll)
        check_layer_sharding(layer_sharding)
        self = object.__new__(cls)
        for name, value in (
            ("layers", layers),
            ("num_layers", num_layers),
            ("mode", mode),
            ("checkpoint", checkpoint),
            ("unroll", unroll),
            ("layer_sharding", layer_sharding),
        ):
            object.__setattr__(self, name, value)
        return self

    def _replace(self, **changes: Any) -> "Stacked":
        # A copy with `changes` applied and every other field kept, static options
        # (`layer_sharding` included) too: the one way to rebuild a Stacked.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return type(self)._build(**{**fields, **changes})

    @classmethod
    def from_layers(
        cls,
        layers: Sequence[Any],
        *,
        mode: str = "scan",
        checkpoint: Any = "auto",
        unroll: int | bool = 1,
    ) -> "Stacked":
        """Stack already-built layers (e.g. loaded from a per-layer checkpoint).

        **Arguments:**

        - `layers`: a non-empty sequence of layers with identical structure,
          static fields, shapes and dtypes.
        - `mode`, `checkpoint`, `unroll`: as for `__init__`.

        **Returns:**

        A `Stacked` whose `unstack()` gives the layers back exactly.

        **Raises:**

        `ValueError` naming the layer index, leaf path and both shapes/dtypes (or
        static values) when the layers cannot be stacked.
        """
        layers = list(layers)
        stacked = stack_layers(layers)
        return cls._build(stacked, len(layers), mode, checkpoint, unroll)

    def with_options(
        self,
        *,
        mode: str = _MISSING,
        checkpoint: Any = _MISSING,
        unroll: int | bool = _MISSING,
        layer_sharding: Sharding | None = _MISSING,
    ) -> "Stacked":
        """A copy with the same weights and new options; options not given are kept.

        **Arguments:**

        - `mode`, `checkpoint`, `unroll`: as for `__init__`.
        - `layer_sharding`: a `jax.sharding.Sharding` (or `None`, the default) that
          each scan step constrains its one layer's weights to before calling it.
          FSDP uses a replicated sharding here, so that a step all-gathers only
          the layer it runs; [`eqxscan.sharding.shard`][] sets it for you.

        **Returns:**

        A `Stacked` sharing this one's arrays.
        """
        options = dict(
            mode=mode,
            checkpoint=checkpoint,
            unroll=unroll,
            layer_sharding=layer_sharding,
        )
        return self._replace(**{k: v for k, v in options.items() if v is not _MISSING})

    def __len__(self) -> int:
        return self.num_layers

    def _check_layer_axis(self, what: str) -> None:
        # A batch of stacks (an ensemble made with `eqx.filter_vmap`) has its batch
        # axis in front of the layer axis; JAX would clamp an index into it, and
        # `lax.scan` would fail with a bare length error.
        for path, leaf in jtu.tree_leaves_with_path(self.layers):
            if eqx.is_array(leaf) and (
                leaf.ndim == 0 or leaf.shape[0] != self.num_layers
            ):
                raise ValueError(
                    f"Cannot {what} this Stacked: it has {self.num_layers} layers, "
                    f"but `layers{jtu.keystr(path)}` has shape {tuple(leaf.shape)}, "
                    "so its first axis is not the layer axis.\n"
                    "Call and index a batch of stacks (e.g. an ensemble built "
                    "with `eqx.filter_vmap`) inside `eqx.filter_vmap`: "
                    "`eqx.filter_vmap(lambda s, x: s(x))(stacks, xs)`, "
                    "`eqx.filter_vmap(lambda s: s[i])(stacks)`."
                )

    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        """`stack[i]` is layer `i` (negative allowed); `stack[i:j]` a `Stacked`."""
        self._check_layer_axis("index")
        if isinstance(index, slice):
            selected = range(self.num_layers)[index]
            if len(selected) == 0:
                raise ValueError(
                    f"Slice {index} selects no layers of a Stacked with "
                    f"{self.num_layers} layers; a Stacked needs at least one."
                )
            layers = jtu.tree_map(
                lambda a: a[index] if eqx.is_array(a) else a, self.layers
            )
            return self._replace(layers=layers, num_layers=len(selected))
        if isinstance(index, jax.core.Tracer):
            raise TypeError(
                "Stacked got a traced index (e.g. a jit argument). Indices must be "
                "concrete ints so they can be range-checked; JAX's own indexing "
                "would clamp an out-of-range one. Mark the index static (e.g. "
                "`jax.jit(..., static_argnums=...)`), or select the layer "
                "yourself: `jax.tree.map(lambda a: a[i] if eqx.is_array(a) else "
                "a, stack.layers)`."
            )
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"Stacked indices must be ints or slices, got {type(index).__name__}."
            ) from None
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(
                f"Layer index {i} is out of range for a Stacked with "
                f"{self.num_layers} layers."
            )
        i %= self.num_layers
        return jtu.tree_map(lambda a: a[i] if eqx.is_array(a) else a, self.layers)

    def unstack(self) -> list[Any]:
        """The layers as a list of ordinary (unstacked) modules."""
        return [self[i] for i in range(self.num_layers)]

    def with_layer(self, index: SupportsIndex, layer: Any) -> "Stacked":
        """A copy with layer `index` replaced by `layer` (layer surgery), every
        option kept. `eqx.tree_at(lambda s: s[i], ...)` cannot do this, since
        `stack[i]` is computed from the stacked arrays.

        **Arguments:**

        - `index`: the layer to replace (negative counts from the end).
        - `layer`: the new layer, checked as [`eqxscan.Stacked.from_layers`][]
          checks its layers: the same structure, static fields, shapes and
          dtypes as the others.

        **Returns:**

        A `Stacked` whose layer `index` is `layer` and whose other layers are this
        one's.

        **Raises:**

        `IndexError` for an index out of range; `ValueError` naming the leaf
        path and both values when `layer` cannot be stacked with the others.
        """
        current = self[index]  # checks the index
        i = operator.index(index) % self.num_layers
        check_alike(
            [current, layer],
            f"Stacked.with_layer({i}, ...)",
            names=(f"layer {i}", "the new layer"),
        )
        # By leaves: `layer` may differ from the others only by identity.
        old, treedef = jtu.tree_flatten(self.layers)
        new = [
            a.at[i].set(b) if eqx.is_array(a) else a
            for a, b in zip(old, jtu.tree_leaves(layer))
        ]
        return self._replace(layers=jtu.tree_unflatten(treedef, new))

    def __call__(
        self, x: PyTree, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> PyTree:
        """Fold `x` through the layers: `x = layer_i(x, *args, **kwargs)`.

        **Arguments:**

        - `x`: the carry, any pytree; every layer must return one of the same
          structure, shapes and dtypes.
        - `*args`, `**kwargs`: passed to every layer (broadcast), except values
          wrapped in [`eqxscan.per_layer`][], which are sliced per layer.
        - `key`: if given, split into `L` keys and layer `i` gets `key=keys[i]`.

        Stateful layers (Equinox's `layer(x, state) -> (x, state)`, e.g. with
        `eqx.nn.BatchNorm`) are called as Equinox calls them: pass the
        `eqx.nn.State` from `eqx.nn.make_with_state` as an argument and each
        layer gets its own slice of it; the call then returns `(x, state)`.

        **Returns:**

        The final carry (or `(carry, state)` when called with a state).
        """
        return self._run(x, args, kwargs, key, collect=False)[0]

    def scan(
        self, x: PyTree, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> tuple[PyTree, PyTree]:
        """Like `__call__`, but each layer returns `(new_x, y_i)`.

        **Returns:**

        `(final carry, ys)` with the `y_i` stacked leaf by leaf on axis 0
        (`None` if layers return `(x, None)`).
        """
        return self._run(x, args, kwargs, key, collect=True)

    def _run(
        self,
        x: Any,
        args: tuple,
        kwargs: dict,
        key: Any,
        collect: Any,
        keys: Any = None,
    ) -> tuple[Any, Any]:
        # `keys`: already-split per-layer keys (leading axis L), used instead of
        # splitting `key`; `Chain` hands each group its slice of one split.
        self._check_layer_axis("call")
        state_at = find_state(args, kwargs)
        if state_at is not None:
            if collect:
                raise TypeError(
                    "Stacked.scan does not take an eqx.nn.State; call the stack "
                    "instead: `x, state = stack(x, state)`."
                )
            # Layer i gets its own slice of the state and returns its new state,
            # collected like a `y`, then written back into the whole state.
            state = get_arg(args, kwargs, state_at)
            sub = layer_state(state, self.layers, self.num_layers, "This Stacked")
            args, kwargs = replace_arg(args, kwargs, state_at, PerLayer(sub))
            x, new_sub = self._run(x, args, kwargs, key, state_pair, keys)
            return (x, state.update(new_sub)), None
        length = self.num_layers
        layer_dyn, layer_static = eqx.partition(self.layers, eqx.is_array)
        per_args, per_statics = {}, {}
        for name, value in check_per_layer(args, kwargs, length).items():
            per_args[name], per_statics[name] = eqx.partition(value.tree, eqx.is_array)
        if keys is None and key is not None:
            keys = jr.split(key, length)
        cls_name = type(self.layers).__name__

        def step(carry: Any, xs: tuple) -> tuple[Any, Any]:
            dyn, per, k = xs
            if self.layer_sharding is not None:
                dyn = constrain(dyn, self.layer_sharding)
            layer = eqx.combine(dyn, layer_static)

            def pick(name: str, value: Any) -> Any:
                # This layer's slice of a `per_layer` argument; others as given.
                if name not in per:
                    return value
                return eqx.combine(per[name], per_statics[name])

            call_args = [pick(_arg_name(i), a) for i, a in enumerate(args)]
            call_kwargs = {n: pick(_arg_name(n), v) for n, v in kwargs.items()}
            if k is not None:
                check_takes_key(layer, "Stacked", "layer i gets key=keys[i]")
                call_kwargs["key"] = k
            out = layer(carry, *call_args, **call_kwargs)
            if not collect:
                return out, None
            if callable(collect):  # how a stateful call reads the output
                return collect(out, f"layer {cls_name}")
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"Stacked.scan expects each layer ({cls_name}) to return a "
                    f"(carry, y) pair, got {describe(out)}. Use `stack(x)` for "
                    "layers that return only the carry."
                )
            return out

        def where(i: int | None) -> str:
            if i is None:
                return (
                    f"The stacked layer {cls_name} (one body for all {length} layers)"
                )
            return f"Layer {i} ({cls_name})"

        return run(
            step,
            x,
            (layer_dyn, per_args, keys),
            length=length,
            mode=self.mode,
            checkpoint=self.checkpoint,
            unroll=self.unroll,
            where=where,
        )
