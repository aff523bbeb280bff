"""How a [`eqxscan.Stacked`][] gets its layers: built by `make_layer` under one
`eqx.filter_vmap`, or stacked from a list, and checked on the way."""

from collections.abc import Callable, Sequence
from typing import TypeVar

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray, PyTree

from .._helpers.checks import (
    check_callable,
    check_made_layer,
    describe,
    is_array,
    split_key,
)
from .._helpers.stackable import check_alike, stack_alike
from .._scan.layer_call import arg_name, check_per_layer


#: The most layers a stack may have: beyond, the per-layer keys alone take
#: gigabytes (and `jax.random.split` aborts the interpreter past 2**62).
MAX_LAYERS = 2**20


LayerT = TypeVar("LayerT")


def stack_layers(layers: Sequence[LayerT], what: str = "Stacked.from_layers") -> LayerT:
    """Stack layers that can share one body leaf by leaf on a new axis 0 (layers
    that differ only by identity share the first one's objects)."""
    layers = list(layers)
    check_alike(layers, what)
    return stack_alike(layers)


def build_layers(
    make_layer: Callable[..., LayerT] | None,
    num_layers: int,
    args: tuple[PyTree, ...],
    key: PRNGKeyArray | None,
) -> LayerT:
    """`make_layer(keys[i], *args_i)` for every layer, in one `eqx.filter_vmap`
    (`per_layer` arguments sliced, others broadcast), after checking that
    `make_layer` makes layers and that a key is given."""
    if isinstance(make_layer, eqx.Module):
        name = type(make_layer).__name__
        raise TypeError(
            f"make_layer must be a function that builds one layer from a key, but "
            f"got a {name} instance (a layer, not a way to make one). Pass e.g. "
            f"`lambda k: {name}(..., key=k)`."
        )
    check_callable("make_layer", make_layer)
    assert make_layer is not None  # checked
    if key is None:
        raise TypeError("Stacked needs `key=` to build its layers.")
    per = check_per_layer(args, {}, num_layers)
    per_dyn, per_static = {}, {}
    for name, value in per.items():
        per_dyn[name], per_static[name] = eqx.partition(value.tree, eqx.is_array)

    def one(k: PRNGKeyArray, slices: dict) -> LayerT:
        call_args = [
            eqx.combine(slices[n], per_static[n]) if n in slices else a
            for n, a in ((arg_name(i), a) for i, a in enumerate(args))
        ]
        return make_layer(k, *call_args)

    keys = split_key(key, num_layers, "Stacked")
    layers = eqx.filter_vmap(one)(keys, per_dyn)
    check_made_layer(layers)
    if is_array(layers):
        one_layer = jax.ShapeDtypeStruct(layers.shape[1:], layers.dtype)
        raise TypeError(
            f"make_layer returned an array ({describe(one_layer)}), not a layer. It "
            "must return a module (e.g. an `eqx.Module`) that is called as "
            "`layer(x)`."
        )
    return layers
