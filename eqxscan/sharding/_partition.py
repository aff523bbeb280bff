"""Tensor parallelism: per-parameter partition specs from logical axis names
(`("embed", "mlp")`) and rules mapping each to a mesh axis, as Flax's
`logical_to_mesh_axes` and MaxText's logical axis rules do."""

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._internal import check_mesh, is_arraylike, is_none, Site, walk
from ._shard import fsdp_shardings, MIN_SIZE


#: The logical names of one layer's axes: a name, or `None` for a replicated axis.
Names: TypeAlias = tuple[str | None, ...]
#: Logical name -> mesh axis (or several, or `None` to replicate); a mapping or a
#: sequence of pairs, as in Flax and MaxText.
Rules: TypeAlias = Mapping[str, str | Sequence[str] | None] | Sequence[tuple]
#: Where the names come from: `{glob pattern on the parameter path: names}` (first
#: match wins) or a function `(path, leaf) -> names | None`.
Axes: TypeAlias = Mapping[str, Names] | Callable[[str, Any], Names | None]


def _rules(rules: Any) -> dict[str, tuple[str, ...]]:
    pairs = rules.items() if isinstance(rules, Mapping) else rules
    out: dict[str, tuple[str, ...]] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(
                "rules must map logical names to mesh axes: a dict or a sequence of "
                f"(name, mesh_axis) pairs, got the entry {pair!r}."
            )
        name, axes = pair
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        out.setdefault(name, tuple(axes))  # the first rule for a name wins
    return out


def logical_spec(
    names: Sequence[str | None], rules: Rules, mesh: Mesh | None = None
) -> PartitionSpec:
    """The `PartitionSpec` for axes with logical `names` under `rules`.

    **Arguments:**

    - `names`: one logical name (or `None`, replicated) per array axis.
    - `rules`: logical name -> mesh axis name, a tuple of them, or `None`
      (replicated); a dict or a sequence of `(name, axis)` pairs.
    - `mesh`: if given, every mesh axis the rules pick must be one of its axes.

    **Returns:**

    A `jax.sharding.PartitionSpec` with one entry per name.

    **Raises:**

    `ValueError` for a name without a rule, a mesh axis the mesh lacks, or a mesh
    axis used for two array axes.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P
        from eqxscan import sharding

        rules = {"embed": "fsdp", "mlp": "model", "vocab": None}
        assert sharding.logical_spec(("embed", "mlp"), rules) == P("fsdp", "model")
        assert sharding.logical_spec(("vocab", None), rules) == P(None, None)
        ```
    """
    table = _rules(rules)
    entries: list[Any] = []
    used: dict[str, str | None] = {}
    for name in names:
        if name is not None and name not in table:
            raise ValueError(
                f"The logical axis name {name!r} has no rule; the rules name "
                f"{sorted(table)}. Add a rule for it (mapping it to None "
                "replicates that axis)."
            )
        axes = () if name is None else table[name]
        for axis in axes:
            if mesh is not None and axis not in mesh.shape:
                raise ValueError(
                    f"The rule for {name!r} picks mesh axis {axis!r}, but the mesh "
                    f"has axes {tuple(mesh.axis_names)}. Map {name!r} to one of "
                    "them, or to None."
                )
            if axis in used:
                raise ValueError(
                    f"Mesh axis {axis!r} would shard two axes of one array (logical "
                    f"names {used[axis]!r} and {name!r} in {tuple(names)}); an array "
                    "can use a mesh axis once. Map one of them to None."
                )
            used[axis] = name
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def _matches(path: str, pattern: str) -> bool:
    # Brackets match themselves too, so that a path as printed (with list
    # indices, `groups[1].w`) is a pattern of itself, not an fnmatch class.
    literal = pattern.replace("[", "[[]")
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, literal)


def _lookup(axes: Axes, path: str, leaf: Any) -> Names | None:
    if callable(axes):
        return axes(path, leaf)
    return next((names for p, names in axes.items() if _matches(path, p)), None)


def logical_shardings(
    model: Any,
    mesh: Mesh,
    axes: Axes,
    rules: Rules,
    *,
    fsdp_axis: str | None = None,
    min_size: int = MIN_SIZE,
) -> Any:
    """The `NamedSharding` of every array leaf of `model`, from logical axis names.

    A parameter whose path matches `axes` is sharded by its names under `rules`
    (e.g. `"mlp"` over a `"model"` mesh axis next to `"embed"` over `"fsdp"`).
    The names describe one layer: inside a [`eqxscan.Stacked`][] the layer axis
    is added, unsharded. Parameters that match nothing get the FSDP rule of
    [`eqxscan.sharding.model_shardings`][] over `fsdp_axis` (replicated when it
    is `None`, the default). Pass the result to
    [`eqxscan.sharding.constrain`][], to
    [`eqxscan.sharding.opt_state_shardings`][] as `param_shardings`, and to
    [`eqxscan.sharding.gather_layers`][] with the model axis in its `keep`.

    **Arguments:**

    - `model`: any pytree, usually an `eqx.Module` containing `Stacked`s.
    - `mesh`: a `jax.sharding.Mesh`, e.g. with axes `("fsdp", "model")`.
    - `axes`: the logical names of each parameter's axes (of one layer):
      `{pattern: names}`, glob patterns on the parameter path without the
      leading dot (`"blocks.layers.w1"`, `"*.w1"`, `"*.layers[0].weight"`:
      brackets also match themselves; the first match wins), or a
      function `(path, leaf) -> names or None`.
    - `rules`: logical name -> mesh axis, as for [`eqxscan.sharding.logical_spec`][].
    - `fsdp_axis`, `min_size`: the rule for parameters without names.

    **Returns:**

    A pytree with the structure of `model`: a `NamedSharding` at each array leaf,
    `None` elsewhere; static fields included, as for `model_shardings` (after
    `gather_layers` or `shard`, JAX's own functions need it computed again;
    `constrain` takes it as it is).

    **Raises:**

    `ValueError` naming the parameter path and shape when its names do not
    match its number of axes, or a mesh axis does not divide the axis it shards;
    naming the pattern when a pattern of `axes` matches no parameter.

    !!! example

        ```python
        import jax
        from jax.sharding import AxisType, PartitionSpec as P
        import eqxscan
        from eqxscan import sharding

        mesh = jax.make_mesh((1, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
        model = eqxscan.StackedMLP(16, 3, key=jax.random.key(0))
        axes = {"*.w1": ("embed", "mlp"), "*.w2": ("mlp", "embed")}
        specs = sharding.logical_shardings(
            model, mesh, axes, {"embed": "fsdp", "mlp": "model"}
        )
        assert specs.blocks.layers.w1.spec == P(None, "fsdp", "model")
        assert specs.blocks.layers.w2.spec == P(None, "model", "fsdp")
        assert specs.blocks.layers.scale.spec == P()  # no names: replicated
        ```
    """
    mesh = check_mesh(mesh)
    if not (callable(axes) or isinstance(axes, Mapping)):
        raise TypeError(
            "axes must be a dict {path pattern: logical names} or a function "
            f"(path, leaf) -> names, got {type(axes).__name__}."
        )
    # The default sharding of each array, by key path (the walk skips `None`
    # fields, which `model_shardings` keeps as leaves). A named array's default
    # is not used, so no axis of it need divide the FSDP axis.
    named = lambda path, leaf: _lookup(axes, jtu.keystr(path).lstrip("."), leaf)
    lenient = lambda path, leaf: named(path, leaf) is not None
    fsdp = fsdp_shardings(model, mesh, fsdp_axis, min_size, lenient)
    found = jtu.tree_leaves_with_path(fsdp, is_leaf=is_none)
    default = {jtu.keystr(path): sharding for path, sharding in found}

    def one(leaf: Any, site: Site) -> NamedSharding | None:
        if not is_arraylike(leaf):
            return None
        names = named(site.path, leaf)
        if names is None:
            return default[jtu.keystr(site.path)]
        name = jtu.keystr(site.path).lstrip(".")
        return _named(leaf, site.depth, name, tuple(names), rules, mesh)

    if isinstance(axes, Mapping):
        _check_patterns(
            axes, [k.lstrip(".") for k, s in default.items() if s is not None]
        )
    return walk(one, model)


def _check_patterns(axes: Mapping[str, Names], paths: list[str]) -> None:
    """Every pattern of `axes` matches a parameter: one that matches none (a
    typo, a weight replaced by a `Quantized` or `LoRA`) would shard nothing."""
    for pattern, names in axes.items():
        if not any(_matches(p, pattern) for p in paths):
            shown = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
            raise ValueError(
                f"The axes pattern {pattern!r} (names {tuple(names)}) matches no "
                f"parameter; the parameters are {shown}.\nHint: a pattern matches "
                "a whole path (fnmatch); a Quantized weight's arrays are "
                "'<weight>.values' and '<weight>.scales', a LoRA's "
                "'<weight>.base', '<weight>.a' and '<weight>.b'."
            )


def _named(
    leaf: Any, layer_axes: int, name: str, names: Names, rules: Rules, mesh: Mesh
) -> NamedSharding:
    """The sharding of `leaf` (at `name`) whose axes after its `layer_axes` have
    the logical `names`."""
    shape = tuple(leaf.shape)
    if len(names) + layer_axes != len(shape):
        layers = f" after its {layer_axes} layer axis(es)" if layer_axes else ""
        raise ValueError(
            f"`{name}` has shape {shape}, so it needs {len(shape) - layer_axes} "
            f"logical names{layers}, but got {names}. Name the axes of one "
            "layer; the layer axis of a Stacked is added for you."
        )
    spec = logical_spec(names, rules, mesh)
    for dim, entry, axis_name in zip(shape[layer_axes:], spec, names):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        size = math.prod(mesh.shape[a] for a in axes)
        if dim % size:
            raise ValueError(
                f"Cannot shard `{name}` with shape {shape}: its axis "
                f"{axis_name!r} has size {dim}, which mesh axis {entry!r} of "
                f"size {size} does not divide. Change the rule for "
                f"{axis_name!r} or the mesh."
            )
    return NamedSharding(mesh, PartitionSpec(*([None] * layer_axes), *spec))
