"""Layer subsets: `run_layers` runs a chosen subset of a model's layers. A static
choice runs a new `Stacked` or `Chain` of the chosen layers; an index array
(traced or not) is one scan over the indices, each step running one layer."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._containers.chain import Chain, chain_layer_fn, run_groups
from .._containers.stack_calls import layer_of, scan_layers
from .._containers.stacked import restack, Stacked
from .._helpers.checks import describe
from .._helpers.constrain import layers_may_be_sharded, spans_devices
from .._scan.engine import run
from .._scan.layer_call import LayerCall, Method, run_one, take
from .._scan.scan_remat import name_inputs
from .._scan.taps import call_of, covering, tapping
from .early_exit import check_layers_method, checked_call


Layers = slice | Sequence[int] | np.ndarray | Array
"""Which layers `run_layers` runs: a slice or ints (static, checked), or an
integer array (traced or not: one program for every choice)."""

_TRACED_HINT = (
    "Hint: with traced indices each chosen layer is one step of one scan, so "
    "every layer of the chain must return a carry like its input; choose the "
    "layers statically (a slice or ints) to let a layer change the carry."
)


def _indices(layers: object, length: int, who: str) -> np.ndarray | slice | Array:
    """`layers` checked; traced indices, which cannot be, are counted from the
    end when negative (as concrete ones and JAX's indexing are), then clamped
    to `[0, L)`, as documented."""
    if isinstance(layers, slice):
        if len(range(length)[layers]) == 0:
            raise ValueError(
                f"{who}: {layers} selects no layers of {length}.\nHint: "
                "a slice i:j runs layers i to j-1 and needs i < j."
            )
        return layers
    traced = isinstance(layers, jax.core.Tracer)
    try:
        idx = layers if traced else np.asarray(layers)
    except Exception:
        idx = None
    # Before the dtype: NumPy reads `[]` as float64.
    if idx is not None and idx.ndim == 1 and idx.size == 0:
        raise ValueError(f"{who}: layers is empty; choose at least one layer.")
    if idx is None or idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(
            f"{who}: layers must be a slice, a sequence of ints or a 1-D integer "
            f"array, got {describe(layers)}.\nHint: e.g. `slice(2, 5)`, "
            "`[0, 2, 4]` or `jnp.arange(i, i + 3)` (`i` may be traced)."
        )
    if traced:  # widened first: `L` need not fit an int8's range
        idx = jnp.asarray(idx, jnp.int32)
        return jnp.clip(jnp.where(idx < 0, idx + length, idx), 0, length - 1)
    idx = idx.astype(np.int64)
    bad = idx[(idx < -length) | (idx >= length)]
    if bad.size:
        raise IndexError(
            f"{who}: layer index {int(bad[0])} is out of range for {length} "
            "layers.\nHint: indices are in [-L, L), negative counting from the end."
        )
    return idx % length


def _scan_indices(
    model: Stacked | Chain, x: PyTree, idx: Int[Array, " n"], call: LayerCall
) -> PyTree:
    """The carry after the layers `idx` (an index array): each scan step reads
    its layer from the whole model (no copy; gradients scatter back to it), and
    knows its layer number."""
    check_layers_method(model, call.method)
    options = model.options
    name = lambda x: name_inputs(x, options.scan_remat)  # noqa: E731
    c_static = eqx.filter(x, eqx.is_array, inverse=True)
    groups = model.groups if isinstance(model, Chain) else (model,)
    # Unrolled, XLA may gather every sharded layer at once (FSDP).
    gathered = layers_may_be_sharded(eqx.filter(groups, eqx.is_array)) or any(
        isinstance(g, Stacked) and spans_devices(g.layer_sharding) for g in groups
    )
    if isinstance(model, Stacked):
        call = call._replace(caller="Stacked")
        cls = type(model.layers).__name__
        body = f"The stacked layer {cls} (one body for the chosen layers)"
        step_name = f"Chosen layer {{}} ({cls})"

        def layer(i: Int[Array, ""], c: PyTree, /) -> PyTree:
            weights, one = name(layer_of(model, i)), name(call.at(i))
            return run_one(weights, call, one, c, f"the stacked layer {cls}")[0]
    else:
        layer = chain_layer_fn(
            model.groups, model.layout, call, name, c_static, _TRACED_HINT
        )
        body = "The chosen layers of a Chain (one switch over its layer bodies)"
        step_name = "Chosen layer {} of a Chain"

    return run(
        lambda carry, i: (layer(i, carry), None),
        x,
        idx,
        length=int(idx.shape[0]),
        options=options,
        where=lambda i: body if i is None else step_name.format(i),
        gathered=gathered,
    )[0]


def run_layers(
    model: Stacked | Chain,
    x: PyTree,
    layers: Layers,
    *args: PyTree,
    key: PRNGKeyArray | None = None,
    method: Method | None = None,
    **kwargs: PyTree,
) -> PyTree:
    """Run only the chosen layers of `model`, in the order given (progressive
    growing, depth-wise fine-tuning, a draft model of the first layers).

    **Arguments:**

    - `model`: an [`eqxscan.Stacked`][] or an [`eqxscan.Chain`][].
    - `x`: the carry.
    - `layers`: a slice (`slice(i, j)` runs layers `i..j-1`) or a sequence of
      ints (negative counting from the end), checked; or an integer array of
      layer numbers (across a chain's groups), checked when concrete; when
      traced (every choice of one length runs in one program) negative ones
      count from the end, as when concrete, and all are then clamped to
      `[0, L-1]`. Indices may repeat (a layer run twice), except under
      [`eqxscan.tap`][], which has one row per layer.
    - `*args`, `**kwargs`: passed to every layer; [`eqxscan.per_layer`][]
      values have the model's `L` layers first, and the chosen layers get
      their own slices.
    - `key`: split into `len(model)` keys; chosen layer `i` gets `keys[i]`, as
      in a full call.
    - `method`: as for [`eqxscan.Stacked.__call__`][].

    **Returns:**

    The carry after the chosen layers.

    A `Stacked` scans the chosen layers with its own options (`mode`, `remat=`,
    `unroll`), so this differentiates like a call: only the chosen layers get
    gradients (a repeated layer the sum). A static stretch of consecutive layers
    is sliced out of the stacked weights; otherwise each scan step reads its
    layer from the whole stack (no copy). Every chosen layer reads its index in
    `model` with [`eqxscan.layer_index`][]. A `Chain` given a static choice
    groups each stretch of consecutive chosen layers afresh (a program per
    choice; a lone layer may change the carry). Given an index array, each step
    `lax.switch`es on the layer's group, every group's body traced once, so
    every layer of the chain must return a carry like its input (an error names
    the layer otherwise); under `jax.vmap` over the indices the `switch` becomes
    a select running every body. Stateful layers (an `eqx.nn.State` argument)
    are not supported.
    """
    call = checked_call(model, args, kwargs, key, method, "run_layers")
    length = model.num_layers
    chosen = _indices(layers, length, call.caller)
    if isinstance(layers, jax.Array):
        idx = jnp.asarray(chosen, jnp.int32)  # `L` need not fit the given dtype
        if tapping():
            twice = jnp.any(jnp.diff(jnp.sort(idx)) == 0)
            idx = eqx.error_if(idx, twice, _tapped_twice("a layer"))
        with call_of(model), covering(length):
            return _scan_indices(model, x, idx, call)
    assert isinstance(chosen, (slice, np.ndarray))
    order = (
        list(range(length)[chosen]) if isinstance(chosen, slice) else chosen.tolist()
    )
    in_order = isinstance(chosen, slice) and chosen.step in (None, 1)
    if tapping() and len(set(order)) < len(order):
        twice = next(i for i in order if order.count(i) > 1)
        raise ValueError(_tapped_twice(f"layer {twice}"))
    # Taps number the layers they record; layers taken out of order are
    # numbered as the traced indices' scan numbers them. The records are rows
    # of a call of `model` (so find_nonfinite gives it its parameters).
    with call_of(model), covering(length):
        return _run_static(model, x, order, tapping() and not in_order, call)


def _tapped_twice(what: str) -> str:
    return (
        f"eqxscan.tap: run_layers was asked to run {what} twice, but a tap has "
        "one row per layer of the model, by layer index.\nHint: tap each run of "
        "that layer in a call of its own, e.g. "
        "`eqxscan.tap(lambda x: eqxscan.run_layers(model, x, [i]), stat)(x)`."
    )


def _stretches(order: list[int]) -> list[tuple[int, int]]:
    """`order` cut into stretches of consecutive layers, as `(start, stop)`."""
    out: list[tuple[int, int]] = []
    for i in order:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _run_static(
    model: Stacked | Chain, x: PyTree, order: list[int], traced: bool, call: LayerCall
) -> PyTree:
    # Every layer runs knowing its layer number (`layer_index()`, the call's
    # `start`). A Stacked's layers out of order are one scan over their indices.
    if traced or (
        isinstance(model, Stacked) and _stretches(order) != [(order[0], order[-1] + 1)]
    ):
        return _scan_indices(model, x, jnp.asarray(order, jnp.int32), call)
    if isinstance(model, Chain):
        # Each stretch of consecutive layers runs as a Chain of its own, so
        # that its layers keep their layer numbers (`layer_index()`).
        for start, stop in _stretches(order):
            sub = model[start:stop]
            sub_call = call.take(slice(start, stop))._replace(caller="Chain")
            x = run_groups(sub.groups, sub.layout, x, sub_call, "Chain")[0]
        return x
    idx = slice(order[0], order[-1] + 1)
    check_layers_method(model, call.method)
    sub = restack(model, layers=take(model.layers, idx), num_layers=len(order))
    return scan_layers(sub, x, call.take(idx)._replace(caller="Stacked"))[0]
