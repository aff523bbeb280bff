import importlib.util
import os
import pathlib
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


def generation(tf, chunk=5):
    """The example's batched generation, compiled once; `traces` counts
    compilations."""
    traces = []

    @eqx.filter_jit
    def run(model, prompts, lengths, limit):
        traces.append(1)
        return tf.generate(model, prompts, lengths, limit, chunk=chunk)

    return run, traces


def prompts_of(tf, key, batch=16, max_word=4):
    seq, n, _ = tf.make_batch(key, batch, max_word)
    t = jnp.arange(seq.shape[1])[None, :]
    return jnp.where(t <= n[:, None], seq, tf.PAD), n + 1


@pytest.mark.parametrize("layers", [4, 3])
def test_generation_matches_recompute(tf, layers, getkey):
    model = small(tf, layers, getkey())
    if layers == 4:  # global, local, global, local: one scan over two repeats
        assert [tuple(s) for s in model.blocks.layout] == [(0, 4, 2)]
    run, traces = generation(tf)
    recompute = eqx.filter_jit(tf.generate_by_recompute)
    forward = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))
    for key, limit in ((getkey(), 10), (getkey(), 8)):
        prompts, lengths = prompts_of(tf, key)
        tokens, n, logits = run(model, prompts, lengths, jnp.asarray(limit))
        ref_tokens, ref_n = recompute(model, prompts, lengths, jnp.asarray(limit))
        assert jnp.array_equal(tokens, ref_tokens)
        assert jnp.array_equal(n, ref_n)
        # The prompt is kept; each sequence stopped at its first END after the
        # prompt or at the limit, and nothing was written past its length.
        t = jnp.arange(tokens.shape[1])[None, :]
        assert jnp.all(jnp.where(t < lengths[:, None], tokens == prompts, True))
        assert jnp.all(jnp.where(t >= n[:, None], tokens == tf.PAD, True))
        new_end = (tokens == tf.END) & (t >= lengths[:, None]) & (t < n[:, None] - 1)
        assert not jnp.any(new_end)
        stopped = (tokens[jnp.arange(16), n - 1] == tf.END) | (n == limit)
        assert jnp.all(stopped & (n <= limit) & (n > lengths))
        # Every step's logits are the full forward pass's at that position.
        full = forward(model, tokens)
        seen = (t < n[:, None] - 1)[..., None]
        assert tree_allclose(
            jnp.where(seen, logits, 0), jnp.where(seen, full, 0), rtol=1e-5, atol=1e-5
        )
    # Prompt lengths, limits and numbers of generated tokens: one program.
    assert len(traces) == 1


def test_chunked_prefill_then_steps_fill_each_cache(tf, getkey):
    model = small(tf, 4, getkey())  # windows of 2: ring buffers of 2 positions
    tokens = jr.randint(getkey(), (10,), 0, tf.VOCAB)
    decode = eqx.filter_jit(type(model).decode)
    cache = model.init_cache()
    # Two prefill chunks of 5 (the second holding 2 real tokens), then steps.
    out = [decode(model, tokens[:5], jnp.asarray(0), cache, jnp.asarray(5))]
    out[0], cache = out[0]
    head, cache = decode(model, jnp.r_[tokens[5:7], 0, 0, 0], 5, cache, 2)
    out.append(head[:2])
    for pos in range(7, 10):
        step, cache = decode(model, tokens[pos : pos + 1], jnp.asarray(pos), cache)
        out.append(step)
    assert tree_allclose(jnp.concatenate(out), model(tokens), rtol=1e-5, atol=1e-5)
    # Each layer's cache holds the keys of the positions it keeps: all 10 for a
    # global layer, the last 2 (at slot position % 2) for a window layer.
    x = model.embed[tokens] + model.positions
    for i, block in enumerate(model.blocks.unstack()):
        keys = block._qkv(x)[1]
        want = keys if block.window is None else keys[jnp.array([8, 9])]
        assert tree_allclose(cache.layer(i)[0], want, rtol=1e-5, atol=1e-5)
        x = block(x)


def test_caches_of_their_own_size_updated_in_place(tf, getkey):
    model = small(tf, 4, getkey())
    cache = model.init_cache()
    shapes = [cache.layer(i)[0].shape for i in range(4)]
    assert shapes == [(10, 2, 8), (2, 2, 8)] * 2  # global, window, global, window
    assert cache.nbytes == 2 * 4 * (2 * 10 + 2 * 2) * 2 * 8  # not L x T

    def memory(model):
        params, static = eqx.partition(model, eqx.is_array)
        step = lambda p, c: eqx.combine(p, static).decode(jnp.zeros(1, jnp.int32), 3, c)
        compiled = jax.jit(step, donate_argnums=1).lower(params, cache).compile()
        return compiled.memory_analysis()

    scanned = memory(model)
    looped = memory(
        eqx.tree_at(lambda m: m.blocks, model, model.blocks.with_options(mode="loop"))
    )
    # The donated caches are the output caches, and the scanned step needs no
    # more scratch than the loop over the layers plus one layer's cache.
    assert scanned.alias_size_in_bytes == looped.alias_size_in_bytes == cache.nbytes
    one_layer = 2 * 4 * 10 * 2 * 8
    assert scanned.temp_size_in_bytes <= looped.temp_size_in_bytes + one_layer


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
    env["XLA_FLAGS"] = os.environ.get("EQXSCAN_TEST_XLA_FLAGS", "")  # one device
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--tiny",  # 3 steps, 2 blocks, short words: the checks hold at any length
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
    assert "compiled programs: 1" in out
    assert "held-out words" in out
    assert out.count(">") >= 2  # the printed samples
