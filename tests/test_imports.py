"""`import eqxscan` imports jax, Equinox and jaxtyping, and of eqxscan the
containers and the scan engine: not the libraries of its optional parts (optax
is imported with `eqxscan.optim`, on first use; Orbax when a `CheckpointManager`
is made), nor beartype or safetensors, nor the subpackages, each imported on
first use; optax missing, `eqxscan.optim` says which extra installs it."""

import os
import pathlib
import subprocess
import sys
import textwrap


ROOT = pathlib.Path(__file__).resolve().parent.parent
HEAVY = ("optax", "flax", "orbax", "matplotlib", "safetensors", "beartype")

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


def _child(source: str) -> list[str]:
    # A fresh process: what `import eqxscan` imports, nothing imported before.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def test_import_eqxscan_leaves_optional_libraries_out():
    assert _child(IMPORTS) == [
        "after import eqxscan: {}",
        "optim loaded: False",
        "planning, distributed loaded: []",
        "planning, distributed: eqxscan.planning._search eqxscan.distributed._runtime",
        "after both: {}",
        "optax loaded: True",
        "AttributeError: module 'eqxscan' has no attribute 'no_such_name'",
    ]


CORE = """
import sys
import eqxscan

ours = sorted(m for m in sys.modules if m.partition(".")[0] == "eqxscan")
print(len(ours))
print([m for m in ours if not m.startswith(("eqxscan._", "eqxscan.__"))][1:])
print(sorted(set(dir(eqxscan)) - set(vars(eqxscan))))
"""

# Each lazy name, used first: the object of the module that defines it.
FIRST_USE = """
import sys
import eqxscan
import equinox as eqx
import jax
import jax.numpy as jnp

model = eqxscan.StackedMLP(4, 2, key=jax.random.key(0))
q = eqxscan.quant.quantize(model, "*.w1")
back = eqxscan.quant.dequantize(q)
w, w_back = model.blocks.layers.w1, back.blocks.layers.w1
# int8 with one scale per output: within half a step of each weight.
step = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127
print(
    type(q.blocks.layers.w1) is eqxscan.quant.Quantized,
    bool(jnp.all(jnp.abs(w_back - w) <= step / 2 * 1.001)),
    w_back.shape == w.shape,
)
print(eqxscan.to_state_dict(back).keys() == eqxscan.to_state_dict(model).keys())
from eqxscan.checkpoint._serialise import save
from eqxscan._models.mlp import StackedMLP
from eqxscan._features.early_exit import run_until
lent = [eqxscan.save, eqxscan.StackedMLP, eqxscan.run_until]
print(*[a is b for a, b in zip(lent, [save, StackedMLP, run_until])])
from eqxscan import adapters, find_nonfinite, layer_buffers
from eqxscan.checkpoint import CheckpointManager
print(adapters is sys.modules["eqxscan.adapters"], callable(find_nonfinite))
print(CheckpointManager.__module__, "eqxscan.sharding" in sys.modules)
"""


def test_import_eqxscan_imports_the_core_alone():
    count, subpackages, lazy = _child(CORE)
    assert int(count) <= 40, count
    assert subpackages == "[]", subpackages
    for name in ["adapters", "quant", "planning", "distributed", "optim"]:
        assert repr(name) in lazy, lazy
    for name in ["save", "load", "to_state_dict", "StackedMLP", "run_until"]:
        assert repr(name) in lazy, lazy
    assert _child(FIRST_USE) == [
        "True True True",
        "True",
        "True True True",
        "True True",
        "eqxscan.checkpoint._orbax True",
    ]


NO_OPTAX = """
import sys
sys.modules["optax"] = None  # as if not installed
import eqxscan

print(eqxscan.planning.plan.__module__, eqxscan.save.__module__)
try:
    eqxscan.optim
except ImportError as e:
    print(type(e).__name__, e.name)
    print(str(e))
"""


def test_optim_without_optax_names_the_extra():
    assert _child(NO_OPTAX) == [
        "eqxscan.planning._search eqxscan.checkpoint._serialise",
        "ModuleNotFoundError optax",
        "eqxscan.optim needs optax, which is not installed.",
        'Hint: pip install "eqxscan[optim]" (or optax).',
    ]
