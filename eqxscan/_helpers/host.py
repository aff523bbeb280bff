"""Arrays on the host: `Lazy`, read from a file (or made) only when NumPy asks
for it, `host_empty`, a large host array returned to the system when freed,
and `placed_like`, a host array put where a model's array is."""

import ctypes
import functools
import math
import mmap
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike


class Lazy:
    """An array read when NumPy asks for it, its `shape` and `dtype` known before
    (so a whole file can be checked first)."""

    def __init__(
        self, shape: tuple[int, ...], dtype: DTypeLike, read: Callable[[], np.ndarray]
    ):
        self.shape, self.dtype, self.read = tuple(shape), np.dtype(dtype), read

    def __array__(
        self, dtype: DTypeLike | None = None, copy: bool | None = None
    ) -> np.ndarray:
        array = self.read()
        return array if dtype is None else array.astype(dtype)


# Past this, `host_empty` maps its own pages.
_MAPPED = 1 << 20
_POSIX = hasattr(mmap, "MAP_PRIVATE")


def host_empty(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """`numpy.empty(shape, dtype)`, in pages of its own when large: freed, they
    go back to the system. From `malloc`, glibc takes a freed large block for a
    reason to keep the next ones on its heap, where layers read one after
    another stay resident long after they are freed."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    if size < _MAPPED:
        return np.empty(shape, dtype)
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if _POSIX else {}
    return np.frombuffer(mmap.mmap(-1, size, **private), dtype).reshape(shape)


@functools.cache
def _malloc_trim() -> Callable[[int], object] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (OSError, AttributeError, TypeError):  # none; Windows: no CDLL(None)
        return None


def give_back_freed() -> None:
    """Hand the memory freed on the heap back to the system, where the C library
    can (glibc's `malloc_trim`): XLA's buffers for a layer, freed, are
    otherwise kept, and a loop over large layers keeps a little more of each."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def placed_like(like: object, value: np.ndarray | jax.Array) -> jax.Array | np.ndarray:
    """`value` (a host array, or one put on the default device) as `like` is: a
    NumPy array, or a JAX array placed as it is."""
    if isinstance(like, np.ndarray):
        return value
    # A jitted function compiles again for an argument that differs in placement,
    # committedness or weak type: match `like` in all three. An uncommitted array
    # (the default placement) stays uncommitted.
    restored = weak_like(like, jnp.asarray(value))
    sharding = getattr(like, "sharding", None)
    if sharding is not None and getattr(like, "committed", True):
        return jax.device_put(restored, sharding)
    return restored


def weak_like(like: object, x: jax.Array) -> jax.Array:
    """`x`, weakly typed where `like` is (`jnp.array(0.5)`, a stack of PReLUs'
    slopes): a strong float32 would promote bfloat16 activations to float32."""
    if not getattr(like, "weak_type", False):
        return x
    # Set into the zeros of a Python number, which are weak: of the default
    # dtype only (a weak bfloat16 stays as it is rather than turn float32).
    weak = jax.lax.full(x.shape, x.dtype.type(0).item()).at[...].set(x)
    return weak if weak.dtype == x.dtype else x
