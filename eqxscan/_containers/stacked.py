"""`Stacked`: L layers of one kind stored as one module with a leading layer axis
(built by `make_layer` under one `eqx.filter_vmap`, run by `stack_calls.py`), and
how a container numbers its layers in a state dict (`LayerNumbering`)."""

import operator
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, overload, SupportsIndex, TypeVar, Unpack

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Sharding
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._helpers.checks import (
    check_bool,
    check_callable,
    check_index,
    check_size,
    Checked,
    describe,
    docs,
    is_array,
    misaligned,
    split_key,
)
from .._helpers.constrain import check_layer_sharding
from .._helpers.stackable import (
    check_alike,
    check_state_indices,
    check_state_order,
    layer_list,
    stack_alike,
    weak_only,
)
from .._scan.drop_rates import (
    DropRates,
    new_drop_rates,
    Rates,
    rates_of,
    resolve_rates,
    with_mode_of,
)
from .._scan.eager_compile import compiled_when_eager
from .._scan.layer_call import (
    carry_only,
    check_method,
    check_per_layer,
    check_reverse_free,
    index as index_at,
    LayerCall,
    Method,
    pairs,
    ReadOut,
    take,
    write,
)
from .._scan.options import OwnOptions, ScanArgs, Scanning, ScanOptions
from .stack_calls import dropping_call, scan_layers, vmap_layers
from .stage_order import (
    check_stage_order,
    layers_in_stage_order,
    permute_stage_order,
    refuse_stage_order,
)


#: The most layers a stack may have: beyond, the per-layer keys alone take
#: gigabytes (and `jax.random.split` aborts the interpreter past 2**62).
MAX_LAYERS = 2**20
# `Stacked`'s keywords besides the scan options, named when one is misspelt.
_KEYWORDS = tuple("key layers layer_sharding drop_path layer_drop stage_order".split())
_HINT = "make_layer's own arguments follow num_layers (or functools.partial)."
LayerT = TypeVar("LayerT")


def build_layers(
    make_layer: Callable[..., LayerT] | None,
    num_layers: int,
    args: tuple[PyTree, ...],
    key: PRNGKeyArray | None,
) -> LayerT:
    """`make_layer(keys[i], *args_i)` for every layer, in one `eqx.filter_vmap`."""
    if isinstance(make_layer, eqx.Module):
        name = type(make_layer).__name__
        raise TypeError(
            f"make_layer must be a function that builds one layer from a key, but "
            f"got a {name} instance (a layer, not a way to make one). Pass e.g. "
            f"`lambda k: {name}(..., key=k)`."
        )
    make_layer = check_callable("make_layer", make_layer)
    if key is None:
        raise TypeError("Stacked needs `key=` to build its layers.")
    check_per_layer(args, {}, num_layers)
    call = LayerCall(args, {}, split_key(key, num_layers, "Stacked"))
    xs, one = call.scanned()

    def build(x: PyTree) -> LayerT:
        layer_i = one(x)
        return make_layer(layer_i.key, *layer_i.args)

    layers = eqx.filter_vmap(build)(xs)
    # A missing `return`, a number, a string or an array fails only when called.
    if is_array(layers):
        one_layer = jax.ShapeDtypeStruct(layers.shape[1:], layers.dtype)
        got = f"an array ({describe(one_layer)})"
    elif layers is None or isinstance(layers, (bool, int, float, complex, str, bytes)):
        got = f"{describe(layers)} ({type(layers).__name__})"
    else:
        return layers
    raise TypeError(
        f"make_layer returned {got}, not a layer.\nHint: make_layer(key, ...) "
        "must return the layer, e.g. an eqx.Module called as `layer(x)`; is a "
        "`return` missing?"
    )


class _Restacked(NamedTuple):
    # `layers` from `restack`, not checked: they may have outer axes in front (a
    # stack inside the layers of another, or a batch of stacks).
    layers: Any


class LayerNumbering(NamedTuple):
    """How the flat state-dict names of [`eqxscan.to_state_dict`][] number the
    layers of a subtree: an array element at layer-axis index `i` (one entry per
    leading layer axis of the subtree) belongs to layer
    `start + sum(i[k] * strides[k])`, the last `i[k]` first replaced by
    `order[i[k]]` when an `order` is given. A `Stacked`'s layers are
    `LayerNumbering(0, (1,))`; layer 5 of a `Chain`, alone, is
    `LayerNumbering(5, ())`."""

    start: int
    strides: tuple[int, ...]
    # The layer offset held at each index of the last layer axis, where it is
    # not the index itself (a stack stored in stage order).
    order: tuple[int, ...] | None = None

    def number(self, index: Sequence[Any]) -> Any:
        """The layer number at `index` (ints, or NumPy index grids)."""
        if self.order is not None and index:
            index = (*index[:-1], np.asarray(self.order)[index[-1]])
        return self.start + sum(i * s for i, s in zip(index, self.strides, strict=True))


StateDictFn = Callable[[PyTree, LayerNumbering, tuple[int, ...]], PyTree]
"""What a module's `state_dict_layers` applies to each subtree that holds layers:
`fn(subtree, index, axes)`, with `axes` the sizes of the layer axes in front of
the subtree's arrays; it returns the subtree to put in its place."""


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
    drop_rates: DropRates | None
    stage_order: tuple[int, int] | None = eqx.field(static=True)

    def __init__(
        self,
        make_layer: Callable[..., LayerT] | None = None,
        num_layers: SupportsIndex | None = None,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        layers: LayerT | None = None,
        layer_sharding: Sharding | PyTree[Sharding | None] | None = None,
        drop_path: Checked[Rates] = 0.0,
        layer_drop: Checked[Rates] = 0.0,
        stage_order: tuple[int, int] | None = None,
        **options: Unpack[ScanArgs],
    ):
        """**Arguments:**

        - `make_layer`: builds one layer from a key (and `*args`), run once under
          `eqx.filter_vmap`: layer `i` is exactly
          `make_layer(jax.random.split(key, num_layers)[i], *args_i)`.
        - `num_layers`: `L >= 1`.
        - `*args`: more arguments for `make_layer`, after the key. Values wrapped
          in [`eqxscan.per_layer`][] are sliced (layer `i` gets slice `i`, e.g. of
          `jnp.arange(L)`); others are passed to every layer unchanged.
        - `key`: a JAX PRNG key.
        - `layers`: instead of `make_layer` and `key`, already-stacked layers
          (every array leaf with leading axis `num_layers`), e.g. `stack.layers`;
          [`eqxscan.Stacked.from_layers`][] stacks a list.
        - `layer_sharding`: a `jax.sharding.Sharding` (or `None`) each scan step
          constrains its layer's weights to before calling it: with FSDP's
          replicated one, a step all-gathers only its layer
          ([`eqxscan.sharding.shard`][] sets it). Or a pytree of one layer's
          structure (a sharding per array, no layer axis), e.g. to keep
          tensor-parallel axes split: [`eqxscan.sharding.gather_layers`][] with
          `keep=` builds it.
        - `mode`: `"scan"` (`jax.lax.scan`, one traced body) or `"loop"` (a Python
          loop over the same weights: the reference and debugging path).
        - `remat`: rematerialisation. `"auto"` (default: chosen from the
          traced layer's shapes: save everything when that is small, else
          recompute; see [`eqxscan.explain_auto`][]), `False` (save everything),
          `True` (`jax.checkpoint` around each layer), a
          `jax.checkpoint_policies` policy, `"nested"` (two-level scan whose
          saved carries grow like `sqrt(L)`), `"offload"` (the matmul outputs
          kept in host memory), or an [`eqxscan.ScanRemat`][] (a policy plus
          what to do with each layer's carry and inputs, and nesting of any
          shape). All give the same values and gradients.
        - `unroll`: a positive int, passed to `jax.lax.scan`; `True` unrolls fully
          (the program of `mode="loop"`, with this `remat`); `"auto"`
          (default) is chosen with `remat="auto"`'s rule.
        - `drop_path`: stochastic depth while training: a rate per layer (one
          number, `L` numbers or [`eqxscan.linear_rates`][]); per example,
          layer `i`'s residual branch `layer(x) - x` is dropped with
          probability `drop_path[i]`, else scaled by `1 / (1 - drop_path[i])`.
        - `layer_drop`: LayerDrop while training: per call, layer `i` is skipped
          for the whole batch with probability `layer_drop[i]`, its compute not
          done (a `jax.lax.cond` in the scan body, forward and backward).
        - `stage_order`: `(stages, repeats)` when `layers` are stored in the
          stage order of [`eqxscan.sharding.pipeline_order`][] for them (which
          sets it), else `None`; [`eqxscan.sharding.pipeline`][] checks it, and
          calls of the stack run its layers in their natural order.

        `mode`, `remat` and `unroll` make the module's
        [`eqxscan.ScanOptions`][]; `drop_path` and `layer_drop` its
        [`eqxscan.DropRates`][] (`.drop_rates`), which needs a `key` at every
        call while training and does nothing under `eqx.nn.inference_mode`.
        """
        num_layers = check_size(
            "num_layers",
            num_layers,
            maximum=MAX_LAYERS,
            hint="Hint: a stack holds every layer's weights at once; for a long "
            "loop over time use eqxscan.Recurrent or jax.lax.scan.",
        )
        self.options = ScanOptions.given("Stacked", options, _KEYWORDS, _HINT)
        if unchecked := isinstance(layers, _Restacked):
            layers = layers.layers
        if layers is None:
            layers = build_layers(make_layer, num_layers, args, key)
        elif make_layer is not None or key is not None or args:
            raise TypeError(
                "Stacked takes either `make_layer` and `key` (and arguments for "
                "`make_layer`), or already-stacked `layers`, not both."
            )
        bad = None if unchecked else misaligned(layers, num_layers)
        if bad is not None:
            raise ValueError(
                f"Stacked was given num_layers={num_layers}, but `layers{bad[0]}` "
                f"has shape {tuple(bad[1].shape)}, not a leading layer axis of "
                f"length {num_layers}.\nHint: every array leaf of `layers` has the "
                "layer axis first (e.g. `stack.layers` with `num_layers=len(stack)`);"
                " a batch of stacks (an ensemble built with `eqx.filter_vmap`) is "
                "changed inside `eqx.filter_vmap`."
            )
        check_layer_sharding(layer_sharding, layers)
        self.layers = layers
        self.num_layers = num_layers
        self.layer_sharding = layer_sharding
        self.drop_rates = new_drop_rates(num_layers, drop_path, layer_drop)
        self.stage_order = check_stage_order(stage_order, num_layers)

    @classmethod
    def from_layers(
        cls,
        layers: Checked[Sequence[LayerT]],
        **options: Unpack[ScanArgs],
    ) -> "Stacked[LayerT]":
        """Stack already-built layers (e.g. loaded from a per-layer checkpoint).

        **Arguments:**

        - `layers`: a non-empty sequence of layers with identical structure,
          static fields, shapes and dtypes (else a `ValueError` naming the layer
          index, leaf path and both shapes/dtypes or static values).
        - `mode`, `remat`, `unroll`: as for `__init__`.

        **Returns:**

        A `Stacked` whose `unstack()` gives the layers back exactly.
        """
        layers = layer_list(layers, "Stacked.from_layers")
        check_alike(layers, "Stacked.from_layers")
        return cls(layers=stack_alike(layers), num_layers=len(layers), **options)

    def own_options(self) -> tuple[str, ...]:
        return ("layer_sharding", "drop_path", "layer_drop")

    def replace_options(
        self, options: ScanOptions, **own: Unpack[OwnOptions]
    ) -> "Stacked[LayerT]":
        changes: dict[str, object] = dict(own)
        order = layers_in_stage_order(self.num_layers, self.stage_order)
        for name in ("drop_path", "layer_drop"):
            if order is not None and name in changes:
                # Given by layer number; stored, as the layers, in stage order.
                rates = resolve_rates(changes[name], self.num_layers, name)
                changes[name] = tuple(rates[i] for i in order)
        return restack(self, options=options, **changes)

    def __len__(self) -> int:
        return self.num_layers

    @overload
    def __getitem__(self, index: slice) -> "Stacked[LayerT]": ...

    @overload
    def __getitem__(self, index: SupportsIndex) -> LayerT: ...

    def check_layer_axis(self, what: str) -> None:
        # A batch of stacks (an ensemble made with `eqx.filter_vmap`) has its
        # batch axis in front, which indexing would clamp and `lax.scan` refuse.
        if (bad := misaligned(self.layers, self.num_layers)) is None:
            return
        path, leaf = bad
        # A scalar: a number field that `jax.jit` made an array.
        hint = (
            "Under jax.jit (or jax.grad) a layer's number field (e.g. Dropout's "
            "p) becomes an array: use eqx.filter_jit (or eqx.filter_grad)."
            if leaf.ndim == 0
            else "Call and index a batch of stacks (e.g. an ensemble built "
            "with `eqx.filter_vmap`) inside `eqx.filter_vmap`: "
            f"`eqx.filter_vmap(lambda s: s[i])(stacks)` (see {docs('idioms.md')})."
        )
        raise ValueError(
            f"Cannot {what} this Stacked: it has {self.num_layers} layers, "
            f"but `layers{path}` has shape {tuple(leaf.shape)}, "
            f"so its first axis is not the layer axis.\n{hint}"
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
            if selected != range(self.num_layers):
                what = f"Cannot take {index} of a Stacked"
                refuse_stage_order(self.stage_order, what)
            check_state_order(self.layers, index, self.num_layers, "Stacked")
            drop = None if self.drop_rates is None else self.drop_rates.sliced(index)
            drop_path, layer_drop = rates_of(drop)
            return restack(
                self,
                layers=take(self.layers, index),
                num_layers=len(selected),
                drop_path=drop_path,
                layer_drop=layer_drop,
            )
        hint = (
            "mark it static, or select with `jax.tree.map(lambda a: a[i], "
            "eqx.filter(stack.layers, eqx.is_array))`"
        )
        if self.stage_order is not None:  # its row i is not layer i
            hint += (
                " of the stack put back in order (pipeline_order(..., inverse=True))"
            )
        i = check_index(index, self.num_layers, "Stacked", hint + ".")
        return index_at(self.layers, self._position(i))

    def _position(self, i: int) -> int:
        # Where layer `i` is stored: `pipeline_order` permutes the positions.
        order = layers_in_stage_order(self.num_layers, self.stage_order)
        return i if order is None else order.index(i)

    def unstack(self) -> list[LayerT]:
        """The layers as a list of ordinary (unstacked) modules."""
        return [self[i] for i in range(self.num_layers)]

    def state_dict_layers(self, fn: StateDictFn) -> "Stacked[LayerT]":
        """Names layer `i`'s `w1` `"<prefix>.i.w1"` in a state dict, as for a list
        of layers, wherever `stage_order` stores it: `fn` replaces `layers`, and
        the stack is rebuilt (checked)."""
        order = layers_in_stage_order(self.num_layers, self.stage_order)
        layers = fn(self.layers, LayerNumbering(0, (1,), order), (self.num_layers,))
        return restack(self, layers=layers)

    def with_layer(self, index: SupportsIndex, layer: LayerT) -> "Stacked[LayerT]":
        """A copy with layer `index` replaced by `layer` (layer surgery), every
        option kept (`eqx.tree_at(lambda s: s[i], ...)` cannot: `stack[i]` is
        computed from the stacked arrays).

        **Arguments:**

        - `index`: the layer to replace (negative counts from the end).
        - `layer`: the new layer, with the same structure, static fields, shapes
          and dtypes as the others (checked as by `from_layers`).

        **Returns:**

        A `Stacked` whose layer `index` is `layer`, the others this one's. An
        index out of range is an `IndexError`; a `layer` that cannot be stacked
        with the others a `ValueError` naming the leaf path and both values.
        """
        current = self[index]  # checks the index
        i = operator.index(index) % self.num_layers
        what = f"Stacked.with_layer({i}, ...)"
        check_state_indices(current, layer, what)
        check_alike([current, layer], what, names=(f"layer {i}", "the new layer"))
        # By leaves: `layer` may differ from the others only by identity.
        old, treedef = jtu.tree_flatten(self.layers)
        given = jtu.tree_leaves(layer)
        new = write(old, self._position(i), given)
        # A strongly typed leaf makes the stack's strong, as `from_layers` does
        # (written into a weak one it would compute in the dtype it meets).
        new = [
            n.astype(n.dtype) if weak_only(o, g) else n
            for n, o, g in zip(new, old, given)
        ]
        return restack(self, layers=jtu.tree_unflatten(treedef, new))

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

        - `x`: the carry, any pytree; every layer must return one of the same
          structure, shapes and dtypes.
        - `*args`, `**kwargs`: passed to every layer (broadcast), except values
          wrapped in [`eqxscan.per_layer`][], which are sliced per layer. For
          stateful layers (`layer(x, state) -> (x, state)`, e.g. with
          `eqx.nn.BatchNorm`), an `eqx.nn.State` from `eqx.nn.make_with_state`
          gives each layer its own slice, and the call returns `(x, state)`.
        - `key`: if given, split into `L` keys and layer `i` gets `key=keys[i]`.
        - `method`: run this instead of `__call__`: a function
          `fn(layer, x, *args, **kwargs)` such as an unbound method
          (`Block.decode`), or a method name (`"decode"`).
        - `reverse`: run layer `L-1` first and layer `0` last, the weights read
          backwards (no reversed copy, unlike `stack[::-1]`); layer `i` keeps
          `keys[i]` and its `per_layer` slice. It is the stack's, never passed
          on: with a layer whose method takes a `reverse` too, `TypeError`.

        **Returns:**

        The final carry (or `(carry, state)` when called with a state).
        """
        stack, call = self._call(args, kwargs, key, method, reverse, carry_only)
        return scan_layers(stack, x, call)[0]

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

        `(final carry, ys)` with the `y_i` stacked leaf by leaf on axis 0
        (`None` if layers return `(x, None)`; other leaves kept once, as one
        traced body gives them: with `mode="loop"`, numbers that differ by
        layer are stacked). `ys[i]` is layer `i`'s, also with `reverse=True`.
        """
        read_out = pairs("Stacked.scan")
        stack, call = self._call(args, kwargs, key, method, reverse, read_out)
        return scan_layers(stack, x, call)

    def _call(
        self,
        args: tuple[PyTree, ...],
        kwargs: dict[str, PyTree],
        key: PRNGKeyArray | None,
        method: Method | None,
        reverse: object,  # checked here, with a clear error
        read_out: ReadOut,
    ) -> tuple["Stacked", LayerCall]:  # old beartype: no generic forward ref here
        # The stack that runs (in natural order) and how it calls its layers:
        # built here and returned, so that a call's traceback passes no frame
        # of it on the way to the layers.
        stack = in_natural_order(self)
        check_method(method, stack.layers)
        check_per_layer(args, kwargs, stack.num_layers)
        if reverse := check_bool("reverse", reverse):
            check_reverse_free(method, stack.layers, "Stacked")
        call = LayerCall(args, kwargs, stack._keys(key), read_out, reverse, method)
        return stack, dropping_call(stack.drop_rates, call, key, "Stacked")

    def _keys(self, key: PRNGKeyArray | None) -> Array | None:
        # Layer i's key: `split(key, L)[i]`.
        return None if key is None else split_key(key, self.num_layers, "Stacked")

    def vmap(
        self,
        x: PyTree,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        method: Method | None = None,
        **kwargs: PyTree,
    ) -> PyTree:
        """Apply every layer to the same `x`, in parallel, and stack the outputs:
        `ys[i] = layer_i(x, *args, **kwargs)` (ensembles, mixture-of-experts).

        **Arguments:**

        - `x`, `*args`, `**kwargs`: given to every layer, except values wrapped
          in [`eqxscan.per_layer`][], which are sliced per layer.
        - `key`: if given, split into `L` keys and layer `i` gets `key=keys[i]`.
        - `method`: as for `__call__`.

        **Returns:**

        The outputs, stacked leaf by leaf on a new leading axis of length `L`
        (as for `scan`'s `ys`):
        one `jax.vmap` over the layer axis (a Python loop with `mode="loop"`).
        Nothing is scanned nor dropped: `remat`, `unroll`, `drop_path` and
        `layer_drop` do not apply.
        """
        stack = in_natural_order(self)
        check_method(method, stack.layers)
        call = LayerCall(
            args, kwargs, stack._keys(key), method=method, caller="Stacked.vmap"
        )
        return vmap_layers(stack, x, call)


def in_natural_order(group: Any) -> Any:
    """`group`, if a stack in stage order, read back in its natural order (a
    copy, through the permutation): where it runs, layer `i` runs `i`-th."""
    if isinstance(group, Stacked) and group.stage_order is not None:
        return permute_stack(group, *group.stage_order, inverse=True, stage_order=None)
    return group


def restack(stack: Stacked[LayerT], **changes: object) -> Stacked[LayerT]:
    """`stack` rebuilt through `Stacked.__init__` with `changes` (its arguments,
    or `options`) applied and every other field kept (inference mode included;
    `stage_order` only for the same number of layers)."""
    drop_path, layer_drop = rates_of(stack.drop_rates)
    same = changes.get("num_layers", stack.num_layers) == stack.num_layers
    fields: dict[str, object] = dict(
        layers=stack.layers,
        num_layers=stack.num_layers,
        layer_sharding=stack.layer_sharding,
        drop_path=drop_path,
        layer_drop=layer_drop,
        stage_order=stack.stage_order if same else None,
    )
    fields.update(changes)
    options = fields.pop("options", stack.options)
    assert isinstance(options, ScanOptions)
    fields["layers"] = _Restacked(fields["layers"])
    # `fields` holds what `__init__` takes, by name.
    new = type(stack)(**fields, **options.as_args())  # type: ignore[arg-type]  # see above
    drop = with_mode_of(new.drop_rates, stack.drop_rates)
    if drop is new.drop_rates:
        return new
    return eqx.tree_at(lambda s: s.drop_rates, new, drop)


def permute_stack(
    stack: Stacked[LayerT], stages: int, repeats: int, inverse: bool, **changes: object
) -> Stacked[LayerT]:
    """`stack` with its layers and per-layer drop rates permuted into stage order
    (or back), as `permute_stage_order` says; `changes` as for `restack`."""
    one = lambda a: permute_stage_order(a, stages, repeats, inverse)
    layers = jtu.tree_map(lambda a: one(a) if eqx.is_array(a) else a, stack.layers)
    order, drop = one(np.arange(stack.num_layers)), stack.drop_rates
    if drop is not None:
        for name in ("drop_path", "layer_drop"):
            changes[name] = tuple(getattr(drop, name)[i] for i in order)
    return restack(stack, layers=layers, **changes)
