"""Arrays on the host: read only when NumPy asks, or put where a model's array
is."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike


class Lazy:
    """An array read when NumPy asks for it, its `shape` and `dtype` known before."""

    def __init__(
        self, shape: tuple[int, ...], dtype: DTypeLike, read: Callable[[], np.ndarray]
    ):
        self.shape, self.dtype, self.read = tuple(shape), np.dtype(dtype), read

    def __array__(
        self, dtype: DTypeLike | None = None, copy: bool | None = None
    ) -> np.ndarray:
        array = self.read()
        return array if dtype is None else array.astype(dtype)


def placed_like(like: object, value: np.ndarray | jax.Array) -> jax.Array | np.ndarray:
    """`value` (a host array, or one on the default device) as `like` is: a NumPy
    array, or a JAX array placed, committed and weakly typed as it is (else a
    jitted function compiles again)."""
    if isinstance(like, np.ndarray):
        return value
    restored = weak_like(like, jnp.asarray(value))
    sharding = getattr(like, "sharding", None)
    if sharding is not None and getattr(like, "committed", True):
        return jax.device_put(restored, sharding)
    return restored


def weak_like(like: object, x: jax.Array) -> jax.Array:
    """`x`, weakly typed where `like` is (a stack of PReLUs' slopes): a strong
    float32 would promote bfloat16 activations to float32."""
    if not getattr(like, "weak_type", False):
        return x
    # Set into a Python number's zeros, which are weak (of the default dtype).
    weak = jax.lax.full(x.shape, x.dtype.type(0).item()).at[...].set(x)
    return weak if weak.dtype == x.dtype else x
