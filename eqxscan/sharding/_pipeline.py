"""Pipeline parallelism over the layer axis of a `Stacked` (GPipe schedule).

Stage `s` of a mesh axis holds layers `[s*K, (s+1)*K)`; the batch is cut into
microbatches that flow from stage to stage with `jax.lax.ppermute` inside
`jax.shard_map`. Autodiff of that program is the backward pipeline.
"""

from typing import Any, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._checks import check_size
from .._constrain import constrain
from .._stacked import restack, Stacked
from ._shard import check_axis, check_mesh


def _split(stack: Stacked, stages: int) -> tuple[Any, Any]:
    # Array leaves [L, ...] -> [stages, L // stages, ...]: contiguous groups.
    dyn, static = eqx.partition(stack.layers, eqx.is_array)
    per = stack.num_layers // stages
    dyn = jtu.tree_map(lambda a: a.reshape(stages, per, *a.shape[1:]), dyn)
    return dyn, static


def pipeline(
    stack: Stacked,
    x: jax.Array,
    *,
    mesh: Mesh,
    microbatches: SupportsIndex,
    stage_axis: str = "stage",
) -> jax.Array:
    """Run `stack(x)` as a pipeline over the `stage_axis` of `mesh`.

    The `L` layers are split into `S` contiguous stages (`S` the size of
    `stage_axis`, which must divide `L`); stage `s` keeps only its own `L / S`
    layers and scans them. The batch (axis 0 of `x`) is cut into `microbatches`
    equal parts which enter stage 0 one per tick and move to the next stage with
    `ppermute`; after `microbatches + S - 1` ticks the last stage has every output.
    Gradients (`jax.grad` through this function) run the pipeline backwards. The
    result equals `stack(x)`; with `S` stages the idle fraction (the "bubble") is
    `(S - 1) / (microbatches + S - 1)`.

    **Arguments:**

    - `stack`: a `Stacked` of layers `layer(x) -> x` that accept a batch of
      inputs (e.g. `StackedMLP.blocks`). Layer arguments, keys and `per_layer`
      values are not supported here.
    - `x`: the input, batch on axis 0.
    - `mesh`: a mesh with an axis `stage_axis`; other axes are not used.
    - `microbatches`: how many parts to cut the batch into (must divide it).
    - `stage_axis`: the mesh axis of pipeline stages.

    **Returns:**

    `stack(x)`, computed stage by stage.
    """
    if not isinstance(stack, Stacked):
        raise TypeError(
            f"pipeline runs an eqxscan.Stacked, got {type(stack).__name__}; for a "
            "model, pass its Stacked (e.g. `model.blocks`)."
        )
    microbatches = check_size("microbatches", microbatches)
    stages = check_axis(check_mesh(mesh), stage_axis, "stage_axis")
    if stack.num_layers % stages:
        raise ValueError(
            f"Cannot split the {stack.num_layers} layers of a Stacked into "
            f"{stages} pipeline stages (mesh axis {stage_axis!r}): the number of "
            "layers must be a multiple of the number of stages."
        )
    if x.ndim == 0 or microbatches < 1 or x.shape[0] % microbatches:
        raise ValueError(
            f"Cannot cut a batch of shape {tuple(x.shape)} into {microbatches} "
            "microbatches: axis 0 must be a positive multiple of microbatches."
        )
    per_stage = stack.num_layers // stages
    dyn, static = _split(stack, stages)
    xs = x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])
    ticks = microbatches + stages - 1
    shift = [(s, s + 1) for s in range(stages - 1)]

    def stage_fn(dyn: Any, xs: jax.Array) -> jax.Array:
        # Runs on every stage at once (shard_map): `dyn` holds this stage's layers.
        # `in_specs` places this stage's layers; `layer_sharding`, a sharding of
        # the whole mesh, is not applied inside `shard_map`.
        local = restack(
            stack,
            layers=eqx.combine(jtu.tree_map(lambda a: a[0], dyn), static),
            num_layers=per_stage,
            layer_sharding=None,
        )
        stage = jax.lax.axis_index(stage_axis)
        vary = lambda a: jax.lax.pcast(a, (stage_axis,), to="varying")
        state = vary(jnp.zeros_like(xs[0]))
        outputs = vary(jnp.zeros_like(xs))

        def tick(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
            state, outputs = carry
            fresh = jax.lax.dynamic_index_in_dim(
                xs, jnp.minimum(t, microbatches - 1), keepdims=False
            )
            out = local(jnp.where(stage == 0, fresh, state))
            done = t - (stages - 1)  # the microbatch leaving the last stage
            written = jax.lax.dynamic_update_index_in_dim(
                outputs, out, jnp.maximum(done, 0), axis=0
            )
            outputs = jnp.where((stage == stages - 1) & (done >= 0), written, outputs)
            state = jax.lax.ppermute(out, stage_axis, shift)
            return (state, outputs), None

        (_, outputs), _ = jax.lax.scan(tick, (state, outputs), jnp.arange(ticks))
        return outputs[None]

    layer_spec = PartitionSpec(stage_axis)
    # Each stage's layers on its devices, the microbatches everywhere.
    dyn = constrain(dyn, NamedSharding(mesh, layer_spec))
    xs = constrain(xs, NamedSharding(mesh, PartitionSpec()))
    out = jax.shard_map(
        stage_fn,
        mesh=mesh,
        in_specs=(jtu.tree_map(lambda _: layer_spec, dyn), PartitionSpec()),
        out_specs=PartitionSpec(stage_axis),
        axis_names={stage_axis},
    )(dyn, xs)
    # Only the last stage's buffer holds outputs.
    out = constrain(out, NamedSharding(mesh, PartitionSpec()))
    return out[stages - 1].reshape(x.shape)
