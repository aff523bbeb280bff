"""What one run of a `Recurrent` is given, checked: its own keywords
(`RecurrentArgs`), the time axis and length of `xs`, the mask, truncation, the
cell's keyword arguments, and the shapes the known cells take."""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypedDict

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, PyTree

from .._helpers.checks import check_bool, check_size, describe, docs, is_array
from .._scan.options import OPTION_NAMES


class RecurrentArgs(TypedDict, total=False):
    """The keyword arguments that control a run of [`eqxscan.Recurrent`][] (and
    both directions of [`eqxscan.Bidirectional`][]), defined once. The cell's own
    arguments are never among them: they go in `cell_kwargs=`."""

    mask: ArrayLike | None
    truncate: int | None
    length: int | None
    time_axis: int
    broadcast_key: bool


_CONTROLS = tuple(RecurrentArgs.__annotations__)


class Controls(NamedTuple):
    """`RecurrentArgs`, checked once against `xs`: what one run needs."""

    length: int
    time_axis: int
    mask: Bool[Array, " T"] | None
    truncate: int | None
    broadcast_key: bool


#: A `Recurrent`'s own keywords besides the scan options (`mode`, `remat`,
#: `unroll`): given to a call, none of them is the cell's.
OWN_OPTIONS = ("reverse", "method", "chunk_size")
_BUILT_WITH = (*OWN_OPTIONS, *OPTION_NAMES)


def check_names(who: str, options: Mapping[str, object]) -> None:
    unknown = [name for name in options if name not in _CONTROLS]
    if built := [name for name in unknown if name in _BUILT_WITH]:
        raise TypeError(
            f"{who} got {built[0]!r} when called, but it is an option of the "
            f"module, set when it is built.\nHint: Recurrent(cell, {built[0]}=...), "
            f"or rnn.with_options({built[0]}=...)."
        )
    if unknown:
        names = ", ".join(repr(n) for n in unknown)
        example = ", ".join(f"{n!r}: ..." for n in unknown)
        raise TypeError(
            f"{who} got unknown keyword argument{'s' if len(unknown) > 1 else ''} "
            f"{names}; its own keywords are {', '.join(_CONTROLS)}, key and "
            "cell_kwargs.\nHint: the cell's own keyword arguments go in one dict, "
            f"passed to the cell at every step: cell_kwargs={{{example}}}."
        )


def _static(name: str, value: object) -> object:
    """An option that shapes the program, a NumPy scalar read as a Python one
    in either mode (as a compiled call reads it). An array, 0-d too, is refused:
    the eager compile traces it, so only `mode="loop"` could read it."""
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, (jax.Array, np.ndarray)):
        kind = "bool" if name == "broadcast_key" else "int"
        raise TypeError(
            f"{name} must be a Python {kind}, got an array {describe(value)}: it "
            "shapes the program, which is traced once for every value of an array."
            f"\nHint: pass {name}={kind}(...) of a concrete value (see "
            f"{docs('recurrent.md#errors')})."
        )
    return value


def controls(who: str, xs: PyTree, options: Mapping[str, object]) -> Controls:
    check_names(who, options)
    options = {k: v if k == "mask" else _static(k, v) for k, v in options.items()}
    time_axis = options.get("time_axis", 0)
    if isinstance(time_axis, bool) or not isinstance(time_axis, int):
        raise TypeError(
            f"time_axis must be an int, got {type(time_axis).__name__} ({time_axis!r})."
        )
    length = _time_length(xs, options.get("length"), time_axis)
    broadcast_key = options.get("broadcast_key", False)
    broadcast_key = check_bool("broadcast_key", broadcast_key)
    mask, truncate = options.get("mask"), options.get("truncate")
    mask = None if mask is None else _check_mask(mask, length)
    if truncate is not None:  # a block longer than the sequence is the sequence
        truncate = min(check_size("truncate", truncate), max(length, 1))
    return Controls(length, time_axis, mask, truncate, broadcast_key)


def check_cell_kwargs(cell_kwargs: Mapping[str, PyTree] | None) -> dict[str, PyTree]:
    if cell_kwargs is None:
        return {}
    if not isinstance(cell_kwargs, Mapping) or not all(
        isinstance(k, str) for k in cell_kwargs
    ):
        raise TypeError(
            "cell_kwargs must be a dict of the cell's keyword arguments (str keys), "
            f"got {describe(cell_kwargs)}."
        )
    if "key" in cell_kwargs:
        raise TypeError(
            "cell_kwargs has 'key', but Recurrent hands the cell its key itself: pass "
            "key=... to the call (split per step, or the same key at every step "
            "with broadcast_key=True)."
        )
    return dict(cell_kwargs)


def time_major(xs: PyTree, time_axis: int) -> PyTree:
    """`xs` with the time axis of every array leaf moved to axis 0."""
    if time_axis == 0:
        return xs
    return jtu.tree_map(
        lambda a: jnp.moveaxis(a, time_axis, 0) if eqx.is_array(a) else a, xs
    )


def time_layout(hs: PyTree, time_axis: int) -> PyTree:
    """`hs` (time on axis 0) with time moved to `time_axis`, as in `xs`."""
    if time_axis == 0:
        return hs

    def one(path: tuple, a: object) -> object:
        if not is_array(a):
            return a
        if not -a.ndim <= time_axis < a.ndim:
            raise ValueError(
                f"hs{jtu.keystr(path)} (the carry stacked over time) has shape "
                f"{tuple(a.shape[1:])} per step, so it has no axis time_axis="
                f"{time_axis} to put time on. Give every carry leaf that axis, or "
                "run per example with `jax.vmap(rnn)`."
            )
        return jnp.moveaxis(jnp.asarray(a), 0, time_axis)

    return jtu.tree_map_with_path(one, hs)


def _time_length(xs: PyTree, length: object, time_axis: int) -> int:
    """The number of steps: the length of the time axis of `xs`, or `length`."""
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int) or length < 0
    ):
        raise ValueError(f"length must be a non-negative int or None, got {length!r}.")
    arrays = [(p, a) for p, a in jtu.tree_leaves_with_path(xs) if eqx.is_array(a)]
    if not arrays:
        if length is None:
            raise ValueError(
                "xs has no array leaves, so it has no time axis. Pass the inputs "
                "with time on axis 0 (e.g. an array of shape (T, input_size)), or "
                "`length=T` to run T steps without inputs."
            )
        return length
    where = "axis 0" if time_axis == 0 else f"axis time_axis={time_axis}"
    path, first = arrays[0]
    if first.ndim == 0:
        raise ValueError(
            f"xs{jtu.keystr(path)} is a scalar, but every array in xs needs a "
            f"time axis ({where})."
        )
    for p, a in arrays:  # `first` itself is checked first
        if not -a.ndim <= time_axis < a.ndim:
            raise ValueError(
                f"xs{jtu.keystr(p)} has shape {tuple(a.shape)}, which has no axis "
                f"time_axis={time_axis}; every array in xs needs its time axis there."
            )
        if a.shape[time_axis] != first.shape[time_axis]:
            raise ValueError(
                f"xs{jtu.keystr(p)} has shape {tuple(a.shape)}, but its {where} must "
                f"be the time axis of length {first.shape[time_axis]} (set by "
                f"xs{jtu.keystr(path)})."
            )
    found = first.shape[time_axis]
    if length is not None and length != found:
        raise ValueError(
            f"length={length} was given, but xs{jtu.keystr(path)} has {found} steps "
            f"on {where}; pass one or the other, or make them agree."
        )
    return found


def _check_mask(mask: object, length: int) -> Bool[Array, " T"]:
    if not is_array(mask):
        raise TypeError(
            f"mask must be a boolean array of shape ({length},), got "
            f"{type(mask).__name__}."
        )
    if mask.dtype != jnp.bool_ or mask.shape != (length,):
        raise ValueError(
            f"mask must be a boolean array of shape ({length},) (one entry per time "
            f"step of xs), got {jnp.dtype(mask.dtype).name}{list(mask.shape)}. "
            "For a batch, build `mask = jnp.arange(T)[None, :] < lengths[:, None]` "
            "and map over it: `jax.vmap(rnn)(h0, xs, mask=mask)`."
        )
    return jnp.asarray(mask)


def check_known_cell(
    cell: Callable[..., PyTree], h0: PyTree, xs: PyTree, time_axis: int
) -> None:
    """Check `h0` and `xs` (time on `time_axis`) up front against a cell whose
    shapes are known, which a batched or mis-sized input otherwise fails deep
    inside with a bare `dot_general` error: exactly `eqx.nn.GRUCell` or
    `eqx.nn.LSTMCell` (a subclass may take other shapes), or a class declaring
    `known_shapes = True` for its `input_size` and `hidden_size`."""
    known = type(cell) in (eqx.nn.GRUCell, eqx.nn.LSTMCell)
    if not (known or vars(type(cell)).get("known_shapes") is True):
        return
    sizes: Any = cell  # it has `input_size` and `hidden_size`, checked above
    n, hidden = sizes.input_size, (sizes.hidden_size,)
    name = f"{type(cell).__name__}(input_size={n}, hidden_size={hidden[0]})"
    batch_hint = " Recurrent runs one sequence; for a batch, `jax.vmap(rnn)(h0, xs)`."
    pair = isinstance(h0, (tuple, list))
    if type(cell) is eqx.nn.LSTMCell:
        shaped = pair and len(h0) == 2 and all(is_array(a) for a in h0)
        ok = shaped and all(a.shape == hidden for a in h0)
        expected = f"a pair (h, c) of arrays of shape {hidden}"
    else:
        ok = is_array(h0) and h0.shape == hidden
        expected = f"an array of shape {hidden}"
    if not ok:
        got = "(" + ", ".join(map(describe, h0)) + ")" if pair else describe(h0)
        raise ValueError(
            f"h0 is {got}, but {name} takes a carry that is {expected}." + batch_hint
        )
    step = list(xs.shape) if is_array(xs) else []
    if step:
        del step[time_axis]  # an axis of `xs`, checked by `controls`
    if step != [n]:
        want = f"(T, {n})" if time_axis == 0 or time_axis < -1 else f"({n}, T)"
        raise ValueError(
            f"xs is {describe(xs)}, but {name} takes one input of shape ({n},) "
            f"per step, so xs must have shape {want}." + batch_hint
        )


def where(cond: Bool[Array, ""], new: PyTree, old: PyTree) -> PyTree:
    # `jnp.where` on the array leaves; other leaves of a carry never change.
    return jtu.tree_map(
        lambda a, b: jnp.where(cond, a, b) if eqx.is_array(a) else a, new, old
    )


def block_starts(controls: Controls, reverse: bool) -> Bool[Array, " T"] | None:
    """The steps where a block of `truncate` consumed steps begins (`None`
    without truncation). A masked step is skipped, not consumed: padding moves
    no block boundary, and never starts a block."""
    if controls.truncate is None:
        return None
    mask = controls.mask
    kept = jnp.ones(controls.length, bool) if mask is None else mask
    kept = kept.astype(jnp.int32)[:: -1 if reverse else 1]  # in consumption order
    before = jnp.cumsum(kept) - kept
    before = before[::-1] if reverse else before
    cut = (before > 0) & (before % controls.truncate == 0)
    return cut if mask is None else cut & mask


def stand_in(xs_dyn: PyTree, mask: Bool[Array, " T"] | None) -> PyTree | None:
    """The input the cell sees on a step `mask` skips: the first kept step's
    (zeros if none), gradient stopped. The cell still runs there, and reverse
    mode multiplies its zero cotangent by its derivatives: finite on real
    inputs, not always on padding (NaN) or zeros (`log`, `x / |x|`), and
    0 * inf is NaN. `None` without a mask, or when no step runs."""
    if mask is None or mask.shape[0] == 0:
        return None
    first, any_kept = jnp.argmax(mask), jnp.any(mask)
    pick = lambda x: jnp.where(any_kept, x, jnp.zeros_like(x))
    return jtu.tree_map(lambda a: jax.lax.stop_gradient(pick(a[first])), xs_dyn)


def kept_inputs(xs_dyn: PyTree, mask: Bool[Array, " T"] | None) -> PyTree:
    """`xs_dyn` (time on axis 0) with each skipped step's input replaced by
    `stand_in`'s, for the parallel forms, which take every step at once (the
    engine selects per step instead, so as not to copy `xs`)."""
    stand = stand_in(xs_dyn, mask)
    if stand is None or mask is None:  # (`stand` is None without a mask)
        return xs_dyn
    return jax.vmap(where, in_axes=(0, 0, None))(mask, xs_dyn, stand)
