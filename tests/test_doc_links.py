"""Every link to the documentation that eqxscan's messages can show leads to a
page of docs/ and, with an anchor, to a heading of that page; no message names a
path of the repository (`docs/x.md`), which an installed package does not have."""

import ast
import pathlib
import re

import markdown
import pytest

from eqxscan._helpers.checks import docs, DOCS_URL


ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "eqxscan").rglob("*.py"))
REPO_PATH = re.compile(r"docs/[A-Za-z0-9_-]+\.md")
# As mkdocs.yml configures Markdown, so that headings get the ids the site has.
EXTENSIONS = [
    "admonition",
    "attr_list",
    "md_in_html",
    "pymdownx.details",
    "pymdownx.superfences",
    "tables",
    "toc",
]


def _is_docs_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == "docs") or (
        isinstance(f, ast.Attribute) and f.attr == "docs"
    )


def _statement_strings(tree: ast.AST) -> set[int]:
    """The ids of string constants standing alone as statements: docstrings,
    shown by `help` and the API reference rather than in a message."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def linked_pages() -> dict[str, list[str]]:
    """`page` -> where, for every `docs(page)` in the package."""
    pages: dict[str, list[str]] = {}
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not _is_docs_call(node):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"  # pyright: ignore
            args = node.args  # pyright: ignore
            assert len(args) == 1 and isinstance(args[0], ast.Constant), (
                f"{where}: docs() takes a literal page, so this test sees it"
            )
            pages.setdefault(args[0].value, []).append(where)
    return pages


def anchors(page: pathlib.Path) -> set[str]:
    md = markdown.Markdown(extensions=EXTENSIONS)
    md.convert(page.read_text(encoding="utf-8"))
    found, todo = set(), list(md.toc_tokens)  # pyright: ignore
    while todo:
        token = todo.pop()
        found.add(token["id"])
        todo.extend(token["children"])
    return found


def test_links_in_messages_lead_to_pages_and_headings():
    pages = linked_pages()
    assert "debugging.md" in pages  # the note every layer's error gets
    for page, where in sorted(pages.items()):
        name, _, anchor = page.partition("#")
        file = ROOT / "docs" / name
        assert file.is_file(), f"{where}: docs({page!r}) links to no page"
        if anchor:
            assert anchor in anchors(file), (
                f"{where}: docs({page!r}) links to no heading of {name} "
                f"(its anchors: {sorted(anchors(file))})"
            )


def test_no_message_names_a_repository_path():
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _statement_strings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in skip
                and REPO_PATH.search(node.value)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"messages naming docs/*.md instead of docs(...): {found}"


@pytest.mark.parametrize(
    "page, url",
    [
        ("debugging.md", "debugging/"),
        ("quantization.md#files", "quantization/#files"),
        ("api/stacked.md", "api/stacked/"),
        ("index.md", ""),
    ],
)
def test_docs_url_is_mkdocs_url_of_page(page, url):
    assert docs(page) == DOCS_URL + url


def test_site_url_is_docs_url():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    site = re.search(r"^site_url:\s*(\S+)\s*$", config, re.MULTILINE)
    assert site is not None and site.group(1) == DOCS_URL
