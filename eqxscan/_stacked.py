"""`Stacked`: L layers of one kind stored as one module with a leading layer axis.

Besides the public `Stacked`, `per_layer` and `PerLayer`, this module offers one
small internal protocol to the other layer containers (`Chain`), which run
their scanned groups through `Stacked`'s public calls:

- `Method`, `check_method` and `call_layer`: what to run of a layer
  (`__call__`, a method name or a function) and running it, with its key;
- `layer_pair`: a layer's output checked as the `(carry, y)` pair a `.scan`
  expects; `check_per_layer`: the `per_layer` arguments of a call, checked;
- `LayerIndex` and `StateDictFn`: how a container's `state_dict_layers` says
  how its arrays are named in a state dict (see `eqxscan._tree`).
"""

import functools
import operator
from collections.abc import Callable, Sequence
from typing import (
    Generic,
    NamedTuple,
    overload,
    SupportsIndex,
    TypeVar,
    Unpack,
)

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import Sharding
from jaxtyping import Array, Bool, PRNGKeyArray, PyTree

from ._alike import check_alike, stack_alike
from ._checks import (
    check_bool,
    check_callable,
    check_index,
    check_leading_axis,
    check_made_layer,
    check_size,
    check_takes_key,
    describe,
    noted,
    split_key,
)
from ._constrain import check_layer_sharding, constrain, layers_may_be_sharded
from ._drop import (
    check_droppable,
    depth_drop,
    DepthDrop,
    DropInputs,
    dropped_layer,
    rates_of,
)
from ._eager import compiled_when_eager
from ._engine import run
from ._options import ScanArgs, Scanning, ScanOptions
from ._remat import name_inputs
from ._stateful import (
    find_state,
    get_arg,
    layer_state,
    replace_arg,
    state_pair,
    updated,
)


#: The most layers a stack may have: beyond, the per-layer keys alone take
#: gigabytes (and `jax.random.split` aborts the interpreter past 2**62).
MAX_LAYERS = 2**20


LayerT = TypeVar("LayerT")


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


def stack_layers(layers: Sequence[LayerT], what: str = "Stacked.from_layers") -> LayerT:
    """Stack layers that can share one body leaf by leaf on a new axis 0 (layers
    that differ only by identity share the first one's objects)."""
    layers = list(layers)
    check_alike(layers, what)
    return stack_alike(layers)


def _check_make_layer(make_layer: object) -> None:
    if isinstance(make_layer, eqx.Module):
        name = type(make_layer).__name__
        raise TypeError(
            f"make_layer must be a function that builds one layer from a key, but "
            f"got a {name} instance (a layer, not a way to make one). Pass e.g. "
            f"`lambda k: {name}(..., key=k)`."
        )
    check_callable("make_layer", make_layer)


def _check_made(layers: object) -> None:
    check_made_layer(layers)
    if eqx.is_array(layers):
        one = jax.ShapeDtypeStruct(layers.shape[1:], layers.dtype)
        raise TypeError(
            f"make_layer returned an array ({describe(one)}), not a layer. It must "
            "return a module (e.g. an `eqx.Module`) that is called as `layer(x)`."
        )


ReadOut = Callable[[object, str], tuple[PyTree, PyTree]]
"""How a runner reads a layer's output, given the layer's name: as the carry
alone (`carry_only`) or as a `(carry, y)` pair."""


def carry_only(out: object, who: str) -> tuple[PyTree, PyTree]:
    """A layer's output read as the new carry, with no `y`."""
    del who
    return out, None


def layer_pair(out: object, who: str, caller: str) -> tuple[PyTree, PyTree]:
    """`out` as the `(carry, y)` pair that `caller` (e.g. `"Stacked.scan"`) expects
    from `who` (a layer, named)."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"{caller} expects each layer to return a (carry, y) pair, but {who} "
            f"returned {describe(out)}. Call the module itself for layers that "
            "return only the carry."
        )
    return out


Method = Callable[..., PyTree] | str
"""What to run of each layer instead of `__call__`: a function
`fn(layer, x, *args, **kwargs)` (e.g. an unbound method, `Block.decode`) or the
name of a method (`"decode"`)."""


class LayerCall(NamedTuple):
    """What every layer of a run is called with: `args` and `kwargs` (values
    wrapped in [`eqxscan.per_layer`][] are sliced per layer), per-layer `keys`
    (already split, leading axis the layers; or `None`), how each output is
    read (`read_out`), whether the layers run last to first (`reverse`),
    which of their methods runs (`method`; `None` for `__call__`), and
    LayerDrop's choice when the caller has drawn it (`keep`, one bool per
    layer, e.g. a pipeline stage's chunk of the whole stack's choice; the scan
    then runs only the kept layers)."""

    args: tuple
    kwargs: dict[str, object]
    keys: Array | None
    read_out: ReadOut
    reverse: bool = False
    method: Method | None = None
    keep: Bool[Array, " L"] | None = None


def check_method(method: object, layer: object) -> None:
    """Raise unless `method` is `None`, a callable, or the name of a method of
    `layer` (a layer or stacked layers, whose class is the layers' class)."""
    if method is None or callable(method):
        return
    if not isinstance(method, str):
        raise TypeError(
            "method must be a function fn(layer, x, ...) (e.g. an unbound method "
            f"such as Block.decode), a method name or None, got "
            f"{type(method).__name__} ({method!r})."
        )
    if not callable(getattr(layer, method, None)):
        raise AttributeError(
            f"{type(layer).__name__} has no method {method!r} to run on each layer; "
            "pass the name of one of its methods, or a function fn(layer, x, ...)."
        )


def call_layer(
    layer: object,
    method: Method | None,
    x: PyTree,
    args: tuple,
    kwargs: dict[str, object],
    key: Array | None = None,
    who: str = "Stacked",
) -> PyTree:
    """Run `method` of `layer` (its `__call__` for `None`) as
    `(x, *args, **kwargs)`, with `key=key` when a key is given, after checking
    that what runs takes one (`who` names the caller in that error)."""
    if method is None:
        fn: Callable[..., PyTree] = layer  # type: ignore[assignment]
    elif isinstance(method, str):
        fn = getattr(layer, method)
    else:
        fn = functools.partial(method, layer)
    if key is None:
        return fn(x, *args, **kwargs)
    target = fn if isinstance(method, str) else (method or layer)
    check_takes_key(target, who, "layer i gets key=keys[i]")
    return fn(x, *args, key=key, **kwargs)


class LayerIndex(NamedTuple):
    """How the flat state-dict names of [`eqxscan.to_state_dict`][] number the
    layers of a subtree: an array element at layer-axis index `i` (one entry per
    leading layer axis of the subtree) belongs to layer
    `start + sum(i[k] * strides[k])`. A `Stacked`'s layers are
    `LayerIndex(0, (1,))`; layer 5 of a `Chain`, alone, is `LayerIndex(5, ())`."""

    start: int
    strides: tuple[int, ...]


StateDictFn = Callable[[PyTree, LayerIndex, tuple[int, ...]], PyTree]
"""What a module's `state_dict_layers` applies to each subtree that holds layers:
`fn(subtree, index, axes)`, with `axes` the sizes of the layer axes in front of
the subtree's arrays; it returns the subtree to put in its place."""


def stacked_pair(out: object, who: str) -> tuple[PyTree, PyTree]:
    """A layer's output read as the `(carry, y)` pair `Stacked.scan` expects."""
    return layer_pair(out, who, "Stacked.scan")


class Stacked(Scanning, Generic[LayerT]):
    """`L` layers of one kind, stored as one module whose array leaves have a
    leading layer axis, and run with `jax.lax.scan` (or a Python loop).

    Stacking is a storage layout, not weight sharing: layer `i` has its own
    weights, `stack.layers.weight[i]`. `Stacked[Block]` is the type of a stack of
    `Block`s: `stack[i]` is a `Block`, `stack[i:j]` a `Stacked[Block]`.

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

    layers: LayerT
    num_layers: int = eqx.field(static=True)
    options: ScanOptions
    layer_sharding: Sharding | PyTree[Sharding | None] | None = eqx.field(static=True)
    depth_drop: DepthDrop | None

    def __init__(
        self,
        make_layer: Callable[..., LayerT] | None = None,
        num_layers: SupportsIndex | None = None,
        *args: object,
        key: PRNGKeyArray | None = None,
        layers: LayerT | None = None,
        layer_sharding: Sharding | PyTree[Sharding | None] | None = None,
        drop_path: object = 0.0,
        layer_drop: object = 0.0,
        **options: Unpack[ScanArgs],
    ):
        """**Arguments:**

        - `make_layer`: builds one layer from a key (and `*args`). It is run once
          under `eqx.filter_vmap`, so layer `i` is exactly
          `make_layer(jax.random.split(key, num_layers)[i], *args_i)`.
        - `num_layers`: `L >= 1`.
        - `*args`: more arguments for `make_layer`, after the key. Values wrapped
          in [`eqxscan.per_layer`][] are sliced (layer `i` gets slice `i`, e.g. of
          `jnp.arange(L)` or of a per-layer configuration array); others are
          passed to every layer unchanged.
        - `key`: a JAX PRNG key.
        - `layers`: instead of `make_layer` and `key`, layers that are already
          stacked (every array leaf has leading axis `num_layers`), e.g. from
          `stack.layers`. [`eqxscan.Stacked.from_layers`][] stacks a list.
        - `layer_sharding`: a `jax.sharding.Sharding` (or `None`) that each scan
          step constrains its one layer's weights to before calling it. FSDP uses
          a replicated sharding here, so that a step all-gathers only the layer it
          runs; [`eqxscan.sharding.shard`][] sets it for you. It may also be a
          pytree with one layer's structure (a sharding per array, without the
          layer axis), e.g. to keep tensor-parallel axes split while the FSDP
          axis is gathered: [`eqxscan.sharding.gather_layers`][] with `keep=`
          builds it.
        - `mode`: `"scan"` (`jax.lax.scan`, one traced body) or `"loop"` (a Python
          loop over the same weights: the reference and debugging path).
        - `checkpoint`: rematerialisation. `"auto"` (default: chosen from the
          traced layer's shapes: save everything when that is small, else
          recompute; see [`eqxscan.explain_auto`][]), `False` (save everything),
          `True` (`jax.checkpoint` around each layer), a
          `jax.checkpoint_policies` policy, `"nested"` (two-level scan whose
          saved carries grow like `sqrt(L)`), `"offload"` (the matmul outputs
          kept in host memory), or an [`eqxscan.ScanCheckpoint`][] (a policy plus
          what to do with each layer's carry and inputs, and nesting of any
          shape). All give the same values and gradients.
        - `unroll`: a positive int, passed to `jax.lax.scan`; `True` unrolls fully
          (the program of `mode="loop"`, with this `checkpoint`); `"auto"`
          (default) is chosen with `checkpoint="auto"`'s rule.

        - `drop_path`: stochastic depth while training: a rate per layer (one
          number, `L` numbers or [`eqxscan.linear_rates`][]); per example,
          layer `i`'s residual branch `layer(x) - x` is dropped with
          probability `drop_path[i]`, else scaled by `1 / (1 - drop_path[i])`.
        - `layer_drop`: LayerDrop while training: per call, layer `i` is skipped
          for the whole batch with probability `layer_drop[i]`, its compute not
          done (a `jax.lax.cond` in the scan body, forward and backward).

        `mode`, `checkpoint` and `unroll` make the module's
        [`eqxscan.ScanOptions`][]; `drop_path` and `layer_drop` its
        [`eqxscan.DepthDrop`][] (`.depth_drop`), which needs a `key` at every
        call while training and does nothing under `eqx.nn.inference_mode`.
        """
        num_layers = check_size(
            "num_layers",
            num_layers,
            maximum=MAX_LAYERS,
            hint="Hint: a stack holds every layer's weights at once; for a long "
            "loop over time use eqxscan.Recurrent or jax.lax.scan.",
        )
        self.options = ScanOptions(**options)
        if layers is None:
            _check_make_layer(make_layer)
            if key is None:
                raise TypeError("Stacked needs `key=` to build its layers.")
            layers = _build(make_layer, num_layers, args, key)
            _check_made(layers)
        elif make_layer is not None or key is not None or args:
            raise TypeError(
                "Stacked takes either `make_layer` and `key` (and arguments for "
                "`make_layer`), or already-stacked `layers`, not both."
            )
        check_layer_sharding(layer_sharding, layers)
        self.layers = layers
        self.num_layers = num_layers
        self.layer_sharding = layer_sharding
        self.depth_drop = depth_drop(num_layers, drop_path, layer_drop)

    @classmethod
    def from_layers(
        cls,
        layers: Sequence[LayerT],
        **options: Unpack[ScanArgs],
    ) -> "Stacked[LayerT]":
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
        return cls(layers=stack_layers(layers), num_layers=len(layers), **options)

    def own_options(self) -> tuple[str, ...]:
        return ("layer_sharding", "drop_path", "layer_drop")

    def replace_options(self, options: ScanOptions, **own: object) -> "Stacked[LayerT]":
        return restack(self, options=options, **own)

    def __len__(self) -> int:
        return self.num_layers

    @overload
    def __getitem__(self, index: slice) -> "Stacked[LayerT]": ...

    @overload
    def __getitem__(self, index: SupportsIndex) -> LayerT: ...

    def check_layer_axis(self, what: str) -> None:
        """Raise unless every array leaf has the layer axis first. A batch of
        stacks (an ensemble made with `eqx.filter_vmap`) has its batch axis in
        front: JAX would clamp an index into it, and `lax.scan` would fail with a
        bare length error."""
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
                    "`eqx.filter_vmap(lambda s: s[i])(stacks)` (see docs/idioms.md)."
                )

    def __getitem__(self, index: SupportsIndex | slice) -> "LayerT | Stacked[LayerT]":
        """`stack[i]` is layer `i` (negative allowed); `stack[i:j]` a `Stacked`."""
        self.check_layer_axis("index")
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
            drop_path, layer_drop = rates_of(self.depth_drop)
            if self.depth_drop is not None:
                drop_path, layer_drop = rates_of(self.depth_drop.sliced(index))
            return restack(
                self,
                layers=layers,
                num_layers=len(selected),
                drop_path=drop_path,
                layer_drop=layer_drop,
            )
        i = check_index(
            index,
            self.num_layers,
            "Stacked",
            "mark it static, or select with "
            "`jax.tree.map(lambda a: a[i], stack.layers)`.",
        )
        return jtu.tree_map(lambda a: a[i] if eqx.is_array(a) else a, self.layers)

    def unstack(self) -> list[LayerT]:
        """The layers as a list of ordinary (unstacked) modules."""
        return [self[i] for i in range(self.num_layers)]

    def state_dict_layers(self, fn: StateDictFn) -> "Stacked[LayerT]":
        """How [`eqxscan.to_state_dict`][] names this stack's arrays: the layer
        index takes the place of the stacked axis and of the `layers` field, so
        layer `i`'s `w1` is `"<prefix>.i.w1"`, as for a list of layers.

        **Arguments:**

        - `fn`: applied to `layers` as `fn(self.layers, LayerIndex(0, (1,)),
          (num_layers,))` (see `eqxscan._stacked.StateDictFn`).

        **Returns:**

        This stack with `layers` replaced by what `fn` returned, rebuilt (and
        so checked) as `Stacked.__init__` builds one.
        """
        layers = fn(self.layers, LayerIndex(0, (1,)), (self.num_layers,))
        return restack(self, layers=layers)

    def with_layer(self, index: SupportsIndex, layer: LayerT) -> "Stacked[LayerT]":
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
        return restack(self, layers=jtu.tree_unflatten(treedef, new))

    @compiled_when_eager
    def __call__(
        self,
        x: PyTree,
        *args: object,
        key: PRNGKeyArray | None = None,
        method: Method | None = None,
        reverse: bool = False,
        **kwargs: object,
    ) -> PyTree:
        """Fold `x` through the layers: `x = layer_i(x, *args, **kwargs)`.

        **Arguments:**

        - `x`: the carry, any pytree; every layer must return one of the same
          structure, shapes and dtypes.
        - `*args`, `**kwargs`: passed to every layer (broadcast), except values
          wrapped in [`eqxscan.per_layer`][], which are sliced per layer.
        - `key`: if given, split into `L` keys and layer `i` gets `key=keys[i]`.
        - `method`: run this instead of `__call__`: a function
          `fn(layer, x, *args, **kwargs)` such as an unbound method
          (`Block.decode`), or a method name (`"decode"`).
        - `reverse`: run layer `L-1` first and layer `0` last. The scan reads the
          weights backwards (no reversed copy, unlike `stack[::-1]`); layer `i`
          keeps `keys[i]` and its `per_layer` slice.

        Stateful layers (Equinox's `layer(x, state) -> (x, state)`, e.g. with
        `eqx.nn.BatchNorm`) are called as Equinox calls them: pass the
        `eqx.nn.State` from `eqx.nn.make_with_state` as an argument and each
        layer gets its own slice of it; the call then returns `(x, state)`.

        **Returns:**

        The final carry (or `(carry, state)` when called with a state).
        """
        check_method(method, self.layers)
        reverse = check_bool("reverse", reverse)
        keys = (
            None
            if key is None
            else split_key(key, self.num_layers, type(self).__name__)
        )
        call = LayerCall(args, kwargs, keys, carry_only, reverse, method)
        return scan_layers(self, x, self._dropping(call, key))[0]

    @compiled_when_eager
    def scan(
        self,
        x: PyTree,
        *args: object,
        key: PRNGKeyArray | None = None,
        method: Method | None = None,
        reverse: bool = False,
        **kwargs: object,
    ) -> tuple[PyTree, PyTree]:
        """Like `__call__`, but each layer returns `(new_x, y_i)`.

        **Returns:**

        `(final carry, ys)` with the `y_i` stacked leaf by leaf on axis 0
        (`None` if layers return `(x, None)`). `ys[i]` is layer `i`'s, also with
        `reverse=True`.
        """
        check_method(method, self.layers)
        reverse = check_bool("reverse", reverse)
        keys = (
            None
            if key is None
            else split_key(key, self.num_layers, type(self).__name__)
        )
        call = LayerCall(args, kwargs, keys, stacked_pair, reverse, method)
        return scan_layers(self, x, self._dropping(call, key))

    def _dropping(self, call: LayerCall, key: PRNGKeyArray | None) -> LayerCall:
        # `call` with LayerDrop and drop-path, when this call drops.
        kwargs, method = drop_call(
            self.depth_drop,
            call.kwargs,
            call.method,
            key,
            find_state(call.args, call.kwargs) is not None,
            call.read_out is not carry_only,
            type(self).__name__,
        )
        return call._replace(kwargs=kwargs, method=method)

    def vmap(
        self,
        x: PyTree,
        *args: object,
        key: PRNGKeyArray | None = None,
        method: Method | None = None,
        **kwargs: object,
    ) -> PyTree:
        """Apply every layer to the same `x`, in parallel, and stack the outputs:
        `ys[i] = layer_i(x, *args, **kwargs)` (ensembles, mixture-of-experts).

        **Arguments:**

        - `x`, `*args`, `**kwargs`: given to every layer, except values wrapped
          in [`eqxscan.per_layer`][], which are sliced per layer.
        - `key`: if given, split into `L` keys and layer `i` gets `key=keys[i]`.
        - `method`: as for `__call__`.

        **Returns:**

        The outputs, stacked leaf by leaf on a new leading axis of length `L`.
        With `mode="scan"` this is one `jax.vmap` over the layer axis; with
        `mode="loop"` a Python loop (the reference). `checkpoint` and `unroll`
        do not apply: nothing is scanned; nor do `drop_path` and `layer_drop`,
        which drop depth.
        """
        check_method(method, self.layers)
        keys = (
            None
            if key is None
            else split_key(key, self.num_layers, type(self).__name__)
        )
        return vmap_layers(
            self, x, LayerCall(args, kwargs, keys, carry_only, False, method)
        )


def _build(
    make_layer: Callable[..., LayerT], num_layers: int, args: tuple, key: PRNGKeyArray
) -> LayerT:
    """`make_layer(keys[i], *args_i)` for every layer, in one `eqx.filter_vmap`:
    `per_layer` arguments sliced, others broadcast."""
    per = check_per_layer(args, {}, num_layers)
    per_dyn, per_static = {}, {}
    for name, value in per.items():
        per_dyn[name], per_static[name] = eqx.partition(value.tree, eqx.is_array)

    def one(k: PRNGKeyArray, slices: dict) -> LayerT:
        call_args = [
            eqx.combine(slices[n], per_static[n]) if n in slices else a
            for n, a in ((_arg_name(i), a) for i, a in enumerate(args))
        ]
        return make_layer(k, *call_args)

    return eqx.filter_vmap(one)(split_key(key, num_layers, "Stacked"), per_dyn)


def restack(stack: Stacked[LayerT], **changes: object) -> Stacked[LayerT]:
    """`stack` rebuilt through `Stacked.__init__` with `changes` applied (any of
    `layers`, `num_layers`, `options`, `layer_sharding`, `drop_path`,
    `layer_drop`) and every other field kept (inference mode included): how
    slicing, loading, sharding and `with_options` make a new stack."""
    fields: dict[str, object] = dict(
        layers=stack.layers,
        num_layers=stack.num_layers,
        options=stack.options,
        layer_sharding=stack.layer_sharding,
        drop_path=rates_of(stack.depth_drop)[0],
        layer_drop=rates_of(stack.depth_drop)[1],
    )
    for name in changes:
        if name not in fields:
            raise TypeError(f"restack() got an unexpected keyword argument {name!r}.")
    fields.update(changes)
    options = fields.pop("options")
    assert isinstance(options, ScanOptions)
    new = type(stack)(**fields, **options.as_args())  # type: ignore[arg-type]
    if stack.depth_drop is None or new.depth_drop is None:
        return new
    inference = stack.depth_drop.inference
    return eqx.tree_at(lambda s: s.depth_drop.inference, new, inference)


def drop_call(
    drop: DepthDrop | None,
    kwargs: dict[str, object],
    method: Method | None,
    key: object,
    has_state: bool,
    pairs: bool,
    who: str,
) -> tuple[dict[str, object], Method | None]:
    """The `(kwargs, method)` of a call, with each layer run through
    `dropped_layer` when `drop` drops in this call (training, a rate above
    zero); else as given. Each layer's rates and drop key reach it as a
    `per_layer` argument, so a `Chain` routes them by global layer index as it
    routes any other; `pairs` says whether layers return `(carry, y)`."""
    if not check_droppable(drop, key, has_state, who):
        return kwargs, method
    assert key is not None
    inner = method

    def run(
        layer: object,
        x: PyTree,
        *args: object,
        key: PRNGKeyArray | None = None,
        **kwargs: object,
    ) -> PyTree:
        # The layer gets its key only if it takes one: a key given only for
        # dropping must not reach, say, an `eqx.nn.Linear`.
        if key is not None and not takes_key(layer, inner):
            key = None
        return call_layer(layer, inner, x, args, kwargs, key, who)

    wrapped = functools.partial(
        dropped_layer,
        _eqxscan_run=run,
        _eqxscan_pairs=pairs,
    )
    return {**kwargs, DROP: PerLayer(drop.per_layer_inputs(key))}, wrapped


#: The keyword under which `dropped_layer` receives its layer's drop inputs.
DROP = "_eqxscan_drop"


def takes_key(layer: object, method: Method | None) -> bool:
    """Whether running `method` of `layer` can be given `key=`."""
    if isinstance(method, str):
        target = getattr(layer, method)
    else:
        target = method or layer
    try:
        check_takes_key(target, "", "")
    except TypeError:
        return False
    return True


def scan_layers(stack: Stacked, x: PyTree, call: LayerCall) -> tuple[PyTree, PyTree]:
    """Fold `x` through the layers of `stack` as `call` says: layer `i` gets
    `key=call.keys[i]` (when there are keys), its output read by `call.read_out`.

    **Returns:**

    `(final carry, ys)`, the `y`s stacked on axis 0 (`None` if there are none).
    """
    args, kwargs, keys, read_out = call.args, call.kwargs, call.keys, call.read_out
    stack.check_layer_axis("call")
    state_at = find_state(args, kwargs)
    if state_at is not None:
        if read_out is not carry_only:
            raise TypeError(
                "Stacked.scan does not take an eqx.nn.State; call the stack "
                "instead: `x, state = stack(x, state)`."
            )
        # Layer i gets its own slice of the state and returns its new state,
        # collected like a `y`, then written back into the whole state.
        state = get_arg(args, kwargs, state_at)
        sub = layer_state(state, stack.layers, stack.num_layers, "This Stacked")
        args, kwargs = replace_arg(args, kwargs, state_at, PerLayer(sub))
        sub_call = call._replace(args=args, kwargs=kwargs, read_out=state_pair)
        x, new_sub = scan_layers(stack, x, sub_call)
        return (x, updated(state, new_sub)), None
    length = stack.num_layers
    layer_dyn, layer_static = eqx.partition(stack.layers, eqx.is_array)
    per_args, per_statics = {}, {}
    for name, value in check_per_layer(args, kwargs, length).items():
        per_args[name], per_statics[name] = eqx.partition(value.tree, eqx.is_array)
    cls_name = type(stack.layers).__name__
    sharding = stack.layer_sharding
    keep = call.keep
    if keep is None:
        keep = _scan_gates(per_args, per_statics, length)

    def step(carry: PyTree, xs: tuple) -> tuple[PyTree, PyTree]:
        dyn, per, k = xs
        if sharding is not None:
            dyn = constrain(dyn, sharding)
        # Named after the gather, so `ScanCheckpoint(save_inputs=...)` decides
        # whether the backward pass gathers the layer again.
        dyn, per = name_inputs((dyn, per), stack.options.scan_checkpoint)
        layer = eqx.combine(dyn, layer_static)

        def pick(name: str, value: object) -> object:
            # This layer's slice of a `per_layer` argument; others as given.
            if name not in per:
                return value
            return eqx.combine(per[name], per_statics[name])

        call_args = [pick(_arg_name(i), a) for i, a in enumerate(args)]
        call_kwargs = {n: pick(_arg_name(n), v) for n, v in kwargs.items()}
        out = call_layer(layer, call.method, carry, tuple(call_args), call_kwargs, k)
        return read_out(out, f"the stacked layer {cls_name}")

    def where(i: int | None) -> str:
        if i is None:
            return f"The stacked layer {cls_name} (one body for all {length} layers)"
        return f"Layer {i} ({cls_name})"

    return run(
        step,
        x,
        (layer_dyn, per_args, keys),
        length=length,
        options=stack.options,
        reverse=call.reverse,
        where=where,
        # Unrolled, XLA may gather every sharded layer at once (FSDP).
        gathered=sharding is not None or layers_may_be_sharded(layer_dyn),
        keep=keep,
    )


def _scan_gates(per_args: dict, per_statics: dict, length: int) -> Array | None:
    """LayerDrop's keep bits for a scan over `length` layers, when this call
    drops layers (its `DROP` argument, one entry per layer): the scan then runs
    only the kept layers, and the layers leave LayerDrop to it. `None` (and the
    arguments unchanged) otherwise."""
    name = _arg_name(DROP)
    if name not in per_args:
        return None
    drop = eqx.combine(per_args[name], per_statics[name])
    if not (
        isinstance(drop, DropInputs)
        and drop.uses[1]
        and not drop.gated
        and drop.layer_rate.shape == (length,)
    ):
        return None  # e.g. the repeats of a Chain's unit: gated inside
    per_args[name], per_statics[name] = eqx.partition(
        drop.gated_by_scan(), eqx.is_array
    )
    return drop.keep()


def vmap_layers(stack: Stacked, x: PyTree, call: LayerCall) -> PyTree:
    """Every layer of `stack` applied to the same `x` as `call` says, outputs
    stacked on a new leading axis: one `vmap`, or a loop with `mode="loop"`."""
    length = stack.num_layers
    layer_dyn, layer_static = eqx.partition(stack.layers, eqx.is_array)
    per_args, per_statics = {}, {}
    for name, value in check_per_layer(call.args, call.kwargs, length).items():
        per_args[name], per_statics[name] = eqx.partition(value.tree, eqx.is_array)
    cls_name = type(stack.layers).__name__

    def one(dyn: PyTree, per: dict, k: Array | None) -> PyTree:
        layer = eqx.combine(dyn, layer_static)

        def pick(name: str, value: object) -> object:
            if name not in per:
                return value
            return eqx.combine(per[name], per_statics[name])

        call_args = [pick(_arg_name(i), a) for i, a in enumerate(call.args)]
        call_kwargs = {n: pick(_arg_name(n), v) for n, v in call.kwargs.items()}
        return call_layer(
            layer, call.method, x, tuple(call_args), call_kwargs, k, "Stacked.vmap"
        )

    inputs = (layer_dyn, per_args, call.keys)
    if stack.mode == "loop":
        outs = []
        for i in range(length):
            layer_i = jtu.tree_map(lambda a, i=i: a[i], inputs)
            outs.append(noted(one, f"Layer {i} ({cls_name})", *layer_i))
        return jtu.tree_map(lambda *a: jnp.stack(a), *outs)
    where = f"The stacked layer {cls_name} (one body for all {length} layers)"
    return noted(eqx.filter_vmap(one), where, *inputs)
