"""`layer_buffers`: every layer's buffer, of its own size, laid out for a call
with [`eqxscan.buffer`][]."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._containers.chain import Chain
from .._containers.chain.groups import Placement, places
from .._containers.stacked import Stacked
from .._helpers.checks import describe, first_difference
from .._scan.buffers import LayerBuffers
from .._scan.eager_compile import compiled_when_eager


MakeBuffer = Callable[[int, Any], PyTree]
"""`make(i, layer)`: layer `i`'s buffer (a pytree of arrays, or `None`)."""


def layer_buffers(model: Stacked | Chain, make: MakeBuffer) -> PyTree:
    """Build every layer's buffer (e.g. its KV cache), each of its own size.

    **Arguments:**

    - `model`: a [`eqxscan.Stacked`][] or a [`eqxscan.Chain`][].
    - `make`: `make(i, layer)` returns layer `i`'s buffer, a pytree of arrays
      (e.g. `jnp.zeros` of its cache shape) or `None`. Layers scanned together
      (a run of like layers, one position in every repeat of a pattern) need
      buffers of one structure, shape and dtype.

    **Returns:**

    For a `Stacked`, the buffers stacked on a leading layer axis; for a `Chain`,
    a [`eqxscan.LayerBuffers`][] laid out as its groups (the sum of the layers'
    own bytes). Pass it as `eqxscan.buffer(...)`. It is built in one compiled
    program, never assembled from copies.
    """
    # Compiled keyed by what `make` reads: a changed global (a maximum length)
    # builds anew rather than return the buffers of the old value.
    if isinstance(model, Stacked):
        return _compiled_run(model, make, 0)
    if isinstance(model, Chain):
        groups = _compiled_groups(model.groups, model.layout, make, 0)
        ndims = tuple(tuple(a.ndim for a in jtu.tree_leaves(g)) for g in groups)
        return LayerBuffers(groups, places(model.groups, model.layout), ndims)
    raise TypeError(
        "eqxscan.layer_buffers takes a Stacked or a Chain, got "
        f"{type(model).__name__}.\nPass the model whose layers the buffers belong to."
    )


def _groups(
    groups: tuple[Any, ...],
    layout: tuple[Placement, ...],
    make: MakeBuffer,
    offset: int,
) -> tuple[PyTree, ...]:
    parts = []
    for group, span in zip(groups, layout):
        start = offset + span.start
        if span.per_step == 0:
            parts.append(_made(make, start, group))
        elif span.per_step == 1:
            parts.append(_run(group, make, start))
        else:
            # A repeated pattern: each repeat's groups, stacked over the repeats.
            starts = range(start, start + span.size, span.per_step)
            units = [group[r] for r in range(len(starts))]  # `Pattern`s
            reps = [_groups(u.groups, u.layout, make, s) for u, s in zip(units, starts)]
            parts.append(_stack(reps, list(starts)))
    return tuple(parts)


def _run(stack: Stacked, make: MakeBuffer, start: int) -> PyTree:
    # A run's buffers, stacked: checked alike, since one scan body reads them.
    made = [_made(make, start + j, stack[j]) for j in range(stack.num_layers)]
    return _stack(made, list(range(start, start + stack.num_layers)))


def _made(make: MakeBuffer, i: int, layer: object) -> PyTree:
    tree = make(i, layer)
    bad = [a for a in jtu.tree_leaves(tree) if not eqx.is_array(a)]
    if bad:
        raise TypeError(
            f"layer_buffers: make({i}, layer) returned a buffer holding "
            f"{describe(bad[0])}.\nReturn a pytree of arrays (or None)."
        )
    return tree


def _stack(trees: list[PyTree], layers: list[int]) -> PyTree:
    # Buffers of layers scanned together, on a new leading axis.
    for tree, i in zip(trees[1:], layers[1:]):
        diff = first_difference(trees[0], tree)
        if diff is not None:
            path, a, b = diff
            raise ValueError(
                f"layer_buffers: layers {layers[0]} and {i} are scanned together, "
                f"but their buffers differ at `buffer{path}`: {a} vs {b}.\nGive "
                "them one shape, or make what sizes it (e.g. a window) a static "
                "field so that the layers are grouped apart."
            )
    return jtu.tree_map(lambda *a: jnp.stack(a), *trees)


_compiled_run = compiled_when_eager(_run, scanning=False, name="layer_buffers")
_compiled_groups = compiled_when_eager(_groups, scanning=False, name="layer_buffers")
