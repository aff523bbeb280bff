"""`merge`: plain weights from a model's LoRAs; `unmerge`: the LoRAs back. Both
add (or subtract) one layer's `delta` at a time (a jitted `fori_loop`), so XLA
allocates one layer's delta besides the arrays, not the stack's."""

from typing import Literal

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from .._internal import Checked, describe, index, write
from ..quant import Quantized
from ._lora import check_adapter, is_lora, LoRA, loras_in


def _ids(lora: LoRA, adapter: object, who: str) -> Array:
    """The adapter each layer of `lora` merges: `adapter`, checked, or where it
    is `None` the one `select` chose (`lora.active`, which may be traced)."""
    if adapter is None:
        adapter = lora.active
    elif isinstance(adapter, bool) or not isinstance(adapter, (int, np.integer)):
        raise TypeError(f"{who}: adapter must be an int, got {describe(adapter)}.")
    else:
        check_adapter(lora, int(adapter), who, "adapter", "is the base alone")
    return jnp.broadcast_to(jnp.asarray(adapter, jnp.int32), lora.layer_axes)


def _base_alone(ids: Array, lora: LoRA) -> bool:
    # Known to select no adapter in any layer (a traced `active` is not known).
    return not isinstance(ids, jax.core.Tracer) and not bool(
        np.any((np.asarray(ids) >= 0) & (np.asarray(ids) < lora.num_adapters))
    )


def _refuse_quantized(lora: LoRA, who: str) -> None:
    if isinstance(lora.base, Quantized):
        raise ValueError(
            f"{who}: the LoRA at `{lora.name}` has a quantized base "
            f"({lora.base.kind}, {lora.base.dtype.name}{list(lora.base.shape)}); "
            "adding a delta to it would need the float weight, quantized again, "
            "with new rounding.\nHint: merge into float weights with "
            f"`adapters.{who}(quant.dequantize(model))`, then quantize the "
            "result if wanted."
        )


def _add_delta(
    weight: Array,
    a: Array,
    b: Array,
    ids: Array,
    scale: float,
    orientation: Literal["x@W", "W@x"],
) -> Array:
    """`weight + scale * delta` of adapter `ids[i]` in layer `i` (none where
    `ids[i]` is outside `[0, K)`, as in a call), one layer at a time."""
    flat = weight.reshape((-1,) + weight.shape[-2:])
    a = a.reshape((-1,) + a.shape[-3:])
    b = b.reshape((-1,) + b.shape[-3:])
    ids = ids.reshape(-1)

    wide = weight.dtype if jnp.finfo(weight.dtype).bits >= 32 else jnp.float32

    def one(i: Array, w: Array) -> Array:
        k, num = index(ids, i), a.shape[1]
        ai, bi = index((a, b), (i, jnp.clip(k, 0, num - 1)))
        pair = (ai, bi) if orientation == "x@W" else (bi, ai)
        delta = jnp.matmul(*pair, preferred_element_type=wide)
        change = jnp.where((k >= 0) & (k < num), scale * delta, 0)
        # A narrower weight (bfloat16) adds in float32: the exact sum rounded
        # once, not a rounded delta added with a second rounding.
        return write(w, i, change, add=True)

    return jax.lax.fori_loop(0, flat.shape[0], one, flat).reshape(weight.shape)


_STATIC = ("scale", "orientation")
_jitted = jax.jit(_add_delta, static_argnames=_STATIC)
_donating = jax.jit(_add_delta, static_argnames=_STATIC, donate_argnums=0)


def merge(
    model: PyTree, adapter: Checked[int | None] = None, *, donate: bool = False
) -> PyTree:
    """A plain model: every [`eqxscan.adapters.LoRA`][] replaced by `base + delta`
    of one adapter.

    **Arguments:**

    - `model`: a model returned by [`eqxscan.adapters.add_lora`][].
    - `adapter`: the adapter merged into every weight (`-1`: the base alone);
      `None` (default): the one each layer has selected
      ([`eqxscan.adapters.select`][]), so that the merged model computes what
      `model` computes. A quantized base ([`eqxscan.quant.Quantized`][],
      QLoRA) is refused unless no layer uses an adapter: merge
      `eqxscan.quant.dequantize(model)` instead.
    - `donate`: update the bases in place (donated: `model` and anything
      sharing its base arrays can no longer be used); peak memory is then the
      model plus one layer's delta, else the merged weights are new arrays.

    **Returns:**

    `model` with arrays where its `LoRA`s were; the layers compute what the
    adapted model computes with `adapter` selected.
    """
    fn = _donating if donate else _jitted
    loras_in(model, "merge")

    def one(node: object) -> object:
        if not isinstance(node, LoRA):
            return node
        ids = _ids(node, adapter, "merge")
        if _base_alone(ids, node):
            return node.base
        _refuse_quantized(node, "merge")
        return fn(node.base, node.a, node.b, ids, node.scaling, node.orientation)

    return jtu.tree_map(one, model, is_leaf=is_lora)


def unmerge(
    merged: PyTree,
    adapted: PyTree,
    adapter: Checked[int | None] = None,
    *,
    donate: bool = False,
) -> PyTree:
    """The adapted model back from a merged one: each base is the merged weight
    minus the delta of `adapter`, the adapters are `adapted`'s.

    **Arguments:**

    - `merged`: what [`eqxscan.adapters.merge`][] returned (possibly changed since
      in its arrays other than the merged weights, which are kept). The model
      `add_lora` adapted holds the LoRAs' own bases, and is refused.
    - `adapted`: the model it was merged from (only its adapters are read).
    - `adapter`: the adapter that was merged (`None`: the ones `adapted` has
      selected, as `merge`'s default).
    - `donate`: update the merged weights in place (as for `merge`).

    **Returns:**

    `adapted`'s structure with `merged`'s arrays, each `LoRA`'s base recovered
    (to float rounding).
    """
    fn = _donating if donate else _jitted
    # A plain `adapted` (the arguments swapped): nothing to recover.
    loras_in(adapted, "unmerge", "the adapted model (its second argument)")

    def one(node: object, weight: object) -> object:
        if not isinstance(node, LoRA):
            return weight
        ids = _ids(node, adapter, "unmerge")
        _refuse_quantized(node, "unmerge")
        if not (isinstance(weight, jax.Array) and weight.shape == node.base.shape):
            raise ValueError(
                f"unmerge: at the LoRA `{node.name}` the merged model holds "
                f"{describe(weight)}, but the base is {describe(node.base)}.\n"
                "Hint: pass the model merge() returned and the model it merged."
            )
        base = weight
        if not _base_alone(ids, node):
            if weight is node.base:  # merge returns new arrays where it adds
                raise ValueError(
                    f"unmerge: at the LoRA `{node.name}` the merged model holds "
                    "the LoRA's own base, which no adapter was merged into: "
                    "subtracting one would change the base.\nHint: pass the "
                    "model merge() returned, not the model add_lora adapted."
                )
            base = fn(weight, node.a, node.b, ids, -node.scaling, node.orientation)
        return eqx.tree_at(lambda lo: lo.base, node, base)

    try:
        return jtu.tree_map(one, adapted, merged, is_leaf=is_lora)
    except ValueError as e:
        if "pytree structure" not in str(e):
            raise
        first = str(e).strip().splitlines()[0:2]
        raise ValueError(
            "unmerge: the merged model is not shaped as the adapted model with "
            f"arrays in place of its LoRAs ({' '.join(x.strip() for x in first)})."
            "\nHint: pass the model merge() returned and the model it merged."
        ) from e
