"""Depth that varies while training: stochastic depth (drop-path) and LayerDrop.

A dropping call gives its layers their drops (`DropInputs`, one entry per
layer), which the layer-call seam slices like any per-layer value and applies
after the layer (`drop_path`); LayerDrop's run bits go to the scan, or to
`layer_drop` for a layer no scan skips. Scan and loop make the same draws.
"""

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import TypeAlias

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, Float, Key, PRNGKeyArray, PyTree, UInt32

from .._helpers.checks import Checked, describe, docs
from .call_state import call_state
from .skip import same_types, skip_layer


#: Folded into a call's key to make the drop keys, apart from the layers' keys.
DROP_STREAM = 0x5D0


class LinearRates(eqx.Module):
    """A rate rising linearly with depth, from `0` at the first layer to
    `max_rate` at the last (timm's `torch.linspace(0, drop_path_rate, depth)`).
    Build it with [`eqxscan.linear_rates`][]."""

    max_rate: float = eqx.field(static=True)


Rates: TypeAlias = float | Sequence[float] | Array | np.ndarray | LinearRates
"""A per-layer drop rate: one number for every layer, one number per layer
(a sequence or a concrete array of length `L`), or [`eqxscan.linear_rates`][]."""


def linear_rates(max_rate: float) -> LinearRates:
    """Drop rates rising linearly with depth, as vision transformers use for
    stochastic depth: layer `i` of `L` gets `max_rate * i / (L - 1)`.

    **Arguments:**

    - `max_rate`: the last layer's rate, in `[0, 1)`.

    **Returns:**

    A frozen [`eqxscan.LinearRates`][] to pass as `drop_path=` or `layer_drop=`;
    the module it is given to fills in `L` (a `Chain` its total depth).
    """
    return LinearRates(check_rate(max_rate, "linear_rates(max_rate)"))


def check_rate(value: object, name: str) -> float:
    """`value` as a float in `[0, 1)`, or an error naming `name` (e.g.
    `"drop_path[3]"`) with a hint."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced value ({describe(value)}), but drop rates are "
            "static: they choose the program.\nHint: pass Python floats (or a "
            "concrete array) when building the module, outside `jit`."
        )
    if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number in [0, 1), got {describe(value)}.\n"
            "Hint: a rate is the probability of dropping, e.g. 0.1."
        )
    rate = float(value)
    # Applied in float32, where a rate just below 1 rounds to 1: 1 / (1 - p) is
    # then inf, and the gradients NaN.
    if not 0.0 <= np.float32(rate) < 1.0 or rate < 0:  # nan included
        rounded = " (1.0 in float32, as it is applied)" if 0 <= rate < 1 else ""
        raise ValueError(
            f"{name} must be in [0, 1), got {rate!r}{rounded}.\nHint: a rate is "
            "the probability of dropping; 1 would drop every time (and drop-path "
            "rescales by 1 / (1 - p))."
        )
    return rate


def resolve_rates(rates: object, num_layers: int, name: str) -> tuple[float, ...]:
    """`rates` (a [`eqxscan.Rates`][] value) as one checked float per layer."""
    if isinstance(rates, LinearRates):  # `max_rate * i / (L - 1)`, 0.0 for L = 1
        return tuple(np.linspace(0.0, rates.max_rate, num_layers).tolist())
    array = isinstance(rates, (jax.Array, np.ndarray))
    # One rate (`check_rate` refuses a traced one: rates are static).
    if isinstance(rates, (numbers.Real, np.bool_, jax.core.Tracer)) or (
        array and rates.ndim == 0
    ):
        return (check_rate(rates, name),) * num_layers
    if array:
        if rates.ndim != 1:
            raise ValueError(
                f"{name} must be one rate or one per layer, got an array of shape "
                f"{tuple(rates.shape)}.\nHint: pass {num_layers} rates, e.g. "
                "eqxscan.linear_rates(0.1)."
            )
        rates = list(rates)
    if not isinstance(rates, Sequence) or isinstance(rates, str):
        raise TypeError(
            f"{name} must be a number, a sequence of {num_layers} numbers or "
            f"eqxscan.linear_rates(max_rate), got {describe(rates)}.\n"
            "Hint: e.g. drop_path=0.1 or drop_path=eqxscan.linear_rates(0.1)."
        )
    if len(rates) != num_layers:
        raise ValueError(
            f"{name} has {len(rates)} rates, but the module has {num_layers} "
            f"layers.\nHint: pass one rate per layer (layer i gets {name}[i]), one "
            "number for all, or eqxscan.linear_rates(max_rate)."
        )
    return tuple(check_rate(r, f"{name}[{i}]") for i, r in enumerate(rates))


class DropInputs(eqx.Module):
    """A dropping call's drops, one entry per layer (leading axis `L`): LayerDrop's
    run bits and rates (`None` where no layer drops, or where the scan skips the
    layers itself), drop-path's rates (`None` where none) and the drop keys, or
    drop-path's mask drawn by the caller (a pipeline's rows of the batch's)."""

    runs: Bool[Array, "*layers"] | None
    layer_rate: Float[Array, "*layers"] | None
    path_rate: Float[Array, "*layers"] | None
    key: Key[Array, "*layers"] | UInt32[Array, "*layers 2"] | None
    path_mask: Bool[Array, "*layers_rows"] | None = None
    # The rates by global layer index, for checks while tracing.
    static_rates: tuple[tuple[float, ...], tuple[float, ...]] = eqx.field(
        static=True, default=((), ())
    )

    def skipped_by_scan(self) -> "DropInputs":
        """These inputs, for layers whose scan runs only the ones that run."""
        return dataclasses.replace(self, runs=None, layer_rate=None)


class DropRates(eqx.Module):
    """How a scanning module varies its depth while training: one drop-path
    rate and one LayerDrop rate per layer. A `Stacked`, `Chain` or `StackedMLP`
    built with `drop_path=` or `layer_drop=` above zero holds one as
    `.drop_rates` (`None` otherwise).

    Dropping happens only in training: `inference` is set by
    `eqx.nn.inference_mode`, as for `eqx.nn.Dropout`. Like `eqx.nn.Dropout`,
    it is a Python bool in the module's pytree: transform such a module with
    `eqx.filter_grad` / `eqx.filter_jit` (or partition it) rather than
    `jax.grad` / `jax.jit`.

    The drops of a call with `key`: `drop_keys = jax.random.split(
    jax.random.fold_in(key, 0x5D0), L)`, and layer `i` uses `k_layer, k_path =
    jax.random.split(drop_keys[i])` (LayerDrop's draw, then drop-path's). The
    layers' own keys (`jax.random.split(key, L)[i]`) are unchanged by dropping.
    """

    drop_path: tuple[float, ...] = eqx.field(static=True)
    layer_drop: tuple[float, ...] = eqx.field(static=True)
    inference: bool

    def __init__(
        self,
        num_layers: int,
        drop_path: Checked[Rates] = 0.0,
        layer_drop: Checked[Rates] = 0.0,
        inference: bool = False,
    ):
        """**Arguments:**

        - `num_layers`: `L`, the module's depth.
        - `drop_path`: the stochastic-depth rate of each layer (a
          [`eqxscan.Rates`][] value): per example, layer `i`'s residual branch
          `layer(x) - x` is dropped with probability `p_i`, else scaled by
          `1 / (1 - p_i)`.
        - `layer_drop`: the LayerDrop rate of each layer: per call, layer `i` is
          skipped for the whole batch (its compute not done) with probability
          `q_i`; a layer that runs is not rescaled.
        - `inference`: no dropping at all (set by `eqx.nn.inference_mode`).

        **Raises:**

        `TypeError` or `ValueError` naming the rate (and layer) that is not a
        number in `[0, 1)`, or a length that is not `L`. (Checked here, not by
        the annotations, so the message is the same with or without a runtime
        type checker.)
        """
        self.drop_path = resolve_rates(drop_path, num_layers, "drop_path")
        self.layer_drop = resolve_rates(layer_drop, num_layers, "layer_drop")
        self.inference = inference

    @property
    def num_layers(self) -> int:
        return len(self.drop_path)

    @property
    def active(self) -> bool:
        """Whether a call drops anything: training, and some rate above zero."""
        if isinstance(self.inference, jax.core.Tracer):
            # `jax.jit` traced the bool leaf, as it does an `eqx.nn.Dropout`'s.
            raise TypeError(
                "The drop rates' `inference` flag (layer_drop/drop_path) is "
                "traced: jax.jit traces every leaf of a model it is given.\nHint: "
                "use eqx.filter_jit (or close over the model), which keeps "
                f"non-array leaves static; see {docs('depth.md')}."
            )
        return not self.inference and any(self.drop_path + self.layer_drop)

    def sliced(self, index: slice) -> "DropRates":
        """The rates of the layers `range(L)[index]` (for `stack[i:j]`), in this
        mode (`None` in a gradient or update tree, as `eqx.filter_grad` gives)."""
        length = len(range(self.num_layers)[index])
        new = DropRates(length, self.drop_path[index], self.layer_drop[index])
        return eqx.tree_at(lambda d: d.inference, new, self.inference)

    def per_layer_inputs(self, key: PRNGKeyArray) -> DropInputs:
        """The drops of a call with `key`, each with leading axis `L`: what each
        layer gets as its `drop`, a part no layer uses `None`."""
        keys = jax.random.split(jax.random.fold_in(key, DROP_STREAM), self.num_layers)
        rates = lambda r: jnp.asarray(r, jnp.float32) if any(r) else None  # noqa: E731
        path_rate, layer_rate = rates(self.drop_path), rates(self.layer_drop)
        runs = None
        if layer_rate is not None:
            runs = jax.vmap(lambda k, q: keep_bits(k, q, 0, None))(keys, layer_rate)
        static = (self.drop_path, self.layer_drop)
        return DropInputs(runs, layer_rate, path_rate, keys, static_rates=static)


def new_drop_rates(
    num_layers: int, drop_path: Checked[Rates], layer_drop: Checked[Rates]
) -> DropRates | None:
    """The `.drop_rates` of a module of `num_layers` layers: `None` when no rate
    is above zero, so that a module that never drops holds no `inference` flag
    (a Python bool leaf, which `jax.grad` would refuse) and runs as before."""
    drop = DropRates(num_layers, drop_path, layer_drop)
    return drop if any(drop.drop_path + drop.layer_drop) else None


def rates_of(drop: DropRates | None) -> tuple[Rates, Rates]:
    """`(drop_path, layer_drop)` of a module's `.drop_rates`, to rebuild it."""
    return (0.0, 0.0) if drop is None else (drop.drop_path, drop.layer_drop)


def with_mode_of(new: DropRates | None, old: DropRates | None) -> DropRates | None:
    """`new` in `old`'s inference mode (as `eqx.nn.inference_mode` set it): how
    slicing and changing a module's rates keep its mode."""
    if new is None or old is None:
        return new
    return eqx.tree_at(lambda d: d.inference, new, old.inference)


def check_droppable(
    drop: DropRates | None, key: object, has_state: bool, who: str
) -> bool:
    """Whether this call drops; raise when it would but cannot (no key, or
    stateful layers, whose skipped state has no meaning)."""
    if drop is None or not drop.active:
        return False
    if key is None:
        raise ValueError(
            f"{who} drops layers while training (drop_path or layer_drop above "
            "0), so it needs a `key`.\nHint: pass `key=...`, or call "
            "`eqx.nn.inference_mode(model)` to run every layer."
        )
    if has_state:
        raise TypeError(
            f"{who} drops layers while training, but its layers are stateful "
            "(called with an eqx.nn.State).\nHint: drop_path and layer_drop need "
            "layers that return only the carry; use eqx.nn.inference_mode(model)."
        )
    return True


def carry_examples(carry_dyn: PyTree) -> int | None:
    """How many examples the carry holds: the shared leading axis when every
    array leaf has one and at least two axes, `None` (one example per call)
    when every leaf has at most one axis."""
    leaves = jtu.tree_leaves(carry_dyn)
    if all(a.ndim <= 1 for a in leaves):
        return None
    sizes = {a.shape[0] for a in leaves if a.ndim >= 2}
    if len(sizes) == 1 and all(a.ndim >= 2 for a in leaves):
        return sizes.pop()
    shapes = ", ".join(describe(a) for a in leaves)
    raise ValueError(
        "drop_path drops per example, along the leading axis of the carry's "
        "leaves, so every array leaf needs at least two axes and the same "
        f"leading one ([B, ...]), but the carry's arrays are {shapes}.\nHint: "
        "give a per-example value a trailing axis ([B, 1]), or eqx.filter_vmap "
        f"over the batch with one key per example; see {docs('depth.md')}."
    )


def keep_bits(
    key: PRNGKeyArray, rate: Float[Array, ""], half: int, examples: int | None
) -> Bool[Array, "*examples"]:
    """One layer's keep bits, one per example (a scalar for `None`), from `half`
    of its drop key: `0` LayerDrop's, `1` drop-path's."""
    shape = () if examples is None else (examples,)
    return jax.random.bernoulli(jax.random.split(key)[half], 1.0 - rate, shape)


def _same_shapes(old: PyTree, new: PyTree) -> bool:
    old, new = eqx.filter(old, eqx.is_array), eqx.filter(new, eqx.is_array)
    return jtu.tree_structure(old) == jtu.tree_structure(new) and all(
        a.shape == b.shape for a, b in zip(jtu.tree_leaves(old), jtu.tree_leaves(new))
    )


def _undroppable(new: PyTree, drop: DropInputs, name: str, why: str) -> PyTree:
    """`new`, from a layer that changed the carry, which cannot be dropped: an
    error if its rate is above 0, raised now for a lone layer, else at run time
    (a stack's engine reports its broken carry contract first, while tracing)."""
    state = call_state()
    index = state.layer
    layer = f"layer {index}" if isinstance(index, int) else "a layer"
    message = (
        f"{name} is above 0 for {layer}, which changes the carry (e.g. a "
        f"Chain's input projection), so it {why}.\nHint: give that layer rate "
        f"0, e.g. `{name}=[0.0] + [0.1] * (L - 1)` for the first; see "
        f"{docs('depth.md')}."
    )
    rates = drop.static_rates[name == "layer_drop"]
    if state.step is None and isinstance(index, int) and index < len(rates):
        if rates[index] > 0:
            raise ValueError(message)
        return new
    rate = drop.layer_rate if name == "layer_drop" else drop.path_rate
    dyn, static = eqx.partition(new, eqx.is_array)
    return eqx.combine(eqx.error_if(dyn, rate > 0, message), static)  # pyright: ignore[reportOptionalOperand]  # set with its drop


def drop_path(old: PyTree, new: PyTree, drop: DropInputs) -> PyTree:
    """`new`, a layer's carry from `old`, with its branch dropped per example:
    `old + mask * (new - old) / (1 - rate)` leaf by leaf (`new` itself where
    the rate is 0), the mask `drop.path_mask` or drawn from the drop key."""
    rate = drop.path_rate
    if rate is None:
        return new
    if not _same_shapes(old, new):  # a `Chain`'s lone layer may change the carry
        why = "has no residual branch `layer(x) - x` to drop"
        return _undroppable(new, drop, "drop_path", why)
    old_dyn = eqx.filter(old, eqx.is_array)
    mask = drop.path_mask
    if mask is None:
        assert drop.key is not None
        mask = keep_bits(drop.key, rate, 1, carry_examples(old_dyn))
    scale = 1.0 / (1.0 - rate)

    def one(path: jtu.KeyPath, a: Array, b: Array) -> Array:
        if not jnp.issubdtype(b.dtype, jnp.inexact):
            raise TypeError(
                "drop_path rescales each layer's residual branch by 1 / (1 - p) "
                f"in every carry leaf, but carry leaf `carry{jtu.keystr(path)}` is "
                f"{describe(b)}, which cannot be rescaled.\nHint: keep such values "
                "out of the carry of a model with drop_path (layer_drop does not "
                "rescale)."
            )
        k = mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim))
        dropped = jnp.where(k, a + (b - a) * scale.astype(b.dtype), a)
        return jnp.where(rate == 0, b, dropped.astype(b.dtype))

    new_dyn, new_static = eqx.partition(new, eqx.is_array)
    return eqx.combine(jtu.tree_map_with_path(one, old_dyn, new_dyn), new_static)


def layer_drop(
    fn: Callable[[PyTree], tuple[PyTree, PyTree]], drop: DropInputs, c: PyTree
) -> tuple[PyTree, PyTree]:
    """`fn(c) -> (carry, y)`, one layer that no scan skips, run where `drop.runs`."""
    assert drop.runs is not None
    new, y = skip_layer(fn, c, drop.runs)
    if same_types(eqx.filter(c, eqx.is_array), eqx.filter(new, eqx.is_array)):
        return new, y
    why = "cannot be skipped (its input is no carry to pass on)"
    return _undroppable(new, drop, "layer_drop", why), y
