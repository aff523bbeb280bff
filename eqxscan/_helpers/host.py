"""Arrays on the host: read only when NumPy asks, or put where a model's array
is."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree
from numpy.typing import DTypeLike

from .jax_private import key_impl


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


def placed_like(
    like: object, value: np.ndarray | jax.Array, weak: bool | None = None
) -> jax.Array | np.ndarray | np.generic:
    """`value` (a host array, or one on the default device) as `like` is: a NumPy
    array or scalar, or a JAX array placed, committed and weakly typed as it is (else a
    jitted function compiles again); weakly typed as `weak` says where given (as
    the array was saved)."""
    if isinstance(like, np.ndarray):
        return value
    if isinstance(like, np.generic):  # a NumPy scalar (`np.int64` of a count):
        return np.asarray(value)[()]  # as one, not a 32-bit JAX array
    restored = weak_like(like, jnp.asarray(value), weak)
    sharding = getattr(like, "sharding", None)
    if sharding is not None and getattr(like, "committed", True):
        return jax.device_put(restored, sharding)
    return restored


def scalars_kept(restored: PyTree, placed: PyTree) -> PyTree:
    """`placed` (`restored` laid out on devices) with the NumPy values of
    `restored` a device cannot hold kept: scalars (an int64 count would be an
    int32 on a device, wrapped), and integer arrays past int32's range without
    `jax_enable_x64`."""
    leaves, treedef = jtu.tree_flatten(placed)
    kept = zip(jtu.tree_leaves(restored), leaves, strict=True)
    return jtu.tree_unflatten(treedef, [r if host_only(r) else p for r, p in kept])


def host_only(x: object) -> bool:
    """Whether `x` is a NumPy value that `restore` keeps on the host: a scalar,
    or an integer array of a dtype a device holds in 32 bits (`wide_int`; the
    values restored are not known before)."""
    return isinstance(x, np.generic) or wide_int(x)


def wide_int(x: object) -> bool:
    """Whether `x` is a NumPy integer value of a dtype that a device, without
    `jax_enable_x64`, holds in 32 bits (int64, uint64)."""
    if not isinstance(x, (np.ndarray, np.generic)) or x.dtype.kind not in "iu":
        return False
    return jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype


def narrowed(x: object) -> bool:
    """Whether `x` is a NumPy integer value that a device, without
    `jax_enable_x64`, would wrap: past int32's (uint32's) range. (A float64 one
    is rounded to float32, as JAX does, and placed.)"""
    if not wide_int(x):
        return False
    a = np.asarray(x)
    bounds = np.iinfo(jax.dtypes.canonicalize_dtype(a.dtype))
    return a.size > 0 and bool(a.min() < bounds.min or a.max() > bounds.max)


def weak_like(like: object, x: jax.Array, weak: bool | None = None) -> jax.Array:
    """`x` (strongly typed), weakly typed where `like` is (a stack of PReLUs'
    slopes: a strong float32 would promote bfloat16 activations to float32), or
    where `weak` says (a checkpoint's record: an optimizer's update makes such a
    leaf strong, and a resumed run computes as the uninterrupted one)."""
    if not (getattr(like, "weak_type", False) if weak is None else weak):
        return x
    # Set into a Python number's zeros, which are weak (of the default dtype).
    typed = jax.lax.full(x.shape, x.dtype.type(0).item()).at[...].set(x)
    return typed if typed.dtype == x.dtype else x


def is_key(x: object) -> bool:
    """Whether `x` (an array or a `jax.ShapeDtypeStruct`) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def key_data(
    x: jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct,
) -> jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct:
    """Typed keys as the unsigned integers a file holds (`jax.random.key_data`:
    a trailing axis more), of an abstract key its shape and dtype."""
    if isinstance(x, jax.ShapeDtypeStruct):
        data = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
    return jax.random.key_data(x) if is_key(x) else x  # pyright: ignore[reportArgumentType]  # a key is no NumPy scalar


def keys_like(
    like: jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct, data: object
) -> jax.Array:
    """`data` (as `key_data` gave it) as typed keys of `like`'s implementation."""
    impl = (
        jax.random.key_impl(like)
        if isinstance(like, jax.Array)
        else key_impl(like.dtype)
    )
    if impl is None:
        raise TypeError(
            f"Cannot tell the PRNG implementation of abstract keys {like}: restore "
            "into concrete keys (jax.random.key(0), say)."
        )
    return jax.random.wrap_key_data(jnp.asarray(data), impl=impl)
