"""`StackedMLP`: a residual MLP stack with shape-checked stacked weights."""

from collections.abc import Sequence
from typing import SupportsIndex, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from beartype import beartype
from jax.typing import DTypeLike
from jaxtyping import Array, Float, jaxtyped, PRNGKeyArray, TypeCheckError

from .._containers.stacked import Stacked
from .._containers.weight_targets import StandsForWeight
from .._helpers.checks import check_size, Checked, describe
from .._scan.drop_rates import check_droppable, check_rate, Rates
from .._scan.eager_compile import compiled_when_eager
from .._scan.options import OwnOptions, ScanArgs, Scanning, ScanOptions


def rms_norm(scale: Array, x: Array, eps: float = 1e-6) -> Array:
    """`x / rms(x) * scale` over the last axis of `x`, reduced in float32 and
    returned in `x.dtype`."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # Explicit broadcast: works under `jax_numpy_rank_promotion="raise"` too;
    # the scale cast, so that a float32 scale keeps a bfloat16 `x` bfloat16.
    scale = jnp.expand_dims(scale, tuple(range(x.ndim - scale.ndim)))
    return (x32 * inv).astype(x.dtype) * scale.astype(x.dtype)


def check_float_dtype(dtype: DTypeLike | None) -> np.dtype:
    """`dtype`, a floating one; `None`: float32 (float64 in JAX's 64-bit mode),
    as for `eqx.nn` layers."""
    if dtype is None:
        return jax.dtypes.canonicalize_dtype(jnp.float64)
    try:
        if jnp.issubdtype(found := jnp.dtype(dtype), jnp.floating):
            return found
    except TypeError:
        pass
    raise TypeError(
        f"dtype must be a floating dtype such as jnp.float32 or jnp.bfloat16, "
        f"got {dtype!r}."
    )


class MLPBlock(eqx.Module):
    """One residual block: `x + gelu(rms_norm(x) @ w1) @ w2`, with dropout after the
    activation. `StackedMLP` stacks `L` of them."""

    w1: Float[Array, "D H"]
    w2: Float[Array, "H D"]
    scale: Float[Array, " D"]
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        dim: SupportsIndex,
        *,
        key: PRNGKeyArray,
        dtype: DTypeLike = jnp.float32,
        dropout: float = 0.0,
    ):
        """**Arguments:**

        - `dim`: the model width `D`; the hidden width is `H = 4 * D`.
        - `key`: a JAX PRNG key for the weights (normal, scaled by fan-in).
        - `dtype`: the parameter dtype.
        - `dropout`: dropout rate after the activation.
        """
        dim = check_size("dim", dim)
        dtype = check_float_dtype(dtype)
        dropout = check_rate(dropout, "dropout")
        hidden = 4 * dim
        k1, k2 = jr.split(key)
        self.w1 = (jr.normal(k1, (dim, hidden)) * dim**-0.5).astype(dtype)
        self.w2 = (jr.normal(k2, (hidden, dim)) * hidden**-0.5).astype(dtype)
        self.scale = jnp.ones(dim, dtype)
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(
        self, x: Float[Array, "*batch D"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch D"]:
        """**Arguments:**

        - `x`: `[..., D]`, the residual stream.
        - `key`: the dropout key (needed only when dropout is active).

        **Returns:**

        `x` plus the block's output, same shape and dtype.
        """
        h = jax.nn.gelu(rms_norm(self.scale, x) @ self.w1)
        return x + self.dropout(h, key=key) @ self.w2


@jaxtyped(typechecker=beartype)
def _stacked_shapes(
    w1: Float[Array, "L D 4*D"],
    w2: Float[Array, "L 4*D D"],
    scale: Float[Array, "L D"],
) -> None:
    """The layer-axis layout of a StackedMLP, checked by jaxtyping + beartype."""


class StackedMLP(Scanning):
    """The residual MLP stack (pre-norm, GELU, optional dropout), scanned over depth.

    Per layer: `h = rms_norm(scale, x); h = gelu(h @ w1); h = dropout(h);
    x = x + h @ w2`. The arrays of `model.blocks` (a [`eqxscan.Stacked`][]) are
    `w1: [L, D, 4*D]`, `w2: [L, 4*D, D]` and `scale: [L, D]`, checked with
    jaxtyping + beartype whenever a model is built or loaded.

    The carry keeps the model's dtype: a bfloat16 model runs end to end in
    bfloat16, with the RMS reduction in float32.
    """

    blocks: Stacked[MLPBlock]

    def __init__(
        self,
        dim: SupportsIndex | None = None,
        num_layers: SupportsIndex | None = None,
        *,
        key: PRNGKeyArray | None = None,
        dtype: DTypeLike | None = None,
        dropout: float = 0.0,
        drop_path: Checked[Rates] = 0.0,
        layer_drop: Checked[Rates] = 0.0,
        blocks: Stacked[MLPBlock] | None = None,
        **options: Unpack[ScanArgs],
    ):
        """**Arguments:**

        - `dim`: the model width `D`; the hidden width is `4 * D`.
        - `num_layers`: `L`.
        - `key`: a JAX PRNG key; layer `i` is built from `split(key, L)[i]`.
        - `dtype`: parameter and activation dtype (e.g. `jnp.bfloat16`;
          default float32).
        - `dropout`: dropout rate after the activation.
        - `drop_path`, `layer_drop`: stochastic depth (per example, a block's
          residual branch dropped or scaled by `1 / (1 - p)`) and LayerDrop
          (per call, whole blocks skipped), as for [`eqxscan.Stacked`][]; both
          need a `key` while training. Change them later with
          `model.with_options(drop_path=...)`.
        - `mode`, `remat`, `unroll`: as for [`eqxscan.Stacked`][].
        - `blocks`: instead of the arguments above, a `Stacked` of
          [`eqxscan.MLPBlock`][]s to hold, dtype, options and drop rates kept
          ([`eqxscan.StackedMLP.from_layers`][] stacks a list).
        """
        if blocks is not None:
            if not (
                isinstance(blocks, Stacked) and isinstance(blocks.layers, MLPBlock)
            ):
                raise TypeError(
                    "StackedMLP(blocks=...) takes a Stacked of eqxscan.MLPBlock, got "
                    f"{describe(blocks)}.\nHint: StackedMLP.from_layers stacks a "
                    "list of MLPBlocks."
                )
            # Each would be ignored: the blocks keep their own.
            given = dict(dim=dim, num_layers=num_layers, key=key, dtype=dtype)
            rates = dict(dropout=dropout, drop_path=drop_path, layer_drop=layer_drop)
            both = [n for n, v in given.items() if v is not None] + list(options)
            both += [n for n, v in rates.items() if not isinstance(v, float | int) or v]
            if both:
                raise TypeError(
                    f"StackedMLP takes `blocks` as they are, but also got "
                    f"{', '.join(both)}, which would be ignored.\nHint: build the "
                    "blocks with them, or change options and drop rates with "
                    "model.with_options(...)."
                )
            self.blocks = blocks
            return
        dim = check_size("dim", dim)
        dtype = check_float_dtype(jnp.float32 if dtype is None else dtype)
        dropout = check_rate(dropout, "dropout")
        self.blocks = Stacked(
            lambda k: MLPBlock(dim, key=k, dtype=dtype, dropout=dropout),
            num_layers,
            key=key,
            drop_path=drop_path,
            layer_drop=layer_drop,
            **options,
        )

    def __check_init__(self) -> None:
        self._check_shapes()

    def _check_shapes(self) -> None:
        # At construction and at each call (an `eqx.tree_at` edit skips the first).
        layers = self.blocks.layers
        arrays = (layers.w1, layers.w2, layers.scale)
        # Shapes, not arrays: a weight may be a module standing for one (a LoRA).
        # A filtered model (`eqx.filter`, e.g. a LoRA's adapters alone) holds
        # None, or a LoRA without its base: nothing to check.
        found = [(getattr(a, "shape", None), getattr(a, "dtype", None)) for a in arrays]
        if any(shape is None or dtype is None for shape, dtype in found):
            return
        try:
            jax.eval_shape(_stacked_shapes, *[jax.ShapeDtypeStruct(*f) for f in found])
        except TypeCheckError as e:
            w1, w2, scale = map(describe, arrays)
            raise TypeCheckError(
                "StackedMLP.blocks has arrays of the wrong shapes: expected w1 [L, "
                f"D, 4*D], w2 [L, 4*D, D], scale [L, D]; got w1 {w1}, w2 {w2}, "
                f"scale {scale}."
            ) from e

    @classmethod
    def from_layers(
        cls,
        blocks: Sequence[MLPBlock],
        **options: Unpack[ScanArgs],
    ) -> "StackedMLP":
        """Build from already-made [`eqxscan.MLPBlock`][]s (shape-checked).

        **Arguments:**

        - `blocks`: a non-empty sequence of `MLPBlock`s of one width and dtype.
        - `mode`, `remat`, `unroll`: as for [`eqxscan.Stacked`][].

        **Returns:**

        A `StackedMLP` whose `blocks.unstack()` gives `blocks` back.
        """
        return cls(blocks=Stacked.from_layers(blocks, **options))

    @property
    def options(self) -> ScanOptions:  # pyright: ignore[reportIncompatibleVariableOverride]  # an eqx.AbstractVar may be met by a property
        return self.blocks.options

    def own_options(self) -> tuple[str, ...]:
        return ("drop_path", "layer_drop")

    def replace_options(
        self, options: ScanOptions, **own: Unpack[OwnOptions]
    ) -> "StackedMLP":
        return StackedMLP(blocks=self.blocks.replace_options(options, **own))

    @property
    def dim(self) -> int:
        return self.blocks.layers.w1.shape[-2]

    @property
    def num_layers(self) -> int:
        return self.blocks.num_layers

    @property
    def dtype(self) -> np.dtype:
        return self.blocks.layers.w1.dtype

    @compiled_when_eager
    def __call__(
        self,
        x: Float[Array | np.ndarray, "*batch D"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*batch D"]:
        """**Arguments:**

        - `x`: `[..., D]` in the model's dtype (a JAX or NumPy array).
        - `key`: required when `dropout`, `drop_path` or `layer_drop` is above 0
          outside inference mode; each layer gets its own dropout key (and its
          own drop keys, made as [`eqxscan.DropRates`][] documents).

        **Returns:**

        `[..., D]`, same dtype.
        """
        x = jnp.asarray(x)
        self._check_shapes()
        if isinstance(w1 := self.blocks.layers.w1, StandsForWeight):
            w1.stored_arrays()  # checks them: a cast model's dtype is not x's to fix
        if x.shape[-1:] != (self.dim,) or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeCheckError(
                f"StackedMLP input x is {describe(x)}, but the model takes a "
                f"floating array [..., D] with D={self.dim}, in {self.dtype}.\nHint: "
                "the last axis is the width; any axes before it are batch axes."
            )
        if x.dtype != self.dtype:
            raise TypeError(
                f"StackedMLP input has dtype {x.dtype}, but the model's parameters "
                f"and carry are {self.dtype}; cast the input with "
                f"`x.astype({self.dtype})`."
            )
        dropout = self.blocks.layers.dropout
        if key is None and not dropout.inference and dropout.p != 0:
            raise ValueError(
                f"StackedMLP has dropout={dropout.p} and is not in inference mode, "
                "so it needs a `key`; pass `key=...` or use "
                "`eqx.nn.inference_mode(model)`."
            )
        check_droppable(self.blocks.drop_rates, key, False, "StackedMLP")
        return self.blocks(x, key=key)
