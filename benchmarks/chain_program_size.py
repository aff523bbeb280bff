"""Lowered program size (StableHLO lines) and compile time of a model that
alternates attention and MLP blocks: `eqxscan.Chain` vs a Python loop.

    python benchmarks/chain_program_size.py --layers 8 24 48
"""

import argparse
import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import eqxscan


class Attention(eqx.Module):
    """Pre-norm causal self-attention block."""

    wqkv: jax.Array
    wo: jax.Array
    scale: jax.Array
    heads: int = eqx.field(static=True)

    def __init__(self, dim, heads, *, key):
        k1, k2 = jr.split(key)
        self.wqkv = jr.normal(k1, (dim, 3 * dim)) / math.sqrt(dim)
        self.wo = jr.normal(k2, (dim, dim)) / math.sqrt(dim)
        self.scale = jnp.ones(dim)
        self.heads = heads

    def __call__(self, x):
        t, d = x.shape
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        h = (h * jnp.broadcast_to(self.scale, x.shape)) @ self.wqkv
        q, k, v = (
            a.reshape(t, self.heads, d // self.heads) for a in jnp.split(h, 3, -1)
        )
        s = jnp.einsum("shd,thd->hst", q, k) / math.sqrt(d // self.heads)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        o = jnp.einsum("hst,thd->shd", jax.nn.softmax(s, -1), v).reshape(t, d)
        return x + o @ self.wo


def make_layers(num_layers, dim, key):
    keys = jr.split(key, num_layers)
    return [
        Attention(dim, 4, key=k) if i % 2 == 0 else eqxscan.MLPBlock(dim, key=k)
        for i, k in enumerate(keys)
    ]


def python_loop(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def chain_call(chain, x):
    return chain(x)


def measure(fn, model, x, grad):
    if grad:
        inner = fn
        fn = eqx.filter_value_and_grad(lambda m, x: jnp.sum(inner(m, x) ** 2))
    start = time.perf_counter()
    lowered = eqx.filter_jit(fn).lower(model, x)
    lines = len(lowered.as_text().splitlines())
    lowered.compile()
    return lines, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 24, 48])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()
    x = jnp.ones((args.seq, args.dim))
    print(
        "| L | what | forward lines | forward compile s | grad lines | grad compile s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.layers:
        layers = make_layers(n, args.dim, jr.key(0))
        chain = eqxscan.Chain(layers)
        for name, fn, model in [
            ("Python loop", python_loop, layers),
            (f"Chain {[tuple(s) for s in chain.layout]}", chain_call, chain),
        ]:
            fl, ft = measure(fn, model, x, grad=False)
            gl, gt = measure(fn, model, x, grad=True)
            print(f"| {n} | {name} | {fl} | {ft:.2f} | {gl} | {gt:.2f} |")


if __name__ == "__main__":
    main()
