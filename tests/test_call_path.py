"""How deep eqxscan's own code sits between a container's `__call__` and a
layer's (or cell's) `__call__`: the frames a traceback from inside it shows."""

import os
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqxscan


PACKAGE = os.path.dirname(eqxscan.__file__)
# At most six eqxscan frames between a container's `__call__` and a layer's (or
# a cell's): few enough to follow in a traceback. Each path is held to its
# present depth, so that a frame added anywhere shows.
MAX_FRAMES = 6
# `Stacked` (in either mode) and `Recurrent` (with or without a `mask`).
STACKED_FRAMES = 5
# A `Chain`'s lone layer: its loop over the groups (`run_groups`), `run_one`.
CHAIN_LONE_FRAMES = 2
# A layer of a `Chain`'s stack of like layers: `run_groups`, then a `Stacked`'s.
CHAIN_STACK_FRAMES = 6
assert max(STACKED_FRAMES, CHAIN_LONE_FRAMES, CHAIN_STACK_FRAMES) <= MAX_FRAMES
# A layer inside a repeated pattern: the repeats run as a stack (6 frames), then
# the pattern's step (`run`), its own loop over its groups and `run_one`. Over
# MAX_FRAMES, as each scan step runs a small chain of its own.
CHAIN_PATTERN_FRAMES = 9


class _Recorded(eqx.Module):
    weight: jax.Array
    stacks: list = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.stacks.append(traceback.extract_stack())
        return x * self.weight


class _Shifted(eqx.Module):
    """Unlike `_Recorded`, so a `Chain` does not stack the two together."""

    shift: jax.Array
    stacks: list = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.stacks.append(traceback.extract_stack())
        return x + self.shift


class _Cell(eqx.Module):
    weight: jax.Array
    stacks: list = eqx.field(static=True)

    def __call__(self, x: jax.Array, h: jax.Array) -> jax.Array:
        self.stacks.append(traceback.extract_stack())
        return h * self.weight + x


def _inside(stack: traceback.StackSummary, container: str) -> list[str]:
    """eqxscan's frames of `stack` (recorded in a layer) below the outermost
    `__call__` of the file `container` (under eqxscan/_containers)."""
    frames = stack[:-1]  # the layer's own frame last
    path = os.path.join("_containers", *container.split("/"))
    calls = [
        k
        for k, f in enumerate(frames)
        if f.name == "__call__" and f.filename.endswith(path)
    ]
    assert calls, f"__call__ of {container} is not on the stack"
    inside = frames[calls[0] + 1 :]
    return [
        f"{os.path.relpath(f.filename, PACKAGE)}:{f.name}"
        for f in inside
        if f.filename.startswith(PACKAGE + os.sep)
    ]


def _check(name: str, frames: list[str], bound: int) -> None:
    print(f"{name}: {len(frames)} frames", *frames, sep="\n  ")
    assert len(frames) <= bound, "\n".join(frames)


def _frames(mode: str) -> list[str]:
    stacks: list = []
    stack = eqxscan.Stacked(
        lambda k: _Recorded(jax.random.normal(k, (3,)), stacks),
        3,
        key=jax.random.key(0),
        mode=mode,
    )
    out = stack(jnp.ones(3))
    assert jnp.allclose(out, jnp.prod(stack.layers.weight, axis=0))
    return _inside(stacks[0], "stacked.py")


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_few_frames_between_stack_and_layer(mode: str) -> None:
    _check(mode, _frames(mode), STACKED_FRAMES)


def _chain(kinds: str, mode: str) -> tuple[list, list]:
    """Run a `Chain` of layers `kinds` ("r" a `_Recorded`, "s" a `_Shifted`)
    against the same fold written out; the stacks each kind recorded."""
    recorded: list = []
    shifted: list = []
    keys = jax.random.split(jax.random.key(0), len(kinds))
    layers = [
        _Recorded(jax.random.normal(k, (3,)), recorded)
        if kind == "r"
        else _Shifted(jax.random.normal(k, (3,)), shifted)
        for kind, k in zip(kinds, keys)
    ]
    expected = jnp.ones(3)
    for layer in layers:
        expected = (
            expected * layer.weight
            if isinstance(layer, _Recorded)
            else expected + layer.shift
        )
    out = eqxscan.Chain(layers, mode=mode)(jnp.ones(3))
    assert jnp.allclose(out, expected)
    return recorded, shifted


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_few_frames_between_chain_and_layer(mode: str) -> None:
    # A stack of three like layers, then a lone one.
    stacked, lone = _chain("rrrs", mode)
    _check(f"{mode}, stack", _inside(stacked[0], "chain/chain.py"), CHAIN_STACK_FRAMES)
    _check(f"{mode}, lone", _inside(lone[0], "chain/chain.py"), CHAIN_LONE_FRAMES)
    # The pattern (r, s) repeated twice: one scan over the repeats.
    in_pattern, _ = _chain("rsrs", mode)
    frames = _inside(in_pattern[0], "chain/chain.py")
    _check(f"{mode}, pattern", frames, CHAIN_PATTERN_FRAMES)


@pytest.mark.parametrize("mode", ["scan", "loop"])
@pytest.mark.parametrize("masked", [False, True])
def test_few_frames_between_recurrent_and_cell(mode: str, masked: bool) -> None:
    stacks: list = []
    weight = jax.random.normal(jax.random.key(0), (3,))
    rnn = eqxscan.Recurrent(_Cell(weight, stacks), mode=mode)
    xs = jax.random.normal(jax.random.key(1), (4, 3))
    mask = jnp.array([True, True, True, False])
    h_T, _ = rnn(jnp.zeros(3), xs, mask=mask if masked else None)
    h = jnp.zeros(3)
    for x in xs[:3] if masked else xs:
        h = h * weight + x
    assert jnp.allclose(h_T, h)
    frames = _inside(stacks[0], "recurrent.py")
    _check(f"{mode}, masked={masked}", frames, STACKED_FRAMES)
