import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqxscan

from .helpers import tree_allclose


ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "transformer.py"


@pytest.fixture(scope="module")
def tf():
    spec = importlib.util.spec_from_file_location("transformer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small(tf, layers, key, window=2):
    return tf.Transformer(
        dim=16, layers=layers, heads=2, window=window, max_len=10, key=key
    )


@pytest.mark.parametrize("layers", [4, 3])
def test_cached_decoding_matches_recompute(tf, layers, getkey):
    model = small(tf, layers, getkey())
    if layers == 4:  # global, local, global, local: one scan over two repeats
        assert [tuple(s) for s in model.blocks.layout] == [(0, 4, 2)]
    seq, n, _ = tf.make_batch(getkey(), 8, 4)
    batched = lambda f: eqx.filter_jit(jax.vmap(f, in_axes=(None, 0, 0)))
    tokens, logits = batched(tf.generate)(model, seq, n + 1)
    ref_tokens, ref_logits = batched(tf.generate_by_recompute)(model, seq, n + 1)
    assert jnp.array_equal(tokens, ref_tokens)
    assert tree_allclose(logits, ref_logits, rtol=1e-4, atol=1e-5)
    # The prompt is kept and something was generated after it.
    t = jnp.arange(seq.shape[1])[None, :]
    assert jnp.all(jnp.where(t <= n[:, None], tokens == seq, True))
    # Step logits are the full forward pass's logits at every position.
    full = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(model, tokens[:, :-1])
    assert tree_allclose(logits, full, rtol=1e-4, atol=1e-5)


def test_prefill_then_step_matches_full_forward(tf, getkey):
    model = small(tf, 4, getkey())
    tokens = jr.randint(getkey(), (10,), 0, tf.VOCAB)
    decode = eqx.filter_jit(type(model).decode)
    cache = model.init_cache()
    head, cache = decode(model, tokens[:6], jnp.asarray(0), cache)
    tail = []
    for pos in range(6, 10):
        out, cache = decode(model, tokens[pos : pos + 1], jnp.asarray(pos), cache)
        tail.append(out)
    got = jnp.concatenate([head, *tail])
    assert tree_allclose(got, model(tokens), rtol=1e-4, atol=1e-5)
    # Every layer's cache holds the keys of all 10 positions, written in place.
    assert cache[0].shape == (4, 10, 2, 8)
    assert not jnp.any(jnp.all(cache[0] == 0, axis=(2, 3)))


def test_cache_is_preallocated_and_updated_in_the_scan(tf, getkey):
    model = small(tf, 4, getkey())
    cache = model.init_cache()
    jaxpr = jax.make_jaxpr(model.decode)(jnp.zeros(1, jnp.int32), jnp.asarray(3), cache)
    text = str(jaxpr)
    # Each layer writes its slice of the cache in place ...
    updates = re.findall(r"f32\[([\d,]+)\] = dynamic_update_slice", text)
    assert updates and set(updates) == {"10,2,8"}
    # ... and the cache never grows: the only joins assemble per-layer outputs
    # along the layer axis, at the full length 10.
    for shape, dim in re.findall(
        r"f32\[([\d,]+)\] = concatenate\[dimension=(\d+)", text
    ):
        assert dim == "0" and shape.endswith(",10,2,8")
    _, new_cache = jax.eval_shape(
        model.decode, jnp.zeros(1, jnp.int32), jnp.asarray(3), cache
    )
    assert [c.shape for c in new_cache] == [c.shape for c in cache]


def test_local_attention_differs_from_global(tf, getkey):
    # The window matters (so local and global blocks really are different).
    key = getkey()
    tokens = jr.randint(getkey(), (10,), 0, tf.VOCAB)
    local = small(tf, 4, key, window=2)(tokens)
    glob = small(tf, 4, key, window=0)(tokens)
    assert not jnp.allclose(local[4:], glob[4:], atol=1e-3)
    assert jnp.allclose(local[:2], glob[:2], atol=1e-5)  # within the window


def test_all_global_blocks_form_one_scanned_run(tf, getkey):
    # All-global blocks collapse to one scanned run; results agree with a loop.
    model = small(tf, 3, getkey(), window=0)
    assert isinstance(model.blocks.groups[0], eqxscan.Stacked)
    tokens = jr.randint(getkey(), (10,), 0, tf.VOCAB)
    logits, _ = model.decode(tokens, jnp.asarray(0), model.init_cache())
    looped = model.blocks.with_options(mode="loop")
    x = model.embed[tokens] + model.positions
    for layer in looped.unstack():
        x = layer(x)
    assert tree_allclose(logits, model._logits(x), rtol=1e-4, atol=1e-5)


def test_example_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--steps=3",
            "--dim=16",
            "--layers=2",
            "--batch=8",
            "--samples=2",
            "--max-word=4",  # short words: the checks below hold at any length
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "trained 3 steps" in out
    assert "tokens identical: True" in out
    assert "held-out words" in out
    assert out.count(">") >= 2  # the printed samples
