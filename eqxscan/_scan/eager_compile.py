"""Eager calls that reuse one compiled program per structure: called eagerly, a
scanning module would hand `jax.lax.scan` a fresh body, compiled anew at every
call. What the code run reads from outside its arguments (the globals,
closed-over values and class attributes read by the Modules' methods and by
static functions) joins the key by value, so that a changed global compiles
anew rather than serving the old program. Under a transformation, in
`mode="loop"`, inside `eqxscan.tap` (whose probe is no argument: the cache would
hand back an untapped program), and where such a value cannot be a key (an
array, a mutable object) the method runs as written."""

import dis
import enum
import functools
import types
from collections.abc import Callable, Iterable
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
_STANDARD = ("builtins", "typing", "abc", "enum", "dataclasses", "functools")
_VALUES = (type(None), bool, int, float, complex, str, bytes, enum.Enum)
Key = tuple | None  # hashable; `None`: cannot be keyed, so not cached


def _key(value: object, seen: set[int]) -> Key:
    """What a static value, and the code it holds, read from outside it
    (globals, closed-over values, class attributes), as hashable values for
    the cache's key; `None` where one of them cannot be (an array, a mutable
    object), and the call is then not cached."""
    if isinstance(value, _VALUES):
        return (type(value), value)
    if isinstance(value, type):  # its methods and attributes, once
        return _class(value, seen)
    if isinstance(value, types.ModuleType | np.dtype) or id(value) in seen:
        return ()
    seen.add(id(value))
    if isinstance(value, tuple | frozenset):
        return _all(value, seen)
    owner = getattr(value, "__self__", None)  # a bound method, of any kind
    if (
        callable(value)
        and owner is not None
        and not isinstance(owner, types.ModuleType)
    ):
        return _all((owner, getattr(value, "__func__", None)), seen)
    if callable(value) and _library(value):
        return ()
    if isinstance(value, functools.partial):
        return _all((value.func, *value.args, *value.keywords.values()), seen)
    wrapped = getattr(value, "__wrapped__", None)
    if wrapped is not None:  # `jax.jit`, type checkers: the user's code
        return _key(wrapped, seen)
    if isinstance(value, types.FunctionType):
        cells = [c.cell_contents for c in value.__closure__ or () if _filled(c)]
        names = [n for n in _global_names(value.__code__) if n in value.__globals__]
        return _all((*cells, *(value.__globals__[n] for n in names)), seen)
    if type(value).__hash__ in (object.__hash__, None):  # identity, or mutable
        return None
    own = _class(type(value), seen)  # frozen data: its value, and its methods
    return None if own is None else (value, own)


def _all(values: Iterable[object], seen: set[int]) -> Key:
    keys = tuple(_key(v, seen) for v in values)
    return None if None in keys else keys


def _library(value: object) -> bool:
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in _LIBRARIES + _STANDARD


def _class(cls: type, seen: set[int]) -> Key:
    # What the methods of a class of the user's read, and its class attributes.
    keys = []
    for c in cls.__mro__:
        if c is object or _library(c) or id(c) in seen:
            continue
        seen.add(id(c))
        for name, attr in vars(c).items():
            if name.startswith(("__", "_abc")) and name != "__call__":
                continue
            if isinstance(attr, staticmethod | classmethod):
                attr = attr.__func__
            key = _key(attr.fget if isinstance(attr, property) else attr, seen)
            if key is None:
                return None
            keys.append((name, key))
    return tuple(keys)


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # not yet assigned
        return False
    return True


@functools.cache
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    # The global names a function's code (nested functions included) reads.
    own = (i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL")
    nested = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return (*own, *(n for c in nested for n in _global_names(c)))


@functools.lru_cache(maxsize=256)
def _classes(treedef: jtu.PyTreeDef) -> tuple[type, ...]:  # pyright: ignore[reportInvalidTypeForm]
    # The classes of the Modules in a call's tree (whose code it runs), in
    # order: once per structure, read off its treedef.
    found: dict[type, None] = {}

    def visit(node: jtu.PyTreeDef) -> None:  # pyright: ignore[reportInvalidTypeForm]
        data = node.node_data()
        if data is not None and isinstance(data[0], type):
            if issubclass(data[0], eqx.Module):
                found[data[0]] = None
        for child in node.children():
            visit(child)

    visit(treedef)
    return tuple(found)


def compiled_when_eager(method: Callable[P, R]) -> Callable[P, R]:
    """A scanning module's call method, run eagerly through one cached
    `eqx.filter_jit` of it."""

    def typed(cache_key: tuple, /, *args: P.args, **kwargs: P.kwargs) -> R:
        del cache_key  # only part of the cache's key
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
        leaves, treedef = jtu.tree_flatten(
            (args, kwargs)
        )  # one flatten for both checks
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return method(*args, **kwargs)
        # `filter_jit` keys its cache by the non-array leaves' hash and equality,
        # under which True == 1 == 1.0: their types join the key, so that a value
        # the method would refuse never reuses the program of one it accepted.
        static = [leaf for leaf in leaves if not eqx.is_array(leaf)]
        # What the code run reads from outside its arguments joins the key.
        reads = _all((*static, *_classes(treedef)), set())
        if reads is None:
            return method(*args, **kwargs)
        return jitted((tuple(map(type, static)), reads), *args, **kwargs)

    return call
