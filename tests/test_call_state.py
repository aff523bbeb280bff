"""The call state that reaches user code is one record in few context variables
(`eqxscan/_scan/call_state.py`), restored after every block that changes it."""

import ast
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqxscan


ROOT = Path(__file__).resolve().parents[1]
MOST = 3  # context variables in the whole package


def context_vars(source: str) -> int:
    """How many `ContextVar(...)` a module's source constructs, under any name
    it imports `contextvars` or `ContextVar` as."""
    tree = ast.parse(source)
    names, modules = {"ContextVar"}, {"contextvars"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "contextvars":
            names |= {a.asname or a.name for a in node.names if a.name == "ContextVar"}
        if isinstance(node, ast.Import):
            modules |= {
                a.asname or a.name for a in node.names if a.name == "contextvars"
            }

    def made(f: ast.expr) -> bool:
        if isinstance(f, ast.Name):
            return f.id in names
        return (
            isinstance(f, ast.Attribute)
            and f.attr == "ContextVar"
            and isinstance(f.value, ast.Name)
            and f.value.id in modules
        )

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return sum(made(n.func) for n in calls)


def test_the_counter_sees_every_spelling():
    source = (
        "import contextvars\nimport contextvars as cv\n"
        "from contextvars import ContextVar, ContextVar as V\n"
        "a = contextvars.ContextVar('a')\nb = cv.ContextVar('b')\n"
        "c: ContextVar[int] = ContextVar('c', default=0)\nd = V('d')\n"
        "# ContextVar('in a comment')\ne = 'ContextVar(\"in a string\")'\n"
    )
    assert context_vars(source) == 4


def test_the_package_holds_few_context_variables():
    files = sorted((ROOT / "eqxscan").rglob("*.py"))
    found = {p: context_vars(p.read_text()) for p in files}
    held = {str(p.relative_to(ROOT)): n for p, n in found.items() if n}
    assert sum(held.values()) <= MOST, held
    # The one record of the call state is there.
    assert held.get(str(Path("eqxscan/_scan/call_state.py"))) == 1


class _Failing(eqx.Module):
    def __call__(self, x):
        if eqxscan.layer_index() == 1:
            raise ValueError("layer 1 failed")
        return x + 1


def test_the_state_is_restored_after_a_failing_layer():
    stack = eqxscan.Stacked(lambda k: _Failing(), 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="layer 1 failed"):
        eqxscan.tap(stack.with_options(mode="loop"), jnp.mean)(jnp.zeros(()))
    # Outside every layer again, and untapped: a fresh tap sees only its own.
    with pytest.raises(RuntimeError, match="called outside a layer"):
        eqxscan.layer_index()
    ok = eqxscan.Stacked(lambda k: eqx.nn.Identity(), 2, key=jax.random.key(0))
    y, stats = eqxscan.tap(ok, jnp.mean)(jnp.ones(()))
    assert y == 1.0 and stats.shape == (2,)
