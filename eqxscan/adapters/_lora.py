"""`LoRA`: a frozen weight and `K` low-rank adapters, used where the weight was:
the layer's own `x @ self.w` computes `x @ base + (alpha / r) * (x @ a[k]) @ b[k]`
without forming `base + delta`, and a scan hands each layer its slices."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .. import Orientation
from .._internal import for_each, MatmulOnly, Site
from ..quant import Quantized


class LoRA(MatmulOnly, eqx.Module):
    """A frozen weight with `K` low-rank adapters, standing where the weight was.

    `x @ lora` (orientation `"x@W"`) is `x @ base + (alpha / rank) *
    (dropout(x) @ a[k]) @ b[k]`, and `lora @ x` (orientation `"W@x"`) is
    `base @ x + (alpha / rank) * b[k] @ (a[k] @ dropout(x))`, with `k = active`;
    `active == -1` (or any other id outside `[0, K)`, silently:
    [`eqxscan.adapters.select`][]`(..., check=True)` checks a traced one)
    gives the base alone.
    `base + delta` is never formed, and the base is frozen: its gradient is
    zero (`jax.lax.stop_gradient`), also in `eqx.filter_grad(loss)(model)`.

    Shapes, per layer (inside a [`eqxscan.Stacked`][] each array has the layer
    axes in front):

    | orientation | `base` | `a` (PEFT's `lora_A`) | `b` (PEFT's `lora_B`) |
    | --- | --- | --- | --- |
    | `"x@W"` | `[in, out]` | `[K, in, r]` | `[K, r, out]` |
    | `"W@x"` | `[out, in]` | `[K, r, in]` | `[K, out, r]` |

    `active` is the adapter used: an `int`, the same in every layer (not an
    array, so that `eqx.filter(model, eqx.is_array)` and `eqx.filter_grad`
    agree), or an integer array with the layer axes where
    [`eqxscan.adapters.select`][] was given a traced id (under `jax.vmap`).
    The scaling is `alpha / rank`. Besides PEFT's fields: `name`, the weight's
    state-dict name (`"blocks.*.w1"`), for errors; `dropout`, the rate on the
    adapters' input, with `inference` (set by `eqx.nn.inference_mode`) and
    `key` (set by [`eqxscan.adapters.with_dropout_key`][], one key per layer).

    The base may be a [`eqxscan.quant.Quantized`][] (QLoRA), dequantized one
    layer at a time inside the scan.

    `.shape`, `.dtype` and `.ndim` are the base's. Other array operations (`+`,
    indexing, `jnp.asarray`) raise a `TypeError` naming the leaf and pointing
    to [`eqxscan.adapters.merge`][] (`jnp.matmul`, `jnp.einsum` and `jnp.dot`
    raise JAX's own). Build one with [`eqxscan.adapters.add_lora`][].
    """

    base: Float[Array, "*layers p q"] | Quantized
    a: Float[Array, "*layers k _ _"]
    b: Float[Array, "*layers k _ _"]
    active: int | Int[Array, "*layers"]
    alpha: float = eqx.field(static=True)
    rank: int = eqx.field(static=True)
    orientation: Orientation = eqx.field(static=True)
    name: str = eqx.field(static=True, default="")
    dropout: float = eqx.field(static=True, default=0.0)
    inference: bool = False
    key: PRNGKeyArray | None = None

    _label = "LoRA"
    _symbol = "lora"
    _maker = "add_lora"
    _instead = "`eqxscan.adapters.merge(model)` to get plain weights"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def ndim(self) -> int:
        return self.base.ndim

    @property
    def num_adapters(self) -> int:
        """`K`, the number of adapters."""
        return self.a.shape[-3]

    @property
    def layer_axes(self) -> tuple[int, ...]:
        """The shape of the layer axes in front of each array (`()` alone)."""
        return tuple(self.a.shape[:-3])

    @property
    def scaling(self) -> float:
        """`alpha / rank`, as PEFT scales its adapters."""
        return self.alpha / self.rank

    def _record(self) -> dict[str, float | int | str | None]:
        # `eqxscan.save` records alpha (rank is the arrays' shapes): a file
        # loaded into a LoRA of another alpha is refused, not scaled otherwise.
        return {"alpha": self.alpha}

    def __rmatmul__(self, x: Array | np.ndarray) -> Array:
        """`x @ lora`, for orientation `"x@W"`: `x` is `[..., in]`."""
        self._check("x@W", x)
        x = jnp.asarray(x)
        k = self._adapter()
        delta = (self._dropped(x) @ self.a[k]) @ self.b[k]
        y = x @ self._frozen()
        return y + self._masked(delta, y.dtype)

    def __matmul__(self, x: Array | np.ndarray) -> Array:
        """`lora @ x`, for orientation `"W@x"`: `x` is `[in]` or `[..., in, n]`."""
        self._check("W@x", x)
        x = jnp.asarray(x)
        k = self._adapter()
        delta = self.b[k] @ (self.a[k] @ self._dropped(x))
        y = self._frozen() @ x
        return y + self._masked(delta, y.dtype)

    def _frozen(self) -> Array | Quantized:
        # The base gets a zero gradient, also when a model is differentiated
        # whole (`eqx.filter_grad`): an optimiser over every float array then
        # leaves it (and a quantized base's scales) as it is.
        return jax.lax.stop_gradient(self.base)

    def _adapter(self) -> int | Array:
        # Out of range (-1: the base alone) reads a valid adapter, whose term is
        # then masked out.
        if isinstance(self.active, int):
            return min(max(self.active, 0), self.num_adapters - 1)
        return jnp.clip(self.active, 0, self.num_adapters - 1)

    def _masked(self, delta: Array, dtype: np.dtype) -> Array:
        # `where`, not a multiplication by 0: a non-finite adapter does not leak
        # into the base's output. In the output's dtype: a bfloat16 base used
        # with float32 inputs does not round the adapters' term to bfloat16.
        scaled = (self.scaling * delta).astype(dtype)
        used = (self.active >= 0) & (self.active < self.num_adapters)
        return jnp.where(used, scaled, jnp.zeros((), scaled.dtype))

    def _dropped(self, x: Array) -> Array:
        if self.dropout == 0 or self.inference:
            return x
        if self.key is None:
            raise ValueError(
                f"{self._where()} has dropout={self.dropout} and is not in "
                "inference mode, but holds no dropout key.\nHint: call "
                "`eqxscan.adapters.with_dropout_key(model, key)` with a fresh key "
                "every step, or use `eqx.nn.inference_mode(model)`."
            )
        keep = jr.bernoulli(self.key, 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros((), x.dtype))

    def _weight(self) -> str:
        shape = ",".join(map(str, self.shape))
        return f"base {jnp.dtype(self.dtype).name}[{shape}]"


def is_lora(x: object) -> bool:
    return isinstance(x, LoRA)


def loras(model: PyTree) -> list[LoRA]:
    """Every `LoRA` of `model`, in `jax.tree_util` order."""
    return [x for x in jtu.tree_leaves(model, is_leaf=is_lora) if is_lora(x)]


def loras_in(model: PyTree, who: str, what: str = "the model") -> list[LoRA]:
    """Every `LoRA` of `model`, or an error naming `who` where it holds none."""
    if not (found := loras(model)):
        raise ValueError(
            f"{who}: {what} holds no LoRA.\nHint: add adapters first with "
            "eqxscan.adapters.add_lora, and pass the model it returns."
        )
    return found


def lora_sites(model: PyTree) -> list[tuple[LoRA, Site]]:
    """Each `LoRA` of `model` with where it sits by state-dict name, once for
    each place it is held in."""
    by_leaf = {id(lora.a): lora for lora in loras(model)}
    found = []

    def visit(leaf: object, site: Site) -> None:
        if id(leaf) in by_leaf and site.path[-1:] == ("a",):
            found.append((by_leaf[id(leaf)], site._replace(path=site.path[:-1])))

    for_each(visit, model, names=True)
    return found


def check_adapter(lora: LoRA, adapter: int, who: str, what: str, hint: str) -> None:
    """`adapter` in `[-1, K)` of `lora`; `what` names the argument in the error."""
    if not -1 <= adapter < lora.num_adapters:
        raise ValueError(
            f"{who}: adapter {adapter} does not exist: the LoRA at `{lora.name}` "
            f"holds {lora.num_adapters} adapter(s), so {what} must be in "
            f"[-1, {lora.num_adapters}).\nHint: -1 {hint}."
        )
