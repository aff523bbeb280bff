"""What a `Chain` says about its grouping: a warning when only object identity
kept like layers apart, and a plain-text account of every group."""

import warnings
from collections.abc import Sequence

from ..._helpers.stackable import compare


def _reason(layers: Sequence[object], j: int, i: int) -> str:
    # Why layer `i`, alone, is not scanned with its neighbour `j`.
    diff = compare(layers[j], layers[i])
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
        diff = compare(layers[i], layers[i + 1])
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


def explain(
    layers: Sequence[object],
    layout: Sequence[tuple[int, int, int]],
    names: Sequence[str],
    bodies: int,
) -> str:
    """One line per group (`layout` holds `(start, size, per_step)`, `names` the
    group names), and for each lone layer why it was not scanned with a
    neighbour."""
    n = len(layers)
    count = len(layout)
    lines = [
        f"Chain of {n} layer{'s' * (n != 1)} in {count} group{'s' * (count != 1)}, "
        f"tracing {bodies} layer bod{'ies' if bodies != 1 else 'y'}:"
    ]
    for (start, _, per_step), name in zip(layout, names):
        if per_step > 0:
            lines.append(f"  {name}")
            continue
        js = [j for j in (start - 1, start + 1) if 0 <= j < n]
        why = "; ".join(_reason(layers, j, start) for j in js) or "the only layer"
        lines.append(f"  {name}: alone, {why}")
    return "\n".join(lines)
