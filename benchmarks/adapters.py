"""LoRA adapters on one base against the base restacked per adapter (`K` full
copies of the model, one per fine-tune): the arrays' bytes, and XLA's
temporaries (`memory_analysis()`) of a forward pass over a batch in which each
row uses its own adapter.

    python -m benchmarks.adapters
    python -m benchmarks.adapters --tiny
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxscan
from eqxscan import adapters


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x))


def _temp(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def measure(dim: int, layers: int, rank: int, k: int, batch: int) -> dict[str, int]:
    base = eqxscan.StackedMLP(dim, layers, key=jax.random.key(0))
    model = adapters.add_lora(
        base, ["*.w1", "*.w2"], rank=rank, num_adapters=k, key=jax.random.key(1)
    )
    # K full copies, one row's weights picked by its id.
    copies = jax.tree.map(lambda a: jnp.stack([a] * k) if eqx.is_array(a) else a, base)
    arrays, static = eqx.partition(model, eqx.is_array)
    c_arrays, c_static = eqx.partition(copies, eqx.is_array)
    xs = jnp.ones((batch, dim))
    ids = jnp.arange(batch, dtype=jnp.int32) % k

    def lora(p, xs, ids):
        m = eqx.combine(p, static)
        return jax.vmap(lambda x, i: adapters.select(m, i)(x))(xs, ids)

    def restacked(p, xs, ids):
        def row(x, i):
            one = jax.tree.map(lambda a: a[i], p)
            return eqx.combine(one, c_static)(x)

        return jax.vmap(row)(xs, ids)

    return {
        "lora_bytes": _nbytes(model),
        "copies_bytes": _nbytes(copies),
        "lora_temp": _temp(lora, arrays, xs, ids),
        "copies_temp": _temp(restacked, c_arrays, xs, ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tiny", action="store_true", help="a smoke test")
    args = parser.parse_args()
    if args.tiny:
        args.dim, args.layers, args.rank, args.batch = 16, 2, 2, 4
        args.adapters = [1, 2]
    print(
        f"StackedMLP dim={args.dim} layers={args.layers}, w1 and w2 adapted, "
        f"rank={args.rank}, batch={args.batch}, float32, {jax.default_backend()}"
    )
    print(
        f"{'K':>3} {'LoRA MiB':>9} {'copies MiB':>11} {'LoRA temp MiB':>14} "
        f"{'copies temp MiB':>16}"
    )
    mib = 2.0**20
    for k in args.adapters:
        r = measure(args.dim, args.layers, args.rank, k, args.batch)
        print(
            f"{k:>3} {r['lora_bytes'] / mib:>9.2f} {r['copies_bytes'] / mib:>11.2f} "
            f"{r['lora_temp'] / mib:>14.2f} {r['copies_temp'] / mib:>16.2f}"
        )


if __name__ == "__main__":
    main()
