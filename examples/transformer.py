"""A small decoder-only Transformer, scanned over depth, that learns to reverse
strings; then batched greedy generation with per-layer KV caches.

The blocks alternate global and local (sliding-window) causal self-attention, so
they are not all alike: `eqxscan.Chain` finds the repeating pair and scans over
it (one scan step = one global + one local block). For decoding, every layer
keeps a cache of its own size (`eqxscan.layer_buffers`): the full length for a
global layer, a ring buffer of the window for a local one. `eqxscan.buffer`
carries the caches through the scan, and each layer writes its new rows in
place. Prompts of different lengths are prefilled in chunks, then every
sequence decodes at its own position in a `jax.lax.while_loop` until all have
produced the end token or reached the length limit: one compiled program for
every prompt length and number of generated tokens. The tokens and logits are
checked against recomputing the full forward pass at every step.

    python examples/transformer.py --steps 300
    python examples/transformer.py --tiny   # every check at the smallest sizes

`--tiny` (what the tests run) keeps every step and check (training, cached
generation against recompute, one compiled program) but trains 3 steps of two
16-wide blocks (one global, one local) on words of up to 4 letters, and decodes
32 held-out words; flags given with it still apply.
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

# (keys, values) of one layer, each [T, heads, head_dim]: the full length for a
# global layer, a ring buffer of the last `window` positions for a local one.
Cache = tuple[Float[Array, "T H E"], Float[Array, "T H E"]]


def norm(scale, x):
    # RMS norm, reduced in float32. Broadcast explicitly: also runs with
    # jax_numpy_rank_promotion="raise".
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * inv).astype(x.dtype) * jnp.broadcast_to(scale, x.shape)


def attend(q, k, v, q_pos, k_pos, window: int | None):
    """Causal (optionally sliding-window) attention of queries at positions
    `q_pos` over keys at positions `k_pos` (a negative position: an empty slot)."""
    scores = jnp.einsum("shd,thd->hst", q, k) / math.sqrt(q.shape[-1])
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)
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
        cache: Cache | None = None,
        *,
        pos: Int[Array, ""] | None = None,
        valid: Int[Array, ""] | None = None,
    ):
        """Without `cache`: the full causal pass over `x` (positions `0..S-1`).

        With this layer's `cache` and `pos`: `x` holds positions `pos..pos+S-1`,
        of which the first `valid` (default all) are real tokens and the rest
        padding. Their keys and values are written into the cache, the queries
        attend over it, and `(x, updated cache)` is returned."""
        q, k, v = self._qkv(x)
        if cache is None:
            positions = jnp.arange(x.shape[0])
            return self._finish(x, attend(q, k, v, positions, positions, self.window))
        s = x.shape[0]
        q_pos = pos + jnp.arange(s)
        k_cache, v_cache = cache
        if self.window is None:
            # The full length: write the new rows at `pos` (only they are written
            # into the stacked cache), then attend over every position so far.
            # Padding rows land past the real tokens, where the causal mask hides
            # them until a real token overwrites them.
            k_cache = jax.lax.dynamic_update_slice(k_cache, k, (pos, 0, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v, (pos, 0, 0))
            k_pos = jnp.arange(k_cache.shape[0])
            attn = attend(q, k_cache, v_cache, q_pos, k_pos, None)
            return self._finish(x, attn), (k_cache, v_cache)
        # A ring buffer: slot j holds the latest position before `pos` that is
        # congruent to j (negative: not written yet). The queries attend over
        # the ring and the new keys together, since the new keys may overwrite
        # slots that earlier queries of the chunk still see.
        w = self.window
        slot = jnp.arange(w)
        ring_pos = pos - 1 - (pos - 1 - slot) % w
        attn = attend(
            q,
            jnp.concatenate([k_cache, k]),
            jnp.concatenate([v_cache, v]),
            q_pos,
            jnp.concatenate([ring_pos, q_pos]),
            w,
        )
        if s == 1:  # a decode step: one row, written in place
            k_cache = jax.lax.dynamic_update_slice(k_cache, k, (pos % w, 0, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v, (pos % w, 0, 0))
        else:
            # A chunk: its last `window` real rows wrap around the ring. A
            # scatter, so the (small) ring is written back whole.
            n = s if valid is None else valid
            row = jnp.arange(s)
            keep = (row < n) & (row >= n - w)
            at = jnp.where(keep, q_pos % w, w)  # out of bounds: dropped
            k_cache = k_cache.at[at].set(k, mode="drop")
            v_cache = v_cache.at[at].set(v, mode="drop")
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

    def init_cache(self) -> eqxscan.LayerBuffers:
        """Zeroed keys and values for every layer, each of its own size: the
        full length for global layers, the window for local ones."""
        dim, length = self.embed.shape[1], self.positions.shape[0]

        def make(i, block):
            shape = (block.window or length, block.heads, dim // block.heads)
            return jnp.zeros(shape), jnp.zeros(shape)

        return eqxscan.layer_buffers(self.blocks, make)

    def decode(
        self,
        tokens: Int[Array, " S"],
        pos: Int[Array, ""],
        cache: eqxscan.LayerBuffers,
        valid: Int[Array, ""] | None = None,
    ):
        """Logits for `tokens` at positions `pos..pos+S-1` (the first `valid`
        real, the rest padding), reading and updating every layer's cache in
        place: `eqxscan.buffer` carries the caches through the scan and each
        layer writes back only the rows it wrote."""
        x = self.embed[tokens] + jax.lax.dynamic_slice_in_dim(
            self.positions, pos, tokens.shape[0]
        )
        x, cache = self.blocks(x, eqxscan.buffer(cache), pos=pos, valid=valid)
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


def generate(
    model: Transformer,
    prompts: Int[Array, "B T"],
    lengths: Int[Array, " B"],
    limit: Int[Array, ""],
    *,
    chunk: int,
):
    """Greedy decoding of a batch, as a server does it.

    `prompts[b, :lengths[b]]` is sequence `b`'s prompt (the rest padding). The
    prompts are prefilled into the caches in chunks of `chunk` tokens; then
    every step decodes one token per sequence, each at its own position, until
    every sequence has produced `END` or reached `limit` tokens. Prompt lengths,
    `limit` and the number of steps are all traced: one compiled program serves
    them all.

    Returns the tokens `[B, T]`, each sequence's length, and the logits that
    predicted each position's next token `[B, T, V]`."""
    batch, length = prompts.shape
    if length % chunk:
        raise ValueError(f"chunk={chunk} must divide the sequence length {length}")
    limit = jnp.minimum(limit, length)
    cache = jax.tree.map(
        lambda a: jnp.broadcast_to(a, (batch, *a.shape)), model.init_cache()
    )
    step = jax.vmap(model.decode, in_axes=(0, 0, 0, 0))

    # Prefill: chunk c holds positions c*chunk.. of every prompt; each sequence
    # keeps the logits at its last prompt position.
    def prefill(state):
        c, cache, logits = state
        start = c * chunk
        tokens = jax.lax.dynamic_slice_in_dim(prompts, start, chunk, axis=1)
        valid = jnp.clip(lengths - start, 0, chunk)
        out, cache = step(tokens, jnp.full(batch, start), cache, valid)
        logits = jax.lax.dynamic_update_slice_in_dim(logits, out, start, axis=1)
        return c + 1, cache, logits

    logits = jnp.zeros((batch, length, VOCAB))
    _, cache, logits = jax.lax.while_loop(
        lambda state: state[0] * chunk < jnp.max(lengths),
        prefill,
        (0, cache, logits),
    )
    rows = jnp.arange(batch)
    # Padding positions' logits predict nothing.
    logits = jnp.where(
        jnp.arange(length)[None, :, None] < lengths[:, None, None], logits, 0
    )
    tokens, n, done = _append(
        prompts, lengths, lengths >= limit, logits[rows, lengths - 1], limit
    )

    # Generation: each sequence feeds its last token at its own position.
    def decode(state):
        tokens, n, done, cache, logits = state
        pos = n - 1
        out, cache = step(tokens[rows, pos][:, None], pos, cache, jnp.ones_like(n))
        logits = logits.at[rows, pos].set(jnp.where(done[:, None], 0, out[:, 0]))
        tokens, n, new_done = _append(tokens, n, done, out[:, 0], limit)
        return tokens, n, new_done, cache, logits

    tokens, n, _, _, logits = jax.lax.while_loop(
        lambda state: ~jnp.all(state[2]),
        decode,
        (tokens, n, done, cache, logits),
    )
    return tokens, n, logits


def _append(tokens, n, done, logits, limit):
    # The greedy next token of every sequence still running, and who is done.
    nxt = jnp.argmax(logits, axis=-1).astype(tokens.dtype)
    rows = jnp.arange(tokens.shape[0])
    at = jnp.where(done, tokens.shape[1], n)  # out of bounds: dropped
    tokens = tokens.at[rows, at].set(nxt, mode="drop")
    n = jnp.where(done, n, n + 1)
    return tokens, n, done | (nxt == END) | (n >= limit)


def generate_by_recompute(
    model: Transformer,
    prompts: Int[Array, "B T"],
    lengths: Int[Array, " B"],
    limit: Int[Array, ""],
):
    """The reference: the same greedy decoding, rerunning the full forward pass
    over the whole (padded) sequences at every step; causality makes the
    padding inert."""
    limit = jnp.minimum(limit, prompts.shape[1])
    rows = jnp.arange(prompts.shape[0])

    def body(state):
        tokens, n, done = state
        logits = jax.vmap(model)(tokens)[rows, n - 1]
        return _append(tokens, n, done, logits, limit)

    state = (prompts, lengths, lengths >= limit)
    tokens, n, _ = jax.lax.while_loop(lambda s: ~jnp.all(s[2]), body, state)
    return tokens, n


def text(tokens) -> str:
    return "".join(CHARS[int(t)] for t in tokens)


# --tiny: short words, so the checks hold at any length.
TINY = dict(steps=3, dim=16, layers=2, batch=8, samples=2, test_words=32, max_word=4)


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
    parser.add_argument("--test-words", type=int, default=256)
    parser.add_argument(
        "--chunk", type=int, default=0, help="prefill chunk (0: half the length)"
    )
    parser.add_argument("--tiny", action="store_true", help="the smallest sizes")
    args = parser.parse_args(argv)
    if args.tiny:
        parser.set_defaults(**TINY)
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
        + (f" pattern of {s.per_step}" if s.per_step > 1 else "")
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

    # Greedy generation with per-layer KV caches on held-out words: the prompt
    # is the word and the separator; generation stops at END or the length
    # limit. Checked against recomputing the full forward pass at every step.
    seq, n, _ = make_batch(k_test, args.test_words, args.max_word)
    length = seq.shape[1]
    prompts = jnp.where(jnp.arange(length)[None, :] <= n[:, None], seq, PAD)
    chunk = args.chunk or length // 2
    traces = []  # one entry per compilation of the generation program

    @eqx.filter_jit
    def decode(model, prompts, lengths, limit):
        traces.append(prompts.shape)
        return generate(model, prompts, lengths, limit, chunk=chunk)

    recompute = eqx.filter_jit(generate_by_recompute)
    limit = jnp.asarray(length)
    tokens, lengths, logits = decode(model, prompts, n + 1, limit)
    ref_tokens, ref_lengths = recompute(model, prompts, n + 1, limit)
    same = bool(jnp.all(tokens == ref_tokens) & jnp.all(lengths == ref_lengths))
    # The logits of every step are the full forward pass's at that position.
    full = jax.vmap(model)(tokens)
    seen = jnp.arange(length)[None, :, None] < lengths[:, None, None] - 1
    err = float(jnp.max(jnp.where(seen, jnp.abs(logits - full), 0)))
    # Within 1e-5, absolute and relative (a trained model's logits reach ~20).
    close = bool(
        jnp.all(~seen | (jnp.abs(logits - full) <= 1e-5 * (1 + jnp.abs(full))))
    )
    # Shorter prompts and a tighter limit: the same compiled program.
    decode(model, jnp.where(jnp.arange(length) < 2, prompts, PAD), n * 0 + 2, limit - 3)
    print(
        f"KV-cache decoding ({len(model.blocks)} layers, cache "
        f"{model.init_cache().nbytes} bytes, prefill in chunks of {chunk}) vs "
        f"full recompute: tokens identical: {same}, max |logit difference| = "
        f"{err:.2e} (within 1e-5: {close}), compiled programs: {len(traces)}"
    )
    t = jnp.arange(length)[None, :]
    answer = (t > n[:, None]) & (t <= 2 * n[:, None] + 1)
    correct = jnp.all((tokens == seq) | ~answer, axis=1)
    print(f"exact reversals: {int(correct.sum())}/{len(correct)} held-out words")
    for i in range(args.samples):
        prompt = text(seq[i, : n[i] + 1])
        out = text(tokens[i, n[i] + 1 : lengths[i]])
        mark = (
            "ok"
            if bool(correct[i])
            else f"expected {text(seq[i, n[i] + 1 : 2 * n[i] + 2])}"
        )
        print(f"  {prompt:>10} {out:<10} {mark}")
    if not (same and close):
        raise SystemExit("KV-cache decoding disagrees with the full forward pass")
    return model


if __name__ == "__main__":
    main()
