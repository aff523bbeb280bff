"""Which leaves of an optimizer state are per-parameter buffers (Adam's `mu`),
and of which model in the parameters: they have its type and structure, every
stack's `layer_sharding` aside."""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu
from jax.sharding import Sharding
from jaxtyping import PyTree

from .. import Stacked
from .._internal import is_placeholder, restack, Site, walk


T = TypeVar("T")
LayerShardingFn = Callable[[Site, PyTree], Sharding | PyTree[Sharding | None] | None]


def set_layer_sharding(tree: T, layer_sharding: LayerShardingFn) -> T:
    # `tree` with each Stacked's `layer_sharding` set to `layer_sharding(site of
    # its layers, its layers)`, inner stacks first: an outer stack's per-array
    # sharding pytree holds the inner stacks' (static) fields.
    def set_one(stack: Stacked, site: Site) -> Stacked:
        return restack(stack, layer_sharding=layer_sharding(site, stack.layers))

    return walk(lambda leaf, site: leaf, tree, stack=set_one)


leaves = functools.partial(jtu.tree_leaves, is_leaf=is_placeholder)


def roots(params: PyTree, key: tuple = ()) -> list[tuple[tuple, PyTree]]:
    # `params`, and each Module in plain containers of several (a dict of the
    # model and an RNG key, saved together): an optimizer made for one of them
    # has buffers of that one's structure. Each with its keys in `params`.
    found = [(key, params)] if not key or isinstance(params, eqx.Module) else []
    if isinstance(params, dict | list | tuple) and type(params) in (dict, list, tuple):
        items = params.items() if isinstance(params, dict) else enumerate(params)
        found += [r for k, v in items for r in roots(v, (*key, k))]
    return found


def at(tree: PyTree, key: tuple) -> PyTree:
    return at(tree[key[0]], key[1:]) if key else tree


def map_buffers(
    buffer: Callable[[tuple, Any, tuple], Any],
    other: Callable[[Any], Any],
    opt_state: Any,
    params: PyTree,
) -> Any:
    # `buffer(path, x, root)` on each per-parameter buffer `x` of `opt_state`
    # (e.g. Adam's `mu`), `other` on every other leaf. A buffer has the type and
    # structure of `params` (or of the root of `roots` at key `root`), every
    # `layer_sharding` unset so that a model and its sharded copy compare equal.
    def structure(tree: Any) -> Any:
        unset = set_layer_sharding(tree, lambda site, layers: None)
        return jtu.tree_structure(unset, is_leaf=is_placeholder)

    targets = [(key, type(r), structure(r)) for key, r in roots(params)]
    found: dict[int, tuple | None] = {}  # by id: asked as a leaf, then mapped

    def root(x: Any) -> tuple | None:
        if id(x) not in found:
            match = (
                k for k, kind, t in targets if kind is type(x) and t == structure(x)
            )
            found[id(x)] = next(match, None)
        return found[id(x)]

    return jtu.tree_map_with_path(
        lambda path, x: other(x) if (r := root(x)) is None else buffer(path, x, r),
        opt_state,
        is_leaf=lambda x: is_placeholder(x) or root(x) is not None,
    )
