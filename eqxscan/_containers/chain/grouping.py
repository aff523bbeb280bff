"""How `Chain` groups its layers: `stack_classes` labels them (two share a label
iff they can be stacked together), then `plan`, a dynamic programme, picks the
grouping of the labels that traces the fewest layer bodies; `why_alone` says why
a layer is alone, and `warn_identity` warns when only object identity kept like
layers apart."""

import functools
import warnings
from collections.abc import Sequence
from typing import NamedTuple

from ..._helpers.stackable import alike, compare


class Group(NamedTuple):
    """One group of a `Plan`: the next `size` layers, `per_step` of them per scan
    step as in a `Placement` (`0`: a lone layer; `1`: a stack; `K >= 2`: a
    pattern of `K` layers, `pattern` the plan of one repeat)."""

    size: int
    per_step: int
    pattern: "Plan" = ()


Plan = tuple[Group, ...]
"""The groups of a sequence of layers, in order."""


_Cost = tuple[int, int]  # layer bodies traced, then groups (in patterns too)


def stack_classes(layers: Sequence[object]) -> tuple[int, ...]:
    """Label layers so that two share a label iff they can be stacked together."""
    reps: list[object] = []
    labels = []
    for layer in layers:
        # Weak types apart: a weakly typed leaf stacked with strong ones would
        # compute in its own dtype (a bfloat16 carry promoted to float32).
        label = next(
            (j for j, rep in enumerate(reps) if alike(rep, layer, weak=True)), None
        )
        if label is None:
            label = len(reps)
            reps.append(layer)
        labels.append(label)
    return tuple(labels)


def plan(classes: tuple[int, ...], patterns: bool) -> Plan:
    """The grouping of a sequence of layer classes with the smallest program.

    Cost, compared lexicographically: the layer bodies traced (a lone layer or
    a stack traces one; a repeated pattern those of its own best grouping, once
    for all repeats), then the groups, counting those inside patterns. Ties go
    to the grouping whose first group covers the most layers, so that the
    choice is deterministic and a remainder comes last.

    For example, a stem `S`, `(local, local, global)` three times and a head
    `H` (classes `(0, 1, 1, 2, 1, 1, 2, 1, 1, 2, 3)`) give
    `(Group(1, 0), Group(9, 3, (Group(2, 1), Group(1, 0))), Group(1, 0))`:
    four bodies however many repeats. With `patterns=False` only stacks are
    scanned: eight groups, eight bodies.
    """
    return _best(classes, patterns)[1]


@functools.cache
def _best(classes: tuple[int, ...], patterns: bool) -> tuple[_Cost, Plan]:
    # best[i]: the cost and plan of classes[i:].
    best: list[tuple[_Cost, Plan]] = [((0, 0), ())] * (len(classes) + 1)
    for i in range(len(classes) - 1, -1, -1):
        cost, g = min(
            (
                ((bodies + rest[0], groups + rest[1]), g)
                for (bodies, groups), g in _candidates(classes, i, patterns)
                for rest, _ in [best[i + g.size]]
            ),
            key=lambda t: (t[0], -t[1].size),
        )
        best[i] = cost, (g, *best[i + g.size][1])
    return best[0]


def _candidates(
    classes: tuple[int, ...], i: int, patterns: bool
) -> list[tuple[_Cost, Group]]:
    """Every group that may start at layer `i`, with its own cost."""
    n = len(classes)
    options: list[tuple[_Cost, Group]] = [((1, 1), Group(1, 0))]
    same = 1  # how many layers from `i` on share its class
    while i + same < n and classes[i + same] == classes[i]:
        same += 1
    options.extend(((1, 1), Group(m, 1)) for m in range(2, same + 1))
    if not patterns:
        return options
    # A pattern within those layers would be one class repeated: the stack
    # does better.
    for k in range(max(2, same + 1), (n - i) // 2 + 1):
        pattern = classes[i : i + k]
        repeats = 1
        while classes[i + repeats * k : i + (repeats + 1) * k] == pattern:
            repeats += 1
        if repeats < 2 or not _primitive(pattern):
            continue  # a shorter pattern repeated: that pattern does better
        (bodies, groups), inner = _best(pattern, patterns)
        options.extend(
            ((bodies, 1 + groups), Group(p * k, k, inner))
            for p in range(2, repeats + 1)
        )
    return options


def _primitive(pattern: tuple[int, ...]) -> bool:
    """Whether `pattern` is not a shorter pattern repeated."""
    k = len(pattern)
    return not any(
        k % d == 0 and pattern == pattern[:d] * (k // d) for d in range(1, k // 2 + 1)
    )


def why_alone(layers: Sequence[object], j: int, i: int) -> str:
    """Why layer `i`, alone, is not scanned with its neighbour `j`."""
    diff = compare(layers[j], layers[i], weak=True)
    if diff is None:
        return (
            f"like layer {j}, but the chosen grouping traces fewer layer bodies "
            "without it"
        )
    text = (
        f"unlike layer {j} ({type(layers[j]).__name__}) at "
        f"`{diff.path or '<root>'}`: it has {diff.b}, layer {j} has {diff.a}"
    )
    if diff.verdict == "unknown":
        text += " (compared by identity only: pass one shared object to scan them)"
    return text


def warn_identity(layers: Sequence[object], labels: Sequence[int]) -> None:
    """Warn once if two neighbouring layers are kept apart only because an object
    they hold compares by identity (it may well be the same thing made twice)."""
    for i in range(len(layers) - 1):
        if labels[i] == labels[i + 1]:
            continue
        diff = compare(layers[i], layers[i + 1], weak=True)
        if diff is None or diff.verdict != "unknown":
            continue
        warnings.warn(
            f"Chain: layers {i} and {i + 1} ({type(layers[i]).__name__}) are not "
            f"scanned together: at `{diff.path}` they hold {diff.a} and {diff.b}, "
            "which compare by identity only. Create the object once and pass the "
            "same object to every layer (or give its class an `__eq__`) to scan "
            "them as one group; `chain.explain()` shows the grouping.",
            UserWarning,
            stacklevel=4,
        )
        return
