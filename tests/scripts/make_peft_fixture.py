"""Make `tests/data/peft_llama/`: a tiny random Hugging Face Llama, a PEFT LoRA
adapter on its `down_proj` weights, and the logits of both for one token batch.

The files are committed; this script says how they were made. It needs PyTorch,
`transformers<5` and `peft` (not eqxscan's dependencies), and downloads
nothing. Made with torch 2.13.0+cpu, transformers 4.57.6, peft 0.21.2,
safetensors 0.8.0, numpy 2.4.6 (Python 3.11):

    python tests/scripts/make_peft_fixture.py [out_dir]

Writes `model.safetensors` and `config.json` (the base model, as
`save_pretrained` writes them; its weights are bfloat16 values, computed with in
float32), `adapter_model.safetensors` and
`adapter_config.json` (PEFT's `save_pretrained`), and `reference.npz`:
`tokens` [B, S], `logits` [B, S, V] of the adapted model and `base_logits` of
the base model alone, all float32.
"""

import copy
import pathlib
import random
import sys

import numpy as np
import torch
from peft import get_peft_model, LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM


OUT = pathlib.Path(__file__).resolve().parents[1] / "data" / "peft_llama"
SEED = 0


def main(out: pathlib.Path) -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    # examples/llama.py's Config: vocab 128, dim 64, hidden 96, 3 layers, 4
    # heads, 2 key/value heads.
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.2,  # logits far apart, so the adapter's change shows
        tie_word_embeddings=False,
    )
    # The base weights are rounded to bfloat16 and saved so (the file is half
    # the size, under the fixture's 300 KB); the model computes in float32 on
    # exactly those values, as eqxscan's does after loading them as float32.
    # Only the parameters: `.to(torch.bfloat16)` on the model would round the
    # rotary frequencies too.
    base = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in base.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(base).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)

    tokens = torch.randint(0, config.vocab_size, (2, 10), generator=None)
    with torch.no_grad():
        base_logits = base(tokens).logits.numpy().copy()

    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["down_proj"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora).eval()
    # PEFT starts lora_B at zero, which would leave the logits unchanged.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.5 * torch.randn_like(param))
        logits = model(tokens).logits.numpy().copy()
    model.save_pretrained(out, safe_serialization=True)
    assert not np.allclose(logits, base_logits, atol=1e-3), "no change from the adapter"

    np.savez(
        out / "reference.npz",
        tokens=tokens.numpy().astype(np.int32),
        logits=logits.astype(np.float32),
        base_logits=base_logits.astype(np.float32),
    )
    # PEFT's model card and the generation defaults: not needed.
    for extra in ("README.md", "generation_config.json"):
        (out / extra).unlink(missing_ok=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
