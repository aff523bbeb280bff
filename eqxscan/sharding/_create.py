"""Building a model directly in its shards, so that no device (and no process) ever
holds a full copy."""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
from jax.sharding import Mesh

from ._shard import gather_layers, MIN_SIZE, model_shardings


_M = TypeVar("_M")


def create(
    make_model: Callable[..., _M],
    *args: Any,
    mesh: Mesh,
    fsdp_axis: str | None = "fsdp",
    min_size: int = MIN_SIZE,
    **kwargs: Any,
) -> _M:
    """Build `make_model(*args, **kwargs)` directly in its shards.

    One `jit` runs `make_model` with the layouts of
    [`eqxscan.sharding.model_shardings`][] (of the model's shapes, from
    `eqx.filter_eval_shape`) as its `out_shardings`: XLA partitions the
    initialisation, so each device computes and stores only its own shards and
    the full model never exists, on any device or process. The values equal
    those of `make_model(*args, **kwargs)` run eagerly (JAX's random numbers do
    not depend on sharding). With `fsdp_axis` set, every [`eqxscan.Stacked`][]
    gathers one layer per scan step, as after [`eqxscan.sharding.shard`][].

    **Arguments:**

    - `make_model`, `*args`, `**kwargs`: `make_model(*args, **kwargs)` builds the
      model; JAX arrays among the arguments (e.g. a key) are traced, the rest
      is static.
    - `mesh`: the `jax.sharding.Mesh` to build on, e.g. from
      [`eqxscan.sharding.make_mesh`][]; if it spans several processes, each
      calls `create` alike.
    - `fsdp_axis`, `min_size`: as for `model_shardings`.

    **Returns:**

    The model, its arrays placed on `mesh`.

    !!! example

        ```python
        import jax
        import eqxscan
        from eqxscan import sharding

        mesh = sharding.make_mesh()
        model = sharding.create(
            eqxscan.StackedMLP, 64, 4, key=jax.random.key(0), mesh=mesh, min_size=0
        )
        print(model.blocks.layers.w1.sharding.spec)  # P(None, None, 'fsdp')
        ```
    """
    lowered, dynamic, skeleton = _program(
        make_model, args, kwargs, mesh, fsdp_axis, min_size
    )
    model = eqx.combine(lowered.compile()(dynamic), skeleton)
    return gather_layers(model, mesh) if fsdp_axis is not None else model


def lower_create(
    make_model: Callable[..., object],
    *args: Any,
    mesh: Mesh,
    fsdp_axis: str | None = "fsdp",
    min_size: int = MIN_SIZE,
    **kwargs: Any,
) -> jax.stages.Lowered:
    """The program `create` runs, lowered: `.compile().memory_analysis()` shows
    the bytes each device holds while the model is built."""
    return _program(make_model, args, kwargs, mesh, fsdp_axis, min_size)[0]


def _program(
    make_model: Callable,
    args: tuple,
    kwargs: dict,
    mesh: Mesh,
    fsdp_axis: str | None,
    min_size: int,
) -> tuple[jax.stages.Lowered, Any, Any]:
    # Arrays among the arguments (keys) are traced, the rest is static.
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)

    def build(dynamic: Any) -> Any:
        args, kwargs = eqx.combine(dynamic, static)
        return eqx.filter(make_model(*args, **kwargs), eqx.is_array)

    shape = eqx.filter_eval_shape(make_model, *args, **kwargs)
    params, skeleton = eqx.partition(
        shape, lambda x: isinstance(x, jax.ShapeDtypeStruct)
    )
    shardings = model_shardings(params, mesh, fsdp_axis=fsdp_axis, min_size=min_size)
    lowered = jax.jit(build, out_shardings=shardings).lower(dynamic)
    return lowered, dynamic, skeleton
