"""Data-parallel and FSDP placement of models with stacked layers: this only
chooses `NamedSharding`s; JAX (`jit`, XLA's partitioner) does all communication."""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import PyTree

from .._internal import (
    align,
    check_mesh,
    check_size,
    is_arraylike,
    is_placeholder,
    restack,
    Site,
    walk,
)
from ._opt_buffers import at, leaves, map_buffers, roots, set_layer_sharding
from ._place import default_devices, Device, place, place_batch
from ._quantized import follow_float_weights


T = TypeVar("T")
LayerShardingFn = Callable[[Site, PyTree], Sharding | PyTree[Sharding | None] | None]


#: Leaves with fewer elements than this are replicated by default: sharding them
#: saves next to no memory and costs a collective each.
MIN_SIZE = 2**14


def make_mesh(
    data: SupportsIndex | None = None,
    fsdp: SupportsIndex | None = None,
    *,
    devices: Sequence[Device] | None = None,
) -> Mesh:
    """A `("data", "fsdp")` mesh over `devices` (default: every device of every
    process, ordered by process).

    The one of `data` and `fsdp` left out takes the remaining devices; with
    neither, all go to `"fsdp"`. The axes are `AxisType.Auto`, so model code
    needs no sharding annotations. With several processes, `"data"` runs across
    processes first and each process's devices form whole `"fsdp"` groups where
    the sizes allow: FSDP's all-gathers stay inside a host.

    **Arguments:**

    - `data`: number of data-parallel replicas.
    - `fsdp`: number of devices each parameter is sharded over.
    - `devices`: the devices, in mesh order.

    **Returns:**

    A `jax.sharding.Mesh` with axes `("data", "fsdp")`.
    """
    devices = default_devices() if devices is None else list(devices)
    n = len(devices)
    repeated = [d for i, d in enumerate(devices) if d in devices[:i]]
    if not n or repeated:
        got = f"device {repeated[0]} more than once" if repeated else "no devices"
        raise ValueError(
            f"make_mesh got {got} in devices; a mesh holds each device once.\n"
            "Hint: pass distinct devices, e.g. jax.devices()[:4], or devices=None "
            "for every device."
        )
    rows, shards = _mesh_size("data", data), _mesh_size("fsdp", fsdp)
    if rows is None and shards is None:
        rows = 1
    if rows is None or shards is None:
        # The axis given takes a divisor of the devices, the other the rest.
        name, given = ("data", rows) if shards is None else ("fsdp", shards)
        assert given is not None
        if n % given:
            raise ValueError(
                f"{name}={given} does not divide the {n} devices, so the other mesh "
                f"axis cannot take the rest; choose a divisor of {n}."
            )
        rows, shards = (given, n // given) if shards is None else (n // given, given)
    if rows * shards != n:
        raise ValueError(
            f"A mesh of data={rows} x fsdp={shards} needs {rows * shards} devices, "
            f"but {n} are given; choose sizes whose product is {n}."
        )
    return jax.make_mesh(
        (rows, shards),
        ("data", "fsdp"),
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices,
    )


def _mesh_size(name: str, value: object) -> int | None:
    try:
        return None if value is None else check_size(name, value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be a positive int or None, got {value!r}."
        ) from None


def check_axes(mesh: Mesh, axes: str | Sequence[str], what: str) -> tuple[str, ...]:
    """`axes` (one name or several) as a tuple of axes of `mesh`."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    for axis in axes:
        if axis not in mesh.shape:
            replicate = "; fsdp_axis=None replicates the parameters"
            raise ValueError(
                f"{what} names mesh axis {axis!r}, but the mesh has axes "
                f"{tuple(mesh.axis_names)} (sizes {dict(mesh.shape)})"
                + (replicate if what == "fsdp_axis" else "")
                + f".\nHint: build the mesh with an axis {axis!r}, e.g. "
                f"jax.make_mesh((4, 2), ({axis!r}, 'data')), or pass the name of "
                "one it has."
            )
    return axes


def _leaf_spec(
    leaf: Any,
    layer_axes: int,
    path: str,
    mesh: Mesh,
    fsdp_axis: str | None,
    min_size: int,
    strict: bool = True,
) -> PartitionSpec:
    """The rule of `model_shardings`; with no divisible axis, raise if `strict`,
    else replicate."""
    shape = tuple(leaf.shape)
    # A scalar, or one per layer (a LoRA's `active`), has no axis to shard.
    if fsdp_axis is None or math.prod(shape) < min_size or len(shape) <= layer_axes:
        return PartitionSpec()
    size = mesh.shape[fsdp_axis]
    candidates = [i for i in range(layer_axes, len(shape)) if shape[i] % size == 0]
    if not candidates and not strict:
        return PartitionSpec()
    if not candidates:
        layer_note = ""
        if layer_axes:
            layer_note = (
                " (axis 0 is the layer axis of a Stacked"
                if layer_axes == 1
                else f" (axes 0-{layer_axes - 1} are layer axes of nested Stackeds"
            ) + ", never sharded because each scan step reads one layer)"
        sizes = shape[layer_axes:]
        raise ValueError(
            f"Cannot shard `{path}` with shape {shape}{layer_note} over mesh axis "
            f"{fsdp_axis!r} of size {size}: none of its axes {sizes} divides by "
            f"{size}. Use a mesh whose {fsdp_axis!r} size divides one of {sizes}, "
            f"or pass min_size > {math.prod(shape)} to replicate leaves this small."
        )
    best = max(candidates, key=lambda i: (shape[i], -i))
    return PartitionSpec(*([None] * best + [fsdp_axis]))


def model_shardings(
    model: Any,
    mesh: Mesh,
    *,
    fsdp_axis: str | None = "fsdp",
    min_size: int = MIN_SIZE,
) -> Any:
    """The `NamedSharding` of every array leaf of `model` (FSDP over `fsdp_axis`).

    Inside a [`eqxscan.Stacked`][] the leading layer axis is never sharded: each
    scan step reads one layer, and `scan` needs its `xs` unsharded along it. Of
    the other axes, the largest that divides by the size of `fsdp_axis` is
    sharded over it (the first on ties). Leaves with fewer than `min_size`
    elements, and those with no axis but layer axes (a scalar, or one per
    layer), are replicated, and every leaf is replicated across the other mesh
    axes (e.g. `"data"`). A [`eqxscan.quant.Quantized`][] weight is sharded as
    the float weight it stands for: its `values` and `scales` along that
    weight's sharded axis where their own axis divides (else replicated, as
    int8's `[1, out]` scales of a weight sharded along its inputs).

    **Arguments:**

    - `model`: any pytree (usually an `eqx.Module` containing `Stacked`s).
    - `mesh`: a `jax.sharding.Mesh`.
    - `fsdp_axis`: the mesh axis to shard over; `None` replicates everything.
    - `min_size`: leaves with fewer elements are replicated.

    **Returns:**

    A pytree with the structure of `model`: a `NamedSharding` at each array leaf,
    `None` elsewhere; `jax.jit`'s `in_shardings`/`out_shardings` for
    `eqx.filter(model, eqx.is_array)`. Its structure includes static fields,
    such as the `layer_sharding` that [`eqxscan.sharding.shard`][] and
    `gather_layers` set: JAX's own functions (`jax.device_put`, `jit`'s
    shardings, `eqx.filter_shard`, `jax.tree.map`) refuse it for the model after
    them (a pytree structure error at the `Stacked`); compute it from the
    model they get, or place with `sharding.constrain`, which matches by key path.

    **Raises:**

    `ValueError` naming the leaf path, its shape and the mesh axis size when a
    leaf of at least `min_size` elements has no axis that divides, or when the
    mesh lacks `fsdp_axis`.
    """
    return fsdp_shardings(model, mesh, fsdp_axis, min_size)


def fsdp_shardings(
    model: Any,
    mesh: Mesh,
    fsdp_axis: str | None,
    min_size: int,
    lenient: Callable[[tuple, Any], bool] = lambda path, leaf: False,
) -> Any:
    """`model_shardings`, replicating rather than refusing the leaves with no axis
    that divides where `lenient(path, leaf)` (those given a sharding elsewhere)."""
    mesh = check_mesh(mesh)
    check_axes(mesh, () if fsdp_axis is None else fsdp_axis, "fsdp_axis")
    min_size = check_size("model_shardings: min_size", min_size, minimum=0)

    def spec_of(leaf: Any, depth: int, path: tuple) -> PartitionSpec:
        name, strict = "model" + jtu.keystr(path), not lenient(path, leaf)
        return _leaf_spec(leaf, depth, name, mesh, fsdp_axis, min_size, strict)

    def one(leaf: object, site: Site) -> NamedSharding | None:
        if not is_arraylike(leaf):
            return None
        if tuple(leaf.shape[: site.depth]) != site.axes:
            # A batch of stacks: its batch axis would be read as the layers'.
            raise ValueError(
                f"model_shardings: `model{jtu.keystr(site.path)}` has shape "
                f"{tuple(leaf.shape)}, but the Stacked holding it has layer axes "
                f"{site.axes}, which should lead its shape.\nHint: a batch of "
                "stacks (an ensemble built with eqx.filter_vmap) is not placed by "
                "model_shardings: give its arrays shardings of your own."
            )
        return NamedSharding(mesh, spec_of(leaf, site.depth, site.path))

    return follow_float_weights(model, walk(one, model), mesh, spec_of)


def opt_state_shardings(
    opt_state: Any,
    model: Any,
    mesh: Mesh,
    *,
    fsdp_axis: str | None = "fsdp",
    min_size: int = MIN_SIZE,
    param_shardings: Any = None,
) -> Any:
    """Shardings for an optimizer state (e.g. optax's) that shard each per-parameter
    buffer like its parameter.

    A subtree of `opt_state` with the structure of the parameters
    (`eqx.filter(model, eqx.is_array)`, `None` or optax's `MaskedNode` where there
    is no parameter) is a per-parameter buffer, e.g. Adam's `mu`: a leaf there of
    its parameter's shape gets the parameter's sharding, one of another shape
    (a factored second moment) the rule of [`eqxscan.sharding.model_shardings`][]
    (replicated, not an error, if no axis divides). Everything else (step counts,
    scalar hyperparameters) is replicated.

    **Arguments:**

    - `opt_state`: the optimizer state, any pytree.
    - `model`: the model whose parameters the state was built for.
    - `mesh`, `fsdp_axis`, `min_size`: as for `model_shardings`.
    - `param_shardings`: the parameters' shardings if not `model_shardings`'
      (e.g. `logical_shardings`'), matched to them by key path.

    **Returns:**

    A pytree with the structure of `opt_state`: a `NamedSharding` at each array
    leaf, `None` elsewhere.
    """
    mesh = check_mesh(mesh)
    check_axes(mesh, () if fsdp_axis is None else fsdp_axis, "fsdp_axis")
    min_size = check_size("opt_state_shardings: min_size", min_size, minimum=0)
    params = eqx.filter(model, is_arraylike)
    if param_shardings is None:
        param_shardings = model_shardings(
            params, mesh, fsdp_axis=fsdp_axis, min_size=min_size
        )
    else:  # by key path, as `constrain` matches them, never by position
        param_shardings = align(param_shardings, params)
    # Each parameter (or `None`) with its sharding and number of layer axes.
    depths = walk(lambda x, s: s.depth, params)
    trees = (params, param_shardings, depths)
    per_param = {
        key: list(zip(*(leaves(at(t, key)) for t in trees))) for key, _ in roots(params)
    }

    def buffer(path: tuple, leaf: Any, param: Any, sharding: Any, depth: Any) -> Any:
        if not is_arraylike(leaf):
            return None
        if not is_arraylike(param):
            depth = 0
        elif leaf.shape == param.shape:
            return sharding
        name = "opt_state" + jtu.keystr(path)
        spec = _leaf_spec(leaf, depth, name, mesh, fsdp_axis, min_size, strict=False)
        return NamedSharding(mesh, spec)

    def one(path: tuple, x: Any, root: tuple) -> Any:
        leaves = jtu.tree_leaves_with_path(x, is_leaf=is_placeholder)
        out = [
            buffer(path + p, leaf, *info)
            for (p, leaf), info in zip(leaves, per_param[root])
        ]
        return jtu.tree_unflatten(jtu.tree_structure(x, is_leaf=is_placeholder), out)

    replicated = NamedSharding(mesh, PartitionSpec())
    other = lambda x: replicated if is_arraylike(x) else None
    return map_buffers(one, other, opt_state, params)


def batch_shardings(
    batch: Any,
    mesh: Mesh,
    *,
    batch_axes: str | Sequence[str] | None = None,
    fsdp_axis: str | None = "fsdp",
) -> Any:
    """Shardings that split every array leaf of `batch` along axis 0 over the
    batch axes of `mesh`: by default `"data"` and `fsdp_axis`, whichever the mesh
    has (FSDP is data parallelism: every device gets its own examples).

    **Arguments:**

    - `batch`: a pytree whose array leaves have the batch on axis 0.
    - `mesh`: a `jax.sharding.Mesh`.
    - `batch_axes`: mesh axis name(s) to split the batch over, or `None`.
    - `fsdp_axis`: as for `model_shardings` (only used by the default).

    **Returns:**

    A pytree with the structure of `batch`: a `NamedSharding` at each array leaf,
    `None` elsewhere.

    **Raises:**

    `ValueError` naming the leaf path, its batch size and the mesh axes' total
    size when the batch does not divide, or a missing mesh axis.
    """
    mesh = check_mesh(mesh)
    if batch_axes is not None:
        axes = check_axes(mesh, batch_axes, "batch_axes")
    else:
        names = ("data",) + (() if fsdp_axis is None else (fsdp_axis,))
        axes = tuple(a for a in names if a in mesh.shape)
        if not axes:
            raise ValueError(
                f"The batch is sharded over the mesh axes {names} by default, but the "
                f"mesh has axes {tuple(mesh.axis_names)}; pass batch_axes=... naming "
                "the axes to split the batch over."
            )
    size = math.prod(mesh.shape[a] for a in axes)
    spec = PartitionSpec(axes[0] if len(axes) == 1 else axes)

    def one(path: tuple, leaf: Any) -> Any:
        if not is_arraylike(leaf):
            return None
        if leaf.ndim == 0 or leaf.shape[0] % size:
            got = "a scalar" if leaf.ndim == 0 else f"batch size {leaf.shape[0]}"
            raise ValueError(
                f"Cannot shard `batch{jtu.keystr(path)}` with shape "
                f"{tuple(leaf.shape)} over mesh axes {axes} (total size {size}, "
                f"{dict((a, mesh.shape[a]) for a in axes)}): it has {got}, and "
                f"axis 0 must be a multiple of {size}."
            )
        return NamedSharding(mesh, spec)

    return jtu.tree_map_with_path(one, batch)


def gather_layers(
    model: Any,
    mesh: Mesh,
    shardings: Any = None,
    *,
    keep: str | Sequence[str] = (),
) -> Any:
    """`model` with every [`eqxscan.Stacked`][] set to gather the one layer each scan
    step runs (its `layer_sharding`): FSDP's per-layer all-gather inside the loop,
    rather than XLA gathering activations instead. By default each step gathers
    its layer whole (replicated on `mesh`); with tensor parallelism, `keep` names
    the mesh axes that stay split, as the weights are placed.

    **Arguments:**

    - `model`: any pytree, usually an `eqx.Module` containing (nested) `Stacked`s.
    - `mesh`: the `jax.sharding.Mesh` the model is placed on.
    - `shardings`: with `keep`, the `NamedSharding`s of `model`'s arrays, a
      pytree of its structure (e.g. from [`eqxscan.sharding.logical_shardings`][]);
      by default read from the arrays, which must be placed on `mesh` already.
    - `keep`: mesh axes that a layer keeps split while it runs (e.g. `"model"`).

    **Returns:**

    `model` with the same arrays and `layer_sharding` set on every `Stacked`: one
    replicated `NamedSharding`, or with `keep`, a sharding per array of one layer.

    **Raises:**

    `ValueError` naming the mesh axis `keep` lists that `mesh` lacks, or the leaf
    path of an array that is not placed on `mesh`.
    """
    mesh = check_mesh(mesh)
    keep = check_axes(mesh, keep, "keep")
    if not keep:
        replicated = NamedSharding(mesh, PartitionSpec())
        return set_layer_sharding(model, lambda site, layers: replicated)
    given = None
    if shardings is not None:
        aligned = align(shardings, eqx.filter(model, eqx.is_array))
        given = dict(jtu.tree_leaves_with_path(aligned))

    def placed(path: tuple, leaf: Any) -> NamedSharding:
        sharding = getattr(leaf, "sharding", None) if given is None else given.get(path)
        if not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
            if given is not None:
                found = f"`shardings` has {sharding!r} there"
            elif isinstance(leaf, Tracer):
                found = "it is traced, and inside jit its placement is not known"
            else:
                found = f"it is placed on {sharding!r}"
            raise ValueError(
                f"gather_layers(keep={keep}) needs `model{jtu.keystr(path)}`'s "
                f"NamedSharding on this mesh, but {found}.\nHint: pass "
                "shardings=, e.g. from sharding.logical_shardings, or place the "
                "model first (sharding.constrain)."
            )
        return sharding

    def per_step(path: tuple, leaf: Any, depth: int) -> NamedSharding:
        # The leaf's spec without its `depth` layer axes, keeping only `keep`.
        kept = [
            tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n in keep)
            for e in list(placed(path, leaf).spec)[depth:]
        ]
        spec = PartitionSpec(*(k[0] if len(k) == 1 else (k or None) for k in kept))
        return NamedSharding(mesh, spec)

    def per_array(site: Site, layers: PyTree) -> PyTree[NamedSharding]:
        arrays = eqx.filter(layers, eqx.is_array)
        return jtu.tree_map_with_path(
            lambda p, a: per_step(site.path + p, a, site.depth), arrays
        )

    return set_layer_sharding(model, per_array)


def shard(
    model: Any,
    opt_state: Any = None,
    batch: Any = None,
    *,
    mesh: Mesh,
    fsdp_axis: str | None = "fsdp",
    batch_axes: str | Sequence[str] | None = None,
    min_size: int = MIN_SIZE,
) -> tuple[Any, Any, Any]:
    """Place a model, its optimizer state and a batch on `mesh` in one call.

    Parameters get [`eqxscan.sharding.model_shardings`][], the optimizer state
    [`eqxscan.sharding.opt_state_shardings`][] and the batch
    [`eqxscan.sharding.batch_shardings`][]. With `fsdp_axis` set, every `Stacked`
    gathers one layer per scan step ([`eqxscan.sharding.gather_layers`][]), and
    the buffers of `opt_state` get the matching structure, so `optimizer.update`
    accepts the new model's gradients. Outside `jit` this moves the arrays
    (`jax.device_put`); inside `jit` it constrains them
    (`jax.lax.with_sharding_constraint`), pinning the layout of the updated
    model and state at the end of a training step. Shardings of `model` computed
    before fit the returned one only through `sharding.constrain` (its stacks'
    static `layer_sharding` changed): for `jit` or `jax.device_put`, compute
    them from the returned model.

    On a mesh spanning several processes, `batch` holds this process's rows only
    (see [`eqxscan.distributed.local_rows`][]) and comes back as global arrays;
    `model` and `opt_state` are the same on every process or global arrays
    already (e.g. from [`eqxscan.sharding.create`][]). A global batch that every
    process passes whole cannot be told from local rows (that would take a
    collective per call): it is taken as each process's own, and the result
    holds one copy of it per process (on `make_mesh`'s meshes), without an
    error. Pass `x[distributed.local_rows(len(x), mesh)]` instead. Processes
    whose devices hold the same rows (batch axes that do not span them) must
    pass the same rows: that is not checked either. A NumPy integer of `model` or
    `opt_state` past int32's range stays NumPy without `jax_enable_x64` (a
    device would hold it in 32 bits, wrapped).

    **Arguments:**

    - `model`: any pytree, usually an `eqx.Module` containing `Stacked`s.
    - `opt_state`: the optimizer state for `model`'s parameters, or `None`.
    - `batch`: the batch on axis 0 of every array leaf, or `None`.
    - `mesh`: a `jax.sharding.Mesh`, e.g. from [`eqxscan.sharding.make_mesh`][].
    - `fsdp_axis`, `min_size`, `batch_axes`: as for `model_shardings` and
      `batch_shardings`.

    **Returns:**

    `(model, opt_state, batch)`, placed (`None` stays `None`).

    **Raises:**

    `ValueError` naming the leaf path, its shape and the mesh axis size when an
    axis does not divide, or the missing mesh axis.
    """
    shardings = model_shardings(model, mesh, fsdp_axis=fsdp_axis, min_size=min_size)
    if batch is not None:
        for_batch = functools.partial(
            batch_shardings, mesh=mesh, batch_axes=batch_axes, fsdp_axis=fsdp_axis
        )
        batch = place_batch(batch, mesh, for_batch)
    new = place(model, shardings, mesh)
    if fsdp_axis is not None:
        new = gather_layers(new, mesh)
    else:  # a layer sharding of another mesh would gather onto its devices
        elsewhere = lambda s: any(  # noqa: E731
            isinstance(x, NamedSharding) and x.mesh != mesh
            for x in jtu.tree_leaves(s.layer_sharding)
        )
        off = lambda s, _: restack(s, layer_sharding=None) if elsewhere(s) else s  # noqa: E731
        new = walk(lambda leaf, _: leaf, new, stack=off)
    if opt_state is not None:
        opt_sh = opt_state_shardings(
            opt_state, model, mesh, fsdp_axis=fsdp_axis, min_size=min_size
        )
        placed = place(opt_state, opt_sh, mesh)
        # Its buffers get the (static) structure of `new`'s arrays.
        arrays = {
            k: jtu.tree_structure(eqx.filter(r, eqx.is_array), is_leaf=is_placeholder)
            for k, r in roots(new)
        }
        regroup = lambda _, x, root: jtu.tree_unflatten(arrays[root], leaves(x))
        opt_state = map_buffers(regroup, lambda x: x, placed, model)
    return new, opt_state, batch
