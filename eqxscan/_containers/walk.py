"""One walk over a model, which sharding, the optimiser helpers, Orbax names and
state dicts all rebuild a model through: every leaf visited with where it sits
(its path and the layer axes in front of its arrays). It walks

- by key path (the default), as `eqx.filter` and `jax.jit`'s shardings see the
  model: a `Stacked`'s `layers` field adds one layer axis; a `Chain` is an
  ordinary pytree (its scanned groups are `Stacked`s);
- or by state-dict name (`names=True`): a `Stacked` or `Chain` is entered
  through its `state_dict_layers`, which puts a `LayerNumbering` where the
  layer number goes; other entries are attribute names, indices and dict keys.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._helpers.checks import is_arraylike
from .._helpers.constrain import is_none
from .chain.chain import Chain
from .stacked import LayerNumbering, Stacked


class Site(NamedTuple):
    """Where a node sits in the model being walked.

    - `path`: the key path from the root (by state-dict name: the name parts,
      strings and `LayerNumbering`es).
    - `axes`: the sizes of the layer axes in front of the node's arrays,
      outermost first: one per enclosing `Stacked` (by name, a `Chain`'s
      repeated pattern adds its repeat axis too).
    - `enclosing`: for each enclosing `Stacked` (by name, `Chain`), the position
      in `path` of the entry standing for its layers (`.layers`, or the layer
      index) and its number of layers.
    """

    path: tuple = ()
    axes: tuple[int, ...] = ()
    enclosing: tuple[tuple[int, int], ...] = ()

    @property
    def depth(self) -> int:
        """The number of layer axes in front of the node's own axes."""
        return len(self.axes)

    def enter(self, entry: object, axes: tuple[int, ...], num_layers: int) -> "Site":
        return Site(
            self.path + (entry,),
            self.axes + axes,
            self.enclosing + ((len(self.path), num_layers),),
        )


ROOT = Site()  # where the root of a walk sits: no path, no layer axes


def check_axes(who: str, leaf: Any, site: Site) -> None:
    """Refuse an array whose leading axes are not the layers of the stacks
    around it (an `eqx.filter_vmap` ensemble of stacks passed whole)."""
    if tuple(leaf.shape[: site.depth]) != site.axes:
        named = all(isinstance(p, (str, LayerNumbering)) for p in site.path)
        where = pattern(site.path) if named else jtu.keystr(site.path)
        raise ValueError(
            f"{who}: `{where}` has shape {tuple(leaf.shape)}, but it "
            f"sits inside Stacked layers of depth {site.axes}, so its leading "
            f"axes must be {site.axes}.\nHint: for an ensemble of stacks "
            f"(`eqx.filter_vmap`), call {who} inside the vmap, per member."
        )


def key_name(entry: Any, where: tuple) -> str:
    """The name of one key-path entry in a state dict; `where` is the name so
    far. (`Any`: JAX types its key classes so.)"""
    if isinstance(entry, jtu.GetAttrKey):
        return entry.name
    if isinstance(entry, jtu.SequenceKey):
        return str(entry.idx)
    is_key = isinstance(entry, (jtu.DictKey, jtu.FlattenedIndexKey))
    name = str(entry.key if is_key else entry)
    if "." in name or name == "":
        raise ValueError(
            f"Cannot name the entry {entry} under `{pattern(where) or '<root>'}` "
            "in a state dict: names are joined with '.', so dict keys must be "
            "non-empty and contain no '.'."
        )
    return name


def pattern(parts: tuple) -> str:
    """Name parts joined with '.', each layer index shown as `*`."""
    return ".".join("*" if isinstance(p, LayerNumbering) else p for p in parts)


def resolve(parts: tuple, index: tuple[int, ...]) -> list:
    """`parts` with each `LayerNumbering` replaced by its layer number at `index`
    of the layer axes, each numbering taking its own axes."""
    it = iter(index)
    return [
        int(p.number([next(it) for _ in p.strides]))
        if isinstance(p, LayerNumbering)
        else p
        for p in parts
    ]


def layer_names(parts: tuple, axes: tuple[int, ...]) -> list[str]:
    """The name of every layer's array, in the order of `np.ndindex(*axes)`."""
    return [".".join(map(str, resolve(parts, i))) for i in np.ndindex(*axes)]


def walk(
    fn: Callable[[object, Site], object],
    tree: PyTree,
    *,
    names: bool = False,
    stack: Callable[[Stacked, Site], Stacked] | None = None,
    site: Site = ROOT,
    is_leaf: Callable[[object], bool] | None = None,
) -> PyTree:
    """`tree` rebuilt with every leaf replaced by `fn(leaf, site)`; each `Stacked`
    and `Chain` keeps its type, static fields and options.

    **Arguments:**

    - `fn`: called at every leaf (`None`, arrays and other non-pytree values),
      in `jax.tree_util.tree_leaves` order.
    - `tree`: any pytree, usually a model.
    - `names`: walk by state-dict name (`Site.path` holds name parts).
    - `stack`: by key path, `stack(stacked, site)` replaces each `Stacked` once
      its layers are rebuilt (inner stacks first), `site` being its `layers`'.
    - `site`: where `tree` itself sits.
    - `is_leaf`: as for `jax.tree_util`: a node it accepts is visited as a leaf
      (e.g. a stand-in for a weight, seen where and as its weight is).
    """
    if is_none(tree) or is_arraylike(tree) or (is_leaf is not None and is_leaf(tree)):
        return fn(tree, site)
    deeper = functools.partial(walk, fn, names=names, stack=stack, is_leaf=is_leaf)
    if names and isinstance(tree, (Stacked, Chain)):
        num_layers = tree.num_layers
        return tree.state_dict_layers(
            lambda subtree, index, axes: deeper(
                subtree, site=site.enter(index, axes, num_layers)
            )
        )
    # A stack's layers gain a layer axis; its other fields (the drop rates) are
    # visited where the stack itself sits, so every leaf is seen once.
    at = site
    if stacked := not names and isinstance(tree, Stacked):
        at = site.enter(jtu.GetAttrKey("layers"), (tree.num_layers,), tree.num_layers)
    children, treedef = jtu.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is not tree
    )
    if not children:  # an empty node, e.g. `()` or a module of static fields
        return tree
    if jtu.treedef_is_leaf(treedef):  # a leaf that is not an array, e.g. a float
        return fn(tree, site)
    rebuilt = []
    for path, child in children:
        if stacked and path == (jtu.GetAttrKey("layers"),):
            child_site = at
        else:
            entries = (key_name(e, site.path) for e in path) if names else path
            child_site = site._replace(path=site.path + tuple(entries))
        rebuilt.append(deeper(child, site=child_site))
    new = jtu.tree_unflatten(treedef, rebuilt)
    return new if not stacked or stack is None else stack(new, at)


def for_each(
    fn: Callable[[object, Site], None],
    tree: PyTree,
    *,
    names: bool = False,
    is_leaf: Callable[[object], bool] | None = None,
) -> None:
    """Call `fn(leaf, site)` at every leaf of `tree`, as `walk` visits them."""

    def visit(leaf: object, site: Site) -> object:
        fn(leaf, site)
        return leaf

    walk(visit, tree, names=names, is_leaf=is_leaf)
