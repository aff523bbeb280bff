"""Hugging Face's weights in and out of examples/llama.py, checked against
Hugging Face's own `FlaxLlamaForCausalLM` (a tiny random model, built on the
CPU, nothing downloaded): logits, greedy tokens, and files its loaders read."""

import contextlib
import dataclasses
import importlib.util
import pathlib
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan


ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "llama_example", ROOT / "examples" / "llama.py"
)
assert spec is not None and spec.loader is not None
llama = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llama)


@contextlib.contextmanager
def _lenient():
    # Hugging Face's code relies on NumPy's broadcasting and type promotion,
    # which conftest.py makes errors for eqxscan's.
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' deprecation notices
            yield


TOKENS = jnp.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38], jnp.int32)


@pytest.fixture(scope="module")
def hf():
    with _lenient():
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query: 2 query heads per key/value head
            max_position_embeddings=64,
            initializer_range=0.2,  # logits far apart: no near-ties for greedy
        )
        with _lenient():
            model = transformers.FlaxLlamaForCausalLM(config, seed=0)
    jitted = jax.jit(
        lambda params, tokens: model(tokens[None], params=params).logits[0]
    )

    def forward(params, tokens):
        with _lenient():
            return jitted(params, tokens)

    return transformers, config, model, forward


@pytest.fixture(scope="module")
def loaded(hf, tmp_path_factory):
    """eqxscan's model, from the file Hugging Face itself writes (Flax names)."""
    transformers, hf_config, model, _ = hf
    directory = tmp_path_factory.mktemp("hf")
    with _lenient():
        model.save_pretrained(directory, safe_serialization=True)
    config = llama.Config.from_hf(hf_config)
    like = eqx.filter_eval_shape(llama.Llama, config, key=jax.random.key(0))
    ours = eqxscan.load_safetensors(directory, like, names=llama.flax_names(config))
    return config, ours, directory


def test_logits_and_greedy_tokens_match_hugging_face(hf, loaded):
    _, _, model, forward = hf
    config, ours, _ = loaded
    theirs = np.asarray(forward(model.params, TOKENS))
    logits = np.asarray(eqx.filter_jit(lambda m, t: m(t))(ours, TOKENS))
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, theirs, rtol=0, atol=1e-4)
    assert np.abs(theirs).max() > 1.0  # not a trivial comparison
    generated = llama.greedy(ours, TOKENS[:4], 6)
    # Causal: Hugging Face's argmax at each position, on the generated sequence,
    # is its greedy choice after that prefix.
    hf_choice = np.argmax(np.asarray(forward(model.params, generated)), axis=-1)
    np.testing.assert_array_equal(hf_choice[3:-1], np.asarray(generated[4:]))
    assert len(set(np.asarray(generated[4:]).tolist())) > 1


def test_exported_flax_names_load_in_hugging_face_with_identical_logits(
    hf, loaded, tmp_path
):
    transformers, hf_config, model, forward = hf
    config, ours, _ = loaded
    eqxscan.save_safetensors(tmp_path, ours, names=llama.flax_names(config))
    hf_config.save_pretrained(tmp_path)
    with _lenient():
        _, params = transformers.FlaxLlamaForCausalLM.from_pretrained(
            tmp_path, _do_init=False
        )
    original = jax.tree_util.tree_leaves_with_path(model.params)
    assert [p for p, _ in original] == [
        p for p, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    for (path, a), b in zip(original, jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_array_equal(
        forward(params, TOKENS), forward(model.params, TOKENS)
    )


def test_exported_torch_names_are_what_hugging_face_converts(hf, loaded, tmp_path):
    # `from_pretrained` on a file with metadata format "pt" converts its PyTorch
    # names with this function (no PyTorch needed): the same parameters come back.
    transformers, _, model, forward = hf
    from transformers.modeling_flax_pytorch_utils import (
        convert_pytorch_state_dict_to_flax,
    )

    config, ours, _ = loaded
    path = tmp_path / "model.safetensors"
    eqxscan.save_safetensors(path, ours, names=llama.torch_names(config))
    import safetensors

    with safetensors.safe_open(path, framework="np") as f:
        assert f.metadata()["format"] == "pt"
    state = eqxscan.read_safetensors(path)
    assert state["model.layers.2.self_attn.k_proj.weight"].shape == (
        32,
        64,
    )  # [out, in]
    assert state["model.layers.2.self_attn.o_proj.weight"].shape == (64, 64)
    with _lenient():
        params = convert_pytorch_state_dict_to_flax(
            {k: jnp.asarray(v) for k, v in state.items()}, model
        )
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        model.params
    )
    for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(model.params)
    ):
        np.testing.assert_array_equal(a, b)
    # And back: the PyTorch names load into eqxscan's model unchanged.
    like = eqx.filter_eval_shape(llama.Llama, config, key=jax.random.key(1))
    again = eqxscan.load_safetensors(path, like, names=llama.torch_names(config))
    assert eqx.tree_equal(again, ours)


def test_a_checkpoint_of_another_configuration_is_named_by_layer(hf, loaded):
    _, hf_config, _, _ = hf
    config, _, directory = loaded
    shallow = dataclasses.replace(config, layers=2)
    like = eqx.filter_eval_shape(llama.Llama, shallow, key=jax.random.key(0))
    with pytest.raises(ValueError) as e:
        eqxscan.load_safetensors(directory, like, names=llama.flax_names(shallow))
    first = str(e.value).splitlines()[0]  # one line, not a name per array
    assert first.endswith(f"the file has {config.layers} layers, the model 2."), first
    assert "unused" not in first
    mha = dataclasses.replace(config, kv_heads=4)  # no grouped-query heads
    like = eqx.filter_eval_shape(llama.Llama, mha, key=jax.random.key(0))
    with pytest.raises(ValueError) as e:
        eqxscan.load_safetensors(directory, like, names=llama.flax_names(mha))
    assert "(6 mis-shaped)" in str(e.value)
    assert (
        "'model.layers.0.self_attn.k_proj.kernel' (layer 0) is float32[64, 32], "
        "'blocks.0.wqkv' needs float32[64, 64]"
    ) in str(e.value)


def test_tied_embeddings_and_rotary_buffers_exist_on_their_side_only(loaded):
    config, ours, _ = loaded
    state = llama.torch_names(config).export(ours)
    for i in range(config.layers):  # as older Llama checkpoints store them
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(
            8, np.float32
        )
    tied = dataclasses.replace(config, tie_embeddings=True)
    names = llama.torch_names(tied)
    like = eqx.filter_eval_shape(llama.Llama, tied, key=jax.random.key(2))
    model = names.load(like, state)
    assert model.lm_head is None
    np.testing.assert_array_equal(model.embed, ours.embed)
    mine, theirs = (eqxscan.to_state_dict(m.blocks) for m in (model, ours))
    assert mine.keys() == theirs.keys()
    for name in mine:
        np.testing.assert_array_equal(mine[name], theirs[name])
    assert "lm_head.weight" not in names.export(model)
    with pytest.raises(ValueError, match="unused 'lm_head.weight'"):
        llama.torch_names(config).load(like, {**state, "lm_head.weight": 0})


def test_configurations_the_example_does_not_implement_are_refused(hf):
    # Each loaded without an error and gave other logits than Hugging Face's
    # (FlaxMistralForCausalLM with a sliding window differs from position 5 on).
    transformers, hf_config, _, _ = hf
    kw = hf_config.to_dict()
    for cls, change, named in [
        (transformers.MistralConfig, {"sliding_window": 4}, "sliding_window=4"),
        (transformers.LlamaConfig, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (transformers.LlamaConfig, {"head_dim": 8}, "head_dim=8"),
        (
            transformers.LlamaConfig,
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            "rope_scaling=",
        ),
    ]:
        with _lenient():
            config = cls(**{**kw, **change})
        with pytest.raises(ValueError, match=f"does not implement {named}"):
            llama.Config.from_hf(config)
    llama.Config.from_hf(transformers.MistralConfig(**{**kw, "sliding_window": None}))
