"""Tensor parallelism with FSDP: logical names to shardings, and one training
step on a 2 x 4 CPU mesh against one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqxscan
from eqxscan import quant, sharding

from .helpers import (
    run_device_script,
)
from .scripts import partition_model


# ------------------------------------------- sharding: tensor parallelism + FSDP


def test_logical_specs_and_errors(getkey):
    mesh = jax.make_mesh((1, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    model, x, _ = partition_model.make_problem()
    axes, rules = partition_model.AXES, partition_model.RULES
    specs = sharding.logical_shardings(model, mesh, axes, rules).blocks.layers
    # The names are one layer's; the layer axis is added, unsharded.
    assert specs.w1.spec == P(None, "fsdp", "model")
    assert specs.w2.spec == P(None, "model", "fsdp")
    assert specs.scale.spec == P()  # no names and fsdp_axis=None: replicated
    # Unnamed parameters fall back to the FSDP rule; a function gives names too.
    fn = lambda path, leaf: ("mlp", None) if path.endswith("w2") else None
    specs = sharding.logical_shardings(
        model, mesh, fn, rules, fsdp_axis="model", min_size=0
    ).blocks.layers
    assert specs.w2.spec == P(None, "model", None)
    assert specs.w1.spec == P(None, None, "model") and specs.scale.spec == P(
        None, "model"
    )
    # Nested Stackeds: one unsharded axis per level.
    outer = eqxscan.Stacked.from_layers([model.blocks, model.blocks])
    nested = sharding.logical_shardings(outer, mesh, {"*.w1": ("embed", "mlp")}, rules)
    assert nested.layers.layers.w1.spec == P(None, None, "fsdp", "model")
    # Placed and run: the same values as on one device.
    placed = sharding.constrain(
        model, sharding.logical_shardings(model, mesh, axes, rules)
    )
    assert placed.blocks.layers.w1.addressable_shards[0].data.shape == (3, 16, 32)
    assert jnp.allclose(
        eqx.filter_jit(type(model).__call__)(placed, x), model(x), atol=1e-5
    )

    with pytest.raises(
        ValueError,
        match=r"blocks.layers.w1` has shape \(3, 16, 64\)"
        r", so it needs 2 logical names after its 1 layer axis",
    ):
        sharding.logical_shardings(model, mesh, {"*.w1": ("embed",)}, rules)
    # As in Flax, the first rule for a name wins (later ones are fallbacks).
    pairs = [("mlp", "model"), ("mlp", None), ("embed", None)]
    assert sharding.logical_spec(("embed", "mlp"), pairs) == P(None, "model")
    with pytest.raises(ValueError, match=r"'vocab' has no rule"):
        sharding.logical_spec(("vocab",), rules)
    with pytest.raises(ValueError, match=r"picks mesh axis 'tensor'.*axes \('fsdp', "):
        sharding.logical_spec(("mlp",), {"mlp": "tensor"}, mesh)
    with pytest.raises(ValueError, match=r"'model' would shard two axes"):
        sharding.logical_spec(("mlp", "heads"), {"mlp": "model", "heads": "model"})
    odd = eqxscan.StackedMLP(5, 2, key=getkey())  # w2 [2, 20, 5]
    with pytest.raises(
        ValueError,
        match=r"w2` with shape \(2, 20, 5\): its axis 'embed' has size 5, which mesh "
        r"axis 'model' of size 2 does not divide",
    ):
        sharding.logical_shardings(
            odd, mesh, {"*.w2": ("mlp", "embed")}, {"mlp": None, "embed": "model"}
        )


def test_axes_pattern_matching_no_parameter_is_an_error(getkey):
    # Such a pattern shards nothing: a typo, or a weight that a Quantized
    # replaced, whose arrays are `<weight>.values` and `<weight>.scales`.
    mesh = jax.make_mesh((1, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    model = eqxscan.StackedMLP(16, 2, key=getkey())
    rules = {"embed": "fsdp", "mlp": "model"}
    with pytest.raises(
        ValueError, match=r"pattern '\*\.w3' \(names \('embed', 'mlp'\)\) matches no"
    ):
        sharding.logical_shardings(
            model, mesh, {"*.w1": ("embed", "mlp"), "*.w3": ("embed", "mlp")}, rules
        )
    q = quant.quantize(model, "*.w1")
    with pytest.raises(ValueError, match=r"'\*\.w1'.*blocks\.layers\.w1\.values"):
        sharding.logical_shardings(q, mesh, {"*.w1": ("embed", "mlp")}, rules)
    axes = {"*.w1.values": ("embed", "mlp"), "*.w1.scales": (None, "mlp")}
    specs = sharding.logical_shardings(q, mesh, axes, rules).blocks.layers.w1
    assert specs.values.spec == P(None, "fsdp", "model")
    assert specs.scales.spec == P(None, None, "model")


@pytest.fixture(scope="module")
def eight_devices():
    return run_device_script("partition_checks.py", timeout=300)


def test_tensor_parallel_eight_devices(eight_devices):
    # A 2 (fsdp) x 4 (model) mesh: one SGD-with-momentum step equals one device,
    # with or without `gather_layers`.
    for name, r in eight_devices.items():
        for err in ("err_loss", "err_grads", "err_params", "err_opt_state"):
            assert r[err] < 1e-5, (name, r)
        assert r["w1_spec"] == r["mu_w1_spec"] == "P(None, 'fsdp', 'model')", r
        assert r["w1_shard"] == [3, 16 // 2, 64 // 4]  # [L, D/fsdp, 4D/model]
    r = eight_devices["plain"]
    # Row-parallel w2: each device holds a partial sum of the block's output,
    # all-reduced over "model" ([B/fsdp, D] activations).
    assert "f32[4,16]" in r["all_reduces"], r
    # FSDP: a layer's weights are all-gathered over "fsdp" ([D, 4D/model]).
    assert "f32[16,16]" in r["all_gathers"], r


def test_tensor_parallel_gather_keeps_model_axis(eight_devices):
    # gather_layers(keep="model"): each step gathers one layer's "fsdp" shards
    # ([D, 4D/4]) and keeps "model" split (the activations are all-reduced),
    # never a whole [D, 4D] weight; keep=() gathers the whole layer.
    kept, whole = eight_devices["kept"], eight_devices["whole"]
    assert "P(None, 'model')" in kept["layer_sharding"], kept
    gathered = [s.replace("[1,", "[") for s in kept["all_gathers"]]
    assert gathered and set(gathered) == {"f32[16,16]"}, kept
    assert "f32[4,16]" in kept["all_reduces"], kept
    whole_gathers = [s.replace("[1,", "[") for s in whole["all_gathers"]]
    assert "f32[16,64]" in whole_gathers and "f32[64,16]" in whole_gathers, whole


def test_named_parameters_need_not_divide_the_fsdp_axis(getkey):
    # scale [2, 5] has no axis that 2 divides: an error under the FSDP rule,
    # but named, its names decide (here: replicated).
    mesh = jax.make_mesh((2, 1), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    model = eqxscan.StackedMLP(5, 2, key=getkey())  # w1 [2, 5, 20], scale [2, 5]
    kw = dict(fsdp_axis="fsdp", min_size=0)
    axes, rules = {"*.scale": (None,), "*.w2": ("mlp", None)}, {"mlp": "model"}
    specs = sharding.logical_shardings(model, mesh, axes, rules, **kw)
    assert specs.blocks.layers.scale.spec == P(None, None)
    assert specs.blocks.layers.w2.spec == P(None, "model", None)
    assert specs.blocks.layers.w1.spec == P(None, None, "fsdp")  # the FSDP rule
    # An unnamed parameter still gets the FSDP rule's error.
    with pytest.raises(ValueError, match=r"`model.blocks.layers.scale` with shape"):
        sharding.logical_shardings(model, mesh, {"*.w2": axes["*.w2"]}, rules, **kw)


def test_a_path_as_printed_is_a_pattern_of_itself(getkey):
    # `[1]` once read as an fnmatch class: the error listing the parameters
    # named this very path as one the pattern did not match.
    mesh = jax.make_mesh((1, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    lin = lambda k: eqx.nn.Linear(4, 4, key=k)
    chain = eqxscan.Chain(
        [lin(getkey()), lin(getkey()), eqx.nn.MLP(4, 4, 8, 1, key=getkey())]
    )
    rules = {"mlp": "model"}
    for pattern in ("groups[1].layers[0].weight", "*.layers[0].weight"):
        specs = sharding.logical_shardings(chain, mesh, {pattern: ("mlp", None)}, rules)
        assert specs.groups[1].layers[0].weight.spec == P("model", None)
        assert specs.groups[1].layers[1].weight.spec == P()  # unnamed
    # Globs around them, and character classes where paths have none.
    axes = {"groups[1].*.weight": ("mlp", None)}
    specs = sharding.logical_shardings(chain, mesh, axes, rules)
    assert specs.groups[1].layers[1].weight.spec == P("model", None)
    mlp = eqxscan.StackedMLP(4, 2, key=getkey())
    specs = sharding.logical_shardings(mlp, mesh, {"*.w[12]": (None, "mlp")}, rules)
    assert specs.blocks.layers.w2.spec == P(None, None, "model")
