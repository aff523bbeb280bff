"""How `Chain` groups its layers: a dynamic programme over groupings.

Layers are first labelled by `stack_classes` (two layers share a label iff they
can be stacked together); `plan` then picks the grouping of the labels that
traces the fewest layer bodies.
"""

import functools
from collections.abc import Sequence
from typing import NamedTuple

from .._alike import alike


class Group(NamedTuple):
    """One group of a `Plan`: the next `size` layers.

    - `period == 0`: one lone layer (`size == 1`), called directly.
    - `period == 1`: a run of `size` like layers, scanned.
    - `period == K >= 2`: `size // K` repeats of a unit of `K` layers, scanned one
      unit per step; `unit` is the plan of one repeat.
    """

    size: int
    period: int
    unit: "Plan" = ()


Plan = tuple[Group, ...]
"""The groups of a sequence of layers, in order."""


class _Cost(NamedTuple):
    # Compared in this order: layer bodies traced, then groups (those inside
    # units included).
    bodies: int
    groups: int


def stack_classes(layers: Sequence[object]) -> tuple[int, ...]:
    """Label layers so that two share a label iff they can be stacked together."""
    reps: list[object] = []
    labels = []
    for layer in layers:
        label = next((j for j, rep in enumerate(reps) if alike(rep, layer)), None)
        if label is None:
            label = len(reps)
            reps.append(layer)
        labels.append(label)
    return tuple(labels)


def plan(classes: tuple[int, ...], periodic: bool) -> Plan:
    """The grouping of a sequence of layer classes with the smallest program.

    Cost of a grouping, compared lexicographically: (1) the number of layer
    bodies traced (a lone layer or a scanned run traces one body; a periodic
    group traces the bodies of its unit's own best grouping, once for all
    repeats), then (2) the number of groups, counting those inside units. Ties go
    to the grouping whose first group covers the most layers, so the choice is
    deterministic and a remainder comes last.

    **Example:** a stem `S`, then `(local, local, global)` three times, then a
    head `H`, has classes `(0, 1, 1, 2, 1, 1, 2, 1, 1, 2, 3)`. The plan is

    ```python
    (
        Group(1, 0),  # S, called directly
        Group(9, 3, (Group(2, 1), Group(1, 0))),  # 3 repeats of [local x2, global]
        Group(1, 0),  # H
    )
    ```

    which traces four layer bodies (S, local, global, H) however many repeats
    there are. With `periodic=False` only runs are scanned:
    `S, local x2, global, local x2, global, local x2, global, H` (eight groups,
    eight bodies).
    """
    return _best(classes, periodic)[0]


@functools.cache
def _best(classes: tuple[int, ...], periodic: bool) -> tuple[Plan, _Cost]:
    n = len(classes)
    # best[i]: the cost of classes[i:] and its first group.
    best: list[tuple[_Cost, Group | None]] = [(_Cost(0, 0), None)] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = min(
            (
                (_Cost(c.bodies + rest.bodies, c.groups + rest.groups), g)
                for c, g in _candidates(classes, i, periodic)
                for rest in [best[i + g.size][0]]
            ),
            key=lambda t: (t[0], -t[1].size),
        )
    groups, i = [], 0
    while i < n:
        group = best[i][1]
        assert group is not None
        groups.append(group)
        i += group.size
    return tuple(groups), best[0][0]


def _candidates(
    classes: tuple[int, ...], i: int, periodic: bool
) -> list[tuple[_Cost, Group]]:
    """Every group that may start at layer `i`, with its own cost."""
    n = len(classes)
    options = [(_Cost(1, 1), Group(1, 0))]
    run = 1
    while i + run < n and classes[i + run] == classes[i]:
        run += 1
    options.extend((_Cost(1, 1), Group(m, 1)) for m in range(2, run + 1))
    if not periodic:
        return options
    # A unit inside the run would be one class repeated: the run does better.
    for k in range(max(2, run + 1), (n - i) // 2 + 1):
        unit = classes[i : i + k]
        repeats = 1
        while classes[i + repeats * k : i + (repeats + 1) * k] == unit:
            repeats += 1
        if repeats < 2 or not _primitive(unit):
            continue  # a power of a shorter unit: that unit does better
        inner, cost = _best(unit, periodic)
        options.extend(
            (_Cost(cost.bodies, 1 + cost.groups), Group(p * k, k, inner))
            for p in range(2, repeats + 1)
        )
    return options


def _primitive(unit: tuple[int, ...]) -> bool:
    """Whether `unit` is not a repeat of a shorter unit."""
    k = len(unit)
    return not any(
        k % d == 0 and unit == unit[:d] * (k // d) for d in range(1, k // 2 + 1)
    )
