"""`layerwise`: any optax transformation run on each layer of a stack on its own,
under `jax.vmap` over each stack's layer axis, and once more, unbatched, on the
arrays outside every stack."""

import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import PyTree

from .. import Stacked
from .._internal import (
    call_state,
    changed_call_state,
    Checked,
    docs,
    is_placeholder,
)
from ._arrays import is_array, is_stacked


class LayerwiseState(NamedTuple):
    """The state of [`eqxscan.optim.layerwise`][].

    - `rest`: the inner state for the arrays outside every `Stacked`.
    - `stacks`: one inner state per outermost `Stacked`, in `jax.tree_util`
      order (a `LayerwiseState` again where the layers hold stacks), layer `i`'s
      in row `i`. Per-parameter buffers (Adam's `mu`, `nu`, ...) are laid out
      like the whole parameter tree, `None` outside their stack, as optax's own
      are (e.g. for [`eqxscan.sharding.opt_state_shardings`][]). A PRNG key
      (`optax.add_noise`'s) has the layer's index folded in: layer `i`'s is
      `jax.random.fold_in(key, i)`.
    """

    rest: PyTree
    stacks: tuple[PyTree, ...]


def one_layer() -> str | None:
    """Where `layerwise` is running its transformation on one layer at a time
    (the stack's path), or `None`."""
    return call_state().layerwise


def outer_stacks(tree: PyTree) -> list[tuple[str, Stacked]]:
    """The outermost `Stacked`s of `tree` with their key paths, in leaf order."""
    found = jtu.tree_flatten_with_path(tree, is_leaf=is_stacked)[0]
    return [(jtu.keystr(path), node) for path, node in found if is_stacked(node)]


def _outside(tree: PyTree) -> PyTree:
    """`tree` with every array inside a `Stacked` replaced by `None`."""
    clear = lambda x: jtu.tree_map(lambda _: None, x) if is_stacked(x) else x
    return jtu.tree_map(clear, tree, is_leaf=is_stacked)


def _with_layers(tree: PyTree, new: dict[int, PyTree]) -> PyTree:
    """`tree` with the layers of its `j`-th outermost `Stacked` set to `new[j]`."""
    nodes, treedef = jtu.tree_flatten(tree, is_leaf=is_stacked)
    at = [i for i, node in enumerate(nodes) if is_stacked(node)]
    for j, layers in new.items():
        nodes[at[j]] = eqx.tree_at(
            lambda s: s.layers, nodes[at[j]], layers, is_leaf=is_placeholder
        )
    return jtu.tree_unflatten(treedef, nodes)


def _has_arrays(tree: PyTree) -> bool:
    return any(eqx.is_array(x) for x in jtu.tree_leaves(tree))


def _check_layers(where: str, stack: Stacked) -> None:
    """Each array of `stack.layers` has the layer axis in front."""
    for path, leaf in jtu.tree_leaves_with_path(stack.layers):
        if not eqx.is_array(leaf):
            raise TypeError(
                f"layerwise: `{where}.layers{jtu.keystr(path)}` is a "
                f"{type(leaf).__name__}, not an array.\nHint: pass the parameters "
                "as optax sees them, e.g. `eqx.filter(model, eqx.is_inexact_array)`."
            )
        if leaf.ndim == 0 or leaf.shape[0] != stack.num_layers:
            raise ValueError(
                f"layerwise: `{where}.layers{jtu.keystr(path)}` has shape "
                f"{tuple(leaf.shape)}, but the Stacked at `{where or '<root>'}` has "
                f"{stack.num_layers} layers, so its leading axis must be "
                f"{stack.num_layers}.\nHint: inside `eqx.filter_vmap` (e.g. an "
                "ensemble of stacks) call the optimiser inside the vmap too."
            )


def _embed(state: PyTree, tree: PyTree, j: int, layers: PyTree) -> PyTree:
    """`state` (of stack `j`'s layers) with each per-parameter buffer (a subtree
    like `layers`) put in place of those layers in an empty copy of `tree`: the
    layout of optax's own buffers."""
    target = jtu.tree_structure(layers, is_leaf=is_placeholder)
    if jtu.treedef_is_leaf(target):  # a bare array cannot be told from a count
        return state
    kind = type(layers)
    blank = jtu.tree_map(lambda _: None, tree)

    def is_buffer(x: object) -> bool:
        return (
            type(x) is kind and jtu.tree_structure(x, is_leaf=is_placeholder) == target
        )

    embed = lambda x: _with_layers(blank, {j: x}) if is_buffer(x) else x
    return jtu.tree_map(embed, state, is_leaf=is_buffer)


def _own_keys(state: PyTree) -> PyTree:
    """`state` (one row per layer) with the row's index folded into each PRNG
    key (`optax.add_noise`'s): `vmap` gave every layer's `init` the same key,
    so every layer would draw the same noise."""

    def fold(leaf: object) -> object:
        if not (is_array(leaf) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)):
            return leaf
        rows = leaf.reshape(leaf.shape[0], -1)
        fold_row = jax.vmap(jax.random.fold_in, in_axes=(0, None))
        return jax.vmap(fold_row)(rows, jnp.arange(leaf.shape[0])).reshape(leaf.shape)

    return jtu.tree_map(fold, state)


def _init_layer(tx: optax.GradientTransformationExtraArgs, params: PyTree) -> PyTree:
    # One layer: `tx`'s own state, or a `LayerwiseState` if it holds stacks.
    return _init(tx, params) if outer_stacks(params) else tx.init(params)


def _init(tx: optax.GradientTransformationExtraArgs, params: PyTree) -> LayerwiseState:
    states = []
    for j, (where, stack) in enumerate(outer_stacks(params)):
        if not _has_arrays(stack.layers):
            states.append(optax.EmptyState())
            continue
        _check_layers(where, stack)
        try:
            state = _own_keys(jax.vmap(lambda p: _init_layer(tx, p))(stack.layers))
        except (TypeError, ValueError) as e:
            if str(e).startswith("layerwise"):
                raise
            # Typically a mask or labels given as a tree of the whole model.
            first = next(iter(str(e).strip().splitlines()), type(e).__name__)
            raise (ValueError if isinstance(e, ValueError) else TypeError)(
                f"layerwise: the transformation failed on one layer of the "
                f"Stacked at `{where or '<root>'}` (a "
                f"{type(stack.layers).__name__}): {first}\nHint: inside "
                "layerwise, masks and labels are given one layer's parameters: "
                "pass them as functions (`mask=lambda p: ...`), or put "
                "optax.masked / optax.multi_transform outside layerwise; see "
                f"{docs('optimisers.md')}."
            ) from e
        states.append(_embed(state, params, j, stack.layers))
    return LayerwiseState(tx.init(_outside(params)), tuple(states))


def _update(
    tx: optax.GradientTransformationExtraArgs,
    updates: PyTree,
    state: object,
    params: PyTree | None = None,
    **extra_args: object,
) -> tuple[PyTree, LayerwiseState]:
    stacks = outer_stacks(updates)
    param_stacks = [None] * len(stacks) if params is None else outer_stacks(params)
    if not isinstance(state, LayerwiseState) or len(state.stacks) != len(stacks):
        found = (
            f"a state for {len(state.stacks)} stacks"
            if isinstance(state, LayerwiseState)
            else f"a {type(state).__name__}, not a LayerwiseState"
        )
        raise ValueError(
            f"layerwise: the updates hold {len(stacks)} Stacked modules (outside "
            f"any other), but the optimiser state is {found}.\nHint: initialise "
            "the optimiser with parameters of the same structure as the updates."
        )
    for (where, stack), stored in zip(stacks, state.stacks):
        # A state for another depth, or a per-layer value replaced by a scalar
        # (`optax.tree_utils.tree_set` of a hyperparameter): named before
        # optax's tree error or `vmap`'s rank error.
        wrong = [
            (jtu.keystr(path), np.shape(a)[:1])
            for path, a in jtu.tree_leaves_with_path(stored)
            if (is_array(a) or isinstance(a, (int, float, complex)))
            and np.shape(a)[:1] != (stack.num_layers,)
        ]
        if wrong:
            path, rows = wrong[0]
            has = f"{rows[0]} rows" if rows else "no layer axis (a scalar)"
            raise ValueError(
                f"layerwise: the Stacked at `{where or '<root>'}` has "
                f"{stack.num_layers} layers, but its optimiser state's leaf "
                f"`{path}` has {has}.\nHint: initialise the optimiser with "
                "parameters of the same structure as the updates (or slice every "
                "leaf of its state as the model was); a hyperparameter is set "
                f"per layer, {stack.num_layers} values ("
                f"{docs('optimisers_layerwise.md')})."
            )
    outside = None if params is None else _outside(params)
    rest, rest_state = tx.update(_outside(updates), state.rest, outside, **extra_args)
    new_layers, new_states = {}, []
    for j, ((where, stack), pair, stored) in enumerate(
        zip(stacks, param_stacks, state.stacks)
    ):
        if not _has_arrays(stack.layers):
            new_states.append(stored)
            continue
        _check_layers(where, stack)
        layer_params = None if pair is None else pair[1].layers
        like = stack.layers if layer_params is None else layer_params
        shapes = jax.eval_shape(jax.vmap(lambda p: _init_layer(tx, p)), like)
        treedef = jtu.tree_structure(shapes)
        leaves = jtu.tree_leaves(stored)
        if treedef.num_leaves != len(leaves):
            raise ValueError(
                f"layerwise: the optimiser state of the Stacked at `{where}` holds "
                f"{len(leaves)} arrays, but its layers need {treedef.num_leaves}."
                "\nHint: initialise the optimiser with parameters of the same "
                "structure as the updates."
            )

        def one(u: PyTree, s: PyTree, p: PyTree) -> tuple[PyTree, PyTree]:
            if outer_stacks(u):
                return _update(tx, u, s, p, **extra_args)
            return tx.update(u, s, p, **extra_args)

        layer_state = jtu.tree_unflatten(treedef, leaves)
        with changed_call_state(layerwise=where or "<root>"):
            out, layer_state = jax.vmap(one)(stack.layers, layer_state, layer_params)
        new_layers[j] = out
        new_states.append(_embed(layer_state, updates, j, stack.layers))
    return _with_layers(rest, new_layers), LayerwiseState(rest_state, tuple(new_states))


def layerwise(
    tx: Checked[optax.GradientTransformation],
) -> optax.GradientTransformationExtraArgs:
    """Run `tx` on each layer of every [`eqxscan.Stacked`][] on its own, as on the
    unstacked model.

    On a stacked `[L, D, 4D]` array, transformations that look at a whole array
    mean something else: `optax.contrib.muon` sends every array with `ndim != 2`
    to Adam, LAMB and LARS take one trust ratio for all layers,
    `clip_by_block_rms` clips the stack as one block, Adafactor factors the
    wrong axes, masks that read `ndim` select the stacked biases. `layerwise(tx)`
    runs `tx` under `jax.vmap` over each stack's layer axis (nested stacks, e.g.
    an [`eqxscan.Chain`][]'s repeated pattern, once per axis) and once on the
    arrays outside every stack: it then trains as `tx` on the layers in a list.

    A reduction inside `tx` is per layer (a global-norm clip inside clips each
    layer, and `optax.apply_if_finite` inside skips only the layers whose
    updates are not finite); keep global ones outside:
    `optax.chain(optax.clip_by_global_norm(1.0), layerwise(optax.adamw(1e-3)))`.
    Masks given as functions (`optax.masked(..., weight_decay_mask)`, `adamw`'s
    `mask=`) get one layer's parameters inside, the whole tree outside;
    [`eqxscan.optim.freeze_layers`][] selects layers of a stack, so it goes
    outside: `freeze_layers(layerwise(tx), ...)`.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, optax, eqxscan

        stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(8, 8, key=k), 4, key=jax.random.key(0)
        )
        # Each layer's weight clipped to RMS 0.1 on its own, not the stack's.
        optimiser = eqxscan.optim.layerwise(optax.clip_by_block_rms(0.1))
        params = eqx.filter(stack, eqx.is_inexact_array)
        state = optimiser.init(params)
        grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(8)) ** 2))(stack)
        updates, state = optimiser.update(grads, state, params)
        rms = jnp.sqrt(jnp.mean(updates.layers.weight**2, axis=(1, 2)))
        assert rms.shape == (4,) and (rms <= 0.1 + 1e-6).all()
        ```

    **Arguments:**

    - `tx`: any optax transformation, e.g. `optax.adamw(1e-3)`; extra arguments
      of `update` (e.g. `value=`) reach it unchanged.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is a
    [`eqxscan.optim.LayerwiseState`][].
    """
    if isinstance(tx, optax.MultiSteps):
        raise TypeError(
            "layerwise takes an optax.GradientTransformation, got MultiSteps, "
            "which accumulates whole steps.\nHint: put it outside: "
            "`optax.MultiSteps(layerwise(tx), every_k_schedule=k)`."
        )
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            "layerwise takes an optax.GradientTransformation, got "
            f"{type(tx).__name__}.\nHint: pass e.g. `optax.adamw(1e-3)`, not a "
            "function that builds one."
        )
    inner = optax.with_extra_args_support(tx)
    return optax.GradientTransformationExtraArgs(
        functools.partial(_init, inner), functools.partial(_update, inner)
    )
