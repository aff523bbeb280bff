"""`import eqxscan` imports jax, Equinox and jaxtyping, not the libraries of its
optional parts: optax is imported with `eqxscan.optim`, on first use; so are
`eqxscan.planning` and `eqxscan.distributed`; Orbax when a
`CheckpointManager` is made."""

import os
import pathlib
import subprocess
import sys
import textwrap


ROOT = pathlib.Path(__file__).resolve().parent.parent
HEAVY = ("optax", "flax", "orbax", "matplotlib", "safetensors")

IMPORTS = """
import sys, traceback

HEAVY = __HEAVY__
first = {}  # each of HEAVY imported: the line of eqxscan that imported it


class Spy:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in HEAVY and top not in first:
            ours = [f for f in traceback.extract_stack() if "/eqxscan/" in f.filename]
            at = ours[-1] if ours else None
            first[top] = at and "/".join(at.filename.split("/")[-2:]) + f":{at.lineno}"
        return None


sys.meta_path.insert(0, Spy())
import eqxscan

print("after import eqxscan:", first)
print("optim loaded:", "eqxscan.optim" in sys.modules)
print("planning, distributed loaded:", [
    m for m in sys.modules if m.startswith(("eqxscan.planning", "eqxscan.distributed"))
])
assert {"planning", "distributed"} <= set(dir(eqxscan))
plan = eqxscan.planning.plan
from eqxscan.distributed import initialize

assert eqxscan.distributed.initialize is initialize
print("planning, distributed:", plan.__module__, initialize.__module__)
print("after both:", first)
assert "optim" in dir(eqxscan)
tx = eqxscan.optim.layerwise  # imported here, optax with it
print("optax loaded:", "optax" in sys.modules)
import eqxscan.optim
from eqxscan.optim import LayerwiseState

assert eqxscan.optim.layerwise is tx and eqxscan.optim.LayerwiseState is LayerwiseState
try:
    eqxscan.no_such_name
except AttributeError as e:
    print("AttributeError:", e)
""".replace("__HEAVY__", repr(HEAVY))


def test_import_eqxscan_leaves_optional_libraries_out():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(IMPORTS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == [
        "after import eqxscan: {}",
        "optim loaded: False",
        "planning, distributed loaded: []",
        "planning, distributed: eqxscan.planning._search eqxscan.distributed._runtime",
        "after both: {}",
        "optax loaded: True",
        "AttributeError: module 'eqxscan' has no attribute 'no_such_name'",
    ]
