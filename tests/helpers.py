"""Comparison helpers and small test layers shared by the tests, and a runner for
the scripts that need a fresh process with several CPU devices."""

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.extend.core
import jax.monitoring
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import jaxtyping
import numpy as np

import eqxscan


_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, _secs, **_kw: (
        _COMPILES.append(name)
        if name == "/jax/core/compile/backend_compile_duration"
        else None
    )
)


def compiles(fn) -> int:
    """How many programs `fn()` compiles."""
    before = len(_COMPILES)
    jax.block_until_ready(fn())
    return len(_COMPILES) - before


def sub_jaxprs(params):
    """The jaxprs in an equation's params (`jax.extend.core.jaxprs_in_params`,
    which only jax >= 0.10 has)."""
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def tree_allclose(a, b, *, rtol=1e-5, atol=1e-6) -> bool:
    """Same structure, same non-array leaves, array leaves close (dtypes equal)."""
    da, sa = eqx.partition(a, eqx.is_array)
    db, sb = eqx.partition(b, eqx.is_array)
    if jtu.tree_structure(da) != jtu.tree_structure(db) or not eqx.tree_equal(sa, sb):
        return False
    for x, y in zip(jtu.tree_leaves(da), jtu.tree_leaves(db), strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        x32 = np.asarray(jnp.asarray(x, jnp.float32) if x.dtype == jnp.bfloat16 else x)
        y32 = np.asarray(jnp.asarray(y, jnp.float32) if y.dtype == jnp.bfloat16 else y)
        if not np.allclose(x32, y32, rtol=rtol, atol=atol):
            return False
    return True


def max_rel_err(a, b) -> float:
    """Largest relative error over all array leaves of two pytrees."""
    errs = [
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        / (float(np.max(np.abs(np.asarray(y, np.float64)))) + 1e-30)
        for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True)
    ]
    return max(errs) if errs else 0.0


ROOT = Path(__file__).resolve().parent.parent


SCRIPTS = ROOT / "tests" / "scripts"


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a multi-process test's coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def processes(*procs: subprocess.Popen):
    """Kill (SIGKILL) whatever is still running on the way out."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)


def script_path(name: str) -> Path:
    """The path of `tests/scripts/<name>`."""
    return SCRIPTS / name


def run_script(name: str, *args: str, timeout: float) -> str:
    """Run `tests/scripts/<name> *args` in a fresh process (which sets its own CPU
    device count) and return what it printed; on failure the assertion names the
    script, its exit status and the end of its output."""
    env = dict(os.environ)
    # The script adds its own device count to conftest's compile-time flags.
    env["XLA_FLAGS"] = os.environ.get("EQXSCAN_TEST_XLA_FLAGS", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script_path(name)), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"tests/scripts/{name} exited with status {proc.returncode}; the end of "
        f"its output:\n{(proc.stdout + proc.stderr)[-4000:]}"
    )
    return proc.stdout


def run_device_script(name: str, timeout: float) -> dict:
    """`run_script(name)` for a script that prints JSON: what it printed, parsed."""
    return json.loads(run_script(name, timeout=timeout))


def once_per_values(fn):
    """`fn`, computed once for each set of argument values and its result handed
    out again: for a reference that every parametrisation of a test computes
    alike. Values are compared by structure, each array's dtype, shape and bytes
    (PRNG keys by their data) and any other leaf by type and equality (functions
    by identity). The result must not be mutated (JAX arrays cannot be)."""
    found = {}

    def value(leaf):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jr.key_data(leaf)
            return leaf.dtype.str, leaf.shape, np.asarray(leaf).tobytes()
        return type(leaf), leaf

    @functools.wraps(fn)
    def once(*args):
        leaves, treedef = jtu.tree_flatten(args)
        key = (treedef, *map(value, leaves))
        if key not in found:
            found[key] = fn(*args)
        return found[key]

    return once


@contextlib.contextmanager
def untyped():
    """As a user runs it: without the suite's runtime type checks, so that
    eqxscan's own check of an annotated argument speaks, not beartype's."""
    old = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", old)


def stable_id(value: object) -> str:
    """A test id without memory addresses (`<function f at 0x..>` becomes `f`), the
    same in every process (pytest-xdist compares the ids its workers collect)."""
    return re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", str(value))


def collectives(text: str, op: str) -> list[str]:
    """Result shapes (layouts dropped) of the `op` instructions in compiled HLO
    `text`, e.g. `['f32[1,16,64]', '(f32[64,16], f32[16])']`."""
    found = []
    for line in text.splitlines():
        m = re.search(rf"= (.*?) {op}(?:-start)?\(", line)
        if m:
            found.append(re.sub(r"\{[^}]*\}", "", m.group(1)))
    return found


# ------------------------------------------- layers and cells shared by tests


IN, HID, T, B = 3, 4, 5, 2
MODES = ("scan", "loop")


def value_and_grads(fn, *args):
    """`fn(*args)` and the gradient of a scalar readout of it w.r.t. every arg."""

    def loss(*a):
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(fn(*a)))

    return fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def elman(key):
    return eqxscan.ElmanCell(IN, HID, key=key)


class MemoryCell(eqx.Module):
    inner: eqxscan.ElmanCell

    def __call__(self, x, h, memory, *, scale, key=None):
        return self.inner(x, h) + scale * jnp.tanh(memory @ h)


L, D = 4, 6


class Block(eqx.Module):
    """A layer with a second method, a per-layer scale and optional randomness."""

    w: jax.Array
    b: jax.Array

    def __init__(self, key, scale=1.0):
        kw, kb = jr.split(key)
        self.w = jr.normal(kw, (D, D)) * 0.4 * scale
        self.b = jr.normal(kb, (D,)) * 0.1

    def __call__(self, x, *, key=None):
        h = jnp.tanh(self.w @ x + self.b)
        return h if key is None else h + 0.1 * jr.normal(key, h.shape)

    def decode(self, x, shift, *, key=None):
        h = jnp.sin(self.w.T @ x) + shift
        return h if key is None else h * jr.uniform(key, h.shape)

    def step(self, x, shift):
        y = self.decode(x, shift)
        return y, jnp.sum(y)


def make_stack(getkey, mode="scan", **options):
    return eqxscan.Stacked(lambda k: Block(k), L, key=getkey(), mode=mode, **options)


# Residual layers of one and of two matrices, for weights found by name or type.
class Dense(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w)


class TwoDense(eqx.Module):
    w: jax.Array
    v: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w) @ self.v
