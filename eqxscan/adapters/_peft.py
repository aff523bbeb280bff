"""PEFT's LoRA adapter files in and out of a model's [`eqxscan.adapters.LoRA`][]s.

PEFT stores `base_model.model.<module>.lora_A.weight` `[r, in]` and
`...lora_B.weight` `[out, r]` for a PyTorch `Linear` (`[out, in]`); the base
model's name map gives our weight as it is ("W@x": `a = lora_A`, `b = lora_B`)
or transposed ("x@W": `a = lora_A.T`, `b = lora_B.T`), see `_peft_targets.py`.
"""

import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from typing import TypeVar

import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .. import read_safetensors, save_safetensors
from .._internal import Checked, describe, placed_like
from ..checkpoint import NameMap
from ._lora import is_lora, LoRA
from ._peft_targets import (
    adapter_index,
    host_factors,
    loras_of,
    peft_layers,
    PeftLayer,
    selected,
    swap,
    tree_of,
)


T = TypeVar("T")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_FACTORS = {".lora_A.weight": "lora_A", ".lora_B.weight": "lora_B"}


@dataclasses.dataclass(frozen=True)
class _Config:
    """The entries of `adapter_config.json` that loading uses."""

    r: int
    lora_alpha: float
    scaling: float
    fan_in_fan_out: bool


# The config file.


def _not_found(path: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"No {os.path.basename(path)} at {path!r}.\nHint: pass the directory that "
        f"peft's save_pretrained wrote ({CONFIG} and {WEIGHTS})."
    )


def _directory(path: object, who: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{who}: directory must be a path, got {describe(path)}.\nHint: the "
            f"arguments are (model, directory, name_map)."
        )
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(
            f"{who}: {path!r} is a file, not a directory.\nHint: pass the "
            f"directory of PEFT's files ({CONFIG} and {WEIGHTS})."
        )
    return path


def _config_error(path: str, why: str, hint: str) -> ValueError:
    return ValueError(f"{path!r} is not a PEFT LoRA config: {why}.\nHint: {hint}")


def _number(config: Mapping[str, object], key: str, path: str) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _config_error(
            path,
            f"'{key}' is {value!r}, expected a positive number",
            "write the file with peft's save_pretrained, or fix the entry.",
        )
    return float(value)


def _read_config(directory: str) -> _Config:
    path = os.path.join(directory, CONFIG)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise _not_found(path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _config_error(
            path, f"it is not valid JSON ({e})", "rewrite it with save_pretrained."
        ) from None
    if not isinstance(config, dict):
        why = f"it holds {type(config).__name__}, not a JSON object"
        raise _config_error(path, why, "rewrite it with save_pretrained.")
    if config.get("peft_type") != "LORA":
        why = f"'peft_type' is {config.get('peft_type')!r}, expected 'LORA'"
        raise _config_error(path, why, "eqxscan reads LoRA adapters only.")
    r = _number(config, "r", path)
    if not r.is_integer():
        raise _config_error(path, f"'r' is {r}, not an integer", "fix the entry.")
    alpha = _number(config, "lora_alpha", path)
    unsupported = [
        f"'{key}' is {config[key]!r}"
        for key, plain in (
            ("use_dora", (False, None)),
            ("bias", ("none", None)),
            ("lora_bias", (False, None)),
            ("rank_pattern", ({}, None)),
            ("alpha_pattern", ({}, None)),
            # Factors of the usual shapes, applied otherwise: only after the
            # invocation tokens (aLoRA), or routed per token (Arrow).
            ("alora_invocation_tokens", (None,)),
            ("arrow_config", (None,)),
        )
        if key in config and config[key] not in plain
    ]
    if unsupported:
        raise _config_error(
            path,
            ", ".join(unsupported) + " (eqxscan's LoRA has one rank and scale, "
            "no bias, DoRA, aLoRA or Arrow)",
            "train the adapter with plain LoRA settings.",
        )
    rslora = bool(config.get("use_rslora", False))
    scaling = alpha / (math.sqrt(r) if rslora else r)
    return _Config(int(r), alpha, scaling, bool(config.get("fan_in_fan_out", False)))


# Loading.


def _read_factors(directory: str) -> tuple[str, dict[str, dict[str, np.ndarray]]]:
    """The file, and each module's factors by name (`"lora_A"`, `"lora_B"`)."""
    path = os.path.join(directory, WEIGHTS)
    if not os.path.isfile(path):
        raise _not_found(path)
    modules: dict[str, dict[str, np.ndarray]] = {}
    odd = []
    for name, value in read_safetensors(path).items():
        suffix = next((s for s in _FACTORS if name.endswith(s)), None)
        if not name.startswith(_PREFIX) or suffix is None:
            odd.append(repr(name))
            continue
        module = name[len(_PREFIX) : -len(suffix)]
        modules.setdefault(module, {})[_FACTORS[suffix]] = value
    if odd:
        raise ValueError(
            f"{path!r} holds tensors that are not LoRA factors "
            f"('{_PREFIX}<module>.lora_A.weight' or '.lora_B.weight'): "
            f"{_few(odd)}.\nHint: eqxscan loads plain LoRA adapters (no "
            "modules_to_save, biases or embedding adapters)."
        )
    return path, modules


def _few(items: Sequence[str], n: int = 6) -> str:
    more = f", ... ({len(items)} in all)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def _check_loras(targets: Sequence[PeftLayer], config: _Config, path: str) -> None:
    """Each LoRA's rank, scale and orientation against the file's."""
    for t in targets:
        if any(t.index):  # each LoRA once, at its first layer
            continue
        lora = t.lora
        if lora.rank != config.r:
            raise ValueError(
                f"{path!r} holds rank-{config.r} adapters, but the LoRA at "
                f"{t.where} has rank {lora.rank}.\nHint: add_lora with "
                f"rank={config.r}, the file's 'r'."
            )
        if not math.isclose(lora.scaling, config.scaling, rel_tol=1e-6):
            plain = math.isclose(config.scaling, config.lora_alpha / config.r)
            how = f"r={config.r}" if plain else f"sqrt(r={config.r}), rsLoRA"
            raise ValueError(
                f"{path!r} scales its adapters by {config.scaling:g} (lora_alpha="
                f"{config.lora_alpha:g} / {how}), but the LoRA at {t.where} by "
                f"{lora.scaling:g} (alpha={lora.alpha:g} / rank {lora.rank})."
                f"\nHint: add_lora with alpha={config.scaling * lora.rank:g}."
            )
        # PEFT's change to its stored weight is `B @ A` (`[out, in]`), or its
        # transpose with `fan_in_fan_out` (a Conv1D's `[in, out]` weight); the
        # map transposes that weight or not on its way to ours.
        want = "W@x" if t.transposed == config.fan_in_fan_out else "x@W"
        if lora.orientation != want:
            stored = "[in, out]" if t.transposed else "[out, in]"
            raise ValueError(
                f"The LoRA at {t.where} has orientation {lora.orientation!r}, but "
                f"the name map stores '{t.module}.weight' as {stored} in eqxscan's "
                f"model (fan_in_fan_out={config.fan_in_fan_out}), so PEFT's "
                f"factors fit {want!r}.\nHint: check the map's Transpose for this "
                "weight, or add_lora with the orientation the layer computes."
            )


def _match(
    targets: Sequence[PeftLayer],
    modules: Mapping[str, Mapping[str, np.ndarray]],
    config: _Config,
) -> list[str]:
    """Every problem between the model's LoRAs and the file's factors."""
    ours = {t.module: t for t in targets}
    unknown = [repr(m) for m in modules if m not in ours]
    problems = []
    if unknown:
        problems.append(
            f"no LoRA of the model stands for {_few(unknown)} through the name "
            f"map (the model's LoRAs stand for {_few([repr(m) for m in ours])})"
        )
    missing = [f"{t.where} ('{t.module}')" for t in targets if t.module not in modules]
    if missing:
        problems.append(f"no factors for the LoRA at {_few(missing)}")
    for t in targets:
        factors = modules.get(t.module, {})
        out, in_ = t.out_in()
        for factor, want in (("lora_A", (config.r, in_)), ("lora_B", (out, config.r))):
            value = factors.get(factor)
            name = f"'{_PREFIX}{t.module}.{factor}.weight'"
            if t.module in modules and value is None:
                problems.append(f"{name} is missing, for {t.where}")
            elif value is not None and tuple(value.shape) != want:
                problems.append(
                    f"{name} is {list(value.shape)}, the LoRA at {t.where} needs "
                    f"{list(want)} ([r, in] for lora_A, [out, r] for lora_B)"
                )
    return problems


def load_peft(
    model: PyTree,
    directory: Checked[str | os.PathLike],
    name_map: Checked[NameMap],
    *,
    adapter: Checked[int | None] = None,
) -> PyTree:
    """Load a PEFT LoRA adapter (the directory `peft`'s `save_pretrained`
    writes) into the [`eqxscan.adapters.LoRA`][]s of `model`.

    The model holds its LoRAs already ([`eqxscan.adapters.add_lora`][] on the
    weights the file adapts, with its rank and scale); one of their `K`
    adapters is filled, nothing else changes. Each module's weight is found
    through `name_map` (e.g. `examples/llama.py`'s `torch_names`), whose rule
    must rename it, or rename and transpose it; the file's tensor names, not
    its `target_modules`, say which modules it adapts. The factors are cast to
    the LoRA's dtype and placed where its arrays are.

    **Arguments:**

    - `model`: a model with `LoRA` leaves (concrete arrays).
    - `directory`: holds `adapter_config.json` and `adapter_model.safetensors`.
    - `name_map`: the base model's [`eqxscan.checkpoint.NameMap`][] to PyTorch
      names.
    - `adapter`: which of the `K` adapters to fill; may be left out when `K` is 1.

    **Returns:**

    `model` with the adapter's `a` and `b` replaced by the file's factors.

    **Raises:**

    `FileNotFoundError` for a missing file (`NotADirectoryError` for a file
    given as the directory); `ValueError`, naming weight and
    layer, for a bad config, another rank or scale, a module without a LoRA (or
    the reverse), a mis-shaped factor, or a weight the map fuses.
    """
    config = _read_config(directory := _directory(directory, "load_peft"))
    path, modules = _read_factors(directory)
    targets = peft_layers(model, name_map, "load_peft")
    k = adapter_index(loras_of(targets), adapter, "load_peft")
    _check_loras(targets, config, path)
    problems = _match(targets, modules, config)
    if problems:
        raise ValueError(
            f"{path!r} does not fit the model's LoRAs: {'; '.join(problems)}.\n"
            "Hint: add_lora on the weights the file adapts, in a model of the "
            "file's depth and sizes (its base model's configuration)."
        )
    new = host_factors(targets)
    for t in targets:
        a, b = new[id(t.lora)]
        factors = modules[t.module]
        pair = swap(t.lora, factors["lora_A"], factors["lora_B"])
        a[t.index + (k,)], b[t.index + (k,)] = pair  # cast to the LoRA's dtype

    def replace(x: object) -> object:
        if not isinstance(x, LoRA) or id(x) not in new:
            return x
        a, b = new[id(x)]
        return dataclasses.replace(x, a=placed_like(x.a, a), b=placed_like(x.b, b))

    return jtu.tree_map(replace, model, is_leaf=is_lora)


# Saving.


def _one(values: set[T], what: str, hint: str) -> T:
    if len(values) != 1:
        raise ValueError(
            f"save_peft: the model's LoRAs have different {what} "
            f"({sorted(values, key=repr)}), but a PEFT config has one.\nHint: {hint}"
        )
    return next(iter(values))


def _write_json(path: str, value: Mapping[str, object]) -> None:
    # Beside its final name, then renamed: a crash leaves the old file or the new.
    directory, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{base}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_peft(
    model: PyTree,
    directory: Checked[str | os.PathLike],
    name_map: Checked[NameMap],
    *,
    adapter: Checked[int | None] = None,
    base_model_name_or_path: str = "",
    task_type: str | None = None,
) -> list[str]:
    """Save one adapter of `model`'s [`eqxscan.adapters.LoRA`][]s as PEFT
    does: `adapter_model.safetensors` and `adapter_config.json`, which `peft`'s
    `PeftModel.from_pretrained` loads onto the PyTorch base model.

    The inverse of [`eqxscan.adapters.load_peft`][], through the same
    `name_map`: factors as PEFT's `lora_A` `[r, in]` and `lora_B` `[out, r]`,
    `target_modules` the modules' names after their layer number
    (`["mlp.down_proj"]`, which PEFT matches as a suffix). Each file is
    written to a temporary file and renamed into place, the weights first.

    **Arguments:**

    - `model`: a model with `LoRA` leaves (concrete arrays), all of one rank,
      `alpha` and dropout.
    - `directory`: where to write (made if absent).
    - `name_map`: the base model's [`eqxscan.checkpoint.NameMap`][] to PyTorch
      names.
    - `adapter`: which of the `K` adapters to write; `None` (default): the one
      the model has selected ([`eqxscan.adapters.select`][]) in every layer.
    - `base_model_name_or_path`: the config's entry of that name.
    - `task_type`: the config's `task_type` (e.g. `"CAUSAL_LM"`), or `None`.

    **Returns:**

    The paths written: the weights, then the config.
    """
    directory = _directory(directory, "save_peft")
    targets = peft_layers(model, name_map, "save_peft")
    loras = loras_of(targets)
    if adapter is None:
        adapter = selected(loras, "save_peft")
    k = adapter_index(loras, adapter, "save_peft")
    hint = "build every LoRA with one add_lora call."
    rank = _one({lora.rank for lora in loras}, "ranks", hint)
    alpha = _one({lora.alpha for lora in loras}, "alphas", hint)
    dropout = _one({lora.dropout for lora in loras}, "dropout rates", hint)
    fan_in_fan_out = _one(
        {t.transposed == (t.lora.orientation == "W@x") for t in targets},
        "layouts of PEFT's stored weights (fan_in_fan_out)",
        "adapt weights the map stores alike (all transposed, or none).",
    )
    hosts, tensors = host_factors(targets), {}
    for t in targets:
        a, b = (x[t.index + (k,)] for x in hosts[id(t.lora)])
        for factor, value in zip(("lora_A", "lora_B"), swap(t.lora, a, b)):
            name = f"{_PREFIX}{t.module}.{factor}.weight"
            tensors[name] = np.ascontiguousarray(value)
    config = {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        # What follows the layer number ("mlp.down_proj"): GPT-2's last names
        # alone ("c_proj") would adapt the attention's and the MLP's.
        "target_modules": sorted({re.split(r"\.\d+\.", t.module)[-1] for t in targets}),
        "task_type": task_type,
        "use_dora": False,
        "use_rslora": False,
    }
    os.makedirs(directory, exist_ok=True)
    weights = os.path.join(directory, WEIGHTS)
    save_safetensors(weights, tree_of(tensors))
    path = os.path.join(directory, CONFIG)
    _write_json(path, config)
    return [weights, path]
