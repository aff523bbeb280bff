"""A chain's layers one at a time, as functions of the carry: for early exit
(`lone_fn`) and for traced subsets (`chain_layer_fn`)."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PyTree

from ..._helpers.checks import CarryError, check_carry, noted
from ..._helpers.constrain import constrain
from ..._scan.layer_call import index, LayerCall, OneLayer, run_one
from ..._scan.taps import add, held
from ..stacked import in_natural_order
from .chain import Chain
from .groups import layer_bodies


def lone_fn(
    layer: object, call: LayerCall, one: OneLayer, name: str, c: PyTree
) -> PyTree:
    """A lone layer as a function of the carry, as `call` runs it."""
    return run_one(layer, call, one, c, name)[0]


def _describe_layers(layers: list[int], name: str) -> str:
    if len(layers) == 1:
        return f"Layer {layers[0]} ({name})"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"Layers {layers[0]}-{layers[-1]} ({name}, one body)"
    shown = ", ".join(map(str, layers[:6])) + (", ..." if len(layers) > 6 else "")
    return f"Layers {shown} ({name}, one body)"


def chain_layer_fn(
    chain: Chain,
    call: LayerCall,
    name_inputs: Callable[[PyTree], PyTree],
    carry_static: PyTree,
    hint: str,
) -> Callable[[Int[Array, ""], PyTree], PyTree]:
    """Layer number `g` (traced) of `chain` as `fn(g, carry)`: a
    `lax.switch` on the body that holds the layer, which reads its one layer from
    its group's stacked weights. Every body must return a carry like the one it
    receives (else a `TypeError` naming the layer, with `hint`). `name_inputs`
    names what a body reads as the step's inputs."""
    walked = list(layer_bodies(chain.groups, chain.layout))
    # Per body: its group, whether a stack, and the layer numbers it runs.
    branches: dict[tuple[int, ...], tuple[Any, bool, list[int]]] = {}
    for g, (path, group, stacked, _) in enumerate(walked):
        branches.setdefault(path, (group, stacked, []))[2].append(g)
    # Per layer number: its body, then the indices of its weights (zero-padded).
    width = max(len(reps) for _, _, _, reps in walked)
    paths = list(branches)
    table = [(paths.index(p), *r, *[0] * (width - len(r))) for p, _, _, r in walked]
    rows = jnp.asarray(table, jnp.int32)

    def body(
        group: Any, stacked: bool, layers: list[int], row: Array, one: OneLayer
    ) -> Callable[[PyTree], PyTree]:
        name = type(group.layers if stacked else group).__name__
        where, depth = _describe_layers(layers, name), len(walked[layers[0]][3])

        # Only the carry's arrays pass through the `switch`; the rest (broadcast
        # arguments may be any Python value) is closed over.
        def fn(c_dyn: PyTree) -> PyTree:
            natural = in_natural_order(group)
            tree = natural.layers if stacked else natural
            for i in range(depth):
                tree = index(tree, row[1 + i])
            if stacked and natural.layer_sharding is not None:
                tree = constrain(tree, natural.layer_sharding)
            layer, old = name_inputs(tree), eqx.combine(c_dyn, carry_static)
            with held() as records:  # taps' records leave the switch as outputs
                new = noted(lone_fn, where, layer, call, one, where, old)
            try:
                check_carry(old, new, where)
            except CarryError as e:
                raise TypeError(f"{call.caller}: {where} {e.what}\n{hint}") from None
            return eqx.filter(new, eqx.is_array), tuple(records)

        return fn

    def layer(g: Int[Array, ""], carry: PyTree) -> PyTree:
        row = rows[g]
        one = name_inputs(call.at(g))
        fns = [body(*branch, row, one) for branch in branches.values()]
        new, records = jax.lax.switch(row[0], fns, eqx.filter(carry, eqx.is_array))
        add(records)
        return eqx.combine(new, carry_static)

    return layer
