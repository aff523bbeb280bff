"""How `CheckpointManager` names a tree's arrays for Orbax (`blocks.*.w1`),
records what Orbax does not keep (stage orders, weak types), and fills a model
with what it restored."""

from collections.abc import Iterable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .. import Stacked
from .._internal import (
    docs,
    for_each,
    host_only,
    is_arraylike,
    is_key,
    key_data,
    key_name,
    keys_like,
    placed_like,
    Site,
    walk,
    weak_like,
)
from ._files import flatten, listed


_M = TypeVar("_M")
_LAYER = "*"


def named_leaves(tree: PyTree) -> list[tuple[tuple[str, ...], Any]]:
    # `(name parts, leaf)` of each array leaf; a layer axis is the part `*`.
    out = []

    def name(leaf: object, site: Site) -> None:
        if is_arraylike(leaf):  # other leaves (floats, None) are not saved
            out.append((_parts(site), leaf))

    for_each(name, tree)
    return out


def _parts(site: Site) -> tuple[str, ...]:
    # Named as in a state dict: a dotted key ('a.b' beside 'a': {'b'}) would
    # restore two arrays from one entry.
    layer_entries = {at for at, _ in site.enclosing}
    parts: tuple[str, ...] = ()
    for i, entry in enumerate(site.path):
        parts += (_LAYER if i in layer_entries else key_name(entry, parts),)
    return parts


def stage_orders(tree: PyTree) -> dict[str, list[int]]:
    # The entry (`blocks.*`) of each stack stored in stage order, and that order:
    # its arrays are saved as stored, so a checkpoint records it.
    orders: dict[str, list[int]] = {}

    def note(stack: Stacked, site: Site) -> Stacked:
        if stack.stage_order is not None:
            orders[".".join(_parts(site))] = list(stack.stage_order)
        return stack

    walk(lambda leaf, _: leaf, tree, stack=note)
    return orders


def _order_name(order: list[int] | None) -> str:
    if order is None:
        return "the natural order"
    return "the stage order of pipeline_order(stack, stages={}, repeats={})".format(
        *order
    )


def check_orders(where: str, saved: dict[str, Any], trees: dict[str, Any]) -> None:
    # Rows of an entry are layers in the order they were saved in: refuse to
    # restore them into a stack stored in another order.
    wrong = [
        f"{item} '{k}' is saved in {_order_name(had.get(k))}, but the {item} to "
        f"restore holds it in {_order_name(want.get(k))}"
        for item, tree in trees.items()
        for had, want in [(saved.get(item, {}), stage_orders(tree))]
        for k in sorted(set(had) | set(want))
        if had.get(k) != want.get(k)
    ]
    if wrong:
        raise ValueError(
            f"{where} holds layers in another order than the model to restore: "
            f"{listed(wrong)}.\nHint: restore into a model (and optimizer "
            "state) in the saved order, made with sharding.pipeline_order (or "
            f"inverse=True), then permute it as needed; see {docs('sharding.md')}."
        )


def _nest(named: Iterable[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    # Nested dicts: Orbax names each entry by its path, e.g. `model.blocks.*.w1`.
    root: dict[str, Any] = {}
    for parts, leaf in named:
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = leaf
    return root


def restore_target(tree: PyTree, shardings: PyTree) -> dict[str, Any]:
    # What Orbax restores `tree` as: each array's shape, dtype and sharding; a
    # NumPy scalar (a count), or an int64 array without x64, as NumPy (as a JAX
    # array an int64 became int32, wrapped).
    spec = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    leaves = zip(named_leaves(tree), jtu.tree_leaves(shardings), strict=True)
    return _nest(
        (p, np.asarray(x) if host_only(x) else spec(x, s))
        for (p, leaf), s in leaves
        for x in [jax.eval_shape(key_data, leaf) if is_key(leaf) else leaf]
    )


def as_stored(named: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    # What Orbax saves: typed PRNG keys as their data (Orbax restores no keys).
    return _nest((p, key_data(x) if is_key(x) else x) for p, x in named)


def weak_names(tree: PyTree) -> list[str]:
    # The names of `tree`'s weakly typed arrays, recorded in the step's JSON.
    return [".".join(p) for p, x in named_leaves(tree) if getattr(x, "weak_type", 0)]


def filled(like: _M, values: dict[str, Any], weak: list[str] | None) -> _M:
    # `like` with its array leaves replaced, in order, by the restored ones,
    # weakly typed as saved (`weak`; `None`, a step of an earlier version: as
    # in `like`).
    flat = flatten(values)
    saved = None if weak is None else set(weak)
    arrays, rest = eqx.partition(like, is_arraylike)
    # Orbax restores every array strongly typed.
    leaves = [
        keys_like(x, value)
        if is_key(x)
        else placed_like(x, value)  # NumPy, as `like`'s
        if host_only(x)
        else weak_like(x, value, None if saved is None else name in saved)
        for parts, x in named_leaves(like)
        for name in [".".join(parts)]
        for value in [flat[name]]
    ]
    return eqx.combine(jtu.tree_unflatten(jtu.tree_structure(arrays), leaves), rest)
