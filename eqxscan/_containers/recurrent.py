"""`Recurrent` runs a cell over time; also `Bidirectional`."""

from collections.abc import Callable, Mapping
from typing import Literal, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Bool, PRNGKeyArray, PyTree

from .._helpers.checks import (
    check_bool,
    check_callable,
    check_carry,
    check_takes_key,
    describe,
    docs,
    split_key,
)
from .._helpers.stateful import clone
from .._scan.buffers import refuse_buffer
from .._scan.call_state import call_state
from .._scan.eager_compile import compiled_when_eager
from .._scan.engine import run
from .._scan.layer_call import LayerCall, OneLayer, run_one
from .._scan.options import OwnOptions, ScanArgs, Scanning, ScanOptions
from .._scan.taps import emitted, in_cell, untapped
from .linear_cells import DiagonalLinearCell, MatrixLinearCell
from .recurrent_inputs import (
    block_starts as _block_starts,
    check_cell_kwargs,
    check_known_cell,
    check_names,
    Controls,
    controls,
    OWN_OPTIONS,
    RecurrentArgs,
    stand_in,
    time_layout,
    time_major,
    where as _where,
)
from .recurrent_linear import check_method, RecurrentMethod, resolve_form, run_parallel


# What a Recurrent given an `eqxscan.buffer` is told instead.
_NO_BUFFER = (
    "the state carried over time is the carry: pass it as h0 and take it back "
    "from the call's (h_T, hs)"
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


        rnn = eqxscan.Recurrent(Attend(eqxscan.ElmanCell(3, 8, key=jax.random.key(0))))
        xs, memory = jnp.ones((6, 3)), jnp.ones((4, 8))  # 6 steps, 4 memory slots
        slots = jnp.array([True, True, False, False])    # the cell's own mask
        steps = jnp.arange(6) < 5                        # the last step is padding
        h_T, hs = rnn(jnp.zeros(8), xs, memory, mask=steps, cell_kwargs={"mask": slots})
        assert jnp.array_equal(hs[5], hs[4])             # step 5 was skipped
        ```
    """

    cell: Callable[..., PyTree]
    reverse: bool = eqx.field(static=True)
    method: RecurrentMethod = eqx.field(static=True)
    chunk_size: int | Literal["auto"] = eqx.field(static=True)
    options: ScanOptions

    def __init__(
        self,
        cell: Callable[..., PyTree],
        *,
        reverse: bool = False,
        method: RecurrentMethod = "auto",
        chunk_size: int | Literal["auto"] = "auto",
        **options: Unpack[ScanArgs],
    ):
        """**Arguments:**

        - `cell`: `cell(x_t, h) -> h`, optionally accepting `key=`. Usually an
          `eqx.Module` (its weights become part of this module).
        - `reverse`: consume the sequence last to first. Outputs stay aligned with
          `xs` either way.
        - `mode`, `remat`, `unroll`: as for [`eqxscan.Stacked`][], per time step:
          `mode="loop"` (a Python loop over the steps) gives identical values,
          keys and gradients; `remat="nested"` keeps the saved carries growing
          like `sqrt(T)`, for long sequences. For a cell with a linear
          recurrence, `mode="loop"` or a `remat` other than `"auto"` runs the
          cell step by step (unless `method` names a parallel form).
        - `method`: how a cell whose recurrence is linear
          ([`eqxscan.DiagonalLinearCell`][], [`eqxscan.MatrixLinearCell`][])
          runs. Every step's gates are computed at once, then the recurrence
          runs as `"sequential"` (a `jax.lax.scan` of `a * h + b`),
          `"associative"` (diagonal only: `jax.lax.associative_scan`),
          `"chunked"` (a parallel scan inside chunks of `chunk_size` steps, a
          sequential one across them), or `"auto"`: chosen from the backend,
          `T`, the carry's size and the `jax.vmap` batch around the call
          (see docs/recurrent.md#the-auto-rule).
          Other cells always run step by step.
        - `chunk_size`: the chunk length of `method="chunked"`; `"auto"`: 64
          steps, 32 for a matrix state on an accelerator (measured, see
          docs/recurrent.md).
        """
        check_callable("cell", cell)
        if isinstance(cell, type):  # callable, but each step would build a cell
            raise TypeError(
                f"Recurrent needs a cell, got the class {cell.__name__} itself: "
                f"create the cell first (`cell = {cell.__name__}(...)`) and pass that."
            )
        reverse = check_bool("reverse", reverse)
        self.chunk_size = check_method(cell, method, chunk_size)
        self.cell = cell
        self.reverse = reverse
        self.method = method
        self.options = ScanOptions.given("Recurrent", options, OWN_OPTIONS)

    def own_options(self) -> tuple[str, ...]:
        return ("reverse", "method", "chunk_size")

    def replace_options(
        self, options: ScanOptions, **own: Unpack[OwnOptions]
    ) -> "Recurrent":
        return Recurrent(
            self.cell,
            reverse=own.get("reverse", self.reverse),
            method=own.get("method", self.method),
            chunk_size=own.get("chunk_size", self.chunk_size),
            **options.as_args(),
        )

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
        """Run the cell over the `T` steps of `xs`: at step `t`,
        `cell(x_t, h, *args, **cell_kwargs)` (with `key=` when a key is given).
        This call's own keywords (`mask`, `truncate`, `length`, `time_axis`,
        `broadcast_key`, `key`) never reach the cell, so a cell may take a `mask=`
        or `length=` of its own in `cell_kwargs`; an unknown keyword is an error
        naming it.

        **Arguments:**

        - `h0`: the initial carry, any pytree of arrays; the cell must return one
          of the same structure, shapes and dtypes.
        - `xs`: the inputs, a pytree whose array leaves all have time on axis
          `time_axis` (length `T`); step `t` gets slice `t`. `None` (with
          `length=T`) runs the cell `T` times with input `None`, e.g. to
          generate from a carry.
        - `*args`: passed unchanged to the cell at every step after `x_t` and
          `h` (an attention memory, a conditioning vector); their gradients are
          summed over steps.
        - `key`: optional PRNG key, split into `T` keys: step `t` gets
          `key=keys[t]`. Without it the cell gets no `key`.
        - `cell_kwargs`: optional dict of the cell's keyword arguments, passed
          unchanged at every step like `*args` (see the class's second
          example); per-step values belong in `xs` (which may be a pytree).
        - `mask`: optional `bool[T]`. Where `mask[t]` is False the step is
          skipped and the carry passes through, so padding at either end does
          not change the final state. The cell sees the first kept `x_t` in
          place of a masked one, so padding of any value (NaN, inf) leaves
          values and gradients those of the unpadded sequence.
        - `truncate`: optional `k >= 1`, truncated backpropagation through time:
          counting from the first step consumed, the gradient through the carry
          is stopped after steps `k, 2k, ...` (steps `mask` skips not counted);
          values are unchanged and `T` need not be a multiple of `k`.
        - `length`: the number of steps `T`, needed when `xs` has no arrays,
          else agreeing with `xs`. `T = 0` gives `h0` and an empty `hs`.
        - `time_axis`: the time axis of every `xs` leaf (e.g. `1` for batch-major
          `[B, T, ...]` inputs and a cell that takes a batch); `hs` gets time on
          the same axis.
        - `broadcast_key`: if True, every step gets `key` itself rather than its
          own split (recurrent, variational dropout: the same units dropped at
          every step).

        **Returns:**

        `(h_T, hs)`: the final carry, and every step's carry stacked on
        `time_axis` and aligned with `xs`: `hs[t]` (for `time_axis=0`) is the
        carry right after consuming `xs[t]`, also with `reverse=True` (where
        `h_T` equals `hs[0]`).
        For an [`eqxscan.MatrixLinearCell`][], `(S_T, os)`: the read-outs
        `os[t] = cell.output(S_t, x_t)` in place of the states.
        """
        run_ = controls("Recurrent", xs, options)
        kwargs = check_cell_kwargs(cell_kwargs)
        check_known_cell(self.cell, h0, xs, run_.time_axis)
        xs = time_major(xs, run_.time_axis)
        xs_dyn, xs_static = eqx.partition(xs, eqx.is_array)
        keys = _step_keys(self.cell, key, run_)
        refuse_buffer(args, kwargs, "Recurrent", _NO_BUFFER)
        form = resolve_form(self.method, self.cell, self.options, run_, h0, xs)
        if form != "engine":  # a linear recurrence, its gates all at once
            h_T, hs = run_parallel(
                self.cell, form, self.chunk_size, self.reverse, h0, xs,
                (args, kwargs), (keys, key), run_,
            )  # fmt: skip
            return h_T, time_layout(hs, run_.time_axis)
        # The cell runs as a layer whose carry comes first (`_cell_step`).
        call = LayerCall(
            args, kwargs, keys, method=_cell_step(), caller="Recurrent", start=None
        )
        per_step, one_step = call.scanned()
        name = type(self.cell).__name__
        where_all = f"The cell {name} (one body for all {run_.length} time steps)"
        masked = where_all if self.mode == "scan" else f"The cell {name}"
        xs_in = (xs_static, stand_in(xs_dyn, run_.mask))
        step = _time_step(self.cell, call, one_step, xs_in, run_, key, masked)
        inputs = (xs_dyn, run_.mask, _block_starts(run_, self.reverse), per_step)
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
        return h_T, time_layout(hs, run_.time_axis)


def _step_keys(
    cell: Callable[..., PyTree], key: PRNGKeyArray | None, controls: Controls
) -> Array | None:
    """Step `t`'s key `keys[t]` (`None` without a key, or when every step gets
    `key` itself), after checking that the cell takes one."""
    if key is None:
        return None
    same = controls.broadcast_key
    per = "every step gets the same key" if same else "step t gets key=keys[t]"
    # A linear cell's `__call__` passes its keyword arguments on to `gates`.
    linear = isinstance(cell, DiagonalLinearCell | MatrixLinearCell)
    check_takes_key(cell.gates if linear else cell, "Recurrent", per)
    keys = split_key(key, 1 if same else controls.length, "Recurrent")  # checked
    return None if same else keys


def _time_step(
    cell: Callable[..., PyTree],
    call: LayerCall,
    one_step: Callable[[PyTree], OneLayer],
    xs_in: tuple[PyTree, PyTree | None],
    controls: Controls,
    key: PRNGKeyArray | None,
    where: str,
) -> Callable[[PyTree, tuple], tuple[PyTree, PyTree]]:
    """The engine's step `(h, (x_t, mask_t, block_start_t, per_t)) -> (h, y)`:
    truncation and masking around the cell, run through the layer-call seam.
    `xs_in` is `(xs_static, stand_in(...))`, the stand-in selected per step
    (not before the scan, which would copy `xs`). `where` names the cell in a
    masked step's carry error. `y` is the new carry, or a matrix state's
    read-out (which is not stacked)."""

    xs_static, stand = xs_in

    def step(h: PyTree, inputs: tuple) -> tuple[PyTree, PyTree]:
        x_dyn, m, cut, per = inputs
        if m is not None and stand is not None:
            x_dyn = _where(m, x_dyn, stand)  # the "double where"
        if cut is not None:  # a new block: let values through, not gradients
            h_dyn, h_static = eqx.partition(h, eqx.is_array)
            h = _where(cut, eqx.combine(jax.lax.stop_gradient(h_dyn), h_static), h)
        x = eqx.combine(x_dyn, xs_static)
        one = one_step(per)
        one = one._replace(
            args=(x, *one.args),  # named by the engine
            key=key if controls.broadcast_key else one.key,
            number=call_state().step,
        )
        this = call if m is None else call._replace(method=_cell_step(m, where))
        new, _ = run_one(cell, this, one, h, f"The cell {type(cell).__name__}")
        y = new
        if isinstance(cell, MatrixLinearCell):
            y = cell.output(new, x, *call.args, **call.kwargs)
        return new, emitted(one.number, y)

    return step


def _cell_step(
    keep: Bool[Array, ""] | None = None, where: str = ""
) -> Callable[..., PyTree]:
    """The cell as a layer of the layer-call seam (carry first). On a step that
    `mask` may skip, `keep`: the new carry where it holds, else the old one
    (`where` names the cell in a carry error). One function either way, so that
    a traceback from the cell passes one frame of it."""

    def cell_step(
        cell: Callable[..., PyTree],
        h: PyTree,
        x: PyTree,
        *args: PyTree,
        key: PRNGKeyArray | None = None,
        **kwargs: PyTree,
    ) -> PyTree:
        # Before the call, which may invalidate `h` (an `eqx.nn.State`).
        carry = jtu.tree_structure(h)
        old = None if keep is None else clone(h)
        with in_cell():
            keyed = {} if key is None else {"key": key}
            new = cell(x, h, *args, **kwargs, **keyed)
        # The `lax.scan` body and Flax convention, which the carry check would
        # report only as a change of structure.
        pair = isinstance(new, tuple) and len(new) == 2
        if pair and jtu.tree_structure(new[0]) == carry != jtu.tree_structure(new):
            raise TypeError(
                f"The cell {type(cell).__name__} returned a pair (carry, output), as "
                "a `jax.lax.scan` body or a Flax cell does, but a cell returns the "
                "new carry alone (`cell(x_t, h) -> h`); Recurrent stacks the "
                "carries as hs.\nHint: return the carry; to keep more per step, "
                f"make it part of the carry (see {docs('recurrent.md')})."
            )
        if keep is None:
            return new
        # Check before `jnp.where` can broadcast a wrong shape into the carry
        # (without a mask the engine checks, naming the step).
        check_carry(old, new, where, over="time")
        return _where(keep, new, old)

    return cell_step


def _no_steps(
    step: Callable[[PyTree, tuple], tuple[PyTree, PyTree]],
    h0: PyTree,
    inputs: tuple,
    where: str,
) -> PyTree:
    """The `hs` of a run of length 0, after tracing (not running) the step on one
    step's shapes, so that a cell that cannot take its inputs fails as usual."""
    one = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), inputs)

    def traced(h: PyTree, x: tuple) -> PyTree:
        new, y = step(h, x)
        check_carry(h, new, where, over="time")
        return y

    with untapped():
        y = eqx.filter_eval_shape(traced, h0, one)
    empty = lambda a: jnp.zeros((0, *a.shape), a.dtype)
    return jtu.tree_map(
        lambda a: empty(a) if isinstance(a, jax.ShapeDtypeStruct) else a, y
    )


def _as_recurrent(rnn: object, reverse: bool, what: str) -> Recurrent:
    if isinstance(rnn, Recurrent):
        if rnn.reverse != reverse:
            raise ValueError(
                f"Bidirectional {what} is a Recurrent with reverse={rnn.reverse}, "
                f"but the {what} direction needs reverse={reverse}. Pass the cell "
                f"itself, or `rnn.with_options(reverse={reverse})`."
            )
        return rnn
    return Recurrent(check_callable(what, rnn), reverse=reverse)


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

    # Not compiled as a whole when eager: each direction compiles itself, so
    # that one in `mode="loop"` (the debugging path) runs as written.
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
        pair = isinstance(h0, (tuple, list))
        if not (pair and len(h0) == 2):
            got = f"a {type(h0).__name__} of length {len(h0)}" if pair else describe(h0)
            raise TypeError(
                f"Bidirectional expects h0 = (h0_forward, h0_backward), got {got}."
            )
        check_names("Bidirectional", options)
        kf, kb = (None, None) if key is None else split_key(key, 2, "Bidirectional")
        hf, hs_f = self.forward(
            h0[0], xs, *args, key=kf, cell_kwargs=cell_kwargs, **options
        )
        hb, hs_b = self.backward(
            h0[1], xs, *args, key=kb, cell_kwargs=cell_kwargs, **options
        )
        return (hf, hb), (hs_f, hs_b)
