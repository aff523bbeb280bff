"""Early exit: `run_until` runs a model's layers until a predicate on the carry
holds, in one `lax.while_loop` whatever the exit depth, walking a `Chain`'s
groups (a `Stacked` as one group)."""

import functools
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray, PyTree

from .._containers.chain import Chain, check_chain_method, lone_fn, Pattern, Placement
from .._containers.stack_calls import layer_of, stack_layer_fn
from .._containers.stacked import in_natural_order, Stacked
from .._containers.stage_order import refuse_stage_order
from .._helpers.checks import (
    check_bool,
    check_callable,
    check_carry,
    check_size,
    describe,
    is_array,
    noted,
    noting,
    split_key,
)
from .._helpers.stateful import find_state
from .._scan.buffers import refuse_buffer
from .._scan.drop_rates import DropRates
from .._scan.eager_compile import compiled_when_eager
from .._scan.layer_call import check_method, check_per_layer, LayerCall, Method
from .._scan.taps import tapping


Bound = int | np.integer | Array
"""A layer count: an int (checked) or an integer scalar array (traced: clamped)."""

Predicate = Callable[[PyTree], Bool[Array, ""] | Bool[Array, " B"] | bool]
"""`predicate(carry) -> bool`: a scalar for the whole batch, or one bool per
example (`[B]`, the carry's leading axis) with `per_example=True`."""


class _Exit(NamedTuple):
    """How a run stops; `masked`: mask instead of skipping (`mode="loop"`)."""

    predicate: Predicate
    per_example: bool
    batch: int
    min_layers: Bound
    max_layers: Bound
    masked: bool
    who: str


class _State(NamedTuple):
    """Layers visited, the carry's arrays, and per example (or for the batch)
    whether it halted and how many layers it ran."""

    i: Int[Array, ""]
    carry: PyTree
    halted: Bool[Array, ""] | Bool[Array, " B"]
    layers_run: Int[Array, ""] | Int[Array, " B"]


def _check_bound(name: str, value: object, length: int, who: str) -> Bound:
    if not isinstance(value, (jax.Array, np.ndarray)):
        hint = f"Hint: the model has {length} layers."
        return check_size(name, value, minimum=0, maximum=length, hint=hint)
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


def _batch_size(carry: PyTree, who: str) -> int:
    sizes = {}
    for path, leaf in jtu.tree_leaves_with_path(eqx.filter(carry, eqx.is_array)):
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
    out = noted(ex.predicate, f"The predicate of {ex.who}", carry)
    shape = (ex.batch,) if ex.per_example else ()
    out = jnp.asarray(out) if isinstance(out, (bool, np.bool_)) else out
    if not (is_array(out) and out.dtype == jnp.bool_ and out.shape == shape):
        expected = f"bool[{ex.batch}]" if ex.per_example else "a bool scalar"
        raise TypeError(
            f"The predicate of {ex.who} must return {expected}, got "
            f"{describe(out)}.\nHint: return a comparison, e.g. `lambda x: "
            "jnp.max(jnp.abs(x)) > 3.0` for the whole batch, or one bool per "
            "example with per_example=True, e.g. `lambda x: "
            "jnp.linalg.norm(x, axis=-1) > 3.0`."
        )
    return jnp.asarray(out)


def _active(ex: _Exit, state: _State) -> Bool[Array, ""]:
    return (state.i < ex.max_layers) & ~jnp.all(state.halted)


def _advance(
    ex: _Exit,
    state: _State,
    layer: Callable[[PyTree], PyTree],
    c_static: PyTree,
    where: str,
    guarded: bool = False,
) -> _State:
    """`state` after one more layer, an error noted with `where` and the carry.
    Halted examples keep their carry (a select: a NaN in a discarded row does
    not leak); `masked` also discards a step that should not run; `guarded`
    runs the layer behind a `lax.cond` (a lone layer)."""
    if guarded and not ex.masked:
        run_it = lambda s: _advance(ex, s, layer, c_static, where)  # noqa: E731
        return jax.lax.cond(_active(ex, state), run_it, lambda s: s, state)
    old = eqx.combine(state.carry, c_static)
    with noting(where, old):
        new = layer(old)
        check_carry(old, new, where)
        new_dyn = eqx.partition(new, eqx.is_array)[0]
        active = _active(ex, state) if ex.masked else True
        run = ~state.halted & active
        if ex.per_example or ex.masked:
            keep = lambda a: run.reshape(run.shape + (1,) * (a.ndim - run.ndim))
            where_run = lambda a, b: jnp.where(keep(a), b, a)
            new_dyn = jtu.tree_map(where_run, state.carry, new_dyn)
        i = state.i + jnp.asarray(active, jnp.int32)
        halted = state.halted | (
            (i >= ex.min_layers) & _halts(ex, eqx.combine(new_dyn, c_static))
        )
    return _State(i, new_dyn, halted, state.layers_run + run.astype(jnp.int32))


def _repeat(
    ex: _Exit,
    state: _State,
    size: int,
    body: Callable[[Int[Array, ""] | int, _State], _State],
) -> _State:
    """`body(j, state)` for `j < size` while the run is active: one
    `lax.while_loop` (a Python loop over all `size` when `masked`)."""
    if ex.masked:
        for j in range(size):
            state = body(j, state)
        return state

    return jax.lax.while_loop(
        lambda js: (js[0] < size) & _active(ex, js[1]),
        lambda js: (js[0] + 1, body(*js)),
        (jnp.int32(0), state),
    )[1]


def _walk_groups(
    ex: _Exit,
    groups: tuple,
    layout: tuple[Placement, ...],
    call: LayerCall,
    first: int,
    state: _State,
    c_static: PyTree,
) -> _State:
    """The groups in order (`first`: the number of their first layer): a lone
    layer behind a `cond`, a stack (or a repeated pattern's repeats) as one while
    loop, which runs a layer only while the run is active."""
    for group, place in zip(groups, layout):
        start, name = first + place.start, type(group).__name__
        if place.per_step == 0:
            fn = functools.partial(lone_fn, group, call, call.at(place.start), name)
            state = _advance(ex, state, fn, c_static, f"Layer {start} ({name})", True)
            continue
        stack = in_natural_order(group)
        group_call = call.placed(place.start, place.size, place.per_step)

        def body(
            j: Int[Array, ""] | int,
            s: _State,
            stack: Stacked = stack,
            group_call: LayerCall = group_call,
            place: Placement = place,
            start: int = start,
        ) -> _State:
            if place.per_step > 1:  # a pattern's repeat: its own groups
                repeat: Pattern = layer_of(stack, j)
                inner = group_call.inner(group_call.at(j))
                at = start + (j * place.per_step if isinstance(j, int) else 0)
                return _walk_groups(
                    ex, repeat.groups, repeat.layout, inner, at, s, c_static
                )
            name, last = type(stack.layers).__name__, start + place.size - 1
            where = (
                f"Layer {start + j} ({name})"
                if isinstance(j, int)
                else f"The stacked layer {name} (one body for layers {start}-{last})"
            )
            fn = stack_layer_fn(stack, group_call, j)
            return _advance(ex, s, fn, c_static, where)

        state = _repeat(ex, state, place.size // place.per_step, body)
    return state


def checked_call(
    model: object,
    args: tuple,
    kwargs: dict[str, object],
    key: PRNGKeyArray | None,
    method: Method | None,
    what: str,
) -> LayerCall:
    """The checks `run_until` and `run_layers` share, and the call of the layers."""
    if not isinstance(model, (Stacked, Chain)):
        raise TypeError(
            f"eqxscan.{what} takes an eqxscan.Stacked or an eqxscan.Chain, got "
            f"{describe(model)}.\nHint: pass one (of a StackedMLP, `model.blocks`)."
        )
    if isinstance(model, Stacked):
        refuse_stage_order(model.stage_order, f"eqxscan.{what} of a Stacked")
    # These runs call the layers themselves, so the model's drop rates would be
    # skipped without a word: refuse them unless inference mode turns them off.
    # (A container among the layers is called whole, its own rates applied.)
    drop = model.drop_rates
    if isinstance(drop, DropRates) and not drop.inference:
        raise ValueError(
            f"eqxscan.{what} does not apply drop_path/layer_drop, but this "
            "model drops layers in training.\nHint: call it on "
            "`eqx.nn.inference_mode(model)`, or build the model without drop "
            "rates for these runs."
        )
    if find_state(args, kwargs) is not None:
        raise TypeError(
            f"{what} does not take an eqx.nn.State.\nHint: call the model itself "
            "for stateful layers: `x, state = model(x, state)`."
        )
    # A call's own option: at its default it is dropped, else refused (passed
    # on, each layer would get it).
    reverse = kwargs.get("reverse", False)
    if isinstance(reverse, bool | int | np.bool_ | np.integer) and not reverse:
        kwargs = {k: v for k, v in kwargs.items() if k != "reverse"}
    else:
        raise TypeError(
            f"eqxscan.{what} takes no reverse={reverse!r}: the layers run in the order "
            f"{'given' if what == 'run_layers' else 'of the model, from layer 0'}."
            "\nHint: run_layers(model, x, slice(None, None, -1)) runs them last "
            "to first."
        )
    length, name = model.num_layers, type(model).__name__
    check_per_layer(args, kwargs, length)
    keys = None if key is None else split_key(key, length, name)
    refuse_buffer(args, kwargs, what)
    return LayerCall(args, kwargs, keys, method=method, caller=f"{what} of a {name}")


def check_layers_method(model: Stacked | Chain, method: Method | None) -> None:
    if isinstance(model, Chain):
        check_chain_method(model.groups, model.layout, method)
    else:
        check_method(method, model.layers)
        model.check_layer_axis("run")


def run_until(
    model: Stacked | Chain,
    x: PyTree,
    predicate: Predicate,
    *args: PyTree,
    per_example: bool = False,
    min_layers: Bound = 0,
    max_layers: Bound | None = None,
    key: PRNGKeyArray | None = None,
    method: Method | None = None,
    **kwargs: PyTree,
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

    - `model`: an [`eqxscan.Stacked`][] or an [`eqxscan.Chain`][] (its layers
      must keep the carry's structure, shapes and dtypes; a chain's indices).
    - `x`: the carry.
    - `predicate`: `predicate(carry) -> bool scalar`; with `per_example=True`,
      one bool per example (`[B]`, over the carry's leading axis).
    - `*args`, `**kwargs`: passed to every layer; [`eqxscan.per_layer`][]
      values are sliced by the layer's number in the model.
    - `per_example`: freeze each example once its predicate holds (a select:
      what a layer computes for a halted row is discarded, NaNs included),
      while the others run on until all have halted (or `max_layers`).
    - `min_layers`, `max_layers`: bounds on the layers run (default `0` and
      `len(model)`). Ints and concrete integer arrays are checked; traced
      integer scalars (one program for every bound) are clamped to
      `[0, len(model)]`.
    - `key`: split into `len(model)` keys: layer `i` gets `keys[i]`, as in a
      full call.
    - `method`: as for [`eqxscan.Stacked.__call__`][].

    **Returns:**

    `(carry, layers_run)`: the carry after the last layer that ran (per example,
    its own) and how many layers ran, an `int32` scalar (`[B]` per example).

    With `mode="scan"` this is a `jax.lax.while_loop` over the stacked layers
    (a chain's lone layer behind a `lax.cond`), so layers after the exit cost
    nothing; `jax.grad` through it fails (`while_loop` has no reverse-mode
    derivative): it is for inference (`jax.jvp` and `jax.vmap` work). With
    `mode="loop"` (the reference) every layer runs in Python and its result is
    discarded after the exit. `remat=` has no effect. Under `jax.vmap` a
    whole-batch exit becomes per mapped example. Stateful layers (an
    `eqx.nn.State` argument) are not supported. Outside `jit` a call is
    compiled once per structure of its arguments, and per predicate by its
    code and the values it reads, as an eager call of the model is; pass what
    the predicate compares against as an argument (one program for every
    value), or call it inside `eqx.filter_jit`.
    """
    _check_arrays(model, min_layers, max_layers)
    return _run_until(
        model,
        x,
        predicate,
        *args,
        per_example=per_example,
        min_layers=min_layers,
        max_layers=max_layers,
        key=key,
        method=method,
        **kwargs,
    )


def _check_arrays(model: object, low: object, high: object) -> None:
    # Bounds given as concrete arrays, checked as ints are before the compiled
    # call (inside it they are traced, and would be clamped without a word).
    length = getattr(model, "num_layers", None)
    concrete = [
        isinstance(v, (jax.Array, np.ndarray)) and not isinstance(v, jax.core.Tracer)
        for v in (low, high)
    ]
    if isinstance(length, int) and any(concrete):
        as_int = lambda v, c: int(v) if c and np.ndim(v) == 0 else v  # noqa: E731
        who = f"run_until of a {type(model).__name__}"
        _bounds(as_int(low, concrete[0]), as_int(high, concrete[1]), length, who)


def _bounds(low: object, high: object, length: int, who: str) -> tuple[Bound, Bound]:
    low = _check_bound("min_layers", low, length, who)
    high = _check_bound("max_layers", length if high is None else high, length, who)
    if isinstance(low, int) and isinstance(high, int) and low > high:
        raise ValueError(
            f"{who}: min_layers={low} is more than max_layers={high}.\nHint: "
            "min_layers is the fewest layers to run before the predicate is "
            "checked, max_layers the most."
        )
    return low, high


def _until(
    model: Stacked | Chain,
    x: PyTree,
    predicate: Predicate,
    *args: PyTree,
    per_example: bool = False,
    min_layers: Bound = 0,
    max_layers: Bound | None = None,
    key: PRNGKeyArray | None = None,
    method: Method | None = None,
    **kwargs: PyTree,
) -> tuple[PyTree, Int[Array, ""] | Int[Array, " B"]]:
    # `run_until`'s body, compiled once per structure when called eagerly.
    call = checked_call(model, args, kwargs, key, method, "run_until")
    if tapping():
        raise TypeError(
            "eqxscan.tap does not reach run_until: its layers run in a while "
            "loop of traced length.\nTap the model itself, or run_layers with "
            "the layers to watch."
        )
    who = call.caller
    check_callable("predicate", predicate)
    per_example = check_bool("per_example", per_example)
    length = model.num_layers
    low, high = _bounds(min_layers, max_layers, length, who)
    batch = _batch_size(x, who) if per_example else 0
    ex = _Exit(predicate, per_example, batch, low, high, model.mode == "loop", who)
    c_dyn, c_static = eqx.partition(x, eqx.is_array)
    halted = jnp.asarray(low == 0) & _halts(ex, x)
    start = _State(jnp.int32(0), c_dyn, halted, jnp.zeros(halted.shape, jnp.int32))
    check_layers_method(model, method)
    groups, layout = (
        ((model,), (Placement(0, length, 1),))
        if isinstance(model, Stacked)
        else (model.groups, model.layout)
    )
    end = _walk_groups(ex, groups, layout, call, 0, start, c_static)
    return eqx.combine(end.carry, c_static), end.layers_run


_run_until = compiled_when_eager(_until, name="run_until")
