"""What a checkpoint records of a model beyond its arrays: the static fields a
stand-in for a weight computes with (a LoRA's `alpha`), by the weight's name
pattern, in each file's metadata; checked against the model loaded into."""

import json
from collections.abc import Mapping

import jax.tree_util as jtu
from jaxtyping import PyTree

from .._internal import for_each, layer_names, MatmulOnly, pattern, Site


RECORDS = "eqxscan.records"  # metadata: JSON {pattern: {field: value}}
WEAK = "eqxscan.weak"  # metadata: JSON [name of each layer's weakly typed array]


class _Recorded:
    """A stand-in held as one leaf, so that the walk names it as its weight."""

    def __init__(self, weight: MatmulOnly):
        self.weight = weight


def _records_something(x: object) -> bool:
    return isinstance(x, MatmulOnly) and bool(x._record())


def _found(model: PyTree) -> dict[str, list[tuple[MatmulOnly, dict]]]:
    leaves = jtu.tree_leaves(model, is_leaf=_records_something)
    if not any(_records_something(x) for x in leaves):
        return {}  # nothing to record: no walk, which names (and cuts) every layer
    held = jtu.tree_map(
        lambda x: _Recorded(x) if _records_something(x) else x,
        model,
        is_leaf=_records_something,
    )
    found: dict[str, list[tuple[MatmulOnly, dict]]] = {}

    def visit(leaf: object, site: Site) -> None:
        if isinstance(leaf, _Recorded):
            w = leaf.weight
            found.setdefault(pattern(site.path), []).append((w, w._record()))

    for_each(visit, held, names=True)
    return found


def records_metadata(model: PyTree) -> dict[str, str]:
    """The metadata entry recording `model`'s stand-ins (none if it has none;
    of a name that a `Chain`'s stacks share, the fields they record alike:
    a LoRA's `alpha` beside a quantized weight's kind)."""
    record = {}
    for name, entries in _found(model).items():
        fields: dict[str, list] = {}
        for _, r in entries:
            for field, value in r.items():
                fields.setdefault(field, []).append(value)
        alike = {f: vs[0] for f, vs in fields.items() if all(v == vs[0] for v in vs)}
        if alike:
            record[name] = alike
    return {RECORDS: json.dumps(record, sort_keys=True)} if record else {}


def check_records(
    metadata: Mapping[str, Mapping[str, str]], like: PyTree, where: str
) -> None:
    """Raise if the files' record of a weight differs from `like`'s (files of
    another writer, or of an earlier version, record nothing: not checked)."""
    texts = [m[RECORDS] for m in metadata.values() if RECORDS in m]
    try:
        saved = json.loads(texts[0]) if texts else {}
        assert isinstance(saved, dict)
    except (ValueError, AssertionError):
        saved = {}  # not ours to judge: the arrays are checked as usual
    wrong = []
    for name, entries in _found(like).items():
        have = saved.get(name)
        if not isinstance(have, dict):
            continue
        for weight, record in entries:
            fields = [k for k in record if k in have and have[k] != record[k]]
            if fields:
                wrong.append((weight, name, fields, have, record))
                break
    if wrong:
        weight, name, fields, have, record = wrong[0]
        said = ", ".join(f"{k}={have[k]!r}" for k in fields)
        model = ", ".join(f"{k}={record[k]!r}" for k in fields)
        also = f" (and {len(wrong) - 1} other weight(s))" if len(wrong) > 1 else ""
        raise ValueError(
            f"{where!r} does not fit the model: the {weight._label} at `{name}` "
            f"was saved with {said}, and the model's has {model}{also}; loaded, "
            f"it would compute with the model's.\nHint: build like as the saved "
            f"model was: {weight._rebuild(said)}."
        )


def weak_metadata(model: PyTree) -> dict[str, str]:
    """The metadata entry naming `model`'s weakly typed arrays, layer by layer
    (a pattern such as `*.a` can stand for arrays of several groups of a
    `Chain`); always written: a file without it, another writer's or an
    earlier version's, loads each array weakly typed as the model loaded into
    has it."""
    weak: list[str] = []

    def visit(leaf: object, site: Site) -> None:
        if getattr(leaf, "weak_type", False):
            weak.extend(layer_names(site.path, site.axes))

    for_each(visit, model, names=True)
    return {WEAK: json.dumps(sorted(weak))}


def saved_weak(metadata: Mapping[str, Mapping[str, str]]) -> frozenset[str] | None:
    """The names of the arrays saved weakly typed (each layer's), or `None`
    where the files do not say (see `weak_metadata`)."""
    texts = [m[WEAK] for m in metadata.values() if WEAK in m]
    try:
        saved = json.loads(texts[0]) if texts else None
    except ValueError:
        return None
    if not isinstance(saved, list) or not all(isinstance(p, str) for p in saved):
        return None
    return frozenset(saved)
