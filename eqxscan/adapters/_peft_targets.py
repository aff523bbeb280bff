"""Which PEFT module each layer of a model's [`eqxscan.adapters.LoRA`][]s
stands for, through the base model's [`eqxscan.checkpoint.NameMap`][]: a probe
exported under the weight's name must come back as it is or transposed, under
one `<module>.weight` name (a weight split, joined or reshaped cannot hold one
rank-r pair)."""

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jaxtyping import PyTree

from .._internal import (
    Checked,
    describe,
    LayerNumbering,
    pattern,
    resolve,
    Site,
)
from ..checkpoint import NameMap
from ._lora import LoRA, lora_sites, loras


@dataclasses.dataclass(frozen=True)
class PeftLayer:
    """One layer of one of the model's `LoRA`s, as PEFT names it."""

    lora: LoRA
    where: str  # eqxscan's name of the weight and layer, e.g. "'blocks.2.w2' (layer 2)"
    index: tuple[int, ...]  # the layer's index along the LoRA's layer axes
    module: str  # PEFT's module, e.g. "model.layers.2.mlp.down_proj"
    transposed: bool  # the map stores the weight transposed ([in, out])

    def out_in(self) -> tuple[int, int]:
        """The `(out, in)` sizes of the weight, from the LoRA's orientation."""
        m, n = self.lora.base.shape[-2:]
        return (m, n) if self.lora.orientation == "W@x" else (n, m)


def tree_of(arrays: Mapping[str, np.ndarray]) -> dict:
    """A pytree with these state-dict names (`"a.0.b"` -> `{"a": {"0": {"b": v}}}`)."""
    tree: dict = {}
    for name, value in arrays.items():
        *parents, last = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _refused(name_map: NameMap, ours: str, shape: tuple[int, ...]) -> str:
    """Why the map does not give `ours` as one PyTorch weight (its own shape)."""
    try:
        out = name_map.export(tree_of({ours: np.zeros(shape, np.uint8)}))
    except ValueError as e:
        return str(e).splitlines()[0]
    if not out:
        return "the name map keeps it on eqxscan's side only (keep=)"
    if len(out) > 1:
        names = ", ".join(f"'{n}' {list(v.shape)}" for n, v in out.items())
        return f"the name map fuses {len(out)} weights into it ({names})"
    ((name, value),) = out.items()
    return f"the name map reshapes it into '{name}' {list(value.shape)}"


def _target(name_map: NameMap, lora: LoRA, site: Site, index: tuple) -> PeftLayer:
    resolved = resolve(site.path, index)
    ours = ".".join(map(str, resolved))
    numbers = [n for n, p in zip(resolved, site.path) if isinstance(p, LayerNumbering)]
    where = f"'{ours}'" + (f" (layer {numbers[-1]})" if numbers else "")
    # A small probe of distinct values tells the rule's operations apart: the
    # map must give it back as it is or transposed, under one `.weight` name.
    probe = np.arange(6, dtype=np.float32).reshape(2, 3)
    try:
        out = name_map.export(tree_of({ours: probe}))
    except ValueError:
        out = {}
    ((name, value),) = out.items() if len(out) == 1 else [("", probe[:0])]
    same = value.shape == probe.shape and np.array_equal(value, probe)
    transposed = value.shape == probe.T.shape and np.array_equal(value, probe.T)
    if not (same or transposed):
        why = _refused(name_map, ours, tuple(lora.base.shape[-2:]))
        raise ValueError(
            f"The LoRA at {where} cannot be written as PEFT's rank-{lora.rank} "
            f"pair: {why}. PEFT adapts one PyTorch Linear weight, which the map "
            "must give as eqxscan's weight or its transpose.\nHint: adapt only "
            "weights that the map renames or transposes (e.g. not fused q/k/v or "
            "gate/up projections, nor weights it reshapes by head)."
        )
    if not name.endswith(".weight"):
        raise ValueError(
            f"The name map gives the LoRA at {where} as '{name}', not a PyTorch "
            "module's '<module>.weight', which PEFT adapts.\nHint: use the map of "
            "the PyTorch checkpoint (names ending in '.weight')."
        )
    return PeftLayer(lora, where, index, name[: -len(".weight")], transposed)


def peft_layers(model: PyTree, name_map: Checked[NameMap], who: str) -> list[PeftLayer]:
    """Every layer of every LoRA of `model`, with its PEFT module."""
    if not isinstance(name_map, NameMap):
        raise TypeError(
            f"{who}: name_map must be an eqxscan.checkpoint.NameMap (the base "
            f"model's, to PyTorch names), got {describe(name_map)}."
        )
    found = loras(model)
    if not found:
        raise ValueError(
            f"{who}: the model holds no eqxscan.adapters.LoRA, got "
            f"{describe(model)}.\nHint: add adapters with "
            "eqxscan.adapters.add_lora(model, ...) first, with the file's targets."
        )
    sites: dict[int, Site] = {}
    for lora, site in lora_sites(model):
        if (first := sites.setdefault(id(lora.a), site)) is not site:
            # One LoRA in two places: which name would it have?
            raise ValueError(
                f"{who}: one LoRA stands both at '{pattern(first.path)}' and at "
                f"'{pattern(site.path)}'.\nHint: adapt a tied weight in one "
                "place only."
            )
    targets = []
    for lora in found:
        site = sites[id(lora.a)]
        if not isinstance(lora.a, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{who} needs concrete arrays, but the LoRA at "
                f"'{pattern(site.path)}' holds {describe(lora.a)}.\nHint: "
                "pass the model itself, not its eval_shape."
            )
        if lora.base.ndim != len(site.axes) + 2:
            raise ValueError(
                f"{who}: the LoRA at '{pattern(site.path)}' has a "
                f"base of shape {tuple(lora.base.shape)} with {len(site.axes)} "
                "layer axes; PEFT adapts 2-D weights only.\nHint: adapt the "
                "model's matrices."
            )
        targets += [_target(name_map, lora, site, i) for i in np.ndindex(*site.axes)]
    seen: dict[str, PeftLayer] = {}
    for t in targets:
        if (other := seen.setdefault(t.module, t)) is not t:
            raise ValueError(
                f"{who}: the LoRAs at {other.where} and {t.where} both stand for "
                f"PEFT's '{t.module}' through the name map.\nHint: check the map's "
                "rules: each weight needs an external name of its own."
            )
    return targets


def loras_of(targets: Sequence[PeftLayer]) -> list[LoRA]:
    return list({id(t.lora): t.lora for t in targets}.values())


def host_factors(
    targets: Sequence[PeftLayer],
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each LoRA's `a` and `b`, copied to the host once."""
    return {id(x): (np.array(x.a), np.array(x.b)) for x in loras_of(targets)}


def swap(lora: LoRA, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # PEFT's (lora_A, lora_B) <-> a LoRA's (a, b), both ways: "W@x" holds them
    # as they are, "x@W" transposed (its delta `a @ b` is `(B @ A).T`).
    return (a.T, b.T) if lora.orientation == "x@W" else (a, b)


def selected(loras: Sequence[LoRA], who: str) -> int:
    """The adapter `select` chose, if the same in every layer of every LoRA."""
    ids = sorted({int(i) for lora in loras for i in np.ravel(lora.active)})
    if len(ids) != 1:
        raise ValueError(
            f"{who}: the model's layers have different adapters selected ({ids})."
            "\nHint: pass adapter=k, or select one with adapters.select(model, k)."
        )
    return ids[0]


def adapter_index(loras: Sequence[LoRA], adapter: object, who: str) -> int:
    k = {lora.num_adapters for lora in loras}
    if len(k) > 1:
        raise ValueError(
            f"{who}: the model's LoRAs hold different numbers of adapters "
            f"({sorted(k)}).\nHint: build every LoRA with one add_lora call."
        )
    (num,) = k
    if isinstance(adapter, np.integer):
        adapter = int(adapter)
    if adapter is None and num == 1:
        return 0
    if isinstance(adapter, bool) or not isinstance(adapter, int) or adapter >= num:
        raise ValueError(
            f"{who}: adapter={adapter!r} does not name one of the {num} adapters "
            f"of the model's LoRAs.\nHint: pass adapter=k with 0 <= k < {num}."
        )
    if adapter < 0:
        raise ValueError(
            f"{who}: adapter={adapter} is negative; -1 (the base alone) is a value "
            f"of `active`, not an adapter.\nHint: pass 0 <= adapter < {num}."
        )
    return adapter
