"""Adapted models in files and what the arrays do not say: the state-dict names
`add_lora` gives, a LoRA's `alpha` recorded by `eqxscan.save` and checked on
loading, and the opt-in run-time check of a traced adapter id."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan
from eqxscan import adapters, quant


TARGETS = ["blocks.*.w1", "blocks.*.w2"]


def _adapted(seed, alpha, k=2):
    model = eqxscan.StackedMLP(8, 2, key=jax.random.key(seed))
    model = adapters.add_lora(
        model, TARGETS, rank=2, alpha=alpha, num_adapters=k, key=jax.random.key(1)
    )
    # Nonzero b, so that alpha changes the output.
    is_lora = lambda x: isinstance(x, adapters.LoRA)  # noqa: E731
    return jax.tree.map(
        lambda x: (
            eqx.tree_at(lambda lo: lo.b, x, jnp.full_like(x.b, 0.1))
            if is_lora(x)
            else x
        ),
        model,
        is_leaf=is_lora,
    )


def test_add_lora_renames_each_adapted_weight_base_a_and_b():
    plain = eqxscan.to_state_dict(eqxscan.StackedMLP(8, 2, key=jax.random.key(0)))
    names = eqxscan.to_state_dict(_adapted(0, 4.0))
    for i in range(2):
        for w in ("w1", "w2"):
            assert f"blocks.{i}.{w}" in plain and f"blocks.{i}.{w}" not in names
            np.testing.assert_array_equal(
                names[f"blocks.{i}.{w}.base"], plain[f"blocks.{i}.{w}"]
            )
            assert names[f"blocks.{i}.{w}.a"].shape[0] == 2  # [K, ...]
            assert f"blocks.{i}.{w}.b" in names
    assert set(names) - {n for n in names if n.endswith((".base", ".a", ".b"))} == {
        "blocks.0.scale",
        "blocks.1.scale",
    }


def test_the_active_id_is_saved_only_once_traced(tmp_path):
    # docs/adapters.md: an int id is not saved; a traced one is an array leaf,
    # saved, and the file then needs a concrete select before saving.
    model = _adapted(0, 4.0)
    arrays, static = eqx.partition(model, eqx.is_array)
    pick = jax.jit(
        lambda a, i: eqx.filter(
            adapters.select(eqx.combine(a, static), i), eqx.is_array
        )
    )
    traced = eqx.combine(pick(arrays, jnp.int32(1)), static)
    assert not [k for k in eqxscan.to_state_dict(model) if k.endswith(".active")]
    names = [k for k in eqxscan.to_state_dict(traced) if k.endswith(".active")]
    assert names == [f"blocks.{i}.{w}.active" for i in range(2) for w in ("w1", "w2")]
    eqxscan.save(tmp_path / "traced.safetensors", traced)
    with pytest.raises(ValueError, match="unexpected keys: 'blocks.0.w1.active'"):
        eqxscan.load(tmp_path / "traced.safetensors", model)
    eqxscan.save(tmp_path / "m.safetensors", adapters.select(traced, 1))
    loaded = eqxscan.load(tmp_path / "m.safetensors", model)
    x = jnp.ones(8)
    np.testing.assert_allclose(
        adapters.select(loaded, 1)(x), traced(x), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("adapters_only", [False, True])
def test_alpha_is_saved_and_a_model_of_another_alpha_is_refused(
    tmp_path, adapters_only
):
    model = _adapted(0, 8.0)
    keep = (lambda m: eqx.filter(m, adapters.trainable(m))) if adapters_only else None
    path = tmp_path / "model.safetensors"
    eqxscan.save(path, keep(model) if keep else model)
    x = jnp.linspace(-1, 1, 24).reshape(3, 8)
    for alpha in (8.0, 2.0):
        fresh = _adapted(1, alpha)
        like = keep(fresh) if keep else fresh
        if alpha == 8.0:
            loaded = eqxscan.load(path, like)
            if keep:
                loaded = eqx.combine(loaded, fresh)
                model = eqx.combine(keep(model), fresh)
            np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)
            continue
        with pytest.raises(ValueError) as e:
            eqxscan.load(path, like)
        msg = str(e.value)
        assert "`blocks.*.w1`" in msg and "alpha=8.0" in msg and "alpha=2.0" in msg
        assert "and 1 other weight(s)" in msg  # w2
        assert msg.splitlines()[1].startswith("Hint: build like")
        assert "add_lora(..., alpha=8.0)" in msg


def test_a_quantized_base_under_adapters_keeps_its_alpha_checked(tmp_path):
    base = quant.quantize(eqxscan.StackedMLP(8, 2, key=jax.random.key(0)), TARGETS)
    model = adapters.add_lora(
        base, "blocks.*.w1", rank=2, alpha=3.0, key=jax.random.key(1)
    )
    quant.save(tmp_path / "q.safetensors", model)
    other = adapters.add_lora(
        base, "blocks.*.w1", rank=2, alpha=1.0, key=jax.random.key(1)
    )
    assert eqx.tree_equal(quant.load(tmp_path / "q.safetensors", model), model)
    with pytest.raises(ValueError, match=r"saved with alpha=3\.0.*has alpha=1\.0"):
        quant.load(tmp_path / "q.safetensors", other)


def test_a_file_without_the_record_loads_unchecked(tmp_path):
    # Another writer's file (the arrays alone): nothing says which alpha.
    import safetensors.numpy

    path = tmp_path / "model.safetensors"
    state = {
        k: np.asarray(v) for k, v in eqxscan.to_state_dict(_adapted(0, 8.0)).items()
    }
    safetensors.numpy.save_file(state, path)
    loaded = eqxscan.load(path, _adapted(1, 2.0))
    assert loaded.blocks.layers.w1.alpha == 2.0


def _served(model, ids, check):
    x = jnp.ones((len(ids), 8))
    row = lambda x, i: adapters.select(model, i, check=check)(x)  # noqa: E731
    return eqx.filter_jit(jax.vmap(row))(x, ids)


def test_a_traced_id_out_of_range_selects_the_base_unless_checked():
    model = _adapted(0, 4.0, k=2)
    base = adapters.select(model, -1)(jnp.ones((1, 8)))
    # Unchecked, 2 and -5 silently give the base alone.
    out = _served(model, jnp.array([2, -5, 1]), check=False)
    np.testing.assert_allclose(out[:2], jnp.concatenate([base, base]), rtol=1e-6)
    assert not np.allclose(out[2], base[0])
    # Checked, ids in [-1, K) run as before; one outside raises naming K.
    ok = _served(model, jnp.array([-1, 0, 1]), check=True)
    np.testing.assert_allclose(ok, _served(model, jnp.array([-1, 0, 1]), False))
    for bad in (2, -2):
        with pytest.raises(eqx.EquinoxRuntimeError, match=r"outside \[-1, 2\)"):
            jax.block_until_ready(_served(model, jnp.array([0, bad]), check=True))
