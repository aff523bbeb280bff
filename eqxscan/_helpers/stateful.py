"""Stateful layers (`eqx.nn.State`) in a stack, `y, state = model(x, state)`:
layer `i` gets its slice of the state (as a `per_layer` argument), and the
states the scan outputs are written back into the whole state."""

from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from .checks import describe, docs, misaligned


T = TypeVar("T")


def find_arg(
    args: tuple, kwargs: dict[str, Any], kind: type, too_many: str
) -> int | str | None:
    """The position or name of a call's one argument of type `kind`, if any
    (`too_many`, formatted with the count, if several)."""
    found: list[int | str] = [i for i, a in enumerate(args) if isinstance(a, kind)]
    found += [n for n, v in kwargs.items() if isinstance(v, kind)]
    if len(found) > 1:
        raise TypeError(too_many.format(len(found)))
    return found[0] if found else None


def find_state(args: tuple, kwargs: dict[str, Any]) -> int | str | None:
    return find_arg(
        args,
        kwargs,
        eqx.nn.State,
        "A stack was called with {} eqx.nn.State arguments; pass one State "
        "holding the state of the whole model.",
    )


def replace_arg(
    args: tuple, kwargs: dict[str, Any], where: int | str, value: object
) -> tuple[tuple, dict[str, Any]]:
    if isinstance(where, int):
        return args[:where] + (value,) + args[where + 1 :], kwargs
    return args, {**kwargs, where: value}


def get_arg(args: tuple, kwargs: dict[str, Any], where: int | str) -> Any:
    return args[where] if isinstance(where, int) else kwargs[where]


def layer_state(
    state: eqx.nn.State, layers: PyTree, length: int, what: str
) -> eqx.nn.State:
    """The part of `state` that belongs to the stacked `layers`, checked."""
    sub = state.substate(layers)
    values, markers = sub.tree_flatten()
    for marker, value in zip(markers, values):
        name = marker if isinstance(marker, str) else "an eqx.nn.StateIndex"
        if (bad := misaligned(value, length)) is not None:
            raise ValueError(
                f"{what} has {length} layers, but its state entry `{name}{bad[0]}` "
                f"is {describe(bad[1])}: the layer axis of length {length} must "
                "come first.\nHint: make the model and its state together with "
                "`eqx.nn.make_with_state`; a slice of a stack, or one of its layers, "
                f"takes the matching slice of its state (see {docs('idioms.md')})."
            )
    return sub


def state_pair(out: object, who: str) -> tuple[PyTree, eqx.nn.State]:
    """A stateful layer's output `(x, state)` read as the scan's `(carry, y)`."""
    if not (
        isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State)
    ):
        raise TypeError(
            f"A stack called with an eqx.nn.State expects each layer to return "
            f"(x, state), as Equinox's stateful layers do, but {who} returned "
            f"{describe(out)}."
        )
    return out[0], out[1]


def clone(tree: T) -> T:
    """`tree`'s structure copied, its leaves shared (`State.set` invalidates a
    state)."""
    leaves, treedef = jtu.tree_flatten(tree)
    return jtu.tree_unflatten(treedef, leaves)
