"""Taps: per-layer statistics of what flows between the layers, collected from
the scanned call itself.

While [`eqxscan.tap`][] runs a container, the layer-call seam hands every
layer's output to `tapped` (with the layer's global index): it records
`stat(output[, input])` in the current scope and, with a [`eqxscan.Probe`][],
adds the layer's slice of the probe to the output through a `custom_vjp` whose
backward pass returns the probe's statistic of the cotangent. The engine
(`collected`) gives every scan step a scope of its own and returns what the
step recorded as extra per-step outputs, so statistics leave nested scans
(a `Chain`'s repeated patterns) stacked; `tap` scatters them by layer index.
"""

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Float, PyTree

from .index import Index, index
from .layer_index import setting


Stat = Callable[..., PyTree]
"""`stat(output)` or `stat(output, input)`: a pytree of arrays from a layer's
output carry (and the carry it was given)."""


@dataclasses.dataclass(frozen=True)
class _Tapping:
    stat: Stat | None
    with_input: bool
    probe: "Probe | None"


_TAPPING: contextvars.ContextVar[_Tapping | None] = contextvars.ContextVar(
    "eqxscan_tapping", default=None
)
# What the innermost scope (a scan step, or the tapped call) has recorded:
# `(index + 1, stats)` pairs, the index a float (0 marks a skipped layer).
_SCOPE: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "eqxscan_tap_scope", default=None
)


def tapping() -> bool:
    """Whether a container call now is tapped (its trace then depends on it)."""
    return _TAPPING.get() is not None


def inside_layer() -> contextlib.AbstractContextManager[None]:
    """Set around a layer's own call: containers inside a layer are not tapped."""
    return setting(_TAPPING, None)


class Probe(eqx.Module):
    """A zero argument whose gradient holds the statistics of the cotangents
    reaching each layer's output (gradient taps). Build it with
    [`eqxscan.probe`][] and pass it to [`eqxscan.tap`][] inside the function
    being differentiated; the gradient with respect to it is a `Probe` whose
    `values[i]` is `stat(cotangent of layer i's output)`.

    The forward values do not depend on it (it is added as zero through a
    `jax.custom_vjp`), so a training step gets the gradient taps from its one
    `eqx.filter_value_and_grad` call.
    """

    values: PyTree[Float[Array, "L ..."]]
    stat: Callable[[PyTree], PyTree] = eqx.field(static=True)


def _inexact(tree: PyTree) -> PyTree:
    return eqx.filter(tree, eqx.is_inexact_array)


def probe(stat: Callable[[PyTree], PyTree], carry: PyTree, length: int) -> Probe:
    """A [`eqxscan.Probe`][] for `length` layers (or time steps) whose carry
    looks like `carry`.

    **Arguments:**

    - `stat`: a statistic of one layer's output cotangent (a pytree like the
      floating-point part of the carry), returning a pytree of float arrays,
      e.g. [`eqxscan.stats.rms`][].
    - `carry`: the carry, or `jax.ShapeDtypeStruct`s with its shapes.
    - `length`: the number of layers of the container (`len(model)`), or of
      time steps for an [`eqxscan.Recurrent`][]; [`eqxscan.tap`][] raises a
      `ValueError` naming both numbers when the call runs another number.

    **Returns:**

    A `Probe` of zeros, `values` with leading axis `length`.
    """
    shapes = jax.eval_shape(stat, _inexact(carry))

    def zeros(s: jax.ShapeDtypeStruct) -> Array:
        if not jnp.issubdtype(s.dtype, jnp.inexact):
            raise TypeError(
                f"eqxscan.probe needs a statistic that returns floating-point "
                f"arrays (a gradient holds it), but {stat!r} returned {s.dtype}.\n"
                "Return e.g. a count as float32."
            )
        return jnp.zeros((length, *s.shape), s.dtype)

    return Probe(jtu.tree_map(zeros, shapes), stat)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _probed(stat: Callable[[PyTree], PyTree], x: PyTree, p: PyTree) -> PyTree:
    del stat, p
    return x


def _probed_fwd(
    stat: Callable[[PyTree], PyTree], x: PyTree, p: PyTree
) -> tuple[PyTree, None]:
    del stat, p
    return x, None


def _probed_bwd(
    stat: Callable[[PyTree], PyTree], res: None, ct: PyTree
) -> tuple[PyTree, PyTree]:
    del res
    return ct, stat(ct)


_probed.defvjp(_probed_fwd, _probed_bwd)


def tapped(i: Index | None, new: PyTree, old: PyTree) -> PyTree:
    """Layer (or step) `i`'s output `new`, given `old`: its statistics
    recorded, and its slice of the probe attached, while a call is tapped."""
    state = _TAPPING.get()
    scope = _SCOPE.get()
    if state is None or scope is None or i is None:
        return new
    if state.stat is not None:
        stats = state.stat(new, old) if state.with_input else state.stat(new)
        scope.append((jnp.asarray(i, jnp.float32) + 1, stats))
    elif state.probe is not None:
        # Only counted: the probe needs one row per layer (see `_check_rows`).
        scope.append((jnp.asarray(i, jnp.float32) + 1, None))
    if state.probe is not None:
        dyn, rest = eqx.partition(new, eqx.is_inexact_array)
        p = index(state.probe.values, i)
        new = eqx.combine(_probed(state.probe.stat, dyn, p), rest)
    return new


Run = Callable[..., tuple[PyTree, PyTree]]


def collected(run: Run) -> Run:
    """The engine's `run`, each step's records (while tapped) returned beside
    its `y` and added, stacked, to the enclosing scope."""

    @functools.wraps(run)
    def wrapped(
        step: Callable, carry: PyTree, xs: PyTree, **kwargs: object
    ) -> tuple[PyTree, PyTree]:
        outer = _SCOPE.get()
        if _TAPPING.get() is None or outer is None:
            return run(step, carry, xs, **kwargs)

        def body(c: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
            records: list = []
            with setting(_SCOPE, records):
                new, y = step(c, x)
            return new, (y, records)

        c, (ys, records) = run(body, carry, xs, **kwargs)
        outer.extend(records)
        return c, ys

    return wrapped


@contextlib.contextmanager
def held() -> Iterator[list]:
    """The records made inside the block, kept from the enclosing scope: a
    `lax.switch` branch returns them (a record must not leave its trace), and
    `add` puts them in the scope after the switch."""
    records: list = []
    if _TAPPING.get() is None or _SCOPE.get() is None:
        yield records
        return
    with setting(_SCOPE, records):
        yield records


def add(records: Sequence) -> None:
    """Put `records` (from `held`) in the enclosing scope."""
    outer = _SCOPE.get()
    if _TAPPING.get() is not None and outer is not None:
        outer.extend(records)


@contextlib.contextmanager
def covering(length: int) -> Iterator[None]:
    """Around a call that may run only some of a model's `length` layers
    (`run_layers`): while tapped, its records are padded to one per layer, so
    that layers not run read zeros (as LayerDrop's skipped layers do) rather
    than the gathered taps being cut to the number of layers run."""
    outer = _SCOPE.get()
    if _TAPPING.get() is None or outer is None:
        yield
        return
    records: list = []
    with setting(_SCOPE, records):
        yield
    outer.extend(records)
    count = sum(idx.size for idx, _ in records)
    if records and count > length:
        # Layers chosen more than once: still `length` rows of a probe.
        outer.append((None, -(count - length)))
    if records and count < length:
        idx, stats = records[0]
        pad = jtu.tree_map(
            lambda a: jnp.zeros((length - count, *a.shape[idx.ndim :]), a.dtype),
            stats,
        )
        # Index 0 is the slot `_gather` drops.
        outer.append((jnp.zeros((length - count,), jnp.float32), pad))


def _takes_input(stat: Stat) -> bool:
    try:
        params = inspect.signature(stat).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        and p.default is p.empty
    ]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _gather(records: list, where: str) -> PyTree:
    # The records (index + 1, stats), each with leading axes of the scans it
    # came out of, as one `[L, ...]` pytree in layer order.
    ids, stats = [], []
    for idx, s in records:
        if idx is None:  # a repeat count from `covering`
            continue
        n = idx.ndim
        ids.append(idx.reshape(-1).astype(jnp.int32))
        stats.append(jtu.tree_map(lambda a, n=n: a.reshape(-1, *a.shape[n:]), s))
    all_ids = jnp.concatenate(ids)
    length = all_ids.shape[0]
    try:
        joined = jtu.tree_map(lambda *a: jnp.concatenate(a), *stats)
    except ValueError as e:
        raise TypeError(
            f"{where}: the statistic returned pytrees of different structures at "
            f"different layers ({e}).\nReturn the same structure for every layer "
            "(e.g. one value per carry leaf, for carries that all look alike)."
        ) from None
    return jtu.tree_map(
        lambda a: jnp.zeros((length + 1, *a.shape[1:]), a.dtype).at[all_ids].set(a)[1:],
        joined,
    )


def tap(
    model: Callable[..., PyTree],
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

    - `model`: the container to call. Its layers are numbered as
      [`eqxscan.layer_index`][] numbers them (a `Chain`'s across its stacks,
      repeated patterns and lone layers); a `Recurrent`'s steps by time step. A
      container inside one of its layers is not tapped.
    - `stat`: `stat(output)` or `stat(output, input)`, a pytree of arrays from
      a layer's output carry (and the carry it received), e.g.
      [`eqxscan.stats.rms`][], or a function returning a dict of several.
    - `probe`: an [`eqxscan.Probe`][] for gradient taps: differentiate with
      respect to it, and its gradient holds its statistic of the cotangent
      reaching each layer's output.

    **Returns:**

    A function taking `model`'s arguments and returning `(output, stats)`:
    `model`'s own output, and `stat`'s pytree with a leading axis of one entry
    per layer (or step), `None` without `stat`. A layer that LayerDrop skipped
    has zeros there.
    """
    if stat is not None and not callable(stat):
        raise TypeError(f"eqxscan.tap: stat must be a function, got {stat!r}.")
    if probe is not None and not isinstance(probe, Probe):
        raise TypeError(
            f"eqxscan.tap: probe must be an eqxscan.Probe (from eqxscan.probe), "
            f"got {type(probe).__name__}."
        )
    with_input = stat is not None and _takes_input(stat)

    def call(*args: object, **kwargs: object) -> tuple[PyTree, PyTree]:
        leaves = jtu.tree_leaves((model, probe, args, kwargs))
        eager = getattr(model, "mode", "scan") != "loop" and not any(
            isinstance(leaf, jax.core.Tracer) for leaf in leaves
        )
        # An eager container call compiles itself: the records would leave
        # its `jit`. Tapped, the whole call is compiled once per structure.
        run = _run_jitted if eager else _run
        return run(model, stat, with_input, probe, args, kwargs)

    return call


def _run(
    model: Callable[..., PyTree],
    stat: Stat | None,
    with_input: bool,
    probe: Probe | None,
    args: tuple,
    kwargs: dict,
) -> tuple[PyTree, PyTree]:
    records: list = []
    with setting(_TAPPING, _Tapping(stat, with_input, probe)), setting(_SCOPE, records):
        out = model(*args, **kwargs)
    if probe is not None:
        _check_rows(probe, records, model)
    if stat is None:
        return out, None
    if not records:
        raise TypeError(
            f"eqxscan.tap: calling {type(model).__name__} ran no layers of a "
            "Stacked, Chain or Recurrent.\nTap the container itself, e.g. "
            "`eqxscan.tap(model.blocks, stat)(x)` inside the model's forward."
        )
    return out, _gather(records, "eqxscan.tap")


def _check_rows(probe: Probe, records: list, model: object) -> None:
    # A probe row per layer: a wrong length would silently merge rows (indices
    # past the end are clamped) or leave rows that no layer reaches.
    leaves = jtu.tree_leaves(probe.values)
    if not leaves or not records:
        return
    rows = leaves[0].shape[0]
    count = sum(s if idx is None else idx.size for idx, s in records)
    if rows != count:
        raise ValueError(
            f"eqxscan.tap: the probe has {rows} rows, but calling "
            f"{type(model).__name__} ran {count} layers (or time steps).\nBuild "
            f"it with eqxscan.probe(stat, carry, {count}): one row per layer."
        )


_run_jitted = eqx.filter_jit(_run)
