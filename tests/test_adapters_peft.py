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
from eqxscan import adapters
from eqxscan.adapters import load_peft, save_peft
from eqxscan.checkpoint import NameMap, Reshape, Rule, Transpose


ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "peft_llama"
WEIGHTS = "adapter_model.safetensors"
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


@pytest.fixture(scope="module")
def base():
    """The fixture's base model, loaded through examples/llama.py's torch names."""
    hf = types.SimpleNamespace(**json.loads((DATA / "config.json").read_text()))
    config = llama.Config.from_hf(hf)
    like = eqx.filter_eval_shape(llama.Llama, config, key=jax.random.key(0))
    names = llama.torch_names(config)
    model = eqxscan.load_safetensors(DATA, like, names=names, dtype=jnp.float32)
    return config, names, model


def _adapted(model, targets="blocks.*.w2", **kwargs):
    """`model` with LoRAs on `targets` (PEFT's initialisation: `b` zero)."""
    kwargs = {"rank": 4, "alpha": 8.0, **kwargs}
    return adapters.add_lora(model, targets, key=jax.random.key(1), **kwargs)


@eqx.filter_jit
def _logits(model, tokens):
    return jax.vmap(model)(tokens)


def _close(ours, reference):
    # 1e-5 relative to the logits' scale (near-zero logits have no relative digits).
    scale = float(np.max(np.abs(reference)))
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * scale)


def test_fixture_logits(base):
    config, names, model = base
    adapted = load_peft(_adapted(model), DATA, names)
    tokens = jnp.asarray(REFERENCE["tokens"])
    # The loop over the same weights, and the base model without LoRAs.
    looped = eqx.tree_at(
        lambda m: m.blocks, adapted, adapted.blocks.with_options(mode="loop")
    )
    runs = [adapters.select(adapted, 0), adapters.select(adapted, -1)]
    runs += [adapters.select(looped, 0), model]
    # One program for the four.
    got = eqx.filter_jit(lambda ms: [jax.vmap(m)(tokens) for m in ms])(runs)
    for ours, name in zip(got, ["logits", "base_logits", "logits", "base_logits"]):
        _close(ours, REFERENCE[name])


def test_factors_placed_by_hand(base):
    # PEFT's change to down_proj.weight [out, in] is scaling * B @ A; eqxscan's
    # w2 is its transpose ([in, out]), so a @ b must be (B @ A).T.
    config, names, model = base
    loaded = load_peft(_adapted(model, num_adapters=3), DATA, names, adapter=1)
    lora = loaded.blocks.layers.w2
    before = _adapted(model, num_adapters=3).blocks.layers.w2
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
    loaded = load_peft(_adapted(model), DATA, names)
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
    assert {k: ours[k] for k in keys} == {k: PEFT_CONFIG[k] for k in keys} | {
        "target_modules": ["mlp.down_proj"]  # PEFT's own: ["down_proj"]
    }
    # And back: the same factors.
    again = load_peft(_adapted(model), tmp_path, names)
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


def test_fan_in_fan_out(base, tmp_path):
    # A Conv1D-style file ([in, out] weights, fan_in_fan_out): PEFT's change is
    # (B @ A).T of its stored weight, which w2's Transpose rule turns back:
    # the LoRA on w2 is then "W@x" (w2 as [out, in] = [96, 64]).
    config, names, model = base
    a_file = {i: FILE[DOWN.format(i=i, f="A")] for i in range(config.layers)}
    b_file = {i: FILE[DOWN.format(i=i, f="B")] for i in range(config.layers)}
    tensors = {
        DOWN.format(i=i, f="A"): np.ascontiguousarray(b_file[i].T) for i in a_file
    }
    tensors |= {
        DOWN.format(i=i, f="B"): np.ascontiguousarray(a_file[i].T) for i in a_file
    }
    directory = _fabricate(tmp_path, tensors, {"fan_in_fan_out": True})
    loaded = load_peft(_adapted(model, orientation="W@x"), directory, names)
    lora = loaded.blocks.layers.w2
    for i in range(config.layers):
        np.testing.assert_allclose(
            lora.b[i, 0] @ lora.a[i, 0],
            (b_file[i] @ a_file[i]).T,
            rtol=1e-6,
            atol=1e-6,
        )
    save_peft(loaded, tmp_path / "again", names)
    again = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert again["fan_in_fan_out"] is True
    saved = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    for name, value in tensors.items():
        np.testing.assert_array_equal(saved[name], value)


def test_peft_loads_our_files(base, tmp_path):
    # PEFT itself reads save_peft's files onto the PyTorch base model.
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    _, names, model = base
    # Adapter 1 of 2, changed from the file's: PEFT must read ours, not the fixture's.
    two = load_peft(_adapted(model, num_adapters=2), DATA, names, adapter=1)
    w2 = two.blocks.layers.w2
    two = eqx.tree_at(lambda m: m.blocks.layers.w2.b, two, w2.b.at[:, 1].mul(0.5))
    save_peft(two, tmp_path / "ours", names, adapter=1, task_type="CAUSAL_LM")
    # The base model alone: beside adapter_config.json, transformers would load
    # the fixture's adapter onto it.
    (tmp_path / "base").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DATA / name, tmp_path / "base" / name)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "base", dtype=torch.float32
    )
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "ours").eval()
    tokens = REFERENCE["tokens"]
    with torch.no_grad():
        theirs = adapted(torch.from_numpy(tokens).long()).logits.numpy()
    _close(_logits(adapters.select(two, 1), jnp.asarray(tokens)), theirs)
    assert not np.allclose(theirs, REFERENCE["logits"], atol=1e-3)


def _fabricate(tmp_path, tensors=None, config=None, *, text=None):
    """An adapter directory: the fixture's files, or these tensors and entries."""
    directory = tmp_path / "adapter"
    directory.mkdir(exist_ok=True)
    save_file(FILE if tensors is None else tensors, str(directory / WEIGHTS))
    if text is None:
        text = json.dumps({**PEFT_CONFIG, **(config or {})})
    (directory / "adapter_config.json").write_text(text)
    return directory


def _without(*names):
    return {k: v for k, v in FILE.items() if k not in names}


Q = PREFIX.format(i=0) + "self_attn.q_proj.lora_{f}.weight"


@pytest.mark.parametrize(
    "kwargs, tensors, message",
    [
        (
            {"rank": 2},
            None,
            "holds rank-4 adapters, but the LoRA at 'blocks.0.w2' (layer 0) has rank 2",
        ),
        ({"alpha": 4.0}, None, "scales its adapters by 2 (lora_alpha=8 / r=4)"),
        (
            {"orientation": "W@x"},
            None,
            "has orientation 'W@x', but the name map stores "
            "'model.layers.0.mlp.down_proj.weight' as [in, out]",
        ),
        (
            {},
            FILE | {Q.format(f="A"): np.zeros((4, 64), np.float32)},
            "no LoRA of the model stands for 'model.layers.0.self_attn.q_proj'",
        ),
        (
            {},
            FILE
            | {
                PREFIX.format(i=0) + "mlp.foo_proj.lora_A.weight": np.zeros(
                    (4, 64), np.float32
                )
            },
            "no LoRA of the model stands for 'model.layers.0.mlp.foo_proj'",
        ),
        (
            {},
            _without(DOWN.format(i=2, f="A"), DOWN.format(i=2, f="B")),
            "no factors for the LoRA at 'blocks.2.w2' (layer 2) "
            "('model.layers.2.mlp.down_proj')",
        ),
        (
            {},
            _without(DOWN.format(i=1, f="B")),
            f"'{DOWN.format(i=1, f='B')}' is missing, for 'blocks.1.w2' (layer 1)",
        ),
        (
            {},
            FILE | {DOWN.format(i=1, f="A"): np.zeros((4, 95), np.float32)},
            f"'{DOWN.format(i=1, f='A')}' is [4, 95], the LoRA at 'blocks.1.w2' "
            "(layer 1) needs [4, 96]",
        ),
        (
            {},
            FILE | {"base_model.model.lm_head.weight": np.zeros((2, 2), np.float32)},
            "holds tensors that are not LoRA factors",
        ),
    ],
)
def test_mismatch_errors(base, tmp_path, kwargs, tensors, message):
    _, names, model = base
    directory = _fabricate(tmp_path, tensors)
    with pytest.raises(ValueError, match="Hint:") as error:
        load_peft(_adapted(model, **kwargs), directory, names)
    assert message in str(error.value)


def test_fused_and_reshaped_weights(base, tmp_path):
    config, names, model = base
    tensors = {Q.format(f="A"): np.zeros((4, 64), np.float32)}
    tensors[Q.format(f="B")] = np.zeros((64, 4), np.float32)
    directory = _fabricate(tmp_path, tensors, {"target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="Hint:") as error:
        load_peft(_adapted(model, "blocks.*.wqkv"), directory, names)
    assert (
        "The LoRA at 'blocks.0.wqkv' (layer 0) cannot be written as PEFT's rank-4 "
        "pair: the name map fuses 3 weights into it "
        "('model.layers.0.self_attn.q_proj.weight' [64, 64], "
    ) in str(error.value)
    # A map that reshapes w2 [96, 64] into [64, 96]: the shape of a transpose,
    # not its values.
    reshaped = NameMap(
        {
            "blocks.{i}.w2": Rule(
                "model.layers.{i}.mlp.down_proj.weight", Reshape((64, 96))
            )
        }
    )
    with pytest.raises(ValueError, match="Hint:") as error:
        load_peft(_adapted(model), DATA, reshaped)
    assert (
        "the name map reshapes it into 'model.layers.0.mlp.down_proj.weight' [64, 96]"
    ) in str(error.value)
    # A map to Flax names ("...kernel"): not a PyTorch module's weight.
    with pytest.raises(ValueError, match="Hint:") as error:
        load_peft(_adapted(model), DATA, llama.flax_names(config))
    assert "as 'model.layers.0.mlp.down_proj.kernel', not a PyTorch" in str(error.value)


def test_rslora_scaling(base, tmp_path):
    # use_rslora: PEFT scales by lora_alpha / sqrt(r) = 8 / 2, which a LoRA
    # matches with alpha = 4 * rank, not with alpha = lora_alpha.
    _, names, model = base
    directory = _fabricate(tmp_path, config={"use_rslora": True})
    with pytest.raises(
        ValueError, match=r"by 4 \(lora_alpha=8 / sqrt\(r=4\), rsLoRA\)"
    ):
        load_peft(_adapted(model), directory, names)
    loaded = load_peft(_adapted(model, alpha=16.0), directory, names)
    a = loaded.blocks.layers.w2.a
    np.testing.assert_array_equal(a[2, 0], FILE[DOWN.format(i=2, f="A")].T)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "it is not valid JSON"),
        ("[1, 2]", "it holds list, not a JSON object"),
        (json.dumps({**PEFT_CONFIG, "peft_type": "IA3"}), "'peft_type' is 'IA3'"),
        (
            json.dumps({k: v for k, v in PEFT_CONFIG.items() if k != "r"}),
            "'r' is None, expected a positive number",
        ),
        (json.dumps({**PEFT_CONFIG, "r": 2.5}), "'r' is 2.5, not an integer"),
        (json.dumps({**PEFT_CONFIG, "lora_alpha": "8"}), "'lora_alpha' is '8'"),
        (json.dumps({**PEFT_CONFIG, "use_dora": True}), "'use_dora' is True"),
        (
            json.dumps({**PEFT_CONFIG, "rank_pattern": {"down_proj": 8}}),
            "'rank_pattern' is {'down_proj': 8}",
        ),
        # Factors of the usual shapes, used otherwise: aLoRA (only after its
        # invocation tokens), Arrow (routed per token).
        (
            json.dumps({**PEFT_CONFIG, "alora_invocation_tokens": [7, 9]}),
            "'alora_invocation_tokens' is [7, 9]",
        ),
        (
            json.dumps({**PEFT_CONFIG, "arrow_config": {"top_k": 3}}),
            "'arrow_config' is {'top_k': 3}",
        ),
    ],
)
def test_config_errors(base, tmp_path, text, message):
    _, names, model = base
    directory = _fabricate(tmp_path, text=text)
    with pytest.raises(ValueError, match="Hint:") as error:
        load_peft(_adapted(model), directory, names)
    assert "adapter_config.json' is not a PEFT LoRA config: " + message in str(
        error.value
    )


def test_argument_errors(base, tmp_path):
    _, names, model = base
    directory = _fabricate(tmp_path)
    two = _adapted(model, num_adapters=2)
    for adapter, message in [
        (None, "adapter=None does not name one of the 2 adapters"),
        (2, "adapter=2 does not name one of the 2 adapters"),
        (-1, "adapter=-1 is negative"),
    ]:
        with pytest.raises(ValueError, match="Hint:") as error:
            load_peft(two, directory, names, adapter=adapter)
        assert "load_peft: " + message in str(error.value)
    # A NumPy integer names an adapter as an int does.
    loaded = load_peft(two, directory, names, adapter=np.int64(1))
    np.testing.assert_array_equal(
        loaded.blocks.layers.w2.a[:, 1],
        load_peft(two, directory, names, adapter=1).blocks.layers.w2.a[:, 1],
    )
    with pytest.raises(ValueError, match="the model holds no eqxscan.adapters.LoRA"):
        load_peft(model, directory, names)
    with pytest.raises(TypeError, match="name_map must be an eqxscan.checkpoint"):
        load_peft(_adapted(model), directory, {"blocks.{i}.w2": "x"})
    for fn in (load_peft, save_peft):  # the directory and the map swapped
        with pytest.raises(
            TypeError, match=r"directory must be a path, got <.*NameMap"
        ):
            fn(_adapted(model), names, directory)
    # The weights file given for its directory.
    with pytest.raises(NotADirectoryError, match=r"load_peft: .* is a file, not a"):
        load_peft(_adapted(model), directory / WEIGHTS, names)
    (directory / WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match="No adapter_model.safetensors at"):
        load_peft(_adapted(model), directory, names)
    (directory / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="No adapter_config.json at"):
        load_peft(_adapted(model), directory, names)


def test_save_errors(base, tmp_path):
    _, names, model = base
    # The embedding's rule keeps PyTorch's layout: "x@W" there means a Conv1D
    # file, w2's Transpose a Linear one; one config cannot say both.
    layouts = _adapted(_adapted(model), "embed", orientation="x@W")
    with pytest.raises(ValueError, match="different layouts of PEFT's stored weights"):
        save_peft(layouts, tmp_path, names)
    with pytest.raises(ValueError, match="save_peft: adapter=1 does not name one"):
        save_peft(_adapted(model), tmp_path, names, adapter=1)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / WEIGHTS).write_bytes(b"old")
    with pytest.raises(NotADirectoryError, match=r"save_peft: .* is a file, not a"):
        save_peft(_adapted(model), tmp_path / WEIGHTS, names)
    assert (tmp_path / WEIGHTS).read_bytes() == b"old"
    # By default the adapter the model has selected is written; one that
    # differs between layers is refused, not guessed.
    two = load_peft(_adapted(model, num_adapters=2), DATA, names, adapter=1)
    save_peft(adapters.select(two, 1), tmp_path / "chosen", names)
    save_peft(two, tmp_path / "one", names, adapter=1)
    chosen, one = (load_file(str(tmp_path / d / WEIGHTS)) for d in ("chosen", "one"))
    assert sorted(chosen) == sorted(one)
    for name in one:
        np.testing.assert_array_equal(chosen[name], one[name])
    mixed = eqx.tree_at(
        lambda m: m.blocks.layers.w2.active, two, jnp.array([0, 1], jnp.int32)
    )
    with pytest.raises(ValueError, match=r"different adapters selected \(\[0, 1\]\)"):
        save_peft(mixed, tmp_path / "mixed", names)


def test_model_errors(base, tmp_path):
    config, names, model = base
    directory = _fabricate(tmp_path)
    adapted = _adapted(model)
    abstract = eqx.filter_eval_shape(lambda: adapted)
    with pytest.raises(TypeError, match="load_peft needs concrete arrays, but the "):
        load_peft(abstract, directory, names)
    mixed = _adapted(_adapted(model), "lm_head", num_adapters=2)
    with pytest.raises(ValueError, match=r"different numbers of adapters \(\[1, 2\]\)"):
        load_peft(mixed, directory, names)
    # A map that keeps w2 on eqxscan's side, and one that gives lm_head the
    # name of layer 0's down_proj.
    kept = NameMap({}, keep=["blocks.{i}.w2"])
    with pytest.raises(ValueError, match="the name map keeps it on eqxscan's side"):
        load_peft(adapted, directory, kept)
    clash = NameMap(
        {
            "blocks.{i}.w2": Rule("model.layers.{i}.mlp.down_proj.weight", Transpose()),
            "lm_head": Rule("model.layers.0.mlp.down_proj.weight", Transpose()),
        }
    )
    with pytest.raises(
        ValueError,
        match="the LoRAs at 'blocks.0.w2' \\(layer 0\\) and 'lm_head' both stand "
        "for PEFT's 'model.layers.0.mlp.down_proj'",
    ):
        load_peft(_adapted(adapted, "lm_head"), directory, clash)
    # One LoRA in two places (a tied weight adapted once, used twice).
    lora = adapted.blocks.layers.w2
    with pytest.raises(ValueError, match="one LoRA stands both at 'x' and at 'y'"):
        load_peft({"x": lora, "y": lora}, directory, names)
    # A LoRA with a leading axis of its own, outside any stack.
    cube = adapters.LoRA(
        base=jnp.zeros((2, 3, 4)),
        a=jnp.zeros((2, 1, 3, 1)),
        b=jnp.zeros((2, 1, 1, 4)),
        active=jnp.zeros(2, jnp.int32),
        alpha=1.0,
        rank=1,
        orientation="x@W",
    )
    with pytest.raises(ValueError, match=r"base of shape \(2, 3, 4\) with 0 layer"):
        load_peft({"w": cube}, directory, NameMap({"w": "w.weight"}))


@pytest.mark.parametrize(
    "other, message",
    [
        ({"rank": 2}, r"have different ranks \(\[2, 4\]\)"),
        ({"alpha": 2.0}, r"have different alphas \(\[2.0, 8.0\]\)"),
        ({"dropout": 0.1}, r"have different dropout rates \(\[0.0, 0.1\]\)"),
        ({"num_adapters": 2}, r"different numbers of adapters \(\[1, 2\]\)"),
    ],
)
def test_save_mixed_loras(base, tmp_path, other, message):
    _, names, model = base
    mixed = _adapted(_adapted(model), "lm_head", **other)
    with pytest.raises(ValueError, match=message):
        save_peft(mixed, tmp_path, names)
    assert list(tmp_path.iterdir()) == []


def test_dtype_and_placement(base):
    # bfloat16 LoRAs get the file's float32 factors rounded; a sharded `a`
    # keeps its sharding.
    config, names, model = base
    adapted = _adapted(model)
    lora = adapted.blocks.layers.w2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    spec = jax.sharding.PartitionSpec(None, None, "x", None)
    sharded_a = jax.device_put(lora.a, jax.sharding.NamedSharding(mesh, spec))
    adapted = eqx.tree_at(
        lambda m: (m.blocks.layers.w2.a, m.blocks.layers.w2.b),
        adapted,
        (sharded_a, lora.b.astype(jnp.bfloat16)),
    )
    loaded = load_peft(adapted, DATA, names).blocks.layers.w2
    assert loaded.a.sharding == sharded_a.sharding
    assert loaded.b.dtype == jnp.bfloat16
    for i in range(config.layers):
        np.testing.assert_array_equal(loaded.a[i, 0], FILE[DOWN.format(i=i, f="A")].T)
        np.testing.assert_array_equal(
            loaded.b[i, 0],
            FILE[DOWN.format(i=i, f="B")].T.astype(jnp.bfloat16),
        )


def test_target_modules_name_only_the_adapted_modules(tmp_path):
    # GPT-2 names its attention's and its MLP's output projections `c_proj`:
    # ["c_proj"] would have PEFT adapt both where only the MLP's is.
    from eqxscan.checkpoint import NameMap

    model = eqxscan.StackedMLP(8, 2, key=jax.random.key(0))
    names = NameMap(
        {
            "blocks.{i}.w1": "h.{i}.attn.c_proj.weight",
            "blocks.{i}.w2": "h.{i}.mlp.c_proj.weight",
            "blocks.{i}.scale": "h.{i}.ln.weight",
        }
    )
    save_peft(_adapted(model), tmp_path, names)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["mlp.c_proj"]
