"""Eager calls that reuse one compiled program per structure: called eagerly, a
scanning module would hand `jax.lax.scan` a fresh body, compiled anew at every
call. Under a transformation, in `mode="loop"` and inside `eqxscan.tap` (whose
probe is no argument: the cache would hand back an untapped program) the method
runs as written."""

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
import numpy as np

from .taps import call_of, tapping


P = ParamSpec("P")
R = TypeVar("R")


def compiled_when_eager(method: Callable[P, R]) -> Callable[P, R]:
    """A scanning module's call method, run eagerly through one cached
    `eqx.filter_jit` of it."""

    def typed(kinds: tuple[type, ...], *args: P.args, **kwargs: P.kwargs) -> R:
        del kinds  # only part of the cache's key
        return method(*args, **kwargs)

    jitted = eqx.filter_jit(typed)

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if getattr(args[0], "mode", "scan") == "loop" or tapping():
            # A tapped call's records are its own rows.
            with call_of(args[0], kwargs.get("reverse")):
                return method(*args, **kwargs)
        # Options such as `truncate=np.int64(2)` or `reverse=np.bool_(True)` are
        # read as Python values (as in the loop), not traced: a NumPy integer or
        # bool scalar given by keyword is static, like a Python int.
        kwargs = {
            k: v.item() if isinstance(v, (np.integer, np.bool_)) else v
            for k, v in kwargs.items()
        }  # pyright: ignore[reportAssignmentType]  # the same values
        leaves = jtu.tree_leaves((args, kwargs))  # one flatten for both checks
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return method(*args, **kwargs)
        # `filter_jit` keys its cache by the non-array leaves' hash and equality,
        # under which True == 1 == 1.0: their types join the key, so that a value
        # the method would refuse never reuses the program of one it accepted.
        kinds = tuple(type(leaf) for leaf in leaves if not eqx.is_array(leaf))
        return jitted(kinds, *args, **kwargs)

    return call
