"""`find_nonfinite`: the layer (or time step), carry leaf and pass that first
produced a NaN or inf, from one run of the scanned training step.

One compiled program runs `eqx.filter_value_and_grad` of the loss with carry
taps and a gradient probe of `nonfinite_count` (`eqxscan/_scan/taps.py`), and counts
the non-finite entries of each layer's parameter gradients; the report is read
from those counts on the host.
"""

import dataclasses
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
from .._containers.stacked import Stacked
from .._scan.tap_stats import nonfinite_count
from .._scan.taps import Probe, tap


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """What [`eqxscan.find_nonfinite`][] found.

    - `found`: whether anything was non-finite (the loss, a carry, a
      cotangent or a gradient).
    - `where`: `"forward"` (a layer's output), `"backward"` (a layer's
      backward pass: the cotangent it passed down, or its own parameters'
      gradient), `"loss"` (the loss after the container, forward or
      backward), or `None`.
    - `index`: the layer (or time step) that first produced one: in the
      forward pass the lowest index with a non-finite output, in the backward
      pass the first one the backward pass reached (the highest), or `None`
      (also for a `Recurrent` cell's parameter gradient, summed over steps).
    - `leaf`: the carry leaf (or, for a parameter gradient, the parameter)
      that held it, as a path such as `"carry[0]"` or `"layer.weight"`.
    - `message`: one line saying all this.
    - `forward`, `backward`: the counts behind the report: non-finite entries
      per layer of each carry leaf, and of each leaf of the cotangent reaching
      each layer's output (`[L]` arrays, the carry's structure).
    - `loss`: the loss value.
    """

    found: bool
    where: Literal["forward", "backward", "loss"] | None
    index: int | None
    leaf: str | None
    message: str
    forward: PyTree
    backward: PyTree
    loss: float

    def __str__(self) -> str:
        return self.message


def _containers(tree: PyTree) -> list[Stacked | Chain]:
    """The outermost `Stacked`s and `Chain`s in `tree`."""
    found = jtu.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Stacked | Chain))
    return [c for c in found if isinstance(c, Stacked | Chain)]


def _stack_counts(stack: Stacked, start: int, total: int, out: dict) -> None:
    # A stacked gradient leaf `[L, ...]`: its non-finite entries per layer,
    # placed at layers `start ..` of a container of `total` layers.
    n = stack.num_layers
    for path, leaf in jtu.tree_leaves_with_path(stack.layers):
        if eqx.is_inexact_array(leaf) and leaf.ndim >= 1 and leaf.shape[0] == n:
            bad = ~jnp.isfinite(leaf.reshape(n, -1))
            counts = jnp.sum(bad, axis=1).astype(jnp.float32)
            row = out.setdefault(jtu.keystr(path), jnp.zeros(total, jnp.float32))
            out[jtu.keystr(path)] = row.at[start : start + n].add(counts)


def _param_counts(grads: PyTree) -> list[dict[str, Float[Array, " L"]]]:
    """Per container in `grads`, per parameter path: the non-finite entries of
    each layer's gradient (a `Chain`'s repeated patterns are not split)."""
    out = []
    for container in _containers(grads):
        counts: dict[str, Array] = {}
        if isinstance(container, Stacked):
            _stack_counts(container, 0, container.num_layers, counts)
        else:
            total = len(container)
            for group, span in zip(container.groups, container.layout):
                if span.per_step == 1:
                    _stack_counts(group, span.start, total, counts)
                elif span.per_step == 0:
                    for path, leaf in jtu.tree_leaves_with_path(group):
                        if eqx.is_inexact_array(leaf):
                            bad = jnp.sum(~jnp.isfinite(leaf)).astype(jnp.float32)
                            key = jtu.keystr(path)
                            row = counts.setdefault(key, jnp.zeros(total, jnp.float32))
                            counts[key] = row.at[span.start].add(bad)
        out.append(counts)
    return out


def _shared_counts(grads: PyTree) -> dict[str, Array]:
    """Per parameter of each `Recurrent`'s cell in `grads`: its non-finite
    entries. The cell's weights are shared by every time step, so their
    gradient (summed over the steps) names no step."""
    out: dict[str, Array] = {}
    found = jtu.tree_leaves(grads, is_leaf=lambda x: isinstance(x, Recurrent))
    for rnn in (r for r in found if isinstance(r, Recurrent)):
        for path, leaf in jtu.tree_leaves_with_path(rnn):
            if eqx.is_inexact_array(leaf):
                out[jtu.keystr(path)] = jnp.sum(~jnp.isfinite(leaf))
    return out


@eqx.filter_jit
def _program(
    model: PyTree, loss_fn: Callable[..., Array], inputs: tuple
) -> tuple[Array, PyTree, PyTree, tuple[list, dict[str, Array]]]:
    def loss(model_and_probe: tuple[PyTree, Probe | None]) -> tuple[Array, PyTree]:
        m, pr = model_and_probe
        return tap(lambda *a: loss_fn(m, *a), nonfinite_count, probe=pr)(*inputs)

    # The probe has one entry per layer and carry leaf, like the forward counts.
    counted = jax.eval_shape(lambda: loss((model, None))[1])
    zeros = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), counted)
    (value, forward), (g_model, g_probe) = eqx.filter_value_and_grad(
        loss, has_aux=True
    )((model, Probe(zeros, nonfinite_count)))
    params = _param_counts(g_model)
    return value, forward, g_probe.values, (params, _shared_counts(g_model))


def _first(tree: PyTree, last: bool) -> tuple[int, str] | None:
    """The lowest (or, `last`, the highest) index with a count above zero over
    every leaf of `tree` (`[L]` counts), and that leaf's path."""
    best = None
    for path, counts in jtu.tree_leaves_with_path(tree):
        i = _pick(counts, last)
        if i is not None and (best is None or (i > best[0] if last else i < best[0])):
            best = (i, jtu.keystr(path))
    return best


def _pick(counts: object, last: bool) -> int | None:
    hits = np.flatnonzero(np.asarray(counts) > 0)
    if not hits.size:
        return None
    return int(hits[-1] if last else hits[0])


def find_nonfinite(
    model: PyTree, loss_fn: Callable[..., Array], *inputs: PyTree
) -> NonFinite:
    """Find the layer (or time step) that first produced a NaN or inf in one
    training step, the carry leaf that held it, and whether the forward or the
    backward pass did: one run of the scanned program (nothing unrolled),
    compiled once per structure of `model` and `inputs`.

    It runs `eqx.filter_value_and_grad(loss_fn)(model, *inputs)` with
    [`eqxscan.tap`][] and an [`eqxscan.Probe`][] of
    [`eqxscan.stats.nonfinite_count`][] on the container that `loss_fn` calls,
    and counts the non-finite entries of each layer's parameter gradients.

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
    - `loss_fn`: `loss_fn(model, *inputs) -> scalar`. It must call exactly one
      container (directly, not inside its own `vmap`, `remat` or `jit`):
      that container's layers are the ones reported.
    - `*inputs`: the rest of `loss_fn`'s arguments (a batch).

    **Returns:**

    A [`eqxscan.NonFinite`][] report; `str(report)` is one line.
    """
    value, forward, backward, (params, shared) = jax.device_get(
        _program(model, loss_fn, inputs)
    )
    leaves = jtu.tree_leaves(forward)
    if not leaves:
        raise TypeError(
            "eqxscan.find_nonfinite: the tapped container's carry has no "
            "floating-point leaves to check.\nCheck that loss_fn calls a Stacked, "
            "Chain or Recurrent whose carry holds floats."
        )
    length = leaves[0].shape[0]
    what = "time step" if isinstance(model, Recurrent) else "layer"
    report = _report(float(value), forward, backward, params, length, what)
    bad = [path for path, count in shared.items() if count > 0]
    if report.where is None and bad:
        # Every step's cotangent is finite, yet the cell's own gradient is not.
        leaf = bad[0].lstrip(".")
        message = (
            f"The backward pass went non-finite in the cell's parameter {leaf}: "
            "its gradient, summed over the time steps, holds NaN or inf while "
            "every carry and cotangent is finite (no one time step is named)."
        )
        return dataclasses.replace(
            report, found=True, where="backward", leaf=leaf, message=message
        )
    return report


def _report(
    value: float,
    forward: PyTree,
    backward: PyTree,
    params: list,
    length: int,
    what: str,
) -> NonFinite:
    def done(
        where: Literal["forward", "backward", "loss"] | None,
        index: int | None,
        leaf: str | None,
        message: str,
    ) -> NonFinite:
        found = where is not None or not np.isfinite(value)
        return NonFinite(found, where, index, leaf, message, forward, backward, value)

    fwd = _first(forward, last=False)
    if fwd is not None:
        i, path = fwd
        return done(
            "forward",
            i,
            f"carry{path}",
            f"The forward pass went non-finite at {what} {i}: its output carry{path} "
            f"holds NaN or inf (every earlier {what}'s output is finite).",
        )
    if not np.isfinite(value):
        return done(
            "loss",
            None,
            None,
            f"Every {what}'s output is finite, but the loss is {value}: the part "
            "of loss_fn after the container made it.",
        )
    # The backward pass reaches the highest index first: layer j + 1 passed a
    # non-finite cotangent to layer j's output, or made non-finite gradients
    # of its own parameters.
    bwd = _first(backward, last=True)
    candidates = []
    if bwd is not None:
        j, path = bwd
        if j == length - 1:
            return done(
                "loss",
                None,
                f"carry{path}",
                f"The cotangent of the last {what}'s output carry{path} is already "
                "non-finite: the backward pass of loss_fn after the container made it.",
            )
        candidates.append((j + 1, f"carry{path}", "input"))
    for counts in params:
        for path, per_layer in counts.items():
            i = _pick(per_layer, last=True)
            if i is not None:
                candidates.append((i, f"layer{path}", "param"))
    if not candidates:
        return done(
            None, None, None, "No NaN or inf: loss, carries and gradients are finite."
        )
    i, leaf, kind = max(candidates, key=lambda c: c[0])
    said = (
        f"passed a non-finite cotangent to its input {leaf}"
        if kind == "input"
        else f"gave its parameter {leaf} a non-finite gradient"
    )
    return done(
        "backward",
        i,
        leaf,
        f"The backward pass went non-finite at {what} {i}: it {said} (the forward "
        "pass and the cotangents reaching it are finite).",
    )
