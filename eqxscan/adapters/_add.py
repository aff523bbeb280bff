"""`add_lora`: targeted weights replaced by `LoRA`s; `trainable`: their adapters."""

import dataclasses
import math
from collections.abc import Sequence
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._internal import (
    check_size,
    Checked,
    replace_weights,
    Target,
)
from ..quant import Quantized
from ._lora import LoRA, Orientation


def add_lora(
    model: PyTree,
    targets: Checked[Target | Sequence[Target]],
    *,
    rank: Checked[int],
    alpha: float | None = None,
    dropout: Checked[float] = 0.0,
    num_adapters: Checked[int] = 1,
    orientation: Checked[Orientation] = "x@W",
    key: PRNGKeyArray,
) -> PyTree:
    """`model` with each targeted weight replaced by a [`eqxscan.adapters.LoRA`][].

    Inside an [`eqxscan.Stacked`][] (or an [`eqxscan.Chain`][]'s stacks) a weight is
    adapted in every layer: the `LoRA`'s arrays have the layer axes in front, and
    its base is the stacked weight itself, not a copy. Initialised as PEFT does
    (`init_lora_weights=True`): `a` Kaiming-uniform (`U(-1/sqrt(in), 1/sqrt(in))`),
    `b` zero, so the adapted model starts equal to the base; adapter 0 is active.

    **Arguments:**

    - `model`: any pytree, usually a model containing `Stacked`s or `Chain`s.
    - `targets`: a name pattern or a module type, or a list of them. A pattern is
      matched (`fnmatch`) against the names of
      [`eqxscan.to_state_dict`][], with every layer index shown as `*`:
      `"blocks.*.w1"`, `"*.w2"`. A module type (e.g. `eqx.nn.Linear`) adapts
      the `weight` of every module of that type, in orientation `"W@x"`. A
      [`eqxscan.quant.Quantized`][] weight is matched as the float weight it
      stands for, and becomes the `LoRA`'s base (QLoRA).
    - `rank`: `r`, at least 1 and at most the smaller side of each weight.
    - `alpha`: the adapters are scaled by `alpha / rank` (default: `rank`).
    - `dropout`: dropout rate on the adapters' input (PEFT's `lora_dropout`);
      above 0, [`eqxscan.adapters.with_dropout_key`][] gives it its keys.
    - `num_adapters`: `K`, adapters held side by side over one base.
    - `orientation`: how the layers use the weights a pattern matches: `"x@W"`
      (base `[in, out]`) or `"W@x"` (base `[out, in]`).
    - `key`: a JAX PRNG key; every weight, layer and adapter gets its own, derived
      from the weight's position and layer index (not from how the model runs).

    **Returns:**

    `model` with the targets replaced; nothing else changes.
    """
    rank = check_size("rank", rank)
    num_adapters = check_size("num_adapters", num_adapters)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a number in [0, 1), got {dropout!r}.")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")
    if orientation not in ("x@W", "W@x"):
        raise ValueError(f"orientation must be 'x@W' or 'W@x', got {orientation!r}.")
    make = _Maker(
        rank, float(rank if alpha is None else alpha), float(dropout), num_adapters
    )
    return replace_weights(
        model,
        targets,
        lambda w, depth, name, o: make(cast(Array | Quantized, w), depth, name, o, key),
        orientation=orientation,
        who="add_lora",
        verb=("adapt", "adapted"),
    )


@dataclasses.dataclass
class _Maker:
    """Builds each adapted weight's `LoRA`, counting them for their keys."""

    rank: int
    alpha: float
    dropout: float
    num_adapters: int
    count: int = 0

    def __call__(
        self,
        base: Array | Quantized,
        depth: int,
        name: str,
        orientation: Orientation,
        key: PRNGKeyArray,
    ) -> LoRA:
        axes, shape = tuple(base.shape[:depth]), tuple(base.shape[depth:])
        if len(shape) != 2:
            raise ValueError(
                f"add_lora: the target `{name}` has shape {tuple(base.shape)} "
                f"({len(shape)} axes per layer after {depth} layer axes), but a "
                "LoRA adapts 2-D weights.\nHint: narrow the pattern to matrices."
            )
        m, n = shape
        if self.rank > min(m, n):
            raise ValueError(
                f"add_lora: rank={self.rank} is larger than the weight `{name}` "
                f"({m}x{n}) allows; the rank must be at most {min(m, n)}.\nHint: "
                "pick a rank well below the smaller side."
            )
        r, k = self.rank, self.num_adapters
        fan_in, a_shape, b_shape = (
            (m, (m, r), (r, n)) if orientation == "x@W" else (n, (r, n), (m, r))
        )
        # Each adapted weight, then each layer, then each adapter its own key.
        leaf_key = jr.fold_in(key, self.count)
        self.count += 1
        layers = int(np.prod(axes, dtype=int))
        keys = jr.split(leaf_key, (layers, k))
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.vmap(
            jax.vmap(lambda kk: jr.uniform(kk, a_shape, base.dtype, -bound, bound))
        )(keys)
        return LoRA(
            base,
            a.reshape(axes + (k,) + a_shape),
            jnp.zeros(axes + (k,) + b_shape, base.dtype),
            jnp.zeros(axes, jnp.int32),
            self.alpha,
            r,
            orientation,
            name=name,
            dropout=self.dropout,
        )


def trainable(model: PyTree) -> PyTree[bool]:
    """A filter spec that is `True` exactly on the adapters (`a`, `b`) of every
    [`eqxscan.adapters.LoRA`][]: for `eqx.partition`, `eqx.filter_grad` and
    `optax.masked`, so that gradients and optimiser state exist for the adapters
    only.

    **Arguments:**

    - `model`: a model returned by [`eqxscan.adapters.add_lora`][].

    **Returns:**

    A pytree of bools with `model`'s structure.
    """

    def spec(node: object) -> object:
        if not isinstance(node, LoRA):
            return False
        off = jtu.tree_map(lambda _: False, node)
        return eqx.tree_at(lambda lo: (lo.a, lo.b), off, (True, True))

    return jtu.tree_map(spec, model, is_leaf=lambda x: isinstance(x, LoRA))
