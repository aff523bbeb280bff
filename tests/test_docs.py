"""Every ```python block in README.md and docs/, and in the docstrings of eqxscan's
public API, runs here, so the docs cannot rot.

Each block runs on its own, in a fresh namespace, in this process (so eqxscan is
type-checked as in the other tests and the strict promotion settings of conftest
apply). A failure is reported as `docs/page.md:LINE`, the line of the fence, and
tracebacks point into the Markdown file. Blocks that must not run are fenced as
```text, ```bash or ```console.
"""

import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest


# Blocks that show interoperability may import these; they are skipped if absent.
OPTIONAL = {"flax"}
ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")


def markdown_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """`(line of the opening fence, dedented source)` of each ```python block."""
    return python_blocks_in(path.read_text(encoding="utf-8"), str(path))


def python_blocks_in(text: str, where: str) -> list[tuple[int, str]]:
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, ticks = m["indent"], m["ticks"]
        is_python = m["info"].lower() in ("python", "py", "python3")
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(ticks)
            and lines[i].strip(ticks[0]).strip() == ""
        ):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            i += 1
        if i == len(lines):
            raise ValueError(f"{where}:{start}: unclosed code fence")
        i += 1
        if is_python:
            blocks.append((start, "\n".join(body) + "\n"))
    return blocks


CASES = [
    pytest.param(path, line, source, id=f"{path.relative_to(ROOT)}:{line}")
    for path in markdown_files()
    for line, source in python_blocks(path)
]


def docstrings() -> list[tuple[str, str]]:
    """`(qualified name, docstring)` of eqxscan's public objects and their methods:
    the examples rendered in the API reference."""
    import eqxscan

    found = []
    namespaces = [("eqxscan", eqxscan)]
    # `dir`, not `vars`: `eqxscan.optim` is imported on first use.
    namespaces += [
        (f"eqxscan.{n}", m)
        for n in dir(eqxscan)
        if not n.startswith("_")
        if inspect.ismodule(m := getattr(eqxscan, n))
    ]
    for prefix, namespace in namespaces:
        # `dir` again: `eqxscan.save` and the like are imported on first use.
        for name in sorted(n for n in dir(namespace) if not n.startswith("_")):
            obj = getattr(namespace, name)
            if not getattr(obj, "__module__", "").startswith("eqxscan"):
                continue
            found.append((f"{prefix}.{name}", inspect.getdoc(obj) or ""))
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    if callable(value) and value.__doc__:
                        doc = inspect.getdoc(value) or ""
                        found.append((f"{prefix}.{name}.{member}", doc))
    return found


DOCSTRING_CASES = [
    pytest.param(source, id=f"{name}:{line}")
    for name, doc in docstrings()
    for line, source in python_blocks_in(doc, name)
]


@pytest.mark.parametrize("source", DOCSTRING_CASES)
def test_docstring_example_runs(source: str):
    exec(compile(source, "<docstring example>", "exec"), {"__name__": "docstring"})


@pytest.mark.parametrize("path, line, source", CASES)
def test_python_block_runs(path: pathlib.Path, line: int, source: str):
    # Pad so that line numbers in tracebacks are those of the Markdown file.
    code = compile("\n" * line + source, str(path), "exec")
    try:
        exec(code, {"__name__": f"docs_block_{line}"})
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"needs the optional package {e.name}")
        raise


def test_blocks_are_found(tmp_path: pathlib.Path):
    # Guards the parser, including fences indented inside admonitions.
    pages = {case.values[0].name for case in CASES}
    assert {"index.md", "concepts.md", "claims.md", "checkpoints.md"} <= pages
    assert any(case.id.startswith("eqxscan.Stacked:") for case in DOCSTRING_CASES)
    assert any(case.id.startswith("eqxscan.optim.") for case in DOCSTRING_CASES)
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n\n    ```py\n    y = 2\n    ```\n"
        "```text\nz\n```\n",
        encoding="utf-8",
    )
    assert python_blocks(page) == [(2, "x = 1\n"), (6, "y = 2\n")]


def _mkdocs_build(tmp_path: pathlib.Path, page: str) -> "subprocess.CompletedProcess":
    """Build a one-page site with the project's mkdocstrings setup, strictly."""
    pytest.importorskip("mkdocstrings")
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "index.md").write_text(page, encoding="utf-8")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: check\nstrict: true\nplugins:\n  - mkdocstrings:\n"
        "      handlers:\n        python:\n"
        f"          paths: [{json.dumps(str(ROOT))}]\n",
        encoding="utf-8",
    )
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", "site"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_strict_docs_build_fails_on_a_broken_reference(tmp_path: pathlib.Path):
    good = "# Page\n\nSee [the mesh][eqxscan.sharding.make_mesh].\n\n"
    good += "::: eqxscan.sharding.make_mesh\n"
    ok = _mkdocs_build(tmp_path, good)
    assert ok.returncode == 0, ok.stderr
    bad = good.replace("sharding.make_mesh]", "sharding.no_such_function]", 1)
    broken = _mkdocs_build(tmp_path, bad)
    assert broken.returncode != 0
    assert "eqxscan.sharding.no_such_function" in broken.stderr
    # CI builds the real docs the same way: strict, and without --quiet, which
    # would hide the warnings that make a strict build fail.
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    line = next(x for x in ci.splitlines() if "mkdocs build" in x)
    assert "--strict" in line and "--quiet" not in line
