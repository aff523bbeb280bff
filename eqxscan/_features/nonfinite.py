"""`find_nonfinite`: the layer (or time step), carry leaf and pass that first
produced a NaN or inf, read on the host from the counts of one compiled training
step (carry taps and gradient probes of `nonfinite_count`)."""

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float, PyTree

from .._containers.chain import Chain
from .._containers.recurrent import Recurrent
from .._containers.stacked import LayerNumbering, Stacked
from .._helpers.checks import Checked
from .._scan.eager_compile import compiled_when_eager
from .._scan.probe import Probe
from .._scan.tap_stats import nonfinite_count
from .._scan.taps import tap_calls


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """What [`eqxscan.find_nonfinite`][] found.

    - `found`: whether anything (loss, carry, cotangent, gradient) was
      non-finite.
    - `where`: `"forward"` (a layer's output), `"backward"` (the cotangent a
      layer passed down, or its parameters' gradient), `"loss"` (the loss after
      the container, forward or backward), or `None`.
    - `index`: the layer (or time step) that first produced one: forward, the
      first to run with a non-finite output (the lowest, or the highest for a
      call with `reverse=True`, or as `eqxscan.run_layers` ordered them);
      backward, the first reached (the one that ran last);
      `"loss"`, the one whose output got the non-finite cotangent; or
      `None` (a non-finite loss value, or a `Recurrent` cell's parameter
      gradient, summed over steps).
    - `leaf`: the carry leaf or parameter that held it, e.g. `"carry[0]"` or
      `"layer.weight"`.
    - `message`: one line saying all this.
    - `forward`, `backward`: non-finite entries per layer of each carry leaf,
      and of the cotangent reaching each layer's output (`[L]` arrays, in the
      carry's structure).
    - `loss`: the loss value.
    - `call`: when `loss_fn` calls several containers, the one named, as
      [`eqxscan.tap`][] names calls (`"Stacked"`, `"Stacked_1"`, `"Recurrent"`,
      in call order; `forward` and `backward` are then dicts by these names);
      `None` for one container.
    """

    found: bool
    where: Literal["forward", "backward", "loss"] | None
    index: int | None
    leaf: str | None
    message: str
    forward: PyTree
    backward: PyTree
    loss: float
    call: str | None = None

    def __str__(self) -> str:
        return self.message


def _param_counts(grads: PyTree) -> list[tuple[str, dict[str, Float[Array, " L"]]]]:
    # Per outermost `Stacked` or `Chain` (with its class name), per parameter
    # path: the non-finite entries of each layer's gradient.
    out: list[tuple[str, dict[str, Array]]] = []
    for c in _containers(grads):
        out.append((type(c).__name__, {}))
        c.state_dict_layers(functools.partial(_count, out[-1][1], len(c)))
    return out


def _containers(tree: PyTree) -> list[Stacked | Chain]:
    is_container = lambda x: isinstance(x, Stacked | Chain)  # noqa: E731
    return [c for c in jtu.tree_leaves(tree, is_leaf=is_container) if is_container(c)]


def _count(
    counts: dict, length: int, tree: PyTree, numbering: LayerNumbering, axes: tuple
) -> PyTree:
    # Layers numbered as the state dict numbers them (a repeated pattern's, a
    # stack stored in stage order), not by position in the stacked arrays.
    ids = numbering.number(tuple(np.indices(axes)))
    for path, leaf in jtu.tree_leaves_with_path(tree):
        if eqx.is_inexact_array(leaf) and leaf.shape[: len(axes)] == axes:
            rest = tuple(range(len(axes), leaf.ndim))
            bad = jnp.sum(~jnp.isfinite(leaf), axis=rest, dtype=jnp.float32)
            row = counts.get(jtu.keystr(path), jnp.zeros(length))
            counts[jtu.keystr(path)] = row.at[ids].add(bad)
    return tree


def _shared_counts(grads: PyTree) -> dict[str, Array]:
    # Per parameter of each `Recurrent`'s cell: its non-finite entries (shared
    # by every time step, so they name no step).
    found = jtu.tree_leaves(grads, is_leaf=lambda x: isinstance(x, Recurrent))
    return {
        jtu.keystr(path): jnp.sum(~jnp.isfinite(leaf))
        for rnn in found
        if isinstance(rnn, Recurrent)
        for path, leaf in jtu.tree_leaves_with_path(rnn)
        if eqx.is_inexact_array(leaf)
    }


def _program(model: PyTree, loss_fn: Callable[..., Array], inputs: tuple) -> tuple:
    def loss(m_and_probes: tuple[PyTree, tuple | None]) -> tuple[Array, PyTree]:
        m, probes = m_and_probes
        probe, emitted = (None, None) if probes is None else probes
        fn = lambda *a: loss_fn(m, *a)  # noqa: E731
        value, calls = tap_calls(fn, nonfinite_count, False, probe, inputs, {}, emitted)
        # Where `m` holds each call's container: the place of its gradient.
        held = [id(c) for c in _containers(m)]
        at = lambda c: held.index(c.module) if c.module in held else None  # noqa: E731
        return value, [(c, s, i, at(c)) for c, s, i in calls or ()]

    # Two probes per container call, one row per layer and carry leaf, like the
    # forward counts: the cotangent of each output carry, and of what a
    # `Recurrent` emits (`hs`), which the loss alone reaches.
    calls = eqx.filter_eval_shape(lambda: loss((model, None))[1])
    zeros = {
        c.name: jtu.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), s)
        for c, s, *_ in calls
    }
    probes = tuple(Probe(zeros, nonfinite_count, per_call=True) for _ in range(2))
    (value, forward), (g_model, g_probes) = eqx.filter_value_and_grad(
        loss, has_aux=True
    )((model, probes))
    backward, emitted = (p.values for p in g_probes)
    rows = [(c, s, backward[c.name], emitted[c.name], *i) for c, s, *i in forward]
    return value, rows, (_param_counts(g_model), _shared_counts(g_model))


# Compiled once per structure of model and inputs, loss function (by its code
# and what it reads) and the values the code run reads from outside them.
_compiled = compiled_when_eager(_program, scanning=False, name="eqxscan.find_nonfinite")


def _order(ids: object, reverse: bool) -> list[int]:
    # The layers a call ran, in run order, from the indices + 1 its taps
    # recorded (0: not run); a call in reverse recorded them ascending.
    ran = [int(i) - 1 for i in np.asarray(ids) if i > 0]
    return sorted(ran, reverse=True) if reverse else ran


def _first(tree: PyTree, order: list[int]) -> tuple[int, str] | None:
    # The first of `order` counted above zero in a leaf of `tree`, and its path.
    leaves = [
        (np.asarray(c), jtu.keystr(p)) for p, c in jtu.tree_leaves_with_path(tree)
    ]
    return next(((i, p) for i in order for c, p in leaves if c[i] > 0), None)


def find_nonfinite(
    model: PyTree, loss_fn: Checked[Callable[..., Array]], *inputs: PyTree
) -> NonFinite:
    """Find the layer (or time step) that first produced a NaN or inf in one
    training step, the carry leaf that held it, and which pass did, in one run
    of the scanned program (compiled once per structure of `model` and
    `inputs`, and per `loss_fn` by its code and the values it reads, as an
    eager call is): `eqx.filter_value_and_grad(loss_fn)(model, *inputs)` with
    [`eqxscan.tap`][] and an [`eqxscan.Probe`][] of
    [`eqxscan.stats.nonfinite_count`][], counting each layer's non-finite
    parameter gradients.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(4, 4, key=k), 6, key=jax.random.key(0)
        )
        w = stack.layers.weight.at[3].set(jnp.nan)  # layer 3 is broken
        stack = eqx.tree_at(lambda s: s.layers.weight, stack, w)
        report = eqxscan.find_nonfinite(stack, lambda m, x: jnp.sum(m(x)), jnp.ones(4))
        assert (report.where, report.index) == ("forward", 3)
        ```

    **Arguments:**

    - `model`: what `loss_fn` is differentiated with respect to (a model, or a
      [`eqxscan.Stacked`][], [`eqxscan.Chain`][] or [`eqxscan.Recurrent`][]).
    - `loss_fn`: `loss_fn(model, *inputs) -> scalar`, calling the containers
      directly (not inside its own `vmap`, `remat` or `jit`); with several
      calls, the report names one (`report.call`).
    - `*inputs`: the rest of `loss_fn`'s arguments (a batch).

    **Returns:**

    A [`eqxscan.NonFinite`][] report; `str(report)` is one line.
    """
    # The function first (as `jax.grad`'s) would call the model with the function.
    if inspect.isfunction(model) and issubclass(type(loss_fn), eqx.Module):
        got = f"got a function as model and a {type(loss_fn).__name__} as loss_fn"
    elif not callable(loss_fn):
        got = f"loss_fn must be callable, got {type(loss_fn).__name__}"
    else:
        got = None
    if got is not None:
        raise TypeError(
            f"eqxscan.find_nonfinite: {got}.\nHint: "
            "`find_nonfinite(model, loss_fn, *inputs)`, with "
            "`loss_fn(model, *inputs)` returning the loss."
        )
    value, rows, (params, shared) = jax.device_get(_compiled(model, loss_fn, inputs))
    # Calls inside a `Recurrent`'s cell (counts per time step) are not checked.
    rows = [r for r in rows if all(np.ndim(a) == 1 for a in jtu.tree_leaves(r[1]))]
    if not any(jtu.tree_leaves(r[1]) for r in rows):
        raise TypeError(
            "eqxscan.find_nonfinite: the tapped container's carry has no "
            "floating-point leaves to check.\nCheck that loss_fn calls a Stacked, "
            "Chain or Recurrent whose carry holds floats."
        )
    several = len(rows) > 1
    found = _found(float(value), rows, params, shared, several)
    # At the first step of the first call with non-finite inputs, a hint (not a
    # verdict: padding may be NaN by design, a masked time step's).
    first_call, *_, ids, _ = rows[0]
    if found is not None and found[0] == "forward" and found[4] == first_call.name:
        if _order(ids, first_call.reverse)[:1] == [found[1]] and _nonfinite(inputs):
            found = (*found[:3], found[3] + _INPUT_HINT, found[4])
    clean = "No NaN or inf: loss, carries and gradients are finite."
    where, index, leaf, message, call = found or (None, None, None, clean, None)
    # The forward and backward counts by call name, or the one call's.
    pick = lambda k: {r[0].name: r[k] for r in rows} if several else rows[0][k]
    args = (where, index, leaf, message, pick(1), pick(2), float(value))
    return NonFinite(where is not None, *args, call if several else None)


_INPUT_HINT = (
    " It is the first step run, and the inputs given to loss_fn already hold NaN "
    "or inf: check them first (masked padding aside)."
)


def _nonfinite(tree: PyTree) -> bool:
    leaves = [x for x in jtu.tree_leaves(tree) if eqx.is_inexact_array(x)]
    return any(not bool(jnp.all(jnp.isfinite(x))) for x in leaves)


def _found(
    value: float, rows: list, params: list, shared: dict, several: bool
) -> tuple | None:
    # `(where, index, leaf, message, call)` of the first non-finite value.
    def at(name: str, i: int) -> str:
        what = "time step" if name.startswith("Recurrent") else "layer"
        return f"{what} {i}" + (f" of {name}" if several else "")

    for call, fwd_counts, _, _, ids, _ in rows:
        fwd = _first(fwd_counts, _order(ids, call.reverse))
        if fwd is not None:
            i, path = fwd
            message = (
                f"The forward pass went non-finite at {at(call.name, i)}: its output "
                f"carry{path} holds NaN or inf (every earlier output is finite)."
            )
            return "forward", i, f"carry{path}", message, call.name
    if not np.isfinite(value):
        message = (
            f"Every layer's output is finite, but the loss is {value}: the part "
            "of loss_fn after the container made it."
        )
        return "loss", None, None, message, None
    # Each call's parameter counts: its container's, where `model` holds it,
    # else those of the next one of its class and length, in call order.
    left = [p for k, p in enumerate(params) if k not in {r[-1] for r in rows}]
    mine = []
    for call, fwd_counts, *_, held in rows:
        if held is not None:
            mine.append(params[held][1])
            continue
        length = jtu.tree_leaves(fwd_counts)[0].shape[0]
        same = [p for p in left if p[0] == call.name.split("_")[0]]
        fits = [p for p in same if all(a.shape[0] == length for a in p[1].values())]
        mine.append(left.pop(left.index(fits[0]))[1] if fits else {})
    for row, counts in reversed(list(zip(rows, mine))):
        call, _, bwd_counts, emitted, ids, _ = row
        at_i = functools.partial(at, call.name)
        found = _backward(bwd_counts, emitted, counts, _order(ids, call.reverse), at_i)
        if found is not None:
            return *found, call.name
    if bad := [path for path, count in shared.items() if count > 0]:
        # Every step's cotangent is finite, yet the cell's own gradient is not.
        leaf = bad[0].lstrip(".")
        message = (
            f"The backward pass went non-finite in the cell's parameter {leaf}: "
            "its gradient, summed over the time steps, holds NaN or inf while "
            "every carry and cotangent is finite (no one time step is named)."
        )
        return "backward", None, leaf, message, None
    return None


def _backward(
    backward: PyTree,
    emitted: PyTree,
    params: dict,
    order: list[int],
    at: Callable[[int], str],
) -> tuple[Literal["backward", "loss"], int, str, str] | None:
    # The backward pass reaches the layer that ran last first (`order`: the
    # layers in the order they ran): the cotangent of output j came non-finite
    # from the loss (what a `Recurrent` emits, or the last output), or the next
    # layer passed it down, or a layer made non-finite gradients of its own
    # parameters.
    candidates = []
    back = order[::-1]
    bwd = _first(backward, back)
    if bwd is not None:
        j, path = bwd
        from_loss = _first(emitted, back)
        if j == order[-1] or (from_loss and from_loss[0] == j):
            message = (
                f"The cotangent of {at(j)}'s output carry{path} is already "
                "non-finite: the backward pass of loss_fn after the container "
                "made it."
            )
            return "loss", j, f"carry{path}", message
        said = "passed a non-finite cotangent to its input {}"
        candidates.append((order[order.index(j) + 1], f"carry{path}", said))
    for path, per_layer in params.items():
        if (last := _first(per_layer, back)) is not None:
            said = "gave its parameter {} a non-finite gradient"
            candidates.append((last[0], f"layer{path}", said))
    if not candidates:
        return None
    i, leaf, said = max(candidates, key=lambda c: order.index(c[0]))
    message = (
        f"The backward pass went non-finite at {at(i)}: it {said.format(leaf)} "
        "(the forward pass and the cotangents reaching it are finite)."
    )
    return "backward", i, leaf, message
