"""A Llama-style decoder written with eqxscan, and Hugging Face's weights in and
out of it through two name maps (PyTorch-convention names and Flax names).

The blocks (RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP) are
one `eqxscan.Stacked`: every array has a leading layer axis, and the forward
pass is one scan. Its layout is eqxscan's own: `[in, out]` matrices, the query,
key and value projections fused in one `wqkv`, the gate and up projections in
one `w13`, the output projection by head (`[H, head_dim, D]`). The name maps
say how Hugging Face names and shapes the same weights.

With `transformers<5` installed, the script builds a tiny random
`FlaxLlamaForCausalLM` (no download), loads its weights, compares logits and
greedy tokens, then exports eqxscan's weights that Hugging Face loads back:

    python examples/llama.py
"""

import dataclasses
import os
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqxscan
from eqxscan.checkpoint import NameMap, Reshape, Rule, Split, Transpose


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    dim: int = 64
    hidden: int = 96
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    eps: float = 1e-6
    theta: float = 10000.0
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @classmethod
    def from_hf(cls, hf) -> "Config":
        """From a `transformers.LlamaConfig` (or a `MistralConfig` without a
        sliding window). A setting this model does not implement is refused,
        rather than giving other logits than Hugging Face's."""
        window = getattr(hf, "sliding_window", None)
        scaling = getattr(hf, "rope_scaling", None)
        unsupported = {
            "hidden_act": (act := getattr(hf, "hidden_act", "silu"), act != "silu"),
            "rope_scaling": (scaling, scaling is not None),
            "sliding_window": (window, window and window < hf.max_position_embeddings),
            "head_dim": (
                getattr(hf, "head_dim", None),
                getattr(hf, "head_dim", None)
                not in (None, hf.hidden_size // hf.num_attention_heads),
            ),
        }
        if bad := [f"{k}={v!r}" for k, (v, no) in unsupported.items() if no]:
            raise ValueError(
                f"Config.from_hf: this Llama does not implement {', '.join(bad)}."
                "\nHint: it has SiLU MLPs, rotary embeddings without scaling, "
                "full causal attention and head_dim = hidden_size / heads."
            )
        return cls(
            vocab=hf.vocab_size,
            dim=hf.hidden_size,
            hidden=hf.intermediate_size,
            layers=hf.num_hidden_layers,
            heads=hf.num_attention_heads,
            kv_heads=hf.num_key_value_heads,
            eps=hf.rms_norm_eps,
            theta=getattr(hf, "rope_theta", 10000.0),
            tie_embeddings=hf.tie_word_embeddings,
        )


def rms_norm(weight: Float[Array, " D"], x: Float[Array, "S D"], eps: float):
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    # Broadcast explicitly: also runs with jax_numpy_rank_promotion="raise".
    return jnp.broadcast_to(weight, x.shape) * (x32 / jnp.sqrt(var + eps)).astype(
        x.dtype
    )


def rotary(x: Float[Array, "S N E"], positions: Int[Array, " S"], theta: float):
    """Rotary embedding, the "rotate half" form that Hugging Face's Llama uses."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (
        jnp.arange(0, 2 * half, 2, dtype=jnp.float32) / (2 * half)
    )
    angles = positions[:, None].astype(jnp.float32) * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


class Block(eqx.Module):
    attn_norm: Float[Array, " D"]
    wqkv: Float[Array, "D QKV"]  # [D, (H + 2K) * E]
    wo: Float[Array, "H E D"]
    mlp_norm: Float[Array, " D"]
    w13: Float[Array, "D F2"]  # gate and up, [D, 2F]
    w2: Float[Array, "F D"]
    config: Config = eqx.field(static=True)

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        c, e = config, config.head_dim
        k1, k2, k3, k4 = jax.random.split(key, 4)
        init = jax.nn.initializers.normal(0.02)
        self.attn_norm = jnp.ones(c.dim)
        self.wqkv = init(k1, (c.dim, (c.heads + 2 * c.kv_heads) * e))
        self.wo = init(k2, (c.heads, e, c.dim))
        self.mlp_norm = jnp.ones(c.dim)
        self.w13 = init(k3, (c.dim, 2 * c.hidden))
        self.w2 = init(k4, (c.hidden, c.dim))
        self.config = config

    def __call__(self, x: Float[Array, "S D"], positions: Int[Array, " S"]):
        c, e = self.config, self.config.head_dim
        s = x.shape[0]
        qkv = rms_norm(self.attn_norm, x, c.eps) @ self.wqkv
        q, k, v = jnp.split(qkv, [c.heads * e, (c.heads + c.kv_heads) * e], axis=-1)
        q = rotary(q.reshape(s, c.heads, e), positions, c.theta)
        k = rotary(k.reshape(s, c.kv_heads, e), positions, c.theta)
        v = v.reshape(s, c.kv_heads, e)
        # Grouped-query heads: query head h reads key/value head h // groups.
        groups = c.heads // c.kv_heads
        q = q.reshape(s, c.kv_heads, groups, e)
        scores = jnp.einsum("sgqe,tge->gqst", q, k) / np.sqrt(e)
        causal = jnp.tril(jnp.ones((1, 1, s, s), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jnp.einsum("gqst,tge->sgqe", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("she,hed->sd", attn.reshape(s, c.heads, e), self.wo)
        gate, up = jnp.split(rms_norm(self.mlp_norm, x, c.eps) @ self.w13, 2, axis=-1)
        return x + (jax.nn.silu(gate) * up) @ self.w2


class Llama(eqx.Module):
    embed: Float[Array, "V D"]
    blocks: eqxscan.Stacked[Block]
    norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = jax.random.normal(k1, (config.vocab, config.dim)) * 0.02
        self.blocks = eqxscan.Stacked(
            lambda k: Block(config, key=k), config.layers, key=k2
        )
        self.norm = jnp.ones(config.dim)
        self.lm_head = (
            None
            if config.tie_embeddings
            else jax.random.normal(k3, (config.dim, config.vocab)) * 0.02
        )

    def __call__(self, tokens: Int[Array, " S"]) -> Float[Array, "S V"]:
        config = self.blocks.layers.config
        x = self.embed[tokens]
        x = self.blocks(x, jnp.arange(tokens.shape[0]))
        x = rms_norm(self.norm, x, config.eps)
        head = self.embed.T if self.lm_head is None else self.lm_head
        return (x @ head).astype(jnp.float32)


def greedy(model: Llama, prompt: Int[Array, " P"], steps: int) -> Int[Array, " T"]:
    """Greedy decoding by recomputing the prefix (short and simple: a KV cache is
    docs/decoding.md's subject)."""
    tokens = jnp.concatenate([prompt, jnp.zeros(steps, prompt.dtype)])
    forward = eqx.filter_jit(lambda m, t: m(t))
    for n in range(len(prompt), len(prompt) + steps):
        logits = forward(model, tokens)  # causal: positions past n do not matter
        tokens = tokens.at[n].set(jnp.argmax(logits[n - 1]).astype(tokens.dtype))
    return tokens


# The name maps: all the mapping code a user writes for Llama.


def torch_names(c: Config) -> NameMap:
    """Hugging Face's PyTorch names (`model.safetensors` of a Llama checkpoint):
    `nn.Linear` weights are `[out, in]`, q/k/v and gate/up are separate."""
    e, at, mlp = c.head_dim, "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    return NameMap(
        {
            "embed": "model.embed_tokens.weight",
            "blocks.{i}.attn_norm": "model.layers.{i}.input_layernorm.weight",
            "blocks.{i}.wqkv": Rule(
                [at + "q_proj.weight", at + "k_proj.weight", at + "v_proj.weight"],
                Transpose(),
                Split(0, (c.heads * e, c.kv_heads * e, c.kv_heads * e)),
            ),
            "blocks.{i}.wo": Rule(
                at + "o_proj.weight", Reshape((c.heads * e, c.dim)), Transpose()
            ),
            "blocks.{i}.mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
            "blocks.{i}.w13": Rule(
                [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
                Transpose(),
                Split(0, (c.hidden, c.hidden)),
            ),
            "blocks.{i}.w2": Rule(mlp + "down_proj.weight", Transpose()),
            "norm": "model.norm.weight",
            "lm_head": Rule("lm_head.weight", Transpose()),
        },
        # Older checkpoints store the rotary frequencies; a tied head, a copy.
        ignore=[at + "rotary_emb.inv_freq"]
        + (["lm_head.weight"] if c.tie_embeddings else []),
        format="pt",
    )


def flax_names(c: Config) -> NameMap:
    """Hugging Face's Flax names (`FlaxLlamaForCausalLM.params`, flattened with
    dots): `Dense` kernels are `[in, out]` already."""
    e, at, mlp = c.head_dim, "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    return NameMap(
        {
            "embed": "model.embed_tokens.embedding",
            "blocks.{i}.attn_norm": "model.layers.{i}.input_layernorm.weight",
            "blocks.{i}.wqkv": Rule(
                [at + "q_proj.kernel", at + "k_proj.kernel", at + "v_proj.kernel"],
                Split(1, (c.heads * e, c.kv_heads * e, c.kv_heads * e)),
            ),
            "blocks.{i}.wo": Rule(at + "o_proj.kernel", Reshape((c.heads * e, c.dim))),
            "blocks.{i}.mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
            "blocks.{i}.w13": Rule(
                [mlp + "gate_proj.kernel", mlp + "up_proj.kernel"],
                Split(1, (c.hidden, c.hidden)),
            ),
            "blocks.{i}.w2": mlp + "down_proj.kernel",
            "norm": "model.norm.weight",
            "lm_head": "lm_head.kernel",
        },
        format="flax",
    )


def flatten(params, prefix: str = "") -> dict[str, np.ndarray]:
    """A Flax parameter tree as `{"model.layers.0.mlp.up_proj.kernel": array}`."""
    out = {}
    for name, value in params.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = np.asarray(value)
    return out


def main() -> None:
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    hf_config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    hf = FlaxLlamaForCausalLM(hf_config, seed=0)
    config = Config.from_hf(hf_config)
    like = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
    tokens = jnp.array([3, 14, 15, 92, 65, 35, 89, 79], jnp.int32)

    with tempfile.TemporaryDirectory() as tmp:
        # In: Hugging Face's own file (Flax names), then through the Flax map.
        hf.save_pretrained(tmp, safe_serialization=True)
        model = eqxscan.load_safetensors(tmp, like, names=flax_names(config))
        ours = model(tokens)
        theirs = np.asarray(hf(tokens[None]).logits[0])
        print(f"logits vs Hugging Face: max |diff| {np.abs(ours - theirs).max():.2e}")
        generated = greedy(model, tokens[:4], 6)
        hf_argmax = np.argmax(np.asarray(hf(generated[None]).logits[0]), axis=-1)
        same = bool(np.all(hf_argmax[3:-1] == np.asarray(generated[4:])))
        print(f"greedy tokens {np.asarray(generated).tolist()}, same as HF's: {same}")

        # Out: PyTorch names, which Hugging Face's loader converts itself.
        out = os.path.join(tmp, "export")
        eqxscan.save_safetensors(out, model, names=torch_names(config))
        hf_config.save_pretrained(out)
        back = FlaxLlamaForCausalLM.from_pretrained(out)
        again = np.asarray(back(tokens[None]).logits[0])
        diff = np.abs(again - theirs).max()
        print(f"exported, loaded by Hugging Face: max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
