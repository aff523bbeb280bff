"""Generated bad input to the public entry points, run as a user runs them
(without the tests' runtime type checks of annotations), for
tests/test_properties.py: `python tests/scripts/fault_properties.py`.

Each call either works as the loop mode does, or raises a TypeError/ValueError
whose first line names the argument. Prints one JSON object: for each entry
point the count of calls that worked, that were refused clearly, and the raw or
silently wrong ones (with the first few, to see).
"""

import json
import os
import sys
import tempfile
from collections import defaultdict


os.environ["JAX_PLATFORMS"] = "cpu"

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import given, HealthCheck, settings, strategies as st  # noqa: E402

import eqxscan  # noqa: E402


EXAMPLES = int(sys.argv[1]) if len(sys.argv) > 1 else 25
tally: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
raw: dict[str, list[str]] = defaultdict(list)

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["False", "True", "0.1", "scan", "nan", "float16", [1, 2]]),
    st.sampled_from([{"a": 1}, np.float32(0.5), np.int64(3), len, object()]),
    st.sampled_from([jnp.ones(2, jnp.int32), jnp.ones(3, jnp.uint32), jr.key(0)]),
    st.sampled_from([jnp.zeros((2, 2)), jr.split(jr.key(0), 3), jnp.ones(2)]),
)


def attempt(entry: str, name: str, value: object, call, check=None) -> object:
    """`call()`, tallied under `entry`: `works`, `clear` (a TypeError/ValueError
    whose first line names `name`), or `raw`/`silent` (recorded)."""
    try:
        out = call()
    except (TypeError, ValueError, IndexError, FileNotFoundError) as e:
        first = next(iter(str(e).splitlines()), "")
        if any(n in first for n in ALIASES.get(name, (name,))) or (
            isinstance(e, FileNotFoundError) and first.startswith("No ")
        ):
            tally[entry]["clear"] += 1
            return None
        tally[entry]["raw"] += 1
        raw[entry].append(f"{name}={value!r}: {type(e).__name__}: {first[:160]}")
        return None
    except Exception as e:  # noqa: BLE001 - anything else is raw
        tally[entry]["raw"] += 1
        raw[entry].append(f"{name}={value!r}: {type(e).__name__}: {str(e)[:160]}")
        return None
    if check is not None and not check(out):
        tally[entry]["silent"] += 1
        raw[entry].append(f"{name}={value!r}: a result unlike the loop's")
        return None
    tally[entry]["works"] += 1
    return out


# Errors that name an argument by what it is: `like` is the model to load into.
ALIASES = {"like": ("like", "does not match the model", "holds typed PRNG keys")}


def same(a: object, b: object) -> bool:
    return bool(
        eqx.tree_equal(
            eqx.filter(a, eqx.is_array),
            eqx.filter(b, eqx.is_array),
            rtol=1e-5,
            atol=1e-6,
        )
    )


def big(name: str, value: object) -> bool:
    # A valid but large count: building that many layers is the user's choice.
    return name in ("num_layers", "dim") and (
        isinstance(value, (int, np.integer))
        and not isinstance(value, bool)
        and value > 64
    )


run = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def linear(key):
    return eqx.nn.Linear(4, 4, key=key)


@run
@given(
    name=st.sampled_from(["num_layers", "mode", "checkpoint", "unroll", "key"]),
    value=junk,
)
def stacked(name, value):
    if big(name, value):
        return
    args = dict(num_layers=2, mode="scan", remat="auto", unroll=1, key=jr.key(0))
    args[name] = value
    count = args.pop("num_layers")
    stack = attempt(
        "Stacked", name, value, lambda: eqxscan.Stacked(linear, count, **args)
    )
    if stack is not None:
        x = jnp.linspace(-1, 1, 4)
        loop = stack.with_options(mode="loop")
        attempt("Stacked", name, value, lambda: stack(x), lambda y: same(y, loop(x)))


@run
@given(
    name=st.sampled_from(["mode", "checkpoint", "unroll", "reverse", "x"]), value=junk
)
def chain(name, value):
    args = dict(mode="scan", remat="auto", unroll=1)
    x = jnp.linspace(-1, 1, 4)
    if name == "x":
        x = value
    elif name != "reverse":
        args[name] = value
    layers = [linear(jr.key(i)) for i in range(3)]
    made = attempt("Chain", name, value, lambda: eqxscan.Chain(layers, **args))
    if made is None:
        return
    if name == "reverse":
        attempt("Chain", name, value, lambda: made(x, reverse=value))
        return
    loop = made.with_options(mode="loop")
    if name == "x":
        attempt("Chain", "input", value, lambda: made(x))
    else:
        attempt("Chain", name, value, lambda: made(x), lambda y: same(y, loop(x)))


@run
@given(name=st.sampled_from(["reverse", "mode", "unroll", "checkpoint"]), value=junk)
def recurrent(name, value):
    args = dict(reverse=False, mode="scan", unroll=1, remat=False)
    args[name] = value
    cell = eqxscan.ElmanCell(3, 4, key=jr.key(0))
    rnn = attempt("Recurrent", name, value, lambda: eqxscan.Recurrent(cell, **args))
    if rnn is not None:
        xs, h = jnp.ones((5, 3)), jnp.zeros(4)
        loop = rnn.with_options(mode="loop")
        attempt(
            "Recurrent", name, value, lambda: rnn(h, xs), lambda y: same(y, loop(h, xs))
        )


@run
@given(
    name=st.sampled_from(["dim", "num_layers", "dtype", "dropout", "key"]), value=junk
)
def stacked_mlp(name, value):
    if big(name, value):
        return
    args = dict(dim=4, num_layers=2, key=jr.key(0), dtype=jnp.float32, dropout=0.0)
    args[name] = value
    attempt("StackedMLP", name, value, lambda: eqxscan.StackedMLP(**args))


MODEL = eqxscan.StackedMLP(4, 1, key=jr.key(0))


@run
@given(name=st.sampled_from(["path", "model", "like"]), value=junk)
def save_load(name, value):
    with tempfile.TemporaryDirectory() as where:
        path = os.path.join(where, "m.safetensors")
        if name == "path":
            attempt("save/load", "path", value, lambda: eqxscan.save(value, MODEL))
            attempt("save/load", "path", value, lambda: eqxscan.load(value, MODEL))
        elif name == "model":
            attempt("save/load", "model", value, lambda: eqxscan.save(path, value))
        else:
            eqxscan.save(path, MODEL)
            attempt("save/load", "like", value, lambda: eqxscan.load(path, value))


@run
@given(name=st.sampled_from(["step", "directory", "max_to_keep"]), value=junk)
def manager(name, value):
    from eqxscan import checkpoint, sharding

    with tempfile.TemporaryDirectory() as where:
        if name != "step":
            args = {"directory": where, "max_to_keep": 3, name: value}
            made = attempt(
                "CheckpointManager",
                name,
                value,
                lambda: checkpoint.CheckpointManager(asynchronous=False, **args),
            )
            if made is not None:
                made.close()
            return
        with checkpoint.CheckpointManager(where, asynchronous=False) as c:
            attempt("CheckpointManager", "step", value, lambda: c.save(value, MODEL))
            attempt(
                "CheckpointManager",
                "step",
                value,
                lambda: c.restore(MODEL, mesh=sharding.make_mesh(), step=value),
            )


if __name__ == "__main__":
    os.chdir(tempfile.mkdtemp())  # relative paths drawn above land there
    for fn in (stacked, chain, recurrent, stacked_mlp, save_load, manager):
        fn()
    print(json.dumps({"tally": tally, "raw": {k: v[:8] for k, v in raw.items()}}))
