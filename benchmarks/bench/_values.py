"""The benchmark's parameter and batch values: normals drawn on the default
device from a seed, so identical in every worker. Drawn on the host, 16 layers
at D=4096 took about 30 s a worker; on a TPU v5e, from a threefry key, 55 s,
almost all of it compiling (17-19 s a shape, deviceless); from an "rbg" key
(the device's own generator), 3 s a shape."""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(
    key: Array, scale: float, shift: float, *, shape: tuple[int, ...], dtype: str
) -> Array:
    values = shift + scale * jax.random.normal(key, shape, jnp.float32)
    return values.astype(dtype)


class Normals:
    """`normals(shape, dtype, scale, shift)`: `shift + scale * N(0, 1)` values,
    a fresh draw at each call, the same sequence for the same seed."""

    def __init__(self, seed: int):
        self._key, self._count = jax.random.key(seed, impl="rbg"), 0

    def __call__(
        self,
        shape: tuple[int, ...],
        dtype: jnp.dtype,
        scale: float = 1.0,
        shift: float = 0.0,
    ) -> Array:
        self._count += 1
        key = jax.random.fold_in(self._key, self._count)
        return _normal(
            key, scale, shift, shape=tuple(shape), dtype=jnp.dtype(dtype).name
        )
