"""Eager calls that reuse one compiled program per structure: called eagerly, a
scanning module would hand `jax.lax.scan` a fresh body, compiled anew at every
call. What the code run reads from outside its arguments (the globals,
closed-over values and class attributes read by the Modules' methods and by
static functions) joins the key by value, so that a changed global compiles
anew rather than serving the old program. An eager `grad` or `vmap` uses the
cached program too; under a staging transformation (`jit`, `scan`), in
`mode="loop"` and inside `eqxscan.tap` (whose probe is no argument: the cache
would hand back an untapped program) the method runs as written; where such a
value cannot be a key (a NumPy array, a mutable object), or past
`MAX_VALUES` values for one structure, the call is compiled for itself
alone."""

import dataclasses
import dis
import enum
import functools
import logging
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._helpers import checks
from .call_state import changed_call_state
from .options import ScanOptions
from .scan_remat import offloads_between_programs, on_accelerator, staged
from .taps import call_of, tapping
from .vmap_batch import vmapped_size


P = ParamSpec("P")
R = TypeVar("R")


# Code taken to read no state of the user's (its own globals and closures).
_LIBRARIES = ("jax", "jaxlib", "equinox", "eqxscan", "numpy", "jaxtyping", "optax")
_STANDARD = ("builtins", "typing", "abc", "enum", "dataclasses", "functools")
_VALUES = (type(None), bool, int, float, complex, str, bytes, enum.Enum)
Key = tuple | None  # hashable; `None`: cannot be keyed, so not cached


def _key(value: object, seen: dict[int, int]) -> Key:
    """What a static value, and the code it holds, read from outside it
    (globals, closed-over values, class attributes), as hashable values for
    the cache's key; `None` where one of them cannot be (a NumPy array, a
    mutable object), and the call is then not cached."""
    if isinstance(value, jax.core.Tracer):  # a transformation's: never cached
        return None
    if isinstance(value, jax.Array):  # immutable: the same array, the same values
        return (_Same(value),)
    if isinstance(value, float | complex):  # -0.0 apart from 0.0, nan equal to nan
        return (type(value), repr(value))
    if isinstance(value, np.generic):  # float32 apart from float64 of equal value
        return (type(value), value.tobytes())
    if isinstance(value, _VALUES):  # with its class's methods (an Enum's, say)
        own = _class(type(value), seen)
        return None if own is None else (type(value), value, own)
    if isinstance(value, np.dtype):
        return (value,)
    if isinstance(value, logging.Logger):  # by identity and level (code may
        return (_Same(value), value.getEffectiveLevel())  # test `isEnabledFor`)
    # A library's function or class (not an instance of its Modules or a
    # partial, whose module is functools), a module, a class.
    library_fn = callable(value) and _library(value) and not _frozen_dataclass(value)
    if isinstance(value, types.ModuleType) and not _library_module(value.__name__):
        return None  # a module of the user's read whole (`getattr(cfg, "X")`, a
        # closure): which of its attributes the code reads is not known
    if isinstance(value, type | types.ModuleType) or (
        library_fn and not isinstance(value, functools.partial)
    ):
        # By identity (`jnp.tanh` is not `jax.nn.relu`); a class of the user's
        # with its methods and attributes, once.
        own = _class(value, seen) if isinstance(value, type) else ()
        return None if own is None else (_Same(value), own)
    if id(value) in seen:  # a cycle: where it was first met
        return ("again", seen[id(value)])
    seen[id(value)] = len(seen)
    if isinstance(value, tuple | frozenset):
        return _all(value, seen)
    owner = getattr(value, "__self__", None)  # a bound method, of any kind
    if (
        callable(value)
        and owner is not None
        and not isinstance(owner, types.ModuleType)
    ):
        return _all((owner, getattr(value, "__func__", None)), seen)
    if isinstance(value, functools.partial):
        return _all((value.func, *value.args, *value.keywords.values()), seen)
    if _frozen_dataclass(value):  # a Module (`eqx.nn.Lambda`, say): its fields
        fields = (getattr(value, f.name, None) for f in dataclasses.fields(value))  # pyright: ignore[reportArgumentType]  # a dataclass instance
        keys, own = _all(fields, seen), _class(type(value), seen)
        return None if keys is None or own is None else (type(value), keys, own)
    wrapped = getattr(value, "__wrapped__", None)
    if wrapped is not None:  # `jax.jit`, `jax.custom_vjp`, type checkers: the
        # user's code, and a custom derivative's rules
        rules = [getattr(value, n, None) for n in ("jvp", "fwd", "bwd")]
        rules = [r for r in rules if callable(r)]
        return _key(wrapped, seen) if not rules else _all((wrapped, *rules), seen)
    if isinstance(value, types.FunctionType):
        # Its code and defaults (a function defined anew under the same name),
        # what it closes over and the globals it reads.
        paths = _global_reads(value.__code__)
        if any(p[0] in _DYNAMIC_READS for p in paths):
            return None  # `globals()[name]`, `eval`: reads no bytecode shows
        cells = [c.cell_contents for c in value.__closure__ or () if _filled(c)]
        read = [_read(value.__globals__, path) for path in paths]
        defaults = (value.__defaults__, *(value.__kwdefaults__ or {}).items())
        attrs = tuple(sorted(vars(value).items()))  # `f.scale = ...`
        own = _all(
            (*defaults, *attrs, *cells, *(r for r in read if r is not _UNSET)), seen
        )
        return None if own is None else (value.__code__, own)
    if _library(type(value)) and type(value).__hash__ is not object.__hash__:
        # a Mesh, a NamedSharding: by value
        try:
            return (value, hash(value))
        except Exception:
            return None
    if hasattr(value, "__dict__") or type(value).__hash__ in (object.__hash__, None):
        return None  # attributes that may be set, or hashed by identity
    own = _class(type(value), seen)  # frozen data: its value, and its methods
    try:
        hash(value)  # frozen, but holding a list, say
    except Exception:
        return None
    return None if own is None else (value, own)


#: Builtins that read names no bytecode shows, and an import of a module of
#: the user's inside the function: a function with them is not cached.
_DYNAMIC_READS = frozenset({"globals", "vars", "eval", "exec", "locals", "<import>"})


def _library_module(name: str) -> bool:
    root = name.split(".")[0]
    return root in _LIBRARIES + _STANDARD or root in sys.stdlib_module_names


def _frozen_dataclass(value: object) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return isinstance(value, eqx.Module) or bool(params and params.frozen)


@dataclasses.dataclass(frozen=True, eq=False)
class _Same:
    # An array read by the code, as a key: by identity (JAX arrays are
    # immutable), held so that its id is not reused.
    value: object

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and self.value is other.value

    def __hash__(self) -> int:
        return id(self.value)


_UNSET = object()


def _read(namespace: dict, path: tuple[str, ...]) -> object:
    # `a.b.c` read from the globals: the attributes of the user's own modules
    # followed (a config module's values), a library's module taken whole.
    value = namespace.get(path[0], _UNSET)
    for name in path[1:]:
        if not isinstance(value, types.ModuleType) or _library(value):
            break
        value = getattr(value, name, _UNSET)
    return value


def _all(values: Iterable[object], seen: dict[int, int]) -> Key:
    keys = tuple(_key(v, seen) for v in values)
    return None if None in keys else keys


def _library(value: object) -> bool:
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and _library_module(module)


def _class(cls: type, seen: dict[int, int]) -> Key:
    # What the methods of a class of the user's read, and its class attributes.
    keys = []
    for c in cls.__mro__:
        if c is object or _library(c) or id(c) in seen:
            continue
        seen[id(c)] = len(seen)
        for name, attr in vars(c).items():
            if name.startswith("_abc") or (
                name.startswith("__") and name not in _RUN_BY_A_CALL
            ):
                continue
            if issubclass(c, enum.Enum) and name.startswith("_"):
                continue  # the Enum machinery's tables (`_member_map_`)
            if isinstance(attr, staticmethod | classmethod):
                attr = attr.__func__
            key = _key(attr.fget if isinstance(attr, property) else attr, seen)
            if key is None:
                return None
            keys.append((name, key))
    return tuple(keys)


#: The special methods a call may run (`self @ x`, `self[i]`, `self(x)`):
#: keyed like other methods; not `__init__`, `__repr__` and the like.
_RUN_BY_A_CALL = frozenset(
    f"__{name}__"
    for name in (
        "call getitem getattr iter len contains bool neg pos abs invert array jax_array"
    ).split()
    + [
        f"{r}{op}"
        for op in (
            "add sub mul matmul truediv floordiv mod pow and or xor lshift rshift"
        ).split()
        for r in ("", "r", "i")
    ]
)


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # not yet assigned
        return False
    return True


@functools.cache
def _global_reads(code: types.CodeType) -> tuple[tuple[str, ...], ...]:
    # The globals a function's code (nested functions included) reads, each
    # with the attributes read off it in turn (`cfg.SCALE`: ("cfg", "SCALE")).
    reads: list[tuple[str, ...]] = []
    chained = False  # the last instruction read a global or an attribute of one
    for i in dis.get_instructions(code):
        if i.opname == "LOAD_GLOBAL":
            reads.append((i.argval,))
        elif i.opname == "IMPORT_NAME" and not _library_module(i.argval):
            reads.append(("<import>",))  # `import cfg` in the body: its values
        elif chained and i.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            reads[-1] = (*reads[-1], i.argval)
        chained = i.opname in ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD") and (
            i.opname == "LOAD_GLOBAL" or chained
        )
    nested = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return (*reads, *(r for c in nested for r in _global_reads(c)))


def _classes(tree: PyTree, treedef: jtu.PyTreeDef) -> tuple[object, ...]:  # pyright: ignore[reportInvalidTypeForm]  # jax's stubs declare PyTreeDef a variable
    # The classes of the Modules and other pytree nodes in a call's tree (whose
    # code it runs: a registered dataclass as a layer), in order, the Modules'
    # static fields' values (an activation function, say) and the functions of
    # `jax.tree_util.Partial`s: all held in the structure, where values that
    # compare equal (0.0 and -0.0, 1 and 1.0) are one.
    # A registered class (not a Module) whose attributes cannot be keyed (a
    # list of field names) is left out, as before such classes were keyed,
    # rather than turn the cache off for every call of it.
    nodes = _node_classes(treedef)
    found = dict.fromkeys(c for c in nodes if _class(c, {}) is not None)
    static: list[object] = []
    _walk(tree, found, static)
    return (*found, *static)


@functools.lru_cache(maxsize=64)
def _node_classes(treedef: jtu.PyTreeDef) -> tuple[type, ...]:  # pyright: ignore[reportInvalidTypeForm]  # as above
    found: dict[type, None] = {}
    todo = [treedef]
    while todo:
        node = todo.pop()
        data = node.node_data()
        # Not containers (a NamedTuple's class holds a dict of its defaults).
        if data is not None and not issubclass(data[0], (list, tuple, dict)):
            found[data[0]] = None
        todo += node.children()
    return tuple(found)


def _walk(tree: PyTree, found: dict[type, None], static: list[object]) -> None:
    is_node = lambda x: isinstance(x, eqx.Module | jtu.Partial)  # noqa: E731
    for node in jtu.tree_leaves(tree, is_leaf=is_node):
        if isinstance(node, jtu.Partial):
            static.append(node.func)
            _walk((node.args, node.keywords), found, static)
        elif isinstance(node, eqx.Module):
            found[type(node)] = None
            for field in dataclasses.fields(node):
                value = node.__dict__.get(field.name, _UNSET)
                if value is _UNSET:
                    continue
                if field.metadata.get("static"):
                    static.append(value)
                else:
                    _walk(value, found, static)


#: Programs one eager method keeps for one structure of arguments; past it, a
#: value read from outside them changes at every call (a step counter), and
#: the calls run uncached rather than keep a program each.
MAX_PROGRAMS = 16
#: Values of the static arguments (a Python float, an adapter's number) for
#: one structure that each keep their program; a new one past it is compiled
#: for its call alone.
MAX_VALUES = 64


@dataclasses.dataclass(frozen=True, eq=False)
class _Keyed:
    # A function argument (`method=lambda ...`, a predicate) compared by its
    # code, not by identity (what it reads is in the call's key already): the
    # same lambda written at each call reuses one program.
    fn: object

    def _code(self) -> object:
        return getattr(getattr(self.fn, "func", self.fn), "__code__", None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Keyed) or type(self.fn) is not type(other.fn):
            return False
        return self._code() == other._code()

    def __hash__(self) -> int:
        return hash(self._code())


def _keyed(leaf: object) -> object:
    if not isinstance(leaf, types.FunctionType | functools.partial) or _library(leaf):
        return leaf
    return _Keyed(leaf)


def _unkeyed(tree: PyTree) -> PyTree:
    is_keyed = lambda x: isinstance(x, _Keyed)  # noqa: E731
    return jtu.tree_map(lambda x: x.fn if is_keyed(x) else x, tree, is_leaf=is_keyed)


def compiled_when_eager(
    method: Callable[P, R], *, scanning: bool = True, name: str = ""
) -> Callable[P, R]:
    """A scanning module's call method, run eagerly through one cached
    `eqx.filter_jit` of it (`scanning=False`: any function, compiled in every
    mode; `name`: the method's in a warning)."""

    def typed(cache_key: tuple, /, *args: P.args, **kwargs: P.kwargs) -> R:
        # The key's last entry: the batch of an eager `vmap` around the call.
        with changed_call_state(vmapped=cache_key[-1]):
            return method(*_unkeyed(args), **_unkeyed(kwargs))  # pyright: ignore[reportCallIssue]  # the same arguments, unwrapped

    typed.__name__ = typed.__qualname__ = method.__name__  # its program's name
    jitted = eqx.filter_jit(typed)
    # By structure and static arguments, what the code read at each program.
    programs: dict[tuple, set[Key]] = {}
    by_value: dict[tuple, set[tuple]] = {}
    warned: set[object] = set()
    label = name or method.__qualname__

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        # Options such as `truncate=np.int64(2)` or `reverse=np.bool_(True)` are
        # read as Python values, not traced: a NumPy integer or bool scalar
        # given by keyword is static, like a Python int (in every mode, so
        # that the layers of the loop see what the scan's do).
        kwargs = {
            k: v.item() if isinstance(v, (np.integer, np.bool_)) else v
            for k, v in kwargs.items()
        }  # pyright: ignore[reportAssignmentType]  # the same values
        if scanning and (getattr(args[0], "mode", "scan") == "loop" or tapping()):
            # A tapped call's records are its own rows.
            with call_of(args[0], kwargs.get("reverse")):
                return method(*args, **kwargs)
        leaves, treedef = jtu.tree_flatten(
            (args, kwargs)
        )  # one flatten for both checks
        # (A function given the model in a closure, `tap`'s, is not looked
        # into for offloading: on an accelerator it runs as written.)
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
        if traced and (
            staged() or _offloads(args) or (not scanning and on_accelerator())
        ):
            return method(*args, **kwargs)
        # The program's trace under an eager `vmap` sees one example: the
        # batch joins the key, and `remat="auto"` reads it (as under `jit`).
        batch = _vmapped(args[1:], kwargs) if traced else 1
        # An eager `grad` or `vmap` (tracers, but no staging trace) runs the
        # cached program too: its own scan would be a new program at every
        # call, each kept by JAX (thousands: the process runs out of memory maps).
        # `filter_jit` keys its cache by the non-array leaves' hash and equality,
        # under which True == 1 == 1.0: their types join the key, so that a value
        # the method would refuse never reuses the program of one it accepted.
        static = [leaf for leaf in leaves if not eqx.is_array(leaf)]
        capped: tuple[object, str, int] | None = None  # warned of past the `try`
        try:  # a value whose hash or comparison fails, or too deep: not cached
            reads, keyed, where = _plan(leaves, static, treedef, (args, kwargs))
            # The static arguments' values, for one structure and their types
            # (a Python float that changes at every call).
            values = by_value.setdefault((treedef, *map(type, static)), set())
            if where not in values and len(values) >= MAX_VALUES:
                reads, capped = None, (treedef, _VALUES_MESSAGE, MAX_VALUES)
            elif reads is not None and reads not in programs.setdefault(where, set()):
                if len(programs[where]) >= MAX_PROGRAMS:
                    reads, capped = None, (where, _READS_MESSAGE, MAX_PROGRAMS)
                else:
                    values.add(where)
                    programs[where].add(reads)
        except Exception:
            reads = keyed = None
        if capped is not None and capped[0] not in warned:  # once: the calls
            # that follow are so
            warned.add(capped[0])
            _warn_at_caller(
                capped[1].format(
                    name=label, n=capped[2], docs=checks.docs("debugging.md")
                )
            )
        try:
            if reads is None or keyed is None:
                with changed_call_state(vmapped=batch):
                    return _compiled_once(method, args, kwargs)
            keyed_args, keyed_kwargs = jtu.tree_unflatten(treedef, keyed)
            cache_key = (tuple(map(type, static)), reads, batch)
            return jitted(cache_key, *keyed_args, **keyed_kwargs)  # pyright: ignore[reportCallIssue]  # the same arguments, keyed
        except TypeError as e:
            # An eager `jvp` through a `custom_vjp` (LayerDrop's skip, a layer's
            # own) fails in JAX's rule for the program: run as written, where
            # the error is raised inside the layer or skip that can name it.
            if "forward-mode autodiff" not in str(e):
                raise
            return method(*args, **kwargs)

    return call


def _warn_at_caller(text: str) -> None:
    """Warn at the first frame outside eqxscan (and outside a runtime type
    checker's wrappers): the user's line, through a public function such as
    `run_until` as through a module's method."""
    frame = sys._getframe(1)
    while frame.f_back is not None and _ours(frame):
        frame = frame.f_back
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        text,
        UserWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
        registry=registry,
        module_globals=frame.f_globals,
    )


def _ours(frame: types.FrameType) -> bool:
    package = str(frame.f_globals.get("__name__")).partition(".")[0]
    return package in ("eqxscan", "jaxtyping", "beartype")


def _compiled_once(method: Callable[..., R], args: tuple, kwargs: dict) -> R:
    """`method` compiled for this call alone, through `eqx.filter_jit` (so an
    `eqx.error_if` raises as Equinox's) of a function closing over the other
    leaves than arrays (not hashed: they may not hash). Equinox's `jax.jit` for
    it would keep a program per such function: its cache is cleared after."""
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)

    def _eqxscan_compiled_once(dynamic: PyTree) -> R:
        a, k = eqx.combine(dynamic, static)
        return method(*a, **k)

    once = eqx.filter_jit(_eqxscan_compiled_once)
    try:
        return once(dynamic)
    finally:
        clear = getattr(getattr(once, "_cached", None), "clear_cache", None)
        if clear is not None:
            clear()


def _vmapped(*trees: PyTree) -> int:
    # The batch of an eager `vmap` over the first array passed besides the
    # module (the carry, which `"auto"` counts per batch): one probe a call.
    leaves = jtu.tree_leaves(trees)
    first = next((x for x in leaves if isinstance(x, jax.core.Tracer)), None)
    return 1 if first is None else vmapped_size(first)


def _offloads(args: tuple) -> bool:
    # Inside the cached program residuals would be offloaded, and pass from the
    # forward's program to the backward's: such a call runs as written.
    is_options = lambda x: isinstance(x, ScanOptions)  # noqa: E731
    return any(
        is_options(o) and offloads_between_programs(o.scan_remat)
        for o in jtu.tree_leaves(args, is_leaf=is_options)
    )


def _plan(
    leaves: list,
    static: list,
    treedef: jtu.PyTreeDef,  # pyright: ignore[reportInvalidTypeForm]  # jax's stubs declare PyTreeDef a variable
    tree: PyTree,
) -> tuple[Key, list | None, tuple]:
    """What the code run reads from outside the arguments (the cache's key, with
    the static leaves' types), the leaves with function arguments compared by
    their code, and the structure and static arguments whose programs are
    counted (what a function argument reads is counted, not its identity)."""
    reads = _all((*static, *_classes(tree, treedef)), {})
    keyed = [_keyed(leaf) for leaf in leaves]
    return reads, keyed, (treedef, *(k for k in keyed if not eqx.is_array(k)))


_READS_MESSAGE = (
    "{name}: {n} eager calls with the same arguments' structure each compiled a "
    "program, for values read from outside the arguments (a global, a closure) "
    "that changed; each call now compiles its own.\nHint: pass such a value as an "
    "argument, or call inside eqx.filter_jit. See {docs}."
)
_VALUES_MESSAGE = (
    "{name}: {n} eager calls with the same arguments' structure each compiled a "
    "program, for arguments that are not arrays (a Python number, say) whose "
    "values changed; each call now compiles its own.\nHint: pass such a value "
    "as an array (jnp.asarray(value)), which is traced, not compiled in. See {docs}."
)
