"""Taps: per-layer statistics of what flows between the layers, from the
scanned call itself. `tapped` records `stat(output[, input])` of each layer in
the current scope and attaches its slice of a [`eqxscan.Probe`][] (a
`custom_vjp`); the engine (`StepTaps`) returns each step's records as extra
per-step outputs, so they leave nested scans stacked; `tap` scatters them by
layer index, per container call (`call_of`)."""

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .call_state import call_state, changed_call_state, TapCall, Tapping
from .layer_io import Index, index
from .probe import Probe


try:
    from jax.extend.core import get_opaque_trace_state as trace_state
except ImportError:  # jax 0.9 has it in `jax.core` only
    from jax.core import get_opaque_trace_state as trace_state


Stat = Callable[..., PyTree]
"""`stat(output)` or `stat(output, input)`: a pytree of arrays from a layer's
output carry (and the carry it was given)."""


def tapping() -> bool:
    """Whether a container call now is tapped."""
    return call_state().tapping is not None


def inside_layer() -> contextlib.AbstractContextManager[object]:
    """Set around a layer's call: containers inside it are not tapped, except
    in a `Recurrent`'s cell."""
    return changed_call_state(paused=call_state().tapping, tapping=None)


def untapped() -> contextlib.AbstractContextManager[object]:
    """Set around a trace that is never run (its records would leak)."""
    return changed_call_state(tapping=None)


def in_cell() -> contextlib.AbstractContextManager[object]:
    """Set around a `Recurrent`'s cell: containers it calls are tapped, with
    rows of their own per time step."""
    return changed_call_state(tapping=call_state().paused)


@contextlib.contextmanager
def call_of(module: object, reverse: object = False) -> Iterator[None]:
    """Around a container's call (`reverse`: its keyword of that name): while
    tapped, its records are its own rows, named after its class (`Stacked`,
    then `Stacked_1`, ...)."""
    now = call_state()
    state = now.tapping
    if state is None:
        yield
        return
    names = {c.name for c in state.calls}
    name, k = type(module).__name__, 0
    while name in names:
        k += 1
        name = f"{type(module).__name__}_{k}"
    if state.stat is not None and not now.depth and trace_state() != state.trace:
        raise TypeError(
            f"eqxscan.tap: {name} was called inside a JAX transformation (jax.vmap, "
            "jax.jit, lax.cond, ...) within the tapped function, so its statistics "
            "cannot leave it.\nTap inside the transformation, e.g. "
            "`jax.vmap(eqxscan.tap(rnn, stat))(h0, xs)`; find_nonfinite's loss_fn "
            "must call the containers directly."
        )
    offset = _count([r for r in state.records if r[2].depth == 0])
    reverse = reverse is True or getattr(module, "reverse", False) is True
    call = TapCall(name, now.depth, offset, reverse, id(module))
    state.calls.append(call)
    with changed_call_state(call=call):
        yield


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _probed(stat: Callable[[PyTree], PyTree], x: PyTree, p: PyTree) -> PyTree:
    return x  # its backward pass: the cotangent, and `stat` of it for `p`


_probed.defvjp(lambda stat, x, p: (x, None), lambda stat, res, ct: (ct, stat(ct)))


def tapped(
    i: Index | None, new: PyTree, old: PyTree, runs: Array | None = None
) -> PyTree:
    """Layer (or step) `i`'s output `new`, given `old`: its statistics
    recorded (a row of zeros where LayerDrop skipped it: `runs` false) and its
    slice of the probe attached."""
    now = call_state()
    state, scope = now.tapping, now.scope
    if state is None or scope is None or i is None:
        return new
    if _stateful(new):  # a stateful layer of a Chain's group: its x, as a
        # stack's call reads it
        return (tapped(i, new[0], old[0] if _stateful(old) else old, runs), new[1])
    stats = None  # without `stat`, only counted: a probe has a row per layer
    if state.stat is not None:
        stats = state.stat(new, old) if state.with_input else state.stat(new)
        stats = jtu.tree_map(jnp.asarray, stats)  # a Python number, as a row
    number = jnp.asarray(i, jnp.float32) + 1
    number = number if runs is None else jnp.where(runs, number, 0.0)
    scope.append((number, stats, now.call))
    return _attached(state.probe, i, new, now.call, runs)


def _stateful(carry: PyTree) -> bool:
    # `(x, state)`: what a stateful layer (`eqx.nn.State`) takes and returns.
    return (
        isinstance(carry, tuple)
        and len(carry) == 2
        and isinstance(carry[1], eqx.nn.State)
    )


def emitted(i: Index | None, y: PyTree) -> PyTree:
    """Time step `i`'s output `y` (its carry, as `hs[i]`), its slice of the
    probe of what is emitted attached (see `Tapping.emitted`)."""
    now = call_state()
    if now.tapping is None or now.scope is None or i is None:
        return y
    return _attached(now.tapping.emitted, i, y, now.call)


def _attached(
    probe: Probe | None,
    i: Index,
    new: PyTree,
    call: TapCall | None,
    runs: Array | None = None,
) -> PyTree:
    if probe is None or call is None or call.depth:  # not per time step
        return new
    values, row = probe.values, i + call.offset  # calls' rows follow each other
    if probe.per_call:
        values, row = values[call.name], i
    values = index(values, row)
    if runs is not None:  # a skipped layer's row gets no gradient: zeros, as
        # its forward statistics and as a scanned stack's skip gives
        values = jtu.tree_map(lambda v: jnp.where(runs, v, jnp.zeros_like(v)), values)
    dyn, rest = eqx.partition(new, eqx.is_inexact_array)
    return eqx.combine(_probed(probe.stat, dyn, values), rest)


class StepTaps:
    """While tapped, what the engine does around each step: the step's records
    returned beside its `y` (`open`, `close`), and added, stacked, to the
    enclosing scope after the run (`finish`)."""

    def __init__(self, state: Tapping, outer: list):
        self.state, self.outer = state, outer
        self.calls: list = []  # the records' calls, which are no scan outputs

    def open(self) -> tuple[int, list, dict[str, object]]:
        # The calls made so far, the step's records and its call state fields.
        records: list = []
        scope = {"scope": records, "depth": call_state().depth + 1}
        return len(self.state.calls), records, scope

    def close(self, y: PyTree, opened: int, records: list | None) -> PyTree:
        assert records is not None
        records = _in_order(records)
        if self.calls:  # a later step of `mode="loop"`: the same calls again
            del self.state.calls[opened:]
        else:
            self.calls[:] = [r[2] for r in records]
        return y, [r[:2] for r in records]

    def finish(self, ys: PyTree) -> PyTree:
        ys, records = ys
        self.outer.extend((*r, call) for r, call in zip(records, self.calls))
        return ys


def step_taps() -> StepTaps | None:
    """What the engine does with each step's records (`None`: not tapped)."""
    state, outer = call_state().tapping, call_state().scope
    return None if state is None or outer is None else StepTaps(state, outer)


def _in_order(records: list) -> list:
    # A step's records of one call that follow each other (a repeated pattern's
    # layers) joined, row by row: stacked apart, the scan would group them by
    # their place in the step, not in the order the layers ran.
    out: list = []
    for idx, s, call in records:
        if idx is not None and out and out[-1][2] is call and out[-1][0] is not None:
            (a, u), (b, v) = _rows(*out[-1][:2]), _rows(idx, s)
            if _rows_like(u) == _rows_like(v):
                joined = jtu.tree_map(lambda *r: jnp.concatenate(r), u, v)
                out[-1] = (jnp.concatenate([a, b]), joined, call)
                continue
        out.append((idx, s, call))
    return out


def _rows(idx: Array, stats: PyTree) -> tuple[Array, PyTree]:
    cut = lambda a: a.reshape(idx.size, *a.shape[idx.ndim :])  # noqa: E731
    return idx.reshape(-1), jtu.tree_map(cut, stats)


def _rows_like(stats: PyTree) -> tuple:
    rows = [(a.shape[1:], a.dtype) for a in jtu.tree_leaves(stats)]
    return jtu.tree_structure(stats), rows


@contextlib.contextmanager
def held() -> Iterator[list]:
    """The records made inside the block, kept from the enclosing scope: a
    `lax.switch` branch returns them (a record must not leave its trace), and
    `add` puts them in the scope after the switch."""
    now = call_state()
    records: list = []
    with changed_call_state(scope=records if now.tapping else now.scope):
        yield records
    records[:] = [r[:2] for r in records]  # arrays only, for the switch


def add(records: Sequence) -> None:
    """Put `records` (from `held`, their calls dropped) in the enclosing scope."""
    now = call_state()
    if now.tapping is not None and now.scope is not None:
        now.scope.extend((*r[:2], now.call) for r in records)


@contextlib.contextmanager
def covering(length: int) -> Iterator[None]:
    """Around a call that may run only some of a model's `length` layers
    (`run_layers`): its records padded to one per layer, so that layers not run
    read zeros (as LayerDrop's skipped layers do)."""
    now = call_state()
    records: list = []
    outer, call = now.scope, now.call
    with changed_call_state(scope=records if now.tapping else outer):
        yield
    if not records or outer is None:
        return
    outer.extend(records)
    count = _count(records)
    if count > length:
        # Layers chosen more than once: still `length` rows of a probe.
        outer.append((None, -(count - length), call))
    if count < length:
        idx, stats, _ = records[0]
        pad = jtu.tree_map(
            lambda a: jnp.zeros((length - count, *a.shape[idx.ndim :]), a.dtype),
            stats,
        )
        # Index 0 is the slot `_gather` drops.
        outer.append((jnp.zeros((length - count,), jnp.float32), pad, call))


def _count(records: list) -> int:
    # Rows: a record's layers, or (index `None`) a repeat count from `covering`.
    return sum(s if idx is None else idx.size for idx, s, _ in records)


def takes_input(stat: Stat) -> bool:
    try:
        params = inspect.signature(stat).parameters.values()
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = sum(p.kind in kinds and p.default is p.empty for p in params)
    return required >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _concatenate(arrays: tuple[Array, ...], axis: int) -> Array:
    # Rows of different dtypes (a bfloat16 stack, a float32 head) in their
    # promoted dtype, whatever the promotion mode.
    with jax.numpy_dtype_promotion("standard"):
        dtype = functools.reduce(jnp.promote_types, [a.dtype for a in arrays])
    return jnp.concatenate([a.astype(dtype) for a in arrays], axis=axis)


def _gather(records: list, depth: int) -> tuple[PyTree, Array]:
    # The records (index + 1, stats), each with leading axes of the scans it
    # came out of, as one `[L, ...]` pytree in layer order after the `depth`
    # axes around the call; and the indices + 1 as recorded (0: not run).
    ids, stats = [], []
    for idx, s, _ in records:
        if idx is not None:  # not a repeat count from `covering`
            outer, n = idx.shape[:depth], idx.ndim
            ids.append(idx.reshape(*outer, -1).astype(jnp.int32))
            cut = lambda a, n=n, o=outer: a.reshape(*o, -1, *a.shape[n:])  # noqa: E731
            stats.append(jtu.tree_map(cut, s))
    all_ids = jnp.concatenate(ids, axis=depth)
    # (Dtypes may differ: joined, they promote.)
    shapes = {tuple(a.shape[depth + 1 :] for a in jtu.tree_leaves(s)) for s in stats}
    if len({jtu.tree_structure(s) for s in stats}) > 1 or len(shapes) > 1:
        kinds = "; ".join(sorted(str(s) for s in shapes))
        raise TypeError(
            "eqxscan.tap: the statistic returned different structures or shapes "
            f"at different layers ({kinds}).\nReturn one structure and shape for "
            "every layer (e.g. eqxscan.stats.rms, a scalar per carry leaf)."
        )
    joined = jtu.tree_map(lambda *a: _concatenate(a, depth), *stats)

    def scatter(ids: Array, a: Array) -> Array:
        return jnp.zeros((ids.shape[0] + 1, *a.shape[1:]), a.dtype).at[ids].set(a)[1:]

    for _ in range(depth):
        scatter = jax.vmap(scatter)
    return jtu.tree_map(lambda a: scatter(all_ids, a), joined), all_ids


def tap_calls(
    model: Callable[..., PyTree],
    stat: Stat | None,
    with_input: bool,
    probe: Probe | None,
    args: tuple,
    kwargs: dict,
    emitted: Probe | None = None,
) -> tuple[PyTree, list[tuple[TapCall, PyTree, Array]] | None]:
    """`tap`'s call of `model`, and per container call, in call order, its
    statistics and its layers' indices + 1 in the order they ran (a call in
    reverse: ascending) (`None` without `stat`)."""
    # Records outside any container call are the model's (run_layers' too).
    outside = TapCall(getattr(model, "__name__", "outside"))
    records: list = []
    state = Tapping(stat, with_input, probe, emitted, [outside], records, trace_state())
    with changed_call_state(tapping=state, scope=records, call=outside, depth=0):
        out = model(*args, **kwargs)
    calls = [(c, rs) for c in state.calls if (rs := [r for r in records if r[2] is c])]
    for p in (probe, emitted):
        if p is not None:
            _check_rows(p, [(c, rs) for c, rs in calls if not c.depth], model)
    if stat is None:
        return out, None
    if not calls:
        raise TypeError(
            f"eqxscan.tap: calling {type(model).__name__} ran no layers of a "
            "Stacked, Chain or Recurrent.\nTap the container itself, e.g. "
            "`eqxscan.tap(model.blocks, stat)(x)` inside the model's forward."
        )
    return out, [(c, *_gather(rs, c.depth)) for c, rs in calls]


def _check_rows(probe: Probe, calls: list, model: object) -> None:
    # A probe row per layer: a wrong length would silently merge rows (indices
    # past the end are clamped) or leave rows that no layer reaches.
    if not calls:
        return
    if probe.per_call:
        wanted = [(c.name, probe.values.get(c.name), [rs]) for c, rs in calls]
    else:
        wanted = [(type(model).__name__, probe.values, [rs for _, rs in calls])]
    for name, values, records in wanted:
        leaves = jtu.tree_leaves(values)
        if values is not None and not leaves:
            continue  # a carry with no floats: nothing reaches the probe
        rows = leaves[0].shape[0] if leaves else 0
        count = sum(_count(rs) for rs in records)
        if rows != count:
            raise ValueError(
                f"eqxscan.tap: the probe has {rows} rows, but calling {name} ran "
                f"{count} layers (or time steps).\nBuild it with "
                f"eqxscan.probe(stat, carry, {count}): one row per layer."
            )
