"""Optimiser helpers that know about the layer axis of [`eqxscan.Stacked`][].

Stacking adds a leading axis to every array of a layer, so the usual rules of
thumb that read `ndim` (decay matrices, not biases or norm scales) and the usual
ways of freezing part of a model (`eqx.partition`, masks per leaf) no longer see
layers. These helpers count the layer axes away and select layers by index.
"""

from collections.abc import Callable, Sequence
from typing import SupportsIndex

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from .._internal import check_index, Site, Stacked, walk
from ._arrays import is_array


def _is_stacked(x: object) -> bool:
    return isinstance(x, Stacked)


def weight_decay_mask(params: PyTree, *, min_ndim: int = 2) -> PyTree[bool]:
    """Which arrays to decay: those with at least `min_ndim` axes per layer.

    The common rule "decay weight matrices, not biases or norm scales" is
    usually written `lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)`. Inside a
    [`eqxscan.Stacked`][] every array has an extra leading layer axis, so that
    rule also decays the stacked biases and norm scales (shape `[L, D]`). This
    mask counts each enclosing layer axis away (nested `Stacked`s, e.g. the
    repeated patterns of an [`eqxscan.Chain`][], count once each), so a stacked
    model is decayed exactly like the same layers kept in a list.

    !!! example

        ```python
        import equinox as eqx, jax, optax, eqxscan

        stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(8, 8, key=k), 4, key=jax.random.key(0)
        )
        mask = eqxscan.optim.weight_decay_mask(stack)
        assert mask.layers.weight and not mask.layers.bias
        optimiser = optax.adamw(1e-3, mask=eqxscan.optim.weight_decay_mask)
        ```

    **Arguments:**

    - `params`: the parameters (or updates) as `optax` sees them, e.g.
      `eqx.filter(model, eqx.is_inexact_array)`.
    - `min_ndim`: the number of per-layer axes from which an array is decayed.

    **Returns:**

    A pytree like `params` with `True` for each array to decay and `False` for
    every other leaf: what `optax.adamw(mask=...)` and `optax.masked` take.
    Pass the function itself as `mask` (it is called with the parameters).
    """

    def decay(leaf: object, site: Site) -> bool | None:
        if leaf is None:
            return None  # no parameter here: no mask entry either
        return bool(is_array(leaf) and leaf.ndim - site.depth >= min_ndim)

    return walk(decay, params)


LayerSelection = SupportsIndex | slice | Sequence[SupportsIndex]


def _layer_flags(layers: LayerSelection, num_layers: int) -> tuple[bool, ...]:
    """One flag per layer: whether `layers` selects it (indices as for a list)."""
    if isinstance(layers, slice):
        chosen = set(range(num_layers)[layers])
    else:
        items = layers if isinstance(layers, Sequence) else [layers]
        chosen = set()
        for item in items:
            if isinstance(item, bool) or not hasattr(type(item), "__index__"):
                raise TypeError(
                    "Layers to freeze must be given as an int, a slice, a range or "
                    f"a sequence of ints, got {type(item).__name__} ({item!r})."
                )
            hint = "freeze_layers takes concrete layer indices."
            chosen.add(check_index(item, num_layers, "Stacked", hint))
    return tuple(i in chosen for i in range(num_layers))


def _zero_layers(stack: Stacked, flags: tuple[bool, ...], zero: float) -> Stacked:
    """`stack` with every array leaf set to `zero` on the flagged layers."""
    frozen = jnp.asarray(flags)

    def zero_out(a: object) -> object:
        if not is_array(a):
            return a
        where = frozen.reshape((len(flags),) + (1,) * (a.ndim - 1))
        return jnp.where(where, jnp.asarray(zero, a.dtype), a)

    # A Stacked's only pytree children are its layers' leaves.
    return jtu.tree_map(zero_out, stack)


def _stacks(tree: PyTree) -> list[Stacked]:
    return [n for n in jtu.tree_leaves(tree, is_leaf=_is_stacked) if _is_stacked(n)]


def _select(
    tree: PyTree, where: Callable[[PyTree], PyTree] | None
) -> Callable[[PyTree], PyTree]:
    """A `where` for `eqx.tree_at` that picks the `Stacked`(s) to freeze."""
    if where is not None:
        return where
    found = _stacks(tree)
    if len(found) != 1:
        raise ValueError(
            f"freeze_layers found {len(found)} Stacked modules (not nested in "
            "another) in the parameters, so it cannot tell which one the layer "
            "indices refer to. Pass `where=lambda model: model.blocks` (any "
            "function returning the Stacked, or a tuple of them)."
        )
    return lambda tree: _stacks(tree)[0]


def freeze_layers(
    inner: optax.GradientTransformation,
    layers: LayerSelection,
    *,
    where: Callable[[PyTree], PyTree] | None = None,
) -> optax.GradientTransformation:
    """Run `inner` with layers `layers` of a [`eqxscan.Stacked`][] frozen.

    `eqx.partition` cannot select part of a layer axis, and zeroing only the
    gradients of frozen layers still moves them through AdamW's weight decay.
    This wrapper zeroes the frozen layers' gradients before `inner` (so, e.g., a
    global-norm clip sees only the trained layers) and their updates after it
    (so weight decay cannot reach them): frozen layers stay bit-identical after
    any number of steps, and the other layers train exactly as they would on
    their own.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, optax, eqxscan

        stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(8, 8, key=k), 4, key=jax.random.key(0)
        )
        # Layers 0 and 1 frozen; weight decay cannot reach them either.
        sgdw = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(1e-2))
        optimiser = eqxscan.optim.freeze_layers(sgdw, range(0, 2))
        params = eqx.filter(stack, eqx.is_inexact_array)
        state = optimiser.init(params)
        grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(8)) ** 2))(stack)
        updates, state = optimiser.update(grads, state, params)
        new = eqx.apply_updates(stack, updates)
        assert (new.layers.weight[:2] == stack.layers.weight[:2]).all()
        assert not (new.layers.weight[2:] == stack.layers.weight[2:]).all()
        ```

    **Arguments:**

    - `inner`: the optimiser, e.g. `optax.adamw(1e-3)`.
    - `layers`: the layers to freeze: an index, a `slice`, a `range` or a
      sequence of indices (negative ones count from the end).
    - `where`: a function from the parameters to the `Stacked` (or a tuple of
      `Stacked`s, each frozen at the same indices) whose layers are meant, as
      for `eqx.tree_at`, e.g. `lambda model: model.blocks`. Not needed when the
      parameters contain exactly one `Stacked` outside any other.

    **Returns:**

    An `optax.GradientTransformation` to use in place of `inner`.
    """

    def freeze(tree: PyTree, zero: float) -> PyTree:
        select = _select(tree, where)
        picked = select(tree)
        for stack in picked if isinstance(picked, (tuple, list)) else (picked,):
            if not _is_stacked(stack):
                raise TypeError(
                    f"freeze_layers: `where` returned a {type(stack).__name__}, "
                    "not an eqxscan.Stacked (or a tuple of them)."
                )
        return eqx.tree_at(
            select,
            tree,
            replace_fn=lambda s: _zero_layers(
                s, _layer_flags(layers, s.num_layers), zero
            ),
        )

    def init(params: PyTree) -> PyTree:
        return inner.init(params)

    def update(
        updates: PyTree, state: PyTree, params: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        updates, state = inner.update(freeze(updates, 0.0), state, params)
        # `p + (-0.0)` is `p` bit for bit, signed zeros included (`+0.0` is not).
        return freeze(updates, -0.0), state

    return optax.GradientTransformation(init, update)
