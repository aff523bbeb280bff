"""The state of a call that reaches code between the package's own frames: the
user's layers and cells, and the optax transformations a user chains.

Where a value can be passed as an argument, it is. What a user's layer reads
while a container calls it ([`eqxscan.layer_index`][]), what the containers
inside it record for [`eqxscan.tap`][], what `"auto"` chose for
[`eqxscan.explain_auto`][], and which stack `eqxscan.optim.layerwise` is running
on cannot be: the user's code sits in between. All of it is one frozen
`CallState` in one context variable, replaced only by `changed_call_state(...)`
around a block and restored after it.
"""

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
    (a call in a `Recurrent`'s cell: one per time step) and its first row of a
    probe."""

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
    """Each field: what it is; who sets it; who reads it.

    - `step`: the index of the engine step being traced (traced int32, or the
      loop's int); the engine's `run`, around each step; the containers
      (`step_index_or_none`, `step_index`), to number their layers.
    - `layer`: the global index of the layer being called (`None`: not in a
      layer, or a step inside another container's layer); the layer-call seam
      (`at_layer`); [`eqxscan.layer_index`][] and the drop rates.
    - `tapping`: the running [`eqxscan.tap`][] (`None`: not tapped, or inside a
      layer); `taps.tap_calls`, cleared around a layer and an untraced trace,
      resumed in a `Recurrent`'s cell; everything in `taps.py`.
    - `scope`: the innermost tap scope's records, `(index + 1, stats, call)`,
      the index a float (0 marks a skipped layer); `tap_calls`, each engine
      step (`StepTaps`), `held` and `covering`; `tapped` appends to it.
    - `call`: the container call being tapped; `call_of`; `tapped`, to tag
      records, and the probe's rows.
    - `depth`: how many tapped scan steps enclose the code; `tap_calls` (0)
      and `StepTaps` (+1); `call_of`, for `TapCall.depth`.
    - `paused`: the tapping a layer's call paused; the layer-call seam
      (`inside_layer`); a `Recurrent`'s cell (`in_cell`), to resume it.
    - `auto_records`: the lists of `AutoChoice`s of the open
      `auto.recording()` blocks ([`eqxscan.explain_auto`][] opens one);
      `recording`; `auto.resolve` appends each choice to every one.
    - `layerwise`: the path of the stack whose layers `eqxscan.optim.layerwise`
      runs its transformation on, one at a time (`None`: not there);
      `layerwise`'s update; the optimiser transformations that refuse to run
      one layer at a time.
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


_OUTSIDE = CallState()  # frozen: shared by every context
_STATE: ContextVar[CallState] = ContextVar("eqxscan_call_state", default=_OUTSIDE)


def call_state() -> CallState:
    """The state of the call being traced (in this context)."""
    return _STATE.get()


@contextlib.contextmanager
def changed_call_state(**fields: object) -> Iterator[CallState]:
    """The state with `fields` replaced for the block (and returned), then
    restored."""
    state = dataclasses.replace(_STATE.get(), **fields)  # pyright: ignore[reportArgumentType]  # checked by the dataclass
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)
