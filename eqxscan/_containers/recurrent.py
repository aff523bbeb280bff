"""`Recurrent` runs a cell over time; also `Bidirectional`."""

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Protocol, TypedDict, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree

from .._helpers.checks import (
    check_callable,
    check_carry,
    check_option,
    check_takes_key,
    describe,
    is_array,
    split_key,
)
from .._helpers.stateful import clone
from .._scan.buffers import refuse_buffer
from .._scan.eager_compile import compiled_when_eager
from .._scan.engine import run
from .._scan.layer_call import LayerCall, OneLayer, run_one
from .._scan.layer_index import current_step
from .._scan.options import OwnOptions, ScanArgs, Scanning, ScanOptions


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


@dataclasses.dataclass(frozen=True)
class _Controls:
    """`RecurrentArgs`, checked once against `xs`: what one run needs."""

    length: int
    time_axis: int
    mask: Bool[Array, " T"] | None
    truncate: int | None
    broadcast_key: bool


def _check_names(who: str, options: Mapping[str, object]) -> None:
    unknown = [name for name in options if name not in _CONTROLS]
    if unknown:
        names = ", ".join(repr(n) for n in unknown)
        example = ", ".join(f"{n!r}: ..." for n in unknown)
        raise TypeError(
            f"{who} got unknown keyword argument{'s' if len(unknown) > 1 else ''} "
            f"{names}; its own keywords are {', '.join(_CONTROLS)}, key and "
            "cell_kwargs.\nHint: the cell's own keyword arguments go in one dict, "
            f"passed to the cell at every step: cell_kwargs={{{example}}}."
        )


def _controls(who: str, xs: PyTree, options: Mapping[str, object]) -> _Controls:
    _check_names(who, options)
    time_axis = _check_time_axis(options.get("time_axis", 0))
    length = _time_length(xs, options.get("length"), time_axis)
    mask = options.get("mask")
    broadcast_key = options.get("broadcast_key", False)
    check_option("broadcast_key", broadcast_key, (False, True))
    return _Controls(
        length=length,
        time_axis=time_axis,
        mask=None if mask is None else _check_mask(mask, length),
        truncate=_check_truncate(options.get("truncate")),
        broadcast_key=bool(broadcast_key),
    )


def _check_cell_kwargs(
    who: str, cell_kwargs: Mapping[str, PyTree] | None
) -> dict[str, PyTree]:
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
            f"cell_kwargs has 'key', but {who} hands the cell its key itself: pass "
            "key=... to the call (split per step, or the same key at every step "
            "with broadcast_key=True)."
        )
    return dict(cell_kwargs)


def _where(cond: Bool[Array, ""], new: PyTree, old: PyTree) -> PyTree:
    # `jnp.where` on the array leaves; other leaves of a carry never change.
    return jtu.tree_map(
        lambda a, b: jnp.where(cond, a, b) if eqx.is_array(a) else a, new, old
    )


def _hide(keep: Bool[Array, ""], x: PyTree[Array]) -> PyTree[Array]:
    """`x` where the step is kept, zeros where it is masked.

    Masking selects the old carry with `jnp.where`, but the cell still runs on a
    masked step, and reverse mode multiplies the zero cotangent of the discarded
    result by the cell's derivatives there: with NaN or inf padding, 0 * nan is
    nan, in every weight's gradient. On zeros the cell's derivatives are finite
    (the "double where"), so padding of any value changes neither values nor
    gradients."""
    return jtu.tree_map(lambda a: jnp.where(keep, a, jnp.zeros_like(a)), x)


def _stop_gradient(a: object) -> object:
    return jax.lax.stop_gradient(a) if eqx.is_array(a) else a


def _check_truncate(truncate: object) -> int | None:
    if truncate is None:
        return None
    if isinstance(truncate, bool):
        raise TypeError(f"truncate must be a positive int or None, got {truncate!r}.")
    try:
        k = operator.index(truncate)  # type: ignore[arg-type]  # its TypeError is the check
    except TypeError:
        raise TypeError(
            "truncate must be a positive int (the number of steps per truncated "
            f"BPTT block) or None, got {type(truncate).__name__} ({truncate!r})."
        ) from None
    if k < 1:
        raise ValueError(f"truncate must be >= 1, got {k}.")
    return k


def _time_major(xs: PyTree, time_axis: int) -> PyTree:
    """`xs` with the time axis of every array leaf moved to axis 0."""
    if time_axis == 0:
        return xs
    return jtu.tree_map(
        lambda a: jnp.moveaxis(a, time_axis, 0) if eqx.is_array(a) else a, xs
    )


def _time_layout(hs: PyTree, time_axis: int) -> PyTree:
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


def _check_time_axis(time_axis: object) -> int:
    if isinstance(time_axis, bool) or not isinstance(time_axis, int):
        raise TypeError(
            f"time_axis must be an int, got {type(time_axis).__name__} ({time_axis!r})."
        )
    return time_axis


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
    found = None
    for p, a in arrays:
        if not -a.ndim <= time_axis < a.ndim:
            raise ValueError(
                f"xs{jtu.keystr(p)} has shape {tuple(a.shape)}, which has no axis "
                f"time_axis={time_axis}; every array in xs needs its time axis there."
            )
        if found is None:
            found = a.shape[time_axis]
        elif a.shape[time_axis] != found:
            raise ValueError(
                f"xs{jtu.keystr(p)} has shape {tuple(a.shape)}, but its {where} must "
                f"be the time axis of length {found} (set by xs{jtu.keystr(path)})."
            )
    assert found is not None
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


class _Sized(Protocol):
    """A cell that says what one step takes."""

    input_size: int
    hidden_size: int


def _check_known_cell(cell: Callable[..., PyTree], h0: PyTree, xs: PyTree) -> None:
    """For the cells whose shapes are known (`eqx.nn.GRUCell`, `eqx.nn.LSTMCell`,
    `ElmanCell`), check `h0` and `xs` up front: a batched or mis-sized input
    otherwise fails deep inside the cell with a bare `dot_general` error."""
    # Exact types: a subclass may well take other shapes. Other cells declare
    # `known_shapes = True` (a class variable) when `input_size` and
    # `hidden_size` say what one step takes, as `eqxscan.nn.ElmanCell` does.
    known = type(cell) in (eqx.nn.GRUCell, eqx.nn.LSTMCell)
    if not (known or vars(type(cell)).get("known_shapes") is True):
        return
    sizes: _Sized = cell  # pyright: ignore[reportAssignmentType]  # checked above
    name = (
        f"{type(cell).__name__}(input_size={sizes.input_size}, "
        f"hidden_size={sizes.hidden_size})"
    )
    batch_hint = (
        " Recurrent runs one sequence; for a batch, map over it: "
        "`jax.vmap(rnn)(h0, xs)`."
    )
    hidden = (sizes.hidden_size,)
    if type(cell) is eqx.nn.LSTMCell:
        ok = (
            isinstance(h0, (tuple, list))
            and len(h0) == 2
            and all(is_array(a) and a.shape == hidden for a in h0)
        )
        expected = f"a pair (h, c) of arrays of shape {hidden}"
    else:
        ok = is_array(h0) and h0.shape == hidden
        expected = f"an array of shape {hidden}"
    if not ok:
        got = (
            "(" + ", ".join(describe(a) for a in h0) + ")"
            if isinstance(h0, (tuple, list))
            else describe(h0)
        )
        raise ValueError(
            f"h0 is {got}, but {name} takes a carry that is {expected}." + batch_hint
        )
    if not (is_array(xs) and xs.shape[1:] == (sizes.input_size,)):
        raise ValueError(
            f"xs is {describe(xs)}, but {name} takes one input of shape "
            f"({sizes.input_size},) per step, so xs must have shape "
            f"(T, {sizes.input_size})." + batch_hint
        )


class Recurrent(Scanning):
    """Run a recurrent cell over the time axis of a sequence with `jax.lax.scan`.

    `cell(x_t, h) -> h` is the `eqx.nn.GRUCell` / `eqx.nn.LSTMCell` convention;
    the carry `h` may be any pytree (LSTM's is `(h, c)`). Batch with
    `jax.vmap(rnn)`; `jax.grad` through it is backpropagation through time.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        rnn = eqxscan.Recurrent(eqx.nn.GRUCell(3, 8, key=jax.random.key(0)))
        xs = jnp.ones((20, 3))                      # 20 time steps
        h_T, hs = rnn(jnp.zeros(8), xs)
        assert hs.shape == (20, 8) and jnp.allclose(hs[-1], h_T)
        ```

    !!! example

        A cell with a `mask=` of its own (over the slots of a memory it
        attends to) gets it through `cell_kwargs`, while `mask=` skips
        padded time steps:

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan


        class Attend(eqx.Module):
            cell: eqxscan.ElmanCell

            def __call__(self, x, h, memory, *, mask):
                scores = jnp.where(mask, memory @ h, -jnp.inf)
                return self.cell(x, h + jax.nn.softmax(scores) @ memory)


        cell = Attend(eqxscan.ElmanCell(3, 8, key=jax.random.key(0)))
        rnn = eqxscan.Recurrent(cell)
        xs, memory = jnp.ones((6, 3)), jnp.ones((4, 8))  # 6 steps, 4 memory slots
        slots = jnp.array([True, True, False, False])    # the cell's own mask
        steps = jnp.arange(6) < 5                        # the last step is padding
        h_T, hs = rnn(
            jnp.zeros(8), xs, memory, mask=steps, cell_kwargs={"mask": slots}
        )
        assert jnp.array_equal(hs[5], hs[4])             # step 5 was skipped
        ```
    """

    cell: Callable[..., PyTree]
    reverse: bool = eqx.field(static=True)
    options: ScanOptions

    def __init__(
        self,
        cell: Callable[..., PyTree],
        *,
        reverse: bool = False,
        **options: Unpack[ScanArgs],
    ):
        """**Arguments:**

        - `cell`: `cell(x_t, h) -> h`, optionally accepting `key=`. Usually an
          `eqx.Module` (its weights become part of this module).
        - `reverse`: consume the sequence last to first. Outputs stay aligned with
          `xs` either way.
        - `mode`: `"scan"` (`jax.lax.scan`) or `"loop"` (a Python loop over the
          time steps: the reference path; identical values, keys and gradients).
        - `remat`: rematerialisation per time step, as for
          [`eqxscan.Stacked`][]: `"auto"` (default), `False`, `True`, a
          `jax.checkpoint_policies` policy, or `"nested"` (saved carries grow like
          `sqrt(T)`, for long sequences).
        - `unroll`: a positive int, passed to `jax.lax.scan`; `True` unrolls fully
          (the program of `mode="loop"`, with this `remat`); `"auto"`
          (default) is chosen with `remat="auto"`'s rule.
        """
        check_callable("cell", cell)
        check_option("reverse", reverse, (False, True))
        self.cell = cell
        self.reverse = reverse
        self.options = ScanOptions(**options)

    def own_options(self) -> tuple[str, ...]:
        return ("reverse",)

    def replace_options(
        self, options: ScanOptions, **own: Unpack[OwnOptions]
    ) -> "Recurrent":
        reverse = own.get("reverse", self.reverse)
        args = options.as_args()
        return Recurrent(self.cell, reverse=reverse, **args)

    @compiled_when_eager
    def __call__(
        self,
        h0: PyTree,
        xs: PyTree = None,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        cell_kwargs: Mapping[str, PyTree] | None = None,
        **options: Unpack[RecurrentArgs],
    ) -> tuple[PyTree, PyTree]:
        """Run the cell over the `T` steps of `xs`.

        At step `t` the cell is called as `cell(x_t, h, *args, **cell_kwargs)`
        (with `key=` when a key is given). The keywords of this call
        (`mask`, `truncate`, `length`, `time_axis`, `broadcast_key`, `key`) are
        Recurrent's own and never reach the cell; the cell's keyword arguments
        go in `cell_kwargs`, so a cell that itself takes `mask=` or `length=`
        gets its own. An unknown keyword is an error naming it.

        **Arguments:**

        - `h0`: the initial carry, any pytree of arrays. The cell must return a
          carry of the same structure, shapes and dtypes.
        - `xs`: the inputs, a pytree whose array leaves all have time on axis
          `time_axis` (length `T`); step `t` passes slice `t` to the cell. `None`
          (with `length=T`) runs the cell `T` times with input `None`, e.g. to
          generate from a carry.
        - `*args`: passed unchanged to the cell at every step after `x_t` and
          `h`: constants such as an attention memory or a conditioning vector.
          Gradients flow to them, summed over steps.
        - `key`: optional PRNG key, split into `T` keys; step `t` calls the cell
          with `key=keys[t]`. Without it the cell is called without `key`.
        - `cell_kwargs`: optional dict of the cell's keyword arguments, passed
          unchanged to the cell at every step, like `*args` (see the class's
          second example). Per-step values belong in `xs` (which may be a
          pytree) instead.
        - `mask`: optional `bool[T]`. Where `mask[t]` is False the step is
          skipped: the carry passes through unchanged, so padding a sequence at
          either end does not change its final state. The cell sees zeros in
          place of a masked step's `x_t`, so padding of any value (NaN, inf)
          leaves values and gradients those of the unpadded sequence.
        - `truncate`: optional `k >= 1`, truncated backpropagation through time:
          counting from the first step consumed, the gradient through the carry
          is stopped after steps `k, 2k, ...`. Values are unchanged and `T` need
          not be a multiple of `k`.
        - `length`: the number of steps `T`. Needed when `xs` has no arrays;
          otherwise it must agree with `xs`. `T = 0` is allowed: the result is
          `h0` and an empty `hs`.
        - `time_axis`: the axis of every `xs` leaf that is time (e.g. `1` for
          batch-major `[B, T, ...]` inputs and a cell that takes a batch); `hs`
          gets time on the same axis.
        - `broadcast_key`: if True, every step gets `key` itself rather than its
          own split, e.g. for recurrent (variational) dropout that drops the same
          units at every step.

        **Returns:**

        `(h_T, hs)`: the final carry, and every step's carry stacked on
        `time_axis` and aligned with `xs`, so `hs[t]` (for `time_axis=0`) is the
        carry right after consuming `xs[t]` (also with `reverse=True`, where
        `h_T` equals `hs[0]`).
        """
        run_ = _controls("Recurrent", xs, options)
        kwargs = _check_cell_kwargs("Recurrent", cell_kwargs)
        xs = _time_major(xs, run_.time_axis)
        xs_dyn, xs_static = eqx.partition(xs, eqx.is_array)
        _check_known_cell(self.cell, h0, xs)
        keys = _step_keys(self.cell, key, run_, type(self).__name__)
        refuse_buffer(args, kwargs, "Recurrent")
        # Step t's arguments and key through the layer-call seam, the cell run
        # as a layer whose carry comes first (`_cell_step`).
        call = LayerCall(
            args, kwargs, keys, method=_cell_step, caller="Recurrent", over="time"
        )
        per_step, one_step = call.scanned()
        name = type(self.cell).__name__
        where_all = f"The cell {name} (one body for all {run_.length} time steps)"
        masked = where_all if self.mode == "scan" else f"The cell {name}"
        step = _time_step(self.cell, call, one_step, xs_static, run_, key, masked)
        inputs = (xs_dyn, run_.mask, _consumption_order(run_, self.reverse), per_step)
        if run_.length == 0:
            h_T, hs = h0, _no_steps(step, h0, inputs, where_all)
        else:
            h_T, hs = run(
                step,
                h0,
                inputs,
                length=run_.length,
                options=self.options,
                reverse=self.reverse,
                where=lambda i: (
                    where_all if i is None else f"The cell {name} at time step {i}"
                ),
                over="time",
            )
        return h_T, _time_layout(hs, run_.time_axis)


def _step_keys(
    cell: Callable[..., PyTree],
    key: PRNGKeyArray | None,
    controls: _Controls,
    who: str,
) -> Array | None:
    """Step `t`'s key `keys[t]`, split from `key` (`None` without a key, or when
    every step gets `key` itself), after checking that the cell takes one."""
    if key is None:
        return None
    per = (
        "every step gets the same key"
        if controls.broadcast_key
        else "step t gets key=keys[t]"
    )
    check_takes_key(cell, "Recurrent", per)
    if controls.broadcast_key:
        return None
    return split_key(key, controls.length, who)


def _consumption_order(controls: _Controls, reverse: bool) -> Int[Array, " T"] | None:
    """Each step's position in consumption order, for truncation's blocks
    (`None` without truncation)."""
    if controls.truncate is None:
        return None
    order = jnp.arange(controls.length)
    return controls.length - 1 - order if reverse else order


def _time_step(
    cell: Callable[..., PyTree],
    call: LayerCall,
    one_step: Callable[[PyTree], OneLayer],
    xs_static: PyTree,
    controls: _Controls,
    key: PRNGKeyArray | None,
    where: str,
) -> Callable[[PyTree, tuple], tuple[PyTree, PyTree]]:
    """The engine's step `(h, (x_t, mask_t, position_t, per_step_t)) -> (h, h)`:
    truncation and masking around the cell, which runs through the layer-call
    seam (its key, named scope and taps there). `where` names the cell in a
    masked step's carry error."""
    k = controls.truncate

    def step(h: PyTree, inputs: tuple) -> tuple[PyTree, PyTree]:
        x_dyn, m, n, per = inputs
        if n is not None and k is not None:
            # Entering a new block: let values through, not gradients.
            cut = (n > 0) & (n % k == 0)
            h = _where(cut, jtu.tree_map(_stop_gradient, h), h)
        if m is not None:
            x_dyn = _hide(m, x_dyn)
        one = one_step(per)
        one = one._replace(
            args=(eqx.combine(x_dyn, xs_static), *one.args),  # named by the engine
            key=key if controls.broadcast_key else one.key,
            number=current_step(),
        )
        this = call if m is None else call._replace(method=_masked_cell_step(m, where))
        new, _ = run_one(cell, this, one, h, f"The cell {type(cell).__name__}")
        return new, new

    return step


def _masked_cell_step(keep: Bool[Array, ""], where: str) -> Callable[..., PyTree]:
    """`_cell_step` on a step that `mask` may skip: the new carry where `keep`,
    else the old one (`where` names the cell in a carry error)."""

    def cell_step(
        cell: Callable[..., PyTree], h: PyTree, *rest: PyTree, **kw: PyTree
    ) -> PyTree:
        old = clone(h)  # the cell may invalidate `h` (an `eqx.nn.State`)
        new = _cell_step(cell, h, *rest, **kw)
        # Check before `jnp.where` can broadcast a wrong shape into the carry
        # (without a mask the engine checks, naming the step).
        check_carry(old, new, where)
        return _where(keep, new, old)

    return cell_step


def _cell_step(
    cell: Callable[..., PyTree],
    h: PyTree,
    x: PyTree,
    *args: PyTree,
    key: PRNGKeyArray | None = None,
    **kwargs: PyTree,
) -> PyTree:
    """The cell as a layer of the layer-call seam (carry first):
    `cell(x, h, *args, **kwargs)`, with `key=` when one is given."""
    if key is None:
        return cell(x, h, *args, **kwargs)
    return cell(x, h, *args, **kwargs, key=key)


def _no_steps(
    step: Callable[[PyTree, tuple], tuple[PyTree, PyTree]],
    h0: PyTree,
    inputs: tuple,
    where: str,
) -> PyTree:
    """The `hs` of a run of length 0: the carry's leaves with a leading axis of 0.

    The step is still traced (not run) on one step's shapes, so a cell that
    cannot take its inputs fails as it would on a longer sequence."""
    one = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), inputs)

    def traced(h: PyTree, x: tuple) -> None:
        new, _ = step(h, x)
        check_carry(h, new, where)

    eqx.filter_eval_shape(traced, h0, one)
    h_dyn, h_static = eqx.partition(h0, eqx.is_array)
    empty = jtu.tree_map(lambda a: jnp.zeros((0, *a.shape), a.dtype), h_dyn)
    return eqx.combine(empty, h_static)


def _as_recurrent(rnn: object, reverse: bool, what: str) -> Recurrent:
    if isinstance(rnn, Recurrent):
        if rnn.reverse != reverse:
            raise ValueError(
                f"Bidirectional {what} is a Recurrent with reverse={rnn.reverse}, "
                f"but the {what} direction needs reverse={reverse}. Pass the cell "
                f"itself, or `rnn.with_options(reverse={reverse})`."
            )
        return rnn
    check_callable(what, rnn)
    assert callable(rnn)
    return Recurrent(rnn, reverse=reverse)


class Bidirectional(eqx.Module):
    """A forward and a backward [`eqxscan.Recurrent`][] over the same sequence.

    Returns both directions as a pair rather than concatenating them, because
    carries may be pytrees (LSTM's `(h, c)`); for array carries,
    `jnp.concatenate(hs, axis=-1)` gives the usual `(T, H_fwd + H_bwd)` features.
    Both outputs are aligned with `xs`: at step `t`, `hs[0][t]` has read
    `xs[:t+1]` and `hs[1][t]` has read `xs[t:]`.

    With a `mask`, masked steps pass the carry through in both directions, so for
    a sequence padded at the end the backward direction starts at the sequence's
    true last step, exactly as on the unpadded sequence.

    !!! example

        ```python
        import jax, jax.numpy as jnp, eqxscan

        k1, k2 = jax.random.split(jax.random.key(0))
        bi = eqxscan.Bidirectional(
            eqxscan.ElmanCell(3, 8, key=k1), eqxscan.ElmanCell(3, 8, key=k2)
        )
        xs = jnp.ones((5, 3))
        (h_fwd, h_bwd), (hs_fwd, hs_bwd) = bi((jnp.zeros(8), jnp.zeros(8)), xs)
        features = jnp.concatenate([hs_fwd, hs_bwd], axis=-1)
        assert features.shape == (5, 16)
        assert jnp.allclose(h_bwd, hs_bwd[0])       # backward ends at t = 0
        ```
    """

    forward: Recurrent
    backward: Recurrent

    def __init__(
        self,
        forward: Recurrent | Callable[..., PyTree],
        backward: Recurrent | Callable[..., PyTree],
    ):
        """**Arguments:**

        - `forward`: a cell (wrapped in `Recurrent(cell)`) or a `Recurrent` with
          `reverse=False`.
        - `backward`: a cell (wrapped in `Recurrent(cell, reverse=True)`) or a
          `Recurrent` with `reverse=True`.
        """
        self.forward = _as_recurrent(forward, False, "forward")
        self.backward = _as_recurrent(backward, True, "backward")

    @compiled_when_eager
    def __call__(
        self,
        h0: PyTree,  # checked to be a pair below, with a clearer message
        xs: PyTree = None,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        cell_kwargs: Mapping[str, PyTree] | None = None,
        **options: Unpack[RecurrentArgs],
    ) -> tuple[tuple[PyTree, PyTree], tuple[PyTree, PyTree]]:
        """**Arguments:**

        - `h0`: `(h0_forward, h0_backward)`.
        - `xs`, `*args`, `cell_kwargs` and the keywords `mask`, `truncate`,
          `length`, `time_axis`, `broadcast_key`: as for
          [`eqxscan.Recurrent`][], passed on to both directions.
        - `key`: optional; split in two, one per direction.

        **Returns:**

        `((h_T_forward, h_T_backward), (hs_forward, hs_backward))`. The backward
        final carry is the one after consuming `xs[0]`.
        """
        if not (isinstance(h0, (tuple, list)) and len(h0) == 2):
            got = (
                f"a {type(h0).__name__} of length {len(h0)}"
                if isinstance(h0, (tuple, list))
                else describe(h0)
            )
            raise TypeError(
                f"Bidirectional expects h0 = (h0_forward, h0_backward), got {got}."
            )
        _check_names("Bidirectional", options)
        kf, kb = (None, None) if key is None else jr.split(key)
        hf, hs_f = self.forward(
            h0[0], xs, *args, key=kf, cell_kwargs=cell_kwargs, **options
        )
        hb, hs_b = self.backward(
            h0[1], xs, *args, key=kb, cell_kwargs=cell_kwargs, **options
        )
        return (hf, hb), (hs_f, hs_b)
