"""`eqxscan.tap`: a call with taps on its containers' carries, compiled as an
eager call is when called outside `jit` (the records are `taps`')."""

from collections.abc import Callable

import jax
import jax.core
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._helpers.checks import Checked
from .eager_compile import compiled_when_eager
from .options import Scanning
from .probe import Probe
from .taps import Stat, takes_input, tap_calls


def tap(
    model: Checked[Callable[..., PyTree]],
    stat: Stat | None = None,
    *,
    probe: Probe | None = None,
) -> Callable[..., tuple[PyTree, PyTree]]:
    """Call `model` (a [`eqxscan.Stacked`][], [`eqxscan.Chain`][] or
    [`eqxscan.Recurrent`][]) with taps on its carry: per-layer statistics of
    what each layer returns, from the scanned call itself (one compiled
    program; the layers' code unchanged).

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(8, 8, key=k), 4, key=jax.random.key(0)
        )
        y, rms = eqxscan.tap(stack, eqxscan.stats.rms)(jnp.ones(8))
        assert rms.shape == (4,)  # rms[i]: the RMS of layer i's output
        ```

    **Arguments:**

    - `model`: the container to call, or a function that calls containers.
      Their layers are numbered as [`eqxscan.layer_index`][] numbers them (a
      `Chain`'s across its stacks, repeated patterns and lone layers); a
      `Recurrent`'s steps by time step. A container inside a layer is not
      tapped; one that a `Recurrent`'s cell calls is.
    - `stat`: `stat(output)` or `stat(output, input)`, a pytree of arrays from
      a layer's output carry (and the carry it received), e.g.
      [`eqxscan.stats.rms`][], or a function returning a dict of several.
    - `probe`: an [`eqxscan.Probe`][] for gradient taps: differentiate with
      respect to it, and its gradient holds its statistic of the cotangent
      reaching each layer's output. With several container calls its rows
      follow one another in call order, or, with `per_call=True`, its
      `values` are keyed as the statistics are (calls in a cell have none).

    **Returns:**

    A function taking `model`'s arguments and returning `(output, stats)`:
    `model`'s own output, and `stat`'s pytree with a leading axis of one entry
    per layer (or step), `None` without `stat`. A layer that LayerDrop skipped
    has zeros there. When several container calls are tapped, `stats` is a
    dict with each call's own, keyed by its class name in call order
    (`"Stacked"`, `"Stacked_1"`, `"Recurrent"`); a call inside a `Recurrent`'s
    cell has a leading time axis before its layers.
    """
    if not callable(model):
        raise TypeError(
            f"eqxscan.tap: model must be callable, got {type(model).__name__}.\n"
            "Hint: `eqxscan.tap(model, stat)(x)`: the container (or a function "
            "calling it) first, then the statistic, then the inputs."
        )
    if isinstance(stat, Scanning) and not isinstance(model, Scanning):
        raise TypeError(
            f"eqxscan.tap: stat is a {type(stat).__name__}, and model a "
            f"{type(model).__name__}: the arguments look swapped.\nHint: "
            "`eqxscan.tap(model, stat)(x)`: the container first, then the statistic."
        )
    if stat is not None and not callable(stat):
        raise TypeError(
            f"eqxscan.tap: stat must be a function, got {stat!r}.\n"
            "Hint: a function of a layer's carry, such as `eqxscan.stats.rms`, or "
            "`None` to record nothing."
        )
    if probe is not None and not isinstance(probe, Probe):
        raise TypeError(
            f"eqxscan.tap: probe must be an eqxscan.Probe (from eqxscan.probe), "
            f"got {type(probe).__name__}."
        )
    with_input = stat is not None and takes_input(stat)

    def call(*args: object, **kwargs: object) -> tuple[PyTree, PyTree]:
        leaves = jtu.tree_leaves((model, probe, args, kwargs))
        eager = getattr(model, "mode", "scan") != "loop" and not any(
            isinstance(leaf, jax.core.Tracer) for leaf in leaves
        )
        # An eager container call compiles itself: the records would leave
        # its `jit`. Tapped, the whole call is compiled once per structure.
        run = _run_compiled if eager else _run
        return run(model, stat, with_input, probe, args, kwargs)

    return call


def _run(*args: object) -> tuple[PyTree, PyTree]:
    out, calls = tap_calls(*args)  # pyright: ignore[reportArgumentType]
    if calls is None or len(calls) > 1:
        return out, None if calls is None else {c.name: s for c, s, _ in calls}
    return out, calls[0][1]


# Keyed as an eager call is, by what the model and `stat` read: a changed
# global compiles anew.
_run_compiled = compiled_when_eager(_run, scanning=False, name="eqxscan.tap")
