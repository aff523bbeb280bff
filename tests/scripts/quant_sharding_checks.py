"""Quantized stacks on 8 simulated CPU devices (FSDP over all 8), run in a fresh
process by test_quant_memory.py. Prints one JSON object; the test asserts on it.
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import tempfile  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import eqxscan  # noqa: E402
from eqxscan import quant, sharding  # noqa: E402
from tests.helpers import collectives  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")

DIM, LAYERS, BATCH = 64, 3, 8
TARGETS = ["blocks.*.w1", "blocks.*.w2"]


def specs(tree) -> dict[str, str]:
    return {
        jax.tree_util.keystr(path): str(s.spec)
        for path, s in jax.tree_util.tree_leaves_with_path(tree)
    }


def main() -> None:
    mesh = sharding.make_mesh(fsdp=8)
    model = eqxscan.StackedMLP(DIM, LAYERS, key=jax.random.key(0)).with_options(
        unroll=1
    )
    x = jax.random.normal(jax.random.key(1), (BATCH, DIM))
    out: dict[str, object] = {
        "float": specs(sharding.model_shardings(model, mesh, min_size=0))
    }
    for kind in ("int8", "int4", "fp8", "int4-native"):
        storage = "native" if kind.endswith("native") else "packed"
        q = quant.quantize(model, TARGETS, kind=kind.split("-")[0], group_size=32,
                           int4_storage=storage)  # fmt: skip
        placed, _, batch = sharding.shard(q, batch=x, mesh=mesh, min_size=0)

        # Gradients of the float arrays (the scales, the norms' scale); the
        # stored values are arguments too, so that they keep their sharding.
        def parts(m):
            floats, rest = eqx.partition(m, eqx.is_inexact_array)
            ints, static = eqx.partition(rest, eqx.is_array)
            return floats, ints, static

        def loss(floats, ints, x, static):
            return jnp.sum(eqx.combine(floats, ints, static)(x) ** 2)

        floats, ints, static = parts(placed)
        step = jax.jit(jax.value_and_grad(loss), static_argnums=3)
        value, grads = step(floats, ints, batch, static)
        f1, i1, s1 = parts(q)
        value1, grads1 = step(f1, i1, x, s1)  # one device
        err = max(
            float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1))
        )
        hlo = step.lower(floats, ints, batch, static).compile().as_text()
        out[kind] = {
            "specs": specs(sharding.model_shardings(q, mesh, min_size=0)),
            "placed_w1_values": str(placed.blocks.layers.w1.values.sharding.spec),
            "err_loss": abs(float(value) - float(value1)) / abs(float(value1)),
            "err_grads": err,
            "all_gathers": collectives(hlo, "all-gather"),
        }
    out["native_files"] = native_files(model, mesh, x)
    out["quantize_file"] = quantized_from_file(model, mesh, x)
    print(json.dumps(out))


def quantized_from_file(model, mesh, x) -> dict[str, object]:
    # A float file quantized into a sharded `like`: each quantized array placed
    # as `model_shardings` places the quantized model, the same numbers as
    # quantizing the loaded model.
    other = eqxscan.StackedMLP(DIM, LAYERS, key=jax.random.key(7))
    like = sharding.shard(other, mesh=mesh, min_size=0)[0]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "f.safetensors")
        eqxscan.save_safetensors(path, model)
        for kind, kw in [("int8", {}), ("int4-native", {"int4_storage": "native"})]:
            kw = dict(kind=kind.split("-")[0], group_size=32, **kw)
            q = quant.quantize_file(path, like, targets=TARGETS, **kw)
            want = sharding.model_shardings(q, mesh, min_size=0)
            by_path = dict(jax.tree_util.tree_leaves_with_path(want))
            placed = [
                a.sharding.is_equivalent_to(by_path[p], a.ndim)
                for p, a in jax.tree_util.tree_leaves_with_path(q)
                if isinstance(a, jax.Array)
            ]
            ref = quant.quantize(model, TARGETS, **kw)
            out[kind] = {
                "placed": all(placed) and len(placed) >= 4,
                "w1_values": str(q.blocks.layers.w1.values.sharding.spec),
                "max_diff": float(jnp.max(jnp.abs(q(x) - ref(x)))),
            }
    return out


class _Holder(eqx.Module):
    w: jax.Array


def native_files(model, mesh, x) -> dict[str, object]:
    # Native int4 (split `[L, groups, g, out]` for "x@W"), sharded, saved and
    # loaded into a sharded native `like`: placed as `like`, the same numbers.
    kw = dict(kind="int4", group_size=32, int4_storage="native")
    q = quant.quantize(model, TARGETS, **kw)
    placed = sharding.shard(q, mesh=mesh, min_size=0)[0]
    other = eqxscan.StackedMLP(DIM, LAYERS, key=jax.random.key(7))
    like = sharding.shard(quant.quantize(other, TARGETS, **kw), mesh=mesh, min_size=0)[
        0
    ]
    # The same `like` described (shapes and shardings only), as a restore
    # onto a mesh builds it without allocating.
    described = jax.tree.map(
        lambda a: (
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
            if isinstance(a, jax.Array)
            else a
        ),
        like,
    )
    with tempfile.TemporaryDirectory() as tmp:
        quant.save(os.path.join(tmp, "q.safetensors"), placed)
        back = quant.load(os.path.join(tmp, "q.safetensors"), like)
        from_described = quant.load(os.path.join(tmp, "q.safetensors"), described)
    layers, wanted = back.blocks.layers, like.blocks.layers
    # A "W@x" weight whose inputs (8) are sharded 8 ways natively but whose
    # packed bytes (4) cannot be: the file is read unsharded, then placed.
    w = jax.random.normal(jax.random.key(2), (LAYERS, 16, 8))
    stack = eqxscan.Stacked.from_layers([_Holder(wi) for wi in w])
    kw = dict(kind="int4", group_size=None, orientation="W@x", int4_storage="native")
    small = quant.quantize(stack, "*.w", **kw)
    placed = NamedSharding(mesh, PartitionSpec(None, None, "fsdp"))
    small = eqx.tree_at(
        lambda m: m.layers.w.values,
        small,
        jax.device_put(small.layers.w.values, placed),
    )
    with tempfile.TemporaryDirectory() as tmp:
        quant.save(os.path.join(tmp, "small.safetensors"), small)
        small_back = quant.load(os.path.join(tmp, "small.safetensors"), small)
    return {
        "small_as_like": small_back.layers.w.values.sharding == placed
        and bool(jnp.all(small_back.layers.w.values == small.layers.w.values)),
        "specs": [str(getattr(layers, w).values.sharding.spec) for w in ("w1", "w2")],
        "as_like": all(
            getattr(layers, w).values.sharding == getattr(wanted, w).values.sharding
            for w in ("w1", "w2")
        ),
        "described_as_like": all(
            a.sharding.is_equivalent_to(b.sharding, a.ndim)
            for a, b in zip(
                jax.tree.leaves(eqx.filter(from_described, eqx.is_array)),
                jax.tree.leaves(eqx.filter(like, eqx.is_array)),
                strict=True,
            )
        ),
        "dtype": str(layers.w1.values.dtype),
        "max_diff": float(jnp.max(jnp.abs(back(x) - q(x)))),
    }


if __name__ == "__main__":
    main()
