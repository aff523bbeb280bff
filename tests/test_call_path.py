"""How deep eqxscan's own code sits between `Stacked.__call__` and a layer's
`__call__`: the frames a traceback from inside a layer shows."""

import os
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqxscan


PACKAGE = os.path.dirname(eqxscan.__file__)
# eqxscan's frames between `Stacked.__call__` and the layer, in either mode.
MAX_FRAMES = 6


class _Recorded(eqx.Module):
    weight: jax.Array
    stacks: list = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.stacks.append(traceback.extract_stack())
        return x * self.weight


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
    frames = stacks[0][:-1]  # the layer's own frame last
    calls = [
        k
        for k, f in enumerate(frames)
        if f.name == "__call__"
        and f.filename.endswith(os.path.join("_containers", "stacked.py"))
    ]
    assert calls, "Stacked.__call__ is not on the stack"
    inside = frames[calls[0] + 1 :]
    return [
        f"{os.path.relpath(f.filename, PACKAGE)}:{f.name}"
        for f in inside
        if f.filename.startswith(PACKAGE + os.sep)
    ]


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_few_frames_between_stack_and_layer(mode: str) -> None:
    frames = _frames(mode)
    print(f"{mode}: {len(frames)} frames", *frames, sep="\n  ")
    assert len(frames) <= MAX_FRAMES, "\n".join(frames)
