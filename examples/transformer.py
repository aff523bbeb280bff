"""A small decoder-only Transformer, scanned over depth, that learns to reverse
strings; then greedy generation with a preallocated per-layer KV cache.

The blocks alternate global and local (sliding-window) causal self-attention, so
they are not all alike: `eqxscan.Chain` finds the repeating pair and scans over
it (one scan step = one global + one local block). For decoding, each layer's
cache is passed with `eqxscan.per_layer` and written in place with
`jax.lax.dynamic_update_slice` inside the scan: the cache is allocated once, at
full length, and never grows. The cached logits are checked against recomputing
the full forward pass.

    python examples/transformer.py --steps 300
"""

import argparse
import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from tqdm import tqdm

import eqxscan


LETTERS = "abcdefghij"
SEP, END, PAD = len(LETTERS), len(LETTERS) + 1, len(LETTERS) + 2
VOCAB = len(LETTERS) + 3
CHARS = LETTERS + ">._"

# (keys, values), each [T, heads, head_dim] for one layer; [L, T, ...] stacked.
Cache = tuple[Float[Array, "T H E"], Float[Array, "T H E"]]


def norm(scale, x):
    # RMS norm, reduced in float32. Broadcast explicitly: also runs with
    # jax_numpy_rank_promotion="raise".
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * inv).astype(x.dtype) * jnp.broadcast_to(scale, x.shape)


def attend(q, k, v, q_pos, k_pos, window: int | None):
    """Causal (optionally sliding-window) attention of queries at positions
    `q_pos` over keys at positions `k_pos`."""
    scores = jnp.einsum("shd,thd->hst", q, k) / math.sqrt(q.shape[-1])
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen = seen & (q_pos[:, None] - k_pos[None, :] < window)
    scores = jnp.where(seen, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("hst,thd->shd", jax.nn.softmax(scores, axis=-1), v)


class Block(eqx.Module):
    """Pre-norm block: causal self-attention, then an MLP, both residual."""

    wqkv: Float[Array, "D 3*D"]
    wo: Float[Array, "D D"]
    w1: Float[Array, "D 4*D"]
    w2: Float[Array, "4*D D"]
    norm1: Float[Array, " D"]
    norm2: Float[Array, " D"]
    heads: int = eqx.field(static=True)
    window: int | None = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, window: int | None, *, key):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.wqkv = jr.normal(k1, (dim, 3 * dim)) * dim**-0.5
        self.wo = jr.normal(k2, (dim, dim)) * dim**-0.5
        self.w1 = jr.normal(k3, (dim, 4 * dim)) * dim**-0.5
        self.w2 = jr.normal(k4, (4 * dim, dim)) * (4 * dim) ** -0.5
        self.norm1 = jnp.ones(dim)
        self.norm2 = jnp.ones(dim)
        self.heads = heads
        self.window = window

    def _qkv(self, x):
        q, k, v = jnp.split(norm(self.norm1, x) @ self.wqkv, 3, axis=-1)
        shape = (x.shape[0], self.heads, x.shape[1] // self.heads)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def _finish(self, x, attn):
        x = x + attn.reshape(x.shape) @ self.wo
        h = jax.nn.gelu(norm(self.norm2, x) @ self.w1)
        return x + h @ self.w2

    def __call__(
        self,
        x: Float[Array, "S D"],
        *,
        pos: Int[Array, ""] | None = None,
        cache: Cache | None = None,
    ):
        """Without `cache`: the full causal pass over `x` (positions `0..S-1`).
        With `cache` (this layer's slice) and `pos`: `x` holds positions
        `pos..pos+S-1`; their keys and values are written into the cache, the
        queries attend over it, and `(x, updated cache)` is returned."""
        q, k, v = self._qkv(x)
        if cache is None:
            positions = jnp.arange(x.shape[0])
            return self._finish(x, attend(q, k, v, positions, positions, self.window))
        k_cache, v_cache = cache
        k_cache = jax.lax.dynamic_update_slice(k_cache, k, (pos, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v, (pos, 0, 0))
        q_pos = pos + jnp.arange(x.shape[0])
        k_pos = jnp.arange(k_cache.shape[0])
        attn = attend(q, k_cache, v_cache, q_pos, k_pos, self.window)
        return self._finish(x, attn), (k_cache, v_cache)


class Transformer(eqx.Module):
    embed: Float[Array, "V D"]
    positions: Float[Array, "T D"]
    blocks: eqxscan.Chain
    norm: Float[Array, " D"]
    head: Float[Array, "D V"]

    def __init__(
        self,
        *,
        dim: int,
        layers: int,
        heads: int,
        window: int | None,
        max_len: int,
        key: PRNGKeyArray,
    ):
        k_embed, k_pos, k_blocks, k_head = jr.split(key, 4)
        self.embed = jr.normal(k_embed, (VOCAB, dim)) * 0.5
        self.positions = jr.normal(k_pos, (max_len, dim)) * 0.5
        # Even layers attend globally, odd layers within a sliding window.
        self.blocks = eqxscan.Chain(
            [
                Block(dim, heads, None if i % 2 == 0 or not window else window, key=k)
                for i, k in enumerate(jr.split(k_blocks, layers))
            ]
        )
        self.norm = jnp.ones(dim)
        self.head = jr.normal(k_head, (dim, VOCAB)) * dim**-0.5

    def _logits(self, x):
        return norm(self.norm, x) @ self.head

    def __call__(self, tokens: Int[Array, " S"]) -> Float[Array, "S V"]:
        """The full forward pass: logits for every position of `tokens`."""
        x = self.embed[tokens] + self.positions[: tokens.shape[0]]
        return self._logits(self.blocks(x))

    def init_cache(self) -> Cache:
        """Zeroed keys and values for every layer and position: `[L, T, H, E]`."""
        block = self.blocks.unstack()[0]
        dim = self.embed.shape[1]
        shape = (
            len(self.blocks),
            self.positions.shape[0],
            block.heads,
            dim // block.heads,
        )
        return jnp.zeros(shape), jnp.zeros(shape)

    def decode(self, tokens: Int[Array, " S"], pos: Int[Array, ""], cache: Cache):
        """Logits for `tokens` at positions `pos..pos+S-1`, reading and updating
        the per-layer cache."""
        x = self.embed[tokens] + jax.lax.dynamic_slice_in_dim(
            self.positions, pos, tokens.shape[0]
        )
        x, cache = self.blocks.scan(x, pos=pos, cache=eqxscan.per_layer(cache))
        return self._logits(x), cache


def make_batch(key, batch: int, max_word: int):
    """Random words `w` of 3..max_word letters as `w > reverse(w) .`, padded.

    Returns the token sequences `[B, 2*max_word+2]`, the word lengths, and the
    mask of positions whose next token is part of the answer."""
    length = 2 * max_word + 2
    k_len, k_letters = jr.split(key)
    n = jr.randint(k_len, (batch, 1), 3, max_word + 1)
    letters = jr.randint(k_letters, (batch, max_word), 0, len(LETTERS))
    t = jnp.arange(length)[None, :]
    fwd = jnp.take_along_axis(letters, jnp.clip(t, 0, max_word - 1).repeat(batch, 0), 1)
    rev = jnp.take_along_axis(letters, jnp.clip(2 * n - t, 0, max_word - 1), 1)
    seq = jnp.where(
        t < n,
        fwd,
        jnp.where(
            t == n,
            SEP,
            jnp.where(t <= 2 * n, rev, jnp.where(t == 2 * n + 1, END, PAD)),
        ),
    )
    answer = (t[:, :-1] >= n) & (t[:, :-1] <= 2 * n)
    return seq, n[:, 0], answer


def loss_fn(model, seq, answer):
    logits = jax.vmap(model)(seq[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:])
    return jnp.sum(nll * answer) / jnp.sum(answer)


def generate(model: Transformer, seq: Int[Array, " T"], prompt_len: Int[Array, ""]):
    """Greedy decoding with the KV cache, one token per scan step.

    The first `prompt_len` tokens of `seq` are the prompt (fed in, one a step);
    after that each step feeds back its own prediction. Returns the tokens and
    the logits of every step. The carry (cache, token) keeps its shape."""

    def step(carry, pos):
        cache, token = carry
        logits, cache = model.decode(token[None], pos, cache)
        nxt = jnp.where(pos + 1 < prompt_len, seq[pos + 1], jnp.argmax(logits[0]))
        return (cache, nxt.astype(token.dtype)), (nxt, logits[0])

    positions = jnp.arange(seq.shape[0] - 1)
    _, (nxt, logits) = jax.lax.scan(step, (model.init_cache(), seq[0]), positions)
    return jnp.concatenate([seq[:1], nxt]), logits


def generate_by_recompute(model: Transformer, seq, prompt_len):
    """The reference: greedy decoding that reruns the full forward pass over the
    whole (padded) sequence at every step; causality makes the padding inert."""

    def step(tokens, pos):
        logits = model(tokens)[pos]
        nxt = jnp.where(pos + 1 < prompt_len, seq[pos + 1], jnp.argmax(logits))
        return tokens.at[pos + 1].set(nxt.astype(tokens.dtype)), logits

    init = jnp.full_like(seq, PAD).at[0].set(seq[0])
    tokens, logits = jax.lax.scan(step, init, jnp.arange(seq.shape[0] - 1))
    return tokens, logits


def text(tokens) -> str:
    return "".join(CHARS[int(t)] for t in tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--window", type=int, default=4, help="0: all global")
    parser.add_argument("--max-word", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--samples", type=int, default=6)
    args = parser.parse_args(argv)

    key = jr.key(args.seed)
    k_model, k_train, k_test = jr.split(key, 3)
    model = Transformer(
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        window=args.window or None,
        max_len=2 * args.max_word + 2,
        key=k_model,
    )
    groups = ", ".join(
        f"{type(g).__name__}[{s.start}:{s.start + s.size}]"
        + (f" period {s.period}" if s.period > 1 else "")
        for g, s in zip(model.blocks.groups, model.blocks.layout)
    )
    print(f"{args.layers} blocks grouped as: {groups}")

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 5 + 1), max(args.steps, 1)
    )
    optim = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, key):
        seq, _, answer = make_batch(key, args.batch, args.max_word)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, seq, answer)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    start = time.perf_counter()
    first = None
    steps = jr.split(k_train, args.steps)
    with tqdm(steps, desc="train", unit="step", mininterval=0.5) as bar:
        for i, step_key in enumerate(bar):
            model, opt_state, loss = train_step(model, opt_state, step_key)
            if i == 0:
                first = float(loss)
            if i % 25 == 0 or i == args.steps - 1:
                bar.set_postfix(loss=f"{float(loss):.4f}")
    if args.steps:
        print(
            f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s: "
            f"loss {first:.4f} -> {float(loss):.4f}"
        )

    # Greedy generation with the KV cache on held-out words, checked against
    # recomputing the full forward pass at every step.
    seq, n, _ = make_batch(k_test, 256, args.max_word)
    decode = eqx.filter_jit(jax.vmap(generate, in_axes=(None, 0, 0)))
    recompute = eqx.filter_jit(jax.vmap(generate_by_recompute, in_axes=(None, 0, 0)))
    tokens, logits = decode(model, seq, n + 1)
    ref_tokens, ref_logits = recompute(model, seq, n + 1)
    same = bool(jnp.all(tokens == ref_tokens))
    err = float(jnp.max(jnp.abs(logits - ref_logits)))
    print(
        f"KV-cache decoding vs full recompute: tokens identical: {same}, "
        f"max |logit difference| = {err:.2e}"
    )
    t = jnp.arange(seq.shape[1])[None, :]
    answer = (t > n[:, None]) & (t <= 2 * n[:, None] + 1)
    correct = jnp.all((tokens == seq) | ~answer, axis=1)
    print(f"exact reversals: {int(correct.sum())}/{len(correct)} held-out words")
    for i in range(args.samples):
        prompt = text(seq[i, : n[i] + 1])
        out = text(tokens[i, n[i] + 1 : 2 * n[i] + 2])
        mark = (
            "ok"
            if bool(correct[i])
            else f"expected {text(seq[i, n[i] + 1 : 2 * n[i] + 2])}"
        )
        print(f"  {prompt:>10} {out:<10} {mark}")
    if not same:
        raise SystemExit("KV-cache decoding disagrees with the full forward pass")
    return model


if __name__ == "__main__":
    main()
