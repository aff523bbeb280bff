"""Placing trees and batches on a mesh that may span several processes: each
process's data turned into global `jax.Array`s, JAX doing the communication."""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import Mesh

from .._internal import (
    align,
    constrain,
    Device,
    docs,
    is_arraylike,
    is_none,
    narrowed,
)


def default_devices() -> list[Device]:
    """Every device of every process, ordered by process then id (on one process:
    `jax.devices()` as it is). A mesh filled in this order puts its first axis
    across processes and keeps runs of its last axis inside one."""
    devices = jax.devices()
    if jax.process_count() == 1:
        return list(devices)
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def _is_traced(tree: Any) -> bool:
    return any(isinstance(x, Tracer) for x in jtu.tree_leaves(tree))


def place(tree: Any, shardings: Any, mesh: Mesh) -> Any:
    """Place `tree`, which every process holds in full, on `shardings`: with
    `constrain` inside `jit` or for arrays global already; else with
    `jax.device_put` (which also moves arrays committed to other devices), each
    process keeping only its own shards. A NumPy integer past int32's range
    stays as it is without `jax_enable_x64`: a device would wrap it."""
    if _is_traced(tree):
        return constrain(tree, shardings)
    put = lambda x, s: x if narrowed(x) else jax.device_put(x, s)  # noqa: E731
    return _assemble(tree, shardings, put)


def _assemble(tree: Any, shardings: Any, put: Callable[[Any, Any], Any]) -> Any:
    # `put(x, sharding)` for local arrays; global ones are resharded by `jit`.
    def one(sharding: Any, x: Any) -> Any:
        if not eqx.is_array(x) or sharding is None:
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return constrain(x, sharding)
        return put(x, sharding)

    return jtu.tree_map(one, align(shardings, tree), tree, is_leaf=is_none)


def place_batch(batch: Any, mesh: Mesh, shardings_for: Callable[[Any], Any]) -> Any:
    """Place `batch` with `shardings_for(batch)`; on a mesh spanning several
    processes `batch` holds this process's rows only, assembled into global
    arrays (`jax.make_array_from_process_local_data`), else this is `constrain`."""
    if _is_traced(batch):
        return constrain(batch, shardings_for(batch))
    if not mesh.is_multi_process:
        return _assemble(batch, shardings_for(batch), jax.device_put)
    # The batch's split, from a stand-in every batch split divides: its row
    # blocks in all, and those this process's devices hold.
    probe = jax.ShapeDtypeStruct((mesh.devices.size,), jax.numpy.float32)
    (sharding,) = jtu.tree_leaves(shardings_for([probe]))
    spec = sharding.spec[0] if len(sharding.spec) else None
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    total = math.prod(mesh.shape[a] for a in axes)
    indices = sharding.addressable_devices_indices_map((total,)).values()
    here = len({i[0].start for i in indices if i is not None})

    def global_like(path: tuple, x: Any) -> Any:
        if not is_arraylike(x):
            return x
        if x.ndim == 0 or x.shape[0] % here:
            raise ValueError(
                f"`batch{jtu.keystr(path)}` has shape {tuple(x.shape)} on process "
                f"{jax.process_index()}, whose devices hold {here} of the "
                f"batch's {total} blocks.\nHint: give each process a multiple "
                f"of {here} rows, its own rows rather than the global batch; see "
                f"{docs('multihost.md')}."
            )
        rows = x.shape[0] // here * total
        return jax.ShapeDtypeStruct((rows,) + tuple(x.shape[1:]), x.dtype)

    shardings = shardings_for(jtu.tree_map_with_path(global_like, batch))
    return _assemble(
        batch, shardings, lambda x, s: jax.make_array_from_process_local_data(s, x)
    )
