"""PEFT's LoRA adapter files in and out of eqxscan's LoRAs, checked against a
fixture PEFT itself wrote (tests/data/peft_llama, made by
tests/scripts/make_peft_fixture.py): a tiny Llama with an adapter on its
`down_proj` weights, and the logits of the adapted and the base model."""

import importlib.util
import json
import pathlib
import shutil
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import eqxscan
from eqxscan.adapters import load_peft, LoRA, save_peft


ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "peft_llama"
spec = importlib.util.spec_from_file_location(
    "llama_example", ROOT / "examples" / "llama.py"
)
assert spec is not None and spec.loader is not None
llama = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llama)

REFERENCE = np.load(DATA / "reference.npz")
FILE = load_file(str(DATA / "adapter_model.safetensors"))
PEFT_CONFIG = json.loads((DATA / "adapter_config.json").read_text())
PREFIX = "base_model.model.model.layers.{i}."
DOWN = PREFIX + "mlp.down_proj.lora_{f}.weight"


def _lora(base, rank, alpha, orientation, num_adapters, key, *, layers=()):
    """A LoRA on `base` ([*layers, p, q]), `a` random and `b` zero, base alone."""
    p, q = base.shape[-2:]
    inner, outer = (p, q) if orientation == "x@W" else (q, p)
    k_shape = (*layers, num_adapters)
    a_shape = (*k_shape, inner, rank) if orientation == "x@W" else (*k_shape, rank, q)
    b_shape = (*k_shape, rank, outer) if orientation == "x@W" else (*k_shape, p, rank)
    del inner, outer
    return LoRA(
        base=base,
        a=jax.random.normal(key, a_shape),
        b=jnp.zeros(b_shape),
        active=jnp.full(layers, -1, jnp.int32),
        alpha=alpha,
        rank=rank,
        orientation=orientation,
    )


@pytest.fixture(scope="module")
def base():
    """The fixture's base model, loaded through examples/llama.py's torch names."""
    hf = types.SimpleNamespace(**json.loads((DATA / "config.json").read_text()))
    config = llama.Config.from_hf(hf)
    like = eqx.filter_eval_shape(llama.Llama, config, key=jax.random.key(0))
    names = llama.torch_names(config)
    model = eqxscan.load_safetensors(DATA, like, names=names, dtype=jnp.float32)
    return config, names, model


def _adapted(model, config, *, rank=4, alpha=8.0, num_adapters=1, field="w2"):
    """`model` with a LoRA on `blocks.{i}.<field>` of every layer."""
    key = jax.random.key(1)
    where = lambda m: getattr(m.blocks.layers, field)  # noqa: E731
    lora = _lora(
        where(model), rank, alpha, "x@W", num_adapters, key, layers=(config.layers,)
    )
    return eqx.tree_at(where, model, lora)


def _activate(model, k):
    w2 = model.blocks.layers.w2
    return eqx.tree_at(
        lambda m: m.blocks.layers.w2.active, model, jnp.full_like(w2.active, k)
    )


@eqx.filter_jit
def _logits(model, tokens):
    return jax.vmap(model)(tokens)


def _close(ours, reference):
    # 1e-5 relative to the logits' scale (near-zero logits have no relative digits).
    scale = float(np.max(np.abs(reference)))
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * scale)


def test_fixture_logits(base):
    config, names, model = base
    adapted = load_peft(_adapted(model, config), DATA, names)
    tokens = jnp.asarray(REFERENCE["tokens"])
    _close(_logits(_activate(adapted, 0), tokens), REFERENCE["logits"])
    _close(_logits(_activate(adapted, -1), tokens), REFERENCE["base_logits"])
    # The loop over the same weights, and the base model without LoRAs.
    looped = eqx.tree_at(
        lambda m: m.blocks, adapted, adapted.blocks.with_options(mode="loop")
    )
    _close(_logits(_activate(looped, 0), tokens), REFERENCE["logits"])
    _close(_logits(model, tokens), REFERENCE["base_logits"])


def test_factors_placed_by_hand(base):
    # PEFT's change to down_proj.weight [out, in] is scaling * B @ A; eqxscan's
    # w2 is its transpose ([in, out]), so a @ b must be (B @ A).T.
    config, names, model = base
    loaded = load_peft(_adapted(model, config, num_adapters=3), DATA, names, adapter=1)
    lora = loaded.blocks.layers.w2
    before = _adapted(model, config, num_adapters=3).blocks.layers.w2
    for i in range(config.layers):
        a_file, b_file = FILE[DOWN.format(i=i, f="A")], FILE[DOWN.format(i=i, f="B")]
        np.testing.assert_array_equal(lora.a[i, 1], a_file.T)
        np.testing.assert_array_equal(lora.b[i, 1], b_file.T)
        np.testing.assert_allclose(
            lora.a[i, 1] @ lora.b[i, 1], (b_file @ a_file).T, rtol=1e-6, atol=1e-6
        )
    # The other adapters, the base and `active` are left as they were.
    for k in (0, 2):
        np.testing.assert_array_equal(lora.a[:, k], before.a[:, k])
        np.testing.assert_array_equal(lora.b[:, k], before.b[:, k])
    np.testing.assert_array_equal(lora.base, model.blocks.layers.w2)
    np.testing.assert_array_equal(lora.active, before.active)
    assert lora.scaling == PEFT_CONFIG["lora_alpha"] / PEFT_CONFIG["r"]


def test_round_trip(base, tmp_path):
    config, names, model = base
    loaded = load_peft(_adapted(model, config), DATA, names)
    written = save_peft(loaded, tmp_path, names, task_type="CAUSAL_LM")
    assert written == [
        str(tmp_path / "adapter_model.safetensors"),
        str(tmp_path / "adapter_config.json"),
    ]
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(FILE)
    for name, value in FILE.items():
        assert saved[name].shape == value.shape and saved[name].dtype == value.dtype
        np.testing.assert_array_equal(saved[name], value)
    ours = json.loads((tmp_path / "adapter_config.json").read_text())
    keys = [
        "peft_type",
        "r",
        "lora_alpha",
        "target_modules",
        "lora_dropout",
        "bias",
        "fan_in_fan_out",
        "task_type",
        "use_dora",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
    ]
    assert {k: ours[k] for k in keys} == {k: PEFT_CONFIG[k] for k in keys}
    # And back: the same factors.
    again = load_peft(_adapted(model, config), tmp_path, names)
    for field in ("a", "b"):
        np.testing.assert_array_equal(
            getattr(again.blocks.layers.w2, field),
            getattr(loaded.blocks.layers.w2, field),
        )
    # A second save replaces the files whole, and leaves no temporary files.
    save_peft(loaded, tmp_path, names, base_model_name_or_path="tiny-llama")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config_again = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config_again["base_model_name_or_path"] == "tiny-llama"
