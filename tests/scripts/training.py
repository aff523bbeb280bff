"""The training step the sharding tests compare across meshes and processes: one
definition, used in the test process and in the scripts it starts."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from eqxscan import sharding


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


# One jitted function per (optimizer, mesh, axis): callers that ask again reuse
# its compiled programs instead of tracing and compiling the same step anew.
@functools.cache
def make_train_step(optimizer, mesh: Mesh | None, fsdp_axis: str | None = "fsdp"):
    """A jitted `(model, opt_state, x, y) -> (model, opt_state, loss, grads)`.

    With a mesh, the updated model and state keep their layout (`shard` inside
    `jit`), and the gradients are pinned to the parameters' layout, so the program
    reduces them into shards rather than keeping a replicated copy."""

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        # optax's Adam mixes Python floats and int32 step counts.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(
                grads, opt_state, eqx.filter(model, eqx.is_array)
            )
        model = eqx.apply_updates(model, updates)
        if mesh is not None:
            model, opt_state, _ = sharding.shard(
                model, opt_state, mesh=mesh, fsdp_axis=fsdp_axis, min_size=0
            )
            grads = sharding.constrain(
                grads,
                sharding.model_shardings(grads, mesh, fsdp_axis=fsdp_axis, min_size=0),
            )
        return model, opt_state, loss, grads

    return step
