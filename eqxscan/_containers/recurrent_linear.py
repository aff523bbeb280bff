"""How `Recurrent` runs a cell whose recurrence is linear in its carry: the
`method=` option, and the parallel forms (every step's gates at once)."""

from collections.abc import Callable, Mapping
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, PRNGKeyArray, PyTree

from .._helpers.checks import check_option, check_size, describe
from .._scan.call_state import call_state
from .._scan.options import ScanOptions
from .._scan.taps import tapping
from .._scan.vmap_batch import vmapped_size
from .linear_cells import check_gates_tuple, DiagonalLinearCell, MatrixLinearCell
from .linear_diag import check_gate_fits, choose_method, diagonal_scan, Method
from .linear_matrix import matrix_scan
from .recurrent_inputs import block_starts, Controls, kept_inputs


RecurrentMethod = Literal["auto", "sequential", "associative", "chunked"]
ChunkSize = int | Literal["auto"]

# `chunk_size="auto"`: 64 steps, but 32 for a matrix state off CPU (faster on a
# TPU v5e, docs/recurrent.md#matrix-state-cells).
AUTO_CHUNK = 64
AUTO_MATRIX_CHUNK_ACCELERATOR = 32


def chunk_for(chunk_size: ChunkSize, matrix: bool) -> int:
    """The chunk length a `Recurrent` runs with (`"auto"` resolved on the
    backend tracing the call)."""
    if chunk_size != "auto":
        return chunk_size
    accelerator = jax.default_backend() != "cpu"
    return AUTO_MATRIX_CHUNK_ACCELERATOR if matrix and accelerator else AUTO_CHUNK


def _kind(cell: object) -> Literal["diagonal", "matrix"] | None:
    if isinstance(cell, DiagonalLinearCell):
        return "diagonal"
    return "matrix" if isinstance(cell, MatrixLinearCell) else None


def _own_call(cell: object) -> bool:
    # A step other than the recurrence its gates describe (a clip, a norm):
    # only the engine, which calls the cell, computes it. (An override that
    # keeps the step says so: `parallel_safe = True`.)
    base = DiagonalLinearCell if _kind(cell) == "diagonal" else MatrixLinearCell
    overridden = type(cell).__call__ is not base.__call__  # pyright: ignore
    return overridden and not getattr(cell, "parallel_safe", False)


def check_method(cell: object, method: object, chunk_size: object) -> ChunkSize:
    """Check `method=` and `chunk_size=` of a `Recurrent` against its cell;
    returns `chunk_size` as an int or `"auto"`."""
    check_option("method", method, ("auto", "sequential", "associative", "chunked"))
    size = "auto" if chunk_size == "auto" else check_size("chunk_size", chunk_size)
    kind = _kind(cell)
    if method in ("associative", "chunked") and kind is None:
        raise ValueError(
            f"method={method!r} needs a cell whose recurrence is linear, an "
            f"eqxscan.DiagonalLinearCell or eqxscan.MatrixLinearCell, but the cell "
            f"is a {type(cell).__name__}.\nHint: other cells run step by step: "
            "method='sequential' (or 'auto')."
        )
    if method in ("associative", "chunked") and kind and _own_call(cell):
        raise ValueError(
            f"method={method!r} computes h_t from the gates alone, but the cell "
            f"{type(cell).__name__} overrides `__call__`, which it cannot call "
            "(it never forms each step's carry by the cell).\nHint: use "
            "method='sequential' (or 'auto'), which calls it at every step; an "
            "override that keeps the step `a * h + b` sets parallel_safe = True."
        )
    if method == "chunked" and kind == "matrix" and _own_output(cell):
        raise ValueError(
            f"method='chunked' reads out o_t = einsum('hk,hkv->hv', q_t, S_t), "
            f"but the cell {type(cell).__name__} overrides `output`, which the "
            "chunked form cannot call (it never forms every S_t).\nHint: use "
            "method='sequential' (or 'auto'), which calls it at every step."
        )
    if method == "associative" and kind == "matrix":
        raise ValueError(
            f"method='associative' is for diagonal recurrences, but the cell "
            f"{type(cell).__name__} is a MatrixLinearCell, whose state would be "
            "multiplied out at every level of the scan.\nHint: use "
            "method='chunked' (or 'sequential', or 'auto')."
        )
    return size


def _own_output(cell: object) -> bool:
    # A read-out other than `q_t . S_t`, which only the engine's steps apply.
    return type(cell).output is not MatrixLinearCell.output  # pyright: ignore


def resolve_form(
    method: RecurrentMethod,
    cell: object,
    options: ScanOptions,
    controls: Controls,
    h0: PyTree,
    xs: PyTree,
) -> Literal["engine"] | Method:
    """The form one run takes: the engine (the cell step by step) for other
    cells and no steps; under `eqxscan.tap` (whose records are the engine's
    steps); where `mode="loop"` or an explicit `remat` asks for it (unless a
    parallel method is named); and for a matrix state truncated or sequential
    (the engine reads out each step)."""
    kind = _kind(cell)
    if kind is None or tapping() or controls.length == 0 or _own_call(cell):
        return "engine"
    engine_asked = options.mode == "loop" or options.remat != "auto"
    if method in ("sequential", "auto") and engine_asked:
        return "engine"
    if kind == "matrix" and (controls.truncate is not None or _own_output(cell)):
        # The carry to cut at, or the state to read out, would be every step's.
        return "engine"
    form = method
    if form == "auto":
        leaves = jtu.tree_leaves(h0)
        if kind == "matrix" and leaves and jnp.ndim(leaves[0]) >= 2:
            size = int(np.prod(jnp.shape(leaves[0])[-2:]))  # one head's dk * dv
        else:
            size = sum(jnp.size(a) for a in leaves)
        form = choose_method(
            jax.default_backend(), controls.length, size, kind, _batch(h0, xs)
        )
    return "engine" if kind == "matrix" and form == "sequential" else form


def _batch(h0: PyTree, xs: PyTree) -> int:
    # The sequences run at once: the `jax.vmap`s' batch over the carry or the
    # inputs (one probe each), times an eager `vmap`'s around a cached program.
    firsts = [next(filter(eqx.is_array, jtu.tree_leaves(t)), None) for t in (h0, xs)]
    inner = max(vmapped_size(x) for x in firsts)
    return inner * call_state().vmapped


def run_parallel(
    cell: Callable[..., PyTree],
    form: Method,
    chunk_size: ChunkSize,
    reverse: bool,
    h0: PyTree,
    xs: PyTree,
    call: tuple[tuple[PyTree, ...], Mapping[str, PyTree]],
    keys: tuple[Array | None, PRNGKeyArray | None],
    controls: Controls,
) -> tuple[PyTree, PyTree]:
    """`(h_T, hs)` (for a matrix state `(S_T, os)`), time on axis 0 of `xs`.
    `call` is the cell's `(args, kwargs)`; `keys` is `(per-step keys, key)`: a
    step without a key of its own gets `key` (`None`, or the same every step).
    Every step's gates at once, `jax.vmap(cell.gates)`: a skipped step gets the
    first kept step's input, as the cell does step by step."""
    assert isinstance(cell, DiagonalLinearCell | MatrixLinearCell)
    (args, kwargs), (per_step, same) = call, keys
    xs_dyn, xs_static = eqx.partition(xs, eqx.is_array)

    matrix = isinstance(cell, MatrixLinearCell)

    def step_gates(x_dyn: PyTree, key: PRNGKeyArray | None) -> tuple:
        key = same if key is None else key
        keyed = {} if key is None else {"key": key}
        out = cell.gates(eqx.combine(x_dyn, xs_static), *args, **kwargs, **keyed)
        return check_gates_tuple(cell, out, 4 if matrix else 2)

    kept = kept_inputs(xs_dyn, controls.mask)  # no inputs: `length=` steps
    gates = list(jax.vmap(step_gates, axis_size=controls.length)(kept, per_step))
    if not matrix:
        _check_gates(cell, gates[0], gates[1], h0)
    else:
        check_gate_fits(gates[0], h0, f"a from {type(cell).__name__}.gates")
    if controls.mask is not None:  # a skipped step: a = 1 and b (or k) = 0
        gates[0] = _where_t(controls.mask, gates[0], 1)
        gates[1] = _where_t(controls.mask, gates[1], 0)
    c = chunk_for(chunk_size, matrix)
    if matrix:  # chunked (the engine runs a sequential one step by step)
        a, k, v, q = gates
        # `os` in the dtype of the engine's read-out, `einsum(q_t, S_t)`.
        v = v.astype(jnp.result_type(q, h0))
        return matrix_scan(
            a, k, v, q, h0, method="chunked", chunk_size=c, reverse=reverse
        )
    a, b = gates  # `diagonal_scan` computes in the carry's dtype
    scan = lambda a_, b_: diagonal_scan(
        a_, b_, h0, method=form, chunk_size=c, reverse=reverse
    )
    if controls.truncate is not None:
        a, b = _truncated(a, b, h0, scan, controls, reverse)
    return scan(a, b)


def _where_t(m: Bool[Array, " T"], new: PyTree, fill: int) -> PyTree:
    """`new` at the steps where `m` holds (time on axis 0), else `fill`."""
    col = lambda x: m.reshape(-1, *([1] * (x.ndim - 1)))
    return jtu.tree_map(lambda x: jnp.where(col(x), x, fill), new)


def _check_gates(cell: object, a: PyTree, b: PyTree, h0: PyTree) -> None:
    name = type(cell).__name__
    tree = jtu.tree_structure(h0)
    hint = "\nHint: gates(x_t) returns (a_t, b_t), each shaped like the carry"
    for what, g in (("a", a), ("b", b)):
        if jtu.tree_structure(g) != tree:
            raise ValueError(
                f"{name}.gates returned {what} with structure "
                f"{jtu.tree_structure(g)}, but the carry h0 has structure {tree}."
                f"{hint}."
            )
        for (path, x), h in zip(jtu.tree_leaves_with_path(g), jtu.tree_leaves(h0)):
            check_gate_fits(x, h, f"{what}{jtu.keystr(path)} from {name}.gates")
            if x.shape[1:] != jnp.shape(h):
                raise ValueError(
                    f"{name}.gates returned {what}{jtu.keystr(path)} of shape "
                    f"{x.shape[1:]} per step, but the carry h0{jtu.keystr(path)} is "
                    f"{describe(h)}.{hint} (for a batch, map over it with jax.vmap)."
                )


def _truncated(
    a: PyTree,
    b: PyTree,
    h0: PyTree,
    scan: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    controls: Controls,
    reverse: bool,
) -> tuple[PyTree, PyTree]:
    """`(a, b)` with the gradient through the carry stopped where a block of
    `truncate` consumed steps begins: there `a_t * h_{t-1}` becomes a constant
    of `b_t` (its value from a first, gradient-free pass) and `a_t` zero."""
    cut = block_starts(controls, reverse)
    assert cut is not None
    _, hs = scan(*jax.lax.stop_gradient((a, b)))

    def previous(h: Array, h_0: Array) -> Array:
        # The carry each step receives, in time order.
        if reverse:
            return jnp.concatenate([h[1:], h_0[None]])
        return jnp.concatenate([h_0[None], h[:-1]])

    prev = jax.lax.stop_gradient(jtu.tree_map(previous, hs, h0))
    carried = _where_t(cut, jtu.tree_map(jnp.multiply, a, prev), 0)
    return _where_t(~cut, a, 0), jtu.tree_map(jnp.add, b, carried)
