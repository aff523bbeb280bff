"""The model, names and rules shared by the tensor-parallel tests."""

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

import eqxscan


DIM, LAYERS, BATCH = 16, 3, 8
#: Megatron-style: w1 column-parallel, w2 row-parallel over "model"; the "embed"
#: axis over "fsdp".
AXES = {"blocks.layers.w1": ("embed", "mlp"), "blocks.layers.w2": ("mlp", "embed")}
RULES = {"embed": "fsdp", "mlp": "model"}


def make_problem():
    model = eqxscan.StackedMLP(DIM, LAYERS, key=jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, DIM))
    return model, x, jax.random.normal(ky, (BATCH, DIM))


def max_rel(a, b):
    a, b = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    errs = [
        float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
        / (float(np.max(np.abs(np.asarray(v, np.float64)))) + 1e-30)
        for u, v in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True)
    ]
    return max(errs)
