"""Early exit and layer subsets: `run_until` runs a stack's layers until a
predicate on the carry holds, in one `lax.while_loop` over the stacked layers
whatever the exit depth; `run_layers` runs a chosen subset of the layers, given
by static ints or a traced array of indices.

Both work on a [`eqxscan.Stacked`][] and a [`eqxscan.Chain`][] (global layer
indices); `StackedMLP` has them as methods.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray, PyTree

from ._chain import (
    _Call,
    _route,
    _take,
    Chain,
    check_chain_method,
    Period,
    run_groups,
    Span,
)
from ._checks import (
    CarryError,
    check_bool,
    check_callable,
    check_carry,
    check_size,
    describe,
    noted,
    split_key,
)
from ._constrain import constrain, layers_may_be_sharded
from ._drop import DepthDrop
from ._engine import run
from ._options import ScanOptions
from ._remat import name_inputs
from ._stacked import (
    call_layer,
    carry_only,
    check_method,
    check_per_layer,
    LayerCall,
    Method,
    PerLayer,
    restack,
    scan_layers,
    Stacked,
)
from ._stateful import find_state


Bound = int | np.integer | Array
"""A layer count: an int (checked) or an integer scalar array, which may be
traced (clamped)."""

Layers = slice | Sequence[int] | np.ndarray | Array
"""Which layers `run_layers` runs: a slice or ints (static, checked), or an
integer array (traced or not: one program for every choice)."""

Predicate = Callable[[PyTree], Bool[Array, ""] | Bool[Array, " B"] | bool]
"""`predicate(carry) -> bool`: a scalar for the whole batch, or one bool per
example (`[B]`, the carry's leading axis) with `per_example=True`."""

_PREDICATE_HINT = (
    "Hint: return a comparison, e.g. `lambda x: jnp.max(jnp.abs(x)) > 3.0` for "
    "the whole batch, or one bool per example with per_example=True, e.g. "
    "`lambda x: jnp.linalg.norm(x, axis=-1) > 3.0`."
)


class _Exit(NamedTuple):
    """How a run decides to stop: the predicate, whether per example (with the
    batch size `batch`), the bounds, and whether to mask instead of skipping
    (`mode="loop"`, the reference)."""

    predicate: Predicate
    per_example: bool
    batch: int
    min_layers: Bound
    max_layers: Bound
    masked: bool
    who: str


class _State(NamedTuple):
    """What the run carries from layer to layer: layers visited `i`, the carry's
    array leaves, which examples (or whether the batch) halted, and the layers
    run per example (or for the batch)."""

    i: Int[Array, ""]
    carry: PyTree
    halted: Bool[Array, ""] | Bool[Array, " B"]
    count: Int[Array, ""] | Int[Array, " B"]


def _check_bound(name: str, value: object, length: int, who: str) -> Bound:
    if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, np.integer):
        if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(
                f"{who}: {name} must be an int or an integer scalar array, got "
                f"{describe(value)}.\nHint: pass e.g. `jnp.int32(k)` to choose the "
                "bound at run time without recompiling."
            )
        if not isinstance(value, jax.core.Tracer):
            check_size(name, int(value), minimum=0, maximum=length)
        # Traced: clamped to [0, L], as documented.
        return jnp.clip(jnp.asarray(value, jnp.int32), 0, length)
    return check_size(
        name,
        value,
        minimum=0,
        maximum=length,
        hint=f"Hint: the model has {length} layers.",
    )


def _batch_size(carry: PyTree, who: str) -> int:
    """The leading axis shared by every array leaf of the carry."""
    sizes = {}
    for path, leaf in jtu.tree_leaves_with_path(carry):
        if eqx.is_array(leaf):
            if leaf.ndim == 0:
                raise ValueError(
                    f"{who} with per_example=True freezes examples along the "
                    f"carry's leading axis, but `carry{jtu.keystr(path)}` is a "
                    f"scalar ({describe(leaf)}).\nHint: give every carry leaf "
                    "the batch axis first, or use per_example=False."
                )
            sizes[jtu.keystr(path)] = leaf.shape[0]
    if not sizes:
        raise ValueError(f"{who} with per_example=True needs an array carry.")
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{who} with per_example=True needs every carry leaf to share the "
            f"batch axis first, but the leading axes are {sizes}.\nHint: put the "
            "batch axis first in every leaf, or use per_example=False."
        )
    return next(iter(sizes.values()))


def _halts(ex: _Exit, carry: PyTree) -> Array:
    """The predicate on `carry`, checked: a bool scalar, or `[B]` per example."""
    out = noted(ex.predicate, f"The predicate of {ex.who}", carry)
    shape = (ex.batch,) if ex.per_example else ()
    if isinstance(out, (bool, np.bool_)):
        out = jnp.asarray(out)
    if not (
        isinstance(out, (jax.Array, np.ndarray))
        and out.dtype == jnp.bool_
        and out.shape == shape
    ):
        expected = f"bool[{ex.batch}]" if ex.per_example else "a bool scalar"
        raise TypeError(
            f"The predicate of {ex.who} must return {expected}, got "
            f"{describe(out)}.\n{_PREDICATE_HINT}"
        )
    return jnp.asarray(out)


def _active(ex: _Exit, state: _State) -> Bool[Array, ""]:
    """Whether the next layer runs for some example."""
    return (state.i < ex.max_layers) & ~jnp.all(state.halted)


def _advance(
    ex: _Exit,
    state: _State,
    layer: Callable[[PyTree], PyTree],
    c_static: PyTree,
    where: str,
) -> _State:
    """`state` after one more layer. Halted examples keep their carry (a select,
    so that a NaN in a discarded row does not leak); with `masked`, the whole
    step is also discarded when no layer should run."""
    old = eqx.combine(state.carry, c_static)
    new = layer(old)
    check_carry(old, new, where)
    new_dyn = eqx.partition(new, eqx.is_array)[0]
    run = ~state.halted
    if ex.masked:
        run = run & _active(ex, state)
    if ex.per_example or ex.masked:

        def keep(a: Array, b: Array) -> Array:
            mask = run.reshape(run.shape + (1,) * (a.ndim - run.ndim))
            return jnp.where(mask, b, a)

        new_dyn = jtu.tree_map(keep, state.carry, new_dyn)
    step = run.astype(jnp.int32)
    i = state.i + (_active(ex, state).astype(jnp.int32) if ex.masked else 1)
    count = state.count + step
    halted = state.halted | (
        (i >= ex.min_layers) & _halts(ex, eqx.combine(new_dyn, c_static))
    )
    return _State(i, new_dyn, halted, count)


def _guarded(
    ex: _Exit,
    state: _State,
    layer: Callable[[PyTree], PyTree],
    c_static: PyTree,
    where: str,
) -> _State:
    """One layer that runs only while the run is active (`lax.cond`; masked in
    `mode="loop"`)."""
    if ex.masked:
        return _advance(ex, state, layer, c_static, where)
    return jax.lax.cond(
        _active(ex, state),
        lambda s: _advance(ex, s, layer, c_static, where),
        lambda s: s,
        state,
    )


def _repeat(
    ex: _Exit,
    state: _State,
    size: int,
    body: Callable[[Int[Array, ""] | int, _State], _State],
) -> _State:
    """`body(j, state)` for `j = 0, 1, ...` while the run is active, at most
    `size` times: one `lax.while_loop` (a Python loop over all `size` in
    `mode="loop"`)."""
    if ex.masked:
        for j in range(size):
            state = body(j, state)
        return state

    def cond(js: tuple[Array, _State]) -> Array:
        j, s = js
        return (j < size) & _active(ex, s)

    def step(js: tuple[Array, _State]) -> tuple[Array, _State]:
        j, s = js
        return j + 1, body(j, s)

    return jax.lax.while_loop(cond, step, (jnp.int32(0), state))[1]


def _index(tree: PyTree, j: Int[Array, ""] | int) -> PyTree:
    """Slice `j` of every array leaf (`dynamic_index_in_dim` when traced)."""
    if isinstance(j, int):
        return jtu.tree_map(lambda a: a[j] if eqx.is_array(a) else a, tree)
    return jtu.tree_map(
        lambda a: (
            jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False)
            if eqx.is_array(a)
            else a
        ),
        tree,
    )


def _pick(value: object, j: Int[Array, ""] | int) -> object:
    return _index(value.tree, j) if isinstance(value, PerLayer) else value


def _stack_layer(
    stack: Stacked,
    j: Int[Array, ""] | int,
    args: tuple,
    kwargs: dict[str, object],
    keys: Array | None,
    method: Method | None,
    who: str,
) -> Callable[[PyTree], PyTree]:
    """Layer `j` of `stack` as a function of the carry, with its `per_layer`
    slices and key."""
    layer = _index(stack.layers, j)
    if stack.layer_sharding is not None:
        dyn, static = eqx.partition(layer, eqx.is_array)
        layer = eqx.combine(constrain(dyn, stack.layer_sharding), static)
    a = tuple(_pick(v, j) for v in args)
    kw = {n: _pick(v, j) for n, v in kwargs.items()}
    k = None if keys is None else keys[j]
    return lambda c: call_layer(layer, method, c, a, kw, k, who)


def _run_stack(
    ex: _Exit,
    stack: Stacked,
    state: _State,
    c_static: PyTree,
    args: tuple,
    kwargs: dict[str, object],
    keys: Array | None,
    method: Method | None,
    first: int,
) -> _State:
    name = type(stack.layers).__name__

    def body(j: Int[Array, ""] | int, s: _State) -> _State:
        where = (
            f"Layer {first + j} ({name})"
            if isinstance(j, int)
            else f"The stacked layer {name} (one body for layers {first}-"
            f"{first + stack.num_layers - 1})"
        )
        fn = _stack_layer(stack, j, args, kwargs, keys, method, ex.who)
        # The while loop runs a layer only while the run is active: no `cond`.
        return noted(_advance, where, ex, s, fn, c_static, where)

    return _repeat(ex, state, stack.num_layers, body)


def _run_groups(
    ex: _Exit,
    groups: tuple,
    layout: tuple[Span, ...],
    state: _State,
    c_static: PyTree,
    call: _Call,
    first: int,
) -> _State:
    """The groups of a chain (or of one repeat of a pattern) in order, each
    layer run only while the run is active. `first` is the global index of the
    groups' first layer (the first repeat's, inside a pattern)."""
    for group, span in zip(groups, layout):
        args = tuple(_route(a, span) for a in call.args)
        kwargs = {n: _route(v, span) for n, v in call.kwargs.items()}
        keys = None if call.keys is None else _take(call.keys, span)
        start = first + span.start
        if span.period == 0:
            where = f"Layer {start} ({type(group).__name__})"

            def layer(c: PyTree, group: object = group, a=args, kw=kwargs, k=keys):
                return call_layer(group, call.method, c, a, kw, k, ex.who)

            state = noted(_guarded, where, ex, state, layer, c_static, where)
        elif span.period == 1:
            state = _run_stack(
                ex, group, state, c_static, args, kwargs, keys, call.method, start
            )
        else:
            state = _run_pattern(ex, group, span, state, c_static, call, args, kwargs)
    return state


def _run_pattern(
    ex: _Exit,
    group: Stacked,
    span: Span,
    state: _State,
    c_static: PyTree,
    call: _Call,
    args: tuple,
    kwargs: dict[str, object],
) -> _State:
    """A repeated pattern of a chain: one while-loop step per repeat, each of
    its layers run only while the run is active."""
    keys = None if call.keys is None else _take(call.keys, span)

    def body(r: Int[Array, ""] | int, s: _State) -> _State:
        unit: Period = _index(group.layers, r)
        # One repeat's `per_layer` slices and keys, then by the unit's groups.
        unit_args = tuple(_pick(a, r) for a in args)
        unit_kwargs = {n: _pick(v, r) for n, v in kwargs.items()}
        unit_keys = None if keys is None else keys[r]
        unit_call = call._replace(args=unit_args, kwargs=unit_kwargs, keys=unit_keys)
        first = span.start + (r * span.period if isinstance(r, int) else 0)
        return _run_groups(ex, unit.groups, unit.layout, s, c_static, unit_call, first)

    return _repeat(ex, state, span.size // span.period, body)


def _check_model(model: object, what: str) -> None:
    if isinstance(model, (Stacked, Chain)):
        _check_no_drop(model, what)
        return
    hint = (
        f"Hint: a StackedMLP has its own `model.{what}(...)`."
        if hasattr(model, what)
        else "Hint: pass an eqxscan.Stacked or an eqxscan.Chain."
    )
    raise TypeError(
        f"eqxscan.{what} takes an eqxscan.Stacked or an eqxscan.Chain, got "
        f"{describe(model)}.\n{hint}"
    )


def _check_no_drop(model: Stacked | Chain, what: str) -> None:
    # These runs call the layers themselves, so drop rates would be skipped
    # without a word: refuse them unless inference mode turns them off.
    modules = jtu.tree_leaves(model, is_leaf=lambda n: isinstance(n, (Stacked, Chain)))
    for module in [model, *modules]:
        drop = getattr(module, "depth_drop", None)
        if isinstance(drop, DepthDrop) and not drop.inference:
            raise ValueError(
                f"eqxscan.{what} does not apply drop_path/layer_drop, but this "
                "model drops layers in training.\nHint: call it on "
                "`eqx.nn.inference_mode(model)`, or build the model without drop "
                "rates for these runs."
            )


def _check_no_state(args: tuple, kwargs: dict[str, object], who: str) -> None:
    if find_state(args, kwargs) is not None:
        raise TypeError(
            f"{who} does not take an eqx.nn.State.\nHint: call the model itself "
            "for stateful layers: `x, state = model(x, state)`."
        )


def run_until(
    model: Stacked | Chain,
    x: PyTree,
    predicate: Predicate,
    *args: object,
    per_example: bool = False,
    min_layers: Bound = 0,
    max_layers: Bound | None = None,
    key: PRNGKeyArray | None = None,
    method: Method | None = None,
    **kwargs: object,
) -> tuple[PyTree, Int[Array, ""] | Int[Array, " B"]]:
    """Run the layers of `model` in order until `predicate(carry)` holds (early
    exit at inference), in one compiled program for every exit depth.

    The predicate is checked on the input and after each layer, once at least
    `min_layers` layers have run; the run stops when it holds, or after
    `max_layers` layers. As a Python loop:

    ```text
    n = 0
    while n < max_layers and not (n >= min_layers and predicate(x)):
        x = layer[n](x, key=keys[n]); n += 1
    ```

    **Arguments:**

    - `model`: an [`eqxscan.Stacked`][] or an [`eqxscan.Chain`][] (whose layers
      must keep the carry's structure, shapes and dtypes; layer indices are the
      chain's).
    - `x`: the carry.
    - `predicate`: `predicate(carry) -> bool scalar`; with `per_example=True`,
      one bool per example (`[B]`, over the carry's leading axis).
    - `*args`, `**kwargs`: passed to every layer, except values wrapped in
      [`eqxscan.per_layer`][], which are sliced per layer (by its index in the
      model).
    - `per_example`: freeze each example once its predicate holds: its carry
      stops changing (a select: what the layer computes for a halted row is
      discarded, NaNs included), while the layers run on for the others until
      all have halted (or `max_layers`).
    - `min_layers`, `max_layers`: bounds on the layers run (default `0` and
      `len(model)`). Ints are checked; traced integer scalars (one program for
      every bound) are clamped to `[0, len(model)]`.
    - `key`: split into `len(model)` keys as for a call: layer `i` gets
      `keys[i]`, so the layers that run get the keys of a full call.
    - `method`: as for [`eqxscan.Stacked.__call__`][].

    **Returns:**

    `(carry, layers_run)`: the carry after the last layer that ran (per
    example: after its own last layer) and how many layers ran, an `int32`
    scalar (`[B]` per example).

    With `mode="scan"` this is a `jax.lax.while_loop` over the stacked layers
    (a lone layer of a chain sits behind a `lax.cond`), so layers after the exit
    cost nothing. `jax.lax.while_loop` has no reverse-mode derivative, so
    `jax.grad` through `run_until` fails (JAX's error names `while_loop`); it is
    for inference (forward-mode `jax.jvp` and `jax.vmap` work). With
    `mode="loop"` (the reference) every layer runs in Python and its result is
    discarded after the exit. `checkpoint=` has no effect: nothing is saved for
    a backward pass. Under `jax.vmap` a whole-batch exit becomes per mapped
    example, as for `while_loop`. Stateful layers (an `eqx.nn.State`
    argument) are not supported. Called outside `jit`, every call compiles
    afresh: call it inside `eqx.filter_jit`, with what the predicate compares
    against as an argument (one program for every value).
    """
    _check_model(model, "run_until")
    who = f"run_until of a {type(model).__name__}"
    check_callable("predicate", predicate)
    per_example = check_bool("per_example", per_example)
    _check_no_state(args, kwargs, "run_until")
    length = model.num_layers
    low = _check_bound("min_layers", min_layers, length, who)
    high = _check_bound(
        "max_layers", length if max_layers is None else max_layers, length, who
    )
    if isinstance(low, int) and isinstance(high, int) and low > high:
        raise ValueError(
            f"{who}: min_layers={low} is more than max_layers={high}.\nHint: "
            "min_layers is the fewest layers to run before the predicate is "
            "checked, max_layers the most."
        )
    check_per_layer(args, kwargs, length)
    keys = None if key is None else split_key(key, length, type(model).__name__)
    batch = _batch_size(x, who) if per_example else 0
    masked = model.mode == "loop"
    ex = _Exit(predicate, per_example, batch, low, high, masked, who)
    c_dyn, c_static = eqx.partition(x, eqx.is_array)
    shape = (batch,) if per_example else ()
    start = _State(
        jnp.int32(0),
        c_dyn,
        jnp.asarray(low == 0) & _halts(ex, x),
        jnp.zeros(shape, jnp.int32),
    )
    if isinstance(model, Stacked):
        check_method(method, model.layers)
        model.check_layer_axis("run")
        end = _run_stack(ex, model, start, c_static, args, kwargs, keys, method, 0)
    else:
        call = _Call(args, kwargs, keys, False, False, method)
        end = _run_groups(ex, model.groups, model.layout, start, c_static, call, 0)
    return eqx.combine(end.carry, c_static), end.count


def _static_indices(layers: object, length: int, who: str) -> np.ndarray | slice:
    """Static `layers` as a slice or a NumPy index array, checked."""
    if isinstance(layers, slice):
        chosen = range(length)[layers]
        if len(chosen) == 0:
            raise ValueError(
                f"{who}: {layers} selects no layers of {length}.\nHint: "
                "a slice i:j runs layers i to j-1 and needs i < j."
            )
        return layers
    try:
        idx = np.asarray(layers)
    except Exception:
        idx = None
    if idx is None or idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(
            f"{who}: layers must be a slice, a sequence of ints or a 1-D integer "
            f"array, got {describe(layers)}.\nHint: e.g. `slice(2, 5)`, "
            "`[0, 2, 4]` or `jnp.arange(i, i + 3)`."
        )
    if idx.size == 0:
        raise ValueError(f"{who}: layers is empty; choose at least one layer.")
    bad = idx[(idx < -length) | (idx >= length)]
    if bad.size:
        raise IndexError(
            f"{who}: layer index {int(bad[0])} is out of range for {length} "
            "layers.\nHint: indices are in [-L, L), negative counting from the end."
        )
    return idx % length


def _dynamic_indices(layers: Array, length: int, who: str) -> Array:
    if layers.ndim != 1 or not jnp.issubdtype(layers.dtype, jnp.integer):
        raise TypeError(
            f"{who}: layers must be a 1-D integer array, got {describe(layers)}."
            "\nHint: e.g. `jnp.arange(i, i + 3)` with a traced `i`."
        )
    if layers.shape[0] == 0:
        raise ValueError(f"{who}: layers is empty; choose at least one layer.")
    if not isinstance(layers, jax.core.Tracer):
        _static_indices(np.asarray(layers), length, who)
    # Traced indices cannot be checked: they are clamped to [0, L), as
    # documented (negative indices are not counted from the end).
    return jnp.clip(layers, 0, length - 1)


def _take_layers(tree: PyTree, idx: object) -> PyTree:
    return jtu.tree_map(lambda a: a[idx] if eqx.is_array(a) else a, tree)


def _take_args(values: Sequence[object], idx: object) -> list[object]:
    return [
        PerLayer(_take_layers(v.tree, idx)) if isinstance(v, PerLayer) else v
        for v in values
    ]


def _scan_gathered(
    stack: Stacked,
    x: PyTree,
    idx: Int[Array, " n"],
    args: tuple,
    kwargs: dict[str, object],
    keys: Array | None,
    method: Method | None,
) -> PyTree:
    """Scan the layers `idx` (traced) of `stack`: each step gathers its one
    layer's weights and `per_layer` slices from the whole stack, so no copy of
    the chosen layers is made; gradients scatter back to the chosen layers."""
    name = type(stack.layers).__name__
    options = stack.options

    def step(carry: PyTree, xs: tuple) -> tuple[PyTree, None]:
        i, k = xs
        layer = _index(stack.layers, i)
        dyn, static = eqx.partition(layer, eqx.is_array)
        if stack.layer_sharding is not None:
            dyn = constrain(dyn, stack.layer_sharding)
        a = tuple(_pick(v, i) for v in args)
        kw = {n: _pick(v, i) for n, v in kwargs.items()}
        dyn, a, kw = name_inputs((dyn, a, kw), options.scan_checkpoint)
        out = call_layer(eqx.combine(dyn, static), method, carry, a, kw, k, "Stacked")
        return out, None

    def where(i: int | None) -> str:
        if i is None:
            return f"The stacked layer {name} (one body for the chosen layers)"
        return f"Chosen layer {i} ({name})"

    gathered = stack.layer_sharding is not None or layers_may_be_sharded(
        eqx.filter(stack.layers, eqx.is_array)
    )
    return _scan_chosen(step, x, idx, keys, options, where, gathered)


def _scan_chosen(
    step: Callable[[PyTree, tuple], tuple[PyTree, None]],
    x: PyTree,
    idx: Int[Array, " n"],
    keys: Array | None,
    options: ScanOptions,
    where: Callable[[int | None], str],
    gathered: bool,
) -> PyTree:
    """The carry after `step` over the chosen layers `idx` (and their keys)."""
    sub_keys = None if keys is None else keys[idx]
    steps = (idx, sub_keys)
    length = int(idx.shape[0])
    return run(
        step, x, steps, length=length, options=options, where=where, gathered=gathered
    )[0]


class _Branch(NamedTuple):
    """One body of a chain's traced subset: a lone layer or a scanned run,
    reached from the chain's groups by `path` (a group index at each level, one
    level per repeated unit on the way). Its layer is indexed by one traced
    index per repeated unit, then one for a run (`run`); `layers` are the
    global indices it covers."""

    path: tuple[int, ...]
    run: bool
    layers: tuple[int, ...]
    name: str


def _walk(
    groups: tuple, layout: tuple[Span, ...], path: tuple[int, ...], reps: tuple
) -> Iterator[tuple[tuple[int, ...], bool, tuple[int, ...], str]]:
    """`(path, run, indices, class name)` for each layer of `groups`, in order:
    which body runs it and the indices (repeats, then the run's offset) that
    pick its weights."""
    for j, (group, span) in enumerate(zip(groups, layout)):
        here = path + (j,)
        if span.period == 0:
            yield here, False, reps, type(group).__name__
        elif span.period == 1:
            name = type(group.layers).__name__
            for o in range(span.size):
                yield here, True, reps + (o,), name
        else:
            unit: Period = group.layers
            for r in range(span.size // span.period):
                yield from _walk(unit.groups, unit.layout, here, reps + (r,))


def _describe_layers(layers: tuple[int, ...], name: str) -> str:
    if len(layers) == 1:
        return f"Layer {layers[0]} ({name})"
    if layers == tuple(range(layers[0], layers[-1] + 1)):
        return f"Layers {layers[0]}-{layers[-1]} ({name}, one body)"
    shown = ", ".join(map(str, layers[:6])) + (", ..." if len(layers) > 6 else "")
    return f"Layers {shown} ({name}, one body)"


def _chain_table(chain: Chain) -> tuple[list[_Branch], np.ndarray]:
    """The chain's bodies, and for each global layer a row `[body, i_0, ...]`:
    which body runs it and the indices of its weights (padded with zeros)."""
    walked = list(_walk(chain.groups, chain.layout, (), ()))
    paths = list(dict.fromkeys(path for path, _, _, _ in walked))
    width = 1 + max(len(indices) for _, _, indices, _ in walked)
    table = np.zeros((len(walked), width), np.int32)
    for g, (path, _, indices, _) in enumerate(walked):
        table[g, : 1 + len(indices)] = (paths.index(path), *indices)
    branches = []
    for b, path in enumerate(paths):
        layers = tuple(int(g) for g in np.flatnonzero(table[:, 0] == b))
        _, run, _, name = walked[layers[0]]
        branches.append(_Branch(path, run, layers, _describe_layers(layers, name)))
    return branches, table


def _branch_layer(chain: Chain, branch: _Branch, row: Int[Array, " w"]) -> object:
    """The layer of `branch` that `row` (a row of `_chain_table`) picks: the
    group reached by `branch.path`, indexed by the row's traced indices."""
    groups: tuple = chain.groups
    indices = []
    for level, j in enumerate(branch.path):
        group = groups[j]
        if level < len(branch.path) - 1:  # a repeated unit: pick the repeat
            indices.append(row[1 + level])
            groups = group.layers.groups
    tree = group.layers if branch.run else group
    if branch.run:  # then the layer within the run
        indices.append(row[len(branch.path)])
    for i in indices:
        tree = _index(tree, i)
    if branch.run and group.layer_sharding is not None:
        dyn, static = eqx.partition(tree, eqx.is_array)
        tree = eqx.combine(constrain(dyn, group.layer_sharding), static)
    return tree


def _scan_chain(
    chain: Chain,
    x: PyTree,
    idx: Int[Array, " n"],
    args: tuple,
    kwargs: dict[str, object],
    keys: Array | None,
    method: Method | None,
    who: str,
) -> PyTree:
    """Scan the layers `idx` (traced) of `chain`: each step looks up which body
    runs its layer and `lax.switch`es to it, and that body reads its one layer
    from its group's stacked weights (a lone layer as it is). Every body is
    traced once, and must return a carry like the one it receives."""
    branches, table = _chain_table(chain)
    rows = jnp.asarray(table)
    c_static = eqx.filter(x, eqx.is_array, inverse=True)
    options = chain.options

    def body(
        branch: _Branch, row: Array, a: tuple, kw: dict[str, object], k: object
    ) -> Callable[[PyTree], PyTree]:
        # Only the carry's arrays pass through the `switch`; the rest (broadcast
        # arguments may be any Python value) is closed over.
        def fn(c_dyn: PyTree) -> PyTree:
            layer = _branch_layer(chain, branch, row)
            dyn, static = eqx.partition(layer, eqx.is_array)
            layer = eqx.combine(name_inputs(dyn, options.scan_checkpoint), static)
            old = eqx.combine(c_dyn, c_static)
            where = branch.name
            new = noted(call_layer, where, layer, method, old, a, kw, k, who)
            try:
                check_carry(old, new, where)
            except CarryError as e:
                raise TypeError(
                    f"{who}: {where} {e.what}\nHint: with traced indices each chosen "
                    "layer is one step of one scan, so every layer of the chain "
                    "must return a carry like its input; choose the layers "
                    "statically (a slice or ints) to let a layer change the carry."
                ) from None
            return eqx.filter(new, eqx.is_array)

        return fn

    def step(carry: PyTree, xs: tuple) -> tuple[PyTree, None]:
        g, k = xs
        row = rows[g]
        a = tuple(_pick(v, g) for v in args)
        kw = {n: _pick(v, g) for n, v in kwargs.items()}
        a, kw = name_inputs((a, kw), options.scan_checkpoint)
        bodies = [body(branch, row, a, kw, k) for branch in branches]
        new = jax.lax.switch(row[0], bodies, eqx.filter(carry, eqx.is_array))
        return eqx.combine(new, c_static), None

    def where(i: int | None) -> str:
        if i is None:
            return (
                f"The chosen layers of a Chain (one switch over its "
                f"{len(branches)} layer bodies)"
            )
        return f"Chosen layer {i} of a Chain"

    gathered = any(
        isinstance(g, Stacked) and g.layer_sharding is not None for g in chain.groups
    ) or layers_may_be_sharded(eqx.filter(chain.groups, eqx.is_array))
    return _scan_chosen(step, x, idx, keys, options, where, gathered)


def run_layers(
    model: Stacked | Chain,
    x: PyTree,
    layers: Layers,
    *args: object,
    key: PRNGKeyArray | None = None,
    method: Method | None = None,
    **kwargs: object,
) -> PyTree:
    """Run only the chosen layers of `model`, in the order given: progressive
    growing, depth-wise fine-tuning, a draft model of a model's first layers.

    **Arguments:**

    - `model`: an [`eqxscan.Stacked`][] or an [`eqxscan.Chain`][].
    - `x`: the carry.
    - `layers`: a slice (`slice(i, j)` runs layers `i..j-1`) or a sequence of
      ints (negative counting from the end), checked; or an integer array of
      layer indices (the chain's global indices for a `Chain`), which may be
      traced: every choice of the same length runs in one compiled program.
      Traced indices cannot be checked and are clamped to `[0, L-1]`; concrete
      arrays are checked. Indices may repeat (a layer run twice).
    - `*args`, `**kwargs`: passed to every layer; values wrapped in
      [`eqxscan.per_layer`][] have the model's `L` layers first and the chosen
      layers get their own slices.
    - `key`: split into `len(model)` keys as for a full call; chosen layer `i`
      gets `keys[i]`, the key it has in a full run.
    - `method`: as for [`eqxscan.Stacked.__call__`][].

    **Returns:**

    The carry after the chosen layers.

    A `Stacked` scans the chosen layers with its own options (`mode`,
    `checkpoint=`, `unroll`), so this differentiates like a call: only the
    chosen layers get gradients (a repeated layer the sum). Static choices are
    sliced out of the stacked weights first; with an index array each scan
    step reads its one layer from the whole stack (no copy of the chosen
    layers). A `Chain` given a static choice groups the chosen layers afresh
    (each choice compiles its own program; a lone layer may change the carry).
    Given an index array it scans the chosen layers with the chain's options,
    and each step `lax.switch`es on the layer's group: every group's body
    (a lone layer, a scanned run's one layer read from its stacked weights, a
    layer of a repeated unit read from its repeat) is traced once into the
    program and each step runs one of them, so every layer of the chain must
    return a carry like its input (an error names the layer otherwise). Under
    `jax.vmap` over the indices the `switch` becomes a select, and every step
    runs every group's body. Stateful layers (an `eqx.nn.State` argument) are
    not supported.
    """
    _check_model(model, "run_layers")
    who = f"run_layers of a {type(model).__name__}"
    _check_no_state(args, kwargs, "run_layers")
    length = model.num_layers
    check_per_layer(args, kwargs, length)
    keys = None if key is None else split_key(key, length, type(model).__name__)
    if isinstance(layers, jax.Array):
        idx: object = _dynamic_indices(layers, length, who)
    else:
        idx = _static_indices(layers, length, who)
    if isinstance(layers, jax.Array) and isinstance(model, Chain):
        check_chain_method(model.groups, model.layout, method)
        return _scan_chain(model, x, idx, args, kwargs, keys, method, who)
    if isinstance(layers, jax.Array):
        check_method(method, model.layers)
        model.check_layer_axis("run")
        return _scan_gathered(model, x, idx, args, kwargs, keys, method)
    names = list(kwargs)
    picked = _take_args(list(args) + [kwargs[n] for n in names], idx)
    sub_args = tuple(picked[: len(args)])
    sub_kwargs = dict(zip(names, picked[len(args) :]))
    sub_keys = None if keys is None else keys[idx]
    if isinstance(model, Chain):
        chosen = model.unstack()
        order = range(length)[idx] if isinstance(idx, slice) else idx.tolist()
        sub = Chain(
            [chosen[i] for i in order],
            periodic=model.periodic,
            **model.options.as_args(),
        )
        call = _Call(sub_args, sub_kwargs, sub_keys, False, False, method)
        return run_groups(sub.groups, sub.layout, x, call, "Chain")[0]
    check_method(method, model.layers)
    model.check_layer_axis("run")
    count = len(range(length)[idx]) if isinstance(idx, slice) else int(idx.shape[0])
    sub = restack(model, layers=_take_layers(model.layers, idx), num_layers=count)
    call = LayerCall(sub_args, sub_kwargs, sub_keys, carry_only, False, method)
    return scan_layers(sub, x, call)[0]
