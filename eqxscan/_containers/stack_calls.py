"""How a `Stacked` runs its layers through the layer-call seam: scanned, vmapped,
or layer `i` on its own."""

from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import Sharding
from jaxtyping import PyTree

from .._helpers.checks import noted
from .._helpers.constrain import constrain, layers_may_be_sharded, spans_devices
from .._helpers.stateful import (
    clone,
    find_state,
    get_arg,
    layer_state,
    replace_arg,
    state_pair,
)
from .._scan.buffers import (
    check_buffer_axis,
    check_keeps_writes,
    find_buffer,
    PerLayer,
    refuse_buffer,
    view_of,
)
from .._scan.call_state import call_state
from .._scan.drop_rates import check_droppable, DropRates
from .._scan.engine import run, stacked
from .._scan.layer_call import (
    carry_only,
    check_per_layer,
    Index,
    index,
    LayerCall,
    LayerFn,
    run_one,
)
from .._scan.options import ScanOptions
from .._scan.taps import untapped


@runtime_checkable
class Stack(Protocol):
    """What running a stack reads of a `Stacked`."""

    layers: Any
    num_layers: int
    options: ScanOptions
    layer_sharding: Sharding | PyTree[Sharding | None] | None

    def check_layer_axis(self, what: str) -> None: ...


def dropping_call(
    drop: DropRates | None, call: LayerCall, key: object, who: str
) -> LayerCall:
    """`call` with its drop inputs when `drop` drops in it."""
    if drop is None:
        return call
    has_state = find_state(call.args, call.kwargs) is not None
    call = call._replace(optional_key=True)
    if not check_droppable(drop, key, has_state, who):
        return call
    assert key is not None
    return call._replace(drop=drop.per_layer_inputs(key))  # pyright: ignore[reportArgumentType]  # checked by check_droppable


def _where(cls_name: str, length: int, i: Index | None) -> str:
    # How errors name the step: one body for every layer, or layer `i`.
    if i is None:
        steps = "repeats" if cls_name == "Pattern" else "layers"  # a Chain's
        return f"The stacked layer {cls_name} (one body for all {length} {steps})"
    return f"Layer {i} ({cls_name})"


def scan_layers(stack: Stack, x: PyTree, call: LayerCall) -> tuple[PyTree, PyTree]:
    """Fold `x` through the layers of `stack` as `call` says (its `per_layer`
    arguments checked by the caller): `(final carry, ys)`."""
    stack.check_layer_axis("call")
    length, cls_name = stack.num_layers, type(stack.layers).__name__
    state_at = find_state(call.args, call.kwargs)
    state = None
    if state_at is not None:
        if call.read_out is not carry_only:
            raise TypeError(
                "Stacked.scan does not take an eqx.nn.State; call the stack "
                "instead: `x, state = stack(x, state)`."
            )
        # Layer i gets its own slice of the state and returns its new state,
        # collected like a `y`, then written back into the whole state.
        state = get_arg(call.args, call.kwargs, state_at)
        sub = layer_state(state, stack.layers, length, "This Stacked")
        args, kwargs = replace_arg(call.args, call.kwargs, state_at, PerLayer(sub))
        call = call._replace(args=args, kwargs=kwargs, read_out=state_pair)
    at = find_buffer(call.args, call.kwargs)
    view = None if at is None else view_of(call.args, call.kwargs, at)
    if view is not None:
        check_buffer_axis(view, length, f"This Stacked of {cls_name} layers")
        drops = call.drop is not None or call.runs is not None
        check_keeps_writes(f"This Stacked of {cls_name} layers", drops)
    runs, drop = call.runs, call.drop
    if runs is None and drop is not None and not call.pattern_step:
        # LayerDrop left to the scan, which then runs only the layers that run.
        runs, call = drop.runs, call._replace(drop=drop.skipped_by_scan())
    layer_dyn, layer_static = eqx.partition(stack.layers, eqx.is_array)
    per_xs, one = call.scanned()
    sharding = stack.layer_sharding
    # With a buffer, the stacked buffer travels in the carry and step `i` gets
    # the view of its slice `i`: the step index is scanned beside the weights.
    steps = None if view is None else jnp.arange(length)

    def read(xs: tuple[PyTree, PyTree, PyTree]) -> tuple[PyTree, PyTree, PyTree]:
        # A step's layer, constrained (FSDP gathers one layer here), and its slices.
        return constrain(xs[0], sharding), *xs[1:]

    def step(carry: PyTree, xs: tuple[PyTree, PyTree, PyTree]) -> tuple[PyTree, PyTree]:
        dyn, per, i = xs
        layer = eqx.combine(dyn, layer_static)
        inputs = one(per)._replace(number=call.number_of(call_state().step))
        if view is not None:
            assert at is not None
            carry, tree = carry
            slot = view.of(tree).at(i)
            args, kwargs = replace_arg(inputs.args, inputs.kwargs, at, slot)
            inputs = inputs._replace(args=args, kwargs=kwargs)
        return run_one(layer, call, inputs, carry, f"the stacked layer {cls_name}")

    x, ys = run(
        step,
        x if view is None else (x, view.tree),
        (layer_dyn, per_xs, steps),
        length=length,
        options=stack.options,
        reverse=call.reverse,
        # A Chain's stack names its layers by their numbers in the chain.
        where=lambda i: _where(
            cls_name, length, None if i is None else call.number_of(i)
        ),
        read=read,
        # Unrolled, XLA may gather every sharded layer at once (FSDP).
        gathered=spans_devices(sharding) or layers_may_be_sharded(layer_dyn),
        runs=runs,
    )
    # The caller's `state` stays valid: `update` invalidates the one it is called on.
    return (x, ys) if state is None else ((x, clone(state).update(ys)), None)


def vmap_layers(stack: Stack, x: PyTree, call: LayerCall) -> PyTree:
    """Every layer of `stack` applied to `x` as `call` says, outputs stacked."""
    stack.check_layer_axis("vmap")
    if find_state(call.args, call.kwargs) is not None:
        raise TypeError(
            "Stacked.vmap does not take an eqx.nn.State: every layer would get "
            "the whole stack's state.\nHint: call the stack for stateful layers: "
            "`x, state = stack(x, state)`."
        )
    length, cls_name = stack.num_layers, type(stack.layers).__name__
    check_per_layer(call.args, call.kwargs, length)
    refuse_buffer(call.args, call.kwargs, "Stacked.vmap")
    layer_dyn, layer_static = eqx.partition(stack.layers, eqx.is_array)
    per_xs, one = call.scanned()

    def each(dyn: PyTree, per: PyTree, i: Index) -> PyTree:
        layer = eqx.combine(dyn, layer_static)
        # Layer `i` knows its index (`eqxscan.layer_index`); nothing is tapped.
        with untapped():
            out = run_one(layer, call, one(per)._replace(number=i), x, "Stacked.vmap")
        return out[0]

    inputs = (layer_dyn, per_xs)
    if stack.options.mode == "loop":
        outs = [
            noted(each, _where(cls_name, length, i), *index(inputs, i), i=i)
            for i in range(length)
        ]
        # The arrays stacked, the rest kept once (as `filter_vmap` keeps it).
        return stacked(outs, lambda i: _where(cls_name, length, i))
    where, steps = _where(cls_name, length, None), jnp.arange(length)
    return noted(eqx.filter_vmap(each), where, *inputs, steps)


def layer_of(stack: Stack, i: Index) -> Any:
    """Layer `i` of `stack` (`i` may be traced), constrained to `layer_sharding`."""
    return constrain(index(stack.layers, i), stack.layer_sharding)


def stack_layer_fn(stack: Stack, call: LayerCall, i: Index) -> LayerFn:
    """Layer `i` of `stack` as a function of the carry, as `call` runs it."""
    name = f"the stacked layer {type(stack.layers).__name__}"
    layer, one = layer_of(stack, i), call.at(i)
    return lambda c: run_one(layer, call, one, c, name)[0]
