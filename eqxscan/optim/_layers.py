"""A weight-decay mask that counts the layer axes away, and freezing of layers
chosen by index: stacking adds a leading axis to every array, which rules that
read `ndim` and freezing by leaf (`eqx.partition`) do not see."""

from collections.abc import Callable, Sequence
from typing import SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jax.core import Tracer
from jaxtyping import PyTree

from .. import Chain, Stacked
from .._internal import check_axes, check_index, docs, layers_in_stage_order, Site, walk
from ._arrays import is_array, is_stacked
from ._layerwise import one_layer, outer_stacks


def weight_decay_mask(params: PyTree, *, min_ndim: int = 2) -> PyTree[bool]:
    """Which arrays to decay: those with at least `min_ndim` axes per layer.

    The usual rule `lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)` also
    decays the biases and norm scales of a [`eqxscan.Stacked`][] (`[L, D]`).
    This mask counts each enclosing layer axis away (nested `Stacked`s, e.g. an
    [`eqxscan.Chain`][]'s repeated patterns, once each): a stacked model is
    decayed exactly like the same layers kept in a list.

    **Arguments:**

    - `params`: the parameters (or updates) as `optax` sees them, e.g.
      `eqx.filter(model, eqx.is_inexact_array)`.
    - `min_ndim`: the number of per-layer axes from which an array is decayed.

    **Returns:**

    A pytree like `params`, `True` for each array to decay and `False` for
    every other leaf, for `optax.adamw(mask=...)` and `optax.masked` (pass the
    function itself as `mask`: it is called with the parameters).
    """

    def decay(leaf: object, site: Site) -> bool | None:
        if leaf is None:
            return None  # no parameter here: no mask entry either
        if is_array(leaf):
            check_axes("weight_decay_mask", leaf, site)
        return bool(is_array(leaf) and leaf.ndim - site.depth >= min_ndim)

    return walk(decay, params)


LayerSelection = (
    SupportsIndex | slice | Sequence[SupportsIndex] | np.ndarray | jax.Array
)


def _zero_layers(
    stack: Stacked, layers: LayerSelection, zero: float, outer: int
) -> Stacked:
    """`stack` with every array leaf set to `zero` on the layers `layers` selects
    (indices as for a list), its layer axis behind `outer` axes of enclosing
    stacks (a stack inside another's layers)."""
    if not outer:
        stack.check_layer_axis("freeze layers of")  # a batch of stacks: in a vmap
    n = stack.num_layers
    if isinstance(layers, np.ndarray | jax.Array) and not isinstance(layers, Tracer):
        layers = np.asarray(layers).tolist()  # an index array: its ints
    if isinstance(layers, slice):
        chosen = set(range(n)[layers])
    else:
        chosen = set()
        for item in layers if isinstance(layers, Sequence) else [layers]:
            if isinstance(item, bool) or not hasattr(type(item), "__index__"):
                raise TypeError(
                    "Layers to freeze must be given as an int, a slice, a range or "
                    f"a sequence of ints, got {type(item).__name__} ({item!r})."
                )
            hint = "freeze_layers takes concrete layer indices."
            chosen.add(check_index(item, n, "Stacked", hint))
    # Layer numbers, wherever the stack stores them (`pipeline_order`).
    layer_at = layers_in_stage_order(n, stack.stage_order) or range(n)
    frozen = jnp.asarray([i in chosen for i in layer_at])

    def zero_out(a: object) -> object:
        if not is_array(a):
            return a
        where = frozen.reshape((1,) * outer + (n,) + (1,) * (a.ndim - outer - 1))
        return jnp.where(where, jnp.asarray(zero, a.dtype), a)

    # A Stacked's only pytree children are its layers' leaves.
    return jtu.tree_map(zero_out, stack)


def _first(stack: Stacked) -> tuple:
    # A stack by its first leaf (not copied by a walk), which a stack in its
    # layers shares: with its layers' type and number.
    leaves = jtu.tree_leaves(stack)
    return (id(leaves[0]) if leaves else 0, type(stack.layers), stack.num_layers)


def _enclosing(tree: PyTree) -> dict[tuple, int]:
    # Each Stacked's number of enclosing layer axes (a stack in another's
    # layers, in a Chain's repeated pattern).
    found: dict[tuple, int] = {}

    def note(stack: Stacked, site: Site) -> Stacked:
        found[_first(stack)] = site.depth - 1  # `site` is its layers'
        return stack

    walk(lambda leaf, _: leaf, tree, stack=note)
    return found


def _select(tree: PyTree) -> Stacked:
    """The one outermost `Stacked` of `tree`, when no `where` picks them."""
    outer = jtu.tree_leaves(tree, is_leaf=lambda n: isinstance(n, (Stacked, Chain)))
    if any(isinstance(n, Chain) for n in outer):
        raise ValueError(
            "freeze_layers found a Chain in the parameters: its scanned groups "
            "number their layers from the group's start, not as the chain does, "
            "so layer indices would freeze other layers.\nHint: pass "
            "`where=lambda model: model.chain.groups[k]` (a Stacked group, as "
            "`chain.explain()` lists them; indices within the group)."
        )
    found = [stack for _, stack in outer_stacks(tree)]
    if len(found) != 1:
        raise ValueError(
            f"freeze_layers found {len(found)} Stacked modules (not nested in "
            "another) in the parameters, so it cannot tell which one the layer "
            "indices refer to. Pass `where=lambda model: model.blocks` (any "
            "function returning the Stacked, or a tuple of them)."
        )
    return found[0]


def freeze_layers(
    inner: optax.GradientTransformation,
    layers: LayerSelection,
    *,
    where: Callable[[PyTree], PyTree] | None = None,
) -> optax.GradientTransformation:
    """Run `inner` with layers `layers` of a [`eqxscan.Stacked`][] frozen.

    `eqx.partition` cannot select part of a layer axis, and zeroing only the
    gradients still lets AdamW's weight decay move frozen layers. This zeroes
    the frozen layers' gradients before `inner` (a global-norm clip sees only
    the trained layers) and their updates after it (weight decay cannot reach
    them): frozen layers stay bit-identical, the others train as on their own
    where `inner` works element by element. One that reduces over a whole array
    (LAMB's trust ratio) still reads the frozen layers' weights: pass
    `layerwise(inner)`.

    **Arguments:**

    - `inner`: the optimiser, e.g. `optax.adamw(1e-3)`.
    - `layers`: the layers to freeze: an index, a `slice`, a `range`, a
      sequence of indices or a concrete integer array of them (negative ones
      count from the end); layer numbers, also for a stack stored in the stage
      order of `sharding.pipeline_order`.
    - `where`: a function from the parameters to the `Stacked` (or a tuple of
      `Stacked`s, each frozen at the same indices) whose layers are meant, as
      for `eqx.tree_at`, e.g. `lambda model: model.blocks`. Not needed when the
      parameters contain exactly one `Stacked` outside any other, and no
      [`eqxscan.Chain`][] (whose groups do not number layers as the chain does).

    **Returns:**

    An `optax.GradientTransformation` to use in place of `inner`.
    """

    def freeze(tree: PyTree, zero: float) -> PyTree:
        select = _select if where is None else where
        picked = select(tree)
        for stack in picked if isinstance(picked, (tuple, list)) else (picked,):
            if not is_stacked(stack):
                raise TypeError(
                    f"freeze_layers: `where` returned a {type(stack).__name__}, "
                    "not an eqxscan.Stacked (or a tuple of them)."
                )
        outer = _enclosing(tree)
        return eqx.tree_at(
            select,
            tree,
            replace_fn=lambda s: _zero_layers(s, layers, zero, outer.get(_first(s), 0)),
        )

    def update(
        updates: PyTree, state: PyTree, params: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        if (inside := one_layer()) is not None:
            raise ValueError(
                "freeze_layers runs inside eqxscan.optim.layerwise, which gives "
                f"it one layer of the Stacked at `{inside}` at a time: it has no "
                "layers to pick.\nHint: wrap it around, "
                f"`freeze_layers(layerwise(tx), ...)`; see {docs('optimisers.md')}."
            )
        updates, state = inner.update(freeze(updates, 0.0), state, params)
        # `p + (-0.0)` is `p` bit for bit, signed zeros included (`+0.0` is not).
        return freeze(updates, -0.0), state

    return optax.GradientTransformation(inner.init, update)
