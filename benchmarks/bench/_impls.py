"""The implementations compared by `python -m benchmarks.bench`.

Every implementation computes the same residual MLP stack as `eqxscan.StackedMLP`
(`x + gelu(rms_norm(x) @ w1) @ w2` per layer) and the same loss, written the way
its library documents it. Each one is built from a `StackedMLP`'s weights (the
arrays are shared, not copied) and maps its gradients back to the `StackedMLP`
layout, so that all of them can be checked against each other before timing.
"""

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, PyTree

from eqxscan import StackedMLP


#: Largest relative error (loss and every gradient, against the unrolled loop) at
#: which two implementations count as computing the same thing, per dtype of the
#: agreement check. The check runs under `jax.default_matmul_precision("highest")`,
#: so that in float32 the programs differ only in the order of their sums; at a
#: TPU's default precision matmuls round their inputs to bfloat16 and scan and
#: loop were reported to differ by 3.1e-5 (7.5e-7 at "highest"). bfloat16 has 8
#: significant bits (a relative step of 2^-8 = 3.9e-3), and two orders of the same
#: sums differ by several of those steps (up to 3.0e-2 on a CPU, Flax linen's
#: Transformer at L=4, D=256): its check catches a wrong layout, a wrong transpose,
#: a program that fails in bfloat16; float32's also catches small scalings.
TOLERANCES = {"float32": 1e-5, "bfloat16": 1e-1}
TOLERANCE = TOLERANCES["float32"]


class MismatchError(RuntimeError):
    """Two implementations disagree on the loss or the gradients."""


def rel_err(a: ArrayLike, b: ArrayLike) -> float:
    """The largest absolute difference of `a` and `b`, relative to `b`'s largest
    magnitude."""
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    return float(np.max(np.abs(a64 - b64)) / (np.max(np.abs(b64)) + 1e-30))


#: A gradient in a model's one layout, `{name: array stacked over layers}`: the
#: `w1`, `w2`, `scale` of `StackedMLP`, the Transformer's `CANON`.
Canon = dict[str, Array]


class Built(NamedTuple):
    """One implementation, ready to differentiate.

    - `params`: a pytree of arrays (the differentiated argument).
    - `loss`: `loss(params, x, y) -> scalar`; the train step is
      `jax.value_and_grad(loss)`.
    - `to_canon`: maps a gradient of `params` to the model's `Canon` layout;
      `None` for entries that compute something else on purpose.
    """

    params: PyTree[Array]
    loss: Callable[[PyTree[Array], Array, Array], Array]
    to_canon: Callable[[PyTree[Array]], Canon] | None


#: The benchmark model an implementation is built from (`StackedMLP`, or the
#: Transformer's `Stacked` blocks).
M = TypeVar("M", bound=eqx.Module)


@dataclasses.dataclass(frozen=True)
class Impl(Generic[M]):
    """A named way of running the stack. `requires` names an optional import."""

    name: str
    description: str
    build: Callable[[M], Built]
    requires: str | None = None

    def available(self) -> bool:
        return self.requires is None or (
            importlib.util.find_spec(self.requires) is not None
        )


def mse(out: Array, y: Array) -> Array:
    """The loss of every implementation, reduced in float32."""
    diff = out.astype(jnp.float32) - y.astype(jnp.float32)
    return jnp.mean(diff * diff)


def stacked_arrays(model: StackedMLP) -> tuple[Array, Array, Array]:
    layers = model.blocks.layers
    return layers.w1, layers.w2, layers.scale


def _canon(w1: Array, w2: Array, scale: Array) -> Canon:
    return dict(w1=w1, w2=w2, scale=scale)


def _model_canon(model: StackedMLP) -> Canon:
    return _canon(*stacked_arrays(model))


def rms_norm(scale: Array, x: Array) -> Array:
    # As `StackedMLP`'s: the mean square in float32, eps 1e-6, back to x's dtype;
    # the scale broadcast explicitly (for `jax_numpy_rank_promotion="raise"`).
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    scale = jnp.expand_dims(scale, tuple(range(x.ndim - scale.ndim)))
    return (x32 * inv).astype(x.dtype) * scale.astype(x.dtype)


def _block(w1: Array, w2: Array, scale: Array, x: Array) -> Array:
    return x + jax.nn.gelu(rms_norm(scale, x) @ w1) @ w2


# eqxscan itself, with its options.


def _eqxscan(**options: Any) -> Callable[[StackedMLP], Built]:
    def build(model: StackedMLP) -> Built:
        model = eqx.tree_at(
            lambda m: m.blocks, model, model.blocks.with_options(**options)
        )
        params, static = eqx.partition(model, eqx.is_array)

        def loss(params: StackedMLP, x: Array, y: Array) -> Array:
            return mse(eqx.combine(params, static)(x), y)

        return Built(params, loss, _model_canon)

    return build


# The hand-written Equinox recipe ("scan-over-layers" in Equinox's docs): build the
# layers with `filter_vmap`, split arrays from the rest with `partition`, and
# `lax.scan` over the arrays, recombining in the body.


class _RecipeBlock(eqx.Module):
    w1: Array
    w2: Array
    scale: Array

    def __call__(self, x: Array) -> Array:
        return _block(self.w1, self.w2, self.scale, x)


class _RecipeModel(eqx.Module):
    layers: _RecipeBlock

    def __call__(self, x: Array) -> Array:
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def f(x: Array, layer_dynamic: _RecipeBlock) -> tuple[Array, None]:
            layer = eqx.combine(layer_dynamic, static)
            return layer(x), None

        x, _ = jax.lax.scan(f, x, dynamic)
        return x


def _recipe(model: StackedMLP) -> Built:
    # `filter_vmap(make_layer)(keys)` is how the recipe builds the stack; building
    # from our arrays gives the same layout, so we construct it directly.
    params = _RecipeModel(_RecipeBlock(*stacked_arrays(model)))

    def loss(params: _RecipeModel, x: Array, y: Array) -> Array:
        return mse(params(x), y)

    def to_canon(g: _RecipeModel) -> Canon:
        return _canon(g.layers.w1, g.layers.w2, g.layers.scale)

    return Built(params, loss, to_canon)


# Plain JAX: a dict of stacked arrays and `lax.scan`.


def _plain_jax(model: StackedMLP) -> Built:
    params = _model_canon(model)

    def loss(params: Canon, x: Array, y: Array) -> Array:
        def body(x: Array, p: Canon) -> tuple[Array, None]:
            return _block(p["w1"], p["w2"], p["scale"], x), None

        x, _ = jax.lax.scan(body, x, params)
        return mse(x, y)

    return Built(params, loss, dict)


# The floor: exactly the model's matmuls (two per layer forward, their transposes
# backward) with nothing else, on per-layer arrays in an unrolled loop.


def _matmul_floor(model: StackedMLP) -> Built:
    w1, w2, _ = stacked_arrays(model)
    params = (list(w1), list(w2))

    def loss(params: tuple[list[Array], list[Array]], x: Array, y: Array) -> Array:
        for a, b in zip(*params):
            x = (x @ a) @ b
        return mse(x, y)

    return Built(params, loss, None)


def linen_stack(block: type, num_layers: int) -> Any:
    """Flax linen's scan over layers: `nn.scan(block)` with its parameters stacked
    on axis 0 (`variable_axes={"params": 0}`), one RNG per layer (`split_rngs`),
    applied as `blocks` to `x`. `block(...)(x, None)` returns `(x, None)`."""
    import flax.linen as nn

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: Array) -> Array:
            scanned = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=num_layers,
            )
            x, _ = scanned(name="blocks")(x, None)
            return x

    return Stack()


def linen_loss(net: Any) -> Callable[[PyTree[Array], Array, Array], Array]:
    """The loss of a linen module `net` on its variables."""

    def loss(variables: PyTree[Array], x: Array, y: Array) -> Array:
        out = net.apply(variables, x)
        assert isinstance(out, Array)  # no mutable collections: the output alone
        return mse(out, y)

    return loss


# Flax linen: `nn.scan` over a block module, parameters stacked on axis 0, one RNG
# per layer.


def _flax_linen(model: StackedMLP) -> Built:
    import flax.linen as nn

    w1, w2, scale = stacked_arrays(model)
    num_layers, dim = scale.shape
    dtype = w1.dtype
    dense = functools.partial(nn.Dense, use_bias=False, dtype=dtype, param_dtype=dtype)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: Array, _: None) -> tuple[Array, None]:
            s = self.param("scale", nn.initializers.ones, (dim,), dtype)
            h = nn.gelu(dense(4 * dim)(rms_norm(s, x)))
            return x + dense(dim)(h), None

    net = linen_stack(Block, num_layers)
    blocks = {"Dense_0": {"kernel": w1}, "Dense_1": {"kernel": w2}, "scale": scale}
    variables = {"params": {"blocks": blocks}}
    x0 = jax.ShapeDtypeStruct((1, dim), dtype)
    check_same_layout(
        "flax-linen", jax.eval_shape(net.init, jax.random.key(0), x0), variables
    )

    def to_canon(g: dict[str, dict[str, Any]]) -> Canon:
        b = g["params"]["blocks"]
        return _canon(b["Dense_0"]["kernel"], b["Dense_1"]["kernel"], b["scale"])

    return Built(variables, linen_loss(net), to_canon)


# Flax NNX: the stack is built by a vmapped `__init__` with split RNGs and run by a
# `nnx.scan`ned `__call__` that carries `x`. The train step uses NNX's functional
# API (`nnx.split` / `nnx.merge`) so that it is jitted by plain `jax.jit` like the
# others.


def nnx_state(blocks: Callable[[], Any], values: PyTree[Array], name: str) -> Any:
    """`(graphdef, state)` of the NNX module `blocks()` (built abstractly), its
    parameters replaced by `values` (a nested dict in the state's layout)."""
    from flax import nnx

    graphdef, abstract = nnx.split(nnx.eval_shape(blocks))
    state = jax.tree.map(lambda a: a, abstract)
    for path, value in jax.tree_util.tree_flatten_with_path(values)[0]:
        node = state
        keys = [k.key for k in path]
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = nnx.Param(value)
    check_same_layout(name, abstract, state)
    return graphdef, state


def nnx_loss(graphdef: Any) -> Callable[[PyTree[Array], Array, Array], Array]:
    """The loss of the NNX module `nnx.merge(graphdef, state)` on its state."""
    from flax import nnx

    def loss(state: PyTree[Array], x: Array, y: Array) -> Array:
        return mse(nnx.merge(graphdef, state)(x), y)

    return loss


def _flax_nnx(model: StackedMLP) -> Built:
    from flax import nnx

    w1, w2, scale = stacked_arrays(model)
    num_layers, dim = scale.shape
    dtype = w1.dtype

    class Blocks(nnx.Module):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0, 0))
        def __init__(self, rngs: nnx.Rngs):
            linear = functools.partial(
                nnx.Linear, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
            )
            self.linear1 = linear(dim, 4 * dim)
            self.linear2 = linear(4 * dim, dim)
            self.scale = nnx.Param(jnp.ones(dim, dtype))

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def __call__(self, x: Array) -> Array:
            h = rms_norm(self.scale[...], x)
            return x + self.linear2(nnx.gelu(self.linear1(h)))

    values = {"linear1": {"kernel": w1}, "linear2": {"kernel": w2}, "scale": scale}
    graphdef, state = nnx_state(lambda: Blocks(nnx.Rngs(0)), values, "flax-nnx")

    def to_canon(g: Any) -> Canon:
        return _canon(
            g["linear1"]["kernel"][...], g["linear2"]["kernel"][...], g["scale"][...]
        )

    return Built(state, nnx_loss(graphdef), to_canon)


def check_same_layout(name: str, expected: PyTree, got: PyTree) -> None:
    # Guards the weight conversion against a library renaming its parameters.
    e = jax.tree_util.tree_flatten_with_path(expected)
    g = jax.tree_util.tree_flatten_with_path(got)
    e_desc = [(jax.tree_util.keystr(p), a.shape, a.dtype) for p, a in e[0]]
    g_desc = [(jax.tree_util.keystr(p), a.shape, a.dtype) for p, a in g[0]]
    if e_desc != g_desc:
        raise RuntimeError(
            f"{name}: the converted weights do not match the library's own "
            f"parameter layout.\nexpected: {e_desc}\ngot:      {g_desc}"
        )


_POLICIES = jax.checkpoint_policies

#: eqxscan's variants in both benchmark models: `(name, description, options)`.
EQXSCAN_VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("eqxscan", "eqxscan default (remat='auto')", {}),
    ("eqxscan-loop", "eqxscan mode='loop' (unrolled)", {"mode": "loop"}),
    # unroll=1: a scan at every size (`"auto"` unrolls a short stack of small layers).
    (
        "eqxscan-plain",
        "eqxscan remat=False, unroll=1",
        {"remat": False, "unroll": 1},
    ),
    ("eqxscan-remat", "eqxscan remat=True", {"remat": True}),
    ("eqxscan-nested", "eqxscan remat='nested'", {"remat": "nested"}),
    (
        "eqxscan-dots",
        "eqxscan remat=dots_saveable",
        {"remat": _POLICIES.dots_saveable},
    ),
    ("eqxscan-offload", "eqxscan remat='offload'", {"remat": "offload"}),
)


def eqxscan_impls(build: Callable[..., Callable[[M], Built]]) -> list[Impl[M]]:
    """One `Impl` per entry of `EQXSCAN_VARIANTS`, built by `build(**options)`."""
    return [Impl(n, d, build(**options)) for n, d, options in EQXSCAN_VARIANTS]


#: Every implementation, in table order. The first is eqxscan's default.
IMPLS: dict[str, Impl[StackedMLP]] = {
    impl.name: impl
    for impl in [
        *eqxscan_impls(_eqxscan),
        Impl(
            "eqxscan-save-all",
            "eqxscan remat=everything_saveable",
            _eqxscan(remat=_POLICIES.everything_saveable),
        ),
        Impl("eqx-recipe", "Equinox recipe (filter_vmap+partition+scan)", _recipe),
        Impl("jax-scan", "plain JAX dict of arrays + lax.scan", _plain_jax),
        Impl("flax-linen", "Flax linen nn.scan", _flax_linen, requires="flax"),
        Impl("flax-nnx", "Flax NNX nnx.vmap + nnx.scan", _flax_nnx, requires="flax"),
        Impl("matmul-floor", "matmuls only, unrolled (lower bound)", _matmul_floor),
    ]
}

#: The ratio baselines.
LOOP = "eqxscan-loop"
RECIPE = "eqx-recipe"
