"""Name maps, declared once and used both ways: renames with the layer index
(global across a Chain's runs and periodic units), transposes, fused
projections split and joined (grouped-query heads), head-axis reshapes, names
of one side only; every problem reported at once, with its layer."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan
from eqxscan.checkpoint import Join, NameMap, Reshape, Rule, Split, Transpose


D, H, K, HD = 8, 4, 2, 2  # model width, query heads, key/value heads, head size


class Block(eqx.Module):
    norm: jax.Array  # [D]
    wqkv: jax.Array  # [D, (H + 2K) * HD]: fused, [in, out]
    wo: jax.Array  # [H, HD, D]: by head

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.norm = jnp.ones(D)
        self.wqkv = jax.random.normal(k1, (D, (H + 2 * K) * HD))
        self.wo = jax.random.normal(k2, (H, HD, D))


class Model(eqx.Module):
    embed: jax.Array
    blocks: eqxscan.Stacked

    def __init__(self, num_layers=3, *, key):
        k1, k2 = jax.random.split(key)
        self.embed = jax.random.normal(k1, (16, D))
        self.blocks = eqxscan.Stacked(lambda k: Block(key=k), num_layers, key=k2)


@functools.cache
def _model(seed=0, num_layers=3):
    return Model(num_layers, key=jax.random.key(seed))


PT = "model.layers.{i}.self_attn."
TORCH = NameMap(
    {
        "embed": "model.embed_tokens.weight",
        "blocks.{i}.norm": "model.layers.{i}.input_layernorm.weight",
        "blocks.{i}.wqkv": Rule(
            [PT + "q_proj.weight", PT + "k_proj.weight", PT + "v_proj.weight"],
            Transpose(),
            Split(0, (H * HD, K * HD, K * HD)),
        ),
        "blocks.{i}.wo": Rule(PT + "o_proj.weight", Reshape((H * HD, D)), Transpose()),
    },
    ignore=["model.layers.{i}.self_attn.rotary_emb.inv_freq"],
)


def _by_hand(model):
    """What the map should write, built with plain NumPy."""
    out = {"model.embed_tokens.weight": np.asarray(model.embed)}
    for i in range(model.blocks.num_layers):
        layer = model.blocks[i]
        q, k, v = np.split(np.asarray(layer.wqkv), [H * HD, (H + K) * HD], axis=1)
        out[f"model.layers.{i}.input_layernorm.weight"] = np.asarray(layer.norm)
        out[PT.format(i=i) + "q_proj.weight"] = q.T
        out[PT.format(i=i) + "k_proj.weight"] = k.T
        out[PT.format(i=i) + "v_proj.weight"] = v.T
        out[PT.format(i=i) + "o_proj.weight"] = np.asarray(layer.wo).reshape(-1, D).T
    return out


def test_export_matches_a_hand_written_conversion_and_loads_back():
    model = _model()
    external = TORCH.export(model)
    expected = _by_hand(model)
    assert list(external) == [
        "model.embed_tokens.weight",
        *[
            n.format(i=i)
            for i in range(3)
            for n in [
                "model.layers.{i}.input_layernorm.weight",
                PT + "q_proj.weight",
                PT + "k_proj.weight",
                PT + "v_proj.weight",
                PT + "o_proj.weight",
            ]
        ],
    ]
    assert external[PT.format(i=0) + "k_proj.weight"].shape == (K * HD, D)
    for name, array in expected.items():
        np.testing.assert_array_equal(external[name], array, err_msg=name)
    # Load: the inverse, from the hand-written arrays, and a buffer of their
    # side only, ignored.
    expected["model.layers.1.self_attn.rotary_emb.inv_freq"] = np.ones(2)
    loaded = TORCH.load(_model(1), expected)
    assert eqx.tree_equal(loaded, model)


def test_joined_on_our_side_split_back_on_load():
    # GPT-2's fused c_attn: separate q/k/v here, one [D, 3D] array there.
    class Attn(eqx.Module):
        q: jax.Array
        k: jax.Array
        v: jax.Array

    key = jax.random.key(0)
    stack = eqxscan.Stacked(
        lambda k: Attn(*jax.random.normal(k, (3, 2, D, D))[:, 0]), 2, key=key
    )
    names = NameMap(
        {("{i}.q", "{i}.k", "{i}.v"): Rule("h.{i}.attn.c_attn.weight", Join(1))}
    )
    external = names.export(stack)
    assert list(external) == ["h.0.attn.c_attn.weight", "h.1.attn.c_attn.weight"]
    np.testing.assert_array_equal(
        external["h.1.attn.c_attn.weight"],
        np.concatenate([stack[1].q, stack[1].k, stack[1].v], axis=1),
    )
    other = eqxscan.Stacked(lambda k: Attn(*jnp.zeros((3, D, D))), 2, key=key)
    assert eqx.tree_equal(names.load(other, external), stack)


def test_a_join_named_in_another_order_than_the_fields_loads_each_in_place():
    # The rule joins k before q; the module holds q first, so q's piece is read
    # first on load: it must not be handed k's.
    class Attn(eqx.Module):
        q: jax.Array
        k: jax.Array

    def attn(key, fill=None):
        if fill is not None:
            return Attn(jnp.full((D, D), fill), jnp.full((D, D), fill))
        return Attn(*jax.random.normal(key, (2, D, D)))

    stack = eqxscan.Stacked(attn, 2, key=jax.random.key(0))
    names = NameMap({("{i}.k", "{i}.q"): Rule("h.{i}.kq", Join(0))})
    external = names.export(stack)
    np.testing.assert_array_equal(
        external["h.1.kq"], np.concatenate([stack[1].k, stack[1].q])
    )
    like = eqxscan.Stacked(lambda k: attn(k, 0.0), 2, key=jax.random.key(1))
    assert eqx.tree_equal(names.load(like, external), stack)


def test_layer_index_is_global_across_a_chains_runs_and_periodic_units():
    class Local(eqx.Module):
        w: jax.Array

    class Global(eqx.Module):
        w: jax.Array
        gate: jax.Array

    def layers(seed):
        keys = jax.random.split(jax.random.key(seed), 7)
        return [
            Global(jax.random.normal(k, (2, 3)), jnp.full(3, float(i)))
            if i % 3 == 2
            else Local(jax.random.normal(k, (2, 3)))
            for i, k in enumerate(keys)
        ]

    chain = eqxscan.Chain(layers(0))  # L L G L L G L: repeats of (L, L, G)
    assert any(isinstance(g, eqxscan.Stacked) for g in chain.groups)
    model = {"layers": chain}
    names = NameMap(
        {
            "layers.{i}.w": Rule("h.{i}.kernel", Transpose()),
            "layers.{i}.gate": "h.{i}.gate",
        }
    )
    external = names.export(model)
    assert sorted(external, key=lambda n: int(n.split(".")[1])) == list(external)
    for i, layer in enumerate(chain.unstack()):
        np.testing.assert_array_equal(external[f"h.{i}.kernel"], layer.w.T)
        if i % 3 == 2:
            np.testing.assert_array_equal(external[f"h.{i}.gate"], np.full(3, i))
        else:
            assert f"h.{i}.gate" not in external
    loaded = names.load({"layers": eqxscan.Chain(layers(1))}, external)
    assert eqx.tree_equal(loaded, model)


def test_every_problem_is_reported_at_once_with_its_layer():
    external = _by_hand(_model())
    del external[PT.format(i=2) + "v_proj.weight"]
    external[PT.format(i=1) + "k_proj.weight"] = np.zeros((D, D), np.float32)
    external["model.layers.3.input_layernorm.weight"] = np.ones(D, np.float32)
    external["lm_head.weight"] = np.ones((16, D), np.float32)
    external["model.layers.1.mlp.up.weight"] = np.ones(D, np.float32)  # no rule
    with pytest.raises(ValueError) as e:
        TORCH.load(_model(1), external)
    first, hint = str(e.value).splitlines()
    assert "(1 mis-shaped, 1 missing, 3 unused)" in first
    assert "unused 'model.layers.1.mlp.up.weight' (layer 1)" in first
    assert (
        "missing 'model.layers.2.self_attn.v_proj.weight' (layer 2) for "
        "'blocks.2.wqkv'" in first
    )
    assert (
        "'model.layers.1.self_attn.k_proj.weight' (layer 1) is float32[8, 8], "
        "'blocks.1.wqkv' needs float32[4, 8]" in first
    )
    assert "unused 'model.layers.3.input_layernorm.weight' (layer 3)" in first
    assert "unused 'lm_head.weight'" in first
    assert hint.startswith("Hint: ")


def test_a_file_of_another_float_dtype_is_named_with_the_cast(tmp_path):
    # Pretrained files are mostly bfloat16: the shapes fit, and the hint is
    # dtype=, not the configuration; each as its caller can cast (NameMap.load
    # takes no dtype=, and was told to pass one).
    external = {k: v.astype(jnp.bfloat16) for k, v in _by_hand(_model()).items()}
    with pytest.raises(ValueError) as e:
        TORCH.load(_model(1), external)
    first, hint = str(e.value).splitlines()
    assert "of another dtype)" in first and "mis-shaped" not in first
    assert "is bfloat16[4, 8], 'blocks.0.wqkv' needs float32[4, 8]" in first
    assert hint == (
        "Hint: the shapes fit: cast the arrays to the model's dtypes first (a "
        "file: eqxscan.load_safetensors(path, like, names=..., dtype=jnp.float32) "
        "casts them)."
    )
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _model())
    eqxscan.save_safetensors(tmp_path / "m.safetensors", bf16, names=TORCH)
    for dtype, want in [
        (None, "the shapes fit: load with dtype=jnp.float32, which casts the "),
        (jnp.float16, "dtype=float16 cast the file's floating-point arrays (the "),
    ]:
        with pytest.raises(ValueError) as e:
            eqxscan.load_safetensors(
                tmp_path / "m.safetensors", _model(1), names=TORCH, dtype=dtype
            )
        first, hint = str(e.value).splitlines()
        assert hint.startswith("Hint: " + want), hint
        assert f"is {jnp.dtype(dtype or jnp.bfloat16).name}[4, 8]" in first


def test_names_of_one_side_only():
    # `keep`: a buffer of eqxscan's model only, taken from like and not written.
    class WithTable(eqx.Module):
        model: Model
        rope: jax.Array

    ours = WithTable(_model(), jnp.arange(4.0))
    names = NameMap(
        {"model.embed": "model.embed_tokens.weight", **_prefixed(TORCH)},
        keep=["rope"],
    )
    external = names.export(ours)
    assert "rope" not in external and len(external) == 16
    like = WithTable(_model(1), jnp.arange(4.0) + 1)
    loaded = names.load(like, external)
    assert eqx.tree_equal(loaded.model, _model())
    np.testing.assert_array_equal(loaded.rope, like.rope)
    # Kept inside a Stacked: each layer keeps its own array.
    kept = NameMap(
        {
            "embed": "model.embed_tokens.weight",
            "blocks.{i}.wqkv": TORCH._rules[2].rule,
            "blocks.{i}.wo": TORCH._rules[3].rule,
        },
        keep=["blocks.{i}.norm"],
    )
    norms = jnp.arange(3.0 * D).reshape(3, D)
    like = eqx.tree_at(lambda m: m.blocks.layers.norm, _model(1), norms)
    loaded = kept.load(like, kept.export(_model()))
    np.testing.assert_array_equal(loaded.blocks.layers.norm, norms)
    np.testing.assert_array_equal(loaded.blocks.layers.wo, _model().blocks.layers.wo)


def test_one_pattern_of_one_side_only_given_as_a_string():
    # One pattern, not its characters (patterns that would match no name).
    names = NameMap(
        {"embed": "e", "blocks.{i}.wqkv": "q.{i}", "blocks.{i}.wo": "o.{i}"},
        keep="blocks.{i}.norm",
        ignore="rotary.{i}",
    )
    external = names.export(_model())
    assert len(external) == 7
    external["rotary.0"] = np.ones(2)
    loaded = names.load(_model(1), external)
    np.testing.assert_array_equal(loaded.blocks.layers.wo, _model().blocks.layers.wo)


def _prefixed(names):
    return {
        "model.blocks.{i}.norm": "model.layers.{i}.input_layernorm.weight",
        "model.blocks.{i}.wqkv": names._rules[2].rule,
        "model.blocks.{i}.wo": names._rules[3].rule,
    }


def test_maps_that_do_not_fit_are_named():
    with pytest.raises(ValueError, match="no rule for 'blocks.0.wo'"):
        NameMap(
            {"embed": "e", "blocks.{i}.norm": "n.{i}", "blocks.{i}.wqkv": "a.{i}"}
        ).export(_model())
    fused = Rule(("q.{i}", "k.{i}", "v.{i}"), Split(0, (4, 4, 4)))
    with pytest.raises(ValueError, match=r"Split\(0, \(4, 4, 4\)\) does not fit") as e:
        NameMap(
            {"embed": "e", "blocks.{i}.norm": "n.{i}", "blocks.{i}.wo": "o.{i}"}
            | {"blocks.{i}.wqkv": fused}
        ).export(_model())
    assert "'blocks.2.wqkv' float32[8, 16]" in str(e.value)
    # An axis the array lacks is refused by name, not wrapped around (axis 2 of
    # a 2-d array was taken as axis 0) or divided by zero (a 0-d array).
    wrapped = Rule(("q.{i}", "k.{i}", "v.{i}"), Split(2, (4, 2, 2)))
    with pytest.raises(ValueError, match=r"has no axis 2 in shape \[8, 16\]"):
        NameMap(
            {"embed": "e", "blocks.{i}.norm": "n.{i}", "blocks.{i}.wo": "o.{i}"}
            | {"blocks.{i}.wqkv": wrapped}
        ).export(_model())
    # Likewise a Transpose: (2, 1) of a 2-d array was taken as (0, 1).
    for axes in [(2, 1), (0, 3)]:
        with pytest.raises(ValueError, match=re.escape(f"Transpose{axes} does not")):
            Transpose(axes).shapes([(8, 16)])
    # Negative sizes that add up: export wrote arrays of other shapes.
    with pytest.raises(ValueError, match=r"Split\(0, \(20, -4\)\) does not fit"):
        Split(0, (20, -4)).shapes([(16, 8)])
    with pytest.raises(ValueError, match=r"Reshape\(-2, -8\) does not fit"):
        Reshape((-2, -8)).shapes([(16,)])
    # Sizes that differ (head counts of another configuration): named, not
    # NumPy's reshape error.
    for to in [(4, 4), (-1, 3), (0, -1)]:
        with pytest.raises(ValueError, match=re.escape(f"Reshape{to} does not fit")):
            Reshape(to).shapes([(8, 16)])
    with pytest.raises(ValueError, match=r"Join\(0\) has no axis 0 in shape \[\]"):
        Join(0).shapes([(), ()])
    with pytest.raises(ValueError, match=r"Split\(-1, \(1,\)\) has no axis -1"):
        Split(-1, (1,)).shapes([()])
    # Two arrays under one name: export wrote one of them, load read it twice.
    twice = NameMap(
        {
            "embed": "e",
            "blocks.{i}.wqkv": "a.{i}",
            "blocks.{i}.wo": "o.{i}",
            "blocks.{i}.norm": Rule("a.{i}", Reshape((2, 4))),
        }
    )
    with pytest.raises(
        ValueError, match="'blocks.0.norm' and 'blocks.0.wqkv' both to 'a.0'"
    ):
        twice.export(_model())
    # A name twice in one rule: the Split's second piece was written under the
    # first's name (q held k's weights), and loaded back as both.
    repeated = NameMap(
        {
            "embed": "e",
            "blocks.{i}.norm": "n.{i}",
            "blocks.{i}.wo": "o.{i}",
            "blocks.{i}.wqkv": Rule(("q.{i}", "q.{i}", "v.{i}"), Split(1, (8, 4, 4))),
        }
    )
    with pytest.raises(ValueError, match="'blocks.0.wqkv' and 'blocks.0.wqkv' both"):
        repeated.export(_model())
    with pytest.raises(ValueError, match=r"joins \['{i}.q', '{i}.q'\], a name twice"):
        NameMap({("{i}.q", "{i}.q"): Rule("qq.{i}", Join(0))})
    with pytest.raises(ValueError, match="needs a Split as its last operation"):
        NameMap({"a": Rule(("b", "c"))})
    # A Join or Split where one name needs none, even after another operation.
    with pytest.raises(ValueError, match="from 1 eqxscan names needs no Join"):
        NameMap({"a": Rule("b", Transpose(), Join(0))})
    with pytest.raises(ValueError, match="to 1 external names needs no Split"):
        NameMap({"a": Rule("b", Split(0, (2,)), Transpose())})
    with pytest.raises(ValueError, match="needs a Join as its first operation"):
        NameMap({("a", "b"): Rule("c", Transpose(), Join(0))})
    with pytest.raises(ValueError, match="same ones"):
        NameMap({"blocks.{i}.norm": "norm"})
    with pytest.raises(TypeError, match="rules"):
        NameMap({"a": 3})  # type: ignore[dict-item]


def test_safetensors_files_through_a_name_map(tmp_path):
    model = _model()
    eqxscan.save_safetensors(tmp_path, model, names=TORCH, max_shard_size=600)
    plain = eqxscan.read_safetensors(tmp_path)
    expected = _by_hand(model)
    assert sorted(plain) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(plain[name], array)
    loaded = eqxscan.load_safetensors(tmp_path, _model(1), names=TORCH)
    assert eqx.tree_equal(loaded, model)
    # Another depth: one line naming both, not a name per array.
    for num_layers, words in [
        (4, "has 3 layers, the model 4"),
        (2, "has 3 layers, the model 2"),
    ]:
        with pytest.raises(ValueError) as e:
            eqxscan.load_safetensors(
                tmp_path, _model(1, num_layers=num_layers), names=TORCH
            )
        first, hint = str(e.value).splitlines()
        assert first.endswith(f"through the name map: the file {words}."), first
        assert "missing" not in first and "unused" not in first, first
    # Another depth and another name besides: both are named.
    external = _by_hand(model)
    v = PT.format(i=2) + "v_proj.weight"
    external[v.replace("v_proj", "value")] = external.pop(v)
    with pytest.raises(ValueError) as e:
        TORCH.load(_model(1, num_layers=4), external)
    first = str(e.value).splitlines()[0]
    assert "the file has 3 layers, the model 4" in first, first
    assert f"missing '{v}' (layer 2)" in first, first


def test_a_transpose_that_is_not_its_own_inverse_round_trips():
    # (1, 2, 0) undone is (2, 0, 1): a map that applied the same permutation
    # both ways would load [D, H, HD] into `wo` ([H, HD, D]) and fail, or
    # export the wrong axes.
    names = NameMap(
        {
            "embed": "model.embed_tokens.weight",
            "blocks.{i}.norm": "model.layers.{i}.input_layernorm.weight",
            "blocks.{i}.wqkv": "model.layers.{i}.qkv",
            "blocks.{i}.wo": Rule("model.layers.{i}.o", Transpose((1, 2, 0))),
        }
    )
    model = _model()
    external = names.export(model)
    for i in range(3):
        np.testing.assert_array_equal(
            external[f"model.layers.{i}.o"],
            np.transpose(np.asarray(model.blocks[i].wo), (1, 2, 0)),
        )
    assert eqx.tree_equal(names.load(_model(1), external), model)
    # And from their side: a file written by hand loads to the inverse.
    theirs = {**external, "model.layers.0.o": np.arange(HD * D * H, dtype=np.float32)}
    theirs["model.layers.0.o"] = theirs["model.layers.0.o"].reshape(HD, D, H)
    loaded = names.load(_model(1), theirs)
    np.testing.assert_array_equal(
        loaded.blocks[0].wo, np.transpose(theirs["model.layers.0.o"], (2, 0, 1))
    )


def test_flax_gpt2_conv1d_kernels_are_out_in_and_a_square_one_needs_the_map(
    tmp_path,
):
    # Hugging Face's Flax GPT-2 stores each `Conv1D` kernel [out, in] (PyTorch's
    # [in, out]); `c_proj` is square, so its shape cannot tell the two apart:
    # only the map's `Transpose()` does, and the file's format is checked.
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxConv1D

    class Proj(eqx.Module):
        w: jax.Array  # [in, out]: x @ w
        b: jax.Array

    stack = eqxscan.Stacked(
        lambda k: Proj(jax.random.normal(k, (D, D)), jax.random.normal(k, (D,))),
        2,
        key=jax.random.key(0),
    )
    flax_gpt2 = NameMap(
        {
            "{i}.w": Rule("transformer.h.{i}.attn.c_proj.kernel", Transpose()),
            "{i}.b": "transformer.h.{i}.attn.c_proj.bias",
        },
        format="flax",
    )
    eqxscan.save_safetensors(tmp_path, stack, names=flax_gpt2)
    state = eqxscan.read_safetensors(tmp_path)
    x = jax.random.normal(jax.random.key(1), (D,))  # one row: no rank promotion
    for i in range(2):
        params = {
            "kernel": state[f"transformer.h.{i}.attn.c_proj.kernel"],
            "bias": state[f"transformer.h.{i}.attn.c_proj.bias"],
        }
        theirs = FlaxConv1D(features=D).apply({"params": params}, x)
        ours = x @ stack[i].w + stack[i].b
        np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)
    like = eqxscan.Stacked(
        lambda k: Proj(jnp.zeros((D, D)), jnp.zeros(D)), 2, key=jax.random.key(2)
    )
    assert eqx.tree_equal(
        eqxscan.load_safetensors(tmp_path, like, names=flax_gpt2), stack
    )
    # PyTorch's layout (no transpose) would load the square kernel transposed:
    # the file says it is Flax's, so that map is refused.
    torch_gpt2 = NameMap(
        {
            "{i}.w": "transformer.h.{i}.attn.c_proj.kernel",
            "{i}.b": "transformer.h.{i}.attn.c_proj.bias",
        }
    )
    with pytest.raises(ValueError, match="holds format 'flax'.*is for format 'pt'"):
        eqxscan.load_safetensors(tmp_path, like, names=torch_gpt2)


def test_a_join_of_unequal_arrays_is_cut_back_at_their_own_sizes():
    # Grouped-query heads: q [D, H*HD], k and v [D, K*HD], fused into one
    # [D, (H + 2K) * HD] array; loading must cut it at q's and k's sizes.
    class Attn(eqx.Module):
        q: jax.Array
        k: jax.Array
        v: jax.Array

    def attn(key, fill=None):
        sizes = (H * HD, K * HD, K * HD)
        keys = jax.random.split(key, 3)
        if fill is not None:
            return Attn(*(jnp.full((D, n), fill) for n in sizes))
        return Attn(*(jax.random.normal(k, (D, n)) for k, n in zip(keys, sizes)))

    stack = eqxscan.Stacked(attn, 2, key=jax.random.key(0))
    names = NameMap({("{i}.q", "{i}.k", "{i}.v"): Rule("h.{i}.qkv", Join(-1))})
    external = names.export(stack)
    for i in range(2):
        np.testing.assert_array_equal(
            external[f"h.{i}.qkv"],
            np.concatenate([stack[i].q, stack[i].k, stack[i].v], axis=1),
        )
    like = eqxscan.Stacked(lambda k: attn(k, 0.0), 2, key=jax.random.key(1))
    assert eqx.tree_equal(names.load(like, external), stack)


def test_a_format_differing_from_a_layout_only_by_case_is_refused():
    # 'Flax' would turn off the check of the file's format (a 'pt' file would
    # load through a Flax map, a square kernel transposed).
    with pytest.raises(ValueError, match="format 'Flax'.*\n.*format='flax'"):
        NameMap({"embed": "e"}, format="Flax")
    assert NameMap({"embed": "e"}, format="mlx").format == "mlx"


def test_metadata_that_names_another_format_than_the_map_is_refused(tmp_path):
    # The file's format is the map's: another would lift the check on loading.
    flax = NameMap(
        {"embed": "e", "blocks.{i}.wqkv": "q.{i}", "blocks.{i}.wo": "o.{i}"},
        keep="blocks.{i}.norm",
        format="flax",
    )
    with pytest.raises(ValueError, match="metadata format 'pt'.*'flax'"):
        eqxscan.save_safetensors(
            tmp_path, _model(), names=flax, metadata={"format": "pt"}
        )
    assert not list(tmp_path.iterdir())
    eqxscan.save_safetensors(
        tmp_path, _model(), names=flax, metadata={"format": "flax", "note": "x"}
    )


def test_a_rule_that_makes_an_ignored_name_is_refused():
    # `ignore=` names their side only: exporting never writes them, loading
    # skips them; a rule making one contradicts both.
    names = NameMap(
        {
            "embed": "lm_head.weight",
            "blocks.{i}.wqkv": "q.{i}",
            "blocks.{i}.wo": "o.{i}",
        },
        keep="blocks.{i}.norm",
        ignore="lm_head.weight",
    )
    with pytest.raises(ValueError, match="'embed' to 'lm_head.weight'.*\n.*keep="):
        names.export(_model())
