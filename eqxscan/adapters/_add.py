"""`add_lora`: targeted weights replaced by `LoRA`s; `trainable`: their adapters."""

import itertools
import math
import numbers
from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from .. import Target
from .._internal import (
    check_rate,
    check_size,
    Checked,
    pattern,
    replace_weights,
    split_key,
)
from ..quant import Quantized
from ._lora import is_lora, LoRA, lora_sites, loras_in, Orientation


def add_lora(
    model: PyTree,
    targets: Checked[Target | Sequence[Target]],
    *,
    rank: Checked[int],
    alpha: Checked[float | None] = None,
    dropout: Checked[float] = 0.0,
    num_adapters: Checked[int] = 1,
    orientation: Checked[Orientation] = "x@W",
    key: Checked[PRNGKeyArray],
) -> PyTree:
    """`model` with each targeted weight replaced by a [`eqxscan.adapters.LoRA`][].

    Inside an [`eqxscan.Stacked`][] (or an [`eqxscan.Chain`][]'s stacks) a weight is
    adapted in every layer, its base the stacked weight itself, not a copy.
    Initialised as PEFT does: `a` Kaiming-uniform (`U(-1/sqrt(in), 1/sqrt(in))`),
    `b` zero (the adapted model starts equal to the base); adapter 0 is active.

    **Arguments:**

    - `model`: any pytree, usually a model containing `Stacked`s or `Chain`s.
    - `targets`: a name pattern or a module type, or a list of them. A pattern is
      matched (`fnmatch`) against [`eqxscan.to_state_dict`][]'s names with
      every layer index as `*`: `"blocks.*.w1"`, `"*.w2"`. A module type (e.g.
      `eqx.nn.Linear`) adapts the `weight` of each such module, in orientation
      `"W@x"`. A [`eqxscan.quant.Quantized`][] is matched as its float weight
      and becomes the base (QLoRA).
    - `rank`: `r`, at least 1 and at most the smaller side of each weight.
    - `alpha`: a positive number; the adapters are scaled by `alpha / rank`
      (default: `rank`).
    - `dropout`: dropout rate on the adapters' input (PEFT's `lora_dropout`);
      above 0, [`eqxscan.adapters.with_dropout_key`][] gives it its keys.
    - `num_adapters`: `K`, adapters held side by side over one base.
    - `orientation`: how the layers use the weights a pattern matches: `"x@W"`
      (base `[in, out]`) or `"W@x"` (base `[out, in]`).
    - `key`: a JAX PRNG key; each weight, layer and adapter gets its own, from
      the weight's position and layer index (not from how the model runs).

    **Returns:**

    `model` with the targets replaced; nothing else changes. The state-dict
    names of each adapted weight change (in [`eqxscan.to_state_dict`][] and
    the files of [`eqxscan.save`][]): `blocks.3.w1` becomes `blocks.3.w1.base`
    (the frozen weight), `blocks.3.w1.a` and `blocks.3.w1.b` (the adapters,
    `K` in front). `eqxscan.save` also records `alpha`, which loading checks
    (docs/adapters.md).
    """
    split_key(key, 1, "add_lora")  # one PRNG key, or an error naming add_lora
    rank = check_size("add_lora: rank", rank)
    num_adapters = check_size("num_adapters", num_adapters)
    dropout = check_rate(dropout, "dropout")
    alpha = rank if alpha is None else alpha
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"add_lora: alpha must be a number, got {alpha!r}.")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(
            f"add_lora: alpha must be a positive finite number (the adapters are "
            f"scaled by alpha / rank), got {alpha!r}.\nHint: leave it out for "
            "alpha = rank (a scaling of 1)."
        )
    alpha = float(alpha)
    count = itertools.count()
    adapted = [pattern(site.path) for _, site in lora_sites(model)]
    _check_adapted(model, targets, adapted)

    def make(w: object, depth: int, name: str, orientation: Orientation) -> LoRA:
        base = cast(Array | Quantized, w)
        axes, (m, n) = _check_target(base, depth, name, rank, adapted)
        fan_in, a_shape, b_shape = (
            (m, (m, rank), (rank, n))
            if orientation == "x@W"
            else (n, (rank, n), (m, rank))
        )
        # Each adapted weight, then each layer, then each adapter its own key.
        layers = int(np.prod(axes, dtype=int))
        keys = jr.split(jr.fold_in(key, next(count)), (layers, num_adapters))
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.vmap(
            jax.vmap(lambda kk: jr.uniform(kk, a_shape, base.dtype, -bound, bound))
        )(keys)
        return LoRA(
            base,
            a.reshape(axes + (num_adapters,) + a_shape),
            jnp.zeros(axes + (num_adapters,) + b_shape, base.dtype),
            0,
            alpha,
            rank,
            orientation,
            name=name,
            dropout=dropout,
        )

    return replace_weights(
        model,
        targets,
        make,
        orientation=orientation,
        who="add_lora",
        verb=("adapt", "adapted"),
    )


def _check_target(
    base: Array | Quantized, depth: int, name: str, rank: int, adapted: list[str]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The target's layer axes and `(m, n)`, or an error naming it."""
    if inside := next((n for n in adapted if name.startswith(n + ".")), None):
        raise ValueError(
            f"add_lora: the target `{name}` is inside the LoRA at `{inside}`, "
            "which is adapted already.\nHint: give add_lora num_adapters= for "
            "several adapters, or adapt `adapters.merge(model)`'s weights."
        )
    axes, shape = tuple(base.shape[:depth]), tuple(base.shape[depth:])
    if len(shape) != 2:
        raise ValueError(
            f"add_lora: the target `{name}` has shape {tuple(base.shape)} "
            f"({len(shape)} axes per layer after {depth} layer axes), but a "
            "LoRA adapts 2-D weights.\nHint: narrow the pattern to matrices."
        )
    if not jnp.issubdtype(base.dtype, jnp.floating):
        raise TypeError(
            f"add_lora: the target `{name}` is {jnp.dtype(base.dtype).name}"
            f"{list(base.shape)}, but a LoRA adapts floating-point weights.\n"
            "Hint: narrow the pattern to the model's float matrices."
        )
    m, n = shape
    if rank > min(m, n):
        raise ValueError(
            f"add_lora: rank={rank} is larger than the weight `{name}` "
            f"({m}x{n}) allows; the rank must be at most {min(m, n)}.\nHint: "
            "pick a rank well below the smaller side."
        )
    return axes, shape


def _check_adapted(model: PyTree, targets: object, adapted: list[str]) -> None:
    # A target that is a LoRA already (by name, or a module's weight): say so,
    # rather than that it matches no array or has no array weight.
    items = targets if isinstance(targets, (list, tuple)) else [targets]
    names = [t for t in items if isinstance(t, str)]
    if hit := next((n for n in adapted for t in names if fnmatchcase(n, t)), None):
        raise ValueError(
            f"add_lora: the target `{hit}` is adapted already: it is a LoRA.\n"
            "Hint: give add_lora num_adapters= for several adapters, or adapt "
            "`adapters.merge(model)`'s weights."
        )
    kinds = tuple(t for t in items if isinstance(t, type))
    is_kind = lambda x: isinstance(x, kinds)  # noqa: E731
    for path, node in jtu.tree_leaves_with_path(model, is_leaf=is_kind):
        if kinds and is_kind(node) and is_lora(getattr(node, "weight", None)):
            raise ValueError(
                f"add_lora: the {type(node).__name__} at `{jtu.keystr(path)}` is "
                "adapted already: its weight is a LoRA.\nHint: give add_lora "
                "num_adapters= for several adapters, or adapt "
                "`adapters.merge(model)`'s weights."
            )


def trainable(model: PyTree) -> PyTree[bool]:
    """A filter spec, `True` exactly on the adapters (`a`, `b`) of every
    [`eqxscan.adapters.LoRA`][]: `eqx.partition(model, adapters.trainable(model))`
    splits off the adapters, to differentiate and update alone (gradients and
    optimiser state for the adapters only). A LoRA's base has a zero gradient,
    but the model's other float arrays (norm scales, biases) do not: an
    optimiser over all of a model's arrays takes `trainable` as labels,
    `optax.multi_transform({True: tx, False: optax.set_to_zero()},
    adapters.trainable)`; not `optax.masked(tx, ...)`, which passes the other
    arrays' gradients through as their updates (and weight decay would move
    the base).

    **Arguments:**

    - `model`: a model returned by [`eqxscan.adapters.add_lora`][].

    **Returns:**

    A pytree of bools with `model`'s structure.
    """
    loras_in(model, "trainable")

    def spec(node: object) -> object:
        if not isinstance(node, LoRA):
            return False
        off = jtu.tree_map(lambda _: False, node)
        return eqx.tree_at(lambda lo: (lo.a, lo.b), off, (True, True))

    return jtu.tree_map(spec, model, is_leaf=is_lora)
