"""LoRA fine-tuning of examples/llama.py's tiny Llama: two adapters over one
frozen base, saved as PEFT files, then served in one batch.

A random base model (nothing pretrained) gets rank-4 adapters on its fused
attention projection `wqkv`, its fused gate/up projection `w13`, its down
projection `w2` and its output head, two adapters side by side. Rows read
`x SEP y`, `x` a few random symbols: adapter 0 learns to copy `x`, adapter 1 to
reverse it. Both are trained in one batch (each row selects its adapter with
`eqxscan.adapters.select`; only `eqxscan.adapters.trainable` gets gradients and
Adam state), written with `save_peft` and read back with `load_peft` into a
fresh adapted model (same logits). Then a batch whose rows use either adapter,
or the base alone, is decoded greedily with in-place KV caches, and each row's
token accuracy is printed against the base's.

    python examples/lora.py          # under a minute on 2 CPU cores
    python examples/lora.py --tiny   # a smaller model and 30 steps: a smoke test
"""

import argparse
import collections
import dataclasses
import os
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from llama import Block, Config, Llama, rms_norm, rotary

import eqxscan
from eqxscan import adapters
from eqxscan.checkpoint import NameMap, Reshape, Rule, Transpose


TASKS = ("copy", "reverse")  # adapter k learns TASKS[k]
SEP = 0  # the separator token; symbols are 1 .. symbols
TARGETS = ["blocks.*.wqkv", "blocks.*.w13", "blocks.*.w2", "lm_head"]

# XLA compiles per jitted function, from jax's own event: a new mix of adapter
# ids, or adapters read from files, must not compile a program again.
COMPILES: collections.Counter[str] = collections.Counter()


def _count_compile(event: str, duration_secs: float, **kwargs: str | int) -> None:
    del duration_secs
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[str(kwargs.get("fun_name", ""))] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@dataclasses.dataclass(frozen=True)
class Setup:
    config: Config = Config()
    length: int = 5  # symbols in `x`
    symbols: int = 8
    steps: int = 600
    batch: int = 32
    lr: float = 3e-3
    rank: int = 4
    alpha: float = 16.0
    serve: int = 8  # rows decoded together


TINY = Setup(
    config=Config(vocab=16, dim=32, hidden=48, layers=2, heads=2, kv_heads=1),
    length=4,
    steps=30,
    batch=16,
    lr=1e-2,
)


def task_rows(
    key: PRNGKeyArray, rows: int, setup: Setup
) -> tuple[Int[Array, "B S"], Int[Array, " B"]]:
    """Rows `x SEP y` with `y` `x` copied (even rows) or reversed (odd rows), and
    the adapter of each row (its task)."""
    x = jax.random.randint(key, (rows, setup.length), 1, setup.symbols + 1)
    ids = jnp.arange(rows, dtype=jnp.int32) % len(TASKS)
    y = jnp.where(ids[:, None] == 0, x, x[:, ::-1])
    return jnp.concatenate([x, jnp.full((rows, 1), SEP, x.dtype), y], axis=1), ids


def row_logits(
    model: Llama, tokens: Int[Array, "B S"], ids: Int[Array, " B"]
) -> Float[Array, "B S V"]:
    """Each row through its own adapter (`-1`: the base alone)."""
    return jax.vmap(lambda t, i: adapters.select(model, i)(t))(tokens, ids)


def answer_losses(
    logits: Float[Array, "B S V"], tokens: Int[Array, "B S"], length: int
) -> tuple[Float[Array, " B"], Float[Array, " B"]]:
    """Each row's cross-entropy and token accuracy on its answer `y`."""
    predicted, answer = logits[:, length:-1], tokens[:, length + 1 :]
    ce = optax.softmax_cross_entropy_with_integer_labels(predicted, answer)
    return ce.mean(axis=1), (jnp.argmax(predicted, -1) == answer).mean(axis=1)


def fused_names(c: Config) -> NameMap:
    """PyTorch names for this model with its fused projections kept fused, as
    Phi-3 names them (`qkv_proj`, `gate_up_proj`): PEFT adapts one `nn.Linear`
    weight per module, so a fused `wqkv` is one module, not Llama's three."""
    at, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    return NameMap(
        {
            "embed": "model.embed_tokens.weight",
            "blocks.{i}.attn_norm": "model.layers.{i}.input_layernorm.weight",
            "blocks.{i}.wqkv": Rule(at + "qkv_proj.weight", Transpose()),
            "blocks.{i}.wo": Rule(
                at + "o_proj.weight",
                Reshape((c.heads * c.head_dim, c.dim)),
                Transpose(),
            ),
            "blocks.{i}.mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
            "blocks.{i}.w13": Rule(mlp + "gate_up_proj.weight", Transpose()),
            "blocks.{i}.w2": Rule(mlp + "down_proj.weight", Transpose()),
            "norm": "model.norm.weight",
            "lm_head": Rule("lm_head.weight", Transpose()),
        },
        format="pt",
    )


# Decoding with a KV cache: the block's own computation, on one layer's cache.


def decode_block(
    block: Block,
    x: Float[Array, "S D"],
    cache: tuple[Float[Array, "T K E"], Float[Array, "T K E"]],
    pos: Int[Array, ""],
):
    """`Block.__call__` for `S` new positions from `pos` on: their keys and
    values are written into this layer's cache, and the queries attend to it."""
    c, e = block.config, block.config.head_dim
    s = x.shape[0]
    positions = pos + jnp.arange(s)
    qkv = rms_norm(block.attn_norm, x, c.eps) @ block.wqkv
    q, k, v = jnp.split(qkv, [c.heads * e, (c.heads + c.kv_heads) * e], axis=-1)
    q = rotary(q.reshape(s, c.heads, e), positions, c.theta)
    k = rotary(k.reshape(s, c.kv_heads, e), positions, c.theta)
    k_cache = jax.lax.dynamic_update_slice(cache[0], k, (pos, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(
        cache[1], v.reshape(s, c.kv_heads, e), (pos, 0, 0)
    )
    q = q.reshape(s, c.kv_heads, c.heads // c.kv_heads, e)
    scores = jnp.einsum("sgqe,tge->gqst", q, k_cache) / np.sqrt(e)
    seen = jnp.arange(k_cache.shape[0])[None, :] <= positions[:, None]
    scores = jnp.where(seen, scores, jnp.finfo(scores.dtype).min)
    attn = jnp.einsum("gqst,tge->sgqe", jax.nn.softmax(scores, axis=-1), v_cache)
    x = x + jnp.einsum("she,hed->sd", attn.reshape(s, c.heads, e), block.wo)
    gate, up = jnp.split(rms_norm(block.mlp_norm, x, c.eps) @ block.w13, 2, axis=-1)
    return x + (jax.nn.silu(gate) * up) @ block.w2, (k_cache, v_cache)


def decode(model: Llama, tokens: Int[Array, " S"], cache, pos: Int[Array, ""]):
    """Logits of `S` new tokens at `pos`, and the cache with their rows written
    in place (`eqxscan.buffer`)."""
    c = model.blocks.layers.config
    x, cache = model.blocks(
        model.embed[tokens], eqxscan.buffer(cache), pos=pos, method=decode_block
    )
    head = model.embed.T if model.lm_head is None else model.lm_head
    return rms_norm(model.norm, x, c.eps) @ head, cache


def empty_cache(c: Config, rows: int, length: int):
    shape = (rows, c.layers, length, c.kv_heads, c.head_dim)
    return jnp.zeros(shape), jnp.zeros(shape)


def decode_step(static: Llama):
    """One jitted decode step for a batch, row `r` through adapter `ids[r]`
    (`-1`: the base alone), the caches donated and updated in place. The ids are
    an argument: any mix of adapters runs the same compiled program."""

    def serve_step(arrays, ids, tokens, cache, pos):
        m = eqx.combine(arrays, static)
        rows = lambda i, t, c: decode(adapters.select(m, i), t, c, pos)  # noqa: E731
        return jax.vmap(rows)(ids, tokens, cache)

    return jax.jit(serve_step, donate_argnums=3)


def greedy(
    step, model: Llama, prompts: Int[Array, "B P"], ids: Int[Array, " B"], n: int
):
    """`n` greedy tokens for each row: one prefill, then one token per step."""
    arrays = eqx.filter(model, eqx.is_array)
    cache = empty_cache(model.blocks.layers.config, len(ids), prompts.shape[1] + n)
    logits, cache = step(arrays, ids, prompts, cache, jnp.int32(0))
    out = []
    for j in range(n):
        token = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        out.append(token)
        if j < n - 1:
            pos = jnp.int32(prompts.shape[1] + j)
            logits, cache = step(arrays, ids, token, cache, pos)
    return jnp.concatenate(out, axis=1)


def with_adapters(base: Llama, setup: Setup, key: PRNGKeyArray) -> Llama:
    """`base` with one adapter per task on every target, all set to adapter 0."""
    return adapters.add_lora(
        base,
        TARGETS,
        rank=setup.rank,
        alpha=setup.alpha,
        num_adapters=len(TASKS),
        key=key,
    )


def train(model: Llama, setup: Setup, key: PRNGKeyArray) -> Llama:
    """Adam on the adapters only, every batch mixing both tasks."""
    params, static = eqx.partition(model, adapters.trainable(model))
    optimiser = optax.adam(setup.lr)
    state = optimiser.init(params)

    @jax.jit
    def train_step(params, state, key):
        tokens, ids = task_rows(key, setup.batch, setup)

        def loss(params):
            logits = row_logits(eqx.combine(params, static), tokens, ids)
            return answer_losses(logits, tokens, setup.length)[0].mean()

        grads = jax.grad(loss)(params)
        updates, state = optimiser.update(grads, state)
        return eqx.apply_updates(params, updates), state

    for k in jax.random.split(key, setup.steps):
        params, state = train_step(params, state, k)
    return eqx.combine(params, static)


def main() -> None:
    parser = argparse.ArgumentParser(description="Two LoRA adapters on a tiny Llama.")
    parser.add_argument("--tiny", action="store_true", help="a smoke test")
    parser.add_argument("--steps", type=int, help="training steps")
    args = parser.parse_args()
    setup = TINY if args.tiny else Setup()
    if args.steps is not None:
        setup = dataclasses.replace(setup, steps=args.steps)
    c = setup.config
    keys = iter(jax.random.split(jax.random.key(0), 6))
    base = Llama(c, key=next(keys))
    model = with_adapters(base, setup, next(keys))
    frozen = sum(x.size for x in jax.tree.leaves(eqx.filter(base, eqx.is_array)))
    params = eqx.filter(model, adapters.trainable(model))
    per_adapter = sum(x.size for x in jax.tree.leaves(params)) // len(TASKS)
    print(
        f"Llama dim={c.dim} layers={c.layers} vocab={c.vocab}: {frozen} frozen "
        f"weights, {per_adapter} per adapter (rank {setup.rank}, {TARGETS})"
    )

    # One batch for the losses, the PEFT check and serving: one program each.
    tokens, ids = task_rows(next(keys), setup.serve, setup)

    @eqx.filter_jit
    def evaluate(model, tokens):
        logits = row_logits(model, tokens, ids)
        return logits, *answer_losses(logits, tokens, setup.length)

    before = evaluate(model, tokens)[1]
    start = time.perf_counter()
    model = train(model, setup, next(keys))
    logits, after, _ = evaluate(model, tokens)
    print(f"trained {setup.steps} steps in {time.perf_counter() - start:.1f} s")
    for k, task in enumerate(TASKS):
        b, a = before[ids == k].mean(), after[ids == k].mean()
        print(f"adapter {k} ({task}): answer loss {b:.3f} -> {a:.4f}")

    # PEFT files, one directory per adapter, read into a fresh adapted model.
    names = fused_names(c)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = with_adapters(base, setup, next(keys))
        for k, task in enumerate(TASKS):
            path = os.path.join(tmp, task)
            adapters.save_peft(model, path, names, adapter=k, task_type="CAUSAL_LM")
            fresh = adapters.load_peft(fresh, path, names, adapter=k)
        files = sorted(os.listdir(os.path.join(tmp, TASKS[0])))
    diff = jnp.abs(evaluate(fresh, tokens)[0] - logits).max()
    print(f"saved with save_peft {files}; reloaded: max |logit diff| {diff:.2e}")

    # Serving the reloaded adapters: both in one batch, then the same rows on
    # the base alone, through the same compiled steps.
    prompts, answers = tokens[:, : setup.length + 1], tokens[:, setup.length + 1 :]
    step = decode_step(eqx.filter(fresh, eqx.is_array, inverse=True))
    start = time.perf_counter()
    adapted = greedy(step, fresh, prompts, ids, setup.length)
    plain = greedy(step, fresh, prompts, jnp.full_like(ids, -1), setup.length)
    seconds = time.perf_counter() - start
    # The cached decode against the full forward pass, which has no cache.
    full = evaluate(fresh, jnp.concatenate([prompts, adapted], axis=1))[0]
    same = bool(jnp.all(jnp.argmax(full[:, setup.length : -1], -1) == adapted))
    print(
        f"greedy decoding with KV caches, {len(ids)} rows twice in {seconds:.1f} s; "
        f"tokens = full forward's: {same}"
    )
    for r, k in enumerate(ids.tolist()):
        ours = float(jnp.mean(adapted[r] == answers[r]))
        theirs = float(jnp.mean(plain[r] == answers[r]))
        print(
            f"row {r} adapter {k} ({TASKS[k]:>7}): token accuracy {ours:.2f} "
            f"(base {theirs:.2f})"
        )
    counts = ", ".join(
        f"{name} {COMPILES[f'jit({name})']}"
        for name in ("evaluate", "train_step", "serve_step")
    )
    print(f"compiled programs: {counts}")


if __name__ == "__main__":
    main()
