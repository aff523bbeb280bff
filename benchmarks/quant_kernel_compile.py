"""The quantized-matmul Pallas kernel compiled for a TPU v5e without one: Mosaic
lowers and XLA compiles each product for a deviceless v5e topology, on this
machine's CPU, and the script prints XLA's temporaries (`memory_analysis()`)
and whether the program holds the kernel (a Mosaic custom call).

    pip install "jax[tpu]==<the installed jax version>"   # libtpu, no chip needed
    python -m benchmarks.quant_kernel_compile

Products `x @ q` (`kernel="pallas"`) for B = 8 rows by `[2048, 8192]` and
`[8192, 2048]` weights and 512 rows by the first (int8, int4 in groups of 128,
fp8; float32 and bfloat16), then a scanned StackedMLP decode step
(B = 8, L = 16, D = 2048, `w1` and `w2` quantized) with `kernel="pallas"`
beside the same step on the XLA path. Nothing is run, so nothing is timed.
"""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import eqxscan
from benchmarks.tpu_compile import tpu_target
from eqxscan import quant


B, L, D = 8, 16, 2048
KINDS = ("int8", "int4", "fp8")


def compiled(fn, args, sharding: NamedSharding) -> tuple[float, bool]:
    """`fn` compiled for the TPU: temporaries in KiB, and whether its program
    holds a Mosaic kernel."""
    shaped = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args
    )
    program = jax.jit(fn).lower(*shaped).compile()
    temp = program.memory_analysis().temp_size_in_bytes / 2**10
    return temp, "tpu_custom_call" in program.as_text()


def products(sharding: NamedSharding) -> None:
    print('x @ q, one layer\'s weight, kernel="pallas"')
    print(f"{'kind':<6}{'rows':>5} {'weight':<14}{'dtype':<10}{'temp KiB':>9}  Mosaic")
    sizes = [(B, (D, 4 * D)), (B, (4 * D, D)), (512, (D, 4 * D))]
    for kind, (rows, shape), dtype in itertools.product(
        KINDS, sizes, (jnp.float32, jnp.bfloat16)
    ):
        w = jnp.zeros(shape, dtype)
        q = quant.quantize({"w": w}, "w", kind=kind, group_size=128, kernel="pallas")[
            "w"
        ]
        x = jnp.zeros((rows, shape[0]), dtype)
        temp, kernel = compiled(lambda x, q: x @ q, (x, q), sharding)
        print(
            f"{kind:<6}{rows:>5} {str(list(shape)):<14}{jnp.dtype(dtype).name:<10}"
            f"{temp:>9.2f}  {kernel}"
        )


def control(sharding: NamedSharding) -> None:
    # What the deviceless compile reports for a program that needs
    # temporaries: read the temp columns against it.
    a = jnp.zeros((2048, 2048))
    temp, _ = compiled(lambda a: jnp.sort((a @ a.T) @ a, axis=0) @ a, (a,), sharding)
    print(f"\ncontrol: temp KiB of jnp.sort((a @ a.T) @ a, axis=0) @ a: {temp:.2f}")


def decode_steps(sharding: NamedSharding) -> None:
    print(f"\nStackedMLP decode step, B={B} L={L} D={D}, scanned, float32 model")
    print(f"{'kind':<8}{'kernel':<8}{'weights MiB':>12}{'temp KiB':>10}  Mosaic")
    model = eqxscan.StackedMLP(D, L, key=jax.random.key(0))
    model = eqx.filter_eval_shape(lambda m: m, model)
    for kind in KINDS:
        q = quant.quantize(
            model, ["blocks.*.w1", "blocks.*.w2"], kind=kind, group_size=128
        )
        for kernel in ("xla", "pallas"):
            m = quant.with_kernel(q, kernel)
            params, static = eqx.partition(
                m, lambda a: isinstance(a, jax.ShapeDtypeStruct)
            )
            x = jax.ShapeDtypeStruct((B, D), jnp.float32)
            temp, mosaic = compiled(
                lambda p, x, static=static: eqx.combine(p, static)(x),
                (params, x),
                sharding,
            )
            nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
            print(f"{kind:<8}{kernel:<8}{nbytes / 2**20:>12.1f}{temp:>10.2f}  {mosaic}")


def main() -> None:
    sharding = tpu_target()
    print(f"jax {jax.__version__}, compiled for {sharding.mesh.devices.flat[0]}\n")
    products(sharding)
    decode_steps(sharding)
    control(sharding)


if __name__ == "__main__":
    main()
