"""When two layers are alike enough to share one traced body.

Layers stack when they have the same structure, shapes and dtypes and the same
non-array data (static fields, activation functions, markers). "The same" cannot
always mean `==`: a `functools.partial` or a lambda made once per layer, or an
`eqx.nn.StateIndex` (whose marker is a fresh `object()` per instance), differ
only by identity. Where the difference is provably only identity, the layers are
alike and stack as if they shared the first layer's object; where identity is all
that can be compared (an object without `__eq__`), the answer is "unknown", so
that callers can say so instead of silently keeping the layers apart.
"""

import dataclasses
import functools
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .checks import describe, docs, first_difference, same_leaf


Verdict = Literal["same", "different", "unknown"]


class Difference(NamedTuple):
    """Where two layers differ: the leaf path, both values described, and whether
    they differ (`"different"`) or only by identity (`"unknown"`)."""

    path: str
    a: str
    b: str
    verdict: Verdict


def _describe(x: object) -> str:
    # `repr` of a partial is long and hides its arguments past 80 characters.
    if isinstance(x, functools.partial):
        func = getattr(x.func, "__name__", None) or describe(x.func)
        args = [describe(a) for a in x.args]
        args += [f"{k}={describe(v)}" for k, v in x.keywords.items()]
        return f"partial({', '.join([func, *args])})"
    return describe(x)


def _concrete_equal(a: object, b: object) -> Verdict:
    # Arrays closed over by a function: compare values when they are concrete.
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return "unknown"
    a, b = np.asarray(a), np.asarray(b)
    same = a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
    return "same" if same else "different"


def _all(verdicts: Iterable[Verdict]) -> Verdict:
    result: Verdict = "same"
    for v in verdicts:
        if v != "same":
            result = v
        if v == "different":
            break
    return result


def _sequence(a: Sequence[object], b: Sequence[object]) -> Verdict:
    if len(a) != len(b):
        return "different"
    return _all(value_verdict(x, y) for x, y in zip(a, b))


def _function(a: types.FunctionType, b: types.FunctionType) -> Verdict:
    # One `def` or `lambda` evaluated more than once: same code, same globals;
    # what may differ is what each instance captured.
    if a.__code__ is not b.__code__ or a.__globals__ is not b.__globals__:
        return "different"

    def parts(f: types.FunctionType) -> tuple[object, ...]:
        cells = [c.cell_contents for c in f.__closure__ or ()]
        return f.__defaults__ or (), f.__kwdefaults__ or {}, cells

    return _sequence(parts(a), parts(b))


def _hidden_arrays(x: object) -> list[object]:
    # The arrays of a module or dataclass, which `compare` judged by shape only.
    leaves = jtu.tree_leaves(x)
    if not (len(leaves) == 1 and leaves[0] is x):  # a pytree
        return [leaf for leaf in leaves if eqx.is_array(leaf)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [
            a
            for f in dataclasses.fields(x)
            for a in _hidden_arrays(getattr(x, f.name, None))
        ]
    return [x] if eqx.is_array(x) else []


_NUMBERS = {bool, int, float, complex}
_CONTAINERS = (tuple, list, dict)


def value_verdict(a: object, b: Any) -> Verdict:
    """Whether two non-array values (static data, functions) are the same (`b:
    Any`: past `type(a) is type(b)` it has `a`'s type, which pyright cannot see)."""
    if a is b:
        return "same"
    if eqx.is_array(a) or eqx.is_array(b) or isinstance(a, np.ndarray):
        return _concrete_equal(a, b)
    if type(a) is not type(b):
        # Python's numbers compute apart where `==` takes them for one (True
        # and 1, 1 and 1.0), as do containers; other values alike where equal
        # (a dtype as `jnp.float32` or `np.dtype("float32")`).
        if {type(a), type(b)} <= _NUMBERS or isinstance(a, _CONTAINERS):
            return "different"
        try:
            return "same" if bool(a == b) else "different"
        except Exception:
            return "different"
    if type(a) is object:
        # A bare `object()` is only ever a unique marker (e.g. `StateIndex`'s).
        return "same"
    if isinstance(a, float | complex):  # -0.0 is not 0.0 (its sign
        return "same" if repr(a) == repr(b) else "different"  # reads apart)
    if isinstance(a, functools.partial):
        return _sequence((a.func, a.args, a.keywords), (b.func, b.args, b.keywords))
    if isinstance(a, types.FunctionType):
        return _function(a, b)
    if isinstance(a, types.MethodType):
        return _sequence((a.__func__, a.__self__), (b.__func__, b.__self__))
    if isinstance(a, dict):  # keys in order, then values
        a, b = list(a.items()), list(b.items())
    if isinstance(a, (tuple, list)):
        return _sequence(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):  # a Module too
        diff = compare(a, b)
        if diff is not None:
            return diff.verdict
        # Here outside the stacked pytree (closed over, in a partial), its arrays
        # would not be stacked: alike only with equal values.
        pairs = zip(_hidden_arrays(a), _hidden_arrays(b), strict=True)
        return _all(_concrete_equal(x, y) for x, y in pairs)
    try:
        if bool(a == b):
            return "same"
    except Exception:
        return "unknown"
    # An object without `__eq__` compares by identity only.
    return "unknown" if type(a).__eq__ is object.__eq__ else "different"


def compare(a: PyTree, b: PyTree, weak: bool = False) -> Difference | None:
    """The first place where two layers differ in a way that keeps them from
    sharing one body: structure, shape, dtype or non-array data. A difference
    that can only be judged by identity is reported only if nothing really
    differs; with `weak`, a weakly typed array leaf against a strongly typed
    one too. `None` when the layers are alike."""
    unknown: list[Difference] = []

    def leaf(x: object, y: object, where: str) -> tuple[str, str, str] | None:
        verdict = value_verdict(x, y)
        if verdict == "same":
            return None
        found = (where, _describe(x), _describe(y))
        if verdict == "unknown":
            unknown.append(Difference(*found, "unknown"))
            return None
        return found

    diff = first_difference(a, b, leaf=leaf)
    if diff is not None:
        return Difference(*diff, "different")
    return (_weak_difference(a, b) if weak else None) or (
        unknown[0] if unknown else None
    )


def _weak(x: object) -> bool:
    return bool(getattr(x, "weak_type", False))


def weak_only(a: object, b: object) -> bool:
    """Whether `a` is a weakly typed array and `b` a strongly typed one."""
    return eqx.is_array(b) and _weak(a) and not _weak(b)


def _weak_difference(a: PyTree, b: PyTree) -> Difference | None:
    # A weakly typed array (`jnp.asarray(0.5)`) takes the dtype of what it
    # meets; stacked with a strongly typed one it would become strong, and
    # compute in its own dtype.
    for (path, x), y in zip(jtu.tree_leaves_with_path(a), jtu.tree_leaves(b)):
        if eqx.is_array(x) and _weak(x) != _weak(y):
            text = lambda v: describe(v) + (" (weakly typed)" if _weak(v) else "")  # noqa: E731
            return Difference(jtu.keystr(path), text(x), text(y), "different")
    return None


def alike(a: PyTree, b: PyTree, weak: bool = False) -> bool:
    """Whether `a` and `b` can share one traced body (never raises); with
    `weak`, only if their array leaves are alike weakly typed (stacked, a weak
    leaf becomes strong: it then computes in its own dtype, where the weak one
    took the dtype of what it met)."""
    try:
        ta, tb = jtu.tree_structure(a), jtu.tree_structure(b)
        # Treedefs compare static data with `==` (True == 1 == 1.0, 0.0 ==
        # -0.0): equal, and printed alike, they hold the same values.
        if (
            ta == tb
            and str(ta) == str(tb)
            and all(
                (
                    same_leaf(x, y)  # an array's shape and dtype; else its value,
                    if eqx.is_array(x) or eqx.is_array(y)  # 1 not 1.0
                    else value_verdict(x, y) == "same"
                )
                and (not weak or _weak(x) == _weak(y))
                for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
            )
        ):
            return True  # the common, fast case: equal treedefs and leaves
        return compare(a, b, weak) is None
    except Exception:
        return False


def stack_alike(layers: list[PyTree]) -> PyTree:
    """Stack `alike` layers on a new axis 0. Non-array data is the first layer's,
    so layers that differ only by identity end up sharing its objects."""
    first, treedef = jtu.tree_flatten(layers[0])
    columns = [first] + [jtu.tree_leaves(layer) for layer in layers[1:]]
    stacked = [
        jnp.stack(leaves) if eqx.is_array(leaves[0]) else leaves[0]
        for leaves in zip(*columns)
    ]
    return jtu.tree_unflatten(treedef, stacked)


def layer_list(layers: object, what: str) -> list:
    """`layers` (a sequence, or a module iterating over its layers) as a list;
    a dict's keys, a string's letters or one layer refused."""
    try:
        iter(layers)  # pyright: ignore[reportCallIssue, reportArgumentType]  # any object
        iterable = not isinstance(layers, str | bytes | Mapping | jax.Array)
    except TypeError:
        iterable = False
    if not iterable:
        raise TypeError(
            f"{what} takes a sequence of layers, got {type(layers).__name__}.\n"
            f"Hint: pass a list, e.g. `{what}([layer])` for one layer."
        )
    return list(layers)  # pyright: ignore[reportCallIssue, reportArgumentType]  # iterable


def check_alike(
    layers: list[PyTree], what: str, names: tuple[str, str] | None = None
) -> None:
    """Raise `ValueError` naming the first layer that cannot share a body with
    layer 0, the leaf path and both values (`names`: of two layers)."""
    if len(layers) == 0:
        raise ValueError(f"{what}: need at least one layer, got an empty sequence.")
    for i, layer in enumerate(layers[1:], start=1):
        if alike(layers[0], layer):
            continue
        diff = compare(layers[0], layer)
        assert diff is not None  # `alike` found them different
        hint = (
            "\nHint: these objects compare by identity only: create one and pass "
            "the same object to every layer."
            if diff.verdict == "unknown"
            else "\nHint: stacked layers need identical structure, static fields, "
            "non-array leaves, shapes and dtypes (a quantized or adapted stack "
            "takes a layer made the same way)."
        )
        first, other = names or ("layer 0", f"layer {i}")
        raise ValueError(
            f"{what}: {other} ({type(layer).__name__}) cannot be stacked with "
            f"{first} ({type(layers[0]).__name__}): at `{diff.path or '<root>'}` "
            f"{first} has {diff.a} but {other} has {diff.b}.{hint}"
        )


def _is_index(x: object) -> bool:
    return isinstance(x, eqx.nn.StateIndex)


def holds_state(tree: PyTree) -> bool:
    """Whether `tree` holds an `eqx.nn.StateIndex`."""
    return any(map(_is_index, jtu.tree_leaves(tree, is_leaf=_is_index)))


def check_state_order(layers: PyTree, index: slice, length: int, who: str) -> None:
    """Refuse a slice that reverses stateful layers: an `eqx.nn.State` keeps their
    states in the stored order, which the reversed layers would read."""
    if index.indices(length)[2] > 0 or len(range(length)[index]) < 2:
        return
    if holds_state(layers):
        raise ValueError(
            f"Cannot take {index} of a {who} of stateful layers (with an "
            "eqx.nn.StateIndex): it reverses them, but their eqx.nn.State keeps "
            f"the {who}'s order, so each layer would read another's state.\nHint: "
            "run them backwards with `model(x, state, reverse=True)`, each with "
            f"its own state (see {docs('idioms.md')})."
        )


def check_state_indices(current: PyTree, layer: PyTree, what: str) -> None:
    """Refuse a layer whose `eqx.nn.StateIndex`es are not those of the one it
    replaces, made with a state: its state would not be in the model's."""

    def markers(tree: PyTree) -> dict[str, object]:
        leaves = jtu.tree_leaves_with_path(tree, is_leaf=_is_index)
        return {jtu.keystr(p): x.marker for p, x in leaves if _is_index(x)}

    new = markers(layer)
    for path, marker in markers(current).items():
        if isinstance(marker, str) and new.get(path, marker) != marker:
            raise ValueError(
                f"{what}: the new layer's eqx.nn.StateIndex at `{path}` is not the "
                "stack's, so its state is not in the model's eqx.nn.State.\nHint: "
                "build the new layer from the old, e.g. `eqx.tree_at(lambda l: "
                "l.linear, stack[i], linear)`, which keeps its state (see "
                f"{docs('idioms.md')})."
            )
