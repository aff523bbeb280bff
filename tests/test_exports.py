"""Each public object has one public name: no object is exported by two public
namespaces (`eqxscan` and its subpackages without a leading underscore), nor
twice by one, so that a reader finds one path to it in code, errors and docs."""

import importlib
import pkgutil
import types

import eqxscan


# Values that are equal wherever they come from (and may be one object by
# interning): two constants that happen to hold `0` are not one export.
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def public_namespaces() -> list[types.ModuleType]:
    """`eqxscan` and every subpackage reached through public names only."""
    found = [eqxscan]
    for info in pkgutil.walk_packages(eqxscan.__path__, "eqxscan."):
        parts = info.name.split(".")
        if info.ispkg and not any(p.startswith("_") for p in parts):
            found.append(importlib.import_module(info.name))
    return found


def public_exports(module: types.ModuleType) -> dict[str, object]:
    """The names a module offers: `__all__` if it has one, else every name in
    `dir` without a leading underscore (lazy names included), less submodules."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in dir(module) if not n.startswith("_")]
    out = {}
    for name in names:
        value = getattr(module, name)
        if not isinstance(value, (types.ModuleType, *_PLAIN)):
            out[f"{module.__name__}.{name}"] = value
    return out


def exported_twice(modules: list[types.ModuleType]) -> dict[int, list[str]]:
    by_id: dict[int, list[str]] = {}
    for module in modules:
        for path, value in public_exports(module).items():
            by_id.setdefault(id(value), []).append(path)
    return {i: paths for i, paths in by_id.items() if len(paths) > 1}


def test_the_namespaces_are_found():
    names = {m.__name__ for m in public_namespaces()}
    assert {"eqxscan", "eqxscan.checkpoint", "eqxscan.quant", "eqxscan.remat"} <= names
    assert not any("._" in n for n in names), names


def test_each_public_object_is_exported_once():
    twice = exported_twice(public_namespaces())
    assert not twice, "exported under more than one name:\n" + "\n".join(
        " = ".join(sorted(paths)) for paths in twice.values()
    )


def test_a_second_name_is_caught():
    # The check itself: a module that re-exports one of eqxscan's objects.
    alias = types.ModuleType("eqxscan.alias")
    vars(alias).update(Stacked=eqxscan.Stacked, ZERO=0)  # ZERO, plain: not counted
    assert list(exported_twice([eqxscan, alias]).values()) == [
        ["eqxscan.Stacked", "eqxscan.alias.Stacked"]
    ]
