"""Several adapters in one batch while decoding: each row of a batch uses its own
adapter (or the base alone) through prefill and greedy decode steps with the
per-layer KV caches updated in place, against each row run alone."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import eqxscan
from eqxscan import adapters

from .test_adapters import _random_b
from .test_buffers import Attn, cache_of, D


V, L, T, K = 16, 2, 32, 3


class Decoder(eqx.Module):
    """Embedding, a stack of cached attention layers (`x @ wqkv`, `o @ wo`), head."""

    embed: jax.Array
    blocks: eqxscan.Stacked[Attn]
    head: jax.Array

    def __init__(self, *, key):
        k1, k2, k3 = jr.split(key, 3)
        self.embed = jr.normal(k1, (V, D))
        self.blocks = eqxscan.Stacked(lambda k: Attn(key=k), L, key=k2)
        self.head = jr.normal(k3, (D, V))

    def __call__(self, tokens, cache, pos):
        x, cache = self.blocks(self.embed[tokens], eqxscan.buffer(cache), pos=pos)
        return x @ self.head, cache


def _generate(step, model, ids, prompts, cache, steps):
    """Prefill the prompts, then `steps` greedy tokens: the logits of each call
    and the tokens chosen."""
    p = prompts.shape[-1]
    logits, cache = step(model, ids, prompts, cache, jnp.int32(0))
    out, tokens = [logits], []
    for n in range(steps):
        token = jnp.argmax(logits[..., -1:, :], axis=-1).astype(jnp.int32)
        tokens.append(token)
        logits, cache = step(model, ids, token, cache, jnp.int32(p + n))
        out.append(logits)
    return out, tokens, cache


def _batched(model, ids, tokens, cache, pos):
    def row(i, t, c):
        return adapters.select(model, i)(t, c, pos)

    return jax.vmap(row)(ids, tokens, cache)


def test_mixed_adapters_decode_as_each_alone():
    base = Decoder(key=jr.key(0))
    model = adapters.add_lora(
        base, ["blocks.*.wqkv", "blocks.*.wo"], rank=2, num_adapters=K, key=jr.key(1)
    )
    model = _random_b(model, jr.key(2))
    ids = jnp.array([0, 2, -1, 1], jnp.int32)
    b = ids.shape[0]
    prompts = jr.randint(jr.key(3), (b, 3), 0, V, jnp.int32)
    # The arrays as arguments (a LoRA's `inference` flag is a Python bool).
    static = eqx.filter(model, eqx.is_array, inverse=True)
    step = jax.jit(
        lambda m, *args: _batched(eqx.combine(m, static), *args), donate_argnums=3
    )
    logits, tokens, _ = _generate(
        step, eqx.filter(model, eqx.is_array), ids, prompts, cache_of(T, (b, L)), 3
    )

    # Each row alone, on the loop over the same layers: an adapter chosen by
    # id, or the model without LoRAs.
    def alone(m, i, t, c, pos):
        return (m if i is None else adapters.select(m, i))(t, c, pos)

    one = eqx.filter_jit(alone)
    for r, k in enumerate(ids.tolist()):
        m = base if k == -1 else model
        m = eqx.tree_at(lambda m: m.blocks, m, m.blocks.with_options(mode="loop"))
        k = None if k == -1 else jnp.int32(k)
        got = _generate(one, m, k, prompts[r], cache_of(T, (L,)), 3)
        for ours, theirs in zip(logits, got[0], strict=True):
            np.testing.assert_allclose(ours[r], theirs, rtol=1e-5, atol=1e-5)
        for ours, theirs in zip(tokens, got[1], strict=True):
            np.testing.assert_array_equal(ours[r], theirs)
    # The adapters matter: every row's logits differ from the base's.
    base_rows = step(
        eqx.filter(base_as_adapted(model), eqx.is_array),
        ids,
        prompts,
        cache_of(T, (b, L)),
        jnp.int32(0),
    )
    diff = jnp.max(jnp.abs(base_rows[0] - logits[0]), axis=(1, 2))
    assert jnp.all((diff > 1e-3) == (ids >= 0))

    # In place: the donated cache is aliased to the new one and no step holds a
    # copy of it (XLA's own analysis), and the donated input is consumed.
    cache = cache_of(T, (b, L))
    nbytes = sum(a.nbytes for a in cache)
    token = tokens[0]
    arrays = eqx.filter(model, eqx.is_array)
    compiled = step.lower(arrays, ids, token, cache, jnp.int32(3)).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes == nbytes
    # The base model's batched step: its temporaries (on CPU each layer's slice
    # is read through a copy) plus the rows' gathered adapters and their
    # products, well below a second cache.
    plain = jax.jit(
        lambda m, t, c, p: jax.vmap(lambda t, c: m(t, c, p))(t, c), donate_argnums=2
    )
    args = (token, cache_of(T, (b, L)), jnp.int32(3))
    base_memory = plain.lower(base, *args).compile().memory_analysis()
    assert base_memory.alias_size_in_bytes == nbytes
    assert memory.temp_size_in_bytes <= base_memory.temp_size_in_bytes + nbytes // 4
    _, new = step(arrays, ids, token, cache, jnp.int32(3))
    assert all(a.is_deleted() for a in cache)
    assert jax.tree.structure(new) == jax.tree.structure(cache)
    assert step._cache_size() == 2  # a prefill and a decode step


def base_as_adapted(model):
    """`model` with every adapter's `b` zero: each adapter then gives the base."""
    is_lora = lambda x: isinstance(x, adapters.LoRA)  # noqa: E731
    loras = [x for x in jax.tree.leaves(model, is_leaf=is_lora) if is_lora(x)]
    return eqx.tree_at(
        lambda m: [x.b for x in jax.tree.leaves(m, is_leaf=is_lora) if is_lora(x)],
        model,
        [jnp.zeros_like(lo.b) for lo in loras],
    )


def test_benchmark_smoke(monkeypatch, capsys):
    # benchmarks/adapters.py --tiny, in this process: it runs, and its numbers
    # are the arrays' own (the LoRA model's bytes against K copies of the base;
    # Adam's state against the adapters and the model) and jax's compile counts.
    import re

    from benchmarks import adapters as bench

    monkeypatch.setattr("sys.argv", ["adapters", "--tiny"])
    with jax.numpy_dtype_promotion("standard"):  # optax's int32 step count
        bench.main()
    memory, train, decode, compiles = capsys.readouterr().out.split("\n\n")
    rows = {int(r.split()[0]): r.split()[1:] for r in memory.splitlines()[2:]}
    assert sorted(rows) == [1, 2]
    model = eqxscan.StackedMLP(16, 2, key=jr.key(0))
    base = sum(a.nbytes for a in jax.tree.leaves(model) if eqx.is_array(a))
    assert float(rows[2][1]) == round(2 * base / 2**20, 2)
    assert float(rows[2][0]) < float(rows[2][1])

    # Adam keeps two moments of what it trains: the adapters, or the model.
    lora = adapters.add_lora(model, ["*.w1", "*.w2"], rank=2, key=jr.key(1))
    params = eqx.filter(lora, adapters.trainable(lora))
    adapter = sum(a.nbytes for a in jax.tree.leaves(params))
    steps = {r.split()[0]: r.split()[1:] for r in train.splitlines()[2:4]}
    assert float(steps["lora"][3]) == round((2 * adapter + 4) / 2**20, 3)
    assert float(steps["full"][3]) == round((2 * base + 4) / 2**20, 3)
    assert float(steps["lora"][4]) == round(adapter / 2**20, 3)
    assert "LoRA's Adam state: 2.00x the adapters' bytes (+ 4 B" in train
    times = {r.split()[0]: float(r.split()[1]) for r in decode.splitlines()[2:5]}
    assert sorted(times) == ["base", "mixed", "single"]
    assert all(t > 0 for t in times.values())
    # Every step compiled once over all its calls, the mixed decode step too,
    # although each call had new adapter ids.
    counts = dict(re.findall(r"(\w+_step) (\d+)", compiles))
    assert len(counts) == 5 and set(counts.values()) == {"1"}
