"""`layer_io`: the one reader and the one writer of a stacked tree at layer `i`,
against hand-written JAX, and the check that no other module slices or updates
a stack itself."""

import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan
from eqxscan._scan.layer_io import index, write


PACKAGE = Path(eqxscan.__file__).resolve().parent
HOME = Path("_scan", "layer_io.py")
# The primitives that cut or update an array at an index.
SLICING = re.compile(r"dynamic_slice|dynamic_index_in_dim|dynamic_update|\.at\[")
# Files that use them on something other than a stack's layer axis.
NOT_LAYERS = {
    # A KV cache's rows written at the decode position (`dynamic_update_slice`).
    Path("_scan", "buffers.py"),
    # Every layer's statistic scattered to its layer number at once.
    Path("_scan", "taps.py"),
    # Per-parameter norms scattered into a table by layer number.
    Path("optim", "_stats.py"),
    # Non-finite counts added by layer number; a docstring example.
    Path("_features", "nonfinite.py"),
    # A whole array set into weak zeros (`.at[...]`), to keep its weak type.
    Path("_helpers", "host.py"),
    # The first time step of a sequence, not a layer.
    Path("_containers", "linear_diag.py"),
    # The whole layer axis permuted at once into a sharding (`pipeline_order`).
    Path("_containers", "stage_order.py"),
}


def _stray(sources: dict[Path, str]) -> list[str]:
    return [
        f"{path}:{n}: {line.strip()}"
        for path, text in sorted(sources.items())
        if path != HOME and path not in NOT_LAYERS
        for n, line in enumerate(text.splitlines(), 1)
        if SLICING.search(line)
    ]


def _sources() -> dict[Path, str]:
    return {
        p.relative_to(PACKAGE): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))
    }


def test_only_layer_io_cuts_or_writes_a_layer():
    sources = _sources()
    assert _stray(sources) == [], (
        "read and write a stack at layer i with _scan/layer_io.py's `index` and "
        "`write`; a slice that is not a layer's: add its file to NOT_LAYERS, "
        "saying why"
    )
    # The exceptions are still needed (each file still slices), and the rule
    # can fail: a stray layer write elsewhere is found.
    assert all(SLICING.search(sources[p]) for p in NOT_LAYERS | {HOME})
    stray = Path("_containers", "stacked.py")
    sources[stray] += "\nw = w.at[i].set(new)\n"
    found = _stray(sources)
    assert len(found) == 1 and found[0].startswith(f"{stray}:"), found
    assert found[0].endswith("w = w.at[i].set(new)"), found


def _tree(dtype: jnp.dtype) -> dict:
    # Two array leaves with a layer axis of 4, and a non-array leaf.
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (4, 3, 2)).astype(dtype),
        "b": jax.random.normal(k2, (4, 5)).astype(dtype),
        "name": "layer",
    }


def _value(dtype: jnp.dtype) -> dict:
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "w": jax.random.normal(k1, (3, 2)).astype(dtype),
        "b": jax.random.normal(k2, (5,)).astype(dtype),
        "name": None,
    }


def _reference(a: jax.Array, i: int, v: jax.Array, add: bool) -> np.ndarray:
    # In NumPy: a narrower float adds in float32 and is rounded once.
    out = np.array(a)
    if add:
        v = out[i].astype(np.float32) + np.asarray(v, np.float32)
    out[i] = np.asarray(v).astype(out.dtype)
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("traced", [False, True])
def test_write_matches_at(dtype: jnp.dtype, add: bool, traced: bool):
    tree, value = _tree(dtype), _value(dtype)
    if add:  # a float32 value, as the adapters' merge adds
        value = {**value, "w": value["w"].astype(jnp.float32) / 3}
    for i in (0, 2, 3):
        # Under jit: an int is static, an int32 array traced.
        j = jnp.int32(i) if traced else i
        got = eqx.filter_jit(lambda t, v, j: write(t, j, v, add=add))(tree, value, j)
        assert got["name"] == "layer"
        for k in ("w", "b"):
            want = _reference(tree[k], i, value[k], add)
            assert got[k].dtype == dtype
            np.testing.assert_array_equal(np.asarray(got[k]), want)
            # What was written is what index reads back, the rest untouched.
            if not add:
                np.testing.assert_array_equal(index(got, i)[k], value[k].astype(dtype))


def test_write_on_another_axis_and_read_back():
    a = jnp.arange(24.0).reshape(2, 4, 3)
    v = -jnp.ones((2, 3))
    for i in (1, jnp.int32(1)):
        got = eqx.filter_jit(lambda a, v, i: write(a, i, v, axis=1))(a, v, i)
        np.testing.assert_array_equal(got, a.at[:, 1].set(v))
        np.testing.assert_array_equal(index(got, i, axis=1), v)


def test_index_of_a_tuple_cuts_each_leading_axis():
    a = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(index(a, (1, 2)), a[1, 2])
    np.testing.assert_array_equal(index(a, (1, jnp.int32(2))), a[1, 2])
    np.testing.assert_array_equal(index(a, (1, 2), axis=1), a[:, 1, 2])
    np.testing.assert_array_equal(index(a, ()), a)
