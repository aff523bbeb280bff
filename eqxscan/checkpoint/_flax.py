"""Importing Flax linen `nn.scan` parameters into a `Stacked`."""

import re
from collections.abc import Mapping

import equinox as eqx
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .. import Stacked
from .._internal import describe, key_name
from ._files import flatten
from ._names import NameMap
from ._state_dict import from_state_dict


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _dense_modules(tree: Mapping, prefix: str = "") -> dict[str, Mapping]:
    # The Flax `Dense` submodules (dicts holding a `kernel`) by dotted path.
    found: dict[str, Mapping] = {}
    for name, value in tree.items():
        path = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, Mapping) and "kernel" in value:
            if extra := sorted(set(value) - {"kernel", "bias"}):
                raise ValueError(
                    f"Flax module '{path}' has parameters {extra} besides "
                    "kernel/bias; only Dense layers are converted."
                )
            found[path] = value
        elif isinstance(value, Mapping):
            found.update(_dense_modules(value, path))
        else:
            raise ValueError(
                f"Flax parameter '{path}' is not part of a Dense layer (kernel/bias); "
                "only Dense layers are converted. Convert other parameters "
                "yourself with eqxscan.to_state_dict / eqxscan.from_state_dict."
            )
    return found


def flax_scan_state(params: Mapping[str, PyTree]) -> dict[str, np.ndarray]:
    """The parameters of a Flax linen `nn.scan` over layers as a per-layer state
    dict of Flax's own names: `"3.Sub_0.DenseGeneral_0.kernel"` is layer 3's
    slice of `params["Sub_0"]["DenseGeneral_0"]["kernel"]`.

    **Arguments:**

    - `params`: the scanned module's parameters (the outer `"params"`
      optional), every array with the layer axis first.

    **Returns:**

    A layer-major `dict[str, numpy.ndarray]`, for a
    [`eqxscan.checkpoint.NameMap`][] to load (as `from_flax_scan` does).
    """
    if set(params) == {"params"}:
        params = params["params"]
    arrays = {name: np.asarray(value) for name, value in flatten(params).items()}
    depths = {name: a.shape[0] if a.ndim else None for name, a in arrays.items()}
    if len(set(depths.values())) > 1 or None in depths.values():
        found = ", ".join(f"'{n}' {list(arrays[n].shape)}" for n in list(arrays)[:6])
        raise ValueError(
            f"The Flax parameters do not share one leading layer axis: {found}.\n"
            "Hint: pass the parameters of the nn.scan module itself, scanned with "
            'variable_axes={"params": 0}.'
        )
    num_layers = next(iter(depths.values()), 0) or 0
    return {
        f"{i}.{name}": array[i]
        for i in range(num_layers)
        for name, array in arrays.items()
    }


def _linears(layer: object) -> list[str]:
    # The `eqx.nn.Linear`s of one layer, in attribute order ("" for a layer that
    # is one).
    is_linear = lambda x: isinstance(x, eqx.nn.Linear)
    found = jtu.tree_flatten_with_path(layer, is_leaf=is_linear)[0]
    return [".".join(key_name(k, ()) for k in p) for p, x in found if is_linear(x)]


def from_flax_scan(
    like: Stacked,
    params: Mapping[str, PyTree],
    *,
    modules: Mapping[str, str] | None = None,
    names: NameMap | None = None,
) -> Stacked:
    """Load the parameters of a Flax linen `nn.scan` over layers into a `Stacked`
    whose layers use `eqx.nn.Linear`.

    `nn.scan(..., variable_axes={"params": 0})` stores each `Dense` as
    `kernel: [N, in, out]` and `bias: [N, out]`; each layer's kernel is
    transposed into an `eqx.nn.Linear`'s `weight: [out, in]`. As in any
    [`eqxscan.from_state_dict`][] load, different depths, shapes or missing
    layers raise `ValueError` naming them.

    **Arguments:**

    - `like`: a `Stacked` of the wanted layout (e.g. built with any key).
    - `params`: the scanned module's parameters (its subtree, if nested), e.g.
      `{"params": {"Dense_0": {"kernel": ..., "bias": ...}}}` (the outer
      `"params"` optional).
    - `modules`: maps each Flax `Dense` path (`"Dense_0"`) to the path of an
      `eqx.nn.Linear` in one layer (`"linear"`; `""` if the layer is one). By
      default the `Dense`s, in numeric order, pair with the layer's `Linear`s
      in attribute order.
    - `names`: instead of `modules`, a [`eqxscan.checkpoint.NameMap`][] from
      the layer's names (`"{i}.norm.weight"`) to Flax's, as
      [`eqxscan.checkpoint.flax_scan_state`][] names them
      (`"{i}.LayerNorm_0.scale"`): any module, nested or not (`LayerNorm`,
      `RMSNorm`, `Embed`, `Conv` with `Transpose((2, 1, 0))`, `DenseGeneral`
      with `Reshape`).

    **Returns:**

    `like` with the Flax weights.
    """
    if not isinstance(like, Stacked):
        raise TypeError(f"like must be an eqxscan.Stacked, got {type(like).__name__}.")
    if names is not None:
        if modules is not None:
            raise ValueError(
                f"from_flax_scan: pass modules= or names=, not both (got "
                f"{describe(modules)}).\nHint: a NameMap also maps Dense layers."
            )
        return names.load(like, flax_scan_state(params))
    if set(params) == {"params"}:
        params = params["params"]
    dense = _dense_modules(params)
    if modules is None:
        flax_names = sorted(dense, key=_natural)
        linears = _linears(like[0])
        if len(flax_names) != len(linears):
            raise ValueError(
                f"The Flax parameters have {len(flax_names)} Dense layers "
                f"{flax_names} but each layer of the Stacked has {len(linears)} "
                f"eqx.nn.Linear {linears}; pass `modules=` to pair them."
            )
        modules = dict(zip(flax_names, linears))
    if unknown := sorted(set(modules) - set(dense)):
        raise ValueError(
            f"modules names Flax Dense layers {unknown} that are not in the "
            f"parameters (found {sorted(dense)})."
        )
    state: dict[str, np.ndarray] = {}
    for flax_name, eqx_path in modules.items():
        kernel = np.asarray(dense[flax_name]["kernel"])
        if kernel.ndim != 3:
            raise ValueError(
                f"Flax '{flax_name}.kernel' has shape {kernel.shape}; a scanned Dense "
                "kernel is [num_layers, in, out]."
            )
        bias = dense[flax_name].get("bias")
        bias = None if bias is None else np.asarray(bias)
        prefix = f".{eqx_path}" if eqx_path else ""
        for i in range(kernel.shape[0]):
            state[f"{i}{prefix}.weight"] = np.ascontiguousarray(kernel[i].T)
            if bias is not None:
                state[f"{i}{prefix}.bias"] = bias[i]
    loaded = from_state_dict(like, state)
    # A Dense left out, or two into one Linear (the last one won), loaded
    # weights that compute something else than the Flax module.
    targets = list(modules.values())
    unused = sorted(set(dense) - set(modules))
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if unused or twice:
        why = f"{unused} unpaired" if unused else f"{twice} given twice"
        raise ValueError(
            f"modules does not pair each Flax Dense with its own Linear: {why} "
            f"(modules={dict(modules)}).\nHint: name every Dense of the "
            "parameters once, or take the unwanted ones out of params."
        )
    return loaded
