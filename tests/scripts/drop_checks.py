"""LayerDrop and drop-path under FSDP on 8 simulated CPU devices, run in a fresh
process by test_depth_gate.py: the sharded train step's loss and gradients equal
one device's for several keys, and the compiled program gathers a layer's
weights only inside the branch that runs it (no gather of a whole stack).
Prints `ok` when every check passes."""

import os
import re


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eqxscan  # noqa: E402
from eqxscan import sharding  # noqa: E402
from tests.helpers import collectives  # noqa: E402
from tests.scripts.optim_checks import elements  # noqa: E402


DIM, LAYERS, BATCH = 16, 4, 16


def loss_and_grads(model, x, key):
    def loss(m):
        return jnp.mean(m(x, key=key) ** 2)

    return eqx.filter_value_and_grad(loss)(model)


def main() -> None:
    mesh = sharding.make_mesh(fsdp=8)
    model = eqxscan.StackedMLP(
        DIM, LAYERS, key=jax.random.key(0), layer_drop=0.5, drop_path=0.2
    )
    x = jax.random.normal(jax.random.key(1), (BATCH, DIM))
    sharded, _, xs = sharding.shard(model, None, x, mesh=mesh, min_size=0)
    w1 = sharded.blocks.layers.w1
    assert not w1.sharding.is_fully_replicated
    step = eqx.filter_jit(loss_and_grads)
    values = set()
    for seed in range(4):
        key = jax.random.key(seed)
        (v, g), (v_ref, g_ref) = step(sharded, xs, key), step(model, x, key)
        values.add(float(v_ref))
        np.testing.assert_allclose(v, v_ref, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert len(values) > 1  # the keys dropped differently
    text = step.lower(sharded, xs, jax.random.key(0)).compile().compiled.as_text()
    whole = LAYERS * DIM * 4 * DIM
    gathers = collectives(text, "all-gather")
    layer_gathers = [g for g in gathers if 0 < elements(g) < whole]
    assert layer_gathers, gathers  # the parse finds the per-layer gathers
    assert all(elements(g) < whole for g in gathers), gathers
    # Every gather of a layer's weights sits in a branch of a conditional: a
    # skipped layer's weights are not gathered.
    branches = _branch_computations(text)
    outside = [
        line
        for name, body in _computations(text).items()
        if name not in branches
        for line in body
        for shape in collectives(line, "all-gather")
        if elements(shape) >= DIM * 4 * DIM  # one layer's w1 or w2
    ]
    assert not outside, outside
    inside = [
        line
        for name, body in _computations(text).items()
        if name in branches
        for line in body
        if " all-gather" in line
    ]
    assert inside  # the parse finds the branches' gathers
    print("gathers:", gathers, "in branches:", len(inside))


def _computations(text: str) -> dict[str, list[str]]:
    """HLO computations by name, each as its instruction lines."""
    found: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line and "(" in line:
            name = line.split("(")[0].split()[-1].lstrip("%")
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return found


def _branch_computations(text: str) -> set[str]:
    """Names of computations a conditional calls, and those they call."""
    comps = _computations(text)
    calls = {
        n: set(
            re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", "\n".join(b))
        )
        for n, b in comps.items()
    }
    direct = set()
    for body in comps.values():
        for line in body:
            m = re.search(r"branch_computations=\{([^}]*)\}", line)
            if m:
                direct |= {c.strip().lstrip("%") for c in m.group(1).split(",")}
            m = re.search(
                r"true_computation=%?([\w.\-]+).*false_computation=%?([\w.\-]+)", line
            )
            if m:
                direct |= {m.group(1), m.group(2)}
    seen, todo = set(), list(direct)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(calls.get(n, ()))
    return seen


if __name__ == "__main__":
    main()
    print("ok")
