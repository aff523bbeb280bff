"""`report`: how far each quantized weight is from the float one, layer by layer."""

import dataclasses
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from .._internal import describe, first_difference, LayerNumbering, resolve
from ._files import weights
from ._quantize import is_quantized
from ._quantized import Quantized


class LayerError(NamedTuple):
    """One quantized weight in one layer: its error against the float weight."""

    name: str
    """The weight's state-dict name pattern (`"blocks.*.w1"`), or its key path."""
    layer: tuple[int, ...]
    """The layer's number in the names of [`eqxscan.to_state_dict`][], one per
    `*` of `name`: `(3,)` for `blocks.3.w1` (a `Chain`'s layers are numbered
    through the chain; `()` outside any stack or chain)."""
    max_abs: float
    """`max |dequantized - float|`."""
    relative: float
    """`||dequantized - float||_F / ||float||_F` (0 for an exact zero weight)."""


@dataclasses.dataclass(frozen=True)
class Report:
    """The errors of a quantized model's weights, one row per weight and layer
    (iterate over it for the [`LayerError`][eqxscan.quant.LayerError] rows);
    `str(report)` is a table."""

    rows: tuple[LayerError, ...]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def worst(self) -> LayerError:
        """The row with the largest relative error."""
        return max(self.rows, key=lambda r: r.relative)

    def __str__(self) -> str:
        head = ("weight", "layer", "max abs error", "relative error")
        body = [
            (
                r.name,
                ".".join(map(str, r.layer)) or "-",
                f"{r.max_abs:.3e}",
                f"{r.relative:.3e}",
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(4)]
        rule = tuple("-" * w for w in widths)
        return "\n".join(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths))
            )
            for row in [head, rule, *body]
        )


@eqx.filter_jit
def _errors(q: Quantized, w: Array) -> tuple[Array, Array]:
    """Max abs and relative Frobenius error of each layer, one layer at a time
    (`lax.map`), so that one layer's float weight is formed at once."""
    n = math.prod(w.shape[:-2])  # not -1: a weight may have no elements
    # Each stored array's own axes after the layers' (a split int4: three).
    flat = jtu.tree_map(lambda a: a.reshape(n, *a.shape[w.ndim - 2 :]), q)
    w = w.reshape(n, *w.shape[-2:])

    def one(args: tuple[Quantized, Array]) -> tuple[Array, Array]:
        layer, wi = args
        wi = wi.astype(jnp.float32)
        diff = layer.dequantize().astype(jnp.float32) - wi
        norm, err = jnp.linalg.norm(wi), jnp.linalg.norm(diff)
        relative = jnp.where(norm > 0, err / jnp.where(norm > 0, norm, 1.0), err)
        return jnp.max(jnp.abs(diff), initial=0.0), relative

    return jax.lax.map(one, (flat, w))


def report(float_model: PyTree, quantized_model: PyTree) -> Report:
    """Per weight and per layer: how far [`eqxscan.quant.quantize`][]'s weights
    are from the float weights they were made from.

    **Arguments:**

    - `float_model`: the model before quantizing.
    - `quantized_model`: what `quantize` returned for it.

    **Returns:**

    A [`Report`][eqxscan.quant.Report]: for every `Quantized` and each of its
    layers, the max abs error and the relative Frobenius error of the dequantized
    weight; `print(report)` shows them as a table.
    """
    pairs: list[tuple[str, Quantized, object]] = []

    def pair(path: tuple, q: object, w: object) -> None:
        if isinstance(q, Quantized):
            pairs.append((q.name or jtu.keystr(path), q, w))

    try:
        jtu.tree_map_with_path(pair, quantized_model, float_model, is_leaf=is_quantized)
    except ValueError as e:
        # Named where: JAX's first line says only what kind of difference.
        floats = jtu.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_quantized(x) else x,
            quantized_model,
            is_leaf=is_quantized,
        )
        diff = first_difference(float_model, floats)
        at = (
            f": at `{diff[0]}` the float model holds {diff[1]}, the quantized one "
            f"{diff[2]}"
            if diff
            else f" ({str(e).splitlines()[0]})"
        )
        raise ValueError(
            "report: the float model is not shaped as the quantized model with "
            f"arrays where its Quantized weights are{at}.\n"
            "Hint: pass the model given to quantize, then what it returned."
        ) from e
    if not pairs:
        raise ValueError(
            "report: the quantized model holds no Quantized weight.\nHint: pass "
            "the model given to quantize, then what it returned."
        )
    rows: list[LayerError] = []
    for (name, q, w), held in zip(pairs, weights(quantized_model)[0], strict=True):
        if not (isinstance(w, jax.Array | np.ndarray) and w.shape == q.shape):
            raise ValueError(
                f"report: at `{name}` the float model holds {describe(w)}, but the "
                f"quantized weight stands for {q.dtype.name}{list(q.shape)}.\nHint: "
                "pass the model given to quantize, then what it returned."
            )
        if not all(isinstance(a, jax.Array | np.ndarray) for a in (q.values, q.scales)):
            raise ValueError(
                f"report: the Quantized weight at `{name}` holds no arrays to "
                f"compare: its values are a {type(q.values).__name__} "
                f"{describe(q.values)}.\nHint: pass what quantize returned, not "
                "its eqx.filter_eval_shape."
            )
        max_abs, relative = (np.asarray(a) for a in _errors(q, jnp.asarray(w)))
        # The layers as the state dict numbers them: not their indices in a
        # `Chain`'s group or in a stack in stage order.
        path = held.site.path
        at = [k for k, p in enumerate(path) if isinstance(p, LayerNumbering)]
        for i, index in enumerate(np.ndindex(*held.site.axes)):
            layer = tuple(resolve(path, index)[k] for k in at)
            rows.append(LayerError(name, layer, float(max_abs[i]), float(relative[i])))
    return Report(tuple(rows))
