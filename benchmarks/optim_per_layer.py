"""`eqxscan.optim.layerwise`: equality with the unstacked model, and step time.

    python benchmarks/optim_per_layer.py [equality|time|all]

- `equality`: the largest difference between any parameter of a stacked model
  and of the same layers kept in a list, after 20 training steps on the same
  data, with `layerwise(tx)` on the stacked model and without it, for each
  transformation, on a StackedMLP-style stack and a Transformer block stack,
  each as a `Stacked` and as a `Chain` (two repeats of `block, block, dense`:
  a stack of units, each holding a stack of two blocks).
- `time`: the step time of a `StackedMLP` (L=16, D=256) trained with
  `layerwise(optax.adamw)` against plain `optax.adamw`, warmed up, timed in
  interleaved repeats; the median of each and the median of the paired ratios,
  for the whole train step and for the optimiser update alone.

Prints Markdown tables; writes nothing.
"""

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxscan
from eqxscan.optim import layerwise


DIM, LAYERS, SEQ, STEPS = 32, 4, 8, 20


class Attention(eqx.Module):
    """A pre-norm Transformer block on `[T, D]` (attention, then a GELU MLP)."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(4, DIM, key=k1)
        self.ln2 = eqx.nn.LayerNorm(DIM)
        self.mlp_in = eqx.nn.Linear(DIM, 4 * DIM, key=k2)
        self.mlp_out = eqx.nn.Linear(4 * DIM, DIM, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class Dense(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        self.linear = eqx.nn.Linear(DIM, DIM, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(jax.vmap(self.linear)(x))


class Net(eqx.Module):
    """An unstacked embedding, then a body: a `Stacked`, a `Chain` or a list."""

    embed: eqx.nn.Linear
    body: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed)(x)
        if isinstance(self.body, list):
            for layer in self.body:
                x = layer(x)
            return x
        return self.body(x)


def mlp(key: jax.Array) -> eqxscan.MLPBlock:
    return eqxscan.MLPBlock(DIM, key=key)


def models(block: Callable, kind: str, key: jax.Array) -> tuple[Net, Net]:
    """A stacked model and the same weights with its body as a list."""
    k0, k1 = jax.random.split(key)
    embed = eqx.nn.Linear(DIM, DIM, key=k0)
    if kind == "Stacked":
        body = eqxscan.Stacked(block, LAYERS, key=k1)
    else:
        keys = jax.random.split(k1, 6)
        body = eqxscan.Chain(
            [Dense(k) if i % 3 == 2 else block(k) for i, k in enumerate(keys)]
        )
    return Net(embed, body), Net(embed, body.unstack())


def loss(model: Net, x: jax.Array) -> jax.Array:
    return 10.0 * jnp.mean(jnp.tanh(model(x)) ** 2)


# Compiled once per model structure: only the update is compiled per
# transformation.
grads_of = eqx.filter_jit(eqx.filter_grad(loss))


def train(model: Net, tx: optax.GradientTransformation, xs: jax.Array) -> Net:
    @eqx.filter_jit
    def step(model, state, grads):
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    for x in xs:
        model, state = step(model, state, grads_of(model, x))
    return model


def flat(model: Net) -> list[jax.Array]:
    """The model's arrays, its body as the list of layers."""
    body = model.body if isinstance(model.body, list) else model.body.unstack()
    return jax.tree.leaves(eqx.filter(Net(model.embed, body), eqx.is_inexact_array))


def gap(a: Net, b: Net) -> float:
    return max(
        float(jnp.max(jnp.abs(u - v))) for u, v in zip(flat(a), flat(b), strict=True)
    )


def ndim_mask(params: Any) -> Any:
    return jax.tree.map(lambda a: a.ndim >= 2, params)


TRANSFORMS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adamw, `ndim >= 2` decay mask": lambda: optax.adamw(
        1e-2, weight_decay=0.1, mask=ndim_mask
    ),
    "lamb": lambda: optax.lamb(1e-2, weight_decay=0.1),
    "lars": lambda: optax.lars(1.0, weight_decay=0.1),
    "adafactor (factored from 16)": lambda: optax.adafactor(
        1e-2, min_dim_size_to_factor=16
    ),
    "contrib.muon": lambda: optax.contrib.muon(1e-2),
    "clip_by_block_rms, sgd": lambda: optax.chain(
        optax.clip_by_block_rms(1e-3), optax.sgd(1.0)
    ),
}
CLIPPED = "clip_by_global_norm(1) outside, adamw"


def wrap(tx: optax.GradientTransformation, name: str) -> Any:
    """`tx`, after a global-norm clip in the row that has one."""
    return optax.chain(optax.clip_by_global_norm(1.0), tx) if name == CLIPPED else tx


def equality() -> None:
    xs = jax.random.normal(jax.random.key(1), (STEPS, SEQ, DIM))
    cases = [
        (name, block, kind)
        for name, block in (("MLP", mlp), ("Transformer", Attention))
        for kind in ("Stacked", "Chain")
    ]
    print(
        f"Max abs parameter difference from the unstacked model after {STEPS} "
        f"steps (fp32, D={DIM}, {LAYERS} stacked layers or a Chain of 6): "
        "`layerwise(tx)` / plain `tx` on the stacked model.\n"
    )
    print("| transformation | " + " | ".join(f"{b} {k}" for b, _, k in cases) + " |")
    print("|---" * (len(cases) + 1) + "|")
    built = [models(block, kind, jax.random.key(0)) for _, block, kind in cases]
    rows = dict(TRANSFORMS)
    rows[CLIPPED] = lambda: optax.adamw(1e-2, weight_decay=0.1)
    for name, make in rows.items():
        cells = []
        for stacked, unstacked in built:
            want = train(unstacked, wrap(make(), name), xs)
            fixed = gap(train(stacked, wrap(layerwise(make()), name), xs), want)
            plain = gap(train(stacked, wrap(make(), name), xs), want)
            cells.append(f"{fixed:.1e} / {plain:.1e}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def timing(repeats: int = 21, steps: int = 5) -> None:
    dim, layers, tokens = 256, 16, 64
    model = eqxscan.StackedMLP(dim, layers, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (tokens, dim))

    def mse(m: eqxscan.StackedMLP) -> jax.Array:
        return jnp.mean(m(x) ** 2)

    runs = {}
    for name, tx in (
        ("adamw", optax.adamw(1e-3, weight_decay=0.1)),
        ("layerwise(adamw)", layerwise(optax.adamw(1e-3, weight_decay=0.1))),
    ):

        @eqx.filter_jit
        def train_step(model, state, tx=tx):
            grads = eqx.filter_grad(mse)(model)
            updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        @eqx.filter_jit
        def update(model, state, grads, tx=tx):
            updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        state = tx.init(eqx.filter(model, eqx.is_inexact_array))
        grads = eqx.filter_grad(mse)(model)
        runs[name] = (train_step, update, state, grads)

    def time_one(name: str, which: int) -> float:
        train_step, update, state, grads = runs[name]
        m = model
        start = time.perf_counter()
        for _ in range(steps):
            if which == 0:
                m, state = train_step(m, state)
            else:
                m, state = update(m, state, grads)
        jax.block_until_ready((m, state))
        return (time.perf_counter() - start) / steps

    for name in runs:  # warm-up: compile and run both programs
        time_one(name, 0)
        time_one(name, 1)
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats):
        for which in (0, 1):
            # Alternate which goes first, so neither always follows the other.
            for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
                times.setdefault((name, which), []).append(time_one(name, which))
    print(
        f"\nStep time, StackedMLP L={layers}, D={dim}, {tokens} tokens, CPU, one "
        f"process ({jax.device_count()} device): median of {repeats} interleaved "
        f"repeats of {steps} steps; ratio: median of the per-repeat ratios.\n"
    )
    print("| program | adamw (ms) | layerwise(adamw) (ms) | ratio |")
    print("|---|---|---|---|")
    for which, label in ((0, "train step (grad + update)"), (1, "update alone")):
        base, ours = times[("adamw", which)], times[("layerwise(adamw)", which)]
        # Each repeat times the two back to back: the median of their ratios
        # cancels the drift of a busy machine.
        ratio = statistics.median(o / b for o, b in zip(ours, base, strict=True))
        print(
            f"| {label} | {statistics.median(base) * 1e3:.2f} | "
            f"{statistics.median(ours) * 1e3:.2f} | {ratio:.3f} |"
        )


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("equality", "all"):
        equality()
    if what in ("time", "all"):
        timing()
