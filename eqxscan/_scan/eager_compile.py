"""Eager calls that reuse one compiled program per structure: called eagerly, a
scanning module would hand `jax.lax.scan` a fresh body, compiled anew at every
call. Under a transformation, in `mode="loop"`, inside `eqxscan.tap` (whose
probe is no argument: the cache would hand back an untapped program), and where
a static part could change between calls unseen by the cache's key (a function
reading a global value or a closed-over one, an object of identity, whose
attributes may be set) the method runs as written."""

import enum
import functools
import types
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


# Code taken to read no state of the user's (its own globals and closures).
_LIBRARIES = ("jax", "jaxlib", "equinox", "eqxscan", "numpy", "jaxtyping", "optax")
_VALUES = (type(None), bool, int, float, complex, str, bytes, type, enum.Enum)


def _fixed(leaf: object, seen: set[int]) -> bool:
    """Whether a static leaf is what it was when a program was compiled for
    it: a value, or code whose globals and closed-over values are code,
    modules and classes (checked through the user's own functions)."""
    if isinstance(leaf, _VALUES + (types.ModuleType, np.dtype)) or id(leaf) in seen:
        return True
    seen.add(id(leaf))
    if isinstance(leaf, tuple | frozenset):
        return all(_fixed(x, seen) for x in leaf)
    owner = getattr(leaf, "__self__", None)  # a bound method, of any kind
    if callable(leaf) and owner is not None and not _fixed(owner, seen):
        return False
    module = getattr(leaf, "__module__", None) or ""
    if callable(leaf) and (module.split(".")[0] in _LIBRARIES or owner is not None):
        return _fixed(getattr(leaf, "__func__", None), seen)
    if isinstance(leaf, functools.partial):
        parts = (leaf.func, *leaf.args, *leaf.keywords.values())
        return all(eqx.is_array(x) or _fixed(x, seen) for x in parts)
    if isinstance(leaf, types.FunctionType):
        cells = [c.cell_contents for c in leaf.__closure__ or () if _filled(c)]
        names = _global_names(leaf.__code__)
        read = [leaf.__globals__[n] for n in names if n in leaf.__globals__]
        code = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)
        return all(
            (callable(x) or isinstance(x, code)) and _fixed(x, seen)
            for x in cells + read
        )
    if hasattr(leaf, "__wrapped__"):  # `jax.jit` of a function of the user's
        return _fixed(leaf.__wrapped__, seen)
    # Hashed by value (frozen data): equal values share a program, as the key's.
    return type(leaf).__hash__ not in (object.__hash__, None)


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # not yet assigned
        return False
    return True


def _global_names(code: types.CodeType) -> list[str]:
    # The names a function's code (nested functions included) may read globally.
    nested = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return [*code.co_names, *(n for c in nested for n in _global_names(c))]


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
        static = [leaf for leaf in leaves if not eqx.is_array(leaf)]
        seen: set[int] = set()
        if not all(_fixed(leaf, seen) for leaf in static):
            return method(*args, **kwargs)
        return jitted(tuple(map(type, static)), *args, **kwargs)

    return call
