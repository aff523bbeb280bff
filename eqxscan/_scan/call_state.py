"""What a call passes across the user's code (layers, cells, chained optax
transformations), which no argument can carry: the layer index a layer reads
([`eqxscan.layer_index`][]), the records of [`eqxscan.tap`][], the choices of
`"auto"` ([`eqxscan.explain_auto`][]) and `eqxscan.optim.layerwise`'s stack. One
frozen `CallState` in one context variable, changed only around a block; its
`step` is the engine step being traced (`None` outside one), which numbers a
layer."""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from jaxtyping import PyTree

from .layer_io import Index
from .probe import Probe


@dataclasses.dataclass(frozen=True, eq=False)
class TapCall:
    """One container call while tapped: its name, how many scan steps enclose it
    and its first row of a probe."""

    name: str
    depth: int = 0
    offset: int = 0
    reverse: bool = False  # last step first (`reverse=True`, held or passed)
    module: int = 0  # the `id` of the container called


@dataclasses.dataclass(frozen=True)
class Tapping:
    """What [`eqxscan.tap`][] was given, and what it has seen so far."""

    stat: Callable[..., PyTree] | None
    with_input: bool
    probe: Probe | None
    # A probe of the cotangent of what a `Recurrent` emits (`hs`), apart from
    # its carry: `find_nonfinite` tells the loss's cotangents from the cell's.
    emitted: Probe | None
    calls: list[TapCall]
    records: list  # the tapped function's own, to count probe rows by
    trace: object  # the tapped call's, which a statistic must not leave


@dataclasses.dataclass(frozen=True, eq=False)
class CallState:
    """Each field, and who sets it.

    - `step`: the index of the engine step being traced (traced int32, or the
      loop's int); the engine, around each step.
    - `layer`: the global index of the layer being called (`None`: not in a
      layer, or in a step inside another container's layer); `run_one`.
    - `tapping`: the running [`eqxscan.tap`][] (`None`: not tapped, or inside
      a layer); `paused`: the tapping a layer's call paused (`inside_layer`),
      which a `Recurrent`'s cell resumes.
    - `scope`: the innermost tap scope's records, `(index + 1, stats, call)`
      (index 0: a skipped layer); `call`: the container call being tapped;
      `depth`: how many tapped scan steps enclose the code.
    - `auto_records`: the `AutoChoice` lists of the open `explain_auto` calls,
      to which `auto.resolve` appends each choice.
    - `layerwise`: the path of the stack `eqxscan.optim.layerwise` runs its
      transformation on one layer at a time (`None`: not there).
    - `vmapped`: the batch of the eager `jax.vmap`s around a cached eager
      program, whose trace sees one example; `eager_compile`, for `"auto"`.
    """

    step: Index | None = None
    layer: Index | None = None
    tapping: Tapping | None = None
    scope: list | None = None
    call: TapCall | None = None
    depth: int = 0
    paused: Tapping | None = None
    auto_records: tuple[list, ...] = ()
    layerwise: str | None = None
    vmapped: int = 1


_OUTSIDE = CallState()  # frozen: shared by every context
_STATE: ContextVar[CallState] = ContextVar("eqxscan_call_state", default=_OUTSIDE)


def call_state() -> CallState:
    """The state of the call being traced (in this context)."""
    return _STATE.get()


@contextlib.contextmanager
def changed_call_state(**fields: object) -> Iterator[CallState]:
    """The state with `fields` replaced for the block (and returned)."""
    state = dataclasses.replace(_STATE.get(), **fields)  # pyright: ignore[reportArgumentType]  # checked by the dataclass
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


def layer_index() -> Index:
    """The index of the layer being called, read inside its `__call__` (or the
    method a container runs).

    Under `jax.lax.scan` (`mode="scan"`) a traced int32 scalar; with
    `mode="loop"`, and for a [`eqxscan.Chain`][]'s lone layers, a Python `int`.
    It counts the layers of the outermost container that runs the layer (a
    `Chain`'s `0 .. len(chain) - 1` across its groups, as `chain.unstack()`
    lists them; `reverse=True` keeps each layer's index); a container inside
    another's layer counts its own. For logging
    (`jax.debug.print("layer {}", eqxscan.layer_index())`), layer-dependent
    scaling, or choosing among per-layer values without threading
    `per_layer(jnp.arange(L))` through every call.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        class Scaled(eqx.Module):
            def __call__(self, x):
                i = eqxscan.layer_index()
                return x * (1.0 + jnp.asarray(i, x.dtype))  # layer i: times i + 1

        stack = eqxscan.Stacked(lambda k: Scaled(), 4, key=jax.random.key(0))
        assert stack(jnp.ones(())) == 1 * 2 * 3 * 4
        assert stack.with_options(mode="loop")(jnp.ones(())) == 24
        ```

    **Returns:**

    The layer's index: an int32 scalar array (traced) or a Python `int`.

    **Raises:**

    `RuntimeError` when called outside a layer run by a `Stacked` or `Chain`.
    """
    i = call_state().layer
    if i is None:
        raise RuntimeError(
            "eqxscan.layer_index() was called outside a layer: it reads the index "
            "of the layer that a Stacked or Chain is running.\nCall it inside a "
            "layer's __call__ (or the method the container runs), while the "
            "container calls it."
        )
    return i
