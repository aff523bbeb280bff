"""Validation helpers: every error names what is wrong, where, and what was
expected; `noted` adds the one note naming the layer or step that raised."""

import dataclasses
import inspect
import operator
import os
import traceback
from collections.abc import Callable, Sequence
from typing import (
    Annotated,
    Any,
    cast,
    Literal,
    ParamSpec,
    TYPE_CHECKING,
    TypeAlias,
    TypeGuard,
    TypeVar,
)

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import jax_private as traceback_util


P = ParamSpec("P")
R = TypeVar("R")
HintT = TypeVar("HintT")

# `Checked[T]`: a `T` to type checkers, `object` at run time, so the function's
# own clear error comes first, with or without a runtime type checker.
if TYPE_CHECKING:
    Checked: TypeAlias = Annotated[HintT, "checked by the function itself"]
else:

    class _Checked:
        def __getitem__(self, hint: object) -> type:
            return object

    Checked = _Checked()

# As Equinox does: JAX's filtered tracebacks hide this package's frames.
traceback_util.register_exclusion(os.path.dirname(__file__))

# mkdocs.yml's `site_url`: messages link to its pages.
DOCS_URL = "https://eqxscan.readthedocs.io/en/latest/"


def docs(page: str) -> str:
    """The site's URL of `page` ("debugging.md#anchor"), as mkdocs serves it."""
    path, _, anchor = page.partition("#")
    path = path.removesuffix(".md")
    path = "" if path == "index" else path.removesuffix("/index") + "/"
    return DOCS_URL + path + (f"#{anchor}" if anchor else "")


DEBUGGING_DOCS = f"see {docs('debugging.md')}"


def noted(fn: Callable[P, R], where: str, *args: P.args, **kwargs: P.kwargs) -> R:
    """`fn(*args, **kwargs)`, its errors noted as `noting` notes them."""
    __tracebackhide__ = True
    with noting(where, *args[:1]):
        return fn(*args, **kwargs)


class noting:  # noqa: N801  # used as a function, in `with`
    """Around code run on `carry`: an exception gets one note naming `where`
    ("Layer 3 (Block)"), and a JAX shape error a headline showing the carry. A
    block: no frame in a traceback."""

    def __init__(
        self,
        where: str,
        *carry: object,
        over: Literal["layers", "time"] = "layers",
        hint: str = "",
    ):
        self.where, self.carry, self.over = where, carry, over  # `()` or `(carry,)`
        self.hint = hint  # for a JAX shape error, in place of the usual one

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type | None, e: BaseException | None, tb: object
    ) -> Literal[False]:  # never suppresses
        __tracebackhide__ = True
        if not isinstance(e, Exception):
            return False
        where = self.where
        shown = _input(self.carry) if type(e) in (TypeError, ValueError) else ""
        # An inner `noting` named the layer already (one of a `Chain`'s inside
        # a scanned pattern, say): a headline here would name the outer body.
        inner = any(n.startswith("(raised by ") for n in getattr(e, "__notes__", ()))
        if shown and _raised_by_jax(e) and not inner:
            # JAX's shape errors ("dot_general requires ...") name no layer and
            # no input: a headline that does, the original kept as the cause.
            first = next(iter(str(e).strip().splitlines()), type(e).__name__)
            # Over time the carry is the state, beside each step's input.
            what, hint = (
                ("input", "the input's shape and dtype")
                if self.over == "layers"
                else ("carry", "the carry's and each step's input's shapes and dtypes")
            )
            hint = self.hint or (
                f"Hint: check {hint} against what it expects (the error may also "
                f"be in the code itself); {DEBUGGING_DOCS}."
            )
            raise type(e)(
                f"{where} failed on its {what} {shown}: {first}\n{hint}"
            ) from e
        # `where` also starts sentences ("The cell ..."): lower case mid-note.
        if where.split(" ", 1)[0] in ("The", "Layer"):
            where = where[0].lower() + where[1:]
        note = f"(raised by {where}, run by eqxscan; {DEBUGGING_DOCS})"
        if note not in getattr(e, "__notes__", ()):
            e.add_note(note)
        return False


def _raised_by_jax(e: BaseException) -> bool:
    files = [f.f_code.co_filename for f, _ in traceback.walk_tb(e.__traceback__)]
    name = files[-1].replace(os.sep, "/") if files else ""
    return any(part in name for part in ("/jax/", "/jaxlib/", "/numpy/", "/equinox/"))


def _input(carry: tuple[object, ...]) -> str:
    # The carry, if any, described leaf by leaf; `""` for a module.
    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    if not carry or any(map(is_module, jtu.tree_leaves(carry, is_leaf=is_module))):
        return ""
    leaves, treedef = jtu.tree_flatten(carry[0])
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
        return describe(leaves[0])
    text = str(jtu.tree_unflatten(treedef, [_Shown(describe(x)) for x in leaves]))
    return text if len(text) <= 200 else text[:197] + "..."


class _Shown(str):
    __repr__ = str.__str__


def describe(x: object) -> str:
    """`float32[8,16]` for arrays, `repr` (shortened) for anything else."""
    # An array, or what stands for one (a jaxpr's value).
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or hasattr(
        x, "aval"
    ):
        x = cast(jax.ShapeDtypeStruct, x)
        shape = ",".join(str(d) for d in x.shape)
        # PRNG keys have an extended dtype (`key<fry>`), which NumPy cannot read.
        extended = jnp.issubdtype(x.dtype, jax.dtypes.extended)
        return f"{x.dtype if extended else jnp.dtype(x.dtype).name}[{shape}]"
    if isinstance(x, tuple | list) and type(x) in (tuple, list):  # not a NamedTuple
        inner = ", ".join(describe(e) for e in x)
        comma = "," if type(x) is tuple and len(x) == 1 else ""
        text = f"({inner}{comma})" if type(x) is tuple else f"[{inner}]"
    elif isinstance(x, dict) and type(x) is dict:
        text = "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in x.items()) + "}"
    else:
        text = " ".join(repr(x).split())  # a module's repr: one line, in an error's
    return text if len(text) <= 80 else text[:77] + "..."


def is_array(x: object) -> TypeGuard[jax.Array | np.ndarray | np.generic]:
    """`eqx.is_array`, as a type guard."""
    return eqx.is_array(x)


def is_arraylike(
    x: object,
) -> TypeGuard[jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct]:
    """An array, or the `jax.ShapeDtypeStruct` standing for one (`eval_shape`)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def check_like(who: str, like: object, example: str = "make_model, key") -> None:
    if not any(is_arraylike(x) for x in jtu.tree_leaves(like)):
        raise TypeError(
            f"{who}: like must be a model of the saved layout, with arrays (or "
            f"jax.ShapeDtypeStructs) in it, got {describe(like)}.\nHint: pass a "
            "model built with the saved configuration, e.g. "
            f"eqx.filter_eval_shape({example})."
        )


def listed(items: list[str], sep: str = "; ") -> str:
    """At most 10 of `items`, and how many more."""
    more = f" and {len(items) - 10} more" if len(items) > 10 else ""
    return sep.join(items[:10]) + more


Found = tuple[str, str, str]


def first_difference(
    a: PyTree,
    b: PyTree,
    leaf: Callable[[object, object, str], Found | None] | None = None,
) -> Found | None:
    """The first place where two pytrees differ in structure, static data (modules
    walked field by field), shape or dtype, as `(path, description of a, of b)`;
    `None` if they agree. Two non-array leaves are judged by `leaf(a, b, path)`."""

    def walk(a: object, b: Any, path: str) -> Found | None:
        if is_arraylike(a) or is_arraylike(b):
            # Two arrays agree iff their descriptions (dtype and shape) do.
            da, db = (
                f"type {type(x).__name__}" if isinstance(x, eqx.Module) else describe(x)
                for x in (a, b)
            )
            both = is_arraylike(a) and is_arraylike(b)
            return None if both and da == db else (path, da, db)
        is_leaf = lambda x: jtu.treedef_is_leaf(jtu.tree_structure(x))  # noqa: E731
        if type(a) is not type(b):
            if leaf is not None and is_leaf(a) and is_leaf(b):  # `leaf` judges
                return leaf(a, b, path)  # values of two types (jnp.float32, a dtype)
            return path, f"type {type(a).__name__}", f"type {type(b).__name__}"
        if dataclasses.is_dataclass(a) and not isinstance(a, type):  # a Module too
            pairs = [
                (getattr(a, f.name, None), getattr(b, f.name, None), f".{f.name}")
                for f in dataclasses.fields(a)
                if hasattr(a, f.name) or hasattr(b, f.name)
            ]
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return path, f"length {len(a)}", f"length {len(b)}"
            pairs = [(x, y, f"[{i}]") for i, (x, y) in enumerate(zip(a, b))]
        elif isinstance(a, dict):
            if set(a) != set(b):
                ka, kb = (f"keys {sorted(map(str, d))}" for d in (a, b))
                return path, ka, kb
            pairs = [(a[k], b[k], f"[{k!r}]") for k in a]
        elif is_leaf(a):
            if leaf is not None:
                return leaf(a, b, path)
            return None if same_leaf(a, b) else (path, describe(a), describe(b))
        else:
            # Another registered pytree node: flattened one level.
            la, ta = jtu.tree_flatten(a, is_leaf=lambda x: x is not a)
            lb, tb = jtu.tree_flatten(b, is_leaf=lambda x: x is not b)
            if ta != tb:
                return path, f"structure {ta}", f"structure {tb}"
            pairs = [(x, y, f"<{i}>") for i, (x, y) in enumerate(zip(la, lb))]
        diffs = (walk(x, y, path + where) for x, y, where in pairs)
        return next((d for d in diffs if d is not None), None)

    return walk(a, b, "")


def same_leaf(x: object, y: object) -> bool:
    if is_array(x) and is_array(y):
        return x.shape == y.shape and x.dtype == y.dtype
    if is_array(x) or is_array(y):
        return False
    try:
        return bool(x is y or x == y)
    except Exception:
        return False


class CarryError(TypeError):
    """A step returned a carry unlike its input: `what` changed, at `step` (`None`
    for a scan's one body), so a caller can name the step anew."""

    def __init__(self, where: str, what: str, step: int | None = None):
        super().__init__(f"{where} {what}")
        self.what, self.step = what, step


def check_carry(
    old: PyTree,
    new: PyTree,
    where: str,
    step: int | None = None,
    over: Literal["layers", "time"] = "layers",
) -> None:
    """Raise `CarryError` unless `new` has the structure, shapes and dtypes of
    `old` (`over`: a layer's carry, or a time step's, whose cell has no `.scan`)."""
    old_def, new_def = jtu.tree_structure(old), jtu.tree_structure(new)
    if old_def != new_def:
        detail = ""
        if (diff := first_difference(old, new)) is not None:
            path, a, b = diff
            detail = f" At `carry{path}` the input has {a} but the output has {b}."
        pair = isinstance(new, tuple) and len(new) == 2 and _like(old, new[0])
        if pair and over == "layers":
            detail += (
                " (A layer returning `(carry, y)` is run with `.scan(x)`, which "
                "stacks the y's.)"
            )
        raise CarryError(
            where,
            "returned a carry whose tree structure differs from its input "
            f"carry.{detail} Every step must return a carry of the same structure, "
            f"shapes and dtypes as it receives (input {old_def}, output {new_def}).",
            step,
        )
    leaves = jtu.tree_leaves_with_path(old)
    for (path, a), b in zip(leaves, jtu.tree_leaves(new)):
        if same_leaf(a, b):
            continue
        hint = ""
        exact = lambda x: not jnp.issubdtype(x.dtype, jnp.inexact)
        if eqx.is_array(a) and eqx.is_array(b) and exact(a) and not exact(b):
            # An integer initial carry into float layers: start it in floats.
            hint = (
                f" (the carry came in as {jnp.dtype(a.dtype).name}: start it in "
                f"{jnp.dtype(b.dtype).name}, e.g. `jnp.zeros(..., "
                f"jnp.{jnp.dtype(b.dtype).name})`)"
            )
        elif eqx.is_array(a) and eqx.is_array(b) and a.shape == b.shape:
            wider = jnp.dtype(b.dtype).itemsize > jnp.dtype(a.dtype).itemsize
            hint = (
                f" (a dtype {'promotion' if wider else 'change'}: cast the "
                "layer's result back, e.g. "
                f"`.astype({jnp.dtype(a.dtype).name})`, or keep its parameters and "
                f"inputs in {jnp.dtype(a.dtype).name})"
            )
        elif not eqx.is_array(a):
            hint = " (carry leaves that change must be JAX arrays: use jnp.asarray)"
        raise CarryError(
            where,
            f"changed carry leaf `carry{jtu.keystr(path)}` from "
            f"{describe(a)} to {describe(b)}{hint}. Every step must return a carry "
            "with the same structure, shapes and dtypes as it receives.",
            step,
        )


def _like(old: PyTree, new: PyTree) -> bool:
    return jtu.tree_structure(old) == jtu.tree_structure(new) and all(
        same_leaf(a, b) for a, b in zip(jtu.tree_leaves(old), jtu.tree_leaves(new))
    )


def misaligned(tree: PyTree, length: int) -> tuple[str, jax.Array] | None:
    """The first array leaf of `tree` (key path, leaf) whose leading axis is not
    `length` (a scalar has none)."""
    for path, leaf in jtu.tree_leaves_with_path(tree):
        if is_array(leaf) and (leaf.ndim == 0 or leaf.shape[0] != length):
            return jtu.keystr(path), leaf  # pyright: ignore[reportReturnType]
    return None


def check_option(name: str, value: object, allowed: Sequence[object]) -> None:
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}.")


def check_unroll(unroll: object) -> None:
    if isinstance(unroll, bool) or (isinstance(unroll, str) and unroll == "auto"):
        return
    if not isinstance(unroll, int):
        raise TypeError(
            "unroll must be a positive int, a bool or 'auto', got "
            f"{type(unroll).__name__}."
        )
    if unroll < 1:
        raise ValueError(f"unroll must be >= 1 (or a bool), got {unroll}.")


def check_callable(name: str, value: object) -> Callable[..., Any]:
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__}.")
    return value


def check_takes_key(fn: object, what: str, per: str) -> None:
    """Raise `TypeError` unless `fn` takes `key=`; `what` was given the key,
    `per` says how it hands keys out ("layer i gets key=keys[i]")."""
    if not callable(fn):  # let the call say so
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: let the call decide
        return
    if any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "key" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in signature.parameters.values()
    ):
        return
    if inspect.isfunction(fn) or inspect.ismethod(fn) or hasattr(fn, "__func__"):
        name = target = fn.__qualname__  # Equinox's bound methods included
    else:
        name = type(fn).__name__
        target = f"{name}.__call__"
    bare = ", ".join(
        str(p.replace(annotation=p.empty)) for p in signature.parameters.values()
    )
    raise TypeError(
        f"{what} was called with `key=...` and passes it on ({per}), but "
        f"{name}({bare}) takes no `key` argument. Call it without `key` if "
        f"{name} needs no randomness, or give {target} a keyword-only "
        "`key=None` parameter."
    )


def check_size(
    name: str,
    value: object,
    minimum: int = 1,
    maximum: int | None = None,
    hint: str = "",
) -> int:
    """`value` (an index but not a `bool`) as an `int` in `[minimum, maximum]`."""
    size = None if isinstance(value, bool) else _index(value)
    if size is None:
        raise TypeError(
            f"{name} must be an int (or a NumPy integer), got "
            f"{type(value).__name__} ({value!r})."
        )
    if size < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {size}.")
    if maximum is not None and size > maximum:
        raise ValueError(
            f"{name} must be at most {maximum}, got {size}."
            + (f"\n{hint}" if hint else "")
        )
    return size


def _index(value: object) -> int | None:
    try:
        return operator.index(value)  # pyright: ignore[reportArgumentType]  # any `__index__`
    except TypeError:
        return None


def check_bool(name: str, value: object) -> bool:
    """`value` as a `bool` if it is one (a string `"False"` would count as true)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r}).")


def check_index(index: object, length: int, who: str, hint: str) -> int:
    """`index` in `range(length)` (negative from the end); `hint`: what to do
    instead of a traced index."""
    if isinstance(index, jax.core.Tracer):
        raise TypeError(
            f"{who} got a traced index (e.g. a jit argument); indices must be "
            f"concrete ints: {hint}"
        )
    # A bool is an int to Python but a mask to NumPy and JAX: neither is meant.
    if isinstance(index, (bool, np.bool_)) or (i := _index(index)) is None:
        raise TypeError(
            f"{who} indices must be ints or slices, got {type(index).__name__}."
        )
    if not -length <= i < length:
        raise IndexError(
            f"Layer index {i} is out of range for a {who} with {length} layers."
        )
    return i % length


def split_key(key: object, num: int, who: str) -> jax.Array:
    """`jax.random.split(key, num)` once `key` is one PRNG key (typed, or a raw
    `uint32[2]`), else an error naming `who`."""
    typed = False
    if isinstance(key, (jax.Array, np.ndarray)):
        typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        if key.shape == (() if typed else (2,)) and (typed or key.dtype == np.uint32):
            return jax.random.split(key, num)
    one = "one key, not a batch of keys" if typed else "one key (jax.random.key(seed))"
    raise TypeError(
        f"{who} needs `key` to be one JAX PRNG key, got {describe(key)}.\nHint: "
        f"pass {one}; eqxscan splits it into one per layer or step."
    )


def check_mesh(mesh: object) -> jax.sharding.Mesh:
    """`mesh`, refused unless it is a `jax.sharding.Mesh`."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one "
            "with eqxscan.sharding.make_mesh or jax.make_mesh."
        )
    return mesh
