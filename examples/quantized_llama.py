"""examples/llama.py's tiny Llama with quantized weights: int8, 4-bit and fp8
read straight from Hugging Face's safetensors file, one layer at a time, and
compared with the float model.

For each kind the script quantizes the blocks' matrices (`wqkv`, `w13`, `w2`)
while reading the file through the Flax name map (`eqxscan.quant.quantize_file`),
prints the worst per-layer weight error (`eqxscan.quant.report`), the logits'
largest difference from the float model's, and how many greedy tokens agree
with the float model's. The int8 model is saved and loaded back
(`quant.save`/`quant.load`) with the same logits. The weights are a tiny random
`FlaxLlamaForCausalLM`'s (`transformers<5`, no download), or without
transformers a random eqxscan Llama's of the same spread written with the same
name map (the output says which):

    python examples/quantized_llama.py
"""

import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int
from llama import Config, flax_names, Llama

from eqxscan import load_safetensors, quant, save_safetensors


TARGETS = ["blocks.*.wqkv", "blocks.*.w13", "blocks.*.w2"]
PROMPTS = [[3, 14, 15, 92], [65, 35, 89, 79], [1, 2, 3, 4], [100, 7, 42, 9]]
STEPS = 8


def _write_weights(path: str) -> tuple[Config, str]:
    """The float model's safetensors file under Flax names, and where it came from."""
    try:
        from transformers import FlaxLlamaForCausalLM, LlamaConfig
    except ImportError:
        config = Config()
        model = Llama(config, key=jax.random.key(0))
        # Spread 0.2 (not Llama's 0.02), as the Hugging Face model's
        # initializer_range below: logits far enough apart for greedy tokens.
        model = jax.tree.map(lambda x: x * 10 if x.ndim > 1 else x, model)
        save_safetensors(path, model, names=flax_names(config))
        return config, "random eqxscan weights (transformers not importable)"
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
    FlaxLlamaForCausalLM(hf_config, seed=0).save_pretrained(
        path, safe_serialization=True
    )
    return Config.from_hf(hf_config), "a random FlaxLlamaForCausalLM's file"


@eqx.filter_jit
def _logits(model: Llama, tokens: Int[Array, "B T"]) -> Array:
    return jax.vmap(model)(tokens)


def _greedy(
    model: Llama, prompts: Int[Array, "B P"], steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """examples/llama.py's greedy decoding (the prefix recomputed at each step),
    every prompt at once and one compiled program per model; with the prompts'
    logits from its first step (the causal mask keeps the padding after them
    out of them)."""
    length = prompts.shape[1]
    tokens = jnp.pad(prompts, ((0, 0), (0, steps)))
    first = None
    for n in range(length, length + steps):
        logits = _logits(model, tokens)
        first = logits[:, :length] if first is None else first
        tokens = tokens.at[:, n].set(jnp.argmax(logits[:, n - 1], -1))
    return np.asarray(tokens), np.asarray(first)


def main() -> None:
    prompts = jnp.array(PROMPTS, jnp.int32)
    with tempfile.TemporaryDirectory() as tmp:
        config, source = _write_weights(tmp)
        print(f"weights: {source}")
        like = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
        names = flax_names(config)
        model = load_safetensors(tmp, like, names=names)
        tokens, reference = _greedy(model, prompts, STEPS)
        scale = np.abs(reference).max()
        print(f"float32 logits: max |logit| {scale:.2f}")
        print("kind  weights KiB  worst rel. error  max |logit diff|  greedy agree")
        floats = _bytes(model)
        for kind in ("int8", "int4", "fp8"):
            q = quant.quantize_file(
                tmp, like, targets=TARGETS, name_map=names, kind=kind, group_size=32
            )
            worst = quant.report(model, q).worst()
            ours, logits = _greedy(q, prompts, STEPS)
            diff = np.abs(logits - reference).max()
            agree = np.mean(
                ours[:, prompts.shape[1] :] == tokens[:, prompts.shape[1] :]
            )
            print(
                f"{kind:5} {_bytes(q) / 1024:8.1f}/{floats / 1024:.1f} "
                f"{worst.relative:10.2e} ({worst.name} {list(worst.layer)}) "
                f"{diff:10.2e} {agree:12.3f}"
            )
            if kind == "int8":
                quant.save(f"{tmp}/int8", q)
                back = quant.load(f"{tmp}/int8", q)
                # On the decoded tokens, q's program: logits at every position.
                decoded = jnp.asarray(ours)
                again = np.abs(np.asarray(_logits(back, decoded) - _logits(q, decoded)))
                print(f"int8 saved and loaded: max |logit diff| {again.max():.2e}")


def _bytes(model: eqx.Module) -> int:
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    return sum(x.nbytes for x in leaves)


if __name__ == "__main__":
    main()
