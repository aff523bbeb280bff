"""examples/llama.py's tiny Llama with quantized weights: int8, 4-bit and fp8
read straight from Hugging Face's safetensors file, one layer at a time, and
compared with the float model.

For each kind the script quantizes the blocks' matrices (`wqkv`, `w13`, `w2`)
while reading the file through the Flax name map (`eqxscan.quant.quantize_file`),
prints the worst per-layer weight error (`eqxscan.quant.report`), the logits'
largest difference from the float model's, and how many greedy tokens agree
with the float model's. The int8 model is saved and loaded back
(`quant.save`/`quant.load`) with the same logits. Needs `transformers<5` (a tiny
random `FlaxLlamaForCausalLM`, no download):

    python examples/quantized_llama.py
"""

import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from llama import Config, flax_names, greedy, Llama

from eqxscan import load_safetensors, quant


TARGETS = ["blocks.*.wqkv", "blocks.*.w13", "blocks.*.w2"]
PROMPTS = [[3, 14, 15, 92], [65, 35, 89, 79], [1, 2, 3, 4], [100, 7, 42, 9]]
STEPS = 8


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
    names = flax_names(config)
    prompts = jnp.array(PROMPTS, jnp.int32)
    logits = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model = load_safetensors(tmp, like, names=names)
        reference = np.asarray(logits(model, prompts))
        scale = np.abs(reference).max()
        tokens = np.stack([np.asarray(greedy(model, p, STEPS)) for p in prompts])
        print(f"float32 logits: max |logit| {scale:.2f}")
        print("kind  weights KiB  worst rel. error  max |logit diff|  greedy agree")
        floats = _bytes(model)
        for kind in ("int8", "int4", "fp8"):
            q = quant.quantize_file(
                tmp, like, targets=TARGETS, name_map=names, kind=kind, group_size=32
            )
            worst = quant.report(model, q).worst()
            diff = np.abs(np.asarray(logits(q, prompts)) - reference).max()
            ours = np.stack([np.asarray(greedy(q, p, STEPS)) for p in prompts])
            agree = np.mean(ours[:, len(PROMPTS[0]) :] == tokens[:, len(PROMPTS[0]) :])
            print(
                f"{kind:5} {_bytes(q) / 1024:8.1f}/{floats / 1024:.1f} "
                f"{worst.relative:10.2e} ({worst.name} {list(worst.layer)}) "
                f"{diff:10.2e} {agree:12.3f}"
            )
            if kind == "int8":
                quant.save(f"{tmp}/int8", q)
                back = quant.load(f"{tmp}/int8", q)
                again = np.abs(np.asarray(logits(back, prompts)) - logits(q, prompts))
                print(f"int8 saved and loaded: max |logit diff| {again.max():.2e}")


def _bytes(model: eqx.Module) -> int:
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    return sum(x.nbytes for x in leaves)


if __name__ == "__main__":
    main()
