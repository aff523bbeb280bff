"""Temporary memory and FLOPs of one gradient of a 24-layer StackedMLP for each
nesting shape of `remat=` (XLA's `memory_analysis()` and `cost_analysis()`,
so the figures do not depend on machine load).

    python benchmarks/nested_shapes.py [--dim 256] [--batch 64]
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxscan


SHAPES = [
    ('"auto" (flat)', "auto"),
    ("True (flat)", True),
    ('"nested" (sqrt: 4 x 6)', "nested"),
    ("nested=2", eqxscan.ScanRemat(nested=2)),
    ("nested=4", eqxscan.ScanRemat(nested=4)),
    ("nested=8", eqxscan.ScanRemat(nested=8)),
    ("nested=(2, 3, 4)", eqxscan.ScanRemat(nested=(2, 3, 4))),
    ("nested=(2, 2, 2, 3)", eqxscan.ScanRemat(nested=(2, 2, 2, 3))),
    ('save_carries="offload"', eqxscan.ScanRemat(save_carries="offload")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    model = eqxscan.StackedMLP(args.dim, args.layers, key=jax.random.key(0))
    x = jnp.ones((args.batch, args.dim))

    def loss(m: eqxscan.StackedMLP) -> jax.Array:
        return jnp.mean(m(x) ** 2)

    print("| remat | temp memory (MiB) | GFLOP |")
    print("| --- | ---: | ---: |")
    for name, remat in SHAPES:
        blocks = model.blocks.with_options(remat=remat)
        m = eqx.tree_at(lambda m: m.blocks, model, blocks)
        compiled = eqx.filter_jit(eqx.filter_grad(loss)).lower(m).compile().compiled
        cost = compiled.cost_analysis()
        flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
        mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"| `{name}` | {mib:.2f} | {flops / 1e9:.2f} |")


if __name__ == "__main__":
    main()
