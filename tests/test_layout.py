"""The package's shape: no import circles, the benchmarks on public names only, and
the version from one place."""

import importlib.util
import tomllib
from pathlib import Path

import eqxscan


ROOT = Path(__file__).resolve().parents[1]


def _structure():
    spec = importlib.util.spec_from_file_location(
        "structure", ROOT / "benchmarks" / "structure.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _graph():
    structure = _structure()
    mods = structure.modules(ROOT / "eqxscan")
    return (
        structure,
        mods,
        {m: structure.imports(m, p, set(mods)) for m, p in mods.items()},
    )


def test_circles_are_found():
    # The detector itself: a two-module circle is reported.
    structure = _structure()
    assert structure.circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert structure.circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    structure, mods, _ = _graph()
    assert structure.circles(structure.run_time_graph(mods)) == []


def test_type_checking_imports_make_no_circle(tmp_path):
    # `from .. import name` in a subpackage meets the package's `__init__`, whose
    # imports of the subpackages are under TYPE_CHECKING only: no circle then, one
    # where the same import runs.
    structure, mods, _ = _graph()
    path = tmp_path / "a.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n"
    )
    assert structure.imports("a", path, {"a", "b"}, run_time=True) == set()
    assert structure.imports("a", path, {"a", "b"}) == {"b"}
    graph = structure.run_time_graph(mods)
    assert "eqxscan.checkpoint._serialise" not in graph["eqxscan"]
    assert "eqxscan" in graph["eqxscan.quant._files"]


def test_benchmarks_use_public_names_only():
    # The benchmarks live beside the package (benchmarks/, not in the wheel): they
    # use eqxscan's public names only, and nothing in eqxscan imports them.
    structure, mods, _ = _graph()
    bench = structure.modules(ROOT / "benchmarks")
    known = set(mods) | set(bench)
    reached = {m: structure.imports(m, p, known) for m, p in {**mods, **bench}.items()}
    assert (
        sorted((m, t) for m in bench for t in reached[m] if t in mods and "._" in t)
        == []
    )
    assert sorted((m, t) for m in mods for t in reached[m] if t in bench) == []


def test_private_imports_only_through_the_internal_api():
    # A subpackage reaches the core's internals only through eqxscan._internal,
    # and the core imports no subpackage.
    structure, mods, graph = _graph()
    assert structure.crossing(graph, mods) == []
    assert structure.upward(graph, mods) == []


def test_private_import_rule_can_fail():
    # The rule itself: a subpackage reaching a core private module other than
    # the internal API, or the core reaching a subpackage, is reported.
    structure, mods, graph = _graph()
    bad = {
        **graph,
        "eqxscan.quant._quantize": graph["eqxscan.quant._quantize"]
        | {"eqxscan._containers.chain"},
    }
    assert (
        "eqxscan.quant._quantize",
        "eqxscan._containers.chain",
    ) in structure.crossing(bad, mods)
    up = {
        **graph,
        "eqxscan._scan.engine": graph["eqxscan._scan.engine"] | {"eqxscan.remat"},
    }
    assert ("eqxscan._scan.engine", "eqxscan.remat") in structure.upward(up, mods)
    # Planning, the runtime and the Orbax manager use sharding's public names
    # only, and the core only through the internal API.
    for m, t in [
        ("eqxscan.planning._candidates", "eqxscan.sharding._shard"),
        ("eqxscan.distributed._runtime", "eqxscan._helpers.jax_private"),
        ("eqxscan.checkpoint._orbax", "eqxscan.sharding._place"),
    ]:
        bad = {**graph, m: graph[m] | {t}}
        assert (m, t) in structure.crossing(bad, mods)
    lazy = {
        **graph,
        "eqxscan._helpers.checks": graph["eqxscan._helpers.checks"]
        | {"eqxscan.planning"},
    }
    assert ("eqxscan._helpers.checks", "eqxscan.planning") in structure.upward(
        lazy, mods
    )


def _private_jax_uses(files):
    # `jaxlib._jax` under TYPE_CHECKING names a class only and is not counted.
    return sorted(
        str(f.relative_to(ROOT))
        for f in files
        if "jax._src" in f.read_text() and f.name != "jax_private.py"
    )


def test_private_jax_in_one_place():
    # Every use of `jax._src` is in eqxscan/_helpers/jax_private.py, guarded and tested.
    assert _private_jax_uses((ROOT / "eqxscan").rglob("*.py")) == []
    assert _private_jax_uses([ROOT / "tests" / "test_jax_private.py"]) == [
        "tests/test_jax_private.py"
    ]


def test_core_folders_import_downward():
    # _helpers < _scan < _containers < _features < _models: each folder's README
    # says what it may import.
    structure, _, graph = _graph()
    assert structure.climbing(graph) == []
    for folder in structure.CORE_FOLDERS:
        readme = ROOT.joinpath(*folder.split(".")) / "README.md"
        assert readme.read_text().startswith(f"# `{folder}`")


def test_core_folder_rule_can_fail():
    structure, _, graph = _graph()
    seam = "eqxscan._scan.layer_call"
    up = {**graph, seam: graph[seam] | {"eqxscan._containers.stacked"}}
    assert (seam, "eqxscan._containers.stacked") in structure.climbing(up)
    loose = {**graph, "eqxscan._loose": set()}
    assert ("eqxscan._loose", "(no core folder)") in structure.climbing(loose)


def test_version_from_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert eqxscan.__version__ == project["version"]


def test_no_file_over_600_lines_nor_function_over_100():
    # Small files with one job each; a function that outgrows a screen is cut into
    # named steps (counted as `benchmarks/structure.py` counts them).
    structure, mods, _ = _graph()
    long_files = {
        m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long_files, long_files
    long_functions = [(n, f) for n, f in structure.longest(mods) if n > 100]
    assert not long_functions, long_functions
    # The count can fail: the longest function is found and measured.
    n, name = structure.longest(mods)[0]
    assert 50 < n <= 100 and ":" in name, (n, name)


def test_structure_counts_the_modules_import_loads():
    # The files `benchmarks/structure.py` counts as loaded by `import eqxscan`:
    # the engine among them, and nothing that loads on first use.
    loaded = {
        p.relative_to(ROOT).as_posix()
        for p in _structure().imported_at_import(ROOT / "eqxscan")
    }
    assert "eqxscan/_scan/engine.py" in loaded and "eqxscan/__init__.py" in loaded
    assert not any(p.startswith(("eqxscan/quant/", "eqxscan/_models/")) for p in loaded)
    assert all(p.startswith("eqxscan/") for p in loaded)
