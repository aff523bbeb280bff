"""The Transformer model of `python -m benchmarks.bench --model transformer`.

A pre-norm decoder block, `x + attn(ln1(x))` then `x + mlp(ln2(x))`, with causal
`eqx.nn.MultiheadAttention` (no projection biases) and a GELU MLP of width `4D`
(with biases), stacked `L` times. Every implementation below computes it from
the same weights, written the way its library documents it, and maps its
gradients back to one flat layout (`CANON`) so that all can be checked against
the unrolled loop before anything is timed.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, DTypeLike, Float, PRNGKeyArray, PyTree

from eqxscan import Stacked

from ._impls import (
    Built,
    Canon,
    check_same_layout,
    eqxscan_impls,
    Impl,
    linen_loss,
    linen_stack,
    mse,
    nnx_loss,
    nnx_state,
)
from ._values import Normals


#: The flat, stacked layout every gradient is mapped to (eqx.nn.Linear's
#: `[out, in]` weights, leading layer axis).
CANON = (
    "ln1_w",
    "ln1_b",
    "wq",
    "wk",
    "wv",
    "wo",
    "ln2_w",
    "ln2_b",
    "w1",
    "b1",
    "w2",
    "b2",
)
EPS = 1e-5


def num_heads(dim: int) -> int:
    """Heads of width 32 up to `D=512`, of width 128 above (e.g. 32 at 4096)."""
    size = 32 if dim <= 512 else 128
    return max(1, dim // size)


def causal_mask(seq: int) -> Array:
    return jnp.tril(jnp.ones((seq, seq), bool))


class Block(eqx.Module):
    """One pre-norm Transformer block on a batch `[B, T, D]`."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, dim: int, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(dim, eps=EPS, dtype=dtype)
        self.attn = eqx.nn.MultiheadAttention(num_heads(dim), dim, key=k1, dtype=dtype)
        self.ln2 = eqx.nn.LayerNorm(dim, eps=EPS, dtype=dtype)
        self.mlp_in = eqx.nn.Linear(dim, 4 * dim, key=k2, dtype=dtype)
        self.mlp_out = eqx.nn.Linear(4 * dim, dim, key=k3, dtype=dtype)

    def _one(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=causal_mask(x.shape[0]))
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))

    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        return jax.vmap(self._one)(x)


def canon_of_block(b: Block) -> Canon:
    """The `CANON` arrays of a (stacked) `Block` or of its gradient."""
    a = b.attn
    # A LayerNorm made with its defaults has a weight and a bias, and `Block`'s
    # linear layers keep theirs (the attention's projections have none).
    assert b.ln1.weight is not None and b.ln1.bias is not None
    assert b.ln2.weight is not None and b.ln2.bias is not None
    assert b.mlp_in.bias is not None and b.mlp_out.bias is not None
    return dict(
        ln1_w=b.ln1.weight,
        ln1_b=b.ln1.bias,
        wq=a.query_proj.weight,
        wk=a.key_proj.weight,
        wv=a.value_proj.weight,
        wo=a.output_proj.weight,
        ln2_w=b.ln2.weight,
        ln2_b=b.ln2.bias,
        w1=b.mlp_in.weight,
        b1=b.mlp_in.bias,
        w2=b.mlp_out.weight,
        b2=b.mlp_out.bias,
    )


def transformer_problem(
    num_layers: int, dim: int, batch: int, seq: int, dtype: str, seed: int = 0
) -> tuple[Stacked, Array, Array]:
    """The stacked blocks and one batch `(x, y)`, identical for every
    implementation, drawn on the device (see `Normals`)."""
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    shapes = eqx.filter_eval_shape(
        Stacked,
        lambda k: Block(dim, key=k, dtype=dt),
        num_layers,
        key=jax.random.key(0),
    )
    normals = Normals(seed)

    def init(path: jax.tree_util.KeyPath, leaf: object) -> object:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        name = jax.tree_util.keystr(path)
        if len(leaf.shape) == 3:  # [L, out, in] weights: fan-in scaling
            return normals(leaf.shape, dt, scale=1 / np.sqrt(leaf.shape[-1]))
        if "ln" in name and "weight" in name:
            return normals(leaf.shape, dt, scale=0.1, shift=1.0)
        # Biases: small but non-zero, so that their gradients are checked.
        return normals(leaf.shape, dt, scale=0.1)

    model = jax.tree_util.tree_map_with_path(init, shapes)
    x = normals((batch, seq, dim), dt)
    y = normals((batch, seq, dim), dt)
    return model, x, y


def transformer_flops(num_layers: int, dim: int, tokens: int, seq: int) -> int:
    """Model FLOPs of one train step: per token and layer, the four `D x D`
    projections and the two MLP matmuls (`2 * 12 D^2` forward) plus the scores
    and the weighted sum over all `T` keys (`2 * 2 T D`, the masked half
    included, as computed); x3 for forward + backward."""
    return 3 * num_layers * tokens * (24 * dim * dim + 4 * seq * dim)


# eqxscan itself, with its options, and the hand-written Equinox recipe.


def _eqxscan(**options: Any) -> Callable[[Stacked], Built]:
    def build(model: Stacked) -> Built:
        model = model.with_options(**options)
        params, static = eqx.partition(model, eqx.is_array)

        def loss(params: Stacked, x: Array, y: Array) -> Array:
            return mse(eqx.combine(params, static)(x), y)

        return Built(params, loss, lambda g: canon_of_block(g.layers))

    return build


def _recipe(model: Stacked) -> Built:
    # Equinox's "scan over layers": the stacked module, `partition`, `lax.scan`
    # over the arrays, `combine` in the body.
    params, static = eqx.partition(model.layers, eqx.is_array)

    def loss(params: Block, x: Array, y: Array) -> Array:
        def f(x: Array, layer: Block) -> tuple[Array, None]:
            return eqx.combine(layer, static)(x), None

        x, _ = jax.lax.scan(f, x, params)
        return mse(x, y)

    return Built(params, loss, canon_of_block)


# Plain JAX: a dict of stacked arrays, hand-written layer norm and attention.


def _layer_norm(w: Array, b: Array, x: Array) -> Array:
    h = x.astype(jnp.float32)
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + EPS)
    w, b = (jnp.broadcast_to(a.astype(jnp.float32), h.shape) for a in (w, b))
    return (h * w + b).astype(x.dtype)


def _plain_block(p: Canon, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
    batch, seq, dim = x.shape
    heads = num_heads(dim)
    h = _layer_norm(p["ln1_w"], p["ln1_b"], x)

    def split(w: Array) -> Array:  # [B, T, D] -> [B, H, T, D/H]
        return (h @ w.T).reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3)

    q, k, v = split(p["wq"]), split(p["wk"]), split(p["wv"])
    q = q / np.sqrt(q.shape[-1]).astype(q.dtype)
    logits = jnp.einsum("bhsd,bhSd->bhsS", q, k)
    logits = jnp.where(causal_mask(seq), logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(x.dtype)
    attn = jnp.einsum("bhsS,bhSd->bhsd", weights, v)
    x = x + attn.transpose(0, 2, 1, 3).reshape(batch, seq, dim) @ p["wo"].T
    h = _layer_norm(p["ln2_w"], p["ln2_b"], x)
    h = jax.nn.gelu(h @ p["w1"].T + p["b1"][None, None])
    return x + h @ p["w2"].T + p["b2"][None, None]


def _plain_jax(model: Stacked) -> Built:
    params = canon_of_block(model.layers)

    def loss(params: Canon, x: Array, y: Array) -> Array:
        x, _ = jax.lax.scan(lambda x, p: (_plain_block(p, x), None), x, params)
        return mse(x, y)

    return Built(params, loss, lambda g: g)


# Flax: the same block from the libraries' own LayerNorm, MultiHeadAttention and
# Dense/Linear layers. Their kernels are `[in, out]` (attention: `[D, H, D/H]` and
# `[H, D/H, D]`); the conversion below reshapes eqx's `[out, in]` weights.


def _to_flax(c: Canon, heads: int) -> dict[str, dict[str, Any]]:
    num_layers, dim = c["ln1_w"].shape

    def head_kernel(w: Array) -> Array:  # [L, D_out, D_in] -> [L, D, H, hd]
        return jnp.swapaxes(w, 1, 2).reshape(num_layers, dim, heads, -1)

    return dict(
        ln1=dict(scale=c["ln1_w"], bias=c["ln1_b"]),
        attn=dict(
            query=dict(kernel=head_kernel(c["wq"])),
            key=dict(kernel=head_kernel(c["wk"])),
            value=dict(kernel=head_kernel(c["wv"])),
            out=dict(
                kernel=jnp.swapaxes(c["wo"], 1, 2).reshape(num_layers, heads, -1, dim)
            ),
        ),
        ln2=dict(scale=c["ln2_w"], bias=c["ln2_b"]),
        mlp_in=dict(kernel=jnp.swapaxes(c["w1"], 1, 2), bias=c["b1"]),
        mlp_out=dict(kernel=jnp.swapaxes(c["w2"], 1, 2), bias=c["b2"]),
    )


def _from_flax(f: dict[str, Any]) -> Canon:
    num_layers, dim = f["ln1"]["scale"].shape

    def head_weight(k: Array) -> Array:  # [L, D, H, hd] -> [L, D_out, D_in]
        return jnp.swapaxes(k.reshape(num_layers, dim, dim), 1, 2)

    a = f["attn"]
    return dict(
        ln1_w=f["ln1"]["scale"],
        ln1_b=f["ln1"]["bias"],
        wq=head_weight(a["query"]["kernel"]),
        wk=head_weight(a["key"]["kernel"]),
        wv=head_weight(a["value"]["kernel"]),
        wo=jnp.swapaxes(a["out"]["kernel"].reshape(num_layers, dim, dim), 1, 2),
        ln2_w=f["ln2"]["scale"],
        ln2_b=f["ln2"]["bias"],
        w1=jnp.swapaxes(f["mlp_in"]["kernel"], 1, 2),
        b1=f["mlp_in"]["bias"],
        w2=jnp.swapaxes(f["mlp_out"]["kernel"], 1, 2),
        b2=f["mlp_out"]["bias"],
    )


def _sizes(canon: Canon) -> tuple[int, int, jnp.dtype, int]:
    """`(layers, D, dtype, heads)` of a stack in the `CANON` layout."""
    num_layers, dim = canon["ln1_w"].shape
    return num_layers, dim, canon["w1"].dtype, num_heads(dim)


def _flax_linen(model: Stacked) -> Built:
    import flax.linen as nn

    canon = canon_of_block(model.layers)
    num_layers, dim, dtype, heads = _sizes(canon)
    ln = functools.partial(
        nn.LayerNorm,
        epsilon=EPS,
        use_fast_variance=False,
        dtype=dtype,
        param_dtype=dtype,
    )
    dense = functools.partial(nn.Dense, dtype=dtype, param_dtype=dtype)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: Array, _: None) -> tuple[Array, None]:
            h = ln(name="ln1")(x)
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.MultiHeadDotProductAttention(
                num_heads=heads,
                use_bias=False,
                name="attn",
                dtype=dtype,
                param_dtype=dtype,
            )(h, mask=mask)
            h = ln(name="ln2")(x)
            h = nn.gelu(dense(4 * dim, name="mlp_in")(h))
            return x + dense(dim, name="mlp_out")(h), None

    net = linen_stack(Block, num_layers)
    variables = {"params": {"blocks": _to_flax(canon, heads)}}
    x0 = jax.ShapeDtypeStruct((1, 2, dim), dtype)
    check_same_layout(
        "flax-linen", jax.eval_shape(net.init, jax.random.key(0), x0), variables
    )
    to_canon = lambda g: _from_flax(g["params"]["blocks"])  # noqa: E731
    return Built(variables, linen_loss(net), to_canon)


def _flax_nnx(model: Stacked) -> Built:
    from flax import nnx

    canon = canon_of_block(model.layers)
    num_layers, dim, dtype, heads = _sizes(canon)

    class Blocks(nnx.Module):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0, 0))
        def __init__(self, rngs: nnx.Rngs):
            ln = functools.partial(
                nnx.LayerNorm,
                epsilon=EPS,
                use_fast_variance=False,
                dtype=dtype,
                param_dtype=dtype,
                rngs=rngs,
            )
            linear = functools.partial(
                nnx.Linear, dtype=dtype, param_dtype=dtype, rngs=rngs
            )
            self.ln1 = ln(dim)
            self.attn = nnx.MultiHeadAttention(
                num_heads=heads,
                in_features=dim,
                use_bias=False,
                decode=False,
                dtype=dtype,
                param_dtype=dtype,
                rngs=rngs,
            )
            self.ln2 = ln(dim)
            self.mlp_in = linear(dim, 4 * dim)
            self.mlp_out = linear(4 * dim, dim)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def __call__(self, x: Array) -> Array:
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x))))

    values = _to_flax(canon, heads)
    graphdef, state = nnx_state(lambda: Blocks(nnx.Rngs(0)), values, "flax-nnx")

    def to_canon(g: PyTree[Array]) -> Canon:
        return _from_flax(nnx.to_pure_dict(g))

    return Built(state, nnx_loss(graphdef), to_canon)


#: Every implementation, in table order; the names match the MLP benchmark's.
IMPLS: dict[str, Impl[Stacked]] = {
    impl.name: impl
    for impl in [
        *eqxscan_impls(_eqxscan),
        Impl("eqx-recipe", "Equinox recipe (partition+scan+combine)", _recipe),
        Impl("jax-scan", "plain JAX dict of arrays + lax.scan", _plain_jax),
        Impl("flax-linen", "Flax linen nn.scan", _flax_linen, requires="flax"),
        Impl("flax-nnx", "Flax NNX nnx.vmap + nnx.scan", _flax_nnx, requires="flax"),
    ]
}
