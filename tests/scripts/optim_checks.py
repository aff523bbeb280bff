"""`eqxscan.optim.layerwise` under FSDP on 8 simulated CPU devices, run in a fresh
process by test_optim_per_layer.py: the state is laid out like its parameters,
the compiled update gathers no whole stack, and a checkpointed state resumes
bit-identically. Prints `ok` when every check passes."""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import math  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqxscan  # noqa: E402
from eqxscan import checkpoint, sharding  # noqa: E402
from eqxscan.optim import layerwise  # noqa: E402
from tests.helpers import collectives  # noqa: E402
from tests.scripts.training import make_train_step  # noqa: E402


DIM, LAYERS, BATCH = 16, 4, 16


def elements(shape: str) -> int:
    """The number of elements of one HLO result, e.g. `f32[4,16,64]`."""
    return max(
        (
            math.prod(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"\[([\d,]*)\]", shape)
        ),
        default=0,
    )


def check(name: str, tx: optax.GradientTransformation) -> None:
    mesh = sharding.make_mesh(fsdp=8)
    model = eqxscan.StackedMLP(DIM, LAYERS, key=jax.random.key(0))
    keys = jax.random.split(jax.random.key(1))
    x = jax.random.normal(keys[0], (BATCH, DIM))
    y = jax.random.normal(keys[1], (BATCH, DIM))
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(eqx.filter(model, eqx.is_array))
    model, state, (x, y) = sharding.shard(model, state, (x, y), mesh=mesh, min_size=0)

    # Every buffer with a parameter's shape has that parameter's layout.
    params = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    layout = {p.shape: p.sharding for p in params}
    assert any(not s.is_fully_replicated for s in layout.values())
    matched = 0
    for leaf in jax.tree.leaves(state):
        if leaf.shape in layout:
            assert leaf.sharding.is_equivalent_to(layout[leaf.shape], leaf.ndim), (
                name,
                leaf.shape,
                leaf.sharding,
            )
            matched += 1
    assert matched >= len(params), (name, matched)

    # The compiled update (no forward pass, whose scan gathers one layer per
    # step by design) gathers no array as large as a whole stacked weight.
    @eqx.filter_jit
    def update(model, state, grads):
        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        model, state, _ = sharding.shard(model, state, mesh=mesh, min_size=0)
        return model, state

    grads = eqx.filter(model, eqx.is_inexact_array)
    text = update.lower(model, state, grads).compile().compiled.as_text()
    whole = LAYERS * DIM * 4 * DIM
    gathers = collectives(text, "all-gather")
    assert all(elements(g) < whole for g in gathers), (name, gathers)

    # Two steps, a checkpoint, two more; restored from it, the same two more.
    step = make_train_step(tx, mesh)
    # The parse above finds gathers where there are some: the forward pass
    # gathers one layer per scan step.
    text = step.lower(model, state, x, y).compile().compiled.as_text()
    per_step = [g for g in collectives(text, "all-gather") if 0 < elements(g) < whole]
    assert per_step, name
    for _ in range(2):
        model, state, _, _ = step(model, state, x, y)
    with tempfile.TemporaryDirectory() as directory:
        with checkpoint.CheckpointManager(directory, asynchronous=False) as manager:
            manager.save(2, model, state)
            ref_model, ref_state = model, state
            for _ in range(2):
                ref_model, ref_state, _, _ = step(ref_model, ref_state, x, y)
            model, state, at = manager.restore(model, state, mesh=mesh)
    assert at == 2
    for _ in range(2):
        model, state, _, _ = step(model, state, x, y)
    for a, b in zip(
        jax.tree.leaves((ref_model, ref_state)),
        jax.tree.leaves((model, state)),
        strict=True,
    ):
        if eqx.is_array(a):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    print(name, "gathers:", gathers)


if __name__ == "__main__":
    check("adamw", layerwise(optax.adamw(1e-2, weight_decay=0.1)))
    check("muon", layerwise(optax.contrib.muon(1e-2)))
    print("ok")
