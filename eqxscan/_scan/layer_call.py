"""The layer-call seam: how a container hands layer `i` what it is called with,
and takes back what it returns.

Every container (`Stacked`; a `Chain`'s lone layers, stacks and patterns;
`run_until`, `run_layers`, `sharding.pipeline`; a `Recurrent`'s cell, on a
call `over="time"`) describes a call of its layers as one `LayerCall`:
`at(i)` is layer `i`'s `OneLayer` (its `per_layer` slices, key and drop
inputs), `placed` cuts the call to one group of a `Chain`, `scanned` splits it
into the arrays a scan slices, and `run_one` calls the layer (method, key,
drop-path, LayerDrop, its index, named scope and taps) and reads its output as
`(carry, y)`. Nothing here knows a container's layout, and nothing outside
knows how arguments, keys and drop inputs are sliced; layers are cut with
`index` and `take` and written with `write` (from `layer_io.py`, re-exported
here).

A `per_layer` value is read-only; a buffer that layers update (an
[`eqxscan.buffer`][], e.g. a KV cache) travels in the carry instead: layer `i`
gets a view of its slice, and `run_one` writes what it returned back into the
one stacked buffer (`buffers.py`), returning `((carry, buffer), y)`.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import Array, Bool, PyTree

from .._helpers.checks import check_leading_axis, check_takes_key, describe
from .._helpers.stateful import clone, replace_arg
from .buffers import call_writing, find_buffer, PerLayer, view_of
from .drop_rates import drop_path, DropInputs, layer_drop
from .layer_index import at_layer
from .layer_io import (
    Index as Index,
    index as index,
    Indices as Indices,
    take as take,
    write as write,
)
from .taps import inside_layer, tapped, untapped


def arg_name(index_or_name: int | str) -> str:
    """How errors name a call's argument: `args[0]`, `kwargs['cache']`."""
    if isinstance(index_or_name, int):
        return f"args[{index_or_name}]"
    return f"kwargs[{index_or_name!r}]"


def check_per_layer(args: tuple, kwargs: dict, length: int) -> dict[str, PerLayer]:
    """The [`eqxscan.per_layer`][] arguments of a call, by name (`args[0]`,
    `kwargs['cache']`), after checking that their array leaves have leading axis
    `length`."""
    given = (*enumerate(args), *kwargs.items())
    found = {arg_name(k): v for k, v in given if isinstance(v, PerLayer)}
    for name, value in found.items():
        if not any(map(eqx.is_array, jtu.tree_leaves(value.tree))):
            raise TypeError(
                f"per_layer {name} holds no arrays to slice (got "
                f"{describe(value.tree)}), so every layer would get all of it."
                "\nHint: pass an array with the layer axis first, e.g. "
                "`eqxscan.per_layer(jnp.asarray(values))`."
            )
        check_leading_axis(value.tree, length, f"per_layer {name}", "layer")
    return found


ReadOut = Callable[[object, str], tuple[PyTree, PyTree]]
"""How a layer's output is read, given the layer's name: as the carry alone
(`carry_only`) or as a `(carry, y)` pair (`pairs(caller)`)."""


def carry_only(out: object, who: str) -> tuple[PyTree, PyTree]:
    """A layer's output read as the new carry, with no `y`."""
    del who
    return out, None


def pairs(caller: str) -> ReadOut:
    """The read-out of `caller`'s layers (e.g. `"Stacked.scan"`'s), which return
    `(carry, y)` pairs."""

    def read(out: object, who: str) -> tuple[PyTree, PyTree]:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{caller} expects each layer to return a (carry, y) pair, but "
                f"{who} returned {describe(out)}. Call the module itself for "
                "layers that return only the carry."
            )
        return out

    return read


Method = Callable[..., PyTree] | str
"""What to run of each layer instead of `__call__`: a function
`fn(layer, x, *args, **kwargs)` (e.g. an unbound method, `Block.decode`) or the
name of a method (`"decode"`)."""


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


class OneLayer(NamedTuple):
    """What one layer is called with: its arguments (its `per_layer` slices),
    key, drop inputs and global index (a time step `over="time"`; `None` when
    not known), which taps record it by."""

    args: tuple
    kwargs: dict[str, object]
    key: Array | None = None
    drop: DropInputs | None = None
    number: Index | None = None


PatternStep = Callable[[object, PyTree, OneLayer], PyTree]
"""How a `Chain` runs one pattern step (one repeat of a repeated pattern, several
layers in one scan step): `pattern_step(repeat, carry, one) -> output`, read as
a layer's output is; `one` holds the repeat's slices (per-layer arguments, keys
and drop inputs with the pattern's layer axis first), and `LayerCall.inner(one)`
is the call of the pattern's own layers."""


class LayerCall(NamedTuple):
    """How every layer of a run is called.

    - `args`, `kwargs`: passed to every layer; [`eqxscan.per_layer`][] values
      are sliced per layer.
    - `keys`: per-layer keys, or `None`; `read_out`: `carry_only` or
      `pairs(...)`; `reverse`: last layer first; `method`: what runs of each
      layer (`None`: `__call__`).
    - `runs`: LayerDrop's choice when the caller drew it (a pipeline stage's
      chunk of the stack's): a scan then runs only the layers that run.
    - `drop`: drop-path and LayerDrop inputs, one entry per layer, or `None`.
    - `optional_key`: a layer that takes no `key` is called without one (the
      key was given for dropping only).
    - `pattern_step`: set when each scan step is a pattern step (see
      `PatternStep`); the per-layer values then have the repeat axis first.
    - `caller`: names the container in errors.
    - `start`, `stride`: layer `i` of this call is the outermost container's
      layer number `start + i * stride`; `start` is `None` when not known.
    - `over`: `"layers"`, or a `Recurrent`'s `"time"` steps, which set no
      [`eqxscan.layer_index`][] and are tapped by time step.
    """

    args: tuple
    kwargs: dict[str, object]
    keys: Array | None
    read_out: ReadOut = carry_only
    reverse: bool = False
    method: Method | None = None
    runs: Bool[Array, " L"] | None = None
    drop: DropInputs | None = None
    optional_key: bool = False
    pattern_step: PatternStep | None = None
    caller: str = "Stacked"
    start: Index | None = 0
    stride: int = 1
    over: Literal["layers", "time"] = "layers"

    def number_of(self, i: Index) -> Index | None:
        """The layer number of this call's layer (or pattern step) `i`."""
        return None if self.start is None else self.start + i * self.stride

    def per_layer_values(self) -> tuple[PyTree, ...]:
        """Everything with a leading layer axis, in one tuple (for slicing)."""
        per = [v.tree for v in self._arguments() if isinstance(v, PerLayer)]
        return (tuple(per), self.keys, self.drop)

    def _arguments(self) -> list[object]:
        return [*self.args, *self.kwargs.values()]

    def _split(self, values: Sequence[object]) -> tuple[tuple, dict[str, object]]:
        # `values` (one per argument, as `_arguments` lists them) as args, kwargs.
        return tuple(values[: len(self.args)]), dict(
            zip(self.kwargs, values[len(self.args) :])
        )

    def _filled(self, trees: Sequence[PyTree], wrap: bool) -> tuple[tuple, dict]:
        # The arguments with the `per_layer` ones replaced by `trees`, in order
        # (wrapped as `per_layer` again when `wrap`).
        it = iter(trees)
        values = [
            (PerLayer(next(it)) if wrap else next(it)) if isinstance(v, PerLayer) else v
            for v in self._arguments()
        ]
        return self._split(values)

    def _with_per_layer(self, new: tuple[PyTree, ...]) -> "LayerCall":
        # `self` with its per-layer values replaced by `new` (as
        # `per_layer_values` lists them).
        trees, keys, drop = new
        args, kwargs = self._filled(trees, wrap=True)
        return self._replace(args=args, kwargs=kwargs, keys=keys, drop=drop)

    def _one(self, new: tuple[PyTree, ...]) -> OneLayer:
        # One layer's inputs from its slices `new` of the per-layer values.
        trees, key, drop = new
        return OneLayer(*self._filled(trees, wrap=False), key, drop)

    def at(self, i: Index) -> OneLayer:
        """Layer `i`'s inputs: slice `i` of every per-layer value (a static
        slice for an int, a dynamic one for an array index)."""
        one = self._one(index(self.per_layer_values(), i))
        return one._replace(number=self.number_of(i))

    def take(self, idx: Indices) -> "LayerCall":
        """The call of the layers `idx` (a static slice or index array), in
        that order: every per-layer value cut to them."""
        start = None
        if isinstance(idx, slice) and idx.step in (None, 1) and self.start is not None:
            start = self.start + (idx.start or 0)
        new = self._with_per_layer(take(self.per_layer_values(), idx))
        return new._replace(start=start, stride=1)

    def placed(self, start: int, size: int, per_step: int) -> "LayerCall":
        """The call of layers `start .. start + size - 1` as one group: a stack
        (`per_step == 1`), or `size // per_step` pattern steps of `per_step`
        layers (`per_step >= 2`; the per-layer values get a repeat axis in
        front of the pattern's layer axis)."""
        part = take(self.per_layer_values(), slice(start, start + size))
        if per_step > 1:
            part = jtu.tree_map(
                lambda a: (
                    a.reshape(size // per_step, per_step, *a.shape[1:])
                    if eqx.is_array(a)
                    else a
                ),
                part,
            )
        new = self._with_per_layer(part)
        return new._replace(start=self.number_of(start), stride=max(per_step, 1))

    def inner(self, one: OneLayer) -> "LayerCall":
        """The call of a pattern's own layers, from one repeat's inputs `one` (see
        `PatternStep`): its slices of the per-layer arguments are per layer again."""
        flags = [isinstance(v, PerLayer) for v in self._arguments()]
        values = [*one.args, *one.kwargs.values()]
        values = [PerLayer(v) if f else v for v, f in zip(values, flags)]
        args, kwargs = self._split(values)
        return self._replace(
            args=args,
            kwargs=kwargs,
            keys=one.key,
            drop=one.drop,
            runs=None,
            pattern_step=None,
            start=one.number,
            stride=1,
        )

    def scanned(self) -> tuple[PyTree, Callable[[PyTree], OneLayer]]:
        """`(xs, one)`: the array parts of the per-layer values, each with the
        layer axis first (what a scan slices), and `one(x_i)`, the layer's
        inputs rebuilt from one step's slice."""
        dyn, static = eqx.partition(self.per_layer_values(), eqx.is_array)
        return dyn, lambda x: self._one(eqx.combine(x, static))


def run_one(
    layer: object, call: LayerCall, one: OneLayer, carry: PyTree, who: str
) -> tuple[PyTree, PyTree]:
    """Run `layer` on `carry` as `call` says, with its inputs `one`, and read its
    output as `(carry, y)`: its method and key, then drop-path and (for a layer
    whose scan does not skip it) LayerDrop. `who` names the layer in errors.

    With a buffer view among its inputs (see `eqxscan/_scan/buffers.py`), a layer
    (not a pattern step, which passes the view on to its own layers) returns
    `(carry, new_slice)` where it would return its carry, and the result is
    `((carry, buffer), y)`, the buffer with the layer's writes made."""
    at = find_buffer(one.args, one.kwargs) if call.pattern_step is None else None
    if at is not None:
        return _run_writing(layer, call, one, at, carry, who)
    if call.pattern_step is not None:
        # A pattern step drops and keys its own layers.
        return call.read_out(call.pattern_step(layer, carry, one), who)
    method, key = call.method, one.key
    # What runs (`__call__` for no method), for reading its signature.
    target: Callable[..., PyTree] = (
        getattr(layer, method) if isinstance(method, str) else method or layer  # pyright: ignore[reportAssignmentType]  # a module is callable
    )
    if key is not None:
        try:
            check_takes_key(target, call.caller, "layer i gets key=keys[i]")
        except TypeError:
            if not call.optional_key:
                raise
            key = None  # given for dropping only
    keyed = {} if key is None else {"key": key}
    if callable(method):
        target = functools.partial(method, layer)

    drop = one.drop

    def fn(c: PyTree) -> tuple[PyTree, PyTree]:
        new, y = call.read_out(target(c, *one.args, **keyed, **one.kwargs), who)
        return (new if drop is None else drop_path(c, new, drop)), y

    old = clone(carry)  # the layer may invalidate `carry` (an `eqx.nn.State`)
    number = one.number if call.over == "layers" else None
    # Named for profiles: a scanned stack's ops carry the layer's class.
    with at_layer(number), inside_layer(), jax.named_scope(type(layer).__name__):
        if drop is None or drop.runs is None:  # called here: one frame less
            out = target(carry, *one.args, **keyed, **one.kwargs)
            new, y = call.read_out(out, who)
            new = new if drop is None else drop_path(carry, new, drop)
        else:
            new, y = layer_drop(fn, drop, carry)
    return tapped(one.number, new, old, None if drop is None else drop.runs), y


def _run_writing(
    layer: object,
    call: LayerCall,
    one: OneLayer,
    at: int | str,
    carry: PyTree,
    who: str,
) -> tuple[PyTree, PyTree]:
    # Layer `who` given its slice of the buffer at `at`; its new slice written
    # back (only the rows it wrote, when it wrote rows).
    # Dropping with a buffer is refused at the call (check_keeps_writes).
    assert one.drop is None, who
    view = view_of(one.args, one.kwargs, at)

    def fn(old: PyTree) -> tuple[tuple[PyTree, PyTree], PyTree]:
        args, kwargs = replace_arg(one.args, one.kwargs, at, old)  # pyright: ignore[reportArgumentType]  # the slice stands where the view was
        with untapped():  # tapped below: records must not leave this trace
            new, y = run_one(
                layer, call, one._replace(args=args, kwargs=kwargs), carry, who
            )
        if not (isinstance(new, tuple) and len(new) == 2):
            raise TypeError(
                f"{who} is called with an eqxscan.buffer, so it must return "
                f"(x, buffer) where it returns its carry, but it returned "
                f"{describe(new)}.\nHint: return the layer's new buffer slice beside x "
                "(unchanged if the layer does not write)."
            )
        return (new[0], y), new[1]

    (new_carry, y), tree = call_writing(fn, view, who)
    return (tapped(one.number, new_carry, carry), tree), y


LayerFn = Callable[[PyTree], PyTree]
"""One layer as a function of the carry (its inputs bound): `carry -> carry`."""


class GroupSteps(NamedTuple):
    """One group of a container's layers, for a walk over them in order (early
    exit): `steps` steps of `per_step` layers each (`0`: a lone layer, one
    step, not in a loop), as a `Chain`'s `Placement` says, its first layer the
    container's layer `start`. `step(j)` is step `j` (an int, or a traced index
    inside a loop): one layer as a function of the carry, or the groups of one
    pattern step. `name` is its layers' class for errors."""

    start: int
    steps: int
    per_step: int
    step: "Callable[[Index], LayerFn | tuple[GroupSteps, ...]]"
    name: str
