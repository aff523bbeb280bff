"""Implementations for the tests of `python -m benchmarks.bench`, added to the
parent and to every worker by `BENCH_EXTRA_IMPLS=tests.bench_impls`."""

import jax
import jax.numpy as jnp

from benchmarks.bench._impls import Built, Impl, IMPLS


#: The batch from which `too-big`'s train step does not fit: bigger than the
#: agreement check's (`CHECK_SIZE`), so that only the measurements hit it.
TOO_BIG_BATCH = 3


def perturbed(model):
    # Computes a slightly different function: w1 scaled by 1.001.
    built = IMPLS["jax-scan"].build(model)

    def loss(params, x, y):
        return built.loss({**params, "w1": params["w1"] * 1.001}, x, y)

    return Built(built.params, loss, built.to_canon)


def too_big(model):
    # The loop's step, but from batch `TOO_BIG_BATCH` its trace asks XLA for
    # 16 TiB, which XLA itself refuses with RESOURCE_EXHAUSTED (nothing is
    # allocated), as a device refuses a program bigger than its memory.
    built = IMPLS["jax-scan"].build(model)

    def loss(params, x, y):
        if x.shape[0] >= TOO_BIG_BATCH:
            with jax.ensure_compile_time_eval():
                jnp.zeros((2**42,), jnp.float32)
        return built.loss(params, x, y)

    return Built(built.params, loss, built.to_canon)


def gradient_scaled(factor: float, matmul_precision: str | None = None) -> Impl:
    """`jax-scan` with its gradient of `w1` scaled by `factor` (so a relative
    error of `factor - 1`), and by 1.1 more when traced at another matmul
    precision than `matmul_precision` (if given)."""

    def build(model):
        built = IMPLS["jax-scan"].build(model)

        def loss(params, x, y):
            precision = jax.config.jax_default_matmul_precision
            wrong = matmul_precision is not None and precision != matmul_precision
            scale = factor * (1.1 if wrong else 1.0)
            # The gradient of w1 scaled, the loss and the other gradients not.
            w1 = params["w1"]
            w1 = jax.lax.stop_gradient(w1) + (w1 - jax.lax.stop_gradient(w1)) * scale
            return built.loss({**params, "w1": w1}, x, y)

        return Built(built.params, loss, built.to_canon)

    return Impl(f"scaled-{factor}", f"gradient of w1 x {factor}", build)


MLP_IMPLS = {
    "broken": Impl("broken", "w1 scaled by 1.001", perturbed),
    "too-big": Impl("too-big", "does not fit from batch 3", too_big),
}
