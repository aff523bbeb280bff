"""A chain's layers one at a time, as functions of the carry: for early exit
(`lone_fn`) and for traced subsets (`chain_layer_fn`)."""

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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


class _Branch(NamedTuple):
    """One body of a chain's traced subset: a lone layer or a stack, reached by
    `path` (a group index per level, one level per repeated pattern), covering
    the global `layers`."""

    path: tuple[int, ...]
    stacked: bool
    layers: tuple[int, ...]
    name: str


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
    walked = list(layer_bodies(chain.groups, chain.layout))
    paths = list(dict.fromkeys(path for path, _, _, _ in walked))
    width = 1 + max(len(indices) for _, _, _, indices in walked)
    table = np.zeros((len(walked), width), np.int32)
    for g, (path, _, _, indices) in enumerate(walked):
        table[g, : 1 + len(indices)] = (paths.index(path), *indices)
    branches = []
    for b, path in enumerate(paths):
        layers = tuple(int(g) for g in np.flatnonzero(table[:, 0] == b))
        _, body, stacked, _ = walked[layers[0]]
        name = _describe_layers(layers, type(body).__name__)
        branches.append(_Branch(path, stacked, layers, name))
    return branches, table


def _branch_layer(chain: Chain, branch: _Branch, row: Int[Array, " w"]) -> object:
    """The layer of `branch` that `row` (of `_chain_table`) picks: indexed by
    the row's traced indices, one per repeated pattern, then within a stack."""
    *patterns, last = branch.path
    groups: tuple = chain.groups
    for j in patterns:
        groups = groups[j].layers.groups
    group = in_natural_order(groups[last])
    tree = group.layers if branch.stacked else group
    for level in range(1, len(branch.path) + branch.stacked):
        tree = index(tree, row[level])
    if branch.stacked and group.layer_sharding is not None:
        tree = constrain(tree, group.layer_sharding)
    return tree


def chain_layer_fn(
    chain: Chain,
    call: LayerCall,
    name_inputs: Callable[[PyTree], PyTree],
    carry_static: PyTree,
    hint: str,
) -> Callable[[Int[Array, ""], PyTree], PyTree]:
    """Layer `g` (a traced global index) of `chain` as `fn(g, carry)`: a
    `lax.switch` on the body that holds the layer, which reads its one layer from
    its group's stacked weights. Every body must return a carry like the one it
    receives (else a `TypeError` naming the layer, with `hint`). `name_inputs`
    names what a body reads as the step's inputs."""
    branches, table = _chain_table(chain)
    rows = jnp.asarray(table)

    def body(branch: _Branch, row: Array, one: OneLayer) -> Callable[[PyTree], PyTree]:
        # Only the carry's arrays pass through the `switch`; the rest (broadcast
        # arguments may be any Python value) is closed over.
        def fn(c_dyn: PyTree) -> PyTree:
            layer = name_inputs(_branch_layer(chain, branch, row))
            old = eqx.combine(c_dyn, carry_static)
            where = branch.name
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
        bodies = [body(branch, row, one) for branch in branches]
        new, records = jax.lax.switch(row[0], bodies, eqx.filter(carry, eqx.is_array))
        add(records)
        return eqx.combine(new, carry_static)

    return layer
