"""The layer-call seam, shared by every container: a `LayerCall` describes a
call of every layer, `at(i)` is layer `i`'s `OneLayer` (its `per_layer` slices,
key and drop inputs), and `run_one` calls one layer (method, key, drops, index,
named scope, taps) and reads its output."""

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import Array, Bool, PyTree

from .._helpers.checks import check_takes_key, describe, misaligned
from .._helpers.stateful import clone, replace_arg
from .buffers import call_writing, find_buffer, PerLayer, view_of
from .call_state import changed_call_state
from .drop_rates import drop_path, DropInputs, layer_drop
from .layer_io import (
    Index as Index,
    index as index,
    Indices as Indices,
    take as take,
    write as write,
)
from .options import Scanning
from .taps import inside_layer, tapped, untapped


def arg_name(index_or_name: int | str) -> str:
    """How errors name a call's argument: `args[0]`, `kwargs['cache']`."""
    if isinstance(index_or_name, int):
        return f"args[{index_or_name}]"
    return f"kwargs[{index_or_name!r}]"


def check_per_layer(args: tuple, kwargs: dict, length: int) -> dict[str, PerLayer]:
    """The [`eqxscan.per_layer`][] arguments of a call by name (`args[0]`,
    `kwargs['cache']`), checked to hold arrays with leading axis `length`."""
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
        if (bad := misaligned(value.tree, length)) is not None:
            raise ValueError(
                f"per_layer {name}{bad[0]} has shape {tuple(bad[1].shape)}, but "
                f"its leading axis must be the layer axis of length {length}."
            )
    return found


# How a layer's output is read, given the layer's name, as `(carry, y)`.
ReadOut = Callable[[object, str], tuple[PyTree, PyTree]]


def carry_only(out: object, who: str) -> tuple[PyTree, PyTree]:
    del who
    return out, None


def pairs(caller: str) -> ReadOut:
    """The read-out of `caller`'s layers (`"Stacked.scan"`'s): `(carry, y)`."""

    def read(out: object, who: str) -> tuple[PyTree, PyTree]:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{caller} expects each layer to return a (carry, y) pair, but "
                f"{who} returned {describe(out)}. Call the module itself for "
                "layers that return only the carry."
            )
        return out

    return read


# What runs of each layer instead of `__call__`: `fn(layer, x, ...)` or a name.
Method = Callable[..., PyTree] | str


def check_method(method: object, layer: object) -> None:
    """Raise unless `method` is `None`, a callable, or the name of a method of
    `layer` (a layer, or stacked layers)."""
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


def check_reverse_free(method: object, layer: object, caller: str) -> None:
    """Raise if the layers' method takes a `reverse` of its own: a container's
    `reverse=True` runs the layers backwards and never reaches them."""
    if isinstance(layer, Scanning):
        return  # a container as a layer: its `reverse` is its own, as it was
    name = method if isinstance(method, str) else "__call__"
    fn = method if callable(method) else getattr(layer, name, None)
    if isinstance(fn, functools.partial) and "reverse" in fn.keywords:
        return  # bound already (`partial(Flow.__call__, reverse=True)`)
    try:
        param = inspect.signature(fn).parameters.get("reverse")  # pyright: ignore[reportArgumentType]  # a callable, else refused below
    except (TypeError, ValueError):  # no signature to read
        return
    if param is not None and param.kind is not inspect.Parameter.VAR_KEYWORD:
        where = getattr(fn, "__qualname__", f"{type(layer).__name__}.{name}")
        raise TypeError(
            f"{caller}(..., reverse=True) runs the layers last to first and passes "
            f"no `reverse` on, but {where} takes a `reverse` of its own.\nHint: "
            "rename the layer's keyword; `reverse=` is the container's."
        )


class OneLayer(NamedTuple):
    """What one layer is called with: its arguments (`per_layer` slices), key,
    drop inputs and number (its global index, or a `Recurrent`'s time step;
    `None` when not known), by which taps record it."""

    args: tuple
    kwargs: dict[str, object]
    key: Array | None = None
    drop: DropInputs | None = None
    number: Index | None = None


# A `Chain`'s pattern step (one repeat of a pattern, in one scan step):
# `pattern_step(repeat, carry, one) -> output`, `one` the repeat's slices.
PatternStep = Callable[[object, PyTree, OneLayer], PyTree]


class LayerCall(NamedTuple):
    """How every layer of a run is called: `args`, `kwargs` (`per_layer` values
    sliced per layer), per-layer `keys` and `drop` inputs, `read_out`, `reverse`
    and `method` (`None`: `__call__`). `runs`: LayerDrop's choice drawn by the
    caller (a pipeline's chunk). `optional_key`: a layer taking no `key` gets none
    (given for dropping only). `pattern_step`: each scan step is a pattern step
    (the repeat axis first). `caller` names the container in errors. Layer `i`
    is the outermost container's layer `start + i * stride` (`start` is `None`
    when not known, and for a `Recurrent`'s time steps, which are no layers)."""

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

    def number_of(self, i: Index | None) -> Index | None:
        """The layer number of this call's layer (or pattern step) `i`."""
        if self.start is None or i is None:
            return None
        return self.start + i * self.stride

    def per_layer_values(self) -> tuple[PyTree, ...]:
        """Everything with a leading layer axis, in one tuple (for slicing)."""
        per = [v.tree for v in self._arguments() if isinstance(v, PerLayer)]
        return (tuple(per), self.keys, self.drop)

    def _arguments(self) -> list[object]:
        return [*self.args, *self.kwargs.values()]

    def _filled(self, trees: Sequence[PyTree], wrap: bool) -> tuple[tuple, dict]:
        # The arguments, the `per_layer` ones replaced by `trees` in order
        # (wrapped as `per_layer` again when `wrap`).
        it = iter(trees)
        values = [
            (PerLayer(next(it)) if wrap else next(it)) if isinstance(v, PerLayer) else v
            for v in self._arguments()
        ]
        return self._split(values)

    def _split(self, values: Sequence[object]) -> tuple[tuple, dict]:
        # `values`, one per argument, as `(args, kwargs)`.
        n = len(self.args)
        return tuple(values[:n]), dict(zip(self.kwargs, values[n:]))

    def _with_per_layer(self, new: tuple[PyTree, ...]) -> "LayerCall":
        # `self` with its per-layer values replaced by `new`.
        trees, keys, drop = new
        args, kwargs = self._filled(trees, wrap=True)
        return self._replace(args=args, kwargs=kwargs, keys=keys, drop=drop)

    def _one(self, new: tuple[PyTree, ...]) -> OneLayer:
        # One layer's inputs from its slices `new` of the per-layer values.
        trees, key, drop = new
        return OneLayer(*self._filled(trees, wrap=False), key, drop)

    def at(self, i: Index) -> OneLayer:
        """Layer `i`'s inputs (`i` an int, or a traced index)."""
        one = self._one(index(self.per_layer_values(), i))
        return one._replace(number=self.number_of(i))

    def take(self, idx: Indices) -> "LayerCall":
        """The call of the layers `idx` (a static slice or index array)."""
        start = None
        if isinstance(idx, slice) and idx.step in (None, 1) and self.start is not None:
            start = self.start + (idx.start or 0)
        new = self._with_per_layer(take(self.per_layer_values(), idx))
        return new._replace(start=start, stride=1)

    def placed(self, start: int, size: int, per_step: int) -> "LayerCall":
        """The call of layers `start .. start + size - 1` as one group: a stack
        (`per_step == 1`), or `size // per_step` pattern steps of `per_step`
        layers (the per-layer values get a repeat axis in front)."""
        part = take(self.per_layer_values(), slice(start, start + size))
        if per_step > 1:
            rows = (size // per_step, per_step)
            part = jtu.tree_map(
                lambda a: a.reshape(*rows, *a.shape[1:]) if eqx.is_array(a) else a, part
            )
        new = self._with_per_layer(part)
        return new._replace(start=self.number_of(start), stride=max(per_step, 1))

    def inner(self, one: OneLayer) -> "LayerCall":
        """The call of a pattern's own layers from one repeat's inputs `one` (its
        per-layer slices per layer again, its other arguments as given)."""
        values = [
            PerLayer(v) if isinstance(own, PerLayer) else v
            for v, own in zip([*one.args, *one.kwargs.values()], self._arguments())
        ]
        args, kwargs = self._split(values)
        new = self._replace(args=args, kwargs=kwargs, keys=one.key, drop=one.drop)
        return new._replace(runs=None, pattern_step=None, start=one.number, stride=1)

    def scanned(self) -> tuple[PyTree, Callable[[PyTree], OneLayer]]:
        """`(xs, one)`: the arrays of the per-layer values (what a scan slices),
        and `one(x_i)`, a layer's inputs rebuilt from one step's slice."""
        dyn, static = eqx.partition(self.per_layer_values(), eqx.is_array)
        return dyn, lambda x: self._one(eqx.combine(x, static))


def run_one(
    layer: object, call: LayerCall, one: OneLayer, carry: PyTree, who: str
) -> tuple[PyTree, PyTree]:
    """Run `layer` on `carry` with its inputs `one`, as `call` says: `(carry, y)`
    (`who` names it in errors). Given a buffer view (not in a pattern step, which
    passes it on), the layer returns `(carry, new_slice)` for its carry, and this
    `((carry, buffer), y)`, the layer's writes made (`buffers.py`)."""
    if call.pattern_step is not None:
        # A pattern step drops and keys its own layers (and passes a buffer on).
        return call.read_out(call.pattern_step(layer, carry, one), who)
    if (at := find_buffer(one.args, one.kwargs)) is not None:
        return _run_writing(layer, call, one, at, carry, who)
    method, key = call.method, one.key
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
    number = None if call.start is None else one.number  # a time step is no layer
    # Named for profiles: a scanned stack's ops carry the layer's class.
    with (
        changed_call_state(layer=number),
        inside_layer(),
        jax.named_scope(type(layer).__name__),
    ):
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
    # `layer` given its slice of the buffer at `at`; its new slice written back.
    assert one.drop is None, who  # refused at the call (check_keeps_writes)
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


# One layer as a function of the carry (its inputs bound): `carry -> carry`.
LayerFn = Callable[[PyTree], PyTree]
