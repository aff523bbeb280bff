"""The package's shape: lines per folder, public names, import layers and circles.

    python benchmarks/structure.py [PACKAGE_DIR]

Reads the source as text (nothing is imported): each module's `from . import`
/ `from .x import` / `import eqxscan.x` statements give the arrows; a circle is
a strongly connected group of more than one module, through the imports that
run (those under `if TYPE_CHECKING:` do not: the package's `__init__` names
there what it imports on first use, and a subpackage may import a name the
package lends it, as `from .. import save_safetensors`).
"""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(
    name: str, path: Path, known: set[str], *, run_time: bool = False
) -> set[str]:
    """The modules of `known` that `name` imports; with `run_time`, those
    imports only that run (not those under `if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree) if run_time else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                found.add(c)
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:`, which never run."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }


def run_time_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's run-time imports of `mods`: the arrows circles are sought in."""
    return {m: imports(m, p, set(mods), run_time=True) for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def public_names(path: Path) -> list[str]:
    # Names imported on first use (PEP 562) are imported under TYPE_CHECKING too.
    names = []
    body = ast.parse(path.read_text()).body
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body += node.body
    for node in body:
        if isinstance(node, ast.ImportFrom):
            names += [a.asname or a.name for a in node.names]
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "eqxscan").resolve()
    mods = modules(root)
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    lines: dict[str, int] = defaultdict(int)
    files: dict[str, int] = defaultdict(int)
    for p in mods.values():
        folder = str(p.parent.relative_to(root.parent))
        lines[folder] += len(p.read_text().splitlines())
        files[folder] += 1
    print("| folder | files | lines |\n|---|---|---|")
    for folder in sorted(lines):
        print(f"| {folder}/ | {files[folder]} | {lines[folder]} |")
    print(f"| all | {sum(files.values())} | {sum(lines.values())} |\n")
    core = sum(n for folder, n in lines.items() if _is_core(folder))
    print(f"core lines (all but {', '.join(PERIPHERY)}): {core}")
    loaded = imported_at_import(root)
    print(
        f"lines of the {len(loaded)} modules `import eqxscan` loads: "
        f"{sum(len(p.read_text().splitlines()) for p in loaded)}"
    )
    top = public_names(root / "__init__.py")
    print(f"top-level names: {len(top)}")
    for sub in sorted(mods):
        if sub.count(".") == 1 and not sub.rpartition(".")[2].startswith("_"):
            p = mods[sub]
            if p.name == "__init__.py" or p.parent == root:
                print(f"  {sub}: {len(public_names(p))} names")
    found = circles(run_time_graph(mods))
    print(f"import circles: {len(found)}")
    for group in found:
        print("  " + " <-> ".join(group))

    # Private modules reached from another folder (bench reaching into the core).
    print("ten longest functions:")
    for lines_, name in longest(mods)[:10]:
        print(f"  {lines_:4d} {name}")
    found = crossing(graph, mods)
    print(f"imports of another folder's private modules: {len(found)}")
    for m, t in found:
        print(f"  {m} -> {t}")
    up = upward(graph, mods)
    print(f"imports of a subpackage by the core: {len(up)}")
    for m, t in up:
        print(f"  {m} -> {t}")
    up = climbing(graph)
    print(f"imports of a higher core folder: {len(up)}")
    for m, t in up:
        print(f"  {m} -> {t}")


def imported_at_import(root: Path) -> list[Path]:
    """The files of the package's modules that `import eqxscan` loads, read
    in a child process (what loads on first use, such as `eqxscan.quant`,
    is not among them)."""
    code = (
        "import sys, eqxscan; print('\\n'.join(m.__file__ for n, m in "
        "list(sys.modules.items()) if n.split('.')[0] == 'eqxscan'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root.parent,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [Path(f) for f in out.split()]


def longest(mods: dict[str, Path]) -> list[tuple[int, str]]:
    """`(lines, module:function)` of every function, longest first (a nested
    function counts in its parent's lines and on its own)."""
    out = []
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                out.append((node.end_lineno - node.lineno + 1, f"{m}:{node.name}"))
    return sorted(out, reverse=True)


#: The subpackages outside the core, whose lines the core's count leaves out.
PERIPHERY = (
    "adapters",
    "quant",
    "planning",
    "distributed",
    "optim",
    "sharding",
    "checkpoint",
)


def _is_core(folder: str) -> bool:
    parts = folder.split("/")
    return len(parts) < 2 or parts[1] not in PERIPHERY


#: The one private core module the subpackages may import.
INTERNAL_API = "eqxscan._internal"


def owner(m: str) -> str:
    """Who a module belongs to: `"core"` for the top of the package and its
    private folders (`eqxscan._scan`), else its subpackage (`eqxscan.sharding`)."""
    parts = m.split(".")
    if len(parts) == 1 or parts[1].startswith("_"):
        return "core"
    return ".".join(parts[:2])


#: The core's folders, lowest first: a module imports from its own folder or
#: lower ones only (see each folder's README.md).
CORE_FOLDERS = (
    "eqxscan._helpers",
    "eqxscan._scan",
    "eqxscan._containers",
    "eqxscan._features",
    "eqxscan._models",
)


def _level(m: str) -> int | None:
    for i, folder in enumerate(CORE_FOLDERS):
        if m == folder or m.startswith(folder + "."):
            return i
    return None


def climbing(graph: dict[str, set[str]]) -> list:
    """`(module, target)` for every import of a higher core folder by a lower one
    (`eqxscan._scan` reaching `eqxscan._containers`), and every core module
    outside the folders but the package's `__init__` and the internal API."""
    out = []
    for m, targets in graph.items():
        if owner(m) != "core" or m in ("eqxscan", INTERNAL_API):
            continue
        level = _level(m)
        if level is None:
            out.append((m, "(no core folder)"))
            continue
        out += [
            (m, t) for t in targets if (_level(t) is not None) and _level(t) > level
        ]
    return sorted(out)


def _private(m: str) -> bool:
    return any(part.startswith("_") for part in m.split(".")[1:])


def crossing(graph: dict[str, set[str]], mods: dict[str, Path]) -> list:
    """`(module, target)` for every import of a private module of another owner
    (the core or another subpackage) other than the internal API. The package's
    `__init__` is aside: it gives each public name its one home, wherever the
    name is defined (`eqxscan.save` from `eqxscan.checkpoint._serialise`)."""
    del mods
    return sorted(
        (m, t)
        for m, targets in graph.items()
        if m != "eqxscan"
        for t in targets
        if _private(t) and owner(t) != owner(m) and t != INTERNAL_API
    )


def upward(graph: dict[str, set[str]], mods: dict[str, Path]) -> list:
    """`(module, target)` for every import of a subpackage by the core (the
    package's `__init__`, which re-exports the subpackages, aside): arrows point
    down only."""
    del mods
    return sorted(
        (m, t)
        for m, targets in graph.items()
        if owner(m) == "core" and "." in m
        for t in targets
        if owner(t) != "core"
    )


if __name__ == "__main__":
    main()
