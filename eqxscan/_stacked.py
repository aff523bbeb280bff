"""`Stacked`: L layers of one kind stored as one module with a leading layer axis."""

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jax.sharding import Sharding
from jaxtyping import PRNGKeyArray, PyTree

from ._checks import (
    check_callable,
    check_leading_axis,
    check_stackable,
    check_takes_key,
    describe,
)
from ._constrain import check_layer_sharding, constrain
from ._engine import check_options, run


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


def _check_num_layers(num_layers: Any) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(
            f"num_layers must be an int, got {type(num_layers).__name__} "
            f"({num_layers!r})."
        )
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
    return num_layers


def stack_layers(layers: Sequence[Any], what: str = "Stacked.from_layers") -> Any:
    """Stack identical-structure layers leaf by leaf on a new axis 0."""
    check_stackable(layers, what)
    return jtu.tree_map(
        lambda first, *rest: (
            jnp.stack((first, *rest)) if eqx.is_array(first) else first
        ),
        layers[0],
        *layers[1:],
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
    unroll: int | bool | Literal["auto"] = eqx.field(static=True)
    layer_sharding: Sharding | None = eqx.field(static=True)

    def __init__(
        self,
        make_layer: Callable[[PRNGKeyArray], Any],
        num_layers: int,
        *,
        key: PRNGKeyArray,
        mode: str = "scan",
        checkpoint: Any = "auto",
        unroll: int | bool | Literal["auto"] = "auto",
    ):
        """**Arguments:**

        - `make_layer`: builds one layer from a key. It is run once under
          `eqx.filter_vmap`, so layer `i` is exactly
          `make_layer(jax.random.split(key, num_layers)[i])`.
        - `num_layers`: `L >= 1`.
        - `key`: a JAX PRNG key.
        - `mode`: `"scan"` (`jax.lax.scan`, one traced body) or `"loop"` (a Python
          loop over the same weights: the reference and debugging path).
        - `checkpoint`: rematerialisation. `"auto"` (default: chosen from the
          traced layer's shapes: save everything when that is small, else
          recompute; see [`eqxscan.explain_auto`][]), `False` (save everything),
          `True` (`jax.checkpoint` around each layer), a
          `jax.checkpoint_policies` policy, or `"nested"` (two-level scan whose
          saved carries grow like `sqrt(L)`). All give the same values and
          gradients.
        - `unroll`: passed to `jax.lax.scan`; `"auto"` (default) unrolls layers
          with little work per step.
        """
        num_layers = _check_num_layers(num_layers)
        check_callable("make_layer", make_layer)
        check_options(mode, checkpoint, unroll)
        keys = jr.split(key, num_layers)
        self.layers = eqx.filter_vmap(make_layer)(keys)
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
        unroll: int | bool | Literal["auto"] = "auto",
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
        unroll: int | bool | Literal["auto"] = _MISSING,
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

    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        """`stack[i]` is layer `i` (negative allowed); `stack[i:j]` a `Stacked`."""
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

        **Returns:**

        The final carry.
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
        collect: bool,
        keys: Any = None,
    ) -> tuple[Any, Any]:
        # `keys`: already-split per-layer keys (leading axis L), used instead of
        # splitting `key`; `Chain` hands each group its slice of one split.
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
